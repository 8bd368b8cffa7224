"""Sampling is exactly lossless: the emitted tokens follow softmax(target_logits / t).

Each test puts many independent requests (one seed each) into one batch and compares the emitted
tokens with the exact target law by a chi-square test (tests/stats.py). Covered: chains and trees with
draft logits (children drawn i.i.d. from the drafter), top-k trees and argmax chains without them (given
proposals), and the first two generated tokens across steps with a Markov-chain target and drafter.
Negative controls show that the same test rejects known-wrong samplers. Runs over the reference
("torch", on the CPU) and every other backend (on tests.helpers.DEVICE); the Triton kernel in the
interpreter gets smaller samples (still enough to reject the wrong samplers by many orders of magnitude).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import BACKENDS, DEVICE, accept_on
from tests.stats import ALPHA, assert_law, chi_square_pvalue, emitted_tokens, first_tokens, target_law

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


CHAIN = [-1, 0, 1, 2]
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
# two tokens across steps: Markov-chain target and drafter over a small vocabulary
# ----------------------------------------------------------------------------------------------
M = 4  # states
P_TARGET = torch.tensor([[0.50, 0.30, 0.15, 0.05],
                         [0.10, 0.20, 0.30, 0.40],
                         [0.25, 0.25, 0.00, 0.50],  # the target never goes 2 -> 2
                         [0.60, 0.05, 0.25, 0.10]], dtype=torch.float64)
Q_DRAFT = torch.tensor([[0.10, 0.20, 0.30, 0.40],
                        [0.40, 0.30, 0.20, 0.10],
                        [0.30, 0.10, 0.50, 0.10],
                        [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
MARKOV_TREE = [-1, 0, 0, 1, 1, 2]


def _markov_step(roots: torch.Tensor, parents: list[int], t: float, with_draft: bool, gen: torch.Generator):
    """One verification step for every request whose last emitted token is roots[b].

    With draft logits the tree's children are drawn i.i.d. from the drafter's transition at their parent;
    without, each node's children are the drafter's argmax (a greedy draft chain).
    """
    n, T = roots.numel(), len(parents)
    log_p, log_q = P_TARGET.log(), Q_DRAFT.log()
    tokens = torch.zeros(n, T, dtype=torch.int64)
    tokens[:, 0] = roots
    for i in range(1, T):
        prev = tokens[:, parents[i]]
        if with_draft:
            q = torch.softmax(log_q[prev] / t, -1)
            tokens[:, i] = torch.multinomial(q, 1, generator=gen)[:, 0]
        else:
            tokens[:, i] = log_q[prev].argmax(-1)
    batch = dict(target_logits=log_p[tokens].float(), tokens=tokens, parents=torch.tensor(parents).expand(n, T),
                 draft_logits=log_q[tokens].float() if with_draft else None, temperature=t)
    return batch


def _first_two_tokens(backend, parents, t, with_draft, n, seed):
    """(n, 2) the first two tokens generated from state 0, taking a second step where the first emits one."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + 7919 * seed
    batch = _markov_step(torch.zeros(n, dtype=torch.int64), parents, t, with_draft, gen)
    out = emitted_tokens(accept_on(backend, **batch, seeds=seeds, offset=0), batch["tokens"])
    first = torch.tensor([o[0] for o in out])
    short = torch.tensor([len(o) == 1 for o in out])
    second = torch.tensor([o[1] if len(o) > 1 else -1 for o in out])
    if short.any():  # the next step starts from the emitted token, same seeds, next offset
        step2 = _markov_step(first[short], parents, t, with_draft, gen)
        res2 = accept_on(backend, **step2, seeds=seeds[short], offset=1)
        second[short] = first_tokens(res2, step2["tokens"])
    return torch.stack([first, second], 1)


def _two_token_law(t: float) -> torch.Tensor:
    """(M * M,) law of (y1, y2) from state 0: P_t(0, y1) P_t(y1, y2), P_t = softmax(log P / t)."""
    p = torch.softmax(P_TARGET.log() / t, -1)
    return (p[0][:, None] * p).flatten()


@pytest.mark.parametrize("backend", LOSSLESS_BACKENDS)
@pytest.mark.parametrize("with_draft,parents,t", [(True, MARKOV_TREE, 1.0), (False, CHAIN, 0.8)],
                         ids=["tree_draft", "argmax_chain_given"])
def test_first_two_tokens_follow_markov_target(backend, with_draft, parents, t):
    pairs = _first_two_tokens(backend, parents, t, with_draft, samples_for(backend), seed=3 + with_draft)
    assert_law(pairs[:, 0] * M + pairs[:, 1], _two_token_law(t), f"Markov two tokens on {backend}")


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
