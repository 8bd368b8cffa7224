"""The logprobs of the emitted tokens (return_logprobs >= 0): `_logprobs_kernel`, launched after the walk, one
program per (request b, position j) (`emitted_logprobs`, the host side).

Position j <= num_accepted[b] emits token e_j (the accepted draft token tokens[b, accepted_nodes[b, j + 1]] for
j < num_accepted, then next_tokens[b]) from its parent row r = accepted_nodes[b, j]. Its log-law:
  * "raw": log_softmax of the row as given (probabilities: log(p / sum p)), before step 0 and the mask;
  * "processed": the law the token was drawn from: the row after step 0 (`_values`: the penalties at the parent
    node's counts), through the mask (`_kept`) and temperature, and for a filtered sampling request its
    threshold tau in the launch's filter order (the one the walk's search, filters.py, found for the node),
    log p(x) = (x - M) / t - lse over the kept x >= tau (M the largest kept value); a greedy request's row at
    temperature 1 without filters (vLLM's convention).
logprobs[b, j] is that log-law at e_j, and top_logprobs / top_token_ids its N = return_logprobs largest entries,
ranked by the row's values themselves (raw: the entries as given, probabilities included, so no float32 log can
tie two of them; processed: the masked values, the dropped ones at -inf), ties by the lower id; token_ranks[b, j]
is e_j's rank by the same keys, the entries at least its own. Positions past num_accepted get NaN / -1.

One read of the row does it all (`_position_pass`): per-lane (max, sum exp) as the walk's statistics, the
token's value and rank, and a running top-N merge (`_merge_top`): a tile enters the list only through the entries that
beat its current last one, so after the first tiles of a row a tile costs one compare per entry and one
reduction; a threshold search for the N-th value instead would read the row at least twice more (pivots, then
gathering). In every mode, filtered or not, each emitted row is read exactly once beyond what the walk reads: a
filtered "processed" row's threshold is the one the walk found for that node when it took its law (`_start_node`
records it, in every launch with filters, in a (B, T) float32 scratch after the search records,
`node_thresholds`; every sampling node of the path gets there before its children's tests or its draw, in every
method), the same float from the same search of the same values, so the kept set and the logprobs are those a
search here would give. A greedy row needs none: no filter applies to it. The rank counts the entries at least
the token's key, which a pass cannot know before it reads the token's tile: the pass starts at that tile and wraps
around, so every tile is compared with the key it read first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _elementwise_max as _MAX
from triton.language.standard import _elementwise_min as _MIN
from triton.language.standard import _sum_combine as _SUM

from .launch import _accept_kernel
from .penalties import _request_penalties
from .records import INT_MAX, NEG_INF, POS_INF, node_thresholds
from .rows import _kept, _lane_lse, _load_row, _merge_lse, _request, _row_logits, _rows, _shift, _values

MODES = ("raw", "processed")


@triton.jit
def _beats(v, i, w, j):
    """Entry (v, id i) ranks before (w, id j): a larger value, or the same value and a lower id."""
    return (v > w) | ((v == w) & (i < j))


@triton.jit
def _last(top_v, top_i, live):
    """The last-ranked entry of the live slots of a top list (value, id); (+inf, -1) when none is live."""
    v = tl.reduce(tl.where(live, top_v, POS_INF), 0, _MIN)
    return v, tl.reduce(tl.where(live & (top_v == v), top_i, -1), 0, _MAX)


@triton.jit
def _merge_top(top_v, top_i, live, key, cols, inside):
    """The top list (values, ids; `live` slots, the others never touched) after the entries (key, cols) of a tile
    (`inside`: real entries): each entry that beats the list's last one replaces it, the best first. Ids are
    distinct (the list's sentinels have ids above any column), so every comparison is strict."""
    last_v, last_i = _last(top_v, top_i, live)
    enters = inside & _beats(key, cols, last_v, last_i)
    while tl.reduce(enters.to(tl.int32), 0, _SUM) > 0:
        best_v = tl.reduce(tl.where(enters, key, NEG_INF), 0, _MAX)
        best_i = tl.reduce(tl.where(enters & (key == best_v), cols, INT_MAX), 0, _MIN)
        out = live & (top_v == last_v) & (top_i == last_i)
        top_v = tl.where(out, best_v, top_v)
        top_i = tl.where(out, best_i, top_i)
        last_v, last_i = _last(top_v, top_i, live)
        enters = enters & (cols != best_i) & _beats(key, cols, last_v, last_i)
    return top_v, top_i


@triton.jit
def _position_pass(req, node, row, token, tau, inv_t, n_top, PROCESSED: tl.constexpr, N_BLOCK: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    """One pass over the row of `node`, from the tile holding `token`: (raw max M of the law's values,
    sum exp((x - M) / t), the value of `token`, its rank (the entries whose key is at least its key), the n_top
    best (key, id) in a list of N_BLOCK slots, unsorted). The law's values: PROCESSED, the
    row after step 0 (`_values`), the mask and the threshold tau (`_kept`); else the row as given. Keys: the
    values, except probabilities (raw, or processed without step 0): the stored entries of the
    values kept, 0 for the others, as their float32 logs may tie distinct entries."""
    ar = tl.arange(0, BLOCK_V)
    slot = tl.arange(0, N_BLOCK)
    live = slot < n_top
    top_v = tl.full((N_BLOCK,), NEG_INF, tl.float32)
    top_i = INT_MAX - slot  # (sentinels: distinct ids past any column, last of their value)
    m = tl.full((BLOCK_V,), NEG_INF, tl.float32)
    s = tl.full((BLOCK_V,), 0.0, tl.float32)
    x_token = tl.full((), NEG_INF, tl.float32)
    key_token = tl.full((), NEG_INF, tl.float32)
    at_least = tl.zeros((BLOCK_V,), tl.int32)
    first = token // BLOCK_V
    num_tiles = tl.cdiv(req.V, BLOCK_V)
    for k in range(0, num_tiles):
        tile = first + k
        cols = tl.where(tile >= num_tiles, tile - num_tiles, tile) * BLOCK_V + ar
        inside = cols < req.V
        stored = _load_row(row + cols, inside, req.probs)
        if PROCESSED:
            x = _kept(req, node, cols, _values(req, node, cols, stored), tau)
        else:
            x = _row_logits(stored, req.probs)
        key = x
        if req.probs and not (PROCESSED and req.penalties):
            key = tl.where(x > NEG_INF, stored.to(tl.float32), 0.0)
        m, s = _lane_lse(m, s, x, inv_t)
        if k == 0:
            x_token = tl.reduce(tl.where(cols == token, x, NEG_INF), 0, _MAX)
            key_token = tl.reduce(tl.where(cols == token, key, NEG_INF), 0, _MAX)
        at_least += (inside & (key >= key_token)).to(tl.int32)
        top_v, top_i = _merge_top(top_v, top_i, live, key, cols, inside)
    max_x, sum_x = _merge_lse(m, s, inv_t)
    return max_x, sum_x, x_token, tl.reduce(at_least, 0, _SUM).to(tl.int64), top_v, top_i


@triton.jit
def _logprobs_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                     mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                     state_f_ptr, taus_ptr, logprobs_ptr, top_lp_ptr, top_ids_ptr, ranks_ptr, T, V, W, stride_tb,
                     stride_tt,
                     stride_db, stride_dt, offset_lo, offset_hi, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr,
                     bias_ids_ptr, bias_values_ptr, min_tokens_ptr, stop_ids_ptr, generated_ptr, counted,
                     prompt_words, K, S, N, HAS_OFFSETS: tl.constexpr, HAS_FILTERS: tl.constexpr,
                     PROBS: tl.constexpr, PACKED: tl.constexpr, PROCESSED: tl.constexpr, T_BLOCK: tl.constexpr,
                     N_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, HAS_PENALTIES: tl.constexpr,
                     FILTER_ORDER: tl.constexpr):
    """Position j = program_id(1) of request b = program_id(0), after the walk wrote its outputs: logprobs[b, j]
    and its N (<= N_BLOCK) top entries (top_lp / top_ids (B, T, N)) and its token's rank (ranks (B, T) int64),
    or NaN / -1 past num_accepted[b]. The
    arguments before logprobs_ptr are the walk's (`_request`'s); taus_ptr: the (B, T) thresholds the walk recorded
    (`node_thresholds`), read only for a filtered "processed" row; rep_ptr ... S: step 0's (read only when
    PROCESSED)."""
    pen = _request_penalties(tl.program_id(0), rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, bias_ids_ptr,
                             bias_values_ptr, min_tokens_ptr, stop_ids_ptr, generated_ptr, counted, prompt_words, K, S,
                             tokens_ptr, parents_ptr, T, V, PROBS, HAS_PENALTIES)
    req = _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                   state_f_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, pen,
                   taus_ptr, HAS_OFFSETS, HAS_FILTERS, PROBS, PACKED, T_BLOCK, HAS_PENALTIES, FILTER_ORDER)
    j = tl.program_id(1)
    at = tl.program_id(0).to(tl.int64) * T + j
    slot = tl.arange(0, N_BLOCK)
    num = tl.load(req.out_num)
    logprob = tl.full((), float("nan"), tl.float32)
    top_lp = tl.full((N_BLOCK,), float("nan"), tl.float32)
    top_id = tl.full((N_BLOCK,), -1, tl.int64)
    rank = slot
    token_rank = tl.full((), -1, tl.int64)
    if j <= num:
        node = tl.load(req.path + j)
        child = tl.load(req.path + j + 1, mask=j < num, other=0)
        token = tl.where(j < num, tl.load(req.tok_row + child, mask=j < num, other=-1),
                         tl.load(req.out_next).to(tl.int32))
        row, _ = _rows(req, node)
        inv_t = 1.0
        tau = tl.full((), NEG_INF, tl.float32)
        if PROCESSED:
            inv_t = req.inv_t
            if HAS_FILTERS:
                if req.filtered:  # (the walk found the node's law, through its threshold, before it went on)
                    tau = tl.load(req.taus + node)
        max_x, sum_x, x_token, token_rank, top_v, top_i = _position_pass(req, node, row, token, tau, inv_t, N,
                                                                         PROCESSED, N_BLOCK, BLOCK_V)
        shift = _shift(max_x)
        lse = tl.log(sum_x)
        logprob = (x_token - shift) * inv_t - lse
        top_x = top_v
        if req.probs and not (PROCESSED and req.penalties):
            top_x = _row_logits(top_v, PROBS)  # (keys that are the stored probabilities)
        live = slot < N
        real = top_i < V
        top_lp = tl.where(real, (top_x - shift) * inv_t - lse, float("nan"))
        top_id = tl.where(real, top_i, -1).to(tl.int64)
        rank = tl.reduce((live[None, :] & _beats(top_v[None, :], top_i[None, :], top_v[:, None], top_i[:, None]))
                         .to(tl.int32), 1, _SUM)
    tl.store(logprobs_ptr + at, logprob)
    tl.store(ranks_ptr + at, token_rank)
    tl.store(top_lp_ptr + at * N + rank, top_lp, mask=slot < N)
    tl.store(top_ids_ptr + at * N + rank, top_id, mask=slot < N)


def empty_logprobs(B: int, T: int, return_logprobs: int, device):
    """The logprob outputs' tensors, uninitialized: (B, T), (B, T, N), (B, T, N) and (B, T), N = return_logprobs;
    (B, 0), (B, 0, 0), (B, 0, 0) and (B, 0) when off (return_logprobs < 0)."""
    positions, N = (T, return_logprobs) if return_logprobs >= 0 else (0, 0)
    return (torch.empty((B, positions), dtype=torch.float32, device=device),
            torch.empty((B, positions, N), dtype=torch.float32, device=device),
            torch.empty((B, positions, N), dtype=torch.int64, device=device),
            torch.empty((B, positions), dtype=torch.int64, device=device))


def emitted_logprobs(args, meta, return_logprobs: int, logprobs_mode: str, raw_rows=None):
    """The op's logprob outputs after the walk: (logprobs (B, T) float32, top_logprobs (B, T, N) float32,
    top_token_ids (B, T, N) int64, token_ranks (B, T) int64), N = max(return_logprobs, 0); `empty_logprobs`' shapes
    when off (return_logprobs < 0). args / meta: the walk's launch arguments and constexprs (`accept`), after the walk
    has run; T is the walk's, the launch a function of the shapes
    only. raw_rows: the target rows "raw" reads when they are not the walk's (float64 rows, which the walk reads
    after step 0 or shifted by the mask's max: the raw rows shifted by their own max, same layout), else None."""
    walk = dict(zip(_accept_kernel.arg_names, args))
    T, accepted = walk["T"], walk["acc_ptr"]
    B, dev = accepted.shape[0], accepted.device
    logprobs, top_lp, top_ids, ranks = empty_logprobs(B, T, return_logprobs, dev)
    if return_logprobs < 0 or B == 0:
        return logprobs, top_lp, top_ids, ranks
    N = return_logprobs
    processed = logprobs_mode == "processed"
    # (filtered: the thresholds the walk recorded; else any tensor stands in, never read)
    taus = node_thresholds(walk["search_f_ptr"], B, T) if meta["HAS_FILTERS"] else walk["state_f_ptr"]
    target = raw_rows if not processed and raw_rows is not None else walk["target_ptr"]
    strides = (0, target.stride(0)) if meta["PACKED"] else (target.stride(0), target.stride(1))
    # the walk's arguments by name (draft_ptr: any pointer, never read), then the outputs and the rows read
    values = dict(walk, target_ptr=target, draft_ptr=target, taus_ptr=taus, logprobs_ptr=logprobs, top_lp_ptr=top_lp,
                  top_ids_ptr=top_ids, ranks_ptr=ranks, N=N,
                  **dict(zip(("stride_tb", "stride_tt", "stride_db", "stride_dt"), strides + strides)))
    names = _logprobs_kernel.arg_names
    _logprobs_kernel[(B, T)](
        *(values[name] for name in names[: names.index("N") + 1]), PROCESSED=processed,
        N_BLOCK=triton.next_power_of_2(max(N, 1)), HAS_PENALTIES=meta["HAS_PENALTIES"] and processed,
        **{name: meta[name] for name in ("HAS_OFFSETS", "HAS_FILTERS", "PROBS", "PACKED", "T_BLOCK", "BLOCK_V",
                                         "FILTER_ORDER", "num_warps")})
    return logprobs, top_lp, top_ids, ranks
