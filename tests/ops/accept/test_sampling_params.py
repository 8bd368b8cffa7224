"""accept's sampling parameters beyond the filters: penalties, logit bias and min-tokens (step 0 of each node's law,
along the node's path), the filter order, and the logprobs of the emitted tokens.

First the reference on hand-made trees whose results follow from the definitions (each fails if the path's draft
tokens are not counted, a token in both the prompt and the path is penalized twice, a repeated bias entry is
dropped, or min-tokens does not count the path); then every backend against the reference on random trees:
greedy results and logprobs exactly (logprobs to 1e-5), the sampled laws at every emitted position (their kept
sets exactly, their values to 1e-5, seen through processed logprobs of the whole vocabulary, V <= 20), and the
drafter's law processed like the target's. Losslessness under path-dependent penalties: test_lossless.py."""
from __future__ import annotations

import math

import pytest
import torch

import specdec
from specdec import _validation as val
from specdec import reference as ref
from specdec._layout import pack_bitmask
from tests.helpers import BACKENDS, on_backend, random_trees

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the interpreter's log(0))

V = 19  # <= 20 = the most logprobs: return_logprobs=V shows a position's whole law
NAN = float("nan")
LOGPROB_TOL = 1e-5
# the fields of a normalized SamplingParams that are step 0's arguments of reference.accept
STEP0_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "output_token_counts",
                "prompt_token_mask", "logit_bias_ids", "logit_bias_values", "min_tokens", "stop_token_ids")


def _accept(backend, **args):
    """specdec.accept on `backend` -> (accepted_nodes, num_accepted, next_tokens, token_logprobs, top_logprobs,
    top_token_ids, token_ranks) on the CPU (the last four None without logprobs)."""
    res = specdec.accept(**on_backend(backend, args), backend=backend)
    lp = (None,) * 4 if res.logprobs is None else tuple(x.cpu() for x in res.logprobs)
    return tuple(x.cpu() for x in res) + lp


def _counts(B, gen, total=None):
    counts = torch.zeros(B, V, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(0, 6, (), generator=gen)) if total is None else total
        counts[b].index_add_(0, torch.randint(0, V, (n,), generator=gen), torch.ones(n, dtype=torch.int32))
    return counts


def _random_params(B, gen, which="all"):
    """Random step-0 arguments (each request its own, some neutral), restricted to `which`."""
    counts = _counts(B, gen)
    K, S = 4, 2
    bias_ids = torch.randint(-1, V, (B, K), generator=gen)
    bias_ids[:, 1] = bias_ids[:, 0]  # a repeated entry: both add
    params = dict(
        repetition_penalty=(torch.rand(B, generator=gen) * 1.5 + 0.5).where(torch.rand(B, generator=gen) < 0.8, 1.0),
        frequency_penalty=(torch.rand(B, generator=gen) * 1.5 - 0.5).where(torch.rand(B, generator=gen) < 0.8, 0.0),
        presence_penalty=(torch.rand(B, generator=gen) * 1.5 - 0.5).where(torch.rand(B, generator=gen) < 0.8, 0.0),
        prompt_token_mask=pack_bitmask(torch.rand(B, V, generator=gen) < 0.3),
        logit_bias=(bias_ids, torch.randn(B, K, generator=gen) * 2),
        # min-tokens reached at a random depth of the tree (or never, or before it)
        min_tokens=counts.sum(-1) + torch.randint(-1, 5, (B,), generator=gen).clamp(min=0),
        stop_token_ids=torch.randint(-1, V, (B, S), generator=gen))
    if which != "all":
        params = {k: v for k, v in params.items()
                  if k.startswith(which) or (which == "min_tokens" and k == "stop_token_ids")}
        if which == "repetition_penalty":
            params["prompt_token_mask"] = pack_bitmask(torch.rand(B, V, generator=gen) < 0.3)
    if any(k.endswith("penalty") or k == "min_tokens" for k in params):
        params["output_token_counts"] = counts
    return params


def _random_batch(B, T, gen, *, dtype=torch.float32, draft=False, temperature=0.0, probs=False, greedy_paths=True):
    """Random trees whose draft tokens often are the argmax of their parent's penalized row (long greedy paths
    need them: the penalties move the argmax along the path) -- approximated by the raw argmax here, and by
    the drafter's own draws with draft logits."""
    parents, num_nodes = random_trees(B, T, gen)
    target = torch.randn(B, T, V, generator=gen) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    draft_logits = torch.randn(B, T, V, generator=gen) if draft else None
    best = target.argmax(-1)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            p = int(parents[b, i])
            if draft:
                tokens[b, i] = int(torch.multinomial(torch.softmax(draft_logits[b, p].double(), -1), 1, generator=gen))
            elif greedy_paths and torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = best[b, p]
    temp = temperature if isinstance(temperature, torch.Tensor) else torch.full((B,), float(temperature))
    batch = dict(tokens=tokens, parents=parents, num_nodes=num_nodes, temperature=temp,
                 seeds=torch.randint(0, 2**62, (B,), generator=gen))
    if probs:
        batch["target_probs"] = torch.softmax(target.double(), -1).to(dtype)
        if draft:
            batch["draft_probs"] = torch.softmax(draft_logits.double(), -1).to(dtype)
    else:
        batch["target_logits"] = target.to(dtype)
        if draft:
            batch["draft_logits"] = draft_logits.to(dtype)
    return batch


def _assert_same(got, want, what=""):
    """Results equal: indices exactly, logprobs to LOGPROB_TOL (NaN where the reference has NaN)."""
    for name, x, y in zip(("accepted_nodes", "num_accepted", "next_tokens", "token_logprobs", "top_logprobs",
                           "top_token_ids", "token_ranks"), got, want):
        if y is None:
            assert x is None, f"{what}{name}: expected None"
        elif y.is_floating_point():
            torch.testing.assert_close(x, y, atol=LOGPROB_TOL, rtol=0, equal_nan=True, msg=f"{what}{name}")
        else:
            assert torch.equal(x, y), f"{what}{name}: {x.tolist()} != {y.tolist()}"


# ------------------------------------------------------------------------------------------------
# the reference (and every backend) on hand-made trees
# ------------------------------------------------------------------------------------------------
def _chain_rows(T, values):
    """(1, T, V) logits: every row -3 except values {token: logit}."""
    row = torch.full((V,), -3.0)
    for x, v in values.items():
        row[x] = v
    return row.expand(1, T, V).clone()


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_repeated_draft_tokens_along_a_path_add_to_the_counts(backend):
    """Token 5 drafted three times along a chain, once in the output: with a frequency penalty of 1 its logit is
    10 - 2 at node 1 and 10 - 3 < 7.5 at node 2, where token 7 wins. Counting only the output accepts all three."""
    counts = torch.zeros(1, V, dtype=torch.int32)
    counts[0, 5] = 1
    args = dict(target_logits=_chain_rows(4, {5: 10.0, 7: 7.5}), tokens=torch.tensor([[9, 5, 5, 5]]),
                parents=torch.tensor([[-1, 0, 1, 2]]), temperature=0.0, seeds=torch.zeros(1, dtype=torch.int64),
                frequency_penalty=1.0, output_token_counts=counts, return_logprobs=2, logprobs_mode="processed")
    acc, num, nxt, lp, top, top_ids, ranks = _accept(backend, **args)
    assert acc.tolist() == [[0, 1, 2, -1]] and num.tolist() == [2] and nxt.tolist() == [7]
    # the processed (greedy: temperature 1) law at node 2: token 5 at 10 - 3 = 7, token 7 at 7.5, the rest -3
    row = torch.full((V,), -3.0, dtype=torch.float64)
    row[5], row[7] = 7.0, 7.5
    law = torch.log_softmax(row, 0)
    assert top_ids[0, 2].tolist() == [7, 5]
    torch.testing.assert_close(top[0, 2], law[[7, 5]].float(), atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(lp[0, :3], torch.log_softmax(torch.stack([
        row.clone().index_fill_(0, torch.tensor([5]), 9.0), row.clone().index_fill_(0, torch.tensor([5]), 8.0),
        row]), -1)[[0, 1, 2], [5, 5, 7]].float(), atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_a_token_in_the_prompt_and_the_path_is_penalized_once(backend):
    """Repetition penalty 2 on token 3, which is in the prompt and drafted at node 1: its logit 4 becomes 2 at
    node 1 (> 1.5, token 6: accepted), not 1 (penalized twice). Token 8 (logit -2, seen): -4."""
    prompt = pack_bitmask(torch.zeros(1, V, dtype=torch.bool).index_fill_(1, torch.tensor([3, 8]), True))
    args = dict(target_logits=_chain_rows(3, {3: 4.0, 6: 1.5, 8: -2.0}), tokens=torch.tensor([[0, 3, 3]]),
                parents=torch.tensor([[-1, 0, 1]]), temperature=0.0, seeds=torch.zeros(1, dtype=torch.int64),
                repetition_penalty=2.0, output_token_counts=torch.zeros(1, V, dtype=torch.int32),
                prompt_token_mask=prompt, return_logprobs=3, logprobs_mode="processed")
    acc, num, nxt, lp, top, top_ids, ranks = _accept(backend, **args)
    assert num.tolist() == [2] and nxt.tolist() == [3]
    row = torch.full((V,), -3.0, dtype=torch.float64)
    row[3], row[6], row[8] = 2.0, 1.5, -4.0
    assert top_ids[0, 2].tolist() == [3, 6, 0]  # ties at -3: the lowest id
    torch.testing.assert_close(top[0, 2], torch.log_softmax(row, 0)[[3, 6, 0]].float(), atol=LOGPROB_TOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_logit_bias_moves_the_argmax_and_repeated_entries_add(backend):
    """Token 2 (logit 1) against token 4 (1.5): two bias entries of 0.3 on token 2 make it the argmax (1.6); one
    would not (1.3). A padding entry (-1) is skipped."""
    args = dict(target_logits=_chain_rows(2, {2: 1.0, 4: 1.5}), tokens=torch.tensor([[0, 2]]),
                parents=torch.tensor([[-1, 0]]), temperature=0.0, seeds=torch.zeros(1, dtype=torch.int64))
    bias = (torch.tensor([[2, -1, 2]]), torch.tensor([[0.3, 5.0, 0.3]]))
    assert _accept(backend, **args, logit_bias=bias)[1].tolist() == [1]
    once = (torch.tensor([[2, -1, -1]]), torch.tensor([[0.3, 5.0, 0.3]]))
    assert _accept(backend, **args, logit_bias=once)[1].tolist() == [0]


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_min_tokens_ends_at_a_node_inside_the_tree(backend):
    """3 tokens generated, min_tokens 5, stop token 0 the largest logit everywhere: at node 0 (3 generated) and
    node 1 (4) it is masked, so the drafted token 1 is the argmax (node 4, token 0 under node 1, is rejected);
    at node 2 (5 generated) token 0 is allowed again and wins: node 3 (token 0) is accepted, then token 0 again."""
    counts = torch.zeros(1, V, dtype=torch.int32)
    counts[0, 1] = 3
    args = dict(target_logits=_chain_rows(5, {0: 9.0, 1: 5.0}), tokens=torch.tensor([[1, 1, 1, 0, 0]]),
                parents=torch.tensor([[-1, 0, 1, 2, 1]]), temperature=0.0, seeds=torch.zeros(1, dtype=torch.int64),
                min_tokens=5, stop_token_ids=torch.tensor([[0, -1]]), output_token_counts=counts)
    acc, num, nxt, *_ = _accept(backend, **args)
    assert acc.tolist() == [[0, 1, 2, 3, -1]] and nxt.tolist() == [0]
    acc, num, nxt, *_ = _accept(backend, **dict(args, min_tokens=6))  # not yet at node 2: token 1 wins there
    assert acc.tolist() == [[0, 1, 2, -1, -1]] and nxt.tolist() == [1]


def test_penalized_row_arithmetic_is_vllms_float32():
    """Each step one float32 operation in vLLM's order: the bias first (a repetition penalty scales the biased
    logit of token 3), then x * (1 / r) above 0 (which differs from x / r for 5 and r = 3), frequency and
    presence."""
    x = torch.tensor([5.0, -1.0, 0.7, 7.0] + [0.0] * (V - 4))
    counts = torch.zeros(V, dtype=torch.long)
    counts[[0, 1]] = torch.tensor([2, 1])
    in_prompt = torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.tensor([3]), True)
    pen = ref.NodePenalties(counts=counts, in_prompt=in_prompt, repetition=3.0, frequency=0.25, presence=0.5,
                            bias=((2, 1.0), (2, 0.1), (3, 2.0)))
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    inv = f32(1.0) / f32(3.0)
    assert f32(5.0) * inv != f32(5.0) / f32(3.0)
    want = [f32(5.0) * inv - f32(0.25) * f32(2.0) - f32(0.5), f32(-1.0) * f32(3.0) - f32(0.25) - f32(0.5),
            f32(0.7) + f32(1.0) + f32(0.1), (f32(7.0) + f32(2.0)) * inv]
    assert ref.penalized_row(x, pen)[:4].tolist() == [float(w) for w in want]


def test_penalized_row_saturates_where_float32_overflows():
    """A huge finite logit biased or scaled past float32's range becomes its largest value, not +inf (which would
    make the law NaN); one pushed below becomes the lowest finite value; a frequency penalty whose f * count
    overflows subtracts the clamped product; an impossible token (-inf) stays impossible whatever the step adds
    (-inf - (-inf) would be NaN); nothing that stays in range changes."""
    top = torch.finfo(torch.float32).max
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    x = f32([3e38, -3e38, -math.inf, 2e38, 1.0] + [0.0] * (V - 5))
    big, small, mid = (float(v) for v in x[[0, 1, 3]])
    counts = torch.zeros(V, dtype=torch.long)
    counts[[0, 1, 2, 4]] = 1

    def step0(counts=None, repetition=1.0, frequency=0.0, bias=()):
        return ref.penalized_row(x, ref.NodePenalties(counts=counts, in_prompt=None, repetition=repetition,
                                                      frequency=frequency, presence=0.0, bias=bias))[:5].tolist()
    assert step0(bias=((0, 3e38), (2, 3e38), (4, 2.0))) == [top, small, -math.inf, mid, 3.0]
    assert step0(counts, repetition=0.5) == [top, float(f32(small) * 0.5), -math.inf, mid, 2.0]
    assert step0(counts, repetition=2.0)[:2] == [float(f32(big) * f32(0.5)), -top]
    counts[[0, 1, 2]] = 2  # f * count = 6e38: clamped to the largest float32 before it is subtracted
    assert step0(counts, frequency=-3e38) == [top, float(f32(small) + top), -math.inf, mid, float(1.0 + f32(3e38))]


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_overflowing_penalties_give_the_references_tokens_inside_the_grammar(backend, temperature):
    """Rows whose step 0 overflows float32 (a bias or a repetition penalty on a logit near 3e38): every backend
    samples from the saturated law, the reference's (a point mass on the saturated token: its draft is accepted),
    and never a token the grammar forbids (a NaN law on the C++ and Triton backends emitted token 0 here)."""
    B, T = 2, 3
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(7))
    logits[:, :, 3] = 3e38
    allowed = torch.zeros(B, T, V, dtype=torch.bool)
    allowed[:, :, [3, 5, 6]] = True
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[:, 3] = 1
    args = dict(target_logits=logits, tokens=torch.tensor([[0, 3, 5], [0, 5, 3]]),
                parents=torch.tensor([[-1, 0, 1], [-1, 0, 1]]), temperature=temperature,
                seeds=torch.arange(B, dtype=torch.int64), token_bitmask=pack_bitmask(allowed))
    for step0 in (dict(repetition_penalty=0.5, output_token_counts=counts),
                  dict(logit_bias=(torch.tensor([[3], [3]]), torch.tensor([[3e38], [3e38]])))):
        got = _accept(backend, **args, **step0)
        assert torch.equal(got[0], torch.tensor([[0, 1, -1], [0, -1, -1]])) and got[2].tolist() == [3, 3]
        norm = val.check_sampling_params(V, B, logits.device, **step0)
        want = ref.accept(logits, args["tokens"], args["parents"], None, torch.full((B,), float(temperature)),
                          args["seeds"], torch.full((B,), T, dtype=torch.int32), 0, token_bitmask=args["token_bitmask"],
                          **{k: getattr(norm, k) for k in STEP0_FIELDS})
        assert all(torch.equal(g, w.cpu()) for g, w in zip(got[:3], want[:3]))



# ------------------------------------------------------------------------------------------------
# every backend against the reference on random trees
# ------------------------------------------------------------------------------------------------
def _law_at(batch, params, b, node, mode):
    """The reference's (values, log-law) of the emitted position whose parent row is node `node` of request b."""
    probs = "target_probs" in batch
    rows = batch["target_probs"].double().log() if probs else batch["target_logits"]
    norm = val.check_sampling_params(V, rows.shape[0], rows.device, **params)
    step0 = {k: getattr(norm, k) for k in STEP0_FIELDS}
    path = ref.path_tokens(batch["parents"][b].tolist(), batch["tokens"][b].tolist(), node)
    pen = ref.node_penalties(b, path, V, **step0)
    top_k, top_p, min_p = (batch.get(k) for k in ("top_k", "top_p", "min_p"))
    k = 0 if top_k is None else int(top_k[b])
    p_top = 1.0 if top_p is None else float(top_p[b])
    p_min = 0.0 if min_p is None else float(min_p[b])
    return ref.log_law(rows[b, node], ref.penalized_row(rows[b, node], pen), None, float(batch["temperature"][b]),
                       k, p_top, p_min, batch.get("filter_order", "hf"), mode)


def _filters(B, gen):
    return dict(top_k=torch.randint(0, V, (B,), generator=gen, dtype=torch.int32),
                top_p=(torch.rand(B, generator=gen) * 0.6 + 0.4).where(torch.rand(B, generator=gen) < 0.7, 1.0),
                min_p=(torch.rand(B, generator=gen) * 0.3).where(torch.rand(B, generator=gen) < 0.6, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("which", ["all", "repetition_penalty", "frequency_penalty", "presence_penalty",
                                   "logit_bias", "min_tokens"])
def test_greedy_results_and_logprobs_equal_the_reference(backend, dtype, which):
    """Greedy: the paths, next tokens, logprobs (raw and processed) and top logprobs of the reference."""
    gen = torch.Generator().manual_seed(4300 + len(which) + dtype.itemsize)
    B, T = 6, 6
    batch = _random_batch(B, T, gen, dtype=dtype)
    params = _random_params(B, gen, which)
    for mode in ("raw", "processed"):
        args = dict(batch, **params, return_logprobs=5, logprobs_mode=mode)
        _assert_same(_accept(backend, **args), _accept("torch", **args), f"{mode}: ")


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_with_probabilities_equals_the_reference(backend):
    gen = torch.Generator().manual_seed(4310)
    batch = _random_batch(6, 5, gen, probs=True)
    args = dict(batch, **_random_params(6, gen), return_logprobs=4, logprobs_mode="processed")
    _assert_same(_accept(backend, **args), _accept("torch", **args))


def _check_laws_at_the_emitted_positions(got, batch, params, mode):
    """Every emitted position's whole law (top logprobs of V entries) is the reference's at that node: the same
    kept set, values to LOGPROB_TOL, the emitted token's logprob among them and its rank (vLLM's: the tokens whose
    logprob is at least its own); padding NaN / -1."""
    acc, num, nxt, lp, top, top_ids, ranks = got
    for b in range(acc.shape[0]):
        n = int(num[b])
        path = acc[b, : n + 1].tolist()
        emitted = batch["tokens"][b, path[1:]].tolist() + [int(nxt[b])]
        for j, (node, token) in enumerate(zip(path, emitted)):
            values, law = _law_at(batch, params, b, node, mode)
            kept = torch.isfinite(law)
            assert kept[token], f"request {b} position {j}: emitted token {token} outside the law"
            order = torch.sort(values, descending=True, stable=True).indices
            assert top_ids[b, j].tolist() == order.tolist(), f"request {b} position {j}"
            torch.testing.assert_close(top[b, j], law[order].float(), atol=LOGPROB_TOL, rtol=0, equal_nan=False)
            torch.testing.assert_close(lp[b, j], law[token].float(), atol=LOGPROB_TOL, rtol=0)
            assert int(ranks[b, j]) == int((law >= law[token]).sum()), f"request {b} position {j}: rank"
        assert lp[b, n + 1:].isnan().all() and top[b, n + 1:].isnan().all() and top_ids[b, n + 1:].eq(-1).all()
        assert ranks[b, n + 1:].eq(-1).all()


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@pytest.mark.parametrize("filter_order", ["hf", "vllm", "sglang"])
@pytest.mark.parametrize("draft", [False, True], ids=["given", "draft_logits"])
def test_sampled_laws_equal_the_reference_at_every_emitted_position(backend, filter_order, draft):
    """Sampling with every parameter, the filters in `filter_order`: the processed law at each emitted position
    (read whole through return_logprobs=V) is the reference's, kept set included."""
    gen = torch.Generator().manual_seed(4320 + len(filter_order) + draft)
    B, T = 8, 5
    temps = torch.tensor([1.0, 0.7, 1.3, 0.0, 0.9, 1.0, 1.1, 0.6])
    batch = dict(_random_batch(B, T, gen, temperature=temps, draft=draft), **_filters(B, gen),
                 filter_order=filter_order)
    params = _random_params(B, gen)
    got = _accept(backend, **batch, **params, return_logprobs=V, logprobs_mode="processed")
    _check_laws_at_the_emitted_positions(got, batch, params, "processed")
    raw = _accept(backend, **batch, **params, return_logprobs=V, logprobs_mode="raw")
    assert all(torch.equal(x, y) for x, y in zip(raw[:3], got[:3]))  # (logprobs change no draw)
    _check_laws_at_the_emitted_positions(raw, batch, params, "raw")


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@pytest.mark.parametrize("draft", [False, True], ids=["given", "draft_logits"])
def test_raw_logprobs_of_penalized_rows_sampled_at_temperature_one(backend, draft):
    """Raw logprobs of sampled rows at temperature 1 with penalties and no filter or mask: the case where a
    backend may take the raw row's exp sum and top entries from the walk's own pass (the law differs from the raw
    row only at the penalized tokens) and must still rank the token it draws after that pass."""
    gen = torch.Generator().manual_seed(4330 + draft)
    B, T = 8, 5
    batch = _random_batch(B, T, gen, temperature=torch.ones(B), draft=draft)
    params = dict(frequency_penalty=torch.full((B,), 0.3), output_token_counts=_counts(B, gen, total=2))
    got = _accept(backend, **batch, **params, return_logprobs=V, logprobs_mode="raw")
    _check_laws_at_the_emitted_positions(got, batch, params, "raw")

@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@pytest.mark.parametrize("filter_order", ["hf", "vllm", "sglang"])
@pytest.mark.parametrize("method", ["block", "traversal"])
def test_sampled_laws_of_block_and_traversal_paths_equal_the_reference(backend, filter_order, method):
    """The processed laws at the emitted positions of block verification's chains and traversal's trees (paths a
    node of which may be left and re-entered, or its law taken again) are the reference's, kept sets included: a
    backend that takes a filtered row's threshold from the walk must have it for every node of these paths."""
    gen = torch.Generator().manual_seed(4326 + len(filter_order) + len(method))
    B, T = 8, 5
    temps = torch.tensor([1.0, 0.7, 1.3, 0.0, 0.9, 1.0, 1.1, 0.6])
    batch = dict(_random_batch(B, T, gen, temperature=temps), **_filters(B, gen), filter_order=filter_order)
    if method == "block":
        batch["parents"] = torch.arange(-1, T - 1).expand(B, T).clone()
    draft = batch["target_logits"] + 0.2 * torch.randn(B, T, V, generator=gen)
    for b in range(B):  # tokens from the filtered draft law at their parent (before step 0): long paths
        filters = ref.request_filters(b, batch["top_k"], batch["top_p"], batch["min_p"])
        for i in range(1, int(batch["num_nodes"][b])):
            law = ref.processed_probs(draft[b, int(batch["parents"][b, i])], max(float(temps[b]), 0.5), *filters,
                                      filter_order=filter_order)
            batch["tokens"][b, i] = int(torch.multinomial(law, 1, generator=gen))
    batch["draft_logits"] = draft
    params = _random_params(B, gen)
    got = _accept(backend, **batch, **params, method=method, return_logprobs=V, logprobs_mode="processed")
    _check_laws_at_the_emitted_positions(got, batch, params, "processed")
    assert int(got[1].max()) >= 2


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@pytest.mark.parametrize("method", ["token", "block", "traversal"])
def test_the_drafters_law_gets_the_same_step0(backend, method):
    """Draft logits equal to the target's: with q processed like p at each node (same path counts), q = p and
    every drafted token with p > 0 is accepted (u q(x) < p(x)). A q without step 0 differs from p wherever a
    penalty moved it, and rejects some. Block verification: chains only."""
    gen = torch.Generator().manual_seed(4330 + len(method))
    B, T = 8, 5
    batch = _random_batch(B, T, gen, temperature=torch.rand(B, generator=gen) * 0.8 + 0.6, greedy_paths=False)
    if method == "block":
        batch["parents"] = torch.arange(-1, T - 1).expand(B, T).clone()
    params = _random_params(B, gen)
    params.pop("min_tokens"), params.pop("stop_token_ids")  # (a masked draft would be rejected: r = q = 0 there)
    batch["draft_logits"] = batch["target_logits"]
    acc, num, *_ = _accept(backend, **batch, **params, method=method)
    want = _accept("torch", **batch, **params, method=method)
    assert torch.equal(acc, want[0]) and torch.equal(num, want[1])
    if method == "token":  # each node's first child is accepted: the path of first children
        for b in range(B):
            kids = ref.children_of(batch["parents"][b].tolist(), int(batch["num_nodes"][b]))
            node, depth = 0, 0
            while kids[node]:
                node, depth = kids[node][0], depth + 1
            assert int(num[b]) == depth, f"request {b}: accepted {int(num[b])} of its first-children path's {depth}"
    assert int(num.sum()) >= B


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_give_the_padded_results(backend):
    gen = torch.Generator().manual_seed(4340)
    B, T = 5, 5
    batch = dict(_random_batch(B, T, gen, temperature=torch.tensor([0.0, 1.0, 0.8, 0.0, 1.2])), **_filters(B, gen))
    params = dict(_random_params(B, gen), return_logprobs=3, logprobs_mode="processed")
    padded = _accept(backend, **batch, **params)
    nn = batch["num_nodes"]
    pack = lambda x: torch.cat([x[b, : int(nn[b])] for b in range(B)])  # noqa: E731
    packed = dict(batch, target_logits=pack(batch["target_logits"]), tokens=pack(batch["tokens"]),
                  parents=pack(batch["parents"]), cu_num_nodes=torch.cat([torch.zeros(1, dtype=torch.int32),
                                                                          nn.cumsum(0).int()]), max_nodes=T)
    del packed["num_nodes"]
    _assert_same(_accept(backend, **packed, **params), padded)


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_neutral_parameters_change_nothing(backend):
    """Penalties at 1 / 0, a zero bias, min_tokens reached: the results (sampled ones included) of accept without."""
    gen = torch.Generator().manual_seed(4350)
    B, T = 6, 5
    batch = dict(_random_batch(B, T, gen, temperature=torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 0.9]), draft=True),
                 **_filters(B, gen))
    counts = _counts(B, gen, total=3)
    neutral = dict(repetition_penalty=torch.ones(B), frequency_penalty=torch.zeros(B), presence_penalty=0.0,
                   output_token_counts=counts, logit_bias=(torch.randint(0, V, (B, 3), generator=gen),
                                                           torch.zeros(B, 3)),
                   min_tokens=torch.full((B,), 3), stop_token_ids=torch.randint(0, V, (B, 2), generator=gen))
    assert all(torch.equal(x, y) for x, y in zip(_accept(backend, **batch, **neutral)[:3], _accept(backend, **batch)))


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_logprobs_off_and_zero(backend):
    """return_logprobs None: no logprobs; 0: the emitted tokens' logprobs only, (B, T, 0) top entries; more than
    V: every token ranked, the rest padded."""
    gen = torch.Generator().manual_seed(4360)
    batch = _random_batch(3, 4, gen)
    assert specdec.accept(**on_backend(backend, batch), backend=backend).logprobs is None
    acc, num, nxt, lp, top, top_ids, ranks = _accept(backend, **batch, return_logprobs=0)
    assert lp.shape == (3, 4) and top.shape == (3, 4, 0) and top_ids.shape == (3, 4, 0) and top_ids.dtype == torch.int64
    assert not lp[0, : int(num[0]) + 1].isnan().any()
    *_, top, top_ids, _ = _accept(backend, **batch, return_logprobs=20)  # more than V = 19: the rest padded
    assert top.shape == (3, 4, 20) and top[:, :, V:].isnan().all() and top_ids[:, :, V:].eq(-1).all()
    assert top_ids[0, 0, :V].sort().values.tolist() == list(range(V))


# ------------------------------------------------------------------------------------------------
# bad input, refused naming the argument, before anything is written
# ------------------------------------------------------------------------------------------------
def _bad_cases(B):
    counts = torch.zeros(B, V, dtype=torch.int32)
    return [
        (dict(repetition_penalty=0.0, output_token_counts=counts), ValueError, "repetition_penalty"),
        (dict(repetition_penalty=torch.tensor([1.0] * (B - 1) + [-2.0]), output_token_counts=counts), ValueError,
         "repetition_penalty"),
        (dict(frequency_penalty=math.inf, output_token_counts=counts), ValueError, "frequency_penalty"),
        (dict(presence_penalty=torch.full((B,), math.nan), output_token_counts=counts), ValueError,
         "presence_penalty"),
        (dict(frequency_penalty=0.5), TypeError, "output_token_counts"),
        (dict(frequency_penalty=0.5, output_token_counts=counts[:, :-1]), ValueError, "output_token_counts"),
        (dict(frequency_penalty=0.5, output_token_counts=counts - 1), ValueError, "output_token_counts"),
        # int64 values that int32 would narrow to valid ones (2**40 -> 0, 2**32 + 1 -> 1)
        (dict(frequency_penalty=0.5, output_token_counts=torch.full((B, V), 2**40)), ValueError,
         "output_token_counts"),
        (dict(logit_bias=(torch.full((B, 2), 2**32 + 1), torch.zeros(B, 2))), ValueError, r"logit_bias\[0\]"),
        (dict(min_tokens=torch.full((B,), 2**40), stop_token_ids=torch.zeros(B, 1, dtype=torch.long),
              output_token_counts=counts), ValueError, "min_tokens"),
        (dict(min_tokens=3, stop_token_ids=torch.full((B, 1), 2**32 + 1), output_token_counts=counts), ValueError,
         "stop_token_ids"),
        (dict(repetition_penalty=1.2, output_token_counts=counts,
              prompt_token_mask=torch.zeros(B, 1, dtype=torch.int64)), ValueError, "prompt_token_mask"),
        (dict(logit_bias=(torch.full((B, 2), V), torch.zeros(B, 2))), ValueError, r"logit_bias\[0\]"),
        (dict(logit_bias=(torch.zeros(B, 2, dtype=torch.long), torch.full((B, 2), math.nan))), ValueError,
         r"logit_bias\[1\]"),
        (dict(logit_bias=torch.zeros(B, 2)), TypeError, "logit_bias"),
        (dict(min_tokens=-1, stop_token_ids=torch.zeros(B, 1, dtype=torch.long), output_token_counts=counts),
         ValueError, "min_tokens"),
        (dict(min_tokens=3, output_token_counts=counts), TypeError, "stop_token_ids"),
        (dict(stop_token_ids=torch.zeros(B, 1, dtype=torch.long)), TypeError, "stop_token_ids"),
        (dict(min_tokens=3, stop_token_ids=torch.full((B, 1), -2), output_token_counts=counts), ValueError,
         "stop_token_ids"),
        (dict(filter_order="torch"), ValueError, "filter_order"),
        (dict(return_logprobs=21), ValueError, "return_logprobs"),
        (dict(return_logprobs=2.0), TypeError, "return_logprobs"),
        (dict(return_logprobs=2, logprobs_mode="logits"), ValueError, "logprobs_mode"),
    ]


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_bad_parameters_are_refused_naming_them(backend):
    gen = torch.Generator().manual_seed(4370)
    B = 3
    batch = _random_batch(B, 4, gen)
    for extra, error, name in _bad_cases(B):
        with pytest.raises(error, match=f"^{name}"):
            specdec.accept(**on_backend(backend, dict(batch, **extra)), backend=backend)


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_min_tokens_masking_every_possible_token_is_refused(backend):
    """A row whose only finite logits are stop tokens, at a node that has not reached min_tokens: no token is
    possible there (a ValueError naming min_tokens); once reached, the same row is fine."""
    rows = torch.full((1, 2, V), -math.inf)
    rows[0, 0, [4, 7]] = torch.tensor([1.0, 0.5])
    rows[0, 1, 4] = 1.0
    batch = dict(target_logits=rows, tokens=torch.tensor([[0, 4]]), parents=torch.tensor([[-1, 0]]), temperature=0.0,
                 seeds=torch.zeros(1, dtype=torch.int64), stop_token_ids=torch.tensor([[4]]),
                 output_token_counts=torch.zeros(1, V, dtype=torch.int32))
    with pytest.raises(ValueError, match="^min_tokens"):
        specdec.accept(**on_backend(backend, dict(batch, min_tokens=2)), backend=backend)
    _assert_same(_accept(backend, **batch, min_tokens=1), _accept("torch", **batch, min_tokens=1))


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_inputs_are_read_only(backend):
    """Step 0 is applied as rows are read: no input changes (a bias added in place would move the next call)."""
    gen = torch.Generator().manual_seed(4380)
    batch = dict(_random_batch(4, 4, gen, temperature=torch.tensor([0.0, 1.0, 0.0, 0.8]), draft=True),
                 **_random_params(4, gen))
    batch = on_backend(backend, batch)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(x.clone() for x in v))
              for k, v in batch.items() if isinstance(v, (torch.Tensor, tuple))}
    specdec.accept(**batch, return_logprobs=2, logprobs_mode="processed", backend=backend)
    for k, v in before.items():
        now = batch[k] if isinstance(batch[k], torch.Tensor) else torch.cat([x.flatten().float() for x in batch[k]])
        was = v if isinstance(v, torch.Tensor) else torch.cat([x.flatten().float() for x in v])
        assert torch.equal(now, was), f"{k} changed"
