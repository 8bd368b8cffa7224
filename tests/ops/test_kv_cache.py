"""kv_append / kv_rollback backends against the reference, on copies of the same random inputs.

Results must be bit-identical (the ops are pure copies), compared through an integer view so the NaN
rows of unowned paged blocks compare too. For Triton, an interpreter spy also checks that rollback
writes exactly the rows that must move and reads exactly their sources (in-place rows cost nothing).
Inputs are built on the CPU; the tested backend runs on tests.helpers.DEVICE (SPECDEC_TEST_DEVICE=cuda
runs the compiled kernels on a GPU) on copies that keep every stride, the reference on the CPU.
"""
import zlib

import numpy as np
import pytest
import torch

import specdec
from tests.helpers import (BACKENDS, DEVICE, FLOAT_DTYPES, FP8_DTYPES, MemorySpy, as_form, compile_for_hopper,
                           from_paged, needs_the_compiler, random_cache, random_trees, report_from_fresh_process,
                           root_path, to_device, to_paged)

LAYOUTS = ["contiguous", "paged"]
BLOCK_SIZE = 4
DTYPE_IDS = [str(d).removeprefix("torch.") for d in FLOAT_DTYPES]
FP8_IDS = [str(d).removeprefix("torch.") for d in FP8_DTYPES]


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def random_lens(B: int, T: int, cap: int, gen: torch.Generator) -> torch.Tensor:
    """Committed lengths leaving room for T rows: 0, the last T slots, block boundaries, random."""
    edge = [0, cap - T, min(BLOCK_SIZE, cap - T), min(2 * BLOCK_SIZE - 1, cap - T)]
    lens = [edge[b] if b < len(edge) else int(torch.randint(0, cap - T + 1, (1,), generator=gen)) for b in range(B)]
    return torch.tensor(lens, dtype=torch.int32)


def random_paths(B: int, T: int, gen: torch.Generator):
    """(B, T) int32 accepted paths padded with -1 and num_accepted (B,): no draft accepted, a full chain
    (every row in place), overlap-prone runs (2->1, 3->2, ...), a prefix in place then jumps, and
    root-to-node paths of random trees."""
    parents, _ = random_trees(B, T, gen, kinds=("random", "star", "chain"), ragged=False)
    fixed = [[0], list(range(T)), [0] + list(range(2, T)), [0, 1, 3, 4, T - 1]]
    paths = torch.full((B, T), -1, dtype=torch.int32)
    num_accepted = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        if b < len(fixed):
            path = fixed[b]
        else:
            path = root_path(parents[b], int(torch.randint(0, T, (1,), generator=gen)))
        paths[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted[b] = len(path) - 1
    return paths, num_accepted


def make_caches(layers, B, cap, H, D, dtype, layout, gen):
    """K and V stacks (layers, B, cap, H, D) or paged (layers, num_blocks, BLOCK_SIZE, H, D) and the table."""
    k, v = random_cache(layers * B, cap, H, D, dtype, gen), random_cache(layers * B, cap, H, D, dtype, gen)
    k, v = k.view(layers, B, cap, H, D), v.view(layers, B, cap, H, D)
    if layout == "contiguous":
        return k, v, None
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    pages = [[to_paged(x[i], BLOCK_SIZE, torch.Generator().manual_seed(seed)) for i in range(layers)] for x in (k, v)]
    table = pages[0][0][1]
    return torch.stack([p for p, _ in pages[0]]), torch.stack([p for p, _ in pages[1]]), table


def logical(cache: torch.Tensor, table) -> torch.Tensor:
    return cache if table is None else from_paged(cache, table)


def for_backend(backend, *tensors):
    """The inputs as `backend` gets them: the reference the CPU tensors themselves, another backend
    copies on DEVICE with the same strides (the very tensors on a CPU run)."""
    return tensors if backend == "torch" else tuple(to_device(t) for t in tensors)


# ----------------------------------------------------------------------------------------------
# kv_rollback
# ----------------------------------------------------------------------------------------------
def run_rollback(backend, k, v, table, lens, paths, num_accepted, form):
    """kv_rollback on copies of the caches and lengths; the results on the CPU."""
    k, v, lens, table, paths, num_accepted = for_backend(backend, k.clone(), v.clone(), lens.clone(), table, paths,
                                                         num_accepted)
    specdec.kv_rollback(as_form(k, form), as_form(v, form), lens, paths, num_accepted,
                        block_table=table, backend=backend)
    return k.cpu(), v.cpu(), lens.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES, ids=DTYPE_IDS + FP8_IDS)
@pytest.mark.parametrize("form", ["layer", "stacked", "list", "list_of_stacks"])
def test_rollback_matches_reference(backend, layout, dtype, form):
    gen = torch.Generator().manual_seed(seed_of(layout, dtype, form))
    B, T, H, D, cap, layers = 7, 8, 3, 5, 24, 3
    k, v, table = make_caches(layers, B, cap, H, D, dtype, layout, gen)
    lens = random_lens(B, T, cap, gen)
    paths, num_accepted = random_paths(B, T, gen)
    k_out, v_out, lens_out = run_rollback(backend, k, v, table, lens, paths, num_accepted, form)
    k_ref, v_ref, lens_ref = run_rollback("torch", k, v, table, lens, paths, num_accepted, form)
    assert torch.equal(lens_out, lens_ref) and torch.equal(lens_ref, lens + num_accepted + 1)
    assert same_bits(k_out, k_ref) and same_bits(v_out, v_ref)
    # independent of the reference: the committed prefix and the rows past the new length keep their
    # values, the accepted path's rows are compacted
    used = 1 if form == "layer" else layers
    for before, after in ((k, k_out), (v, v_out)):
        for layer in range(used):
            old, new = logical(before[layer], table), logical(after[layer], table)
            for b in range(B):
                L, n = int(lens[b]), int(num_accepted[b]) + 1
                assert same_bits(new[b, :L], old[b, :L])
                assert same_bits(new[b, L: L + n], old[b, L + paths[b, :n].long()])
                assert same_bits(new[b, L + n:], old[b, L + n:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_engine_like_heads_over_several_tiles(backend):
    # Hkv 8, D 128: the head dimension spans several program tiles; paths longer than one step
    gen = torch.Generator().manual_seed(11)
    B, T, H, D, cap, layers = 5, 20, 8, 128, 32, 2
    k, v, table = make_caches(layers, B, cap, H, D, torch.bfloat16, "paged", gen)
    lens = random_lens(B, T, cap, gen)
    paths, num_accepted = random_paths(B, T, gen)
    paths[4] = torch.tensor([0] + list(range(2, 20, 2)) + [-1] * 10, dtype=torch.int32)  # 10 moves
    num_accepted[4] = 9
    k_out, v_out, lens_out = run_rollback(backend, k, v, table, lens, paths, num_accepted, "stacked")
    k_ref, v_ref, lens_ref = run_rollback("torch", k, v, table, lens, paths, num_accepted, "stacked")
    assert torch.equal(lens_out, lens_ref)
    assert same_bits(k_out, k_ref) and same_bits(v_out, v_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_list_of_layers_with_different_strides(backend):
    gen = torch.Generator().manual_seed(12)
    B, T, H, D, cap = 4, 6, 2, 4, 12
    k, v, _ = make_caches(2, B, cap, H, D, torch.float16, "contiguous", gen)
    # layer 1 stored head-dim-major: same shape, another stride layout
    k1 = k[1].transpose(2, 3).contiguous().transpose(2, 3)
    v1 = v[1].transpose(2, 3).contiguous().transpose(2, 3)
    lens = random_lens(B, T, cap, gen)
    paths, num_accepted = random_paths(B, T, gen)
    outs = {}
    for name in (backend, "torch"):
        k0c, k1c, v0c, v1c, lens_out, paths_in, num_in = for_backend(
            name, k[0].clone(), k1.clone(), v[0].clone(), v1.clone(), lens.clone(), paths, num_accepted)
        specdec.kv_rollback([k0c, k1c], [v0c, v1c], lens_out, paths_in, num_in, backend=name)
        outs[name] = [t.cpu() for t in (k0c, k1c, v0c, v1c, lens_out)]
    assert all(same_bits(a, b) for a, b in zip(outs[backend], outs["torch"]))


def row_addresses(cache, table, b, positions):
    """Element addresses of logical rows `positions` of request b in every layer of a 5-D cache."""
    rows = logical(torch.arange(cache[0].numel(), dtype=torch.int64).view(cache.shape[1:]), table)
    elems = rows[b, positions].reshape(-1)
    layer = torch.arange(cache.shape[0]).unsqueeze(1) * cache.stride(0)
    return (cache.data_ptr() + (layer + elems) * cache.element_size()).reshape(-1).numpy()


@pytest.mark.skipif("triton" not in BACKENDS, reason="interpreter spy")
@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["stacked", "list"])
def test_rollback_moves_only_rows_off_place(monkeypatch, layout, form):
    gen = torch.Generator().manual_seed(13)
    B, T, H, D, cap, layers = 6, 8, 2, 4, 16, 2
    k, v, table = make_caches(layers, B, cap, H, D, torch.float16, layout, gen)
    lens = random_lens(B, T, cap, gen)
    paths, num_accepted = random_paths(B, T, gen)
    expected_reads, expected_writes = [], []
    for b in range(B):
        n = int(num_accepted[b]) + 1
        i = torch.arange(n)
        off = paths[b, :n].long() != i  # rows already in place are neither read nor written
        for cache in (k, v):
            expected_reads.append(row_addresses(cache, table, b, int(lens[b]) + paths[b, :n].long()[off]))
            expected_writes.append(row_addresses(cache, table, b, int(lens[b]) + i[off]))
    spy = MemorySpy(monkeypatch)
    specdec.kv_rollback(as_form(k, form), as_form(v, form), lens.clone(), paths, num_accepted,
                        block_table=table, backend="triton")
    writes, reads = spy.inside(spy.stores, (k, v)), spy.inside(spy.loads, (k, v))
    # each moved element written exactly once, read exactly once, nothing else touched
    assert np.array_equal(np.sort(writes), np.sort(np.concatenate(expected_writes)))
    assert np.array_equal(np.sort(reads), np.sort(np.concatenate(expected_reads)))
    full_chain = 1  # random_paths: request 1 accepts its whole chain, every row in place
    assert not np.isin(row_addresses(k, table, full_chain, torch.arange(T) + int(lens[full_chain])), writes).any()


# ----------------------------------------------------------------------------------------------
# kv_append
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("T", [0, 1, 11])
def test_append_matches_reference(backend, layout, dtype, T):
    gen = torch.Generator().manual_seed(seed_of(layout, dtype, T))
    B, H, D, cap = 6, 3, 5, 24
    k, v, table = make_caches(1, B, cap, H, D, dtype, layout, gen)
    k, v = k[0], v[0]
    lens = random_lens(B, T, cap, gen)
    # non-contiguous new rows with different strides: K a slice of a fused projection output, V head-major
    k_new = torch.randn(B, T, 3 * H + 1, D, generator=gen).to(dtype)[:, :, 1: H + 1]
    v_new = torch.randn(B, H, T, D, generator=gen).to(dtype).transpose(1, 2)
    outs = {}
    for name in (backend, "torch"):
        kc, vc, k_in, v_in, lens_c, table_in = for_backend(name, k.clone(), v.clone(), k_new, v_new, lens.clone(),
                                                            table)
        specdec.kv_append(kc, vc, k_in, v_in, lens_c, block_table=table_in, backend=name)
        assert torch.equal(lens_c.cpu(), lens)  # append does not commit
        outs[name] = kc.cpu(), vc.cpu()
    assert same_bits(outs[backend][0], outs["torch"][0]) and same_bits(outs[backend][1], outs["torch"][1])
    # independent of the reference: the T rows hold the new values, every other row is unchanged
    for old, new, src in ((k, outs[backend][0], k_new), (v, outs[backend][1], v_new)):
        old, new = logical(old, table), logical(new, table)
        for b in range(B):
            L = int(lens[b])
            assert same_bits(new[b, L: L + T], src[b])
            assert same_bits(new[b, :L], old[b, :L]) and same_bits(new[b, L + T:], old[b, L + T:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("new_dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=FP8_IDS)
def test_append_float8_quantizes(backend, cache_dtype, new_dtype, layout):
    """A float8 cache stores fp32(x) * fp32(1 / scale) saturated and rounded to nearest even: bit-identical to
    the reference; independently, each stored value dequantizes to x within the format's precision, and
    values (and infinities) beyond its range saturate to +-max. (Under the interpreter the final rounding is
    torch's conversion, see conftest.py: the GPU's cvt.rn.satfinite is checked on a GPU run and in the PTX.)"""
    gen = torch.Generator().manual_seed(seed_of(cache_dtype, new_dtype, layout))
    B, T, H, D, cap = 5, 6, 2, 16, 24
    k, v, table = make_caches(1, B, cap, H, D, cache_dtype, layout, gen)
    k, v = k[0], v[0]
    lens = random_lens(B, T, cap, gen)
    k_scale, v_scale = 0.013, 2.5
    limit = torch.finfo(cache_dtype).max
    k_new = (torch.randn(B, T, H, D, generator=gen) * k_scale * limit / 2).to(new_dtype)  # some beyond the range
    k_new[0, 0, 0, :2] = torch.tensor([float("inf"), -float("inf")])
    v_new = torch.randn(B, T, H, D, generator=gen).to(new_dtype)
    outs = {}
    for name in (backend, "torch"):
        kc, vc, k_in, v_in, lens_in, table_in = for_backend(name, k.clone(), v.clone(), k_new, v_new, lens, table)
        specdec.kv_append(kc, vc, k_in, v_in, lens_in, block_table=table_in, k_scale=k_scale, v_scale=v_scale,
                          backend=name)
        outs[name] = kc.cpu(), vc.cpu()
    assert same_bits(outs[backend][0], outs["torch"][0]) and same_bits(outs[backend][1], outs["torch"][1])
    info = torch.finfo(cache_dtype)
    half_ulp, half_subnormal_step = info.eps / 2, info.smallest_normal * info.eps / 2
    for new, src, scale in ((outs[backend][0], k_new, k_scale), (outs[backend][1], v_new, v_scale)):
        new = logical(new, table)
        for b in range(B):
            L = int(lens[b])
            stored, wanted = new[b, L: L + T].double(), src[b].double() / scale
            saturated = wanted.abs() > limit
            assert (stored[saturated] == wanted[saturated].sign() * limit).all()
            assert (stored[~saturated] - wanted[~saturated]).abs().le(
                half_ulp * wanted[~saturated].abs() + half_subnormal_step).all()
    assert logical(outs[backend][0], table)[0, int(lens[0]), 0, :2].float().tolist() == [limit, -limit]


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_engine_like_heads_over_several_tiles(backend):
    gen = torch.Generator().manual_seed(21)
    B, T, H, D, cap = 3, 16, 8, 128, 64
    k, v, table = make_caches(1, B, cap, H, D, torch.bfloat16, "paged", gen)
    k, v = k[0], v[0]
    lens = random_lens(B, T, cap, gen)
    k_new = torch.randn(B, T, H, D, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(B, T, H, D, generator=gen).to(torch.bfloat16)
    outs = {}
    for name in (backend, "torch"):
        kc, vc, k_in, v_in, lens_in, table_in = for_backend(name, k.clone(), v.clone(), k_new, v_new, lens, table)
        specdec.kv_append(kc, vc, k_in, v_in, lens_in, block_table=table_in, backend=name)
        outs[name] = kc.cpu(), vc.cpu()
    assert same_bits(outs[backend][0], outs["torch"][0]) and same_bits(outs[backend][1], outs["torch"][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_and_rollback_touch_only_their_blocks(backend):
    """Blocks wholly before cache_lens (freed by an engine whose sliding window left them behind: id -1) are
    neither checked nor touched by append and rollback, which write and move rows from cache_lens on."""
    gen = torch.Generator().manual_seed(31)
    B, T, H, D, cap = 4, 6, 2, 8, 32
    k, v, table = make_caches(2, B, cap, H, D, torch.float32, "paged", gen)
    lens = torch.tensor([9, 0, 13, 20], dtype=torch.int32)
    table = table.clone()
    for b in range(B):
        table[b, :int(lens[b]) // BLOCK_SIZE] = -1
    k_new, v_new = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    paths, num_accepted = random_paths(B, T, gen)
    outs = {}
    for name in (backend, "torch"):
        kc, vc, k_in, v_in, lens_in, table_in, paths_in, num_in = for_backend(
            name, k.clone(), v.clone(), k_new, v_new, lens.clone(), table, paths, num_accepted)
        specdec.kv_append(kc[0], vc[0], k_in, v_in, lens_in, block_table=table_in, backend=name)
        specdec.kv_rollback(kc, vc, lens_in, paths_in, num_in, block_table=table_in, backend=name)
        outs[name] = kc.cpu(), vc.cpu(), lens_in.cpu()
    assert all(same_bits(a, b) for a, b in zip(outs[backend], outs["torch"]))
    assert torch.equal(outs["torch"][2], lens + num_accepted + 1)


# ----------------------------------------------------------------------------------------------
# compiled code (no GPU needed): the interpreter accepts programs the compiler rejects
# ----------------------------------------------------------------------------------------------
def ptx_for_hopper(fn, types, constexprs):
    """PTX of `fn` for sm_90 with every pointer and integer argument 16-divisible, as Triton
    specializes them when launched on an engine's shapes (D 128, strides multiples of 16)."""
    return compile_for_hopper(fn, types, constexprs).asm["ptx"]


def vectorized_copies_report(elem: str) -> None:
    """Prints (JSON) which instructions the kernels compile to for sm_90 with `elem` ("fp16", "fp32") caches.
    Runs in a fresh process without TRITON_INTERPRET (see tests.helpers.report_from_fresh_process)."""
    import json

    from specdec.kernels import kv_cache
    ints = {"cache_lens": "*i32", "accepted_nodes": "*i32", "num_accepted": "*i32", "block_table": "*i32",
            "new_lens": "*i32", "entry_offsets": "*i64"}
    rollback = ptx_for_hopper(kv_cache._kv_rollback_kernel, {"caches": f"*{elem}", **ints},
                              {"ENTRY_ALIGN": 16, "BLOCK_P": 8, "BLOCK_H": 4, "BLOCK_D": 128, "s_d": 1,
                               "IDENTITY_TABLE": False})
    caches = {name: f"*{elem}" for name in ("k_cache", "v_cache", "k_new", "v_new")}
    scales = {"k_inv_scale": "fp32", "v_inv_scale": "fp32"}
    unit = {"skc_d": 1, "svc_d": 1, "skn_d": 1, "svn_d": 1}
    append = ptx_for_hopper(kv_cache._kv_append_kernel, {**caches, **ints, **scales},
                            {"BLOCK_T": 8, "BLOCK_H": 4, "BLOCK_D": 128, "FP8_LIMIT": 0.0, "IDENTITY_TABLE": False,
                             **unit})
    # a float8 cache fed 16-bit rows
    fp8 = {"k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv", "k_new": "*bf16", "v_new": "*bf16"}
    append_fp8 = ptx_for_hopper(kv_cache._kv_append_kernel, {**fp8, **ints, **scales},
                                {"BLOCK_T": 8, "BLOCK_H": 4, "BLOCK_D": 128, "FP8_LIMIT": 448.0,
                                 "IDENTITY_TABLE": False, **unit})
    found = {name: {ins: ins in ptx for ins in ("ld.global.v4.b32", "st.global.v4.b32", "bar.sync",
                                                "cvt.rn.satfinite.e4m3x2.f32")}
             for name, ptx in (("rollback", rollback), ("append", append), ("append_fp8", append_fp8))}
    print(json.dumps(found))


@needs_the_compiler
@pytest.mark.parametrize("elem", ["fp16", "fp32"])
def test_kernels_compile_to_vectorized_copies(elem):
    found = report_from_fresh_process(
        f"from tests.ops.test_kv_cache import vectorized_copies_report; vectorized_copies_report({elem!r})")
    for name in ("rollback", "append"):  # 16-byte loads and stores
        assert found[name]["ld.global.v4.b32"] and found[name]["st.global.v4.b32"], name
    assert found["rollback"]["bar.sync"]  # sources read before destinations are written
    # a float8 cache fed 16-bit rows: hardware conversion, round to nearest even, saturating
    assert found["append_fp8"]["cvt.rn.satfinite.e4m3x2.f32"] and found["append_fp8"]["ld.global.v4.b32"]


# ----------------------------------------------------------------------------------------------
# positions near 2**31 and caches over 2**31 elements (positions and element offsets in int64)
# ----------------------------------------------------------------------------------------------
def append_then_rollback(backend, k, v, lens, table, paths, num_accepted, rows):
    """kv_append of rows (B, T, H, D) (K; V their negation) at cache_lens, then kv_rollback of the paths, on `backend`
    (on copies); (new lengths, K, V) on the CPU."""
    k, v, lens, table, paths, num_accepted, rows = for_backend(backend, k.clone(), v.clone(), lens.clone(), table,
                                                               paths, num_accepted, rows)
    specdec.kv_append(k, v, rows, rows.neg(), lens, block_table=table, backend=backend)
    specdec.kv_rollback(k, v, lens, paths, num_accepted, block_table=table, backend=backend)
    return lens.cpu(), k.cpu(), v.cpu()


NEAR_LIMIT_BLOCK = 8176  # divides 2**31 - 16: a block boundary among the rows written


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_and_rollback_near_int32_limit(backend):
    """Rows written and moved up to position 2**31 - 2 (request 0) and across the block boundary at 2**31 - 16
    (request 1), in a paged cache holding only the blocks touched (the table's other entries are -1)."""
    gen = torch.Generator().manual_seed(41)
    T, H, D = 6, 2, 4
    lens = torch.tensor([2**31 - 1 - T, 2**31 - 16 - 3], dtype=torch.int32)
    table = torch.full((2, -(-2**31 // NEAR_LIMIT_BLOCK)), -1, dtype=torch.int32)
    owned = [(b, column) for b in range(2)
             for column in range(int(lens[b]) // NEAR_LIMIT_BLOCK, (int(lens[b]) + T - 1) // NEAR_LIMIT_BLOCK + 1)]
    for block, (b, column) in enumerate(owned):
        table[b, column] = block
    k = torch.randn(len(owned) + 2, NEAR_LIMIT_BLOCK, H, D, generator=gen)
    v = torch.randn(len(owned) + 2, NEAR_LIMIT_BLOCK, H, D, generator=gen)
    rows = torch.randn(2, T, H, D, generator=gen)
    paths = torch.tensor([[0, 2, 3, 5, -1, -1], [0, 1, 4, -1, -1, -1]], dtype=torch.int32)
    num_accepted = torch.tensor([3, 2], dtype=torch.int32)
    outs = {name: append_then_rollback(name, k, v, lens, table, paths, num_accepted, rows)
            for name in (backend, "torch")}
    assert torch.equal(outs[backend][0], outs["torch"][0]) and torch.equal(outs["torch"][0], lens + num_accepted + 1)
    assert same_bits(outs[backend][1], outs["torch"][1]) and same_bits(outs[backend][2], outs["torch"][2])
    assert not same_bits(outs["torch"][1], k)  # (the rows were written)


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_and_rollback_head_major_cache_over_2_31_elements(backend):
    """A contiguous cache stored head-major, (Hkv, 1, L_max, D) viewed as (1, L_max, Hkv, D): head 2 starts 2**31
    elements in. Allocated but never filled (the pages stay virtual) save the rows compared; float8, 3 GiB a
    tensor."""
    gen = torch.Generator().manual_seed(42)
    T, H, L_max = 6, 3, 2**26
    L = L_max - T - 2
    rows = torch.randn(1, T, H, 16, generator=gen)
    paths, num_accepted = torch.tensor([[0, 2, 3, 5, -1, -1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    tail = [torch.randn(1, T + 4, H, 16, generator=gen).to(torch.float8_e4m3fn) for _ in range(2)]  # rows L - 2 on
    results = {}
    for name in (backend, "torch"):
        device = "cpu" if name == "torch" else DEVICE
        k, v = (torch.empty((H, 1, L_max, 16), dtype=torch.float8_e4m3fn, device=device).permute(1, 2, 0, 3)
                for _ in range(2))
        assert k.stride(2) * 2 >= 2**31 > k.stride(2)
        for cache, values in zip((k, v), tail):
            cache[:, L - 2:] = values.to(device)
        lens = torch.tensor([L], dtype=torch.int32, device=device)
        specdec.kv_append(k, v, rows.to(device), rows.neg().to(device), lens, backend=name)
        specdec.kv_rollback(k, v, lens, paths.to(device), num_accepted.to(device), backend=name)
        results[name] = lens.cpu(), k[:, L - 2:].cpu(), v[:, L - 2:].cpu()
    assert torch.equal(results[backend][0], results["torch"][0])
    assert same_bits(results[backend][1], results["torch"][1]) and same_bits(results[backend][2], results["torch"][2])
    # independent of the reference: the accepted path's new rows, compacted at L (row 2 of the rows compared)
    assert same_bits(results["torch"][1][0, 2:6], rows[0, paths[0, :4].long()].to(torch.float8_e4m3fn))


# ----------------------------------------------------------------------------------------------
# single-cache layers (MLA's latent cache [c_kv ; k_rope]: V is a view of its rows, never written or moved apart)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "float8_e4m3fn"])
def test_single_cache_append(backend, layout, dtype):
    """kv_append(latent, None, new, None): the T rows hold the new latents (quantized for float8, bit-identical to
    the reference), every other row is unchanged."""
    gen = torch.Generator().manual_seed(seed_of("single-append", layout, dtype))
    B, T, D, cap = 5, 6, 40, 24
    latent, _, table = make_caches(1, B, cap, 1, D, dtype, layout, gen)
    latent = latent[0]
    lens = random_lens(B, T, cap, gen)
    new = torch.randn(B, T, 1, D, generator=gen)
    scale = 0.03 if dtype == torch.float8_e4m3fn else None
    outs = {}
    for name in (backend, "torch"):
        cache, new_in, lens_in, table_in = for_backend(name, latent.clone(), new, lens, table)
        specdec.kv_append(cache, None, new_in, None, lens_in, block_table=table_in, k_scale=scale, backend=name)
        outs[name] = cache.cpu()
    assert same_bits(outs[backend], outs["torch"])
    old, got = logical(latent, table), logical(outs[backend], table)
    for b in range(B):
        L = int(lens[b])
        expected = new[b] if scale is None else specdec.reference.quantize(new[b], scale, dtype)
        assert same_bits(got[b, L: L + T], expected.to(dtype))
        assert same_bits(got[b, :L], old[b, :L]) and same_bits(got[b, L + T:], old[b, L + T:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["layer", "stacked", "list"])
def test_single_cache_rollback(backend, layout, form):
    """kv_rollback(latent, None, ...) moves each accepted row once (overlap-prone paths included): the committed
    prefix and the rows past the new length keep their values, the path is compacted, bit-identical to the
    reference."""
    gen = torch.Generator().manual_seed(seed_of("single-rollback", layout, form))
    B, T, D, cap, layers = 7, 8, 40, 24, 2
    latent, _, table = make_caches(layers, B, cap, 1, D, torch.bfloat16, layout, gen)
    lens = random_lens(B, T, cap, gen)
    paths, num_accepted = random_paths(B, T, gen)
    outs = {}
    for name in (backend, "torch"):
        cache, lens_in, table_in, paths_in, num_in = for_backend(name, latent.clone(), lens.clone(), table, paths,
                                                                 num_accepted)
        specdec.kv_rollback(as_form(cache, form), None, lens_in, paths_in, num_in, block_table=table_in,
                            backend=name)
        outs[name] = cache.cpu(), lens_in.cpu()
    assert same_bits(outs[backend][0], outs["torch"][0]) and torch.equal(outs[backend][1], lens + num_accepted + 1)
    for layer in range(1 if form == "layer" else layers):
        old, new = logical(latent[layer], table), logical(outs[backend][0][layer], table)
        for b in range(B):
            L, n = int(lens[b]), int(num_accepted[b]) + 1
            assert same_bits(new[b, :L], old[b, :L]) and same_bits(new[b, L + n:], old[b, L + n:])
            assert same_bits(new[b, L: L + n], old[b, L + paths[b, :n].long()])


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_single_cache_refuses_a_view_of_its_rows_as_v(backend):
    """MLA's V view (latent[..., :Dv]) as v_cache would write or move its rows twice (a row moved onto a later
    source is moved again): kv_append and kv_rollback refuse it, naming v_cache (rollback also the latent itself
    as v_cache), before anything is written; so does a v_new without v_cache and the converse."""
    gen = torch.Generator().manual_seed(32)
    B, T, D, cap = 3, 4, 40, 16
    latent = torch.randn(B, cap, 1, D, generator=gen)
    lens = torch.tensor([0, 3, 9], dtype=torch.int32)
    new = torch.randn(B, T, 1, D, generator=gen)
    paths = torch.tensor([[0, 2, 3]] * B, dtype=torch.int32)
    num_accepted = torch.full((B,), 2, dtype=torch.int32)
    cache, lens_in, new_in, paths_in, num_in = for_backend(backend, latent.clone(), lens.clone(), new, paths,
                                                           num_accepted)
    with pytest.raises(ValueError, match=r"^v_cache: is a view of k_cache's rows \(MLA's V\); a single-cache "
                                         "layer passes v_cache=None"):
        specdec.kv_rollback(cache, cache[..., :32], lens_in, paths_in, num_in, backend=backend)
    with pytest.raises(ValueError, match="^v_cache: shares memory with k_cache"):
        specdec.kv_rollback(cache, cache, lens_in, paths_in, num_in, backend=backend)
    with pytest.raises(ValueError, match="^v_cache: is a view of k_cache's rows"):
        specdec.kv_append(cache, cache[..., :32], new_in, new_in, lens_in, backend=backend)
    with pytest.raises(TypeError, match="^v_new: given without v_cache"):
        specdec.kv_append(cache, None, new_in, new_in, lens_in, backend=backend)
    with pytest.raises(TypeError, match="^v_new: required with v_cache"):
        specdec.kv_append(cache, cache.clone(), new_in, None, lens_in, backend=backend)
    assert same_bits(cache.cpu(), latent) and torch.equal(lens_in.cpu(), lens)
    if backend == "cpp":  # the C++ ops themselves, no Python checks before them
        with pytest.raises(ValueError, match="^v_cache: is a view of k_cache's rows"):
            torch.ops.specdec.kv_rollback([cache], [cache[..., :32]], lens_in, paths_in, num_in, None)
        with pytest.raises(TypeError, match="^v_new: given without v_cache"):
            torch.ops.specdec.kv_append(cache, None, new_in, new_in, lens_in, None)
        assert same_bits(cache.cpu(), latent) and torch.equal(lens_in.cpu(), lens)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("empty", ["Hkv", "D", "layers"])
@pytest.mark.parametrize("single", [True, False], ids=["single-cache", "pair"])
def test_rollback_with_nothing_to_move_still_advances_cache_lens(backend, empty, single):
    """Caches with no element in a row (Hkv = 0, D = 0) or a stack of no layers: no kernel has a row to move, and
    cache_lens still advances by each path's length on every backend (it read garbage where none launched)."""
    B, T, cap = 3, 4, 8
    shape = {"Hkv": (1, B * cap // 4, 4, 0, 8), "D": (2, B * cap // 4, 4, 2, 0), "layers": (0, B * cap // 4, 4, 2, 8)}
    k = torch.randn(shape[empty])
    v = None if single else torch.randn(shape[empty])
    table = torch.randperm(B * cap // 4, dtype=torch.int32).view(B, cap // 4)
    lens = torch.tensor([0, 3, 4], dtype=torch.int32)
    paths = torch.tensor([[0, -1, -1, -1], [0, 2, 3, -1], [0, 1, 2, 3]], dtype=torch.int32)
    num_accepted = torch.tensor([0, 2, 3], dtype=torch.int32)
    k_in, lens_in, table_in, paths_in, num_in = for_backend(backend, k.clone(), lens.clone(), table, paths,
                                                            num_accepted)
    v_in = None if v is None else for_backend(backend, v.clone())[0]
    specdec.kv_rollback(k_in, v_in, lens_in, paths_in, num_in, block_table=table_in, backend=backend)
    assert torch.equal(lens_in.cpu(), lens + num_accepted + 1)
