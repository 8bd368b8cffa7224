"""tree_attention backends (Triton through the interpreter on CPU, C++ when built) vs the reference.

Shapes stay tiny: the interpreter runs every program and every KV tile one after another.
Inputs are built on the CPU; the tested backend runs on tests.helpers.DEVICE (SPECDEC_TEST_DEVICE=cuda
runs the compiled kernel on a GPU) on copies that keep every stride, the reference on the CPU.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton

import specdec
from specdec import reference
from specdec.kernels import tree_attention as ta
from tests import helpers
from tests.helpers import (BACKENDS, DEVICE, FLOAT_DTYPES, FP8_DTYPES, MemorySpy, assert_close, element_addresses,
                           from_paged, needs_the_compiler, on_backend, poison_, random_cache, random_trees,
                           report_from_fresh_process, to_device, to_paged)

BLOCK_SIZE = 16  # page size of the paged cases: pages split the prefix and the tree at odd places


def make_case(gen, *, B=3, T=9, Hkv=2, group=4, D=64, dtype=torch.float32, lens=(0, 37, 70), kinds=None,
              paged=False, window_left=-1):
    """Random trees (ragged num_nodes), a cache whose rows past cache_lens + T (and before a window:
    cache_lens - window_left) are NaN (a read of them shows), optionally paged with a shuffled block table;
    returns the public op's keyword arguments."""
    parents, num_nodes = random_trees(B, T, gen, **({"kinds": kinds} if kinds else {}))
    cache_lens = torch.tensor(lens, dtype=torch.int32)
    cap = math.ceil((max(lens) + T) / BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    kv = random_cache(B, cap, 2 * Hkv, D, dtype, gen)  # K and V side by side, so they page alike
    for b in range(B):
        kv[b, int(cache_lens[b]) + T:] = float("nan")
        if window_left >= 0:
            kv[b, :max(0, int(cache_lens[b]) - window_left)] = float("nan")
    block_table = None
    if paged:
        kv, block_table = to_paged(kv, BLOCK_SIZE, gen)
    return dict(q=torch.randn(B, T, Hkv * group, D, generator=gen).to(dtype),
                k_cache=kv[:, :, :Hkv], v_cache=kv[:, :, Hkv:], cache_lens=cache_lens,
                tree_mask=specdec.build_tree(parents, num_nodes).mask, block_table=block_table,
                num_nodes=num_nodes)


def run(case, backend, **kw):
    """The public op: the reference on the CPU, other backends on DEVICE; (out, lse) on the CPU."""
    return tuple(x.cpu() for x in specdec.tree_attention(**on_backend(backend, case), return_lse=True, backend=backend,
                                                         **kw))


def check_against_reference(actual, case, **kw):
    """out within the dtype's tolerance, lse within fp32's, padding rows exactly 0 / -inf (actual may
    still be on DEVICE)."""
    out, lse = (x.cpu() for x in actual)
    ref_out, ref_lse = run(case, "torch", **kw)
    dtype = case["q"].dtype
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32)
    T = case["q"].shape[1]
    padding = torch.arange(T).unsqueeze(0) >= case["num_nodes"].unsqueeze(1)  # (B, T)
    assert torch.isfinite(out[~padding]).all() and torch.isfinite(lse[~padding]).all()
    assert (out[padding] == 0).all() and (lse[padding] == -math.inf).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(backend, dtype, group, D, paged):
    gen = torch.Generator().manual_seed(group * 1000 + D + paged)
    case = make_case(gen, group=group, D=D, dtype=dtype, paged=paged)
    check_against_reference(run(case, backend), case)


def to_float8(case, cache_dtype, k_scale, v_scale):
    """The case with its caches quantized as kv_append stores them (NaN poison rows stay NaN)."""
    return dict(case, k_cache=reference.quantize(case["k_cache"], k_scale, cache_dtype),
                v_cache=reference.quantize(case["v_cache"], v_scale, cache_dtype))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_float8_cache_matches_reference(backend, cache_dtype, dtype, paged):
    """A float8 KV cache with per-tensor scales (values spread over the format's range) against the
    reference, which dequantizes exactly: the result meets q's dtype tolerance."""
    gen = torch.Generator().manual_seed(paged + 10 * FLOAT_DTYPES.index(dtype))
    case = make_case(gen, B=3, T=6, Hkv=2, group=2, D=64, dtype=dtype, lens=(0, 21, 50), paged=paged)
    case = to_float8(case, cache_dtype, k_scale=0.011, v_scale=0.37)
    kw = dict(k_scale=0.011, v_scale=0.37)
    check_against_reference(run(case, backend, **kw), case, **kw)


# (window_left, logits_soft_cap): windows shorter and longer than the prefixes (37, 70), the smallest allowed
# (T - 1 = 8), a cap alone, both
WINDOW_CAP = [(8, 0.0), (30, 0.0), (1000, 0.0), (-1, 5.0), (20, 2.0)]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window_left,cap", WINDOW_CAP)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_and_soft_cap_match_reference(backend, dtype, window_left, cap, paged):
    """Sliding-window layers (each node's window ends at its own position: cache_lens + depth) and logit
    soft-capping, on random trees with ragged node counts."""
    gen = torch.Generator().manual_seed(window_left + 7 * int(cap) + paged)
    case = make_case(gen, dtype=dtype, kinds=("random", "chain"), paged=paged, window_left=window_left)
    kw = dict(window_left=window_left, logits_soft_cap=cap)
    check_against_reference(run(case, backend, **kw), case, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_with_several_mask_words_and_stray_bits(backend):
    """T = 40 (two mask words): depths up to 39 from both words; bits of nodes >= T in the last word (which
    no node has) are ignored by every backend, as the reference ignores them."""
    gen = torch.Generator().manual_seed(40)
    case = make_case(gen, B=2, T=40, Hkv=1, group=2, lens=(64, 3), kinds=("random", "chain"), paged=True,
                     window_left=45)
    case["tree_mask"] = case["tree_mask"].clone()
    case["tree_mask"][:, :, 1] |= 0b111 << 20  # "nodes" 52-54 (the input checks look at nodes < T only)
    check_against_reference(run(case, backend, window_left=45), case, window_left=45)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_leaves_freed_blocks_alone(backend):
    """An engine may free the blocks that slid out of the window (block id -1): they are neither checked nor
    read with the window, and rejected without it."""
    gen = torch.Generator().manual_seed(41)
    case = make_case(gen, B=3, T=6, Hkv=2, group=2, lens=(0, 45, 130), paged=True, window_left=30)
    table = case["block_table"].clone()
    for b, L in enumerate((0, 45, 130)):
        table[b, :max(0, L - 30) // BLOCK_SIZE] = -1
    assert (table == -1).sum() > 0
    case["block_table"] = table
    check_against_reference(run(case, backend, window_left=30), case, window_left=30)
    with pytest.raises(ValueError, match="^block_table: block ids in use"):
        run(case, backend)


# ----------------------------------------------------------------------------------------------
# attention sinks (gpt-oss): a learned logit per query head in the softmax's denominator, with no value
# ----------------------------------------------------------------------------------------------
def random_sinks(Hq, gen):
    """(Hq,) float32 logits around the scores' logsumexp (about 5 here), head 0's -inf (no sink), the last one 6."""
    sinks = torch.randn(Hq, generator=gen) * 2 + 3
    sinks[0], sinks[-1] = -math.inf, 6.0
    return sinks


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_sinks_by_hand(backend):
    """The spec by hand (gpt-oss's eager attention): scores of every key a node sees plus the sink's logit, unscaled,
    softmax, the sink's weight dropped; lse = logsumexp of the scores and the sink."""
    gen = torch.Generator().manual_seed(6)
    case = make_case(gen, B=2, T=5, Hkv=2, group=2, lens=(9, 20), kinds=("random",))
    B, T, Hq, D = case["q"].shape
    sinks = random_sinks(Hq, gen)
    out, lse = run(dict(case, sinks=sinks), backend, scale=0.3)
    bits = reference.unpack_bits(case["tree_mask"], T)
    for b in range(B):
        L = int(case["cache_lens"][b])
        for i in range(int(case["num_nodes"][b])):
            seen = torch.cat([torch.arange(L), L + bits[b, i].nonzero().flatten()])
            for h in range(Hq):
                keys, vals = case["k_cache"][b, seen, h // 2].double(), case["v_cache"][b, seen, h // 2].double()
                logits = torch.cat([keys @ case["q"][b, i, h].double() * 0.3, sinks[h:h + 1].double()])
                weights = torch.softmax(logits, 0)[:-1]
                torch.testing.assert_close(out[b, i, h].double(), weights @ vals, atol=2e-5, rtol=2e-5)
                torch.testing.assert_close(lse[b, i, h].double(), torch.logsumexp(logits, 0), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window_left,cap", [(-1, 0.0), (20, 2.0)], ids=["plain", "window-cap"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_match_reference(backend, dtype, window_left, cap, paged):
    """Sinks on random trees with ragged node counts and GQA, with and without a window and soft-capping (the sink
    itself is neither: the reference adds it after both)."""
    gen = torch.Generator().manual_seed(60 + window_left + paged + 10 * FLOAT_DTYPES.index(dtype))
    case = make_case(gen, dtype=dtype, kinds=("random", "chain"), paged=paged, window_left=window_left)
    case["sinks"] = random_sinks(case["q"].shape[2], gen)
    kw = dict(window_left=window_left, logits_soft_cap=cap)
    check_against_reference(run(case, backend, **kw), case, **kw)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_with_float8_cache(backend, paged):
    """The sink is a logit: k_scale scales the scores, not the sink; v_scale the values, not its (absent) value."""
    gen = torch.Generator().manual_seed(61 + paged)
    case = make_case(gen, B=3, T=6, Hkv=2, group=2, D=64, dtype=torch.bfloat16, lens=(0, 21, 50), paged=paged)
    case = dict(to_float8(case, torch.float8_e4m3fn, k_scale=0.011, v_scale=0.37), sinks=random_sinks(4, gen))
    kw = dict(k_scale=0.011, v_scale=0.37)
    check_against_reference(run(case, backend, **kw), case, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sinks_packed(backend):
    """The packed form (rows of every request flattened) with sinks, a paged cache and a window, against the
    reference's packed form; every packed row written."""
    gen = torch.Generator().manual_seed(62)
    case = make_case(gen, B=3, T=7, Hkv=2, group=2, D=32, lens=(5, 0, 23), paged=True, window_left=12)
    nn = case["num_nodes"]
    rows = torch.cat([b * 7 + torch.arange(int(nn[b])) for b in range(3)])
    packed = dict(case, q=case["q"].flatten(0, 1)[rows], tree_mask=case["tree_mask"].flatten(0, 1)[rows],
                  num_nodes=None, cu_num_nodes=torch.cat([torch.zeros(1, dtype=torch.int32), nn.cumsum(0).int()]),
                  max_nodes=7, sinks=random_sinks(4, gen))
    kw = dict(window_left=12, logits_soft_cap=20.0)
    out, lse = run(packed, backend, **kw)
    ref_out, ref_lse = run(packed, "torch", **kw)
    assert out.shape == (len(rows), 4, 32) and lse.shape == (len(rows), 4)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_triton_sinks_split_kv(num_splits):
    """Split-KV with sinks (folded in once: in the merge with several splits, at the end of the main kernel with
    one), empty splits included (cache_lens 0 and 1), a window and soft-capping, small tiles, into NaN-poisoned
    outputs; padding nodes stay 0 / -inf."""
    gen = torch.Generator().manual_seed(63 + num_splits)
    case = make_case(gen, B=4, T=7, Hkv=2, group=2, dtype=torch.float16, lens=(0, 1, 37, 130), paged=True,
                     window_left=40)
    B, T, Hq, D = case["q"].shape
    out = poison_(torch.empty(B, T, Hq, D, dtype=torch.float16, device=DEVICE))
    lse = poison_(torch.empty(B, T, Hq, dtype=torch.float32, device=DEVICE))
    sinks = random_sinks(Hq, gen)
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    triton_call(case, 1.0, 1.0, 40, 5.0, None, 0, to_device(sinks), num_splits=num_splits, config=config, out=out,
                lse=lse)
    check_against_reference((out, lse), case, window_left=40, logits_soft_cap=5.0, sinks=sinks)


def sink_variants(backend, case, sinks, **kw):
    """(out, lse) on `backend`, on the CPU: the public op, and on Triton also split-KV (3 splits, small tiles)."""
    results = [run(dict(case, sinks=sinks), backend, **kw)]
    if backend == "triton":
        config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
        results.append(tuple(x.cpu() for x in triton_call(
            case, 1.0, 1.0, kw.get("window_left", -1), kw.get("logits_soft_cap", 0.0), None, 0, to_device(sinks),
            num_splits=3, config=config)))
    return results


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_sink_of_minus_inf_is_no_sink(backend):
    """Every head's sink at -inf gives the result without sinks, bit for bit (out and lse), split or not, with a
    window and soft-capping."""
    gen = torch.Generator().manual_seed(64)
    case = make_case(gen, B=3, T=6, Hkv=2, group=2, lens=(3, 45, 90), paged=True, window_left=50)
    kw = dict(window_left=50, logits_soft_cap=4.0)
    none = torch.full((4,), -math.inf)
    for i, (out, lse) in enumerate(sink_variants(backend, case, none, **kw)):
        if i == 0:
            expected = run(case, backend, **kw)
        else:  # the same split count without sinks
            config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
            expected = tuple(x.cpu() for x in triton_call(case, 1.0, 1.0, 50, 4.0, num_splits=3, config=config))
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1]), i


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_large_sink_shrinks_out_keeps_numerator(backend, dtype):
    """A sink of 10 (above every row's logsumexp, about 5) leaves the numerator sum_j exp(s_j) v_j = out * exp(lse)
    as it is without sinks: out * exp(lse - lse_without) equals out without sinks, while out itself shrinks and lse
    is logaddexp(lse_without, 10). A sink of 300 (exp overflows in float32) gives out 0 and lse 300, finite."""
    gen = torch.Generator().manual_seed(65 + FLOAT_DTYPES.index(dtype))
    case = make_case(gen, B=2, T=5, Hkv=2, group=2, dtype=dtype, lens=(40, 70), kinds=("random",))
    B, T, Hq, D = case["q"].shape
    plain_out, plain_lse = run(case, backend)
    real = torch.arange(T).unsqueeze(0) < case["num_nodes"].unsqueeze(1)
    for out, lse in sink_variants(backend, case, torch.full((Hq,), 10.0)):
        out, lse, expected_out, expected_lse = out[real], lse[real], plain_out[real], plain_lse[real]
        assert_close(lse, torch.logaddexp(expected_lse, torch.tensor(10.0)), torch.float32)
        assert_close(out.float() * torch.exp(lse - expected_lse).unsqueeze(-1), expected_out.float(), dtype)
        assert (out.float().abs().amax(-1) < expected_out.float().abs().amax(-1) * 0.2).all()
    for out, lse in sink_variants(backend, case, torch.full((Hq,), 300.0)):
        assert (out[real] == 0).all() and (lse[real] == 300.0).all()
        assert (out[~real] == 0).all() and (lse[~real] == -math.inf).all()


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_bad_sinks_are_named(backend):
    """sinks: a (Hq,) float32 tensor on q's device; NaN and +inf are refused (-inf is no sink). The C++ op itself
    (no Python checks before it) refuses the same with the same messages."""
    gen = torch.Generator().manual_seed(66)
    case = make_case(gen, B=2, T=4, Hkv=1, group=2, D=16, lens=(3, 9))
    bad = [([0.0, 0.0], TypeError, "sinks: expected a torch.Tensor, got list"),
           (torch.zeros(2, dtype=torch.float64), TypeError, "sinks: dtype float64 not supported"),
           (torch.zeros(2, dtype=torch.bfloat16), TypeError, "sinks: dtype bfloat16 not supported"),
           (torch.zeros(1, 2), ValueError, r"sinks: expected 1 dimensions, got shape \(1, 2\)"),
           (torch.zeros(1), ValueError, r"sinks: expected shape \(2,\), got \(1,\)"),
           (torch.tensor([0.0, math.nan]), ValueError, "sinks: every entry must be a finite logit or -inf"),
           (torch.tensor([math.inf, 0.0]), ValueError, "sinks: every entry must be a finite logit or -inf")]
    for sinks, error, message in bad:
        with pytest.raises(error, match="^" + message):
            run(dict(case, sinks=sinks), backend)
        if backend == "cpp" and isinstance(sinks, torch.Tensor):
            args = [case[name] for name in ("q", "k_cache", "v_cache", "cache_lens", "tree_mask", "block_table",
                                            "num_nodes")]
            with pytest.raises(error, match="^" + message):
                torch.ops.specdec.tree_attention(*args, 0.25, sinks=sinks)
    run(dict(case, sinks=torch.tensor([-math.inf, 1e30])), backend)


def test_sinks_through_layer_calls_and_opcheck():
    """LayerCalls passes a layer's sinks (checked with its first call: a NaN is named); the op with sinks passes
    torch.library.opcheck (schema, fake tensors, AOT dispatch) on the registered CPU kernel."""
    gen = torch.Generator().manual_seed(67)
    case = make_case(gen, B=2, T=4, Hkv=1, group=2, D=16, lens=(3, 9))
    sinks = random_sinks(2, gen)
    calls = specdec.ops.LayerCalls(case["cache_lens"], case["tree_mask"], num_nodes=case["num_nodes"])
    expected = specdec.tree_attention(case["q"], case["k_cache"], case["v_cache"], case["cache_lens"],
                                      case["tree_mask"], num_nodes=case["num_nodes"], sinks=sinks)
    assert torch.equal(calls.tree_attention(case["q"], case["k_cache"], case["v_cache"], sinks=sinks), expected)
    fresh = specdec.ops.LayerCalls(case["cache_lens"], case["tree_mask"], num_nodes=case["num_nodes"])
    with pytest.raises(ValueError, match="^sinks: every entry"):
        fresh.tree_attention(case["q"], case["k_cache"], case["v_cache"], sinks=torch.tensor([0.0, math.nan]))
    args = tuple(case[name] for name in ("q", "k_cache", "v_cache", "cache_lens", "tree_mask", "block_table",
                                         "num_nodes"))
    torch.library.opcheck(torch.ops.specdec.tree_attention.default, (*args, 0.25), {"sinks": sinks})


def test_window_limits_what_the_reference_sees():
    """The reference's window (the spec) by hand: a chain node at depth d sees the last window_left + 1 - d
    committed positions; a window covering the prefix changes nothing; a cap changes the result."""
    gen = torch.Generator().manual_seed(4)
    case = make_case(gen, B=1, T=4, Hkv=1, group=1, lens=(30,), kinds=("chain",))
    case["q"] = torch.zeros_like(case["q"])  # uniform weights: out = the mean of the values seen
    out = run(case, "torch", window_left=5)[0]
    values = case["v_cache"][0, :, 0]
    for d in range(4):  # node d sees positions [30 + d - 5, 30) and tree nodes 0..d
        seen = torch.cat([values[25 + d: 30], values[30: 31 + d]])
        torch.testing.assert_close(out[0, d, 0], seen.mean(0))
    torch.testing.assert_close(run(case, "torch", window_left=40)[0], run(case, "torch")[0])
    case["q"] = torch.randn(case["q"].shape, generator=gen) * 4
    assert not torch.allclose(run(case, "torch", logits_soft_cap=1.0)[0], run(case, "torch")[0])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_equals_contiguous(backend, dtype):
    gen = torch.Generator().manual_seed(7)
    case = make_case(gen, dtype=dtype, lens=(5, 64, 49))
    logical = torch.cat([case["k_cache"], case["v_cache"]], dim=2)
    pages, table = to_paged(logical, BLOCK_SIZE, gen)
    Hkv = case["k_cache"].shape[2]
    paged = dict(case, k_cache=pages[:, :, :Hkv], v_cache=pages[:, :, Hkv:], block_table=table)
    out_c, lse_c = run(case, backend)
    out_p, lse_p = run(paged, backend)
    if backend == "triton":  # one code path for both layouts: the same arithmetic, bit for bit
        assert torch.equal(out_c, out_p) and torch.equal(lse_c, lse_p)
    else:
        assert_close(out_p, out_c, dtype)
        assert_close(lse_p, lse_c, torch.float32)


@pytest.mark.parametrize("T", [1, 33, 70])
@pytest.mark.parametrize("kind", ["chain", "star", "random"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_shapes(backend, kind, T):
    """Single-node trees and trees spanning several mask words and several KV tiles of tree keys."""
    gen = torch.Generator().manual_seed(T)
    case = make_case(gen, B=2, T=T, Hkv=1, group=1, lens=(64, 3), kinds=(kind,), paged=True)
    check_against_reference(run(case, backend), case)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_strides_and_head_dims(backend):
    """Explicit scale, q and caches as strided views (no contiguous copies), GQA group 3, D 256 and 32."""
    gen = torch.Generator().manual_seed(3)
    for D in (256, 32):
        case = make_case(gen, B=2, T=6, Hkv=2, group=3, D=D, lens=(11, 40), paged=True)
        wide_q = torch.randn(2, 6, 6, 2 * D, generator=gen)
        wide_q[..., :D] = case["q"]
        case["q"] = wide_q[..., :D]
        check_against_reference(run(case, backend, scale=0.3), case, scale=0.3)


def triton_call(case, *scales, **launcher_kw):
    """The Triton launcher directly (normalized args; `scales`: k_scale, v_scale) on DEVICE, for its test-only
    knobs; results stay there."""
    B, T, Hq, D = case["q"].shape
    names = ("q", "k_cache", "v_cache", "cache_lens", "tree_mask", "block_table", "num_nodes")
    return ta.tree_attention(*(to_device(case[name]) for name in names), D ** -0.5, *scales, **launcher_kw)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("block_n", [64, 16])
def test_triton_split_kv_into_poisoned_outputs(num_splits, block_n):
    """Forced split counts (with empty splits: cache_lens 0 and 1, and 8 splits of a short prefix),
    small KV tiles so each split spans several, writing into NaN-poisoned output buffers."""
    gen = torch.Generator().manual_seed(num_splits)
    case = make_case(gen, B=4, T=7, Hkv=2, group=2, dtype=torch.float16, lens=(0, 1, 37, 130), paged=True)
    B, T, Hq, D = case["q"].shape
    out = poison_(torch.empty(B, T, Hq, D, dtype=torch.float16, device=DEVICE))
    lse = poison_(torch.empty(B, T, Hq, dtype=torch.float32, device=DEVICE))
    config = ta.TileConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=1)
    result = triton_call(case, num_splits=num_splits, config=config, out=out, lse=lse)
    assert result[0] is out and result[1] is lse
    check_against_reference((out, lse), case)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("partial_dtype", [None, torch.float32], ids=["partials-in-q-dtype", "partials-fp32"])
def test_triton_split_partials_dtype(dtype, partial_dtype):
    """Split partial outputs stored in q's dtype (the default) or in float32 both meet q's tolerance."""
    gen = torch.Generator().manual_seed(11)
    case = make_case(gen, B=2, T=5, Hkv=2, group=2, dtype=dtype, lens=(3, 90), paged=True)
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    check_against_reference(triton_call(case, num_splits=4, config=config, partial_dtype=partial_dtype), case)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_split_window(num_splits):
    """Splits partition the window, not the whole prefix; small tiles so the window starts mid-tile."""
    gen = torch.Generator().manual_seed(13)
    case = make_case(gen, B=3, T=6, Hkv=2, group=2, lens=(0, 45, 130), paged=True, window_left=27)
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    result = triton_call(case, 1.0, 1.0, 27, 3.0, num_splits=num_splits, config=config)
    check_against_reference(result, case, window_left=27, logits_soft_cap=3.0)


def test_triton_split_float8_cache():
    """v_scale applied in every split's partial output (the merge is linear), k_scale in every score."""
    gen = torch.Generator().manual_seed(12)
    case = make_case(gen, B=2, T=5, Hkv=2, group=2, dtype=torch.bfloat16, lens=(3, 90), paged=True)
    case = to_float8(case, torch.float8_e4m3fn, k_scale=0.05, v_scale=3.0)
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    result = triton_call(case, 0.05, 3.0, num_splits=4, config=config)
    check_against_reference(result, case, k_scale=0.05, v_scale=3.0)


def test_triton_row_tiles_split_nodes():
    """T * group rows over several BLOCK_M tiles, with group 3 so a node's heads straddle two tiles."""
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, B=2, T=9, Hkv=1, group=3, lens=(20, 33), kinds=("random",), paged=True)
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    check_against_reference(triton_call(case, config=config), case)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_triton_reads_each_kv_element_once(monkeypatch, paged, num_splits):
    """The bytes claim of the kernel (each K/V tile loaded once): every K and V element of a request's cache_lens[b] +
    num_nodes[b] positions is loaded exactly once for all its T nodes and the Hq/Hkv query heads sharing
    it (one row tile), whatever the split count; nothing else in the caches is touched. With two row
    tiles (the documented cost when T * group > BLOCK_M) the prefix is read twice: the spy sees it."""
    gen = torch.Generator().manual_seed(17 + num_splits)
    case = make_case(gen, B=3, T=5, Hkv=2, group=4, D=16, lens=(37, 0, 20), paged=paged)
    B, T, Hq, D = case["q"].shape
    config = ta.TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)  # 20 rows: one row tile
    def expected_reads(times_read):
        """{address: times} of K and V at request b's position p read times_read(b, p) times."""
        expected = {}
        for cache in (case["k_cache"], case["v_cache"]):
            addresses = element_addresses(cache)
            addresses = addresses if case["block_table"] is None else from_paged(addresses, case["block_table"])
            for b in range(B):
                for p in range(int(case["cache_lens"][b]) + int(case["num_nodes"][b])):
                    expected.update(dict.fromkeys(addresses[b, p].reshape(-1).tolist(), times_read(b, p)))
        return expected

    spy = MemorySpy(monkeypatch)
    triton_call(case, num_splits=num_splits, config=config)
    assert spy.counts([case["k_cache"]]) == expected_reads(lambda b, p: 1)  # K and V share one buffer
    spy.loads.clear()  # a window: nothing before its first position cache_lens - window_left
    triton_call(case, 1.0, 1.0, 21, num_splits=num_splits, config=config)
    in_window = lambda b, p: p >= int(case["cache_lens"][b]) - 21  # noqa: E731
    assert spy.counts([case["k_cache"]]) == {a: 1 for a, n in expected_reads(in_window).items() if n}
    spy.loads.clear()
    triton_call(case, num_splits=num_splits, config=config._replace(block_m=16))  # tiles: nodes 0-3, nodes 4
    first_tile_sees = lambda b, p: p < int(case["cache_lens"][b]) + 4  # noqa: E731 (prefix, tree nodes 0-3)
    assert spy.counts([case["k_cache"]]) == expected_reads(lambda b, p: 1 + first_tile_sees(b, p))


def test_choose_num_splits_from_shapes():
    h200 = 132
    # B=1, L=8K: split until the GPU holds about PROGRAMS_PER_SM programs per SM, no further
    splits = ta.choose_num_splits(batch=1, kv_heads=8, row_tiles=1, capacity=8192, sm_count=h200)
    assert 1 < splits <= ta.MAX_SPLITS
    assert 8 * splits <= ta.PROGRAMS_PER_SM * h200
    # a batch that fills the GPU, a short cache, a huge cache with one program: 1, 1, the cap
    assert ta.choose_num_splits(batch=256, kv_heads=8, row_tiles=1, capacity=32768, sm_count=h200) == 1
    assert ta.choose_num_splits(batch=1, kv_heads=1, row_tiles=1, capacity=100, sm_count=h200) == 1
    assert ta.choose_num_splits(batch=1, kv_heads=1, row_tiles=1, capacity=1 << 17, sm_count=h200) == ta.MAX_SPLITS
    # fewer splits as the batch grows
    by_batch = [ta.choose_num_splits(B, 8, 1, 32768, h200) for B in (1, 2, 8, 32)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > by_batch[-1]


def test_choose_config_covers_rows():
    for rows in (1, 16, 17, 64, 100, 128, 1024):
        for D in (64, 128, 256):
            for elem_bytes in (2, 4):
                config = ta.choose_config(rows, D, elem_bytes)
                assert config.block_m >= 16 and config.block_n >= 16  # tl.dot's minimum
                # all rows in one tile (K/V read once) up to 128 rows (64 at D = 256; half as many with fp32)
                assert config.block_m >= min(rows, (128 if D <= 128 else 64) // (2 if elem_bytes == 4 else 1))
                tile_bytes = config.block_n * D * elem_bytes  # one K (or V) tile
                q_bytes = config.block_m * D * elem_bytes
                assert tile_bytes <= 16384 and 2 * tile_bytes * config.num_stages + q_bytes <= 160 * 1024


@pytest.mark.parametrize("D", [40, 80])
def test_triton_head_dims_that_are_not_powers_of_two(D):
    """Head dims off the powers of two run on channel tiles masked past D (padding channels read as 0)."""
    gen = torch.Generator().manual_seed(D)
    case = make_case(gen, B=2, T=5, group=2, D=D, lens=(3, 40), paged=True)
    check_against_reference(run(case, "triton"), case)


def test_triton_rejects_unsupported():
    gen = torch.Generator().manual_seed(0)
    case = make_case(gen, dtype=torch.float64)
    with pytest.raises(TypeError, match="q: dtype"):
        run(case, "triton")
    case = make_case(gen, B=2, T=3, group=2, D=1024, lens=(0, 5))
    with pytest.raises(ValueError, match=r"q: head dims \(D 1024, Dv 1024\) not supported by the triton backend"):
        run(case, "triton")
    case = make_case(gen)
    with pytest.raises(ValueError, match="out: expected"):
        triton_call(case, out=torch.empty(case["q"].shape, dtype=torch.float16, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# compiled code for an H100/H200 (sm_90), no GPU needed: the interpreter accepts programs the compiler
# rejects, and it says nothing of registers or shared memory
# ----------------------------------------------------------------------------------------------
def compile_for_hopper(fn, types, constexprs, num_warps=4, num_stages=3, divisible_ints=()):
    """sm_90 compile with strides, pointers and the int arguments `divisible_ints` 16-divisible (as a launch marks
    every int argument that is a multiple of 16); innermost strides (in `constexprs`) are 1."""
    return helpers.compile_for_hopper(fn, types, constexprs,
                                      lambda name: name.startswith("stride_") or name in divisible_ints
                                      or types.get(name, "").startswith("*"),
                                      num_warps, num_stages)


def spilled_bytes(kernel):
    """Per-thread stack (register spills) of a compiled kernel, or None without cuobjdump."""
    return helpers.resource_usage(kernel)[1]


def hopper_report(paged: bool, num_splits: int, cache: str = "bf16", window_cap: bool = False,
                  packed: bool = False, head_dim: int = 128, sinks: bool = False, v_dim: int = 0,
                  group: int = 4) -> None:
    """Prints (JSON) what compiling the kernels at the benchmark shape gives: bf16 q, D 128, T 16, GQA 4, a
    `cache` ("bf16", "fp8e4nv", or "fp32": fp32 q and cache, IEEE dots) KV cache, with a sliding window and
    soft-capping if `window_cap`, packed rows if `packed`, attention sinks if `sinks`. 0 < v_dim < head_dim: MLA's
    absorbed form, V the first v_dim channels of K's rows (V_FROM_K), `group` query heads on the one latent head. Runs in a
    fresh process without TRITON_INTERPRET (the interpreter's patches break the compiler)."""
    import json
    q = "fp32" if cache == "fp32" else "bf16"
    config = ta.choose_config(16 * group, head_dim, 4 if q == "fp32" else 2)
    v_dim = v_dim or head_dim
    dims = ta.head_dims(head_dim, v_dim)
    types = {"q_ptr": f"*{q}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "cache_lens_ptr": "*i32",
             "tree_mask_ptr": "*i32", "block_table_ptr": "*i32", "num_nodes_ptr": "*i32", "row_offsets_ptr": "*i64",
             "out_ptr": f"*{q}", "lse_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale": "fp32", "v_scale": "fp32",
             "cap": "fp32"}
    constexprs = dict(GROUP=group, V_DIM=v_dim, V_PAD=dims.v_pad, REST_DIM=head_dim - v_dim, REST_PAD=dims.rest_pad,
                      V_FROM_K=v_dim < head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                      NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q == "fp32" else "tf32", IDENTITY_TABLE=not paged,
                      COMPUTE_DTYPE=triton.language.float32 if q == "fp32" else triton.language.bfloat16,
                      WINDOW=window_cap, SOFT_CAP=window_cap, PACKED=packed, SINKS=sinks,
                      stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, stride_mw=1, stride_tc=1,
                      stride_cache_lens=1, stride_num_nodes=1, stride_row_offsets=1, stride_sinks=1)
    kernel = compile_for_hopper(ta._tree_attention_kernel, types, constexprs, config.num_warps, config.num_stages)
    merge_types = {"part_out_ptr": f"*{q}", "part_lse_ptr": "*fp32", "out_ptr": f"*{q}", "lse_ptr": "*fp32",
                   "num_nodes_ptr": "*i32", "row_offsets_ptr": "*i64", "sinks_ptr": "*fp32"}
    merge_constexprs = dict(NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits),
                            V_DIM=v_dim, V_PAD=dims.v_pad, PACKED=packed, SINKS=sinks, stride_pd=1, stride_od=1,
                            stride_num_nodes=1, stride_row_offsets=1, stride_sinks=1)
    merge = compile_for_hopper(ta._merge_splits_kernel, merge_types, merge_constexprs)
    print(json.dumps({"wgmma": "wgmma" in kernel.asm["ptx"], "fma": "fma.rn.f32" in kernel.asm["ptx"],
                      "shared": kernel.metadata.shared, "registers": helpers.resource_usage(kernel)[0],
                      "config": list(config),
                      "spilled": spilled_bytes(kernel), "merge_spilled": spilled_bytes(merge)}))


@needs_the_compiler
@pytest.mark.parametrize("paged,num_splits,cache,window_cap,packed,sinks", [
    (False, 1, "bf16", False, False, False), (True, 4, "bf16", False, False, False),
    (False, 1, "fp8e4nv", False, False, False), (True, 4, "bf16", True, False, False),
    (True, 4, "bf16", False, True, False), (False, 1, "bf16", False, False, True), (True, 4, "bf16", True, True, True)],
    ids=["contiguous", "paged-split", "contiguous-fp8", "paged-split-window-cap", "paged-split-packed",
         "contiguous-sinks", "paged-split-window-cap-packed-sinks"])
def test_compiles_for_hopper_at_the_benchmark_shape(paged, num_splits, cache, window_cap, packed, sinks):
    """Tensor-core dots (wgmma), no register spills, and shared memory for two programs per SM
    (228 KiB per SM, 1 KiB reserved per program). Sinks: folded at the main kernel's end (one split), in the merge
    (several)."""
    args = (paged, num_splits, cache, window_cap, packed, 128, sinks)
    report = report_from_fresh_process(f"from tests.ops.test_tree_attention import hopper_report; "
                                      f"hopper_report{args!r}", timeout=300)
    assert report["wgmma"]
    assert report["shared"] <= 113 * 1024
    assert report["spilled"] in (0, None) and report["merge_spilled"] in (0, None)


@needs_the_compiler
@pytest.mark.parametrize("head_dim,most_spilled", [(64, 0), (128, 256), (256, 2048)])
def test_fp32_compiles_for_hopper_with_few_register_spills(head_dim, most_spilled):
    """fp32 q and cache (IEEE dots: FMA, no tensor cores; the shipped pair's loop runs so on a GPU) at T 16, GQA 4:
    few bytes spilled a thread (choose_config's fp32 tiles; at the 16-bit ones 8-10 KB at D 64..128) and shared
    memory for two programs per SM."""
    report = report_from_fresh_process(f"from tests.ops.test_tree_attention import hopper_report; "
                                      f"hopper_report(False, 1, 'fp32', False, False, {head_dim})", timeout=300)
    assert report["fma"] and not report["wgmma"] and report["shared"] <= 113 * 1024
    assert report["spilled"] is None or report["spilled"] <= most_spilled, report
    assert report["merge_spilled"] in (0, None)


# ----------------------------------------------------------------------------------------------
# positions near 2**31 and caches over 2**31 elements: int64 arithmetic where int32 overflows
# ----------------------------------------------------------------------------------------------
HUGE_BLOCK = 8176  # divides 2**31 - 16: a block boundary inside the windows below


def window_near_int32_limit(gen, T=5, window_left=40):
    """Two requests whose windows end near 2**31 (the last node of request 0's chain at 2**31 - 3, request 1's tree
    across the block boundary at 2**31 - 16), in a paged cache that holds only the blocks the windows read: the
    block table's earlier entries are -1 (blocks freed: the window never reads them), positions outside the windows
    are NaN (a read of them shows)."""
    lens = [2**31 - 3 - (T - 1), 2**31 - 16 - 3]
    columns = -(-2**31 // HUGE_BLOCK)
    table = torch.full((2, columns), -1, dtype=torch.int32)
    owned = []  # (request, column) of each real block
    for b, L in enumerate(lens):
        for column in range((L - window_left) // HUGE_BLOCK, (L + T - 1) // HUGE_BLOCK + 1):
            table[b, column] = len(owned)
            owned.append((b, column))
    kv = torch.full((len(owned) + 2, HUGE_BLOCK, 2, 16), float("nan"))  # K and V heads side by side; 2 spare blocks
    for block, (b, column) in enumerate(owned):
        positions = torch.arange(column * HUGE_BLOCK, (column + 1) * HUGE_BLOCK)
        read = (positions >= lens[b] - window_left) & (positions < lens[b] + T)
        kv[block, read] = torch.randn(int(read.sum()), 2, 16, generator=gen)
    parents = torch.tensor([helpers.random_parents(T, kind, gen) for kind in ("chain", "random")])
    tree = specdec.build_tree(parents)
    return dict(q=torch.randn(2, T, 2, 16, generator=gen), k_cache=kv[:, :, :1], v_cache=kv[:, :, 1:],
                cache_lens=torch.tensor(lens, dtype=torch.int32), tree_mask=tree.mask, block_table=table,
                num_nodes=tree.num_nodes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_ending_near_int32_limit(backend):
    """Windows ending at position 2**31 - 3 (Triton: positions in int64, tiles at int32 offsets from them; its tiles
    ran past 2**31 - 1 in int32 and read wrapped positions)."""
    case = window_near_int32_limit(torch.Generator().manual_seed(31))
    check_against_reference(run(case, backend, window_left=40), case, window_left=40)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_window_ending_near_int32_limit_small_tiles(num_splits):
    """Tiles of 16 keys and split windows: tiles start on both sides of the block boundary and end past 2**31."""
    case = window_near_int32_limit(torch.Generator().manual_seed(32))
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    result = triton_call(case, 1.0, 1.0, 40, num_splits=num_splits, config=config)
    check_against_reference(result, case, window_left=40)


def test_triton_rejects_blocks_of_2_31_rows():
    """A paged cache's block of 2**31 rows or more (the kernel finds a key's block in uint32): a ValueError naming
    k_cache (the cache a stride-0 view: nothing allocated)."""
    gen = torch.Generator().manual_seed(33)
    case = make_case(gen, B=2, T=4, Hkv=1, group=1, D=16, lens=(3, 9))
    rows = torch.randn(3, 1, 1, 16, generator=gen).expand(3, 2**31, 1, 16)
    case.update(k_cache=rows, v_cache=rows, block_table=torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="^k_cache: block size 2147483648 not supported by the triton backend"):
        run(case, "triton")


def head_major_report(backend: str) -> None:
    """test_head_major_cache_over_2_31_elements's check on `backend`, in a process of its own (a kernel that gets the
    offsets wrong reads far outside the cache and crashes); prints an empty JSON object when the results are right.
    A contiguous cache stored head-major, (2 Hkv, 1, L_max, D) viewed as (1, L_max, 2 Hkv, D): KV head 2 starts
    2**31 elements in. Allocated but never filled (the pages stay virtual) save the rows a window reads; a float8
    cache keeps that to 6 GiB."""
    T, Hkv, L_max, window_left = 4, 3, 2**26, 20
    L = L_max - T - 7
    storage = torch.empty((2 * Hkv, 1, L_max, 16), dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(34)
    storage[:, :, L - window_left:L + T] = torch.randn(2 * Hkv, 1, window_left + T, 16, generator=gen).to(
        torch.float8_e4m3fn)
    kv = storage.permute(1, 2, 0, 3)
    assert kv.stride(2) * 2 >= 2**31 > kv.stride(2)
    parents = torch.tensor([helpers.random_parents(T, "random", gen)])
    case = dict(q=torch.randn(1, T, Hkv, 16, generator=gen), k_cache=kv[:, :, :Hkv], v_cache=kv[:, :, Hkv:],
                cache_lens=torch.tensor([L], dtype=torch.int32), tree_mask=specdec.build_tree(parents).mask,
                block_table=None, num_nodes=torch.tensor([T], dtype=torch.int32))
    check_against_reference(run(case, backend, window_left=window_left), case, window_left=window_left)
    print("{}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_major_cache_over_2_31_elements(backend):
    """Element offsets past 2**31 (Triton computes them in int64; kv_head * head stride was int32, and read before
    the cache)."""
    report_from_fresh_process(f"import tests.conftest; from tests.ops.test_tree_attention import head_major_report; "
                              f"head_major_report({backend!r})", timeout=300)
