"""specdec.sampling (the vectorized processed law, for engines and drafters) against the reference's
processed_keep / processed_probs: exactly the same kept sets, ties and boundary rows included."""
from __future__ import annotations

import math

import pytest
import torch

from specdec import _layout
from specdec import reference as ref
from specdec import sampling

INF = math.inf


def random_rows(gen, N, V, *, ties: bool):
    logits = (torch.randint(-4, 5, (N, V), generator=gen).float() * 0.5 if ties
              else torch.randn(N, V, generator=gen) * 2)
    logits[torch.rand(N, V, generator=gen) < 0.15] = -INF
    allowed = torch.rand(N, V, generator=gen) < 0.75
    t = torch.rand(N, generator=gen) * 1.5 + 0.1
    t[::5] = 0.0  # greedy rows: the mask only
    top_k = torch.randint(0, V + 2, (N,), generator=gen, dtype=torch.int32)
    top_p = torch.rand(N, generator=gen)
    top_p[::3] = 1.0
    min_p = torch.rand(N, generator=gen) * 0.9
    min_p[::4] = 0.0
    return logits, t, top_k, top_p, min_p, allowed


def reference_keep(logits, t, top_k, top_p, min_p, allowed, filter_order="hf"):
    rows = []
    for i in range(logits.shape[0]):
        a = None if allowed is None else allowed[i]
        if float(t[i]) < ref.GREEDY_BELOW:
            rows.append(ref.mask_disallowed(logits[i], a) > -INF)
        else:
            k = 0 if top_k is None else int(top_k[i])
            p = 1.0 if top_p is None else float(top_p[i])
            m = 0.0 if min_p is None else float(min_p[i])
            rows.append(ref.processed_keep(logits[i], float(t[i]), k, p, m, a, filter_order))
    return torch.stack(rows)


@pytest.mark.parametrize("filter_order", ref.FILTER_ORDERS)
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
@pytest.mark.parametrize("which", ["all", "top_k", "top_p", "min_p", "mask", "top_k+top_p"])
def test_keep_mask_equals_the_reference(ties, which, filter_order):
    gen = torch.Generator().manual_seed(3 + ties)
    for V in (1, 5, 37, 64):
        logits, t, top_k, top_p, min_p, allowed = random_rows(gen, 40, V, ties=ties)
        args = dict(top_k=top_k, top_p=top_p, min_p=min_p, allowed=allowed)
        if which != "all":
            args = {k: (v if k in which.split("+") or (which == "mask" and k == "allowed") else None)
                    for k, v in args.items()}
        got = sampling.keep_mask(logits, t, **args, filter_order=filter_order)
        assert torch.equal(got, reference_keep(logits, t, **args, filter_order=filter_order)), (which, V)


def test_filter_orders_differ_where_top_p_normalizes_over_another_set():
    """p = (0.4, 0.3, 0.2, 0.1), top_k 2, top_p 0.5: over the top-k set (hf) the mass above the second token is
    0.4 / 0.7 >= 0.5, so it goes; over the whole row (sglang) 0.4 < 0.5 keeps it. With min_p 0.3 and top_p 0.75,
    vllm's min-p drops 0.1 first: over the three left the mass above 0.2 is 0.7 / 0.9 >= 0.75 and it goes, where
    hf's top-p over the whole row keeps it (0.7 < 0.75)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().unsqueeze(0)
    kept = {order: sampling.keep_mask(logits, 1.0, 2, 0.5, None, filter_order=order)[0].tolist()
            for order in ref.FILTER_ORDERS}
    assert kept == {"hf": [True, False, False, False], "vllm": [True, False, False, False],
                    "sglang": [True, True, False, False]}
    vllm = sampling.keep_mask(logits, 1.0, None, 0.75, 0.3, filter_order="vllm")[0].tolist()
    hf = sampling.keep_mask(logits, 1.0, None, 0.75, 0.3, filter_order="hf")[0].tolist()
    assert vllm == [True, True, False, False] and hf == [True, True, True, False]
    with pytest.raises(ValueError, match="filter_order"):
        sampling.keep_mask(logits, 1.0, 2, filter_order="tgi")


def test_boundary_rows():
    """Rows built on the thresholds: ties at the k-th value, top_p a hair above / below a cumulative mass,
    min_p a hair above / below a ratio."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625], dtype=torch.float64)
    logits = p.log().float().expand(8, -1).clone()
    logits[4:6, 3] = logits[4:6, 2]  # ties at the third value
    t = torch.ones(8)
    top_p = torch.tensor([0.75 + 1e-6, 0.75 - 1e-6, 0.5 + 1e-6, 0.5 - 1e-6, 1.0, 1.0, 0.875 + 1e-6, 0.875 - 1e-6])
    top_k = torch.tensor([0, 0, 0, 0, 3, 2, 0, 0], dtype=torch.int32)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.25 - 1e-6, 0.25 + 1e-6, 0.0, 0.0])
    got = sampling.keep_mask(logits, t, top_k, top_p, min_p)
    assert torch.equal(got, reference_keep(logits, t, top_k, top_p, min_p, None))
    assert got.sum(-1).tolist() == [3, 2, 2, 1, 4, 2, 5, 3]


def test_every_parameter_off_keeps_every_finite_allowed_entry():
    gen = torch.Generator().manual_seed(5)
    logits, t, *_, allowed = random_rows(gen, 10, 20, ties=True)
    assert torch.equal(sampling.keep_mask(logits, t, allowed=allowed), allowed & (logits > -INF))
    assert torch.equal(sampling.keep_mask(logits, 1.0, top_k=0, top_p=1.0, min_p=0.0), logits > -INF)


def test_processed_logits_give_the_processed_law():
    gen = torch.Generator().manual_seed(6)
    logits, t, top_k, top_p, min_p, allowed = random_rows(gen, 30, 37, ties=False)
    out = sampling.processed_logits(logits, t, top_k, top_p, min_p, allowed)
    assert out.dtype == logits.dtype
    for i in range(30):
        if float(t[i]) == 0:
            masked = ref.mask_disallowed(logits[i], allowed[i])
            assert int(out[i].argmax()) == int(masked.argmax()) or masked.max() == -INF
            continue
        law = ref.processed_probs(logits[i], float(t[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]), allowed[i])
        if law.sum() == 0:
            assert (out[i] == -INF).all()
        else:
            torch.testing.assert_close(torch.softmax(out[i].double() / float(t[i]), 0), law)


def test_scalars_and_chunks(monkeypatch):
    """Python numbers for the parameters; rows processed in several chunks give the same mask."""
    gen = torch.Generator().manual_seed(7)
    logits, t, *_ = random_rows(gen, 9, 33, ties=True)
    t = t.clamp(min=0.2)
    whole = sampling.keep_mask(logits, t, 3, 0.8, 0.1)
    monkeypatch.setattr(sampling, "_CHUNK_ELEMENTS", 64)  # 1 row per chunk
    assert torch.equal(sampling.keep_mask(logits, t, 3, 0.8, 0.1), whole)
    n = 9
    assert torch.equal(whole, reference_keep(logits, t, torch.full((n,), 3), torch.full((n,), 0.8),
                                             torch.full((n,), 0.1), None))


def test_bitmask_round_trip():
    gen = torch.Generator().manual_seed(8)
    for V in (1, 31, 32, 33, 100):
        allowed = torch.rand(3, 4, V, generator=gen) < 0.5
        bitmask = sampling.pack_bitmask(allowed)
        assert bitmask.dtype == torch.int32 and bitmask.shape == (3, 4, (V + 31) // 32)
        assert torch.equal(sampling.unpack_bitmask(bitmask, V), allowed)
        assert torch.equal(_layout.unpack_bits(bitmask, V), allowed)
    assert sampling.unpack_bitmask(torch.tensor([-1], dtype=torch.int32), 32).all()  # bit 31: the sign bit


def test_processed_tree_logits_per_node():
    """Node i of request b: request b's parameters and node i's bitmask row."""
    gen = torch.Generator().manual_seed(9)
    B, T, V = 3, 4, 40
    logits = torch.randn(B, T, V, generator=gen)
    allowed = torch.rand(B, T, V, generator=gen) < 0.6
    allowed[..., 0] = True
    t, top_k = torch.tensor([0.0, 0.8, 1.3]), torch.tensor([0, 5, 2], dtype=torch.int32)
    top_p, min_p = torch.tensor([1.0, 0.7, 0.95]), torch.tensor([0.3, 0.0, 0.05])
    out = sampling.processed_tree_logits(logits, t, top_k, top_p, min_p, sampling.pack_bitmask(allowed))
    for b in range(B):
        for i in range(T):
            if b == 0:
                expected = ref.mask_disallowed(logits[b, i], allowed[b, i]) > -INF
            else:
                expected = ref.processed_keep(logits[b, i], float(t[b]), int(top_k[b]), float(top_p[b]),
                                              float(min_p[b]), allowed[b, i])
            assert torch.equal(out[b, i] > -INF, expected), (b, i)


def test_sampling_params_for_batch():
    """Numbers for all requests or one per request; the off values give None (the accept fast path);
    allowed_token_ids becomes one packed (B, W) mask, a row per node for accept."""
    off = sampling.SamplingParams.for_batch(3, 40, "cpu")
    assert all(x is None for x in off[:5]) and off.accept_kwargs(5) == dict(top_k=None, top_p=None, min_p=None,
                                                                               token_bitmask=None)
    p = sampling.SamplingParams.for_batch(3, 40, "cpu", top_k=[0, 5, 0], top_p=0.9, min_p=[0.0, 0.0, 0.0],
                                          allowed_token_ids=[3, 33, 39])
    assert p.top_k.tolist() == [0, 5, 0] and p.top_k.dtype == torch.int32 and p.min_p is None
    assert p.top_p.dtype == torch.float32 and p.top_p.shape == (3,)
    mask = p.accept_kwargs(4)["token_bitmask"]
    assert mask.shape == (3, 4, 2) and mask.dtype == torch.int32
    assert sampling.unpack_bitmask(mask, 40)[2, 3].nonzero().flatten().tolist() == [3, 33, 39]
    for kwargs, message in ((dict(top_k=[1, 2]), "top_k"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
                            (dict(allowed_token_ids=[40]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=message):
            sampling.SamplingParams.for_batch(3, 40, "cpu", **kwargs)


def test_drafter_samples_from_the_processed_law():
    """The drafters' sampler (drafters.base.sample) draws from exactly the processed law that accept is told
    q is (chi-square over 6000 draws of one row, never outside its support); greedy rows take the masked
    top tokens. Negative control: the unfiltered sampler fails the same test."""
    from scipy.stats import chi2

    from specdec.loop.drafters.base import DraftRandom, sample
    gen = torch.Generator().manual_seed(3)
    V, t, n = 24, 0.9, 6000
    logits = torch.randn(1, 1, V, generator=gen) * 2
    ids = [i for i in range(V) if i % 3 != 1]
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[ids] = True
    law = ref.processed_probs(logits[0, 0], t, 9, 0.9, 0.0, allowed)
    support = law > 0
    assert 3 <= int(support.sum()) < len(ids)  # the filters cut something, and leave a law to test
    threshold = chi2.ppf(0.999, int(support.sum()) - 1)

    def draw(params, temperature, k, rows=1):  # k children of each of `rows` copies of the row
        return sample(logits.expand(1, rows, V), torch.tensor([temperature]), k, DraftRandom([5], "cpu"),
                      False, params)[0]

    def statistic(params):
        counts = torch.bincount(draw(params, t, 1, rows=n).flatten(), minlength=V).double()
        expected = law[support] * n
        return float(((counts[support] - expected) ** 2 / expected).sum()), float(counts[~support].sum())

    params = sampling.SamplingParams.for_batch(1, V, "cpu", top_k=9, top_p=0.9, allowed_token_ids=ids)
    stat, outside = statistic(params)
    assert outside == 0 and stat < threshold, stat
    greedy = draw(params, 0.0, 3)[0].tolist()
    assert greedy == logits[0, 0].masked_fill(~allowed, -INF).topk(3).indices.tolist()
    stat, outside = statistic(sampling.SamplingParams())
    assert outside > 0 and stat > threshold


def test_chain_acceptance_probs_equal_the_reference():
    """Level d of a chain: sum_x min(p(x), q(x)), p and q the processed laws (temperature, top-k, top-p, min-p,
    allowed tokens) of the target's and the drafter's logits at node d - 1; p(x) of its token x for a given proposal
    (no draft logits)."""
    gen = torch.Generator().manual_seed(4)
    B, T, V = 3, 4, 12
    target, draft = torch.randn(B, T, V, generator=gen) * 2, torch.randn(B, T, V, generator=gen) * 2
    t = torch.tensor([0.7, 1.0, 1.3])
    allowed_ids = [i for i in range(V) if i != 5]
    params = sampling.SamplingParams.for_batch(B, V, "cpu", top_k=[0, 6, 9], top_p=[1.0, 0.9, 0.95],
                                               min_p=[0.0, 0.0, 0.05], allowed_token_ids=allowed_ids)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[allowed_ids] = True

    def law(logits, b, i):
        return ref.processed_probs(logits[b, i], float(t[b]), int(params.top_k[b]), float(params.top_p[b]),
                                   float(params.min_p[b]), allowed)

    tokens = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for d in range(1, T):
            tokens[b, d] = torch.multinomial(law(draft, b, d - 1).float(), 1, generator=gen)
    sampled = sampling.chain_acceptance_probs(target, tokens, draft, t, params)
    given = sampling.chain_acceptance_probs(target, tokens, None, t, params)
    assert sampled.shape == given.shape == (B, T - 1) and sampled.dtype == torch.float32
    for b in range(B):
        for d in range(1, T):
            x = tokens[b, d]
            p = law(target, b, d - 1)[x]
            overlap = torch.minimum(law(target, b, d - 1), law(draft, b, d - 1)).sum()
            assert float(sampled[b, d - 1]) == pytest.approx(float(overlap), rel=1e-5, abs=1e-7)
            assert float(given[b, d - 1]) == pytest.approx(float(p), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("draft_logits", [True, False], ids=["sampled draft", "given proposal"])
def test_chain_acceptance_probs_average_to_what_accept_accepts(draft_logits):
    """One level, 4000 requests (distinct seeds) with the same logits and drafts drawn from q: accept accepts at
    the rate the probabilities give, sum_x min(p(x), q(x)) (p(x) for a given proposal x)."""
    import specdec
    gen = torch.Generator().manual_seed(6)
    N, V, t = 4000, 10, 0.8
    row_p, row_q = torch.randn(V, generator=gen) * 1.5, torch.randn(V, generator=gen) * 1.5
    target = row_p.expand(N, 2, V).contiguous()
    p, q = torch.softmax(row_p.double() / t, 0), torch.softmax(row_q.double() / t, 0)
    tokens = torch.zeros(N, 2, dtype=torch.long)
    if draft_logits:
        draft = row_q.expand(N, 2, V).contiguous()
        tokens[:, 1] = torch.multinomial(q.float(), N, replacement=True, generator=gen)
        exact = float(torch.minimum(p, q).sum())
    else:
        draft = None
        tokens[:, 1] = int(p.argsort()[-2])  # (a likely token, not the likeliest)
        exact = float(p[tokens[0, 1]])
    parents = torch.tensor([-1, 0]).expand(N, 2)
    temperature = torch.full((N,), t)
    probs = sampling.chain_acceptance_probs(target, tokens, draft, temperature, sampling.SamplingParams())
    accepted = specdec.accept(target, tokens, parents, draft_logits=draft, temperature=temperature,
                              seeds=torch.arange(N)).num_accepted.double()
    torch.testing.assert_close(probs, torch.full((N, 1), exact, dtype=torch.float32))
    assert 0.2 < exact < 0.8 and abs(float(accepted.mean()) - exact) < 4 * math.sqrt(exact * (1 - exact) / N)


def test_greedy_below_on_the_drafter_side():
    """The drafter's processed law switches to greedy where accept does: below reference.GREEDY_BELOW (1e-5 as a
    float32) a row is only masked, at 1e-5 it is filtered; logits ~ 1e-5 so that the filters bite at t = 1e-5."""
    logits = (1e-5 * torch.tensor([2.0, 1.0, 0.0, -1.0, -INF])).expand(4, -1)
    t = torch.tensor([0.99e-5, 1e-12, 1e-40, 1e-5])
    allowed = torch.tensor([True, True, True, False, True]).expand(4, -1)
    args = dict(top_k=torch.full((4,), 2, dtype=torch.int32), top_p=torch.full((4,), 0.7), min_p=None, allowed=allowed)
    got = sampling.keep_mask(logits, t, **args)
    assert torch.equal(got, reference_keep(logits, t, **args))
    assert got.tolist() == [[True, True, True, False, False]] * 3 + [[True, False, False, False, False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_huge_logits_keep_their_law(dtype):
    """Rows near the dtype's largest finite value: the kept sets are those of the differences (t = 0.5: two tied
    tokens of mass 1/2 each, the rest 0), as the reference's, and chain_acceptance_probs' p is 1/2, not NaN."""
    big = torch.finfo(dtype).max
    logits = torch.tensor([[big, big, 0.0, -big, 1.0]], dtype=dtype)
    for filters in (dict(top_k=1), dict(top_p=0.4), dict(min_p=0.9)):
        got = sampling.keep_mask(logits, 0.5, **filters)
        assert torch.equal(got[0], ref.processed_keep(logits[0], 0.5, **filters)), filters
        assert got.tolist() == [[True, True, False, False, False]], filters
    assert ref.processed_probs(logits[0], 0.5).tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]
    if dtype == torch.float32:
        chain = logits.view(1, 1, 5).expand(1, 2, 5)
        p = sampling.chain_acceptance_probs(chain, torch.tensor([[0, 1]]), None, torch.tensor([0.5]),
                                            sampling.SamplingParams())
        assert p.tolist() == [[0.5]]


def test_drafter_sampler_at_tiny_temperatures_and_huge_logits():
    """The drafters' sampler follows accept's rules: below 1e-5 a request is greedy (the top tokens; 1e-40's
    softmax of logits / t was NaN), and a row is scaled as (x - max) / t (float32 [3e38, 3e38, 0, -3e38] at t = 0.5
    draws tokens 0 and 1 about equally; x / t overflowed to NaN)."""
    from specdec.loop.drafters.base import DraftRandom, sample
    logits = torch.tensor([[[0.1, 0.5, 0.2, 0.4]]])
    for t in (1e-40, 9.9e-6):
        drawn = sample(logits.expand(1, 8, 4), torch.tensor([t]), 2, DraftRandom([1], "cpu"), False)[0]
        assert drawn.tolist() == [[1, 3]] * 8
    huge = torch.tensor([[[3e38, 3e38, 0.0, -3e38]]])
    drawn = sample(huge.expand(1, 4000, 4), torch.tensor([0.5]), 1, DraftRandom([2], "cpu"), False)[0].flatten()
    counts = torch.bincount(drawn, minlength=4)
    assert counts[2:].sum() == 0 and 1800 < counts[0] < 2200, counts


def random_penalties(gen, N, V, K=4, S=3):
    """Per-row step-0 arguments of penalized_logits: counts with zeros, a prompt mask, penalties with neutral rows,
    logit biases with repeated ids and padding, min-tokens on for some rows."""
    counts = torch.randint(0, 3, (N, V), generator=gen, dtype=torch.int32) * (torch.rand(N, V, generator=gen) < 0.4)
    in_prompt = torch.rand(N, V, generator=gen) < 0.3
    rep = torch.rand(N, generator=gen) * 1.5 + 0.5
    rep[::3] = 1.0
    freq = torch.randn(N, generator=gen)
    freq[1::3] = 0.0
    pres = torch.randn(N, generator=gen)
    pres[2::3] = 0.0
    bias_ids = torch.randint(-1, min(V, 3), (N, K), generator=gen, dtype=torch.int32)  # (few ids: repeats)
    bias_values = torch.randn(N, K, generator=gen) * 3
    generated = counts.sum(-1)
    min_tokens = (generated + torch.randint(-2, 3, (N,), generator=gen)).clamp(min=0).to(torch.int32)
    stop_ids = torch.randint(-1, V, (N, S), generator=gen, dtype=torch.int32)
    return dict(counts=counts, prompt_token_mask=_layout.pack_bitmask(in_prompt), repetition_penalty=rep,
                frequency_penalty=freq, presence_penalty=pres, logit_bias_ids=bias_ids, logit_bias_values=bias_values,
                min_tokens=min_tokens, stop_token_ids=stop_ids)


def reference_penalized(logits, args):
    """reference.penalized_row of each row, its NodePenalties from the per-row arguments."""
    N, V = logits.shape
    rows = []
    for i in range(N):
        def get(name, off):
            x = args.get(name)
            return off if x is None else float(x[i])
        counts = args.get("counts")
        mask = args.get("prompt_token_mask")
        bias = () if args.get("logit_bias_ids") is None else tuple(
            (int(x), float(v)) for x, v in zip(args["logit_bias_ids"][i].tolist(),
                                               args["logit_bias_values"][i].tolist()) if x >= 0)
        stop = None
        if args.get("min_tokens") is not None and int(counts[i].sum()) < int(args["min_tokens"][i]):
            stop = torch.zeros(V, dtype=torch.bool)
            stop[[x for x in args["stop_token_ids"][i].tolist() if x >= 0]] = True
        pen = ref.NodePenalties(None if counts is None else counts[i].long(),
                                None if mask is None else _layout.unpack_bitmask(mask[i], V),
                                get("repetition_penalty", 1.0), get("frequency_penalty", 0.0),
                                get("presence_penalty", 0.0), bias, stop)
        rows.append(ref.penalized_row(logits[i], pen))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("which", ["all", "repetition_penalty", "frequency_penalty", "presence_penalty",
                                   "logit_bias", "min_tokens"])
def test_penalized_logits_equal_the_reference_bit_for_bit(dtype, which):
    gen = torch.Generator().manual_seed(11)
    for V in (1, 7, 45):
        N = 30
        logits = (torch.randn(N, V, generator=gen) * 3).to(dtype)
        logits[torch.rand(N, V, generator=gen) < 0.1] = -INF
        logits[torch.rand(N, V, generator=gen) < 0.1] = 0.0
        args = random_penalties(gen, N, V)
        if which != "all":
            keep = {"counts", "prompt_token_mask", which} | ({"logit_bias_ids", "logit_bias_values"} if which ==
                                                             "logit_bias" else set()) | \
                ({"stop_token_ids"} if which == "min_tokens" else set())
            args = {k: v for k, v in args.items() if k in keep}
        got = sampling.penalized_logits(logits, **args)
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        want = reference_penalized(logits, args)
        # bit for bit: the same values, and -0.0 where the reference has -0.0
        assert torch.equal(got.double(), want) and torch.equal(got.double().signbit(), want.signbit()), (which, V)


def test_penalized_logits_without_a_penalty_or_bias_is_the_row():
    logits = torch.randn(4, 9)
    assert torch.equal(sampling.penalized_logits(logits), logits)
    with pytest.raises(ValueError, match="counts"):
        sampling.penalized_logits(logits, frequency_penalty=torch.ones(4))


def test_node_counts_are_the_output_counts_plus_each_path():
    gen = torch.Generator().manual_seed(2)
    B, T, V = 3, 9, 6
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 5, 6, 2], [-1, 0, 1, 2, 3, 4, 5, 6, 7], [-1] + [0] * 8])
    tokens = torch.randint(0, V, (B, T), generator=gen)
    base = torch.randint(0, 4, (B, V), generator=gen, dtype=torch.int32)
    got = sampling.node_counts(base, tokens, parents)
    assert got.dtype == torch.int32
    for b in range(B):
        for i in range(T):
            want = ref.node_penalties(b, ref.path_tokens(parents[b].tolist(), tokens[b].tolist(), i), V,
                                      output_token_counts=base).counts
            assert torch.equal(got[b, i].long(), want), (b, i)


@pytest.mark.parametrize("filter_order", ref.FILTER_ORDERS)
def test_process_with_penalties_is_the_reference_law_at_each_node(filter_order):
    """SamplingParams.process (what a drafter samples from) with step 0 at each node's counts: the reference's
    processed law of the node (accept's q), tokens kept and probabilities to float rounding."""
    gen = torch.Generator().manual_seed(8)
    B, T, V = 3, 5, 30
    prompts = [[1, 2, 3], [4], [5, 5, 6]]
    pen = sampling.Penalties.for_batch(prompts, V, "cpu", repetition_penalty=[1.3, 1.0, 0.8], frequency_penalty=0.4,
                                       presence_penalty=[0.0, 0.5, -0.3], logit_bias=[{2: 3.0}, None, {7: -1.5}],
                                       min_tokens=[0, 2, 6], stop_token_ids=[[0], [0, 1], [9]])
    pen.output_token_counts.copy_(torch.randint(0, 2, (B, V), generator=gen, dtype=torch.int32))
    params = sampling.SamplingParams.for_batch(B, V, "cpu", top_k=[0, 6, 9], top_p=[1.0, 0.9, 0.95],
                                               min_p=[0.1, 0.0, 0.05])
    params = params._replace(penalties=pen, filter_order=filter_order)
    parents = torch.tensor([[-1, 0, 1, 1, 2]] * B)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    logits = torch.randn(B, T, V, generator=gen) * 2
    t = torch.tensor([0.7, 1.0, 1.3])
    x = params.process(logits, t, pen.node_counts(tokens, parents))
    law = torch.softmax(x.double() / t.double().view(B, 1, 1), -1)
    step0 = pen.accept_kwargs()
    bias = step0.pop("logit_bias")
    step0.update(logit_bias_ids=bias[0], logit_bias_values=bias[1])
    for b in range(B):
        for i in range(T):
            node = ref.node_penalties(b, ref.path_tokens(parents[b].tolist(), tokens[b].tolist(), i), V, **step0)
            want = ref.processed_probs(ref.penalized_row(logits[b, i], node), float(t[b]), int(params.top_k[b]),
                                       float(params.top_p[b]), float(params.min_p[b]), None, filter_order)
            assert torch.equal(law[b, i] > 0, want > 0), (b, i)
            torch.testing.assert_close(law[b, i], want, rtol=1e-6, atol=1e-7)


def test_penalties_for_batch():
    """Off everywhere gives None; per-request values; the prompt mask only with a repetition penalty; the
    arguments refused name themselves."""
    prompts = [[1, 2], [3]]
    assert sampling.Penalties.for_batch(prompts, 10, "cpu") is None
    assert sampling.Penalties.for_batch(prompts, 10, "cpu", stop_token_ids=[2]) is None  # (min_tokens off)
    pen = sampling.Penalties.for_batch(prompts, 10, "cpu", repetition_penalty=[1.0, 1.2], logit_bias={4: 1.0},
                                       min_tokens=[3, 0], stop_token_ids=[[2], [2, 5]])
    assert pen.output_token_counts.shape == (2, 10) and int(pen.output_token_counts.sum()) == 0
    assert _layout.unpack_bitmask(pen.prompt_token_mask, 10).nonzero().tolist() == [[0, 1], [0, 2], [1, 3]]
    assert pen.logit_bias_ids.tolist() == [[4], [4]] and pen.stop_token_ids.tolist() == [[2, -1], [2, 5]]
    assert pen.frequency_penalty is None and pen.min_tokens.tolist() == [3, 0]
    for kwargs, name in ((dict(repetition_penalty=0.0), "repetition_penalty"),
                         (dict(frequency_penalty=[1.0]), "frequency_penalty"),
                         (dict(presence_penalty=math.nan), "presence_penalty"),
                         (dict(logit_bias={10: 1.0}), "logit_bias"), (dict(logit_bias={1: math.inf}), "logit_bias"),
                         (dict(min_tokens=-1), "min_tokens"),
                         (dict(min_tokens=2, stop_token_ids=[-1]), "stop_token_ids")):
        with pytest.raises(ValueError, match=name):
            sampling.Penalties.for_batch(prompts, 10, "cpu", **kwargs)


def test_penalties_for_batch_padding_rows_are_off():
    """padding: rows after the requests' with every argument off (a batch padded to its bucket)."""
    pen = sampling.Penalties.for_batch([[1], [2]], 10, "cpu", repetition_penalty=[1.5, 2.0], logit_bias={4: 1.0},
                                       min_tokens=3, stop_token_ids=[5], padding=2)
    assert pen.repetition_penalty.tolist() == [1.5, 2.0, 1.0, 1.0] and pen.output_token_counts.shape == (4, 10)
    assert pen.logit_bias_ids.tolist() == [[4], [4], [-1], [-1]] and pen.min_tokens.tolist() == [3, 3, 0, 0]
    assert _layout.unpack_bitmask(pen.prompt_token_mask, 10)[2:].sum() == 0
    assert pen.first_on() == "repetition_penalty"
    with pytest.raises(ValueError, match="stop_token_ids"):
        sampling.Penalties.for_batch([[1]], 10, "cpu", min_tokens=3)
