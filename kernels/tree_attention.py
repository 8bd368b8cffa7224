"""Tree-attention verification kernel: T draft-tree queries over a (paged) KV cache, GQA, split-KV.

    tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, block_table, num_nodes, scale,
                   k_scale, v_scale, window_left, logits_soft_cap)
        -> out (B, T, Hq, Dv) in q.dtype, lse (B, T, Hq) float32 (natural log)

q (B, T, Hq, D); k_cache (B, L_max, Hkv, D) contiguous when block_table is None, else
(num_blocks, block_size, Hkv, D) with block_table (B, max_blocks) int32, v_cache the same with head dim Dv <= D
(MLA: k_cache[..., :Dv]), in q's dtype or float8 (e4m3fn, e5m2) holding K / k_scale and V / v_scale;
cache_lens (B,) int32;
tree_mask (B, T, ceil(T/32)) int32 packed ancestor-or-self bits; num_nodes (B,) int32. Node i attends
to the committed prefix [0, cache_lens[b]) unmasked (or its last positions: window_left) and to tree position
cache_lens[b] + j iff bit j of tree_mask[b, i] is set. sinks: None or (Hq,) float32 logits in the softmax's
denominator. Padding nodes (i >= num_nodes[b]) get out = 0, lse = -inf.

Design (decode verification is memory-bound: the prefix K/V are nearly all the bytes):
  * One code path for both layouts: a contiguous cache is a paged cache with block_size = L_max and
    block_table[b] = [b]. That identity table is computed in the kernel (IDENTITY_TABLE), not loaded,
    so the contiguous case costs no extra launch or allocation; the cache itself is never copied.
  * One program owns one KV head of one request and a tile of BLOCK_M query rows, where a row is a
    (tree node, query head of that KV head's group) pair, so every K/V tile is loaded once for all T
    nodes and all Hq/Hkv heads sharing it (once per row tile when T * group > BLOCK_M).
  * Split-KV (flash-decoding): the prefix is cut into `num_splits` ranges (the count is a function of
    shapes only, so there is no host sync and the op is CUDA-graph capturable; each range's bounds are
    computed on the device from cache_lens). Partial results are merged by LSE weight in a second
    kernel. The tree part is handled by the last split.
  * Bytes: K and V of the cache_lens[b] + num_nodes[b] positions, once per row tile (one tile while
    T * group <= 128, or 64 at D = 256; half as many rows with fp32 operands), q read, out and lse written;
    with S > 1 splits also the partials, B*S*T*Hq*(D*e + 4) bytes written and read back by the merge. They are
    stored in q's dtype (e its size; the LSEs stay fp32), as vLLM's split-KV decode does: at B=1, L=8K fp32
    partials would add half as many bytes again as the prefix itself, for a rounding the final cast to q's
    dtype repeats. Sinks add Hq * 4 bytes.
  * Online softmax in fp32 (exp2 with log2(e) folded into the scale); dots accumulate in fp32 from
    fp16/bf16 operands on GPU (fp32 operands in IEEE precision, not TF32). The CPU interpreter upcasts
    every tile to fp32 right after the load (its bf16 arithmetic is wrong).
  * Positions reach 2**31 - 1 (cache_lens + T <= 2**31 - 1, a window near the end of a huge paged table): a
    split's first position and the tree's are int64, the keys int32 offsets from them, so the loop over tiles
    does no int64 division; element offsets into the caches are int64 (a cache may exceed 2**31 elements).
  * The index tensors (cache_lens, num_nodes, row_offsets, block_table, tree_mask) are read through their
    strides: views need no copy.
  * Sliding windows (window_left >= 0): a row's window ends at its node's position cache_lens + depth, depth
    = its mask bits below T - 1 (popcount in-kernel: no extra input); the splits partition the window only,
    from position cache_lens - window_left, so older keys are never read (their blocks may be freed) and the
    split heuristic sizes splits from the window, not the cache. Soft-capping (logits_soft_cap > 0)
    maps the scores through cap * tanh(score / cap) before the softmax. Both are constexpr branches: the
    plain kernel compiles without them.
  * Attention sinks (gpt-oss; sinks (Hq,) float32, SINKS constexpr): query head h's softmax denominator gains
    exp(sinks[h]), a logit with no value. It joins a row's statistics once, after its last key: at the end of
    the main kernel with one split, in the merge with several (a split's partial is the plain attention of its
    keys; the merge weighs them and the sink by their LSEs), so the lse includes it. Folded at the larger of the
    row's max and the sink (no overflow for a sink far above the scores); a sink of -inf changes no bit.
  * Head dims: q . K runs over two channel tiles, V's first Dv channels (V_PAD, a power of two >= 16, masked past
    Dv) and the other D - Dv (REST_PAD, masked; none when Dv = D), so any D and Dv <= D run, 576 = 512 + 64
    included. MLA's absorbed form (v_cache = k_cache[..., :Dv], V_FROM_K): each latent tile is loaded once, as V,
    and K's first channels are its transpose: one read of Dqk channels a position for all T * Hq rows of a row
    tile (Hkv = 1: every query head is in the group). Head dims past 256 take 64-row tiles of 16 keys, 8 warps
    (choose_config): the (64, 512) fp32 accumulator fills half the registers (sm_90 report:
    bench/results/triton-sm90-offline.md).
  * float8 caches (vLLM's fp8 KV cache, per-tensor scales): tiles are widened to q's dtype after the load
    (exact: every e4m3/e5m2 value is a bf16 and an fp16 value), k_scale is folded into the score scale and
    v_scale into the final normalization, so the prefix costs half the bytes of a 16-bit cache.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.0 / math.log(2.0)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LN2 = tl.constexpr(math.log(2.0))  # the kernel works in log2; the op returns a natural-log LSE
_LOG2E = tl.constexpr(LOG2E)

# Split-KV heuristic (shapes only). Aim for PROGRAMS_PER_SM resident programs per SM, give each split
# at least MIN_TOKENS_PER_SPLIT positions of the cache's capacity, and never more than MAX_SPLITS.
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# Stand-in for the SM count off GPU (the interpreter runs programs one after another: no gain in splitting).
CPU_SM_COUNT = 1


class TileConfig(NamedTuple):
    """Launch parameters of the attention kernel: query rows and KV positions per tile, warps, stages."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class HeadDims(NamedTuple):
    """The kernel's channel tiles: q . K over V's first Dv channels (v_pad wide, masked past Dv) plus the other
    D - Dv channels (rest_pad wide, masked; 0: none, D = Dv). MLA's absorbed form: 512 + 64 at DeepSeek-V3's 576."""
    v_pad: int
    rest_pad: int


MAX_V_PAD = 512  # V's (and out's) channels in one tile: MLA's kv_lora_rank
MAX_REST_PAD = 256


def head_dims(head_dim: int, v_dim: int) -> HeadDims:
    """Tiles for q / K head dim D and V head dim Dv <= D (tl.dot needs >= 16 channels, powers of two)."""
    rest = head_dim - v_dim
    return HeadDims(max(16, triton.next_power_of_2(v_dim)), max(16, triton.next_power_of_2(rest)) if rest else 0)


def choose_config(num_rows: int, head_dim: int, elem_bytes: int) -> TileConfig:
    """Tile sizes for T * group query rows of head dim D and element size (a pure function of shapes).

    BLOCK_M covers all rows when it can (K/V are then read once): up to 128 rows (64 at D = 256, to keep
    the fp32 accumulator in registers); tl.dot needs >= 16. BLOCK_N keeps one K tile at <= 16 KiB, so a
    pipeline stage (K + V) is <= 32 KiB; three stages beside a Q tile of <= 32 KiB (every fp16/bf16
    case), two beside a larger (fp32) one, stay well inside the shared memory of an SM.
    fp32 operands (IEEE dots: FMA, no tensor cores) hold far more in registers: at the 16-bit tiles they spilled
    8-10 KB a thread at D = 64..128 (sm_90, Triton 3.9); 16 KV positions a tile, 8 warps and at most 64 rows
    (32 at D = 256) spill none at D = 64, 200 bytes at 128 and 1.5 KB at 256 (tests/ops/test_tree_attention.py).
    Head dims past 256 (MLA's absorbed form, D = 576, Dv = 512: one KV head, T * Hq rows): 64 rows (32
    with fp32 operands) keep the (rows, Dv) fp32 accumulator in registers, 16 keys a tile keep a K tile (16 x 576)
    at 18 KiB in 16-bit (tests/ops/test_mla_attention.py reports the sm_90 compile).
    """
    fp32 = elem_bytes == 4
    if head_dim > 256:
        block_m = min(32 if fp32 else 64, max(16, triton.next_power_of_2(num_rows)))
        return TileConfig(block_m, 16, 8, 2)
    most_rows = (128 if head_dim <= 128 else 64) // (2 if fp32 else 1)
    block_m = min(most_rows, max(16, triton.next_power_of_2(num_rows)))
    keys_in_16k = 16384 // (head_dim * elem_bytes)
    block_n = 16 if fp32 else max(16, min(64, 1 << (keys_in_16k.bit_length() - 1)))  # (a power of two)
    # 4 warps would spill registers at 128 rows, at D = 256 and with fp32 operands (ptxas, sm_90)
    num_warps = 8 if block_m >= 128 or head_dim >= 256 or fp32 else 4
    num_stages = 3 if block_m * head_dim * elem_bytes <= 32768 else 2
    return TileConfig(block_m, block_n, num_warps, num_stages)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def choose_num_splits(batch: int, kv_heads: int, row_tiles: int, capacity: int, sm_count: int) -> int:
    """Number of prefix splits: enough programs to fill the GPU, from shapes only (never cache_lens)."""
    programs = max(1, batch * kv_heads * row_tiles)  # (an empty batch launches nothing)
    wanted = PROGRAMS_PER_SM * sm_count // programs  # the most splits that still fit in one wave
    return max(1, min(wanted, triton.cdiv(capacity, MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def default_config(q: torch.Tensor, k_cache: torch.Tensor) -> TileConfig:
    """The tile heuristic's choice for these tensors' shapes."""
    _, T, Hq, D = q.shape
    return choose_config(T * (Hq // k_cache.shape[2]), D, q.element_size())


def default_num_splits(q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor],
                       config: TileConfig, window_left: int = -1) -> int:
    """The split-KV heuristic's choice for these shapes and tiles (the capacity of the cache, or of a window,
    never its lengths: no host sync)."""
    B, T, Hq, _ = q.shape
    Hkv = k_cache.shape[2]
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if window_left >= 0:
        capacity = min(capacity, window_left + T)
    return choose_num_splits(B, Hkv, triton.cdiv(T * (Hq // Hkv), config.block_m), capacity, _sm_count(q.device))


@triton.jit
def _tile_origin(table_row_ptr, stride_table, position, block_size, IDENTITY_TABLE: tl.constexpr):
    """Where a run of KV tiles starts, logical position `position` (int64: positions reach 2**31 - 1), as the
    table entry of its block and its row there (contiguous: the position itself); the tiles address their keys at
    int32 offsets from it (_load_kv_tile), so the int64 arithmetic is done once, outside the loop over the tiles."""
    if IDENTITY_TABLE:  # contiguous cache: request b's one block (of L_max rows) is block b, its rows the positions
        return table_row_ptr, position
    else:
        return table_row_ptr + (position // block_size) * stride_table, position % block_size


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, origin_table_ptr, stride_table, request, origin_row, offset, key_ok, block_size,
                  stride_kn, stride_kp, stride_kd, stride_vn, stride_vp, stride_vd,
                  V_DIM: tl.constexpr, V_PAD: tl.constexpr, REST_DIM: tl.constexpr, REST_PAD: tl.constexpr,
                  V_FROM_K: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, IDENTITY_TABLE: tl.constexpr):
    """K^T's first V_DIM channels (V_PAD, BLOCK_N), V (BLOCK_N, V_PAD) and K^T's other REST_DIM channels
    (REST_PAD, BLOCK_N; with REST_PAD > 0) of request `request`'s keys `offset` (int32, >= 0) positions after the
    origin (_tile_origin's table entry and row; k_ptr/v_ptr already at the KV head). V_FROM_K (MLA: V is the
    first V_DIM channels of K's rows): those channels are loaded once, as V, and K^T's part is their transpose.
    Masked-off keys and padding channels read as 0 (never garbage: a NaN in V would survive a zero softmax
    weight)."""
    if IDENTITY_TABLE:
        page = request
        first_row = origin_row
        row = offset
    else:
        # a key's place from the origin block's start, < block_size + offset < 2**32 (the launcher takes
        # block_size < 2**31): uint32 division, as cheap as int32's; the blocks after the origin's, < 2**31
        size = tl.cast(block_size, tl.uint32)
        in_page = origin_row.to(tl.uint32) + offset.to(tl.uint32)
        page = tl.load(origin_table_ptr + (in_page // size).to(tl.int32) * stride_table, mask=key_ok,
                       other=0).to(tl.int64)
        first_row = 0
        row = (in_page % size).to(tl.int32)
    # int64 element offsets: a cache may hold more than 2**31 elements
    k_rows = page * stride_kn + first_row * stride_kp + row.to(tl.int64) * stride_kp
    d = tl.arange(0, V_PAD)
    k_mask = key_ok[None, :]
    v_mask = key_ok[:, None]
    if V_DIM < V_PAD:  # (constexpr: a power-of-two head dim needs no channel mask)
        k_mask = k_mask & (d < V_DIM)[:, None]
        v_mask = v_mask & (d < V_DIM)[None, :]
    if V_FROM_K:
        v = tl.load(k_ptr + k_rows[:, None] + d[None, :] * stride_kd, mask=v_mask, other=0.0).to(COMPUTE_DTYPE)
        k_t = tl.trans(v)
    else:
        v_rows = page * stride_vn + first_row * stride_vp + row.to(tl.int64) * stride_vp
        k_t = tl.load(k_ptr + k_rows[None, :] + d[:, None] * stride_kd, mask=k_mask, other=0.0).to(COMPUTE_DTYPE)
        v = tl.load(v_ptr + v_rows[:, None] + d[None, :] * stride_vd, mask=v_mask, other=0.0).to(COMPUTE_DTYPE)
    if REST_PAD > 0:
        r = tl.arange(0, REST_PAD)
        k_rest_t = tl.load(k_ptr + k_rows[None, :] + (V_DIM + r)[:, None] * stride_kd,
                           mask=key_ok[None, :] & (r < REST_DIM)[:, None], other=0.0).to(COMPUTE_DTYPE)
    else:
        k_rest_t = k_t  # (unused)
    # the dots' operand dtype: q's (float8 caches are widened to it, exactly), fp32 in the interpreter
    return k_t, v, k_rest_t


@triton.jit
def _popcount(x):
    """Set bits of each int32 (SWAR on the unsigned bits: Triton has no portable popcount)."""
    x = x.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _online_softmax_step(q, k_t, q_rest, k_rest_t, v, allowed, m_i, l_i, acc, qk_scale, cap,
                         DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr, REST_PAD: tl.constexpr):
    """Fold one KV tile into the running (max, sum, accumulator), all in the log2 domain. The scores are
    q . k_t, plus q_rest . k_rest_t with REST_PAD > 0 (the channels past V's: MLA's rope part).
    A row with no allowed key so far keeps m = -inf; m_safe = 0 then makes its weights exp2(-inf) = 0.
    SOFT_CAP: scores become cap * tanh(score / cap) (cap in the log2 domain too; tanh through exp2, exact
    enough in fp32, and saturating to +-1 without overflow trouble)."""
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    if REST_PAD > 0:
        s = tl.dot(q_rest, k_rest_t, s, input_precision=DOT_PRECISION)
    s = s * qk_scale
    if SOFT_CAP:
        s = cap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * _LOG2E / cap)) + 1.0))  # tanh(y) = 1 - 2 / (e^2y + 1)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _fold_sink(m_i, l_i, acc, sink):
    """The running (max, sum, accumulator) with one more score, `sink` (log2 domain), that has no value: exp2(sink)
    joins the sum, everything at the larger of the max and the sink. A sink no larger than the max rescales
    nothing (a sink of -inf changes no bit); a row that saw no key (max -inf) then holds the sink alone."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_safe))
    return m_new, l_i * rescale + tl.exp2(sink - m_safe), acc * rescale[:, None]


@triton.jit
def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, cache_lens_ptr, tree_mask_ptr, block_table_ptr, num_nodes_ptr, row_offsets_ptr,
    out_ptr, lse_ptr,  # final outputs (NUM_SPLITS == 1) or per-split partials (out: partial dtype; lse: fp32)
    sinks_ptr,  # (Hq,) float32, read with SINKS only
    qk_scale, v_scale, cap, window_left, T, block_size,
    stride_cache_lens, stride_num_nodes, stride_row_offsets, stride_sinks,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kp, stride_kh, stride_kd,
    stride_vn, stride_vp, stride_vh, stride_vd,
    stride_mb, stride_mt, stride_mw,
    stride_tb, stride_tc,
    stride_ob, stride_os, stride_ot, stride_oh, stride_od,
    stride_lb, stride_ls, stride_lt, stride_lh,
    GROUP: tl.constexpr, V_DIM: tl.constexpr, V_PAD: tl.constexpr, REST_DIM: tl.constexpr, REST_PAD: tl.constexpr,
    V_FROM_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, IDENTITY_TABLE: tl.constexpr,
    WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, PACKED: tl.constexpr, SINKS: tl.constexpr,
):
    row_tile = tl.program_id(0)
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    b = tl.program_id(2).to(tl.int64)
    prefix_len = tl.load(cache_lens_ptr + b * stride_cache_lens).to(tl.int64)
    # (unchecked input: never past the T rows of a request)
    real_nodes = tl.minimum(tl.load(num_nodes_ptr + b * stride_num_nodes), T)

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    node = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    if PACKED:  # node i of request b is row row_offsets[b] + i of q, tree_mask (and the final out, lse)
        row0 = tl.load(row_offsets_ptr + b * stride_row_offsets).to(tl.int64)
        q_base = row0 * stride_qt
        mask_base = row0 * stride_mt
        row_ok = node < real_nodes  # (the rows after a request's nodes are the next request's)
    else:
        row0 = b * 0
        q_base = b * stride_qb
        mask_base = b * stride_mb
        row_ok = node < T
    # q's first V_DIM channels (the ones V's dims pair with: all of them unless V is narrower) and the rest
    d = tl.arange(0, V_PAD)
    q_rows = q_ptr + q_base + node[:, None] * stride_qt + head[:, None] * stride_qh
    d_ok = row_ok[:, None]
    if V_DIM < V_PAD:
        d_ok = d_ok & (d < V_DIM)[None, :]
    q = tl.load(q_rows + d[None, :] * stride_qd, mask=d_ok, other=0.0).to(COMPUTE_DTYPE)
    if REST_PAD > 0:
        r = tl.arange(0, REST_PAD)
        q_rest = tl.load(q_rows + (V_DIM + r)[None, :] * stride_qd, mask=row_ok[:, None] & (r < REST_DIM)[None, :],
                         other=0.0).to(COMPUTE_DTYPE)
    else:
        q_rest = q  # (unused)

    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh  # (a head-major cache's head stride is its layer's size)
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    table_row_ptr = block_table_ptr + b * stride_tb
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)

    # Prefix: this split's share of [first, prefix_len), whole tiles per split. Without a window every key is
    # visible (first = 0). With one, row (i, h) sees positions >= prefix_len + depth_i - window_left, depth_i
    # = its mask bits below T - 1; first is where depth 0 starts seeing: nothing older is read (an engine may
    # have freed those blocks).
    first = 0
    if WINDOW:
        depth = tl.full([BLOCK_M], -1, tl.int32)
        for w in range(0, (T + 31) // 32):
            word = tl.load(tree_mask_ptr + mask_base + node * stride_mt + w * stride_mw, mask=row_ok, other=0)
            bits = T - 32 * w  # word w holds nodes 32w..32w+31: count those below T only
            depth += _popcount(word & tl.where(bits >= 32, -1, (1 << tl.minimum(bits, 31)) - 1))
        row_first = prefix_len + depth - window_left
        first = tl.maximum(prefix_len - window_left, 0)
    per_split = (prefix_len - first + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = first + split * chunk
    # The split's keys are lo + offset, offset in [0, count), count <= prefix_len < 2**31: int32 offsets from an
    # int64 origin (positions reach 2**31 - 1, and a tile's lanes run past its last key). The loop counts up to 0,
    # not to count: its last step then stays in int32 (count + BLOCK_N may not).
    count = (tl.minimum(lo + chunk, prefix_len) - lo).to(tl.int32)
    origin_table_ptr, origin_row = _tile_origin(table_row_ptr, stride_tc, lo, block_size, IDENTITY_TABLE)
    if WINDOW:  # row (i, h) sees the offsets from row_first - lo on
        row_first = tl.minimum(tl.maximum(row_first - lo, 0), count).to(tl.int32)
    for start_from_end in range(-count, 0, BLOCK_N):  # (the tile's first offset - count)
        offset = (start_from_end + count) + offs_n
        key_ok = offset < count
        k_t, v, k_rest_t = _load_kv_tile(k_head_ptr, v_head_ptr, origin_table_ptr, stride_tc, b, origin_row, offset,
                                         key_ok, block_size, stride_kn, stride_kp, stride_kd, stride_vn, stride_vp,
                                         stride_vd, V_DIM, V_PAD, REST_DIM, REST_PAD, V_FROM_K, COMPUTE_DTYPE,
                                         IDENTITY_TABLE)
        allowed = key_ok[None, :]
        if WINDOW:
            allowed = allowed & (offset[None, :] >= row_first[:, None])
        m_i, l_i, acc = _online_softmax_step(q, k_t, q_rest, k_rest_t, v, allowed, m_i, l_i, acc, qk_scale, cap,
                                             DOT_PRECISION, SOFT_CAP, REST_PAD)

    # Tree: nodes j < min(real nodes, last node of this row tile + 1) at positions prefix_len + j,
    # visible to row (i, h) iff bit j % 32 of word j // 32 of tree_mask[b, i] is set. Last split only.
    tree_end = tl.minimum(real_nodes, tl.minimum((row_tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1, T))
    tree_end = tl.where(split == NUM_SPLITS - 1, tree_end, 0)
    origin_table_ptr, origin_row = _tile_origin(table_row_ptr, stride_tc, prefix_len, block_size, IDENTITY_TABLE)
    for j0 in tl.range(0, tree_end, BLOCK_N, num_stages=1):  # 1-2 tiles: pipeline buffers would only cost smem
        j = j0 + offs_n
        key_ok = j < tree_end
        k_t, v, k_rest_t = _load_kv_tile(k_head_ptr, v_head_ptr, origin_table_ptr, stride_tc, b, origin_row, j,
                                         key_ok, block_size, stride_kn, stride_kp, stride_kd, stride_vn, stride_vp,
                                         stride_vd, V_DIM, V_PAD, REST_DIM, REST_PAD, V_FROM_K, COMPUTE_DTYPE,
                                         IDENTITY_TABLE)
        words = tl.load(tree_mask_ptr + mask_base + node[:, None] * stride_mt + (j // 32)[None, :] * stride_mw,
                        mask=row_ok[:, None] & key_ok[None, :], other=0)
        allowed = ((words >> (j % 32)[None, :]) & 1) != 0
        m_i, l_i, acc = _online_softmax_step(q, k_t, q_rest, k_rest_t, v, allowed, m_i, l_i, acc, qk_scale, cap,
                                             DOT_PRECISION, SOFT_CAP, REST_PAD)

    if SINKS and NUM_SPLITS == 1:  # (with splits, the merge folds the sink in, once)
        m_i, l_i, acc = _fold_sink(m_i, l_i, acc, tl.load(sinks_ptr + head * stride_sinks) * _LOG2E)
    # Rows that saw no key (an empty split, a padding node) end with l = 0: out 0, lse -inf.
    seen = (l_i > 0) & (node < real_nodes)
    l_safe = tl.where(seen, l_i, 1.0)
    out = tl.where(seen[:, None], acc * (v_scale / l_safe)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))
    if PACKED and NUM_SPLITS == 1:  # the final outputs, packed like q
        out_base = row0 * stride_ot
        lse_base = row0 * stride_lt
    else:
        out_base = b * stride_ob
        lse_base = b * stride_lb
    out_rows = out_ptr + out_base + split * stride_os + node * stride_ot + head * stride_oh
    tl.store(out_rows[:, None] + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + lse_base + split * stride_ls + node * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_nodes_ptr, row_offsets_ptr, sinks_ptr,
                         stride_num_nodes, stride_row_offsets, stride_sinks,
                         stride_pb, stride_ps, stride_pt, stride_ph, stride_pd,
                         stride_qb, stride_qs, stride_qt, stride_qh,
                         stride_ob, stride_ot, stride_oh, stride_od,
                         stride_lb, stride_lt, stride_lh,
                         NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, V_DIM: tl.constexpr,
                         V_PAD: tl.constexpr, PACKED: tl.constexpr, SINKS: tl.constexpr):
    """out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s, for one (request, node, head).
    Empty splits carry lse_s = -inf (weight 0); if every split is empty the row is padding: 0 / -inf.
    SINKS: the head's sink joins the sum as one more term of lse with no value (a real node's row only).
    PACKED: the final row of node i of request b is row_offsets[b] + i, written for real nodes only."""
    head = tl.program_id(0)
    node = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    if PACKED:
        if node >= tl.load(num_nodes_ptr + b * stride_num_nodes):
            return
        row0 = tl.load(row_offsets_ptr + b * stride_row_offsets).to(tl.int64)
        out_base = row0 * stride_ot
        lse_base = row0 * stride_lt
    else:
        out_base = b * stride_ob
        lse_base = b * stride_lb
    s = tl.arange(0, SPLITS_POW2)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, V_PAD)
    d_ok = d < V_DIM
    part_lse = tl.load(part_lse_ptr + b * stride_qb + s * stride_qs + node * stride_qt + head * stride_qh,
                       mask=s_ok, other=float("-inf"))
    m = tl.max(part_lse, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head * stride_sinks)
        if not PACKED:  # (a packed padding node returned above)
            sink = tl.where(node < tl.load(num_nodes_ptr + b * stride_num_nodes), sink, float("-inf"))
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp(part_lse - m_safe)
    total = tl.sum(weight, 0)
    if SINKS:
        total += tl.exp(sink - m_safe)
    part_out = tl.load(part_out_ptr + b * stride_pb + node * stride_pt + head * stride_ph
                       + s[:, None] * stride_ps + d[None, :] * stride_pd, mask=s_ok[:, None] & d_ok[None, :],
                       other=0.0)
    part_out = part_out.to(tl.float32)
    total_safe = tl.where(total > 0, total, 1.0)
    out = tl.sum(weight[:, None] * part_out, 0) / total_safe
    lse = tl.where(total > 0, m_safe + tl.log(total_safe), float("-inf"))
    tl.store(out_ptr + out_base + node * stride_ot + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_ptr + lse_base + node * stride_lt + head * stride_lh, lse)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                   tree_mask: torch.Tensor, block_table: Optional[torch.Tensor], num_nodes: torch.Tensor,
                   scale: float, k_scale: float = 1.0, v_scale: float = 1.0, window_left: int = -1,
                   logits_soft_cap: float = 0.0, row_offsets: Optional[torch.Tensor] = None, max_nodes: int = 0,
                   sinks: Optional[torch.Tensor] = None, *, num_splits: Optional[int] = None,
                   config: Optional[TileConfig] = None,
                   out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                   partial_dtype: Optional[torch.dtype] = None):
    """Launcher (normalized args of the `specdec::tree_attention` schema); returns (out, lse).

    sinks: None or (Hq,) float32, per-head logits in the softmax's denominator (the op's `sinks`).
    Keyword-only extras for tests, benchmarks and engines: `num_splits` overrides the split-KV heuristic
    (`choose_num_splits`), `config` the tile heuristic (`choose_config`), `partial_dtype` the dtype of the
    split partial outputs (default q.dtype), and `out` (B, T, Hq, D) q.dtype / `lse` (B, T, Hq) float32
    are preallocated outputs to write into. Every element of them is written. Packed form (row_offsets (B,)
    given): q (N, Hq, D) and tree_mask (N, W) rows, node i of request b at row row_offsets[b] + i, T = max_nodes;
    out (N, Hq, D) / lse (N, Hq), only the rows of real nodes written.
    """
    packed = row_offsets is not None
    if packed:
        B, T, (N, Hq, D) = row_offsets.shape[0], max_nodes, q.shape
        # the kernels address packed rows from row_offsets: views with a dummy request dim (its stride unused)
        q, tree_mask = q.unsqueeze(0), tree_mask.unsqueeze(0)
    else:
        B, T, Hq, D = q.shape
    Hkv, Dv = k_cache.shape[2], v_cache.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q: dtype {q.dtype} not supported by the triton backend (float16, bfloat16, float32); "
                        "use backend='torch'")
    dims = head_dims(D, Dv)
    if dims.v_pad > MAX_V_PAD or dims.rest_pad > MAX_REST_PAD:
        raise ValueError(f"q: head dims (D {D}, Dv {Dv}) not supported by the triton backend (Dv up to {MAX_V_PAD}, "
                         f"D - Dv up to {MAX_REST_PAD}); use backend='torch'")
    # (checked by the op: a v_cache in K's memory with K's strides is k_cache[..., :Dv], MLA's V)
    v_from_k = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
    group = Hq // Hkv
    block_size = k_cache.shape[1]  # contiguous: one block of L_max rows per request
    identity_table = block_table is None
    if not identity_table and block_size >= 2**31:  # (the kernel finds a position's block in uint32)
        raise ValueError(f"k_cache: block size {block_size} not supported by the triton backend (at most 2**31 - 1)")
    # the kernel never reads the table of a contiguous cache: any int32 tensor stands in, with strides 0
    table, table_strides = (cache_lens, (0, 0)) if identity_table else (block_table, block_table.stride())
    offsets = row_offsets if packed else num_nodes  # (padded: any int tensor stands in, never read)
    sink_logits = cache_lens if sinks is None else sinks  # (no sinks: any tensor stands in, never read)
    # (the heuristics read shapes only: a padded batch's, packed or not)
    shaped = torch.empty((B, T, Hq, D), dtype=q.dtype, device="meta") if packed else q
    config = config or default_config(shaped, k_cache)
    row_tiles = triton.cdiv(T * group, config.block_m)
    if num_splits is None:
        num_splits = default_num_splits(shaped, k_cache, block_table, config, window_left)
    rows = (N,) if packed else (B, T)
    if out is None:
        out = torch.empty((*rows, Hq, Dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((*rows, Hq), dtype=torch.float32, device=q.device)
    for name, buf, shape, dtype in (("out", out, (*rows, Hq, Dv), q.dtype), ("lse", lse, (*rows, Hq), torch.float32)):
        if tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != q.device:
            raise ValueError(f"{name}: expected a {shape} {dtype} buffer on {q.device}, got {tuple(buf.shape)} "
                             f"{buf.dtype} on {buf.device}")
    final_out, final_lse = (out.unsqueeze(0), lse.unsqueeze(0)) if packed else (out, lse)  # (B or 1, T or N, ...)
    if num_splits == 1:
        att_out, att_lse = final_out.unsqueeze(1), final_lse.unsqueeze(1)  # (B, 1, T, Hq, D), (B, 1, T, Hq)
    else:
        att_out = torch.empty((B, num_splits, T, Hq, Dv), dtype=partial_dtype or q.dtype, device=q.device)
        att_lse = torch.empty((B, num_splits, T, Hq), dtype=torch.float32, device=q.device)

    _tree_attention_kernel[(row_tiles, Hkv * num_splits, B)](
        q, k_cache, v_cache, cache_lens, tree_mask, table, num_nodes, offsets, att_out, att_lse, sink_logits,
        scale * k_scale * LOG2E, v_scale, logits_soft_cap * LOG2E, window_left, T, block_size,
        cache_lens.stride(0), num_nodes.stride(0), offsets.stride(0), sink_logits.stride(0),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *tree_mask.stride(), *table_strides,
        *att_out.stride(), *att_lse.stride(),
        GROUP=group, V_DIM=Dv, V_PAD=dims.v_pad, REST_DIM=D - Dv, REST_PAD=dims.rest_pad, V_FROM_K=v_from_k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, NUM_SPLITS=num_splits,
        COMPUTE_DTYPE=tl.float32 if q.device.type == "cpu" else _TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        IDENTITY_TABLE=identity_table, WINDOW=window_left >= 0, SOFT_CAP=logits_soft_cap > 0, PACKED=packed,
        SINKS=sinks is not None, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(Hq, T, B)](
            att_out, att_lse, final_out, final_lse, num_nodes, offsets, sink_logits, num_nodes.stride(0),
            offsets.stride(0), sink_logits.stride(0),
            *att_out.stride(), *att_lse.stride(), *final_out.stride(), *final_lse.stride(),
            NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits), V_DIM=Dv, V_PAD=dims.v_pad,
            PACKED=packed,
            SINKS=sinks is not None,
        )
    return out, lse
