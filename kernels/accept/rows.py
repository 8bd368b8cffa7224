"""Randomness, elementwise pieces and the request: its context (`_request`), its tree (children, tokens, the
acceptance uniforms), and every read of one of its rows (`_load_row`, `_values`, `_kept`, `_log_prob`)."""
from __future__ import annotations

import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _elementwise_max as _MAX
from triton.language.standard import _elementwise_min as _MIN
from triton.language.standard import _sum_combine as _SUM

from .penalties import _penalized
from .records import GREEDY_BELOW, NEG_INF, Request, STATE_FLOATS, STREAM_U, Stream, U_TEST


@triton.jit
def _uniform(stream, idx, word):
    """U[0, 1) (24 bits): word 0 of Philox(seed; idx, word, base | STREAM_U, off_lo)."""
    r, _, _, _ = tl.philox(stream.seed, idx, word, stream.base + STREAM_U, stream.off_lo)
    return (r >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _uniform_pair(stream, idx, word):
    """Two independent U[0, 1): words 0 and 1 of Philox(seed; idx, word, base | STREAM_U, off_lo)."""
    r0, r1, _, _ = tl.philox(stream.seed, idx, word, stream.base + STREAM_U, stream.off_lo)
    return (r0 >> 8).to(tl.float32) * 5.9604644775390625e-08, (r1 >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _lane_lse(m, s, x, inv_t):
    """Fold raw values x into per-lane (raw max M, sum exp((. - M) / t)) with one exp per entry; -inf entries add
    nothing."""
    t = tl.exp(-tl.abs(x - m) * inv_t)  # exp((min - max) / t) of the pair; the max's own term is 1
    t = tl.where(x == NEG_INF, 0.0, t)
    up = x > m
    return tl.maximum(m, x), tl.where(up, s * t + 1.0, s + t)


@triton.jit
def _merge_lse(m, s, inv_t):
    """(raw max M, sum exp((. - M) / t)) of a vector of such pairs (a tile's lanes, or a row's chunks)."""
    mm = tl.reduce(m, 0, _MAX)
    return mm, tl.reduce(s * tl.exp((m - _shift(mm)) * inv_t), 0, _SUM)


@triton.jit
def _shift(m):
    """The shift of a row whose raw max is m: m, or 0 when the row keeps nothing (m = -inf)."""
    return tl.where(m == NEG_INF, 0.0, m)


@triton.jit
def _scaled(req, x, law):
    """(x - shift) / t: raw values on the scale of the row's `RowLaw`."""
    return (x - law.shift) * req.inv_t


@triton.jit
def _residual(a, b, law_p, law_q, c, HAS_DRAFT: tl.constexpr):
    """r = max(p - c q, 0) (p itself when c <= 0: q is not read then), from values already `_scaled`."""
    p = tl.exp(a - law_p.lse)
    if HAS_DRAFT:
        p = tl.where(c > 0, tl.maximum(p - c * tl.exp(b - law_q.lse), 0.0), p)
    return p


@triton.jit
def _load_row(ptrs, mask, PROBS: tl.constexpr):
    """Row entries as stored, a masked lane as an impossible token: probability 0 (PROBS) or logit -inf; every
    load of a target or draft row goes through here, and its values through `_row_logits` before use."""
    if PROBS:
        x = tl.load(ptrs, mask=mask, other=0.0)
    else:
        x = tl.load(ptrs, mask=mask, other=NEG_INF)
    return x


@triton.jit
def _row_logits(x, PROBS: tl.constexpr):
    """float32 logits of entries `_load_row` read: probabilities mean their logs (log 0 = -inf, as a masked lane),
    taken after the upcast (a 16-bit log would move the law). A step of its own so that the prefetched tiles
    stay raw loads until they are folded in (a log at the load would wait for it, defeating the prefetch)."""
    x = x.to(tl.float32)
    if PROBS:
        x = tl.log(x)
    return x


@triton.jit
def _values(req, node, cols, x):
    """The values the walk uses of entries x (as `_load_row` read them) of tokens `cols` of node's row:
    `_row_logits`, after step 0 when the launch has it (HAS_PENALTIES: `_penalized`, the node's path counts).
    Every read of a row goes through here (or `_target_values`)."""
    if req.penalties:
        values = _penalized(req.pen, node, cols, x)
    else:
        values = _row_logits(x, req.probs)
    return values


@triton.jit
def _target_values(req, node, cols, x):
    """`_values` of a statistics pass's target tile. A greedy row of probabilities keeps them as they are
    (0 = impossible: -inf): its argmax is theirs, where a float32 log rounds probabilities an ulp apart to one
    value (the first of them won); after step 0 it is the argmax of the penalized logs (`_penalized`)."""
    if req.penalties:
        values = _penalized(req.pen, node, cols, x)
    else:
        values = x.to(tl.float32)
        if req.probs:
            values = tl.where(req.greedy, tl.where(values > 0.0, values, NEG_INF), tl.log(values))
    return values


@triton.jit
def _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr, mask_ptr,
             row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr, state_f_ptr, T, V, W,
             stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, pen, taus_ptr, HAS_OFFSETS: tl.constexpr,
             HAS_FILTERS: tl.constexpr, PROBS: tl.constexpr, PACKED: tl.constexpr, T_BLOCK: tl.constexpr,
             HAS_PENALTIES: tl.constexpr, FILTER_ORDER: tl.constexpr):
    """The `Request` of this program (request program_id(0)); pen: its `Penalties` (`_request_penalties`);
    taus_ptr: (B, T) float32, the nodes' target thresholds (HAS_FILTERS: written by the walk, read by the
    logprobs; else never touched)."""
    b = tl.program_id(0)
    t = tl.load(temp_ptr + b)
    greedy = t < GREEDY_BELOW
    k = tl.full((), 0, tl.int32)
    top_p = tl.full((), 1.0, tl.float32)
    min_p = tl.full((), 0.0, tl.float32)
    if HAS_FILTERS:
        k = tl.load(top_k_ptr + b)
        top_p = tl.load(top_p_ptr + b)
        min_p = tl.load(min_p_ptr + b)
    k = tl.where((k > 0) & (k < V), k, 0)
    filtered = (~greedy) & ((k > 0) | (top_p < 1.0) | (min_p > 0.0))
    # the int offset arrives as two int32 words (one argument type for every value: a Python int in
    # [2^31, 2^32) would be typed uint32 and one above as int64)
    off = offset_hi.to(tl.int64) * 2147483648 + offset_lo.to(tl.int64)
    if HAS_OFFSETS:
        off += tl.load(offsets_ptr + b).to(tl.int64)
    stream = Stream(seed=tl.load(seeds_ptr + b), off_lo=(off & 0x7FFFFFFF).to(tl.int32),
                    base=(((off >> 31) & 0x1FFFFFFF) * 4).to(tl.int32))
    idx = tl.arange(0, T_BLOCK)
    n_real = tl.minimum(tl.load(num_nodes_ptr + b), T)
    valid = idx < n_real  # (paths only ascend: a walk ends even on unchecked input)
    par_row = parents_ptr + b * T
    tok_row = tokens_ptr + b * T
    # the request's first target / draft / bitmask row: node n's rows follow it at n row strides
    if PACKED:  # rows (N, ...) shared by the batch: request b's start at row row_offsets[b] (no stride of its own)
        first = tl.load(row_offsets_ptr + b).to(tl.int64)
        t_rows = target_ptr + first * stride_tt
        d_rows = draft_ptr + first * stride_dt
        masks = mask_ptr + first * W
    else:
        t_rows = target_ptr + b.to(tl.int64) * stride_tb
        d_rows = draft_ptr + b.to(tl.int64) * stride_db
        masks = mask_ptr + b.to(tl.int64) * T * W
    u_test = tl.full((T_BLOCK,), 0.0, tl.float32)
    if not greedy:  # drawn up front in one call
        u_test = _uniform(stream, idx, U_TEST)
    return Request(greedy=greedy, inv_t=1.0 / tl.where(greedy, 1.0, t), stream=stream, idx=idx, valid=valid,
                   par=tl.load(par_row + idx, mask=valid, other=-2), tok=tl.load(tok_row + idx, mask=valid, other=-1),
                   u_test=u_test, par_row=par_row, tok_row=tok_row, n_real=n_real,
                   t_rows=t_rows, d_rows=d_rows, stride_tt=stride_tt, stride_dt=stride_dt, V=V, masks=masks, W=W,
                   t=tl.where(greedy, 1.0, t), k=k, top_p=top_p, min_p=min_p, filtered=filtered, path=acc_ptr + b * T,
                   out_num=num_acc_ptr + b, out_next=next_ptr + b, writer=tl.program_id(1) == 0,
                   records=state_f_ptr + (2 * tl.num_programs(0) + b * T).to(tl.int64) * STATE_FLOATS,
                   taus=taus_ptr + b.to(tl.int64) * T, pen=pen, probs=PROBS, penalties=HAS_PENALTIES,
                   order=FILTER_ORDER, record_taus=HAS_FILTERS)


@triton.jit
def _rows(req, node):
    """The node's target and draft logits rows."""
    return req.t_rows + node.to(tl.int64) * req.stride_tt, req.d_rows + node.to(tl.int64) * req.stride_dt


@triton.jit
def _allowed(req, node, cols):
    """Whether node's token_bitmask row allows tokens `cols` (bit v % 32 of word v // 32; call only with a
    bitmask, W > 0). The grammar mask is fused here: its words are read per tile, V / 8 bytes per walked row,
    and no masked copy of the logits exists. A runtime switch (W > 0, uniform per program) rather than a
    constexpr: it guards one load and one select at each place a row is read."""
    words = tl.load(req.masks + node.to(tl.int64) * req.W + cols // 32, mask=(cols >= 0) & (cols < req.V), other=0)
    return ((words >> (cols % 32)) & 1) != 0


@triton.jit
def _kept(req, node, cols, x, tau):
    """Raw values x (float32) of tokens `cols` of node's row, -inf where the node's processed law drops them:
    disallowed by its bitmask row, or (filtered) below the row's threshold tau. -inf and NaN stay as they are."""
    if req.W > 0:
        x = tl.where(_allowed(req, node, cols), x, NEG_INF)
    if req.filtered:
        x = tl.where(x < tau, NEG_INF, x)
    return x


@triton.jit
def _kept_pair(req, node, cols, a, b, tau_a, tau_b):
    """_kept of two rows of one node over the same tokens (its target and draft tiles), the bitmask read once."""
    if req.W > 0:
        allowed = _allowed(req, node, cols)
        a = tl.where(allowed, a, NEG_INF)
        b = tl.where(allowed, b, NEG_INF)
    if req.filtered:
        a = tl.where(a < tau_a, NEG_INF, a)
        b = tl.where(b < tau_b, NEG_INF, b)
    return a, b


@triton.jit
def _log_prob(req, row, node, x, tau, law):
    """log p(x) of token x in the node's row of law `law`, -inf for an x outside the vocabulary or dropped by
    the node's processed law."""
    raw = _values(req, node, x, _load_row(row + x, (x >= 0) & (x < req.V), req.probs))
    return _scaled(req, _kept(req, node, x, raw, tau), law) - law.lse


@triton.jit
def _first_child(req, node, after, match, T_BLOCK: tl.constexpr):
    """The first real child of `node` past index `after` where `match` holds (T_BLOCK: none)."""
    return tl.reduce(tl.where((req.par == node) & req.valid & match & (req.idx > after), req.idx, T_BLOCK), 0, _MIN)


@triton.jit
def _child(req, child):
    """The child's token and the u of its acceptance test."""
    here = req.idx == child
    return tl.reduce(tl.where(here, req.tok, 0), 0, _SUM), tl.reduce(tl.where(here, req.u_test, 0.0), 0, _SUM)


@triton.jit
def _uses_q(req, node, T_BLOCK: tl.constexpr):
    """Draft statistics are needed only at a sampling node that has children (a leaf's q is never used)."""
    return (~req.greedy) & (_first_child(req, node, -1, req.valid, T_BLOCK) < T_BLOCK)


@triton.jit
def _descend(req, child, depth):
    """Accept `child`: the next node of the path (written by chunk 0). Returns the new depth."""
    depth += 1
    tl.store(req.path + depth, child, mask=req.writer)
    return depth


@triton.jit
def _emit(req, depth, token, mask):
    """The request's outputs: `depth` accepted nodes, then `token`; token 0 when bad input (a row without a
    finite logit, NaN) left no token in [0, V), as in the reference: never an out-of-range id."""
    tl.store(req.out_num, depth, mask=mask)
    tl.store(req.out_next, tl.where((token >= 0) & (token < req.V), token, 0).to(tl.int64), mask=mask)
