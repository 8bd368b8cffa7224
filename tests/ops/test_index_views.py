"""Index and metadata tensors as strided views, on every backend against the reference on contiguous copies.

Each index argument of tree_attention (cache_lens, num_nodes, cu_num_nodes, block_table, tree_mask), kv_append
(cache_lens, block_table), kv_rollback and RollbackPlan.run (cache_lens, accepted_nodes, num_accepted,
block_table) is passed as a view with a storage offset and a gap after every element (2-D: after every entry of
each row), or column-major, in int32 and in int64 where the op takes it. The gaps hold values that show if read
as the view's elements, and stay in bounds (a kernel that ignores a stride gives a wrong result, not a crash):
a shorter length, a count of 1, a spare block full of NaN, every mask bit, a path that moves other rows.
kv_rollback writes the new lengths through the caller's view and leaves its gaps alone.
"""
from __future__ import annotations

import pytest
import torch

import specdec
from specdec import reference
from tests.helpers import BACKENDS, DEVICE, on_backend, poison_, to_device
from tests.ops.test_kv_cache import make_caches, random_lens, random_paths, same_bits
from tests.ops.test_packed_attention import _packed
from tests.ops.test_tree_attention import check_against_reference, make_case

ALL_BACKENDS = ["torch"] + BACKENDS


def as_view(values: torch.Tensor, gap: int, layout: str, device) -> torch.Tensor:
    """`values` (1-D or 2-D) as a view on `device`: "gaps": storage offset 1 and `gap` after every element (2-D: a
    gap row first, and a gap after every entry of a row); "column-major": 2-D with strides (1, rows)."""
    if layout == "column-major":  # (dense: a copy to another device keeps the strides)
        return values.T.contiguous().T.to(device)
    if values.dim() == 1:
        storage = torch.full((2 * values.numel() + 1,), gap, dtype=values.dtype)
        storage[1::2] = values
        return storage.to(device)[1::2]
    rows, cols = values.shape
    storage = torch.full((rows + 1, 2 * cols), gap, dtype=values.dtype)
    storage[1:, ::2] = values
    return storage.to(device)[1:, ::2]


def device_of(backend: str) -> torch.device:
    """Where `backend` takes its inputs: the reference the CPU, the others DEVICE."""
    return torch.device("cpu") if backend == "torch" else DEVICE


def view_id(name, dtype, layout, *_) -> str:
    return f"{name}-{str(dtype).removeprefix('torch.')}-{layout}"


def spare_block(table: torch.Tensor, num_blocks: int) -> int:
    """A block id no request owns (tests.helpers.to_paged fills those blocks with NaN)."""
    return sorted(set(range(num_blocks)) - set(table.flatten().tolist()))[0]


# ----------------------------------------------------------------------------------------------
# tree_attention
# ----------------------------------------------------------------------------------------------
# (argument, its dtype, view layout)
ATTENTION_VIEWS = [("cache_lens", torch.int32, "gaps"), ("num_nodes", torch.int32, "gaps"),
                   ("num_nodes", torch.int64, "gaps"), ("block_table", torch.int32, "gaps"),
                   ("block_table", torch.int32, "column-major"), ("tree_mask", torch.int32, "gaps")]


def attention_gap(case, name):
    """A gap value that changes the result if read: a shorter prefix, one node, a NaN block, every mask bit."""
    if name == "block_table":
        return spare_block(case["block_table"], case["k_cache"].shape[0])
    return {"cache_lens": 3, "num_nodes": 1, "tree_mask": -1}[name]


@pytest.mark.parametrize("window_left", [-1, 12], ids=["no-window", "window"])
@pytest.mark.parametrize("name,dtype,layout", ATTENTION_VIEWS, ids=[view_id(*v) for v in ATTENTION_VIEWS])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_tree_attention_index_views(backend, name, dtype, layout, window_left):
    gen = torch.Generator().manual_seed(ATTENTION_VIEWS.index((name, dtype, layout)))
    case = make_case(gen, B=3, T=5, Hkv=1, group=2, D=16, lens=(0, 37, 20), paged=True)
    args = on_backend(backend, case)
    values = case[name].to(dtype)
    if name == "tree_mask":  # (B, T, W): a gap after every word, as a slice of a wider mask
        storage = torch.full((*values.shape[:2], 2 * values.shape[2] + 1), -1, dtype=dtype)
        storage[..., 1::2] = values
        view = storage.to(device_of(backend))[..., 1::2]
    else:
        view = as_view(values, attention_gap(case, name), layout, device_of(backend))
    assert not view.is_contiguous()
    args[name] = view
    actual = specdec.tree_attention(**args, window_left=window_left, return_lse=True, backend=backend)
    check_against_reference(actual, case, window_left=window_left)


@pytest.mark.parametrize("backend,dtype", [
    pytest.param(backend, dtype, id=f"{backend}-{str(dtype).removeprefix('torch.')}")
    for backend in ALL_BACKENDS for dtype in (torch.int32, torch.int64)])
def test_packed_tree_attention_offsets_view(backend, dtype):
    """cu_num_nodes as a view (int64: row_offsets, its first B entries, reach the kernels as a view too); gaps 0."""
    gen = torch.Generator().manual_seed(5)
    case = make_case(gen, B=3, T=5, Hkv=1, group=2, D=16, lens=(40, 3, 17))
    packed, _ = _packed(case)
    expected = specdec.tree_attention(**packed, return_lse=True, backend="torch")
    args = on_backend(backend, packed)
    args["cu_num_nodes"] = as_view(packed["cu_num_nodes"].to(dtype), 0, "gaps", device_of(backend))
    out, lse = specdec.tree_attention(**args, return_lse=True, backend=backend)
    torch.testing.assert_close(out.cpu(), expected[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu(), expected[1], atol=2e-5, rtol=2e-5)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton launcher")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_packed_split_merge_reads_views(num_splits):
    """The launcher's row_offsets and num_nodes as views (the merge kernel of split-KV reads both), into poisoned
    outputs: every packed row right."""
    from specdec.kernels.tree_attention import tree_attention as triton_attention

    gen = torch.Generator().manual_seed(6)
    case = make_case(gen, B=3, T=5, Hkv=1, group=2, D=16, lens=(40, 3, 17))
    packed, _ = _packed(case)
    expected = specdec.tree_attention(**packed, return_lse=True, backend="torch")
    N, Hq, D = packed["q"].shape
    out, lse = poison_(torch.empty(N, Hq, D, device=DEVICE)), poison_(torch.empty(N, Hq, device=DEVICE))
    row_offsets = as_view(packed["cu_num_nodes"][:-1].long(), 0, "gaps", DEVICE)
    num_nodes = as_view(case["num_nodes"], 1, "gaps", DEVICE)
    triton_attention(*(to_device(packed[n]) for n in ("q", "k_cache", "v_cache", "cache_lens", "tree_mask")), None,
                     num_nodes, D ** -0.5, row_offsets=row_offsets, max_nodes=5, num_splits=num_splits, out=out,
                     lse=lse)
    torch.testing.assert_close(out.cpu(), expected[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.cpu(), expected[1], atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------------------------
# kv_append, kv_rollback, RollbackPlan.run
# ----------------------------------------------------------------------------------------------
B, T, H, D, CAP, LAYERS = 6, 6, 2, 4, 24, 2


@pytest.mark.parametrize("name,layout", [("cache_lens", "gaps"), ("block_table", "gaps"),
                                         ("block_table", "column-major")])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_kv_append_index_views(backend, name, layout):
    gen = torch.Generator().manual_seed(7)
    k, v, table = make_caches(1, B, CAP, H, D, torch.float32, "paged", gen)
    k, v = k[0], v[0]
    lens = random_lens(B, T, CAP, gen)
    k_new, v_new = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    expected_k, expected_v = k.clone(), v.clone()
    reference.kv_append(expected_k, expected_v, k_new, v_new, lens, table)
    device = device_of(backend)
    args = dict(cache_lens=lens, block_table=table)
    gap = 1 if name == "cache_lens" else spare_block(table, k.shape[0])
    args = {n: as_view(x, gap, layout, device) if n == name else x.to(device) for n, x in args.items()}
    k_out, v_out = k.to(device), v.to(device)
    specdec.kv_append(k_out, v_out, k_new.to(device), v_new.to(device), **args, backend=backend)
    assert same_bits(k_out.cpu(), expected_k) and same_bits(v_out.cpu(), expected_v)


# (argument, its dtype, view layout, gap)
ROLLBACK_VIEWS = [("cache_lens", torch.int32, "gaps", 1), ("accepted_nodes", torch.int32, "gaps", 0),
                  ("accepted_nodes", torch.int64, "gaps", 0), ("accepted_nodes", torch.int32, "column-major", 0),
                  ("num_accepted", torch.int32, "gaps", 0), ("num_accepted", torch.int64, "gaps", 0),
                  ("block_table", torch.int32, "gaps", None), ("block_table", torch.int32, "column-major", None)]


@pytest.mark.parametrize("plan", [False, True], ids=["kv_rollback", "RollbackPlan"])
@pytest.mark.parametrize("name,dtype,layout,gap", ROLLBACK_VIEWS, ids=[view_id(*v) for v in ROLLBACK_VIEWS])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_kv_rollback_index_views(backend, name, dtype, layout, gap, plan):
    """The rolled-back caches equal the reference's; cache_lens, a view, holds the new lengths, its gaps untouched."""
    gen = torch.Generator().manual_seed(8)
    k, v, table = make_caches(LAYERS, B, CAP, H, D, torch.float32, "paged", gen)
    lens = random_lens(B, T, CAP, gen)
    paths, num_accepted = random_paths(B, T, gen)
    expected_k, expected_v, expected_lens = k.clone(), v.clone(), lens.clone()
    reference.kv_rollback([expected_k], [expected_v], expected_lens, paths, num_accepted, table)
    device = device_of(backend)
    gap = spare_block(table, k.shape[1]) if gap is None else gap
    args = dict(cache_lens=lens, accepted_nodes=paths, num_accepted=num_accepted, block_table=table)
    args = {n: as_view(x.to(dtype), gap, layout, device) if n == name else x.to(device) for n, x in args.items()}
    k_out, v_out = k.to(device), v.to(device)
    if plan:
        specdec.RollbackPlan(k_out, v_out, args.pop("block_table"), backend=backend).run(**args)
    else:
        specdec.kv_rollback(k_out, v_out, **args, backend=backend)
    assert same_bits(k_out.cpu(), expected_k) and same_bits(v_out.cpu(), expected_v)
    assert torch.equal(args["cache_lens"].cpu(), expected_lens)
    if name == "cache_lens":  # written through the view: the gaps around its elements keep their value
        storage = args["cache_lens"]._base.cpu()
        assert (storage[0::2] == gap).all()
