"""KV-cache maintenance for tree verification: append the tree's K/V, roll back to the accepted path.

kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale, v_scale) -> None
    One layer. k_new, v_new (B, T, Hkv, D); writes row i of request b at logical position
    cache_lens[b] + i (quantized with the per-tensor scales for a float8 cache). K and V in one launch;
    grid (B, T tiles, head tiles). A single-cache layer (MLA's latent cache) has v_cache, v_new None (HAS_V off).
kv_rollback(k_caches, v_caches, cache_lens, accepted_nodes, num_accepted, block_table) -> None
    Every layer given: lists of 4-D (one layer) or 5-D (layers, ...) tensors. For each request b with
    L = cache_lens[b], moves row L + accepted_nodes[b, i] to L + i for i <= num_accepted[b], then
    cache_lens[b] += num_accepted[b] + 1 (on the device, no host sync). Grid (B, K/V layers, head tiles);
    each program walks its request's path in ascending order, so overlapping moves are safe, and skips
    rows already in place (path[i] == i): a fully accepted chain moves zero bytes.

Caches: contiguous (B, L_max, Hkv, D) or paged (num_blocks, block_size, Hkv, D) with block_table
(B, max_blocks) int32. One code path: a contiguous cache is a paged one with a single block of
L_max rows per request and the identity block table (block_table[b] = [b]), computed in the kernel
(IDENTITY_TABLE), never allocated.

Rollback, every layer in one launch: a device table holds each (K or V, layer) base as an element
offset from the lowest-addressed cache tensor, so a stacked tensor and a list of per-layer tensors are
launched alike. `layer_tables` builds it (one small asynchronous host-to-device copy); a caller that
rolls back the same caches every step builds it once and passes it to `rollback` (specdec.RollbackPlan
does), the schema launcher `kv_rollback` builds it per call. Tensors with different stride layouts
cannot share one set of strides: they are launched once per distinct layout (in practice every layer
shares one layout, so one launch). The table addresses other tensors through the anchor's pointer,
which is fine on the GPU and under TRITON_INTERPRET=1 with CPU tensors (the interpreter's case that
copies CUDA tensors to the host one by one would break it). Pure copies (no arithmetic): every dtype,
float8 included, is bit-exact.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096  # elements one program copies per step: enough bytes in flight, few registers
MAX_ROWS_PER_STEP = 8  # path nodes (or new rows) per step; accepted paths are short


@triton.jit
def _physical_rows(table_row, request, pos, block_size, s_blk, s_row, mask, IDENTITY_TABLE: tl.constexpr):
    """int64 element offsets of the rows holding logical positions `pos` (int64) of request `request`."""
    if IDENTITY_TABLE:  # contiguous cache: the request's one block (of L_max rows) is block `request`
        block = tl.zeros_like(pos) + request
    else:
        block = tl.load(table_row + pos // block_size, mask=mask, other=0).to(tl.int64)
    return block * s_blk + (pos % block_size) * s_row


@triton.jit
def _within_row(h, d, s_h, s_d):
    """(1, BLOCK_H, BLOCK_D) int64 offsets of heads h and dims d inside a row."""
    return h.to(tl.int64)[None, :, None] * s_h + d.to(tl.int64)[None, None, :] * s_d


@triton.jit
def _append_rows(cache, new, inv_scale, table_row, pos, b, t, h, d, rows, mask, block_size,
                 sc_blk, sc_row, sc_h, sc_d, sn_b, sn_t, sn_h, sn_d, FP8_LIMIT: tl.constexpr,
                 IDENTITY_TABLE: tl.constexpr):
    """cache at logical positions pos[j] <- new[b, t[j]], for the (t, h, d) tile under `mask`; a float8
    cache (FP8_LIMIT > 0, its largest finite value) gets fp32(x) * inv_scale, saturated, rounded to nearest
    even (NaN stays NaN: both comparisons are false)."""
    dst = _physical_rows(table_row, b, pos, block_size, sc_blk, sc_row, rows, IDENTITY_TABLE)
    src = b * sn_b + t.to(tl.int64) * sn_t
    vals = tl.load(new + (src[:, None, None] + _within_row(h, d, sn_h, sn_d)), mask=mask)
    if FP8_LIMIT > 0:
        y = vals.to(tl.float32) * inv_scale
        y = tl.where(y > FP8_LIMIT, FP8_LIMIT, tl.where(y < -FP8_LIMIT, -FP8_LIMIT, y))
        vals = y.to(cache.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(cache + (dst[:, None, None] + _within_row(h, d, sc_h, sc_d)), vals, mask=mask)


@triton.jit
def _kv_append_kernel(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_inv_scale, v_inv_scale,
                      T, H, D, block_size, s_table,
                      skc_blk, skc_row, skc_h, skc_d, svc_blk, svc_row, svc_h, svc_d,
                      skn_b, skn_t, skn_h, skn_d, svn_b, svn_t, svn_h, svn_d,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_LIMIT: tl.constexpr,
                      IDENTITY_TABLE: tl.constexpr, HAS_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rows = t < T
    mask = rows[:, None, None] & (h < H)[None, :, None] & (d < D)[None, None, :]
    pos = tl.load(cache_lens + b).to(tl.int64) + t
    table_row = block_table + b * s_table
    _append_rows(k_cache, k_new, k_inv_scale, table_row, pos, b, t, h, d, rows, mask, block_size,
                 skc_blk, skc_row, skc_h, skc_d, skn_b, skn_t, skn_h, skn_d, FP8_LIMIT, IDENTITY_TABLE)
    if HAS_V:
        _append_rows(v_cache, v_new, v_inv_scale, table_row, pos, b, t, h, d, rows, mask, block_size,
                     svc_blk, svc_row, svc_h, svc_d, svn_b, svn_t, svn_h, svn_d, FP8_LIMIT, IDENTITY_TABLE)


@triton.jit
def _kv_rollback_kernel(caches, entry_offsets, cache_lens, accepted_nodes, num_accepted, block_table,
                        P, H, D, block_size, s_path, s_table, s_blk, s_row, s_h, s_d,
                        ENTRY_ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, IDENTITY_TABLE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # this program's layer of K or V; offsets are stored divided by ENTRY_ALIGN so the compiler
    # knows the base stays aligned (vectorized loads)
    cache = caches + tl.load(entry_offsets + tl.program_id(1)) * ENTRY_ALIGN
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    in_row = (h < H)[None, :, None] & (d < D)[None, None, :]
    within = _within_row(h, d, s_h, s_d)
    L = tl.load(cache_lens + b).to(tl.int64)
    n = tl.minimum(tl.load(num_accepted + b) + 1, P)  # path length
    path_row = accepted_nodes + b * s_path
    table_row = block_table + b * s_table
    # Ascending blocks of the path. A source L + path[j] (path[j] >= j) is never an earlier block's
    # destination, so only the moves inside a block can overlap (e.g. path 0,2,3 moves 2->1, 3->2):
    # the barrier makes every source of the block read before any destination is written.
    for p0 in range(0, n, BLOCK_P):
        i = p0 + tl.arange(0, BLOCK_P)
        node = tl.load(path_row + i, mask=i < n, other=0)
        moves = (i < n) & (node != i)  # rows already in place are not touched
        src = _physical_rows(table_row, b, L + node, block_size, s_blk, s_row, moves, IDENTITY_TABLE)
        dst = _physical_rows(table_row, b, L + i, block_size, s_blk, s_row, moves, IDENTITY_TABLE)
        mask = moves[:, None, None] & in_row
        vals = tl.load(cache + (src[:, None, None] + within), mask=mask)
        tl.debug_barrier()
        tl.store(cache + (dst[:, None, None] + within), vals, mask=mask)


def _tile(rows: int, H: int, D: int, tile_elements: int = TILE_ELEMENTS) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_H, BLOCK_D): whole head dim, about `tile_elements` elements per step."""
    block_d = triton.next_power_of_2(max(D, 1))
    block_rows = min(triton.next_power_of_2(max(rows, 1)), MAX_ROWS_PER_STEP)
    block_h = max(1, min(triton.next_power_of_2(H), tile_elements // (block_rows * block_d)))
    return block_rows, block_h, block_d


def _paging(block_table, cache_lens):
    """(table, its row stride, IDENTITY_TABLE) for the kernels. The kernels never read the table of a
    contiguous cache: any int32 tensor stands in (cache_lens), with stride 0."""
    if block_table is None:
        return cache_lens, 0, True
    table = block_table.contiguous()
    return table, table.stride(0), False


def kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale=1.0, v_scale=1.0) -> None:
    B, T, H, D = k_new.shape
    lens = cache_lens.contiguous()
    table, s_table, identity_table = _paging(block_table, lens)
    BLOCK_T, BLOCK_H, BLOCK_D = _tile(T, H, D)
    grid = (B, triton.cdiv(T, BLOCK_T), triton.cdiv(H, BLOCK_H))
    fp8 = k_cache.element_size() == 1  # the one-byte cache dtypes the op accepts are the float8 ones
    has_v = v_cache is not None
    if not has_v:  # a single cache: K's tensors stand in for V's, never read or written
        v_cache, v_new = k_cache, k_new
    # the kernel multiplies by fp32(1 / scale), computed here in double as the reference does
    _kv_append_kernel[grid](k_cache, v_cache, k_new, v_new, lens, table, 1.0 / k_scale,
                            1.0 / v_scale, T, H, D, k_cache.shape[-3], s_table,
                            *k_cache.stride(), *v_cache.stride(), *k_new.stride(), *v_new.stride(),
                            BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                            FP8_LIMIT=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
                            IDENTITY_TABLE=identity_table, HAS_V=has_v)


class LayerTable(NamedTuple):
    """Every (K or V, layer) of the cache tensors sharing one stride layout, for one rollback launch: the
    base of entry e is `anchor` + offsets[e] * align elements. anchor is the lowest-addressed tensor, so
    offsets are >= 0; align is the largest power of two <= 16 dividing every offset (offsets are stored
    divided by it so the kernel knows each base stays aligned: vectorized loads)."""
    anchor: torch.Tensor  # a 5-D view of the lowest-addressed tensor of the group
    offsets: torch.Tensor  # (entries,) int64 on the caches' device
    align: int
    strides: tuple  # (s_blk, s_row, s_h, s_d) shared by the group
    head_shape: tuple  # (Hkv, D)


# Host sources of tables built while a CUDA graph was being captured: the captured copy re-reads its
# source at every replay, and the graph may outlive the caller's table, so they live as long as the
# process (a few bytes per capture). Tables built outside a capture (a RollbackPlan made before capturing
# its run) never land here.
_captured_sources: list = []


def layer_tables(k_caches, v_caches) -> list[LayerTable]:
    """The rollback tables of lists of 4-D (one layer) or 5-D ((layers, ...)) cache tensors, one per distinct
    stride layout (in practice one). One asynchronous host-to-device copy each (pinned on CUDA)."""
    stacks = [c if c.dim() == 5 else c.unsqueeze(0) for c in list(k_caches) + list(v_caches)]
    layouts: dict = {}
    for c in stacks:
        layouts.setdefault(c.stride()[1:], []).append(c)
    tables = []
    size = stacks[0].element_size()
    for strides, group in layouts.items():
        anchor = min(group, key=lambda c: c.data_ptr())
        base = anchor.data_ptr()
        assert all((c.data_ptr() - base) % size == 0 for c in group), "cache tensors must be element-aligned"
        offsets = [(c.data_ptr() - base) // size + layer * c.stride(0) for c in group for layer in range(c.shape[0])]
        common = math.gcd(*offsets)
        align = min(common & -common, 16) if common else 16
        host = torch.tensor([o // align for o in offsets], dtype=torch.int64, pin_memory=anchor.is_cuda)
        if anchor.is_cuda and torch.cuda.is_current_stream_capturing():
            _captured_sources.append(host)
        tables.append(LayerTable(anchor, host.to(anchor.device, non_blocking=True), align, strides,
                                 tuple(anchor.shape[-2:])))
    return tables


def rollback(tables: list[LayerTable], cache_lens, accepted_nodes, num_accepted, block_table, *,
             tile_elements: int = TILE_ELEMENTS, num_warps: int = 4) -> None:
    """kv_rollback of the caches `tables` (from `layer_tables`) describe: one launch per table, then
    cache_lens advanced on the device by the path lengths. Allocates only those (B,): CUDA-graph capturable."""
    B, P = accepted_nodes.shape
    H, D = tables[0].head_shape
    lens, path, num_acc = cache_lens.contiguous(), accepted_nodes.contiguous(), num_accepted.contiguous()
    table, s_table, identity_table = _paging(block_table, lens)
    block_size = tables[0].anchor.shape[-3]
    BLOCK_P, BLOCK_H, BLOCK_D = _tile(P, H, D, tile_elements)
    for entry in tables:
        if H * D * entry.offsets.shape[0] == 0:  # no row has an element to move (Hkv = 0, D = 0, no layers)
            continue
        s_blk, s_row, s_h, s_d = entry.strides
        grid = (B, entry.offsets.shape[0], triton.cdiv(H, BLOCK_H))
        _kv_rollback_kernel[grid](entry.anchor, entry.offsets, lens, path, num_acc, table,
                                  P, H, D, block_size, path.stride(0), s_table, s_blk, s_row, s_h, s_d,
                                  ENTRY_ALIGN=entry.align, BLOCK_P=BLOCK_P, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                                  IDENTITY_TABLE=identity_table, num_warps=num_warps)
    # after every move is issued (the kernels read cache_lens), whether or not any was: no host sync
    cache_lens.add_(num_acc.clamp(max=P - 1).add_(1).to(cache_lens.dtype))


def kv_rollback(k_caches, v_caches, cache_lens, accepted_nodes, num_accepted, block_table, *,
                tile_elements: int = TILE_ELEMENTS, num_warps: int = 4) -> None:
    """Normalized arguments of the `specdec::kv_rollback` schema (the layer tables built for this call);
    the keyword-only tunables (elements one program moves per step, warps per program) are for the GPU
    tuning sweep (bench/sweep.py)."""
    rollback(layer_tables(k_caches, v_caches), cache_lens, accepted_nodes, num_accepted, block_table,
             tile_elements=tile_elements, num_warps=num_warps)
