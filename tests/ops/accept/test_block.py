"""Block verification (accept(..., method="block"); Sun et al., arXiv 2403.10444, Algorithm 2): exactly
lossless, and never fewer accepted tokens than token-wise verification of the same drafts.

Exact checks enumerate every draft chain of small Markov targets and drafters with the reference's own
block_weights / block_residual (the paper's steps): the law of the first emitted tokens is the target's,
and the expected accepted length is >= token-wise's, with equality only where the paper's argument allows
it (gamma = 1). Sampled checks run accept itself on every CPU backend: chi-square over the first 2 and 3
generated tokens on chains of 1-5 drafts at temperatures 0.5, 1 and 2; the mean accepted length against
its exact value; negative controls (no residual correction, a wrong weight) that the same tests reject.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import specdec
from specdec import reference
from tests.helpers import DEVICE, MemorySpy, accept_on, element_addresses
from tests.stats import ALPHA, assert_law, chi_square_pvalue, emitted_tokens
from tests.ops.accept.test_lossless import FILTERS, M, P_TARGET, Q_DRAFT, _markov_step, _two_token_law

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

BLOCK_BACKENDS = ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else []) + ["triton"]
SAMPLES = 3000
INTERPRETED = DEVICE.type == "cpu"  # the Triton kernel runs in the interpreter: smaller samples, fewer cases


def samples_for(backend: str) -> int:
    return 800 if backend == "triton" and INTERPRETED else SAMPLES


def _chain(gamma: int) -> list[int]:
    return [-1] + list(range(gamma))


# ----------------------------------------------------------------------------------------------
# exact: every draft chain enumerated
# ----------------------------------------------------------------------------------------------
def _token_wise(P, Q, drafted):
    """Token-wise verification of one chain, exactly: [(probability, emitted tokens)]."""
    out, keep = [], 1.0
    for i in range(len(drafted) + 1):
        if i == len(drafted):
            out += [(keep * float(P[i][y]), tuple(drafted[:i]) + (y,)) for y in range(len(P[i]))]
            break
        x = drafted[i]
        a = min(1.0, float(P[i][x] / Q[i][x]))
        r = torch.clamp(P[i] - Q[i], min=0.0)
        r = r / r.sum() if r.sum() > 0 else P[i]
        out += [(keep * (1 - a) * float(r[y]), tuple(drafted[:i]) + (y,)) for y in range(len(P[i]))]
        keep *= a
    return out


def _block(P, Q, drafted):
    """Block verification of one chain, exactly, from the reference's steps: [(probability, emitted)]."""
    weights, h = reference.block_weights(P, Q, drafted)
    gamma, out = len(drafted), []
    for tau in range(gamma + 1):  # tau is the last i with eta_i < h_i
        chance = (h[tau - 1] if tau else 1.0) * math.prod(1 - h[j] for j in range(tau, gamma))
        r = P[tau] if tau == gamma else reference.block_residual(P[tau], Q[tau], weights[tau])
        r = r / r.sum() if r.sum() > 0 else P[tau]
        out += [(chance * float(r[y]), tuple(drafted[:tau]) + (y,)) for y in range(len(P[tau]))]
    return out


def _exact(verify, p, q, gamma):
    """Markov target p and drafter q (M x M, from state 0): (law of the emitted tuples, E[accepted])."""
    law, accepted = {}, 0.0
    for drafted in itertools.product(range(p.shape[0]), repeat=gamma):
        states = (0,) + drafted
        chance = math.prod(float(q[states[i], drafted[i]]) for i in range(gamma))
        for pr, emitted in verify([p[s] for s in states], [q[s] for s in states], list(drafted)):
            law[emitted] = law.get(emitted, 0.0) + chance * pr
            accepted += chance * pr * (len(emitted) - 1)
    return law, accepted


def _first_two(law, p):
    """The law of the first two generated tokens (a one-token emission continues from its token with p)."""
    two = torch.zeros(p.shape[0], p.shape[0], dtype=torch.float64)
    for emitted, pr in law.items():
        if len(emitted) > 1:
            two[emitted[0], emitted[1]] += pr
        else:
            two[emitted[0]] += pr * p[emitted[0]]
    return two


def test_block_weights_on_the_papers_example():
    """Sun et al.'s motivating example: two context-independent models over {a, b}, target (1/3, 2/3),
    drafter (2/3, 1/3), blocks of 2: token-wise accepts 10/9 tokens on average, block verification 11/9."""
    p = torch.tensor([[1 / 3, 2 / 3]] * 2, dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    assert _exact(_token_wise, p, q, 2)[1] == pytest.approx(10 / 9, abs=1e-12)
    assert _exact(_block, p, q, 2)[1] == pytest.approx(11 / 9, abs=1e-12)


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_block_is_exactly_lossless_and_never_worse(gamma):
    """Random Markov pairs (V = 4, some zeros on either side): the first two tokens follow the target exactly
    (to rounding); block verification accepts >= token-wise on every pair and > on most (gamma >= 2; at
    gamma = 1 the two are the same algorithm)."""
    gen = torch.Generator().manual_seed(gamma)
    better = tried = 0
    while tried < 25:
        p = torch.rand(4, 4, generator=gen, dtype=torch.float64) ** 2
        q = torch.rand(4, 4, generator=gen, dtype=torch.float64) ** 2
        p[torch.rand(4, 4, generator=gen) < 0.1] = 0.0  # impossible tokens for the target ...
        q[torch.rand(4, 4, generator=gen) < 0.1] = 0.0  # ... and ones the drafter never proposes
        if not (p.sum(-1) > 0).all() or not (q.sum(-1) > 0).all():
            continue
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
        tried += 1
        law, block = _exact(_block, p, q, gamma)
        _, token = _exact(_token_wise, p, q, gamma)
        torch.testing.assert_close(_first_two(law, p), p[0][:, None] * p, rtol=0, atol=1e-12)
        assert block >= token - 1e-12
        better += block > token + 1e-9
    assert better == 0 if gamma == 1 else better >= 20


# ----------------------------------------------------------------------------------------------
# sampled: accept itself on every CPU backend
# ----------------------------------------------------------------------------------------------
def _first_tokens(backend, gamma, t, n, seed, k, filters=None):
    """(n, k) the first k tokens generated from state 0 by steps of accept(method="block") on chains of gamma
    Markov drafts (q's transitions at temperature t, processed by `filters` if given), each request's next
    step from its last emitted token."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + 7919 * seed
    out = [[] for _ in range(n)]
    last = torch.zeros(n, dtype=torch.int64)
    for step in range(k):
        todo = torch.tensor([len(o) < k for o in out])
        if not todo.any():
            break
        batch = _markov_step(last[todo], _chain(gamma), t, True, gen, filters)
        res = accept_on(backend, **batch, seeds=seeds[todo], offset=step, method="block")
        for b, emitted in zip(torch.nonzero(todo).flatten().tolist(), emitted_tokens(res, batch["tokens"])):
            out[b] += emitted
            last[b] = emitted[-1]
    return torch.tensor([o[:k] for o in out])


def _k_token_law(t: float, k: int) -> torch.Tensor:
    """(M^k,) the law of the first k tokens from state 0 under softmax(log P / t)."""
    p = torch.softmax(P_TARGET.log() / t, -1)
    law = p[0]
    for _ in range(k - 1):
        law = (law.view(-1, 1) * p[torch.arange(M).repeat(law.numel() // M)]).flatten()
    return law


def _index(tokens: torch.Tensor) -> torch.Tensor:
    return sum(tokens[:, j] * M ** (tokens.shape[1] - 1 - j) for j in range(tokens.shape[1]))


@pytest.mark.parametrize("backend", BLOCK_BACKENDS)
@pytest.mark.parametrize("gamma,t", [(1, 1.0), (2, 0.5), (3, 1.0), (4, 2.0), (5, 1.0)])
def test_first_tokens_follow_the_markov_target(backend, gamma, t):
    """Chains of 1-5 drafts from q at temperatures 0.5, 1, 2: the first two and the first three generated
    tokens follow the target's Markov law (chi-square)."""
    if backend == "torch" and gamma not in (2, 5):
        pytest.skip("the reference loops in Python: two chain lengths")
    if backend == "triton" and INTERPRETED and gamma != 3:
        pytest.skip("the interpreter's time: one chain length")
    tokens = _first_tokens(backend, gamma, t, samples_for(backend), seed=11 + gamma, k=3)
    assert_law(_index(tokens[:, :2]), _k_token_law(t, 2), f"block, first two tokens, gamma {gamma}, on {backend}")
    assert_law(_index(tokens), _k_token_law(t, 3), f"block, first three tokens, gamma {gamma}, on {backend}")


@pytest.mark.parametrize("backend", BLOCK_BACKENDS)
def test_block_with_every_filter_follows_the_processed_target(backend):
    """Top-k, top-p, min-p and a path-dependent grammar mask compose with block verification: its P and Q are
    the processed laws (the drafter samples from its processed one); the first two tokens follow the
    processed target law."""
    f = FILTERS["all"]
    n = 400 if backend == "triton" and INTERPRETED else SAMPLES  # (test_lossless.py's filtered size there)
    tokens = _first_tokens(backend, 3, 0.9, n, seed=21, k=2, filters=f)
    assert_law(_index(tokens), _two_token_law(0.9, f), f"block with every filter on {backend}")


@pytest.mark.parametrize("backend", BLOCK_BACKENDS)
@pytest.mark.parametrize("gamma", [2, 4])
def test_mean_accepted_length_is_the_exact_one(backend, gamma):
    """A lossless sampler can still reject too often: the mean accepted length of one step from state 0 is
    the exact expectation (enumerated), within 4 standard errors, and above token-wise's exact one."""
    if backend == "triton" and INTERPRETED and gamma != 4:
        pytest.skip("the interpreter's time: one chain length")
    t = 1.0
    n = samples_for(backend)
    gen = torch.Generator().manual_seed(5 + gamma)
    batch = _markov_step(torch.zeros(n, dtype=torch.int64), _chain(gamma), t, True, gen)
    res = accept_on(backend, **batch, seeds=torch.arange(n) + 17, offset=0, method="block")
    got = res.num_accepted.double()
    p = torch.softmax(P_TARGET.log() / t, -1)
    q = torch.softmax(Q_DRAFT.log() / t, -1)
    exact, token = _exact(_block, p, q, gamma)[1], _exact(_token_wise, p, q, gamma)[1]
    assert abs(float(got.mean()) - exact) < 4 * float(got.std()) / math.sqrt(n), (float(got.mean()), exact)
    assert exact > token + 0.01


def test_negative_controls_reject_wrong_block_samplers(monkeypatch):
    """The chi-square over the first two tokens rejects block verification without its residual correction
    (the next token from the target itself), and with token-wise weights (p_i = min(P/Q, 1), not carried), at
    the smallest sample size used above (the interpreter's), by a wide margin."""
    gamma, t, n = 3, 1.0, samples_for("triton")
    law = _k_token_law(t, 2)
    def no_correction(p_row, q_row, weight):
        return p_row.clone()

    def unchained(P, Q, drafted):  # p_i = min(P / Q, 1), without the factor p_{i-1}
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

    for name, wrong in (("block_residual", no_correction), ("block_weights", unchained)):
        with monkeypatch.context() as m:
            m.setattr(reference, name, wrong)
            tokens = _first_tokens("torch", gamma, t, n, seed=3, k=2)
        p_value = chi_square_pvalue(_index(tokens), law)
        assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject {name} = {wrong.__name__} ({p_value:.3g})"


# ----------------------------------------------------------------------------------------------
# the op: arguments, greedy requests, determinism, batch invariance
# ----------------------------------------------------------------------------------------------
V_CHAIN = 11


def _chain_batch(B, T, gen, temperature):
    target = torch.randn(B, T, V_CHAIN, generator=gen) * 2
    draft = target + torch.randn(B, T, V_CHAIN, generator=gen)
    tokens = torch.randint(0, V_CHAIN, (B, T), generator=gen)
    tokens[:, 1:] = target[:, :-1].argmax(-1)  # long greedy paths, often accepted when sampling too
    return dict(target_logits=target, tokens=tokens, parents=torch.arange(-1, T - 1).expand(B, T),
                draft_logits=draft, temperature=temperature, seeds=torch.arange(B) + 3,
                num_nodes=torch.randint(1, T + 1, (B,), generator=gen))


@pytest.mark.parametrize("backend", BLOCK_BACKENDS)
def test_bad_method_arguments(backend):
    gen = torch.Generator().manual_seed(0)
    batch = _chain_batch(3, 4, gen, torch.tensor([1.0, 0.0, 0.7]))
    with pytest.raises(TypeError, match="method"):
        accept_on(backend, **batch, method=1)
    with pytest.raises(ValueError, match="method: expected one of"):
        accept_on(backend, **batch, method="blocks")
    with pytest.raises(ValueError, match="method: 'block' needs draft_logits"):
        accept_on(backend, **dict(batch, draft_logits=None), method="block")
    tree = dict(batch, parents=torch.tensor([[-1, 0, 0, 1]] * 3), num_nodes=torch.full((3,), 4))
    with pytest.raises(ValueError, match="method: 'block' verifies chains only"):
        accept_on(backend, **tree, method="block")


@pytest.mark.parametrize("backend", BLOCK_BACKENDS)
def test_greedy_requests_ignore_the_method_and_results_are_deterministic_and_batch_invariant(backend):
    gen = torch.Generator().manual_seed(1)
    B = 8
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.9])
    batch = _chain_batch(B, 6, gen, temps)
    block = accept_on(backend, **batch, method="block")
    token = accept_on(backend, **batch, method="token")
    greedy = temps == 0
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(block, token))
    assert all(torch.equal(x, y) for x, y in zip(block, accept_on(backend, **batch, method="block")))
    order = torch.randperm(B, generator=gen)
    shuffled = {k: (v[order] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B else v)
                for k, v in batch.items()}
    again = accept_on(backend, **shuffled, method="block")
    assert all(torch.equal(x[order], y) for x, y in zip(block, again))
    assert int(block.num_accepted[~greedy].max()) >= 2


def test_triton_block_schedules_agree_and_read_every_chain_row(monkeypatch):
    """The Triton walk of block verification gives the same results under the split launches as in the
    walker alone, with filters too; it reads every row of each sampled chain (each test needs its node's
    residual mass), not only the rows up to a first rejection, never a row past the chain, and never the
    last node's draft row (h_gamma = p_gamma needs none)."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(4)
    B, T = 6, 5
    temps = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 0.7])
    batch = _chain_batch(B, T, gen, temps)
    target, draft = batch["target_logits"], batch["draft_logits"]
    args = (target, batch["tokens"].int(), batch["parents"].int(), draft, temps, batch["seeds"],
            batch["num_nodes"].int(), 0)
    spy = MemorySpy(monkeypatch)
    base = triton_accept(*args, method="block")
    reads = {name: spy.counts([x]) for name, x in (("target", target), ("draft", draft))}
    for b in range(B):
        n = int(batch["num_nodes"][b])
        for i in range(T):
            rows = {name: element_addresses(x)[b, i].tolist() for name, x in (("target", target), ("draft", draft))}
            target_read = all(reads["target"].get(a, 0) >= 1 for a in rows["target"])
            if temps[b] > 0:
                assert target_read == (i < n), (b, i)
                draft_read = sum(reads["draft"].get(a, 0) > 0 for a in rows["draft"])
                assert (draft_read == V_CHAIN) == (i < n - 1), (b, i, draft_read)
    for schedule in (dict(num_splits=3, split_steps=2 * T + 3), dict(num_splits=2, split_steps=3)):
        assert all(torch.equal(x, y) for x, y in zip(base, triton_accept(*args, method="block", **schedule)))
    filters = (torch.tensor([3, 0, 5, 2, 0, 4], dtype=torch.int32), torch.tensor([0.9, 0.8, 1.0, 1.0, 0.95, 0.7]),
               torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0]), None)
    filtered = triton_accept(*args, None, *filters, "block")
    assert all(torch.equal(x, y) for x, y in zip(filtered, triton_accept(*args, None, *filters, "block",
                                                                         num_splits=3, split_steps=20)))
