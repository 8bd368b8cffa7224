"""accept(target_probs=..., draft_probs=...): the laws given as probabilities, as engines hand them over.

A row of probabilities means what the logits log(probs) mean: zeros are impossible tokens, rows need not be
normalized (each row here is scaled by its own random factor), and temperature t reshapes a row as probs^(1/t).
Checked on every CPU backend: the sampled law (chi-square over the first two tokens on the Markov harness,
with draft probabilities on a tree, given proposals on a chain, traversal and block verification, every
filter), greedy results equal to those from logits, tokens of probability 0 never emitted or accepted, and
the errors of bad probabilities.
"""
from __future__ import annotations

import pytest
import torch

import specdec
from tests.helpers import DEVICE, accept_on
from tests.stats import assert_law, emitted_tokens, first_tokens
from tests.test_accept_lossless import CHAIN, FILTERS, M, MARKOV_TREE, _markov_step, _two_token_law

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

PROB_BACKENDS = ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else [])
INTERPRETED = DEVICE.type == "cpu"


def samples_for(backend: str) -> int:
    return 600 if backend == "triton" and INTERPRETED else 2000


def _as_probs(batch: dict, gen: torch.Generator) -> dict:
    """The batch with its logits replaced by unnormalized probabilities: exp(logits) times a random factor per
    row in [0.1, 10) (so the kernel must normalize), in the logits' dtype."""
    out = dict(batch)
    for logits_key, probs_key in (("target_logits", "target_probs"), ("draft_logits", "draft_probs")):
        logits = out.pop(logits_key)
        if logits is not None:
            scale = 10.0 ** (torch.rand(*logits.shape[:2], 1, generator=gen) * 2 - 1)
            out[probs_key] = (logits.double().exp() * scale).to(logits.dtype)
    return out


def _first_two(backend, parents, t, with_draft, n, seed, filters=None, method="token"):
    """(n, 2) the first two tokens from state 0 with probabilities as input (a second step where the first
    emits one token)."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + 7919 * seed
    batch = _as_probs(_markov_step(torch.zeros(n, dtype=torch.int64), parents, t, with_draft, gen, filters), gen)
    out = emitted_tokens(accept_on(backend, **batch, seeds=seeds, offset=0, method=method), batch["tokens"])
    first = torch.tensor([o[0] for o in out])
    short = torch.tensor([len(o) == 1 for o in out])
    second = torch.tensor([o[1] if len(o) > 1 else -1 for o in out])
    if short.any():
        step2 = _as_probs(_markov_step(first[short], parents, t, with_draft, gen, filters), gen)
        res2 = accept_on(backend, **step2, seeds=seeds[short], offset=1, method=method)
        second[short] = first_tokens(res2, step2["tokens"])
    return torch.stack([first, second], 1)


@pytest.mark.parametrize("backend", PROB_BACKENDS)
@pytest.mark.parametrize("with_draft,parents,t,method", [
    (True, MARKOV_TREE, 1.0, "token"), (False, CHAIN, 0.8, "token"), (True, MARKOV_TREE, 0.7, "traversal"),
    (True, [-1, 0, 1, 2], 1.5, "block")], ids=["tree_draft", "chain_given", "tree_traversal", "chain_block"])
def test_probabilities_follow_the_markov_target(backend, with_draft, parents, t, method):
    """P_TARGET has a zero (2 -> 2 is impossible): a zero probability is an impossible token, as -inf is."""
    pairs = _first_two(backend, parents, t, with_draft, samples_for(backend), seed=5, method=method)
    assert_law(pairs[:, 0] * M + pairs[:, 1], _two_token_law(t), f"probabilities, {method}, on {backend}")


@pytest.mark.parametrize("backend", PROB_BACKENDS)
def test_probabilities_with_every_filter(backend):
    f = FILTERS["all"]
    pairs = _first_two(backend, MARKOV_TREE, 0.9, True, samples_for(backend), seed=8, filters=f)
    assert_law(pairs[:, 0] * M + pairs[:, 1], _two_token_law(0.9, f), f"probabilities with every filter on {backend}")


def _random_batch(gen, B=6, T=5, V=37, zeros=0.3):
    logits = torch.randn(B, T, V, generator=gen) * 2
    logits[torch.rand(B, T, V, generator=gen) < zeros] = float("-inf")
    logits[..., 0] = 0.0  # every row keeps a possible token
    draft = logits + torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents = torch.tensor([[-1, 0, 0, 1, 1]] * B)
    return dict(target_logits=logits, draft_logits=draft, tokens=tokens, parents=parents, seeds=torch.arange(B))


@pytest.mark.parametrize("backend", PROB_BACKENDS)
def test_greedy_from_probabilities_equals_greedy_from_logits(backend):
    gen = torch.Generator().manual_seed(2)
    batch = _random_batch(gen)
    batch["tokens"][:, 1:] = batch["target_logits"][:, :-1].argmax(-1)  # paths that go deep
    from_logits = accept_on(backend, **batch, temperature=0.0)
    from_probs = accept_on(backend, **_as_probs(batch, gen), temperature=0.0)
    assert all(torch.equal(x, y) for x, y in zip(from_logits, from_probs))
    assert int(from_logits.num_accepted.max()) >= 1


@pytest.mark.parametrize("backend", PROB_BACKENDS)
@pytest.mark.parametrize("method", ["token", "traversal"])
def test_tokens_of_probability_zero_are_never_accepted_or_emitted(backend, method):
    gen = torch.Generator().manual_seed(3)
    batch = _random_batch(gen, B=40, zeros=0.6)
    probs = _as_probs(batch, gen)
    impossible = probs["target_probs"] == 0
    res = accept_on(backend, **probs, temperature=1.0, method=method)
    for b in range(40):
        path = res.accepted_nodes[b, : int(res.num_accepted[b]) + 1].tolist()
        for parent, child in zip(path, path[1:]):
            assert not impossible[b, parent, int(batch["tokens"][b, child])]
        assert not impossible[b, path[-1], int(res.next_tokens[b])]


@pytest.mark.parametrize("backend", PROB_BACKENDS)
def test_bad_probabilities(backend):
    gen = torch.Generator().manual_seed(4)
    batch = _random_batch(gen, B=2)
    probs = _as_probs(batch, gen)
    with pytest.raises(TypeError, match="target_probs: give target_logits or target_probs"):
        accept_on(backend, **probs, target_logits=batch["target_logits"])
    with pytest.raises(TypeError, match="draft_logits: goes with target_logits"):
        accept_on(backend, **dict(probs, draft_logits=batch["draft_logits"], draft_probs=None))
    with pytest.raises(TypeError, match="draft_probs: goes with target_probs"):
        accept_on(backend, **dict(batch, draft_probs=probs["draft_probs"], draft_logits=None))
    negative = probs["target_probs"].clone()
    negative[1, 2, 3] = -0.1
    with pytest.raises(ValueError, match="target_probs: contains a negative value"):
        accept_on(backend, **dict(probs, target_probs=negative), temperature=1.0)
    empty = probs["draft_probs"].clone()
    empty[0, 1] = 0.0
    with pytest.raises(ValueError, match="draft_probs: a real node's row is all zeros"):
        accept_on(backend, **dict(probs, draft_probs=empty), temperature=1.0)
    with pytest.raises(ValueError, match="method: 'traversal' needs draft_probs"):
        accept_on(backend, **dict(probs, draft_probs=None), temperature=1.0, method="traversal")
