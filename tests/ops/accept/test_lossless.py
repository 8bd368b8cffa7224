"""Sampling is exactly lossless: the emitted tokens follow softmax(target_logits / t).

Each test puts many independent requests (one seed each) into one batch and compares the emitted
tokens with the exact target law by a chi-square test (tests/stats.py). Covered: chains and trees with
draft logits (children drawn i.i.d. from the drafter), top-k trees and argmax chains without them (given
proposals), and the first two generated tokens across steps with a Markov-chain target and drafter, also
with top-k, top-p, min-p and a grammar mask that changes along the path (the processed law).
Negative controls show that the same test rejects known-wrong samplers. Runs over the reference
("torch", on the CPU) and every other backend (on tests.helpers.DEVICE); the Triton kernel in the
interpreter gets smaller samples (still enough to reject the wrong samplers by many orders of magnitude).
"""
from __future__ import annotations

import functools

import pytest
import torch

from specdec import reference
from tests.helpers import BACKENDS, DEVICE, accept_on
from tests.ops.accept.markov import (CHAIN, FILTERS, INTERPRETED_FILTERED_SAMPLES, MARKOV_TREE, generated_tokens, index,
                                     two_token_law)
from tests.stats import ALPHA, assert_law, chi_square_pvalue, first_tokens, target_law

# the interpreted kernel computes log(0) = -inf and exp(-inf) on purpose (masked entries); numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

LOSSLESS_BACKENDS = ["torch"] + BACKENDS
SAMPLES = 3000  # requests per test
INTERPRETED_SAMPLES = 800  # for the Triton kernel in the interpreter (~30 ms per request)

V = 6
NEG_INF = float("-inf")
# The root's laws: the target never emits token 5, which the drafter proposes 10% of the time. They are
# chosen (by exact computation of the laws) so that the usual mistakes move the law by a total variation
# of 0.14 - 0.22: a residual not carried over between siblings, c_{k+1} = c_k + 1 instead of c_k + Z_k, a
# correction drawn from p, no renormalization after a rejected given proposal.
TARGET_ROOT = torch.tensor([1.25, 0.2, -0.35, -0.2, -1.65, NEG_INF])
DRAFT_ROOT = torch.tensor([0.55, 1.25, -1.4, 0.8, -0.25, 0.0])


def samples_for(backend: str) -> int:
    return INTERPRETED_SAMPLES if backend == "triton" and DEVICE.type == "cpu" else SAMPLES


def _draft_children(parents: list[int], draft: torch.Tensor, t: float, n: int, gen: torch.Generator):
    """(n, T) tokens: every node's children drawn i.i.d. from softmax(draft[parent] / t)."""
    T = len(parents)
    tokens = torch.zeros(n, T, dtype=torch.int64)
    for i in range(1, T):
        q = torch.softmax(draft[parents[i]].double() / t, -1)
        tokens[:, i] = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=gen)[:, 0]
    return tokens


def _scenario(parents: list[int], t: float, with_draft: bool, n: int, seed: int, given_tokens=None):
    """A batch of n requests sharing the tree shape and logits (root rows above, deeper rows random)."""
    gen = torch.Generator().manual_seed(seed)
    T = len(parents)
    target = torch.randn(T, V, generator=gen) * 1.5
    target[0] = TARGET_ROOT
    draft = torch.randn(T, V, generator=gen) * 1.5
    draft[0] = DRAFT_ROOT
    if with_draft:
        tokens = _draft_children(parents, draft, t, n, gen)
    else:
        tokens = torch.tensor(given_tokens, dtype=torch.int64).expand(n, T)
    return dict(target_logits=target.expand(n, T, V), tokens=tokens, parents=torch.tensor(parents).expand(n, T),
                draft_logits=draft.expand(n, T, V) if with_draft else None, temperature=t,
                seeds=torch.arange(n, dtype=torch.int64) + 1000 * seed)


TREE = [-1, 0, 0, 0, 1, 1, 2]  # the root has 3 children, node 1 has 2, node 2 has 1
TOPK_TREE = [-1, 0, 0, 0, 0, 1, 1]  # the root has 4 children, node 1 has 2

SCENARIOS = {
    # children drawn from the drafter, multi-step rejection with residuals
    "chain_draft": dict(parents=CHAIN, t=0.8, with_draft=True),
    "tree_iid_draft": dict(parents=TREE, t=1.0, with_draft=True),
    # given proposals: a top-k tree (the masked token 5 among the root's children) and an argmax chain
    "topk_tree_given": dict(parents=TOPK_TREE, t=1.0, with_draft=False, given_tokens=[0, 0, 1, 5, 2, 3, 4]),
    "argmax_chain_given": dict(parents=CHAIN, t=0.7, with_draft=False, given_tokens=[0, 0, 1, 2]),
}


@pytest.mark.parametrize("backend", LOSSLESS_BACKENDS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_first_token_follows_target(backend, name):
    cfg = dict(SCENARIOS[name])
    t = cfg["t"]
    batch = _scenario(n=samples_for(backend), seed=len(name), **cfg)
    result = accept_on(backend, **batch)
    assert_law(first_tokens(result, batch["tokens"]), target_law(TARGET_ROOT, t), f"{name} on {backend}")


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton kernel's draw")
@pytest.mark.parametrize("name,trials", [("chain_draft", 0), ("tree_iid_draft", 1)])
def test_triton_draw_after_a_last_rejection_is_exact_for_any_candidate_count(monkeypatch, name, trials):
    """The draw after a last rejection with draft logits: trials=0 is the Z-pass draw alone, trials=1 one
    candidate then that fallback (the default tries 8, rarely falling back): a mixture of exact paths."""
    from specdec.kernels import accept as kernel
    monkeypatch.setattr(kernel, "TRIALS", trials)
    cfg = dict(SCENARIOS[name])
    batch = _scenario(n=samples_for("triton"), seed=len(name) + 7 * trials, **cfg)
    result = accept_on("triton", **batch)
    assert_law(first_tokens(result, batch["tokens"]), target_law(TARGET_ROOT, cfg["t"]), f"{name}, trials={trials}")


# ----------------------------------------------------------------------------------------------
# two tokens across steps: Markov-chain target and drafter over a small vocabulary (tests/ops/accept/markov.py)
# ----------------------------------------------------------------------------------------------
def _pairs(backend, parents, t, with_draft, n, seed, filters=None, ignore=()):
    """(n,) the first two tokens generated from state 0 (markov.generated_tokens), as indices of two_token_law."""
    return index(generated_tokens(functools.partial(accept_on, backend), parents, t, n, seed, 2, with_draft=with_draft,
                                  filters=filters, ignore=ignore))


@pytest.mark.parametrize("backend", LOSSLESS_BACKENDS)
@pytest.mark.parametrize("with_draft,parents,t", [(True, MARKOV_TREE, 1.0), (False, CHAIN, 0.8)],
                         ids=["tree_draft", "argmax_chain_given"])
def test_first_two_tokens_follow_markov_target(backend, with_draft, parents, t):
    pairs = _pairs(backend, parents, t, with_draft, samples_for(backend), seed=3 + with_draft)
    assert_law(pairs, two_token_law(t), f"Markov two tokens on {backend}")


# ----------------------------------------------------------------------------------------------
# the processed law: top-k, top-p, min-p and a grammar mask that changes along the path (markov.FILTERS)
# ----------------------------------------------------------------------------------------------
# the Triton interpreter is slow: the per-parameter cases run on compiled backends, "all" everywhere
FILTERED_BACKENDS = [b for b in LOSSLESS_BACKENDS if not (b == "triton" and DEVICE.type == "cpu")]


@pytest.mark.parametrize("backend", FILTERED_BACKENDS)
@pytest.mark.parametrize("filters", ["top_k", "top_p", "min_p", "mask"])
@pytest.mark.parametrize("with_draft,parents,t", [(True, MARKOV_TREE, 1.0), (False, CHAIN, 0.8)],
                         ids=["tree_draft", "argmax_chain_given"])
def test_first_two_tokens_follow_the_processed_markov_target(backend, filters, with_draft, parents, t):
    """The drafter samples from its processed law (with draft logits); the emitted tokens follow the
    processed target law, over two steps."""
    f = FILTERS[filters]
    pairs = _pairs(backend, parents, t, with_draft, samples_for(backend), seed=5 + with_draft, filters=f)
    assert_law(pairs, two_token_law(t, f), f"Markov two tokens, {filters}, on {backend}")


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton kernel's fused mask")
def test_first_two_tokens_follow_the_masked_markov_target_in_the_fused_triton_mask():
    """The bitmask alone is fused in the Triton kernel (not processed before it): the path-dependent mask,
    draft logits on a tree (residuals after rejections, the draw); a smaller sample in the interpreter."""
    f = FILTERS["mask"]
    n = INTERPRETED_FILTERED_SAMPLES if DEVICE.type == "cpu" else SAMPLES
    pairs = _pairs("triton", MARKOV_TREE, 1.0, True, n, seed=6, filters=f)
    assert_law(pairs, two_token_law(1.0, f), "Markov two tokens, fused mask, on triton")


@pytest.mark.parametrize("backend", LOSSLESS_BACKENDS)
@pytest.mark.parametrize("with_draft,parents,t", [(True, CHAIN, 0.9), (False, MARKOV_TREE, 1.0)],
                         ids=["chain_draft", "topk_tree_given"])
def test_first_two_tokens_with_every_filter(backend, with_draft, parents, t):
    """top_k, top_p, min_p and the path-dependent mask together, on the other two tree kinds."""
    f = FILTERS["all"]
    n = INTERPRETED_FILTERED_SAMPLES if backend == "triton" and DEVICE.type == "cpu" else SAMPLES
    pairs = _pairs(backend, parents, t, with_draft, n, seed=8 + with_draft, filters=f)
    assert_law(pairs, two_token_law(t, f), f"Markov two tokens, all filters, on {backend}")


@pytest.mark.parametrize("ignored", ["mask", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("with_draft,parents,t", [(True, MARKOV_TREE, 1.0), (False, CHAIN, 0.8)],
                         ids=["tree_draft", "argmax_chain_given"])
def test_negative_control_rejects_a_sampler_that_ignores_a_filter(ignored, with_draft, parents, t):
    """accept without the mask (or without top_k, top_p, min_p) while the law to follow (and the drafter's)
    has it: rejected, at the interpreter's smallest sample size."""
    f = FILTERS[ignored]
    pairs = _pairs("torch", parents, t, with_draft, INTERPRETED_FILTERED_SAMPLES, seed=3, filters=f, ignore=(ignored,))
    p_value = chi_square_pvalue(pairs, two_token_law(t, f))
    assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject a sampler ignoring {ignored} ({p_value:.3g})"


# ----------------------------------------------------------------------------------------------
# negative controls: the same test rejects known-wrong samplers at the smallest sample size used
# ----------------------------------------------------------------------------------------------
def _wrong_sampler(batch, rule: str) -> torch.Tensor:
    """First emitted token of a known-wrong acceptance rule (plain PyTorch, one request at a time)."""
    gen = torch.Generator().manual_seed(12345)
    t = batch["temperature"]
    p = torch.softmax(batch["target_logits"][0, 0].double() / t, -1)
    q = torch.softmax(batch["draft_logits"][0, 0].double() / t, -1)
    kids = [i for i, par in enumerate(batch["parents"][0].tolist()) if par == 0]
    firsts = []
    for toks in batch["tokens"]:
        chosen = None
        for c in kids:
            x = int(toks[c])
            u = float(torch.rand((), dtype=torch.float64, generator=gen))
            if u * q[x] < p[x]:  # min(1, p/q), every sibling against the untouched p
                chosen = x
                break
        if chosen is None:
            # "correct_from_p": the correction drawn from p instead of the residual max(p - q, 0)
            residual = p if rule == "correct_from_p" else torch.clamp(p - q, min=0)
            chosen = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
        firsts.append(chosen)
    return torch.tensor(firsts)


@pytest.mark.parametrize("rule,name", [("correct_from_p", "chain_draft"),
                                       ("siblings_share_residual", "tree_iid_draft")])
def test_negative_control_rejects_wrong_sampler(rule, name):
    cfg = dict(SCENARIOS[name])
    batch = _scenario(n=INTERPRETED_SAMPLES, seed=len(name), **cfg)
    p_value = chi_square_pvalue(_wrong_sampler(batch, rule), target_law(TARGET_ROOT, cfg["t"]))
    assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject the wrong rule {rule!r} (p = {p_value:.3g})"


def test_negative_control_rejects_misdeclared_draft():
    """Children drawn from one drafter but verified against another's logits: the law breaks."""
    cfg = dict(SCENARIOS["tree_iid_draft"])
    batch = _scenario(n=INTERPRETED_SAMPLES, seed=11, **cfg)
    batch["draft_logits"] = batch["draft_logits"].flip(-1)
    result = accept_on("torch", **batch)
    p_value = chi_square_pvalue(first_tokens(result, batch["tokens"]), target_law(TARGET_ROOT, cfg["t"]))
    assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject a misdeclared drafter (p = {p_value:.3g})"


# ----------------------------------------------------------------------------------------------
# huge finite logits and the smallest sampling temperature: the law depends on differences only
# ----------------------------------------------------------------------------------------------
# Each case: (target row, draft row, temperature, probabilities?, dtype), V = 5. float32 3e38 at t = 0.5 (x / t
# overflows: the Triton kernel always emitted token 0 where the law is 1/2, 1/2); float64 1.7e308 at t = 1e-5 (the
# reference's row / t overflowed; the Triton kernel read it as float32 inf); three live tokens one ulp apart at
# 3e38 with t = that ulp (x / t is exact there, but a log-sum-exp of ~1.5e7 rounds its log-sum away); logits ~ 1e-5
# at t = 1e-5 (the smallest sampling temperature, reference.GREEDY_BELOW); probabilities ~ 1e-30 apart by factors
# exp(1e-5 k) at t = 1e-5 (their logs ~ -69 divided by t ~ -6.9e6, where float32 rounds by 0.5).
_ULP = float(torch.tensor(3e38) - torch.nextafter(torch.tensor(3e38), torch.tensor(0.0)))
_BIG = float(torch.tensor(3e38))
_SCALED = torch.tensor([1.0, 0.0, -1.0, -3.0, -30.0])
_SCALED_DRAFT = torch.tensor([0.0, 1.0, -1.0, 0.0, -30.0])
EXTREME_ROWS = {
    "huge_two_live": ([3e38, 3e38, 0.0, -3e38, 1e30], [3e38, -3e38, 3e38, 0.0, 3e38], 0.5, False, torch.float32),
    "huge_float64": ([1.7e308, 1.7e308, 0.0, -1.7e308, 1e300], [1.7e308, -1.7e308, 1.7e308, 0.0, 1.7e308], 1e-5,
                     False, torch.float64),
    "huge_three_live": ([_BIG, _BIG - _ULP, _BIG - 2 * _ULP, -3e38, 0.0],
                        [_BIG - 2 * _ULP, _BIG, _BIG - _ULP, 0.0, _BIG - _ULP], _ULP, False, torch.float32),
    "logits_at_greedy_below": ((1e-5 * _SCALED).tolist(), (1e-5 * _SCALED_DRAFT).tolist(), 1e-5, False,
                               torch.float32),
    "tiny_probs_at_greedy_below": ((1e-30 * (1e-5 * _SCALED).exp()).tolist(),
                                   (1e-30 * (1e-5 * _SCALED_DRAFT).exp()).tolist(), 1e-5, True, torch.float32),
}
# verifier: (parents, given proposals' tokens or None for children drawn from the draft law, method)
EXTREME_VERIFIERS = {"given": ([-1, 0, 0], [0, 1, 2], "token"), "draft": ([-1, 0, 0, 1], None, "token"),
                     "block": ([-1, 0, 1], None, "block"), "traversal": ([-1, 0, 0, 1], None, "traversal")}
EXTREME_FILTERS = dict(top_k=3, top_p=0.8, min_p=0.05)


def _extreme_batch(case: str, verifier: str, filtered: bool, n: int, seed: int):
    """n requests of one case on one tree (every node's rows the case's), children drawn i.i.d. from the processed
    draft law; and the processed target law of the root, the reference's (float64, on the float32 inputs)."""
    target, draft, t, probs, dtype = EXTREME_ROWS[case]
    parents, given, method = EXTREME_VERIFIERS[verifier]
    filters = EXTREME_FILTERS if filtered else {}
    T, V = len(parents), len(target)
    rows = {"target": torch.tensor(target, dtype=dtype), "draft": torch.tensor(draft, dtype=dtype)}
    t32 = float(torch.tensor(t, dtype=torch.float32))

    def law(row):
        logits = row.double().log() if probs else row
        return reference.processed_probs(logits, t32, filters.get("top_k", 0), filters.get("top_p", 1.0),
                                         filters.get("min_p", 0.0))

    gen = torch.Generator().manual_seed(seed)
    if given is None:
        tokens = torch.multinomial(law(rows["draft"]).expand(n, -1), T, replacement=True, generator=gen)
    else:
        tokens = torch.tensor(given).expand(n, T)
    names = ("target_probs", "draft_probs") if probs else ("target_logits", "draft_logits")
    batch = {names[0]: rows["target"].expand(n, T, V), "tokens": tokens, "parents": torch.tensor(parents).expand(n, T),
             "temperature": t, "seeds": torch.arange(n) + 104729 * seed, "method": method, **filters}
    if given is None:
        batch[names[1]] = rows["draft"].expand(n, T, V)
    return batch, law(rows["target"])


@pytest.mark.parametrize("backend", LOSSLESS_BACKENDS)
@pytest.mark.parametrize("case", list(EXTREME_ROWS))
@pytest.mark.parametrize("verifier,filtered", [(v, False) for v in EXTREME_VERIFIERS] + [("draft", True)],
                         ids=list(EXTREME_VERIFIERS) + ["draft_filtered"])
def test_extreme_rows_follow_the_target(backend, case, verifier, filtered):
    """The first token emitted follows the root's processed law, computed exactly from the differences."""
    n = 120 if backend == "triton" and DEVICE.type == "cpu" else 1000
    batch, law = _extreme_batch(case, verifier, filtered, n, seed=list(EXTREME_ROWS).index(case))
    assert int((law > 0).sum()) >= 2  # (a law with a choice: a point mass would pass a greedy sampler)
    assert_law(first_tokens(accept_on(backend, **batch), batch["tokens"]), law, f"{case}, {verifier} on {backend}")
