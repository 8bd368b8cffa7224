"""Passes over a node's rows: one chunk's (`_chunk_pass`, a split launch's program) or the whole row's
(`_row_pass`, the walker), and the draw: its first level (`_pick_chunk`: a chunk by its residual mass), its second
(`_locate`: that chunk's scan), and the candidates after a last rejection with draft logits (`_first_accepted`)."""
from __future__ import annotations

import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _elementwise_max as _MAX
from triton.language.standard import _elementwise_min as _MIN
from triton.language.standard import _sum_combine as _SUM

from .records import (
    CANDIDATE, CANDIDATE_TOKEN, Chunks, DONE, INT_MAX, NEG_INF, STATS, U_CANDIDATE, ZPASS, _part_records, _updated)
from .rows import (
    _emit, _kept, _kept_pair, _lane_lse, _load_row, _log_prob, _merge_lse, _residual, _rows, _scaled, _target_values,
    _uniform_pair, _uses_q, _values)


@triton.jit
def _bounds(req, s, SPLIT_V: tl.constexpr):
    """Vocab entries [lo, hi) of chunk s."""
    lo = s * SPLIT_V
    return lo, tl.minimum(lo + SPLIT_V, req.V)


# Prefetch: the next PREFETCH (1 or 2) tiles' loads are in flight while a tile is folded in (the compiler
# does not pipeline loads that feed no dot): `_prefetch` issues them before the loop, `_next_tile` hands out
# the oldest and issues the one PREFETCH tiles ahead.
@triton.jit
def _prefetch(row, lo, hi, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr, PROBS: tl.constexpr):
    cols = lo + tl.arange(0, BLOCK_V)
    tile_next = _load_row(row + cols, cols < hi, PROBS)
    tile_later = tile_next
    if PREFETCH == 2:
        tile_later = _load_row(row + cols + BLOCK_V, cols + BLOCK_V < hi, PROBS)
    return tile_next, tile_later


@triton.jit
def _next_tile(row, start, hi, tile_next, tile_later, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr,
               PROBS: tl.constexpr):
    # (a scalar base and a tile-shaped offset: a tile of 64-bit addresses live across the walker's loop costs
    # registers, which the filtered walker has too few of)
    ahead = start + PREFETCH * BLOCK_V
    ar = tl.arange(0, BLOCK_V)
    new = _load_row(row + ahead + ar, ar < hi - ahead, PROBS)
    tile = tile_next
    if PREFETCH == 2:
        tile_next = tile_later
        tile_later = new
    else:
        tile_next = new
    return tile, tile_next, tile_later


@triton.jit
def _chunk_pass(req, walk, s, use_q, HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr,
                PREFETCH: tl.constexpr):
    """Pass walk.kind over chunk s of the node's rows, as a `Chunks` of scalars. STATS: (raw max M,
    sum exp((. - M) / t)) of target (greedy: the max alone) and, where `use_q`, of draft, and the chunk's first
    argmax of target;
    ZPASS (draft logits only): the mass of the residual max(p - c q, 0). One loop streams the tiles for both
    passes (see below why)."""
    t_row, d_row = _rows(req, walk.node)
    lo, hi = _bounds(req, s, SPLIT_V)
    stats = (walk.kind == STATS) | (not HAS_DRAFT)  # (without draft logits every pass is a statistics pass)
    hi_q = tl.where((stats & use_q) | (walk.kind == ZPASS), hi, lo)
    ar = tl.arange(0, BLOCK_V)
    # per-lane accumulators over the tiles, one cross-lane reduction at the end
    m_p = tl.full([BLOCK_V], NEG_INF, tl.float32)
    s_p = tl.full([BLOCK_V], 0.0, tl.float32)
    m_q = m_p
    s_q = s_p
    best = tl.full([BLOCK_V], -1, tl.int32)
    a_next, a_later = _prefetch(t_row, lo, hi, BLOCK_V, PREFETCH, req.probs)
    b_next, b_later = a_next, a_later  # (the draft's tiles exist only with draft logits)
    if HAS_DRAFT:
        b_next, b_later = _prefetch(d_row, lo, hi_q, BLOCK_V, PREFETCH, req.probs)
    for start in range(lo, hi, BLOCK_V):
        a, a_next, a_later = _next_tile(t_row, start, hi, a_next, a_later, BLOCK_V, PREFETCH, req.probs)
        b = a
        if HAS_DRAFT:
            b, b_next, b_later = _next_tile(d_row, start, hi_q, b_next, b_later, BLOCK_V, PREFETCH, req.probs)
        a = _target_values(req, walk.node, start + ar, a)
        if HAS_DRAFT:
            b = _values(req, walk.node, start + ar, b)
        else:
            b = a
        a, b = _kept_pair(req, walk.node, start + ar, a, b, walk.tau_p, walk.tau_q)
        if stats:  # on raw values (scaled inside the fold: a max / t may overflow)
            best = tl.where(a > m_p, start + ar, best)  # strictly greater: a lane keeps its first maximum
            if req.greedy:  # the argmax alone: no exp
                m_p = tl.maximum(m_p, a)
            else:
                m_p, s_p = _lane_lse(m_p, s_p, a, req.inv_t)
            if HAS_DRAFT:
                m_q, s_q = _lane_lse(m_q, s_q, b, req.inv_t)
        elif HAS_DRAFT:  # ZPASS: the residual's per-lane sums, in the accumulator of target's sums
            s_p += _residual(_scaled(req, a, walk.law_p), _scaled(req, b, walk.law_q), walk.law_p, walk.law_q, walk.c,
                             True)
    if not stats:
        m_p = tl.full([BLOCK_V], 0.0, tl.float32)  # the residual's sums merge against max 0: a plain sum
    max_p, sum_p = _merge_lse(m_p, s_p, req.inv_t)
    max_q, sum_q = _merge_lse(m_q, s_q, req.inv_t)
    argmax = tl.reduce(tl.where((m_p == max_p) & (best >= 0), best, INT_MAX), 0, _MIN)
    return Chunks(max_p=max_p, sum_p=sum_p, max_q=max_q, sum_q=sum_q, argmax=tl.where(argmax == INT_MAX, -1, argmax),
                  mass=sum_p)


@triton.jit
def _row_pass(req, walk, HAS_DRAFT: tl.constexpr, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
              SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """The walker's whole-row pass walk.kind: every chunk's pass in turn, as the `Chunks` the split launches'
    partials hold (so that the merge is the same)."""
    sidx = tl.arange(0, S_BLOCK)
    max_p = tl.full((S_BLOCK,), NEG_INF, tl.float32)
    sum_p = tl.full((S_BLOCK,), 0.0, tl.float32)
    max_q = max_p
    sum_q = sum_p
    argmax = tl.full((S_BLOCK,), -1, tl.int32)
    mass = sum_p
    use_q = _uses_q(req, walk.node, T_BLOCK)
    for s in range(NUM_SPLITS):
        chunk = _chunk_pass(req, walk, s, use_q, HAS_DRAFT, SPLIT_V, BLOCK_V, PREFETCH)
        here = sidx == s
        max_p = tl.where(here, chunk.max_p, max_p)
        sum_p = tl.where(here, chunk.sum_p, sum_p)
        max_q = tl.where(here, chunk.max_q, max_q)
        sum_q = tl.where(here, chunk.sum_q, sum_q)
        argmax = tl.where(here, chunk.argmax, argmax)
        mass = tl.where(here, chunk.mass, mass)
    return Chunks(max_p, sum_p, max_q, sum_q, argmax, mass)


@triton.jit
def _clamped(mass, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Chunk masses as the draw weighs them: >= 0, none past the last chunk."""
    return tl.where(tl.arange(0, S_BLOCK) < NUM_SPLITS, tl.maximum(mass, 0.0), 0.0)


@triton.jit
def _pick_chunk(mass, u, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """The draw's first level: the chunk holding u * (total mass), and the threshold inside it."""
    sidx = tl.arange(0, S_BLOCK)
    mass = _clamped(mass, NUM_SPLITS, S_BLOCK)
    total = tl.reduce(mass, 0, _SUM)
    run = tl.cumsum(mass, 0)
    target = u * total
    pick = tl.reduce(tl.where((run > target) & (mass > 0), sidx, S_BLOCK), 0, _MIN)
    last = tl.reduce(tl.where(mass > 0, sidx, -1), 0, _MAX)
    pick = tl.where(pick == S_BLOCK, tl.maximum(last, 0), pick)  # rounding left u * total past the sum
    return pick, target - tl.reduce(tl.where(sidx < pick, mass, 0.0), 0, _SUM)


@triton.jit
def _total_mass(mass, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """The total chunk mass the draw weighs."""
    return tl.reduce(_clamped(mass, NUM_SPLITS, S_BLOCK), 0, _SUM)


@triton.jit
def _tile(req, node, row, start, hi, ar):
    """`_values` of entries start + ar of one of node's rows, -inf past hi (hi = start: nothing is read)."""
    return _values(req, node, start + ar, _load_row(row + start + ar, start + ar < hi, req.probs))


@triton.jit
def _locate(req, node, pick, thresh, c, law_p, law_q, tau_p, tau_q, HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr,
            BLOCK_V: tl.constexpr):
    """The draw's second level: chunk `pick`'s scan, tile by tile until the running sum of the residual
    max(p - c q, 0) passes `thresh`: the first such entry (the last entry with r > 0 if rounding leaves the sum
    short). Given proposals skip the node's children's tokens unless c is FROM_P (a fallback that draws from p)."""
    t_row, d_row = _rows(req, node)
    lo, hi = _bounds(req, pick, SPLIT_V)
    ar = tl.arange(0, BLOCK_V)
    hi_q = tl.where(c > 0, hi, lo)  # q is needed only for a residual max(p - c q, 0) with c > 0
    token = tl.full((), -1, tl.int32)
    last = token
    acc = tl.full((), 0.0, tl.float32)  # the residual's running sum over the tiles scanned
    start = lo
    while (start < hi) & (token < 0):
        cols = start + ar
        a = _scaled(req, _kept(req, node, cols, _tile(req, node, t_row, start, hi, ar), tau_p), law_p)
        b = a
        if HAS_DRAFT:
            b = _scaled(req, _kept(req, node, cols, _tile(req, node, d_row, start, hi_q, ar), tau_q), law_q)
        r = _residual(a, b, law_p, law_q, c, HAS_DRAFT)
        if not HAS_DRAFT:
            if c >= 0:  # (not FROM_P)
                for j in range(node + 1, req.n_real):
                    is_child = tl.load(req.par_row + j) == node
                    r = tl.where(cols == tl.where(is_child, tl.load(req.tok_row + j), -1), 0.0, r)
        last = tl.maximum(last, tl.reduce(tl.where(r > 0, cols, -1), 0, _MAX))
        tile = tl.reduce(r, 0, _SUM)
        if acc + tile > thresh:
            run = tl.cumsum(r, 0) + acc
            token = tl.reduce(tl.where((run > thresh) & (r > 0), cols, INT_MAX), 0, _MIN)
            token = tl.where(token == INT_MAX, last, token)
        acc += tile
        start += BLOCK_V
    return tl.where(token < 0, last, token)


@triton.jit
def _candidate(req, walk, res, j, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """Candidate j of the draw from r = max(p - c q, 0) after a walk's last rejection: x drawn from the
    residual the merged pass left chunk masses of, r' = max(p - c' q, 0) (`res`; r <= r' as c > c'), by the
    two-level inverse transform, and accepted with probability r(x) / r'(x). Returns (accepted, x)."""
    u_x, u_ok = _uniform_pair(req.stream, walk.node, j + U_CANDIDATE)
    pick, thresh = _pick_chunk(res.mass, u_x, NUM_SPLITS, S_BLOCK)
    x = _locate(req, walk.node, pick, thresh, res.c, walk.law_p, walk.law_q, walk.tau_p, walk.tau_q, True, SPLIT_V,
                BLOCK_V)
    t_row, d_row = _rows(req, walk.node)
    p = tl.exp(_log_prob(req, t_row, walk.node, x, walk.tau_p, walk.law_p))
    q = tl.exp(_log_prob(req, d_row, walk.node, x, walk.tau_q, walk.law_q))
    return (x >= 0) & (u_ok * tl.maximum(p - res.c * q, 0.0) < tl.maximum(p - walk.c * q, 0.0)), x


@triton.jit
def _first_accepted(req, walk, res, j, step, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                    S_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, TRIALS: tl.constexpr):
    """Candidates j, j + step, ... < TRIALS in order until one is accepted: (its j, its token), or
    (TRIALS, -1). The walker tries them all (step 1); a split launch's program its share (step NUM_SPLITS)."""
    first = tl.full((), TRIALS, tl.int32)
    token = tl.full((), -1, tl.int32)
    while (j < TRIALS) & (first == TRIALS):
        ok, x = _candidate(req, walk, res, j, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V)
        if ok:
            first = j
            token = x
        j += step
    return first, token


@triton.jit
def _after_candidates(req, walk, first, token, TRIALS: tl.constexpr):
    """The first accepted candidate is the next token; if every one was rejected, the exact draw needs Z of
    the residual first."""
    kind = tl.full((), ZPASS, tl.int32)
    if first < TRIALS:
        _emit(req, walk.depth, token, req.writer)
        kind = tl.full((), DONE, tl.int32)
    return _updated(walk, kind=kind)


@triton.jit
def _merge_candidates(req, walk, part_f_ptr, part_i_ptr, buf, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr,
                      TRIALS: tl.constexpr):
    """The split launch's candidates: every program's first accepted one, the lowest j of all wins."""
    sidx = tl.arange(0, S_BLOCK)
    _, pi = _part_records(part_f_ptr, part_i_ptr, buf, sidx, NUM_SPLITS)
    have = sidx < NUM_SPLITS
    j = tl.load(pi + CANDIDATE, mask=have, other=TRIALS)
    first = tl.reduce(j, 0, _MIN)
    token = tl.reduce(tl.where(j == first, tl.load(pi + CANDIDATE_TOKEN, mask=have, other=INT_MAX), INT_MAX), 0, _MIN)
    return _after_candidates(req, walk, first, token, TRIALS)
