"""What every verifier of accept's draft trees must do, checked for each method that decides jointly: "block"
(chains) and "traversal" (any tree), on every CPU backend that runs it (traversal on the Triton kernel:
test_traversal_triton.py). Each method's own exact law and bookkeeping are in test_block.py / test_traversal.py.

  - lossless: the first two and three tokens generated over steps (tests/ops/accept/markov.py) follow the target's
    Markov law (chi-square), also with every filter and a path-dependent grammar mask (the processed law);
  - not merely lossless: the mean accepted length of one step is the exact one (enumerated), above token-wise's;
  - the chi-square tests bite: the same test rejects each method's known-wrong variants;
  - bad method arguments are errors; greedy requests ignore the method; results are deterministic and
    batch invariant, and the accepted path is a root-to-node path of the tree.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from specdec import reference
from tests.helpers import DEVICE, accept_on
from tests.ops.accept.markov import (BINARY, EXACT_TREES, FILTERS, INTERPRETED_FILTERED_SAMPLES, METHOD_BACKENDS,
                                     P_TARGET, Q_DRAFT, SAMPLED_TREES, V_BATCH, chain, chain_batch, exact_accepted,
                                     generated_tokens, index, k_token_law, markov_step, tree_batch, two_token_law)
from tests.stats import ALPHA, assert_law, chi_square_pvalue

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SAMPLES = 3000
INTERPRETED = DEVICE.type == "cpu"  # the Triton kernel runs in the interpreter: smaller samples, fewer cases
VERIFIER_BACKENDS = [(method, backend) for method, backends in METHOD_BACKENDS.items() for backend in backends]


def samples_for(backend: str) -> int:
    return 800 if backend == "triton" and INTERPRETED else SAMPLES


def slow(backend: str) -> bool:
    """The reference loops in Python and the interpreted Triton kernel is slower still: each runs a few cases."""
    return backend == "torch" or (backend == "triton" and INTERPRETED)


def _generated(backend, method, parents, t, n, seed, k, filters=None):
    return generated_tokens(functools.partial(accept_on, backend), parents, t, n, seed, k, filters=filters,
                            method=method)


# ----------------------------------------------------------------------------------------------
# lossless: chi-square over the first generated tokens
# ----------------------------------------------------------------------------------------------
# method: (case name, parents, temperature, seed) at temperatures 0.5, 1 and 2; the cases the slow backends run
SAMPLED_CASES = {
    "block": [(f"chain{gamma}", chain(gamma), t, 11 + gamma)
              for gamma, t in ((1, 1.0), (2, 0.5), (3, 1.0), (4, 2.0), (5, 1.0))],
    "traversal": [(name, SAMPLED_TREES[name], t, 31 + len(name))
                  for name, t in (("random7", 1.0), ("random9", 0.5), ("star", 2.0), ("chain", 1.0), ("binary", 2.0),
                                  ("random7", 0.5), ("binary", 1.0))],
}
SLOW_CASES = {("block", "torch"): {("chain2", 0.5), ("chain5", 1.0)}, ("block", "triton"): {("chain3", 1.0)},
              ("traversal", "torch"): {("random7", 1.0), ("binary", 2.0)}}

FIRST_TOKEN_CASES = [pytest.param(method, backend, name, parents, t, seed, id=f"{method}-{backend}-{name}-t{t:g}")
                     for method, backend in VERIFIER_BACKENDS for name, parents, t, seed in SAMPLED_CASES[method]
                     if not slow(backend) or (name, t) in SLOW_CASES[method, backend]]


@pytest.mark.parametrize("method,backend,name,parents,t,seed", FIRST_TOKEN_CASES)
def test_first_tokens_follow_the_markov_target(method, backend, name, parents, t, seed):
    """Chains (block) and random trees, stars, chains (traversal) drafted from q: the first two and the first
    three generated tokens follow the target's Markov law (chi-square)."""
    tokens = _generated(backend, method, parents, t, samples_for(backend), seed, k=3)
    assert_law(index(tokens[:, :2]), k_token_law(t, 2), f"{method}, first two tokens, {name}, on {backend}")
    assert_law(index(tokens), k_token_law(t, 3), f"{method}, first three tokens, {name}, on {backend}")


FILTER_CASES = {"block": (chain(3), 21), "traversal": (BINARY, 23)}  # (parents, seed)


@pytest.mark.parametrize("method,backend", VERIFIER_BACKENDS)
def test_every_filter_follows_the_processed_target(method, backend):
    """Top-k, top-p, min-p and a path-dependent grammar mask compose with the verifier: its P and Q are the
    processed laws (the drafter samples from its processed one); the first two tokens follow the processed
    target law."""
    parents, seed = FILTER_CASES[method]
    f = FILTERS["all"]
    n = INTERPRETED_FILTERED_SAMPLES if backend == "triton" and INTERPRETED else SAMPLES
    tokens = _generated(backend, method, parents, 0.9, n, seed, k=2, filters=f)
    assert_law(index(tokens), two_token_law(0.9, f), f"{method} with every filter on {backend}")


# ----------------------------------------------------------------------------------------------
# more accepted tokens than token-wise, exactly as many as the method's law says
# ----------------------------------------------------------------------------------------------
# method: (case name, parents, seed, the least margin of its exact mean over token-wise's)
MEAN_LENGTH_CASES = {"block": [("chain2", chain(2), 7, 0.01), ("chain4", chain(4), 9, 0.01)],
                     "traversal": [("binary", BINARY, 11, 0.005), ("mixed", EXACT_TREES["mixed"], 10, 0.005)]}
SLOW_MEAN_LENGTH_CASES = {("block", "triton"): {"chain4"}}


@pytest.mark.parametrize("method,backend,parents,seed,margin", [
    pytest.param(method, backend, parents, seed, margin, id=f"{method}-{backend}-{name}")
    for method, backend in VERIFIER_BACKENDS for name, parents, seed, margin in MEAN_LENGTH_CASES[method]
    if not (backend == "triton" and INTERPRETED) or name in SLOW_MEAN_LENGTH_CASES[method, backend]])
def test_mean_accepted_length_is_the_exact_one(method, backend, parents, seed, margin):
    """A lossless sampler can still reject too often: the mean accepted length of one step from state 0 is the
    exact expectation (enumerated), within 4 standard errors, and above token-wise's exact one."""
    t, n = 1.0, samples_for(backend)
    gen = torch.Generator().manual_seed(seed)
    batch = markov_step(torch.zeros(n, dtype=torch.int64), parents, t, True, gen)
    res = accept_on(backend, **batch, seeds=torch.arange(n) + 17, offset=0, method=method)
    got = res.num_accepted.double()
    p = torch.softmax(P_TARGET.log() / t, -1)
    q = torch.softmax(Q_DRAFT.log() / t, -1)
    exact, token = exact_accepted(method, p, q, parents), exact_accepted("token", p, q, parents)
    assert abs(float(got.mean()) - exact) < 4 * float(got.std()) / math.sqrt(n), (float(got.mean()), exact)
    assert exact > token + margin, (exact, token)


# ----------------------------------------------------------------------------------------------
# negative controls: the chi-square over the first two tokens rejects known-wrong variants of each method at
# the interpreter's sample size, by a wide margin
# ----------------------------------------------------------------------------------------------
def block_residual_without_correction(p_row, q_row, weight):
    """The next token from the target itself, not block verification's residual."""
    return p_row.clone()


def block_weights_unchained(P, Q, drafted):
    """Token-wise weights p_i = min(P / Q, 1), without block verification's factor p_{i-1}."""
    weights, h = [1.0], []
    for i in range(1, len(drafted) + 1):
        x = drafted[i - 1]
        weights.append(min(float(P[i - 1][x] / Q[i - 1][x]), 1.0) if Q[i - 1][x] > 0 else 1.0)
        if i < len(drafted):
            s = float(torch.clamp(weights[i] * P[i] - Q[i], min=0.0).sum())
            h.append(s / (s + 1.0 - weights[i]) if s + 1.0 - weights[i] > 0 else 1.0)
        else:
            h.append(weights[i])
    return weights, h


_TRAVERSAL_RESIDUAL, _TRAVERSAL_CHILD_WEIGHT = reference.traversal_residual, reference.traversal_child_weight


def traversal_residual_without_correction(w, law_row, q_row):
    """A failed child leaves the node's law as it was (its weight still updated)."""
    return law_row, _TRAVERSAL_RESIDUAL(w, law_row, q_row)[1]


def traversal_child_weight_uncarried(w, law_row, q_row, x):
    """Weights not carried down the path: min(L / Q, 1), as token-wise."""
    return _TRAVERSAL_CHILD_WEIGHT(1.0 if w > 0 else 0.0, law_row, q_row, x)


# (method, the reference's step replaced, the wrong step, the tree)
WRONG_VARIANTS = [("block", "block_residual", block_residual_without_correction, chain(3)),
                  ("block", "block_weights", block_weights_unchained, chain(3)),
                  ("traversal", "traversal_residual", traversal_residual_without_correction, BINARY),
                  ("traversal", "traversal_child_weight", traversal_child_weight_uncarried, BINARY)]


@pytest.mark.parametrize("method,step,wrong,parents", WRONG_VARIANTS, ids=[w[1] for w in WRONG_VARIANTS])
def test_negative_control_rejects_a_wrong_variant(monkeypatch, method, step, wrong, parents):
    monkeypatch.setattr(reference, step, wrong)
    tokens = _generated("torch", method, parents, 1.0, samples_for("triton"), seed=3, k=2)
    p_value = chi_square_pvalue(index(tokens), k_token_law(1.0, 2))
    assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject {step} = {wrong.__name__} ({p_value:.3g})"


# ----------------------------------------------------------------------------------------------
# the op: arguments, greedy requests, determinism, batch invariance
# ----------------------------------------------------------------------------------------------
# method: (random batches of its trees, a misspelling of its name, nodes per tree in the bad-argument test, in the
# greedy test)
OP_CASES = {"block": (chain_batch, "blocks", 4, 6), "traversal": (tree_batch, "traverse", 5, 7)}


@pytest.mark.parametrize("method,backend", VERIFIER_BACKENDS)
def test_bad_method_arguments(method, backend):
    batch_of, misspelled, T, _ = OP_CASES[method]
    batch = batch_of(3, T, torch.Generator().manual_seed(0), torch.tensor([1.0, 0.0, 0.7]))
    with pytest.raises(TypeError, match="method"):
        accept_on(backend, **batch, method=1)
    with pytest.raises(ValueError, match="method: expected one of"):
        accept_on(backend, **batch, method=misspelled)
    with pytest.raises(ValueError, match=f"method: '{method}' needs draft_logits"):
        accept_on(backend, **dict(batch, draft_logits=None), method=method)


@pytest.mark.parametrize("method,backend", VERIFIER_BACKENDS)
def test_greedy_requests_ignore_the_method_and_results_are_deterministic_and_batch_invariant(method, backend):
    batch_of, _, _, T = OP_CASES[method]
    gen = torch.Generator().manual_seed(1)
    B = 8
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.9])
    batch = batch_of(B, T, gen, temps)
    joint = accept_on(backend, **batch, method=method)
    token = accept_on(backend, **batch, method="token")
    greedy = temps == 0
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(joint, token))
    assert all(torch.equal(x, y) for x, y in zip(joint, accept_on(backend, **batch, method=method)))
    order = torch.randperm(B, generator=gen)
    shuffled = {k: (v[order] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B else v)
                for k, v in batch.items()}
    again = accept_on(backend, **shuffled, method=method)
    assert all(torch.equal(x[order], y) for x, y in zip(joint, again))
    assert int(joint.num_accepted[~greedy].max()) >= 2
    # the accepted path is a root-to-node path of the tree, padded with -1
    for b in range(B):
        k = int(joint.num_accepted[b])
        path = joint.accepted_nodes[b, : k + 1].tolist()
        assert path[0] == 0 and all(int(batch["parents"][b, path[i]]) == path[i - 1] for i in range(1, k + 1))
        assert (joint.accepted_nodes[b, k + 1:] == -1).all()
        assert 0 <= int(joint.next_tokens[b]) < V_BATCH
