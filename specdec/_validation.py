"""Input validation shared by every backend's entry point.

Two kinds of checks:
  * metadata checks (shapes, dtypes, devices): free, always on;
  * value checks (index ranges, NaN logits, capacity, path shape): they read device data on the host,
    so they cost a sync on GPU. They are ON by default and switched off for the GPU hot path with
    `specdec.set_value_checks(False)`, `with specdec.value_checks(False):` or the environment variable
    `SPECDEC_VALUE_CHECKS=0` (the default of every thread). The switch is a context variable: setting it
    in one thread (or asyncio task) leaves the others as they are. The checks are also skipped while
    torch.compile traces (they cannot run on fake tensors) and while a CUDA graph is captured.

The public ops skip the value checks in Python when the call goes to the C++ op, which runs the same
checks with the same messages itself (tests/backends/test_cpp.py compares them).

Every error is a ValueError or TypeError whose message starts with the offending argument's name, and
every check runs before anything is written, so a failed call never leaves a cache half-updated.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import NamedTuple, Optional

import torch

from ._layout import FP8_DTYPES, packed_row_index, unpack_bitmask, unpack_bits

_VALUE_CHECKS = contextvars.ContextVar(
    "specdec_value_checks", default=os.environ.get("SPECDEC_VALUE_CHECKS", "1") not in ("0", "false", "False", ""))

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
INT_DTYPES = (torch.int32, torch.int64)
MAX_OFFSET = 2**60  # accept's random-stream offsets (Philox counter words: 31 + 29 bits)
INT32_MAX = 2**31 - 1  # index tensors are int32 on every backend; positions and ids must fit
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32 (subnormal)
FLOAT32_BELOW_ONE = 1 - 2**-24  # the largest float32 below 1


def set_value_checks(enabled: bool) -> None:
    """Turn the host-syncing value checks on or off for every op called from the current thread (or
    asyncio task) from now on; other threads keep theirs (default: on, or SPECDEC_VALUE_CHECKS)."""
    _VALUE_CHECKS.set(bool(enabled))


@contextlib.contextmanager
def value_checks(enabled: bool):
    """The value checks on or off inside a `with` block, in the current thread only; the previous setting
    comes back after it (blocks nest)."""
    token = _VALUE_CHECKS.set(bool(enabled))
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """On unless turned off, and never while torch.compile traces or a CUDA graph is being captured (a host
    sync there is an error; the checks ran, or could have run, on the eager warm-up calls)."""
    if torch.compiler.is_compiling():  # first: the traced code never reads the context variable
        return False
    return _VALUE_CHECKS.get() and not _capturing_cuda_graph()


def _capturing_cuda_graph() -> bool:
    # is_initialized first: a process that never touched CUDA cannot be capturing, and the query is skipped
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------
def _tensor(name, x, *, dim=None, dtypes=None, device=None):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: dtype {_dtype_name(x.dtype)} not supported (expected one of {names})")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: on {x.device}, expected {device} like the other inputs")


def _number(name, value) -> float:
    """A float argument (an int is accepted, a bool is not)."""
    if not isinstance(value, (float, int)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def _shape(name, x, expected):
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(x.shape)}")


def _fail_if(name, cond, message):
    """Raise ValueError(name: message) when the boolean tensor `cond` has any True (host sync)."""
    if bool(cond.any()):
        raise ValueError(f"{name}: {message}")


def check_int32_values(name, x, num_nodes=None):
    """Value check (on whatever the backend: the ops narrow index tensors to int32 before any kernel sees them,
    the C++ op included): an int64 index tensor holds int32 values, else narrowing would wrap them (2**32 + 5
    would become 5). With num_nodes, x is (B, T) per node and only the real nodes' values count (padding is
    never read)."""
    if x.dtype == torch.int64 and value_checks_enabled():
        outside = (x < -INT32_MAX - 1) | (x > INT32_MAX)
        if num_nodes is not None:
            outside &= torch.arange(x.shape[1], device=x.device) < num_nodes.to(x.device).long().unsqueeze(1)
        _fail_if(name, outside, "int64 values must fit in int32")


# ----------------------------------------------------------------------------------------------
# trees
# ----------------------------------------------------------------------------------------------
def check_parents(parents, num_nodes, values, *, name="parents"):
    B, T = parents.shape
    if T < 1:
        raise ValueError(f"{name}: needs at least one node (the root), got shape {tuple(parents.shape)}")
    if not values:
        return
    nn = num_nodes.to(parents.device).long()
    check_num_nodes_range(nn, T)
    _fail_if(name, parents[:, 0] != -1, "parents[:, 0] must be -1 (node 0 is the root)")
    idx = torch.arange(T, device=parents.device)
    real = (idx > 0) & (idx < nn.unsqueeze(1))
    bad = real & ((parents < 0) | (parents >= idx))
    _fail_if(name, bad, "every real node i > 0 needs 0 <= parents[b, i] < i")


def normalize_num_nodes(num_nodes, B, T, device, *, name="num_nodes"):
    if num_nodes is None:
        return torch.full((B,), T, dtype=torch.int32, device=device)
    _tensor(name, num_nodes, dim=1, dtypes=INT_DTYPES, device=device)
    _shape(name, num_nodes, (B,))
    check_int32_values(name, num_nodes)
    return num_nodes.to(torch.int32)


def check_num_nodes_range(num_nodes, T):
    nn = num_nodes.long()
    _fail_if("num_nodes", (nn < 1) | (nn > T), f"every entry must be in [1, {T}]")


def check_build_tree(parents, num_nodes, values=True):
    _tensor("parents", parents, dim=2, dtypes=INT_DTYPES)
    B, T = parents.shape
    num_nodes = normalize_num_nodes(num_nodes, B, T, parents.device)
    check_int32_values("parents", parents, num_nodes)
    check_parents(parents, num_nodes, values and value_checks_enabled())
    return num_nodes


# ----------------------------------------------------------------------------------------------
# caches
# ----------------------------------------------------------------------------------------------
def check_cache_pair(k_cache, v_cache, block_table, B, *, k_name="k_cache", v_name="v_cache", v_head_dim=False):
    """Checks one layer's (4-D) or a stacked (5-D) K/V pair, or a single cache (v_cache None: MLA's latent cache,
    which kv_append and kv_rollback write and move once); returns (Hkv, D). v_head_dim: v_cache may have its own
    head dim (tree_attention's V, checked there), else it has k_cache's shape and is not a narrower view of
    k_cache's rows (MLA's V; kv_rollback refuses any memory K and V share, the very tensor twice included).
    B: the requests, or None where they are not known yet (a RollbackPlan checks a contiguous cache's rows at
    every run)."""
    _tensor(k_name, k_cache, dtypes=CACHE_DTYPES)
    if v_cache is not None:
        _tensor(v_name, v_cache, dtypes=CACHE_DTYPES, device=k_cache.device)
    if k_cache.dim() not in (4, 5):
        raise ValueError(f"{k_name}: expected (B, L_max, Hkv, D), (num_blocks, block_size, Hkv, D) or a stack of "
                         f"those with a leading layer dimension, got shape {tuple(k_cache.shape)}")
    if v_cache is not None:
        if not v_head_dim and v_reads_k(k_cache, v_cache) and v_cache.shape[-1] < k_cache.shape[-1]:
            raise ValueError(f"{v_name}: is a view of {k_name}'s rows (MLA's V); a single-cache layer passes "
                             f"{v_name}=None, its rows are written and moved once")
        head_dim = v_cache.shape[-1] if v_head_dim and v_cache.dim() == k_cache.dim() else k_cache.shape[-1]
        _shape(v_name, v_cache, (*k_cache.shape[:-1], head_dim))
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"{v_name}: dtype {v_cache.dtype} differs from {k_name} dtype {k_cache.dtype}")
    if block_table is None and B is not None:
        check_contiguous_rows(k_cache, B, k_name)
    return k_cache.shape[-2], k_cache.shape[-1]


def v_reads_k(k_cache, v_cache) -> bool:
    """Whether v_cache is k_cache's leading channels, k_cache[..., :Dv] (MLA's absorbed form: V is the first Dv
    channels of the latent rows K holds): one storage, one first element, K's strides. While torch.compile traces
    (neither aliasing nor storage offsets are traceable there) the shapes decide: a V narrower than K, rows alike,
    is read as K's leading channels, one as wide as K as a cache of its own."""
    if not (v_cache.dim() == k_cache.dim() and v_cache.shape[:-1] == k_cache.shape[:-1]
            and v_cache.shape[-1] <= k_cache.shape[-1]):
        return False
    if torch.compiler.is_compiling():
        return v_cache.shape[-1] < k_cache.shape[-1]
    return (torch._C._is_alias_of(v_cache, k_cache) and v_cache.storage_offset() == k_cache.storage_offset()
            and v_cache.stride() == k_cache.stride())


def check_contiguous_rows(k_cache, B, k_name="k_cache"):
    if k_cache.shape[-4] != B:
        raise ValueError(f"{k_name}: a contiguous cache needs one row per request ({B}), got {k_cache.shape[-4]}")


def check_block_table(block_table, B, device):
    """B: the requests, or None where they are not known yet (a RollbackPlan checks the rows at every run)."""
    if block_table is None:
        return
    _tensor("block_table", block_table, dim=2, dtypes=(torch.int32,), device=device)
    if B is not None and block_table.shape[0] != B:
        raise ValueError(f"block_table: expected {B} rows (one per request), got shape {tuple(block_table.shape)}")


def check_cache_lens(cache_lens, B, device):
    _tensor("cache_lens", cache_lens, dim=1, dtypes=(torch.int32,), device=device)
    _shape("cache_lens", cache_lens, (B,))


def capacity(cache_shape, block_table) -> int:
    """Logical positions a request can address."""
    if block_table is None:
        return cache_shape[-3]
    return block_table.shape[1] * cache_shape[-3]


def check_scales(cache_dtype, k_scale, v_scale):
    """The per-tensor dequantization scales of a cache: (k_scale, v_scale) as floats, 1.0 for None.
    A float8 cache stores x / scale (stored * scale is the value); other caches hold values as they are."""
    scales = []
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        scale = 1.0 if scale is None else _number(name, scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name}: must be a finite number > 0, got {scale:g}")
        if scale != 1.0 and cache_dtype not in FP8_DTYPES:
            raise ValueError(f"{name}: only float8 caches are scaled; this cache is {_dtype_name(cache_dtype)}")
        scales.append(scale)
    return tuple(scales)


def check_positions(cache_shape, cache_lens, block_table, extent, *, what="the T new tokens", first=None):
    """Value check: positions [cache_lens[b], cache_lens[b] + extent[b]) exist, and the blocks the op touches,
    those holding positions [first[b], cache_lens[b] + extent[b]) (first: default 0), are valid; an engine may
    have freed the others (e.g. the blocks that slid out of a window)."""
    cap = capacity(cache_shape, block_table)
    lens = cache_lens.long()
    _fail_if("cache_lens", lens < 0, "must be >= 0")
    end = lens + extent
    _fail_if("cache_lens", end > cap, f"no room for {what}: cache_lens + count exceeds the capacity {cap}")
    # (cache_lens is int32: the op advances it to at most `end`)
    _fail_if("cache_lens", end > INT32_MAX, f"no room for {what}: cache_lens + count exceeds 2**31 - 1 (int32)")
    if block_table is not None:
        block_size = cache_shape[-3]
        used = (end + block_size - 1) // block_size  # blocks covering [0, end)
        first_block = torch.zeros_like(lens) if first is None else first.long() // block_size
        cols = torch.arange(block_table.shape[1], device=block_table.device)
        in_use = (cols.unsqueeze(0) >= first_block.unsqueeze(1)) & (cols.unsqueeze(0) < used.unsqueeze(1))
        num_blocks = cache_shape[-4]
        bad = in_use & ((block_table < 0) | (block_table >= num_blocks))
        _fail_if("block_table", bad, f"block ids in use must be in [0, {num_blocks})")


def check_tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, block_table, num_nodes, scale, k_scale=None,
                         v_scale=None, window_left=-1, logits_soft_cap=0.0, row_offsets=None, max_nodes=0,
                         sinks=None, values=True):
    packed = row_offsets is not None  # q (N, Hq, D), tree_mask (N, W): node i of request b at row_offsets[b] + i
    _tensor("q", q, dim=3 if packed else 4, dtypes=FLOAT_DTYPES)
    if packed:
        (N, Hq, D), B, T = q.shape, row_offsets.shape[0], max_nodes
    else:
        B, T, Hq, D = q.shape
    dev = q.device
    _tensor("k_cache", k_cache, dim=4, device=dev)
    _tensor("v_cache", v_cache)  # (never None here: only kv_append and kv_rollback take a single cache)
    Hkv, Dk = check_cache_pair(k_cache, v_cache, block_table, B, v_head_dim=True)
    if k_cache.dtype != q.dtype and k_cache.dtype not in FP8_DTYPES:
        raise TypeError(f"k_cache: dtype {k_cache.dtype} differs from q dtype {q.dtype} (a cache holds q's dtype "
                        "or float8)")
    from_k = v_reads_k(k_cache, v_cache)
    given_v_scale = v_scale
    k_scale, v_scale = check_scales(k_cache.dtype, k_scale, v_scale)
    if from_k:  # one set of stored values, one scale: None means k_scale
        if given_v_scale is not None and v_scale != k_scale:
            raise ValueError(f"v_scale: v_cache is a view of k_cache's rows, which hold K / k_scale: V's scale is "
                             f"k_scale ({k_scale:g}); give v_scale=None or k_scale, got {v_scale:g}")
        v_scale = k_scale
    if Dk != D:
        raise ValueError(f"k_cache: head dim {Dk} differs from q head dim {D}")
    if Hkv < 1 or D < 1:
        raise ValueError(f"k_cache: needs at least one KV head and a head dim >= 1, got shape {tuple(k_cache.shape)}")
    if not 1 <= v_cache.shape[-1] <= D:
        raise ValueError(f"v_cache: head dim {v_cache.shape[-1]} must be in [1, {D}] (at most K's, as MLA's "
                         "V, the first channels of its latent rows)")
    if Hq % Hkv != 0:
        raise ValueError(f"q: {Hq} query heads is not a multiple of the {Hkv} KV heads")
    check_cache_lens(cache_lens, B, dev)
    check_block_table(block_table, B, dev)
    _tensor("tree_mask", tree_mask, dim=2 if packed else 3, dtypes=(torch.int32,), device=dev)
    _shape("tree_mask", tree_mask, (N, (T + 31) // 32) if packed else (B, T, (T + 31) // 32))
    num_nodes = normalize_num_nodes(num_nodes, B, T, dev)
    if scale is None:
        scale = D ** -0.5
    scale = _number("scale", scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: must be a finite number, got {scale:g}")
    if not isinstance(window_left, int) or isinstance(window_left, bool):
        raise TypeError(f"window_left: expected an int, got {type(window_left).__name__}")
    if window_left != -1 and window_left < T - 1:
        raise ValueError(f"window_left: must be -1 (no window) or >= T - 1 = {T - 1} (a node always sees its "
                         f"ancestors), got {window_left}")
    logits_soft_cap = _number("logits_soft_cap", logits_soft_cap)
    if not (math.isfinite(logits_soft_cap) and logits_soft_cap >= 0):
        raise ValueError(f"logits_soft_cap: must be a finite number >= 0 (0 = no cap), got {logits_soft_cap:g}")
    if sinks is not None:  # one logit per query head
        _tensor("sinks", sinks, dim=1, dtypes=(torch.float32,), device=dev)
        _shape("sinks", sinks, (Hq,))
    if values and value_checks_enabled():
        if sinks is not None:
            _fail_if("sinks", torch.isnan(sinks) | (sinks == math.inf), "every entry must be a finite logit or -inf "
                     "(no sink), got NaN or +inf")
        nn = num_nodes.long()
        check_num_nodes_range(nn, T)
        # the committed prefix is read from position 0, or from the window's first position
        first = (cache_lens.long() - window_left).clamp(min=0) if window_left >= 0 else None
        check_positions(k_cache.shape, cache_lens, block_table, T, first=first)
        if packed:  # request b's rows, gathered (B, T, W) for the checks below
            check_packed_bounds(row_offsets, num_nodes, N)
            tree_mask = tree_mask[packed_row_index(row_offsets, T, N)]
        bits = unpack_bits(tree_mask, T)  # (B, T, T)
        idx = torch.arange(T, device=dev)
        real = idx.unsqueeze(0) < nn.unsqueeze(1)
        no_self = real & ~bits[:, idx, idx]
        _fail_if("tree_mask", no_self, "every real node must have its own bit set")
        future = bits & (idx.view(1, 1, T) > idx.view(1, T, 1))
        _fail_if("tree_mask", future.any(-1) & real, "node i may only see nodes j <= i (ancestors and itself)")
    return num_nodes, scale, k_scale, v_scale, window_left, logits_soft_cap


def check_kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale=None, v_scale=None,
                    values=True):
    """v_cache and v_new are both None for a single-cache layer (MLA's latent cache)."""
    _tensor("k_new", k_new, dim=4, dtypes=FLOAT_DTYPES)
    B, T, Hkv, D = k_new.shape
    dev = k_new.device
    if (v_new is None) != (v_cache is None):
        raise TypeError("v_new: given without v_cache (a single-cache layer has neither)" if v_cache is None else
                        "v_new: required with v_cache (a single-cache layer passes v_cache=None, v_new=None)")
    if v_new is not None:
        _tensor("v_new", v_new, device=dev)
        _shape("v_new", v_new, k_new.shape)
    _tensor("k_cache", k_cache, dim=4, device=dev)
    Hc, Dc = check_cache_pair(k_cache, v_cache, block_table, B)
    if (Hc, Dc) != (Hkv, D):
        raise ValueError(f"k_new: (Hkv, D) = {(Hkv, D)} differs from the cache's {(Hc, Dc)}")
    news = (("k_new", k_new),) if v_new is None else (("k_new", k_new), ("v_new", v_new))
    if v_new is not None:
        _tensor("v_new", v_new, dtypes=FLOAT_DTYPES)
    for name, x in news:
        if x.dtype != k_cache.dtype and k_cache.dtype not in FP8_DTYPES:
            raise TypeError(f"{name}: dtype {x.dtype} differs from cache dtype {k_cache.dtype}")
    scales = check_scales(k_cache.dtype, k_scale, v_scale)
    check_cache_lens(cache_lens, B, dev)
    check_block_table(block_table, B, dev)
    if values and value_checks_enabled():
        check_positions(k_cache.shape, cache_lens, block_table, T, first=cache_lens)  # writes from cache_lens on
    return scales


def as_layer_list(name, caches):
    """One tensor (4-D layer or 5-D stack) or a list/tuple of them -> list of tensors."""
    if isinstance(caches, torch.Tensor):
        return [caches]
    if isinstance(caches, (list, tuple)) and len(caches) > 0 and all(isinstance(c, torch.Tensor) for c in caches):
        return list(caches)
    raise TypeError(f"{name}: expected a tensor or a non-empty list of tensors")


def check_path(accepted_nodes, num_accepted, T_limit=None):
    """Value check: accepted_nodes[b, :num_accepted[b]+1] is strictly increasing from 0."""
    B, P = accepted_nodes.shape
    na = num_accepted.long()
    _fail_if("num_accepted", (na < 0) | (na >= P), f"every entry must be in [0, {P - 1}]")
    idx = torch.arange(P, device=accepted_nodes.device)
    on_path = idx.unsqueeze(0) <= na.unsqueeze(1)
    path = accepted_nodes.long()
    _fail_if("accepted_nodes", path[:, 0] != 0, "every path must start at node 0 (the root)")
    steps = on_path[:, 1:] & (path[:, 1:] <= path[:, :-1])
    _fail_if("accepted_nodes", steps, "the accepted path must be strictly increasing")
    if T_limit is not None:
        _fail_if("accepted_nodes", on_path & (path >= T_limit), f"node indices must be < {T_limit}")


def _layer_suffix(ks, i):
    return "" if len(ks) == 1 else f"[{i}]"


def _span(t):
    """(first, last + 1) byte addresses of t's elements (strides are >= 0)."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()


def self_overlapping(t) -> bool:
    """Whether two elements of t may share memory: a stride-0 dimension, or strides that do not nest (sorted,
    each larger than the extent of the smaller ones; when they nest, distinct indices are distinct addresses)."""
    extent = 0
    for stride, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= extent:
            return True
        extent += (n - 1) * stride
    return False


def shares_memory(a, b) -> bool:
    """Whether tensors a and b (neither self-overlapping) have an element in common. Exact for views of one
    layout at two offsets (the K and V halves of an interleaved buffer, slices of one stack): the offset is
    written in the layout's nested strides, digit by digit; any other pair whose address ranges intersect
    counts as sharing."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _span(a), _span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    size = a.element_size()
    if a.shape != b.shape or a.stride() != b.stride() or b.element_size() != size or (b_lo - a_lo) % size:
        return True
    rest = (b_lo - a_lo) // size
    for stride, n in sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1), reverse=True):
        digit = max(-(n - 1), min(n - 1, int(rest / stride)))  # (toward zero, within the dimension)
        rest -= digit * stride
    return rest == 0


def overlapping_pairs(tensors):
    """The pairs (i, j), i < j, of tensors that share memory (shares_memory; only pairs in one storage whose
    address ranges intersect are compared)."""
    order = sorted(range(len(tensors)), key=lambda i: (tensors[i].untyped_storage().data_ptr(), _span(tensors[i])))
    for pos, i in enumerate(order):
        for j in order[pos + 1:]:
            if (tensors[j].untyped_storage().data_ptr() != tensors[i].untyped_storage().data_ptr()
                    or _span(tensors[j])[0] >= _span(tensors[i])[1]):
                break
            if shares_memory(tensors[i], tensors[j]):
                yield min(i, j), max(i, j)


def check_rollback_caches(k_caches, v_caches, block_table):
    """The metadata of kv_rollback's caches, which stay the same from step to step (RollbackPlan checks them
    once): every layer on one device, of one shape and dtype. v_caches None: single-cache layers (MLA's latent
    caches). Returns the caches as lists (ks, vs), vs empty for single-cache layers."""
    ks = as_layer_list("k_cache", k_caches)
    vs = [] if v_caches is None or (isinstance(v_caches, (list, tuple)) and not v_caches) else \
        as_layer_list("v_cache", v_caches)
    if vs and len(ks) != len(vs):
        raise ValueError(f"v_cache: {len(vs)} layer tensors but k_cache has {len(ks)}")
    dev = ks[0].device
    for i, (k, v) in enumerate(zip(ks, vs or [None] * len(ks))):
        suffix = _layer_suffix(ks, i)
        _tensor(f"k_cache{suffix}", k, device=dev)
        check_cache_pair(k, v, block_table, None, k_name=f"k_cache{suffix}", v_name=f"v_cache{suffix}")
        if k.shape[-4:] != ks[0].shape[-4:] or k.dtype != ks[0].dtype:
            raise ValueError(f"k_cache{suffix}: every layer must share the first layer's shape and dtype")
    # memory shared by two caches (K and V one tensor, a layer twice, overlapping views) or by two elements of one
    # (a stride-0 expand) would have its rows moved twice: a row moved onto a later one's source is moved again
    # (and on a GPU, two programs move the same rows at once). (Not while torch.compile traces: addresses are not
    # known there; the eager calls checked the same caches.)
    if not torch.compiler.is_compiling():
        check_memory_of_its_own(ks, vs)
    check_block_table(block_table, None, dev)
    return ks, vs


def check_memory_of_its_own(ks, vs):
    """No element of a K or V layer shares memory with another element of any of them."""
    names = [f"{name}{_layer_suffix(caches, i)}" for name, caches in (("k_cache", ks), ("v_cache", vs))
             for i in range(len(caches))]
    tensors = ks + vs
    for name, c in zip(names, tensors):
        if self_overlapping(c):
            raise ValueError(f"{name}: its elements overlap (a stride-0 or overlapping view); every row must be "
                             "memory of its own")
    shared = next(overlapping_pairs(tensors), None)
    if shared is not None:
        raise ValueError(f"{names[shared[1]]}: shares memory with {names[shared[0]]}; every K and V layer must be "
                         "memory of its own")


def check_rollback_step(ks, block_table, cache_lens, accepted_nodes, num_accepted, values=True):
    """The per-step arguments of kv_rollback for caches `ks` (and `block_table`) that passed
    check_rollback_caches."""
    dev = ks[0].device
    _tensor("cache_lens", cache_lens, dim=1, dtypes=(torch.int32,), device=dev)
    B = cache_lens.shape[0]
    if block_table is None:
        check_contiguous_rows(ks[0], B, f"k_cache{_layer_suffix(ks, 0)}")
    _tensor("accepted_nodes", accepted_nodes, dim=2, dtypes=INT_DTYPES, device=dev)
    if accepted_nodes.shape[0] != B:
        raise ValueError(f"accepted_nodes: expected {B} rows, got shape {tuple(accepted_nodes.shape)}")
    _tensor("num_accepted", num_accepted, dim=1, dtypes=INT_DTYPES, device=dev)
    _shape("num_accepted", num_accepted, (B,))
    check_block_table(block_table, B, dev)
    check_int32_values("accepted_nodes", accepted_nodes)
    check_int32_values("num_accepted", num_accepted)
    if values and value_checks_enabled():
        check_path(accepted_nodes, num_accepted)
        # the furthest row read is L + path[num_accepted]; its block must exist
        last = accepted_nodes.long().gather(1, num_accepted.long().clamp(0, accepted_nodes.shape[1] - 1).unsqueeze(1))
        check_positions(ks[0].shape, cache_lens, block_table, last.squeeze(1) + 1, what="the tree rows",
                        first=cache_lens)  # moves rows from cache_lens on


def check_kv_rollback(k_caches, v_caches, cache_lens, accepted_nodes, num_accepted, block_table, values=True):
    """Both halves: check_rollback_caches, then check_rollback_step. Returns (ks, vs)."""
    ks, vs = check_rollback_caches(k_caches, v_caches, block_table)
    check_rollback_step(ks, block_table, cache_lens, accepted_nodes, num_accepted, values)
    return ks, vs


# ----------------------------------------------------------------------------------------------
# acceptance
# ----------------------------------------------------------------------------------------------
def packed_rows(cu_num_nodes, max_nodes, num_rows):
    """A packed batch's (num_nodes (B,) int32, row_offsets (B,) int64) from cu_num_nodes (B + 1,): request b's
    nodes are the rows cu[b] .. cu[b + 1] - 1 of num_rows packed rows, at most max_nodes (a Python int) each.
    Its checks run whatever the backend (a kernel sees only the rows the offsets give); no host sync but theirs."""
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
        raise TypeError("max_nodes: with cu_num_nodes, an int >= 1 bounding every request's number of nodes")
    _tensor("cu_num_nodes", cu_num_nodes, dim=1, dtypes=INT_DTYPES)
    if cu_num_nodes.numel() < 2:
        raise ValueError(f"cu_num_nodes: expected (B + 1,) offsets with B >= 1, got shape {tuple(cu_num_nodes.shape)}")
    cu = cu_num_nodes.long()
    counts = cu[1:] - cu[:-1]
    if value_checks_enabled():
        _fail_if("cu_num_nodes", cu[:1] != 0, "cu_num_nodes[0] must be 0")
        _fail_if("cu_num_nodes", cu[-1:] != num_rows, f"cu_num_nodes[-1] must be the number of packed rows, {num_rows}")
        _fail_if("cu_num_nodes", (counts < 1) | (counts > max_nodes),
                 f"every request needs 1 to max_nodes = {max_nodes} nodes")
    return counts.to(torch.int32), cu[:-1]


def packed_nodes(cu_num_nodes, max_nodes, tokens, parents, num_rows):
    """accept's packed form -> the op's: (tokens (B, T), parents (B, T), num_nodes (B,) int32, row_offsets (B,)
    int64) with T = max_nodes, from cu_num_nodes (B + 1,) and tokens / parents (num_rows,) packed the same way
    (parents are indices within the request). On the device, no host sync (the value checks aside)."""
    num_nodes, row_offsets = packed_rows(cu_num_nodes, max_nodes, num_rows)
    dev = cu_num_nodes.device
    for name, x in (("tokens", tokens), ("parents", parents)):
        _tensor(name, x, dim=1, dtypes=INT_DTYPES, device=dev)
        _shape(name, x, (num_rows,))
    real = torch.arange(max_nodes, device=dev) < num_nodes.long().unsqueeze(1)
    rows = packed_row_index(row_offsets, max_nodes, num_rows)
    return (torch.where(real, tokens.long()[rows], 0), torch.where(real, parents.long()[rows], -1), num_nodes,
            row_offsets)


def check_packed_bounds(row_offsets, num_nodes, num_rows):
    """A value check: request b's rows row_offsets[b] .. + num_nodes[b] - 1 lie among the num_rows packed rows."""
    _fail_if("row_offsets", (row_offsets < 0) | (row_offsets + num_nodes.long() > num_rows),
             f"request b's rows row_offsets[b] .. + num_nodes[b] - 1 must be in [0, {num_rows})")


def accept_nodes(cu_num_nodes, max_nodes, num_nodes, tokens, parents, num_rows):
    """accept's nodes in the op's padded form, (tokens, parents, num_nodes, row_offsets): as given (row_offsets
    None), or from the packed form (cu_num_nodes with max_nodes; packed_nodes)."""
    if cu_num_nodes is None:
        return tokens, parents, num_nodes, None
    if num_nodes is not None:
        raise TypeError("num_nodes: with cu_num_nodes the counts are its differences; give one of them")
    return packed_nodes(cu_num_nodes, max_nodes, tokens, parents, num_rows)


def check_accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, top_k=None,
                 top_p=None, min_p=None, token_bitmask=None, method="token", probs=False, row_offsets=None,
                 values=True):
    """The checks of specdec.accept; returns the normalized (num_nodes, temperature, seeds, offset, offsets,
    top_k, top_p, min_p, token_bitmask): top_k (B,) int32, top_p / min_p (B,) float32, each None when it is off
    for the whole batch (None, or a Python number meaning off), so the kernels keep their plain path."""
    target_name, draft_name = ("target_probs", "draft_probs") if probs else ("target_logits", "draft_logits")
    check_method(method, draft_logits, draft_name)
    packed = row_offsets is not None  # rows (N, V): node i of request b is row row_offsets[b] + i
    _tensor(target_name, target_logits, dim=2 if packed else 3, dtypes=FLOAT_DTYPES)
    dev = target_logits.device
    _tensor("tokens", tokens, dim=2, dtypes=INT_DTYPES, device=dev)
    # (padded: the shapes follow target_logits; packed: the nodes' (B, T) follow tokens)
    B, T = tokens.shape if packed else target_logits.shape[:2]
    V = target_logits.shape[-1]
    if V < 1:
        raise ValueError(f"{target_name}: needs a vocabulary of at least one token, got shape "
                         f"{tuple(target_logits.shape)}")
    rows_shape = tuple(target_logits.shape[:1]) if packed else (B, T)
    _shape("tokens", tokens, (B, T))
    _tensor("parents", parents, dim=2, dtypes=INT_DTYPES, device=dev)
    _shape("parents", parents, (B, T))
    if draft_logits is not None:
        _tensor(draft_name, draft_logits, dim=2 if packed else 3, dtypes=FLOAT_DTYPES, device=dev)
        _shape(draft_name, draft_logits, (*rows_shape, V))
    if packed:
        _tensor("row_offsets", row_offsets, dim=1, dtypes=INT_DTYPES, device=dev)
        _shape("row_offsets", row_offsets, (B,))
    num_nodes = normalize_num_nodes(num_nodes, B, T, dev)
    if T >= 1 and value_checks_enabled():  # first: the per-node checks below read the slots it names
        check_num_nodes_range(num_nodes, T)
    check_int32_values("tokens", tokens, num_nodes)
    check_int32_values("parents", parents, num_nodes)
    temperature = normalize_temperature(temperature, B, dev)
    seeds = normalize_seeds(seeds, B, dev)
    offsets = None
    if isinstance(offset, torch.Tensor):
        _tensor("offset", offset, dim=1, dtypes=INT_DTYPES, device=dev)
        _shape("offset", offset, (B,))
        offset, offsets = 0, offset
    elif not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise TypeError("offset: expected a non-negative int or a (B,) int tensor")
    elif offset >= MAX_OFFSET:
        raise ValueError(f"offset: must be < 2**60, got {offset}")
    top_k = normalize_top_k(top_k, B, V, dev)
    top_p = normalize_fraction("top_p", top_p, B, dev, off=1.0)
    min_p = normalize_fraction("min_p", min_p, B, dev, off=0.0)
    if token_bitmask is not None:
        _tensor("token_bitmask", token_bitmask, dim=len(rows_shape) + 1, device=dev)
        if token_bitmask.dtype != torch.int32:  # a ValueError: the layout is wrong, as for a wrong shape
            raise ValueError(f"token_bitmask: dtype {_dtype_name(token_bitmask.dtype)} not supported (expected int32)")
        _shape("token_bitmask", token_bitmask, (*rows_shape, (V + 31) // 32))
    values = values and value_checks_enabled()
    check_parents(parents, num_nodes, values)
    if values:
        check_accept_nodes(tokens, parents, num_nodes, temperature, offsets, top_k, top_p, min_p, method, V,
                           row_offsets, rows_shape[0])
        rows_real = (torch.ones(rows_shape, dtype=torch.bool, device=dev) if packed  # every packed row is a node's
                     else torch.arange(T, device=dev).unsqueeze(0) < num_nodes.long().unsqueeze(1))
        allowed = None
        if token_bitmask is not None:
            allowed = unpack_bitmask(token_bitmask, V)  # (B, T, V) or (N, V)
            _fail_if("token_bitmask", rows_real & ~allowed.any(-1), "a real node's row allows no token")
        for name, x in ((target_name, target_logits), (draft_name, draft_logits)):
            if x is None:
                continue
            row_max = check_finite_rows(name, x, probs)
            if probs:  # zeros are impossible tokens; a row needs some positive entry
                _fail_if(name, rows_real & (row_max == 0), "a real node's row is all zeros")
            else:
                _fail_if(name, rows_real & (row_max == float("-inf")), "a real node's row is entirely -inf")
            if allowed is not None:
                empty = 0.0 if probs else float("-inf")
                masked_max = x.masked_fill(~allowed, empty).amax(-1)
                _fail_if(name, rows_real & (masked_max == empty),
                         f"a real node's row is {'0' if probs else '-inf'} on every token token_bitmask allows")
    return num_nodes, temperature, seeds, offset, offsets, top_k, top_p, min_p, token_bitmask


def check_accept_nodes(tokens, parents, num_nodes, temperature, offsets, top_k, top_p, min_p, method, V,
                       row_offsets=None, num_rows=None):
    """accept's value checks of everything but the rows of logits (check_finite_rows): the draft tokens (of a
    vocabulary of V), the tree, the per-request parameters (normalized by check_accept) and the packed offsets.
    (check_parents first: its messages come before these.)"""
    if offsets is not None:
        _fail_if("offset", (offsets < 0) | (offsets >= MAX_OFFSET), "must be in [0, 2**60)")
    T = tokens.shape[1]
    idx = torch.arange(T, device=tokens.device)
    real = (idx > 0) & (idx < num_nodes.long().unsqueeze(1))
    if method == "block":
        _fail_if("method", real & (parents != idx - 1), "'block' verifies chains only (parents[b, i] = i - 1)")
    if row_offsets is not None:
        check_packed_bounds(row_offsets, num_nodes, num_rows)
    _fail_if("tokens", real & ((tokens < 0) | (tokens >= V)), f"draft tokens must be in [0, {V})")
    _fail_if("temperature", torch.isnan(temperature) | (temperature < 0) | torch.isinf(temperature),
             "must be finite and >= 0")
    if top_k is not None:
        _fail_if("top_k", top_k < 0, TOP_K_RANGE)
    if top_p is not None:
        _fail_if("top_p", ~((top_p > 0) & (top_p <= 1)), TOP_P_RANGE)
    if min_p is not None:
        _fail_if("min_p", ~((min_p >= 0) & (min_p < 1)), MIN_P_RANGE)


def check_finite_rows(name, x, probs):
    """No NaN or +inf in the rows x (logits or probabilities), and no negative probability: the checks that need
    no other row or shard. Returns the rows' maxima."""
    row_max = x.amax(-1)  # one pass: NaN propagates into the max, +inf is the max
    _fail_if(name, torch.isnan(row_max), "contains NaN")
    _fail_if(name, row_max == float("inf"), "contains +inf")
    if probs:
        _fail_if(name, x.amin(-1) < 0, "contains a negative value")
    return row_max


METHODS = ("token", "block", "traversal")


def check_method_name(method):
    """accept's verifier: "token" (token-wise, any tree), "block" (block verification of chains) or "traversal"
    (traversal verification, any tree)."""
    if not isinstance(method, str):
        raise TypeError(f"method: expected a str, one of {METHODS}, got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


def check_method(method, draft_logits, draft_name="draft_logits"):
    """check_method_name, and the drafter's laws (draft_logits or draft_probs) that "block" and "traversal" need."""
    check_method_name(method)
    if method != "token" and draft_logits is None:
        raise ValueError(f"method: {method!r} needs {draft_name} (the drafter's laws); given proposals verify with "
                         "method='token'")


TOP_K_RANGE = "must be >= 0 (0 or >= V: off)"
TOP_P_RANGE = "must be in (0, 1] (1: off)"
MIN_P_RANGE = "must be in [0, 1) (0: off)"


def normalize_top_k(top_k, B, V, device):
    """None / an int / a (B,) int tensor -> None (off for every request) or (B,) int32, clamped to [-1, V]
    (0, negative or >= V: off)."""
    if top_k is None:
        return None
    if isinstance(top_k, int) and not isinstance(top_k, bool):
        if top_k < 0:
            raise ValueError(f"top_k: {TOP_K_RANGE}, got {top_k}")
        return None if top_k == 0 or top_k >= V else torch.full((B,), top_k, dtype=torch.int32, device=device)
    if not isinstance(top_k, torch.Tensor):
        raise TypeError(f"top_k: expected None, an int or a (B,) int tensor, got {type(top_k).__name__}")
    _tensor("top_k", top_k, dim=1, dtypes=INT_DTYPES, device=device)
    _shape("top_k", top_k, (B,))
    return top_k.clamp(-1, V).to(torch.int32)


def normalize_fraction(name, x, B, device, *, off):
    """top_p (off = 1, range (0, 1]) or min_p (off = 0, range [0, 1)): None / a float / a (B,) float tensor ->
    None (off for every request) or (B,) float32."""
    if x is None:
        return None
    rule = TOP_P_RANGE if name == "top_p" else MIN_P_RANGE
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        ok = 0 < x <= 1 if name == "top_p" else 0 <= x < 1
        if not ok:  # (NaN fails both)
            raise ValueError(f"{name}: {rule}, got {x}")
        return None if x == off else to_float32_fraction(name, torch.full((B,), float(x), dtype=torch.float64,
                                                                           device=device))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected None, a float or a (B,) float tensor, got {type(x).__name__}")
    _tensor(name, x, dim=1, dtypes=FLOAT_DTYPES, device=device)
    _shape(name, x, (B,))
    if value_checks_enabled():  # on the values as given (rounding may make a valid value invalid, or the reverse)
        valid = (x > 0) & (x <= 1) if name == "top_p" else (x >= 0) & (x < 1)
        _fail_if(name, ~valid, rule)
    return to_float32_fraction(name, x)


def to_float32_fraction(name, x):
    """top_p / min_p as float32, valid values staying valid: a top_p below float32's smallest positive value becomes
    that value (either keeps only the top tokens), a min_p that would round up to 1 becomes the float32 below 1."""
    if name == "top_p":
        return x.to(torch.float64).clamp(min=FLOAT32_TINY).to(torch.float32)
    return x.to(torch.float64).clamp(max=FLOAT32_BELOW_ONE).to(torch.float32)


def normalize_temperature(temperature, B, device):
    if temperature is None:
        return torch.zeros(B, dtype=torch.float32, device=device)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if not 0 <= temperature <= FLOAT32_MAX:  # (NaN fails too)
            raise ValueError(f"temperature: must be finite and >= 0 (at most float32's largest, 3.4e38), got "
                             f"{temperature}")
        return torch.full((B,), float(temperature), dtype=torch.float32, device=device)
    _tensor("temperature", temperature, dim=1, dtypes=FLOAT_DTYPES, device=device)
    _shape("temperature", temperature, (B,))
    return temperature.to(torch.float32)


def normalize_seeds(seeds, B, device):
    if seeds is None:
        # fresh seeds from torch's global generator, drawn on the device: no host sync
        return torch.randint(0, 2**62, (B,), dtype=torch.int64, device=device)
    _tensor("seeds", seeds, dim=1, dtypes=INT_DTYPES, device=device)
    _shape("seeds", seeds, (B,))
    return seeds.to(torch.int64)


# ----------------------------------------------------------------------------------------------
# accept's sampling parameters beyond the filters: step 0 (penalties, logit bias, min-tokens), the filter order,
# logprobs (their law: specdec.reference.penalized_row, processed_keep and log_law)
# ----------------------------------------------------------------------------------------------
FILTER_ORDERS = ("hf", "vllm", "sglang")
LOGPROBS_MODES = ("raw", "processed")
MAX_LOGPROBS = 20


class SamplingParams(NamedTuple):
    """accept's step-0 and logprob arguments, normalized as the op schema takes them (each None: off)."""
    repetition_penalty: Optional[torch.Tensor]  # (B,) float32
    frequency_penalty: Optional[torch.Tensor]  # (B,) float32
    presence_penalty: Optional[torch.Tensor]  # (B,) float32
    output_token_counts: Optional[torch.Tensor]  # (B, V) int32, contiguous
    prompt_token_mask: Optional[torch.Tensor]  # (B, ceil(V/32)) int32
    logit_bias_ids: Optional[torch.Tensor]  # (B, K) int32, -1 = padding
    logit_bias_values: Optional[torch.Tensor]  # (B, K) float32
    min_tokens: Optional[torch.Tensor]  # (B,) int32
    stop_token_ids: Optional[torch.Tensor]  # (B, S) int32, -1 = padding
    filter_order: str
    return_logprobs: int  # -1: off
    logprobs_mode: str


def _choice(name, x, choices):
    if not isinstance(x, str):
        raise TypeError(f"{name}: expected a str, one of {choices}, got {type(x).__name__}")
    if x not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {x!r}")


def normalize_penalty(name, x, B, device, *, off):
    """A penalty: None / a number / a (B,) float tensor -> None (off for every request) or (B,) float32; finite,
    and > 0 for the repetition penalty (off = 1; frequency and presence: off = 0)."""
    if x is None:
        return None
    rule = "must be finite and > 0 (1: off)" if off == 1.0 else "must be finite (0: off)"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if not (math.isfinite(x) and abs(x) <= FLOAT32_MAX and (off != 1.0 or x > 0)):
            raise ValueError(f"{name}: {rule}, got {x}")
        return None if x == off else torch.full((B,), float(x), dtype=torch.float32, device=device)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected None, a float or a (B,) float tensor, got {type(x).__name__}")
    _tensor(name, x, dim=1, dtypes=FLOAT_DTYPES, device=device)
    _shape(name, x, (B,))
    x = x.to(torch.float32)
    if value_checks_enabled():  # (after the cast: a float64 beyond float32's range is inf there)
        _fail_if(name, ~torch.isfinite(x) | ((x <= 0) if off == 1.0 else torch.zeros_like(x, dtype=torch.bool)),
                 rule)
    return x


def _token_ids(name, x, B, V, device, values, to_cpp=False):
    """(B, K) int ids, -1 = padding, else in [0, V) -> int32 (as given for the C++ op: `_narrowed`)."""
    _tensor(name, x, dim=2, dtypes=INT_DTYPES, device=device)
    if x.shape[0] != B:
        raise ValueError(f"{name}: expected shape (B, K) with B = {B}, got {tuple(x.shape)}")
    if values:
        _fail_if(name, (x < -1) | (x >= V), f"ids must be in [0, {V}) or -1 (padding)")
    return _narrowed(x, to_cpp)


def _narrowed(x: torch.Tensor, to_cpp: bool) -> torch.Tensor:
    """x as int32, or as it came for the C++ op: it checks the values itself (its value checks on or off, as it
    narrows them after), and narrowing 2**40 to int32 here would hand it a valid-looking 0."""
    return x if to_cpp else x.to(torch.int32)


def check_sampling_params(V, B, device, repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
                          output_token_counts=None, prompt_token_mask=None, logit_bias=None, min_tokens=None,
                          stop_token_ids=None, filter_order="hf", return_logprobs=None, logprobs_mode="raw",
                          values=True) -> SamplingParams:
    """The checks of accept's step-0 and logprob arguments (specdec.accept's docstring) -> SamplingParams. values
    False: the C++ op takes them, and checks their values itself."""
    to_cpp = not values
    values = values and value_checks_enabled()
    _choice("filter_order", filter_order, FILTER_ORDERS)
    _choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    if return_logprobs is None:
        return_logprobs = -1
    elif not isinstance(return_logprobs, int) or isinstance(return_logprobs, bool):
        raise TypeError(f"return_logprobs: expected None or an int, got {type(return_logprobs).__name__}")
    elif not 0 <= return_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"return_logprobs: must be in [0, {MAX_LOGPROBS}] (None: off), got {return_logprobs}")
    rep = normalize_penalty("repetition_penalty", repetition_penalty, B, device, off=1.0)
    freq = normalize_penalty("frequency_penalty", frequency_penalty, B, device, off=0.0)
    pres = normalize_penalty("presence_penalty", presence_penalty, B, device, off=0.0)
    if min_tokens is None:
        if stop_token_ids is not None:
            raise TypeError("stop_token_ids: goes with min_tokens (the stop tokens masked until min_tokens)")
    elif isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        if min_tokens < 0 or min_tokens > INT32_MAX:
            raise ValueError(f"min_tokens: must be in [0, 2**31) (0: off), got {min_tokens}")
        min_tokens = None if min_tokens == 0 else torch.full((B,), min_tokens, dtype=torch.int32, device=device)
    elif isinstance(min_tokens, torch.Tensor):
        _tensor("min_tokens", min_tokens, dim=1, dtypes=INT_DTYPES, device=device)
        _shape("min_tokens", min_tokens, (B,))
        if values:
            _fail_if("min_tokens", (min_tokens < 0) | (min_tokens > INT32_MAX), "must be in [0, 2**31) (0: off)")
        min_tokens = _narrowed(min_tokens, to_cpp)
    else:
        raise TypeError(f"min_tokens: expected None, an int or a (B,) int tensor, got {type(min_tokens).__name__}")
    if min_tokens is not None:
        if stop_token_ids is None:
            raise TypeError("stop_token_ids: required with min_tokens")
        stop_token_ids = _token_ids("stop_token_ids", stop_token_ids, B, V, device, values, to_cpp)
    else:
        stop_token_ids = None
    needs_counts = [n for n, x in (("repetition_penalty", rep), ("frequency_penalty", freq),
                                   ("presence_penalty", pres), ("min_tokens", min_tokens)) if x is not None]
    if output_token_counts is not None:
        _tensor("output_token_counts", output_token_counts, dim=2, dtypes=INT_DTYPES, device=device)
        _shape("output_token_counts", output_token_counts, (B, V))
        if values and output_token_counts.numel():  # (two reductions: a mask of (B, V) would cost more)
            counts = output_token_counts
            _fail_if("output_token_counts", (counts.amin() < 0) | (counts.amax() > INT32_MAX),
                     "counts must be in [0, 2**31)")
        output_token_counts = _narrowed(output_token_counts, to_cpp).contiguous() if needs_counts else None
    elif needs_counts:
        raise TypeError(f"output_token_counts: required with {needs_counts[0]} (the counts the penalties read)")
    if prompt_token_mask is not None:
        _tensor("prompt_token_mask", prompt_token_mask, dim=2, device=device)
        if prompt_token_mask.dtype != torch.int32:
            raise ValueError(f"prompt_token_mask: dtype {_dtype_name(prompt_token_mask.dtype)} not supported "
                             "(expected int32)")
        _shape("prompt_token_mask", prompt_token_mask, (B, (V + 31) // 32))
        prompt_token_mask = prompt_token_mask.contiguous() if rep is not None else None
    bias_ids = bias_values = None
    if logit_bias is not None:
        if not (isinstance(logit_bias, (tuple, list)) and len(logit_bias) == 2):
            raise TypeError("logit_bias: expected (ids (B, K) int, values (B, K) float)")
        bias_ids = _token_ids("logit_bias[0]", logit_bias[0], B, V, device, values, to_cpp)
        _tensor("logit_bias[1]", logit_bias[1], dim=2, dtypes=FLOAT_DTYPES, device=device)
        _shape("logit_bias[1]", logit_bias[1], tuple(bias_ids.shape))
        bias_values = logit_bias[1].to(torch.float32)
        if values:
            _fail_if("logit_bias[1]", ~torch.isfinite(bias_values), "must be finite (as float32)")
    return SamplingParams(rep, freq, pres, output_token_counts, prompt_token_mask, bias_ids, bias_values, min_tokens,
                          stop_token_ids, filter_order, return_logprobs, logprobs_mode)


def check_rows_after_min_tokens(name, rows, params: SamplingParams, parents, num_nodes, token_bitmask, probs,
                                row_offsets=None):
    """Value check: min-tokens never leaves a real node's row without a possible token (stop tokens masked at the
    nodes that have not generated min_tokens yet, with the grammar mask). rows (B, T, V) or packed (N, V)."""
    if params.min_tokens is None or not value_checks_enabled():
        return
    B, T = parents.shape
    V = rows.shape[-1]
    real = torch.arange(T, device=rows.device) < num_nodes.long().unsqueeze(1)
    parents = parents.long().where(real, -1)  # (padding slots hold anything)
    depth = torch.zeros((B, T), dtype=torch.long, device=rows.device)
    for _ in range(T - 1):  # depth[i] = depth[parents[i]] + 1, settled from the root down
        depth = torch.where(parents > 0, depth.gather(1, parents.clamp(min=0)) + 1,
                            (parents == 0).long())
    generated = params.output_token_counts.long().sum(-1, keepdim=True) + depth  # (B, T)
    stopping = generated < params.min_tokens.long().unsqueeze(1)  # (B, T)
    check = real & stopping
    if not bool(check.any()):
        return
    b, i = check.nonzero(as_tuple=True)  # (only the rows min-tokens masks are read)
    stops = torch.zeros((B, V + 1), dtype=torch.bool, device=rows.device)
    stops.scatter_(1, params.stop_token_ids.long().where(params.stop_token_ids >= 0, V), True)
    at = (b, i) if row_offsets is None else (row_offsets.long()[b] + i,)  # packed: row row_offsets[b] + i
    banned = stops[b, :V]
    if token_bitmask is not None:
        banned = banned | ~unpack_bitmask(token_bitmask[at], V)
    empty = 0.0 if probs else float("-inf")
    _fail_if("min_tokens", rows[at].masked_fill(banned, empty).amax(-1) == empty,
             "masks every possible token of a real node's row (its stop tokens and the grammar mask leave none)")
