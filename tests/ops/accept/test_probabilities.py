"""accept(target_probs=..., draft_probs=...): the laws given as probabilities, as engines hand them over.

A row of probabilities means what the logits log(probs) mean: zeros are impossible tokens, rows need not be
normalized (each row here is scaled by its own random factor), and temperature t reshapes a row as probs^(1/t).
Checked on every CPU backend: the sampled law (chi-square over the first two tokens on the Markov harness,
with draft probabilities on a tree, given proposals on a chain, traversal and block verification, every
filter), greedy results equal to those from logits, tokens of probability 0 never emitted or accepted, and
the errors of bad probabilities. The Triton kernel (PROBS: the log of each entry as it is read) on the same
checks where they are cheap in the interpreter, the chi-square on one case, and its results from probabilities
equal to its results from their float32 logs as logits, exactly (same random stream), for every verifier,
the filters, a bitmask, 16-bit probabilities, in the walker and in split launches.
"""
from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

import specdec
from specdec.sampling import pack_bitmask
from tests.helpers import DEVICE, accept_on, to_device
from tests.ops.accept.markov import CHAIN, FILTERS, MARKOV_TREE, generated_tokens, index, two_token_law
from tests.stats import assert_law

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

PROB_BACKENDS = ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else [])
# checks cheap enough in the interpreter also run on the Triton kernel
CHEAP_BACKENDS = PROB_BACKENDS + ["triton"]
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


def _pairs(backend, parents, t, with_draft, n, seed, filters=None, method="token"):
    """(n,) the first two tokens generated from state 0 with probabilities as input (markov.generated_tokens),
    as indices of two_token_law."""
    return index(generated_tokens(functools.partial(accept_on, backend), parents, t, n, seed, 2, with_draft=with_draft,
                                  filters=filters, method=method, prepare=_as_probs))


@pytest.mark.parametrize("backend", PROB_BACKENDS)
@pytest.mark.parametrize("with_draft,parents,t,method", [
    (True, MARKOV_TREE, 1.0, "token"), (False, CHAIN, 0.8, "token"), (True, MARKOV_TREE, 0.7, "traversal"),
    (True, [-1, 0, 1, 2], 1.5, "block")], ids=["tree_draft", "chain_given", "tree_traversal", "chain_block"])
def test_probabilities_follow_the_markov_target(backend, with_draft, parents, t, method):
    """P_TARGET has a zero (2 -> 2 is impossible): a zero probability is an impossible token, as -inf is."""
    pairs = _pairs(backend, parents, t, with_draft, samples_for(backend), seed=5, method=method)
    assert_law(pairs, two_token_law(t), f"probabilities, {method}, on {backend}")


def test_triton_probabilities_follow_the_markov_target():
    """The Triton kernel on the first case above (draft probabilities on a tree: residuals after rejections,
    the candidates' draw): one chi-square, interpreter-sized."""
    pairs = _pairs("triton", MARKOV_TREE, 1.0, True, samples_for("triton"), seed=5)
    assert_law(pairs, two_token_law(1.0), "probabilities, token, on triton")


@pytest.mark.parametrize("backend", PROB_BACKENDS)
def test_probabilities_with_every_filter(backend):
    f = FILTERS["all"]
    pairs = _pairs(backend, MARKOV_TREE, 0.9, True, samples_for(backend), seed=8, filters=f)
    assert_law(pairs, two_token_law(0.9, f), f"probabilities with every filter on {backend}")


def _random_batch(gen, B=6, T=5, V=37, zeros=0.3):
    logits = torch.randn(B, T, V, generator=gen) * 2
    logits[torch.rand(B, T, V, generator=gen) < zeros] = float("-inf")
    logits[..., 0] = 0.0  # every row keeps a possible token
    draft = logits + torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents = torch.tensor([[-1, 0, 0, 1, 1]] * B)
    return dict(target_logits=logits, draft_logits=draft, tokens=tokens, parents=parents, seeds=torch.arange(B))


@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
def test_greedy_from_probabilities_equals_greedy_from_logits(backend):
    gen = torch.Generator().manual_seed(2)
    batch = _random_batch(gen)
    batch["tokens"][:, 1:] = batch["target_logits"][:, :-1].argmax(-1)  # paths that go deep
    from_logits = accept_on(backend, **batch, temperature=0.0)
    from_probs = accept_on(backend, **_as_probs(batch, gen), temperature=0.0)
    assert all(torch.equal(x, y) for x, y in zip(from_logits, from_probs))
    assert int(from_logits.num_accepted.max()) >= 1


@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
@pytest.mark.parametrize("method", ["token", "traversal"])
def test_tokens_of_probability_zero_are_never_accepted_or_emitted(backend, method):
    gen = torch.Generator().manual_seed(3)
    batch = _random_batch(gen, B=16 if backend == "triton" and INTERPRETED else 40, zeros=0.6)
    B = batch["tokens"].shape[0]
    probs = _as_probs(batch, gen)
    impossible = probs["target_probs"] == 0
    res = accept_on(backend, **probs, temperature=1.0, method=method)
    for b in range(B):
        path = res.accepted_nodes[b, : int(res.num_accepted[b]) + 1].tolist()
        for parent, child in zip(path, path[1:]):
            assert not impossible[b, parent, int(batch["tokens"][b, child])]
        assert not impossible[b, path[-1], int(res.next_tokens[b])]


@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
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


# ----------------------------------------------------------------------------------------------
# the Triton kernel: probabilities read as their logs, exactly
# ----------------------------------------------------------------------------------------------
@triton.jit
def _log_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.log(tl.load(x_ptr + i, mask=i < n).to(tl.float32)), mask=i < n)


def _float32_log(x: torch.Tensor) -> torch.Tensor:
    """log(float32(x)) by Triton's own tl.log, the log the kernel takes of each entry it reads (numpy's in the
    interpreter, the GPU's when compiled): logits meaning exactly what the kernel reads the probabilities as."""
    x = to_device(x.contiguous())
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _log_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out.cpu()


def _tree_batch(gen, parents, V=70, B=4, draft_dtype=torch.float32):
    """Probabilities with zeros (30% of the target's entries, every row keeps token 0), a drafter close to the
    target, children drawn from the drafter's law at their parent or (40%) the target's argmax there (deep
    paths, also through filters; the equality tests need no particular law), mixed temperatures (request 1
    greedy)."""
    T = len(parents)
    logits = torch.randn(B, T, V, generator=gen) * 2
    logits[torch.rand(B, T, V, generator=gen) < 0.3] = float("-inf")
    logits[..., 0] = 0.0
    draft = logits.clamp(min=-30.0) + torch.randn(B, T, V, generator=gen)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    for i in range(1, T):
        drawn = torch.multinomial(torch.softmax(draft[:, parents[i]], -1), 1, generator=gen)[:, 0]
        best = torch.rand(B, generator=gen) < 0.4
        tokens[:, i] = torch.where(best, logits[:, parents[i]].argmax(-1), drawn)
    scale = lambda: 10.0 ** (torch.rand(B, T, 1, generator=gen) * 2 - 1)  # noqa: E731  (unnormalized rows)
    return dict(target_probs=(logits.double().exp() * scale()).float(),
                draft_probs=(draft.double().exp() * scale()).to(draft_dtype), tokens=tokens,
                parents=torch.tensor(parents).expand(B, T), temperature=torch.tensor([1.0, 0.0, 0.8, 1.3])[:B],
                seeds=torch.arange(B) + 17)


TREE5 = [-1, 0, 0, 1, 1]
CHAIN5 = [-1, 0, 1, 2, 3]
LOG_CASES = {  # (parents, accept's extra arguments, what the batch changes)
    "token": (TREE5, {}, None),
    "given": (TREE5, {}, "no_draft"),
    "block": (CHAIN5, dict(method="block"), None),
    "traversal": (TREE5, dict(method="traversal"), None),
    "filters": (TREE5, dict(top_k=torch.tensor([5, 0, 3, 8]), top_p=0.9, min_p=torch.tensor([0.02, 0.0, 0.1, 0.0])),
                None),
    "mask": (TREE5, {}, "mask"),
    "bf16_draft": (TREE5, {}, "bf16"),
}
SCHEDULES = {"walker": {}, "split-launches": dict(block_v=16, num_splits=3, split_steps=6)}  # (3 chunks at V 70)


def _valid(res, batch):
    """A root path padded with -1 whose accepted tokens and next token have probability > 0 at their parent (so
    every output element was written: a test of equal outputs cannot pass on two unwritten buffers)."""
    probs = batch["target_probs"]
    B, T = batch["tokens"].shape
    for b in range(B):
        n = int(res.num_accepted[b])
        path = res.accepted_nodes[b, : n + 1].tolist()
        assert 0 <= n < T and path[0] == 0 and res.accepted_nodes[b, n + 1:].eq(-1).all(), res.accepted_nodes[b]
        for prev, node in zip(path, path[1:]):
            assert int(batch["parents"][b, node]) == prev and probs[b, prev, int(batch["tokens"][b, node])] > 0
        assert 0 <= int(res.next_tokens[b]) < probs.shape[-1] and probs[b, path[-1], int(res.next_tokens[b])] > 0


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("case", list(LOG_CASES))
def test_triton_probabilities_are_read_as_their_logs(monkeypatch, case, schedule):
    """PROBS: accept(target_probs=P, draft_probs=Q) on Triton gives exactly what accept(target_logits=log P,
    draft_logits=log Q) gives on Triton (same seeds, the same float32 log): every read of a row (statistics,
    the Z passes, the tested tokens' lookups, the draw's scan, the candidates, the threshold searches, the
    rejected proposals' masses) takes the log; a missed one changes a result here. In the walker alone and in
    split launches (the GPU's schedule: chunks, partials between launches)."""
    from specdec.kernels import accept as kernel
    config = kernel._config
    monkeypatch.setattr(kernel, "_config", lambda *a, **k: {**config(*a, **k), **SCHEDULES[schedule]})
    parents, extra, change = LOG_CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 13 + len(schedule))
    batch = _tree_batch(gen, parents, draft_dtype=torch.bfloat16 if change == "bf16" else torch.float32)
    if change == "no_draft":
        batch["draft_probs"] = None
    if change == "mask":  # ~70% allowed, token 0 always
        allowed = torch.rand(*batch["tokens"].shape, 70, generator=gen) < 0.7
        allowed[..., 0] = True
        batch["token_bitmask"] = pack_bitmask(allowed)
        batch["target_probs"] = batch["target_probs"] * allowed  # (_valid: what the mask drops has probability 0)
    from_probs = accept_on("triton", **batch, **extra)
    logits = {("target_logits" if k == "target_probs" else "draft_logits" if k == "draft_probs" else k):
              (_float32_log(v) if k.endswith("_probs") and v is not None else v) for k, v in batch.items()}
    from_logits = accept_on("triton", **logits, **extra)
    _valid(from_probs, batch)
    assert all(torch.equal(x, y) for x, y in zip(from_probs, from_logits)), (from_probs, from_logits)
    assert int(from_probs.num_accepted.max()) >= 1


@pytest.mark.parametrize("backend", CHEAP_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_greedy_separates_probabilities_an_ulp_apart(backend, dtype):
    """Greedy's argmax is that of the probabilities (the reference's, on float64 logs): 0.0010000003 beats
    0.0010000002 one float32 ulp below it (their float32 logs are one value: the first index won), at the root and
    at the node below it, whose token is that argmax."""
    rows = torch.tensor([[0.0010000002, 0.0010000003, 0.0005]] * 2, dtype=torch.float32).to(dtype)
    assert float(rows[0, 0]) < float(rows[0, 1]) and float(rows[0, :2].float().log().diff().abs()) == 0.0
    res = accept_on(backend, target_probs=rows.view(1, 2, 3), tokens=torch.tensor([[0, 1]]),
                    parents=torch.tensor([[-1, 0]]), temperature=0.0)
    assert res.accepted_nodes.tolist() == [[0, 1]] and res.next_tokens.tolist() == [1], res
