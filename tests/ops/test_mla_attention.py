"""tree_attention in MLA's absorbed form (DeepSeek-V2/V3, Kimi-K2) against the unabsorbed MLA, on every backend.

The model: per position a latent c (R = kv_lora_rank channels) and a shared rope key k_rope (P channels); query
head h has q_nope (N channels), q_rope (P), and the up-projections W_UK[h] (N x R), W_UV[h] (Dh x R). The
unabsorbed form is ordinary attention with one KV head per query head, K_h = [W_UK[h] c ; k_rope], V_h = W_UV[h] c.
The absorbed form (the op's): queries [W_UK[h]^T q_nope ; q_rope] (Dqk = R + P), one latent cache
[c ; k_rope] (..., 1, Dqk) and V = its first Dv = R channels (v_cache = k_cache[..., :R], a view); out_h
(R channels) then times W_UV[h] is the unabsorbed out_h. The unabsorbed reference is reference.tree_attention on
materialized per-head K and V in float64, so absorption is checked against the obvious form; every backend is
checked against it (fp32 q; float8 caches through the dequantized latent) and against the absorbed reference
(fp16 / bf16 q, within their tolerance).
"""
from __future__ import annotations

import math

import pytest
import torch

import specdec
from specdec import reference
from tests.helpers import (BACKENDS, DEVICE, FP8_DTYPES, MemorySpy, assert_close, element_addresses, from_paged,
                           needs_the_compiler, on_backend, poison_, random_trees, report_from_fresh_process,
                           to_device)

BLOCK_SIZE = 8  # page size of the paged cases: pages split the prefix and the tree at odd places
SMALL = dict(R=32, P=8, N=16, Dh=16)  # Dqk = 40, Dv = 32
DEEPSEEK_V3 = dict(R=512, P=64, N=128, Dh=128)  # Dqk = 576, Dv = 512


def make_mla(gen, *, B=3, T=6, Hq=4, R, P, N, Dh, lens=(0, 13, 30), dtype=torch.float32, cache_dtype=None,
             k_scale=1.0, paged=False, packed=False, kinds=("random", "chain", "star")):
    """An MLA layer's tree-verification step: the absorbed op's keyword arguments (q, latent k_cache, v_cache the
    view of its first R channels, ...) and the unabsorbed model (float64 weights, queries, dequantized latent
    rows by logical position). Cache rows past cache_lens + T are NaN (a read of them shows)."""
    parents, num_nodes = random_trees(B, T, gen, kinds=kinds)
    cache_lens = torch.tensor(lens, dtype=torch.int32)
    cap = math.ceil((max(lens) + T) / BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE
    latent = torch.randn(B, cap, 1, R + P, generator=gen, dtype=torch.float64)
    stored = reference.quantize(latent, k_scale, cache_dtype) if cache_dtype else latent.to(dtype)
    for b in range(B):
        stored[b, int(cache_lens[b]) + T:] = float("nan")
    w_uk = torch.randn(Hq, N, R, generator=gen, dtype=torch.float64) / math.sqrt(N)
    w_uv = torch.randn(Hq, Dh, R, generator=gen, dtype=torch.float64) / math.sqrt(R)
    q_nope = torch.randn(B, T, Hq, N, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(B, T, Hq, P, generator=gen, dtype=torch.float64)
    q = torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, w_uk), q_rope], -1).to(dtype)  # absorbed, q's dtype
    block_table = None
    k_cache = stored
    if paged:
        block_table = torch.randperm(B * cap // BLOCK_SIZE + 2, generator=gen)[:B * cap // BLOCK_SIZE]
        block_table = block_table.view(B, -1).to(torch.int32)
        k_cache = torch.full((B * cap // BLOCK_SIZE + 2, BLOCK_SIZE, 1, R + P), float("nan"), dtype=stored.dtype)
        k_cache[block_table.view(-1).long()] = stored.view(-1, BLOCK_SIZE, 1, R + P)
    tree_mask = specdec.build_tree(parents, num_nodes).mask
    case = dict(q=q, k_cache=k_cache, v_cache=k_cache[..., :R], cache_lens=cache_lens, tree_mask=tree_mask,
                block_table=block_table, num_nodes=num_nodes, scale=(N + P) ** -0.5,
                k_scale=k_scale if cache_dtype else None)
    model = dict(latent=stored.double() * k_scale, w_uk=w_uk, w_uv=w_uv, q_nope=q_nope, q_rope=q_rope,
                 tree_mask=tree_mask, R=R)
    if packed:
        rows = torch.cat([b * T + torch.arange(int(num_nodes[b])) for b in range(B)])
        case.update(q=q.flatten(0, 1)[rows], tree_mask=tree_mask.flatten(0, 1)[rows], num_nodes=None,
                    cu_num_nodes=torch.cat([torch.zeros(1, dtype=torch.int32), num_nodes.cumsum(0).int()]),
                    max_nodes=T)
        model.update(rows=rows)
    return case, model, num_nodes


def unabsorbed(case, model, num_nodes, **kw):
    """The unabsorbed MLA: ordinary attention with one KV head per query head, queries [q_nope ; q_rope], keys
    K_h = [W_UK[h] c ; k_rope], values V_h = W_UV[h] c, from reference.tree_attention on materialized contiguous
    caches (float64). Returns out (B, T, Hq, Dh) and lse (B, T, Hq), padded (B, T) rows even for a packed case."""
    R, latent = model["R"], model["latent"]
    Hq = model["q_nope"].shape[-2]
    c, k_rope = latent[:, :, 0, :R], latent[:, :, :, R:]  # (B, cap, R), (B, cap, 1, P)
    keys = torch.cat([torch.einsum("bpr,hnr->bphn", c, model["w_uk"]), k_rope.expand(-1, -1, Hq, -1)], -1)
    values = torch.einsum("bpr,hdr->bphd", c, model["w_uv"])
    q = torch.cat([model["q_nope"], model["q_rope"]], -1)
    return reference.tree_attention(q, keys, values, case["cache_lens"], model["tree_mask"], None, num_nodes,
                                    case["scale"], **kw)


def run(case, backend, **kw):
    """The public op on `backend` (the reference on the CPU, other backends on DEVICE): (out, lse) on the CPU."""
    return tuple(x.cpu() for x in specdec.tree_attention(**on_backend(backend, case), return_lse=True,
                                                         backend=backend, **kw))


def check_against_unabsorbed(actual, case, model, num_nodes, dtype=torch.float32, **kw):
    """out (projected by W_UV) and lse within q's dtype tolerance of the unabsorbed MLA; padding rows exactly
    0 / -inf; every real row finite."""
    out, lse = actual
    ref_out, ref_lse = unabsorbed(case, model, num_nodes, **kw)
    projected = torch.einsum("...hr,hdr->...hd", out.double(), model["w_uv"])
    T = ref_out.shape[1]
    real = torch.arange(T).unsqueeze(0) < num_nodes.unsqueeze(1)
    if "rows" in model:  # packed: only real rows exist
        ref_out, ref_lse = ref_out[real], ref_lse[real]
        assert out.shape[0] == int(real.sum())
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    else:
        assert (out[~real] == 0).all() and (lse[~real] == -math.inf).all()
        projected, ref_out, lse, ref_lse = projected[real], ref_out[real], lse[real], ref_lse[real]
        assert torch.isfinite(out[real]).all()
    assert_close(projected, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32)


ALL = ["torch"] + BACKENDS


def test_absorbed_reference_equals_unabsorbed_mla():
    """The absorbed reference (float64 q) against the unabsorbed form, to float64 rounding: the two forms are one
    attention (scores q_nope . W_UK c + q_rope . k_rope, values W_UV c)."""
    gen = torch.Generator().manual_seed(1)
    for paged in (False, True):
        case, model, nn = make_mla(gen, dtype=torch.float64, paged=paged, **SMALL)
        out, lse = run(case, "torch")
        ref_out, ref_lse = unabsorbed(case, model, nn)
        assert out.shape == (3, 6, 4, SMALL["R"]) and out.dtype == torch.float64
        torch.testing.assert_close(torch.einsum("...hr,hdr->...hd", out, model["w_uv"]), ref_out, atol=1e-12,
                                   rtol=1e-12)
        torch.testing.assert_close(lse, ref_lse.float())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", ALL)
def test_matches_unabsorbed_mla(backend, paged):
    """Random trees (ragged node counts), fp32 q and cache, the small config (Dqk 40, Dv 32) with 4 and 16 heads."""
    gen = torch.Generator().manual_seed(2 + paged)
    for Hq in (4, 16):
        case, model, nn = make_mla(gen, Hq=Hq, paged=paged, **SMALL)
        check_against_unabsorbed(run(case, backend), case, model, nn)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_float8_latent_cache(backend, cache_dtype):
    """A float8 latent cache holding latent / k_scale, paged: V, read from the same rows, takes K's scale (v_scale
    None); against the unabsorbed MLA of the dequantized latent."""
    gen = torch.Generator().manual_seed(4)
    case, model, nn = make_mla(gen, cache_dtype=cache_dtype, k_scale=0.02, paged=True, **SMALL)
    check_against_unabsorbed(run(case, backend), case, model, nn)
    out, lse = run(dict(case, v_scale=0.02), backend)  # the same scale given explicitly
    check_against_unabsorbed((out, lse), case, model, nn)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_matches_absorbed_reference(backend, dtype):
    """fp16 / bf16 q and cache, paged: within the dtype's tolerance of the absorbed reference (float64 math on the
    same rounded inputs), itself checked against the unabsorbed form above."""
    gen = torch.Generator().manual_seed(5)
    case, _, nn = make_mla(gen, dtype=dtype, paged=True, **SMALL)
    out, lse = run(case, backend)
    ref_out, ref_lse = run(case, "torch")
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("backend", ALL)
def test_packed_rows(backend):
    """The packed (ragged) form: q (N, Hq, Dqk), out (N, Hq, Dv), against the unabsorbed MLA."""
    gen = torch.Generator().manual_seed(6)
    case, model, nn = make_mla(gen, paged=True, packed=True, **SMALL)
    out, lse = run(case, backend)
    assert out.shape == (int(nn.sum()), 4, SMALL["R"])
    check_against_unabsorbed((out, lse), case, model, nn)


@pytest.mark.parametrize("backend", ALL)
def test_window_soft_cap_and_sinks(backend):
    """A sliding window, soft-capping and attention sinks compose with the absorbed form as with GQA."""
    gen = torch.Generator().manual_seed(7)
    case, model, nn = make_mla(gen, lens=(2, 20, 33), paged=True, kinds=("random", "chain"), **SMALL)
    sinks = torch.randn(4, generator=gen)
    kw = dict(window_left=9, logits_soft_cap=3.0)
    out, lse = run(dict(case, sinks=sinks), backend, **kw)
    check_against_unabsorbed((out, lse), case, model, nn, sinks=sinks, **kw)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend", ALL)
def test_deepseek_v3_shape(backend, paged):
    """DeepSeek-V3's Dqk = 576, Dv = 512 (kv_lora_rank 512, rope 64), 8 heads, one small batch; bf16 contiguous,
    a float8 e4m3 paged cache with fp32 q."""
    gen = torch.Generator().manual_seed(8 + paged)
    dtype, cache = (torch.float32, torch.float8_e4m3fn) if paged else (torch.bfloat16, None)
    case, model, nn = make_mla(gen, B=2, T=4, Hq=8, lens=(5, 17), dtype=dtype, cache_dtype=cache, k_scale=0.05,
                               paged=paged, **DEEPSEEK_V3)
    out, lse = run(case, backend)
    assert out.shape == (2, 4, 8, 512)
    if dtype == torch.float32:
        check_against_unabsorbed((out, lse), case, model, nn)
    else:
        ref_out, ref_lse = run(case, "torch")
        assert_close(out, ref_out, dtype)
        assert_close(lse, ref_lse, torch.float32)


def test_v_cache_of_its_own_with_a_smaller_head_dim():
    """A V cache in memory of its own with Dv < D is plain attention with narrower values (V's own scale applies);
    a view of K's leading channels is the same attention with V = those channels."""
    gen = torch.Generator().manual_seed(9)
    case, _, _ = make_mla(gen, **SMALL)
    copy = case["k_cache"][..., :SMALL["R"]].clone()
    for backend in ALL:
        viewed = run(case, backend)
        copied = run(dict(case, v_cache=copy), backend)
        assert_close(copied[0], viewed[0], torch.float32)
        assert_close(copied[1], viewed[1], torch.float32)


def bad_mla_inputs(case):
    """(arguments changed, error, message) for inconsistent MLA inputs."""
    k = case["k_cache"]
    B, cap = k.shape[:2]
    return [
        (dict(v_cache=torch.cat([k, k[..., :8]], -1)), ValueError, r"v_cache: head dim 48 must be in \[1, 40\]"),
        (dict(v_cache=k[:, :, :, :0]), ValueError, r"v_cache: head dim 0 must be in \[1, 40\]"),
        (dict(v_cache=k[:, :-1, :, :32]), ValueError,
         rf"v_cache: expected shape \({B}, {cap}, 1, 32\), got \({B}, {cap - 1}, 1, 32\)"),
        (dict(v_cache=k[..., :32].double()), TypeError, "v_cache: dtype torch.float64 differs from k_cache dtype"),
        (dict(v_cache=k[..., :32].unsqueeze(0)), ValueError,
         rf"v_cache: expected shape \({B}, {cap}, 1, 40\), got \(1, {B}, {cap}, 1, 32\)"),
    ]


@pytest.mark.parametrize("backend", ALL)
def test_bad_inputs_are_named(backend):
    """Inconsistent V shapes, dtypes and head dims, and a float8 view of K with a scale of its own, are refused with
    a ValueError / TypeError naming the argument; the C++ op itself (no Python checks before it) with the same
    message."""
    gen = torch.Generator().manual_seed(10)
    case, _, _ = make_mla(gen, **SMALL)
    names = ("q", "k_cache", "v_cache", "cache_lens", "tree_mask", "block_table", "num_nodes")
    for change, error, message in bad_mla_inputs(case):
        with pytest.raises(error, match="^" + message):
            run(dict(case, **change), backend)
        if backend == "cpp":
            with pytest.raises(error, match="^" + message):
                torch.ops.specdec.tree_attention(*(dict(case, **change)[n] for n in names), 0.25)
    fp8, _, _ = make_mla(gen, cache_dtype=torch.float8_e4m3fn, k_scale=0.5, **SMALL)
    message = r"v_scale: v_cache is a view of k_cache's rows, which hold K / k_scale: V's scale is k_scale \(0.5\)"
    with pytest.raises(ValueError, match="^" + message):
        run(dict(fp8, v_scale=0.25), backend)
    if backend == "cpp":  # the schema's default v_scale 1.0 differs from k_scale too
        with pytest.raises(ValueError, match="^" + message):
            torch.ops.specdec.tree_attention(*(fp8[n] for n in names), 0.25, 0.5)


def test_layer_calls_and_opcheck():
    """LayerCalls runs MLA layers (single-cache kv_append, the view as v_cache) as the ops do; the MLA form passes
    torch.library.opcheck (schema, fake out (..., Dv), AOT dispatch) on the registered CPU kernel."""
    gen = torch.Generator().manual_seed(11)
    case, _, _ = make_mla(gen, **SMALL)
    latent = case["k_cache"].clone()
    new = torch.randn(3, 6, 1, 40, generator=gen)
    specdec.kv_append(latent, None, new, None, case["cache_lens"])
    calls = specdec.ops.LayerCalls(case["cache_lens"], case["tree_mask"], num_nodes=case["num_nodes"])
    layer = case["k_cache"].clone()
    calls.kv_append(layer, None, new, None)
    assert torch.equal(layer.nan_to_num(), latent.nan_to_num())
    expected = specdec.tree_attention(case["q"], latent, latent[..., :32], case["cache_lens"], case["tree_mask"],
                                      num_nodes=case["num_nodes"], scale=case["scale"])
    assert torch.equal(calls.tree_attention(case["q"], layer, layer[..., :32], scale=case["scale"]), expected)
    default_scale = calls.tree_attention(case["q"], layer, layer[..., :32])  # (1/sqrt(Dqk): another scale)
    assert not torch.equal(default_scale, expected)
    args = (case["q"], latent, latent[..., :32], case["cache_lens"], case["tree_mask"], None, case["num_nodes"], 0.2)
    torch.library.opcheck(torch.ops.specdec.tree_attention.default, args)


def triton_mla(case, **launcher_kw):
    """The Triton launcher directly (normalized arguments, on DEVICE) for its test-only knobs."""
    from specdec.kernels import tree_attention as ta
    names = ("q", "k_cache", "v_cache", "cache_lens", "tree_mask", "block_table", "num_nodes")
    k_scale = case["k_scale"] or 1.0
    return ta.tree_attention(*(to_device(case[name]) for name in names), case["scale"], k_scale, k_scale,
                             **launcher_kw)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton launcher")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_split_kv_into_poisoned_outputs(num_splits):
    """Split-KV off and on (empty splits: cache_lens 0), small tiles, a float8 latent cache, writing into NaN-poisoned
    buffers (out (B, T, Hq, Dv)): every element written, padding rows 0 / -inf, against the unabsorbed MLA."""
    from specdec.kernels import tree_attention as ta
    gen = torch.Generator().manual_seed(12 + num_splits)
    case, model, nn = make_mla(gen, B=3, Hq=4, lens=(0, 9, 35), cache_dtype=torch.float8_e5m2, k_scale=0.1,
                               paged=True, **SMALL)
    out = poison_(torch.empty(3, 6, 4, SMALL["R"], device=DEVICE))
    lse = poison_(torch.empty(3, 6, 4, device=DEVICE))
    config = ta.TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    result = triton_mla(case, num_splits=num_splits, config=config, out=out, lse=lse)
    assert result[0] is out and result[1] is lse
    check_against_unabsorbed((out.cpu(), lse.cpu()), case, model, nn)


@pytest.mark.skipif("triton" not in BACKENDS or DEVICE.type == "cuda", reason="interpreter spy")
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_reads_each_latent_element_once(monkeypatch, num_splits):
    """MLA's bandwidth claim: with V a view of K's rows, every latent element of a request's cache_lens[b] +
    num_nodes[b] positions is loaded exactly once for all T nodes and all Hq heads (one row tile), K and V alike
    (V's channels are not loaded again); with V a copy, the latent is still read once (K), V from the copy."""
    from specdec.kernels import tree_attention as ta
    gen = torch.Generator().manual_seed(14 + num_splits)
    case, _, nn = make_mla(gen, B=2, T=4, Hq=8, lens=(21, 3), paged=True, **SMALL)  # 32 rows: one tile
    config = ta.TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    latent, table = case["k_cache"], case["block_table"]
    addresses = from_paged(element_addresses(latent), table)
    expected = {}
    for b in range(2):
        for p in range(int(case["cache_lens"][b]) + int(nn[b])):
            expected.update(dict.fromkeys(addresses[b, p].reshape(-1).tolist(), 1))
    spy = MemorySpy(monkeypatch)
    triton_mla(case, num_splits=num_splits, config=config)
    assert spy.counts([latent]) == expected
    spy.loads.clear()
    triton_mla(dict(case, v_cache=latent[..., :SMALL["R"]].clone()), num_splits=num_splits, config=config)
    assert spy.counts([latent]) == expected



@needs_the_compiler
@pytest.mark.parametrize("cache,paged,num_splits", [("bf16", False, 1), ("fp8e4nv", True, 4)],
                         ids=["bf16-contiguous", "fp8-paged-split"])
def test_compiles_for_hopper_at_deepseek_v3_shape(cache, paged, num_splits):
    """The MLA variant at DeepSeek-V3's shape (Hq 128 on one latent head, T 16, Dqk 576, Dv 512, bf16 q) compiles
    for sm_90 with tensor-core dots (wgmma), shared memory for one program per SM (228 KiB, 1 KiB reserved), and
    at most 512 bytes a thread spilled (64 rows x 512 fp32 accumulators: 128 of the 255 registers;
    bench/results/triton-sm90-offline.md); the merge spills none."""
    args = (paged, num_splits, cache, False, False, 576, False, 512, 128)
    report = report_from_fresh_process(f"from tests.ops.test_tree_attention import hopper_report; "
                                      f"hopper_report{args!r}", timeout=300)
    assert report["wgmma"] and report["shared"] <= 227 * 1024
    assert report["spilled"] is None or report["spilled"] <= 512, report
    assert report["merge_spilled"] in (0, None)
