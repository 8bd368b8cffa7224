"""Top-k, top-p and min-p: a row's threshold, found by its own passes over the row (a `Search`).

Every kept set of the processed law is an upper set of the row's raw values (ties stay or go together), so
a row's law is softmax(x / t) over its allowed x >= tau: the walk needs one threshold per row and applies it
wherever it reads the row (`_kept`). At a filtered node the first statistics pass (sel 0) gives the raw max
M; min-p's threshold is closed-form from it (`_min_p_threshold`). Top-k and top-p are found by SELECT
passes over the node's rows (`_select_chunk`, decided by `_select_decide`), one `Search` per row: a pivot
pass counts the entries and sums their weights at NUM_PIVOTS pivots (geometric below M for a fresh range,
then evenly spaced in key space), which brackets the threshold between two pivots; once the bracket holds
at most CAP entries a gathering pass collects their values, and the threshold is decided exactly, pairwise,
by the definitions themselves (`_resolve`: fewer than k strictly larger values; mass of the strictly larger
values < top_p times what top-k keeps). No sort. The gathering also gives what the row keeps per chunk (the
weight above the bracket, plus the gathered values' above the threshold), so the node's law (log-sum-exp,
chunk masses) is known and its children are tested in the same decision (`_select_decide`); otherwise (min-p
alone, a threshold above the gathered bracket, a search that ended on pivots) a statistics pass through the
thresholds (sel 1) gives it. Then the walk goes on as without filters.
Reads of a filtered row: statistics, pivots, gathering (3); top-p after top-k is decided on the same
gathered values when the gathering covered [lo, +inf) (k <= CAP entries kept); min-p alone: statistics
twice. A bracket of more than CAP entries (ties of many values, or dense values) costs more pivot passes:
each divides its key range by NUM_PIVOTS, and a bracket of one value is the threshold itself.
Filter orders (FILTER_ORDER, `Request.order`) differ only in the set top-p's softmax is over (min-p's set
depends on the max alone and top-k's sets nest, so the kept set is always top-k's, top-p's and min-p's in
common): ORDER_HF, what top-k keeps (top-p's range starts at top-k's threshold); ORDER_VLLM, what min-p and
top-k keep (every SELECT pass reads the row below the thresholds found so far, min-p's first, as dropped:
`_select_row_chunk`'s floor); ORDER_SGLANG, the whole masked row (top-p's own search over it after top-k's,
`_top_p_floor`: a gathering cannot serve both).
Weights: exp((x - max x) / t) in float32, summed in float64 (the gathered values' in float64), so top-p's
comparisons are those of the float64 reference unless the mass sits within ~1e-7 (relative) of top_p."""
from __future__ import annotations

import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _elementwise_max as _MAX
from triton.language.standard import _elementwise_min as _MIN
from triton.language.standard import _sum_combine as _SUM

from .passes import _bounds
from .records import (
    FLT_LOWEST, GOAL_DONE, GOAL_K, GOAL_P, MODE_COMPACT, MODE_EVEN, MODE_FIRST, NEG_INF, ORDER_SGLANG, ORDER_VLLM,
    POS_INF, SELECT, STATS, Search, _updated)
from .rows import _kept, _load_row, _rows, _uses_q, _values


@triton.jit
def _key(x):
    """The order-preserving int32 key of a float32 (not NaN): x < y iff key(x) < key(y) (-0.0 just below 0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _from_key(key):
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _at(x, i, N: tl.constexpr):
    """Element i of a vector of N (finite values)."""
    return tl.reduce(tl.where(tl.arange(0, N) == i, x, 0), 0, _SUM)


@triton.jit
def _min_p_kept(v, m, t, log_min_p):
    return (v.to(tl.float64) - m) / t >= log_min_p


@triton.jit
def _min_p_threshold(req, m_x):
    """Min-p's threshold: the smallest float32 v with p(v) >= min_p * max p, i.e. (v - M) / t >= log(min_p)
    in float64 (M the raw max): the boundary rounded to float32, then moved to the exact float by key steps."""
    m = m_x.to(tl.float64)
    t = req.t.to(tl.float64)
    log_min_p = tl.log(req.min_p.to(tl.float64))
    key = _key((m + log_min_p * t).to(tl.float32))
    for _ in tl.static_range(2):  # (the rounding is within one float of the boundary)
        key = tl.where(_min_p_kept(_from_key(key), m, t, log_min_p), key, key + 1)
    for _ in tl.static_range(2):
        key = tl.where(_min_p_kept(_from_key(key - 1), m, t, log_min_p), key - 1, key)
    return _from_key(key)


@triton.jit
def _top_p_floor(req, tau_k):
    """Where top-p's search starts after top-k's threshold tau_k: tau_k (its softmax over the top-k set), the
    whole row for ORDER_SGLANG (over every masked token: top-p's set is intersected with top-k's afterwards)."""
    lo = tau_k
    if req.order == ORDER_SGLANG:
        lo = tl.full((), FLT_LOWEST, tl.float32)
    return lo


@triton.jit
def _idle_search():
    """A row without a search (goal done, no threshold)."""
    zero = tl.full((), 0, tl.int32)
    f = tl.full((), 0.0, tl.float32)
    d = tl.full((), 0.0, tl.float64)
    return Search(goal=zero + GOAL_DONE, mode=zero + MODE_FIRST, c_hi=zero, lo=f + FLT_LOWEST, hi=f + POS_INF,
                  tau=f + NEG_INF, m_x=f, f_hi=d, w=d - 1.0)


@triton.jit
def _new_search(req, m_x, on):
    """A row's search once the statistics pass gave its raw max m_x: min-p's threshold, and the goal top-k (if
    on), else top-p (if on), over the whole row. `on`: the row's law is used (no threshold for a row without a
    finite max: bad input, handled as without filters)."""
    on = on & (m_x > NEG_INF) & (m_x < POS_INF)
    srch = _idle_search()
    tau = srch.tau
    if req.min_p > 0.0:
        tau = _min_p_threshold(req, m_x)
    goal = tl.where(req.k > 0, GOAL_K, tl.where(req.top_p < 1.0, GOAL_P, GOAL_DONE))
    return Search(goal=tl.where(on, goal, GOAL_DONE).to(tl.int32), mode=srch.mode, c_hi=srch.c_hi, lo=srch.lo,
                  hi=srch.hi, tau=tl.where(on, tau, NEG_INF), m_x=m_x, f_hi=srch.f_hi, w=srch.w)


@triton.jit
def _after_search(walk, sp, sq):
    """SELECT while a row's search goes on, else statistics through the thresholds found (sel 1)."""
    done = (sp.goal == GOAL_DONE) & (sq.goal == GOAL_DONE)
    return _updated(walk, kind=tl.where(done, STATS, SELECT).to(tl.int32), sel=done.to(tl.int32), tau_p=sp.tau,
                    tau_q=sq.tau)


@triton.jit
def _start_search(req, walk, chunks, HAS_DRAFT: tl.constexpr, T_BLOCK: tl.constexpr):
    """After a filtered node's first statistics pass: a search per row (the draft's only where q is used)."""
    sp = _new_search(req, tl.reduce(chunks.max_p, 0, _MAX), True)
    sq = _idle_search()
    if HAS_DRAFT:
        sq = _new_search(req, tl.reduce(chunks.max_q, 0, _MAX), _uses_q(req, walk.node, T_BLOCK))
    return _after_search(walk, sp, sq), sp, sq


@triton.jit
def _pivots(req, srch, NUM_PIVOTS: tl.constexpr):
    """A pivot pass's pivots, ascending raw values, pivot 0 = lo: MODE_FIRST geometric below the max, from 16
    down to 1/8 nats of x / t (never below lo); MODE_EVEN evenly spaced keys over [lo, hi) (hi = +inf: up to
    the max)."""
    j = tl.arange(0, NUM_PIVOTS)
    nats = 0.125 * tl.exp2((NUM_PIVOTS - 1 - j).to(tl.float32) * (7.0 / (NUM_PIVOTS - 2)))
    geometric = tl.maximum(srch.lo, srch.m_x - nats * req.t)
    lo_key = _key(srch.lo).to(tl.int64)
    hi_key = tl.where(srch.hi == POS_INF, _key(srch.m_x).to(tl.int64) + 1, _key(srch.hi).to(tl.int64))
    even = _from_key((lo_key + (hi_key - lo_key) * j // NUM_PIVOTS).to(tl.int32))
    return tl.where(j == 0, srch.lo, tl.where(srch.mode == MODE_EVEN, even, geometric))


@triton.jit
def _select_row_chunk(req, node, row, srch, s, rec, sb, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
                      SPLIT_V: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    """One row's part of a SELECT pass over chunk s into partial record `rec`: the count and weight of its
    entries at or above each pivot, or (MODE_COMPACT) its values in [lo, hi), in index order, and the weight
    of those at or above hi (mass slot 0)."""
    lo, hi = _bounds(req, s, SPLIT_V)
    hi = tl.where(srch.goal == GOAL_DONE, lo, hi)  # (a row whose search is over is not read)
    pivots = _pivots(req, srch, NUM_PIVOTS)
    gather = srch.mode == MODE_COMPACT
    ar = tl.arange(0, SELECT_BLOCK)
    counts = tl.zeros([NUM_PIVOTS], tl.int32)
    masses = tl.zeros([NUM_PIVOTS], tl.float64)
    n = tl.full((), 0, tl.int32)
    values = sb.gathered + rec * CAP
    j = tl.arange(0, NUM_PIVOTS)
    floor = tl.full((), NEG_INF, tl.float32)
    if req.order == ORDER_VLLM:  # top-k and top-p see only what the thresholds so far keep (min-p's first)
        floor = srch.tau
    for start in range(lo, hi, SELECT_BLOCK):
        cols = start + ar
        x = _kept(req, node, cols, _values(req, node, cols, _load_row(row + cols, cols < hi, req.probs)), floor)
        weight = tl.exp((x - srch.m_x) * req.inv_t)
        if gather:
            inside = (x >= srch.lo) & (x < srch.hi)
            at = n + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.store(values + at, x, mask=inside & (at < CAP))
            n += tl.reduce(inside.to(tl.int32), 0, _SUM)
            above_hi = tl.reduce(tl.where(x >= srch.hi, weight, 0.0), 0, _SUM).to(tl.float64)
            masses += tl.where(j == 0, above_hi, 0.0)
        else:
            above = x[:, None] >= pivots[None, :]
            counts += tl.reduce(above.to(tl.int32), 0, _SUM)
            masses += tl.reduce(tl.where(above, weight[:, None], 0.0), 0, _SUM).to(tl.float64)
    tl.store(sb.pivot_counts + rec * NUM_PIVOTS + j, tl.where(gather, tl.where(j == 0, n, 0), counts))
    tl.store(sb.pivot_masses + rec * NUM_PIVOTS + j, masses)


@triton.jit
def _select_chunk(req, walk, sp, sq, s, sb, buf, HAS_DRAFT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, SPLIT_V: tl.constexpr, SELECT_BLOCK: tl.constexpr):
    """A SELECT pass over chunk s of the node's rows (partials in buffer `buf`)."""
    t_row, d_row = _rows(req, walk.node)
    rec = ((buf * tl.num_programs(0) + tl.program_id(0)) * NUM_SPLITS + s) * 2
    _select_row_chunk(req, walk.node, t_row, sp, s, rec, sb, NUM_PIVOTS, CAP, SPLIT_V, SELECT_BLOCK)
    if HAS_DRAFT:
        _select_row_chunk(req, walk.node, d_row, sq, s, rec + 1, sb, NUM_PIVOTS, CAP, SPLIT_V, SELECT_BLOCK)


@triton.jit
def _narrow(req, srch, recs, have, sb, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr):
    """After a pivot pass: the pivots' counts and masses (summed over the chunks in order) bracket the goal's
    threshold in [lo, hi) = [pivot j, pivot j + 1) (or the old hi): top-k at the highest pivot with count >= k,
    top-p at the highest with mass >= top_p * w. Next: gather [lo, +inf) if it holds at most CAP entries, else
    [lo, hi) if that does (with the count and mass above hi), else a bracket of one value is the threshold,
    else pivots over [lo, hi)."""
    j = tl.arange(0, NUM_PIVOTS)
    at = recs[:, None] * NUM_PIVOTS + j[None, :]
    counts = tl.reduce(tl.load(sb.pivot_counts + at, mask=have[:, None], other=0), 0, _SUM)
    masses = tl.reduce(tl.load(sb.pivot_masses + at, mask=have[:, None], other=0.0), 0, _SUM)
    pivots = _pivots(req, srch, NUM_PIVOTS)
    goal, mode, c_hi, lo, hi, tau, m_x, f_hi, w = srch
    if (goal == GOAL_K) & (_at(counts, 0, NUM_PIVOTS) < req.k):  # fewer than k finite entries: all kept
        goal = tl.where(req.top_p < 1.0, GOAL_P, GOAL_DONE).to(tl.int32)  # (top-p on the same pivots)
    if (goal == GOAL_P) & (mode == MODE_FIRST):  # a fresh top-p range [lo, +inf): w = what top-k keeps
        w = _at(masses, 0, NUM_PIVOTS)
    pick = tl.where(goal == GOAL_K, tl.reduce(tl.where(counts >= req.k, j, 0), 0, _MAX),
                    tl.reduce(tl.where(masses >= req.top_p * w, j, 0), 0, _MAX))
    top = pick == NUM_PIVOTS - 1
    new_lo = _at(pivots, pick, NUM_PIVOTS)
    new_hi = tl.where(top, hi, _at(pivots, pick + 1, NUM_PIVOTS))
    new_c_hi = tl.where(top, c_hi, _at(counts, pick + 1, NUM_PIVOTS))
    new_f_hi = tl.where(top, f_hi, _at(masses, pick + 1, NUM_PIVOTS))
    count = _at(counts, pick, NUM_PIVOTS)
    hi_key = tl.where(new_hi == POS_INF, _key(m_x).to(tl.int64) + 1, _key(new_hi).to(tl.int64))
    if goal != GOAL_DONE:
        if count <= CAP:
            mode = tl.full((), MODE_COMPACT, tl.int32)
            lo = new_lo
            hi = tl.full((), POS_INF, tl.float32)
            c_hi = tl.full((), 0, tl.int32)
            f_hi = tl.full((), 0.0, tl.float64)
        elif count - new_c_hi <= CAP:
            mode = tl.full((), MODE_COMPACT, tl.int32)
            lo = new_lo
            hi = new_hi
            c_hi = new_c_hi
            f_hi = new_f_hi
        elif hi_key - _key(new_lo).to(tl.int64) <= 1:  # one value: the threshold
            tau = tl.maximum(tau, new_lo)
            # (top-k's: top-p's search next, over [lo, +inf))
            goal = tl.where((goal == GOAL_K) & (req.top_p < 1.0), GOAL_P, GOAL_DONE).to(tl.int32)
            mode = tl.full((), MODE_FIRST, tl.int32)
            lo = _top_p_floor(req, new_lo)
            hi = tl.full((), POS_INF, tl.float32)
            c_hi = tl.full((), 0, tl.int32)
            f_hi = tl.full((), 0.0, tl.float64)
            w = tl.full((), -1.0, tl.float64)
        else:
            mode = tl.full((), MODE_EVEN, tl.int32)
            lo = new_lo
            hi = new_hi
            c_hi = new_c_hi
            f_hi = new_f_hi
    return Search(goal, mode, c_hi, lo, hi, tau, m_x, f_hi, w)


@triton.jit
def _gathered(sb, recs, starts, ends, total, g, CAP: tl.constexpr):
    """The gathered values at positions g of the concatenation of the chunks' (in order; -inf past total).
    (g runs along dim 1 here and in _resolve's sum: with it along dim 0 in one expression and dim 1 in another,
    the compiler computes the whole chain once per layout, and the walker spills.)"""
    owner = tl.reduce((ends[:, None] <= g[None, :]).to(tl.int32), 0, _SUM)  # the chunks that end at or before g
    mine = tl.arange(0, recs.shape[0])[:, None] == owner[None, :]
    first = tl.reduce(tl.where(mine, starts[:, None], 0), 0, _SUM)
    rec = tl.reduce(tl.where(mine, recs[:, None], 0), 0, _SUM)
    return tl.load(sb.gathered + rec * CAP + (g - first), mask=g < total, other=NEG_INF), owner


@triton.jit
def _resolve(req, srch, recs, have, sb, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, PAIR_BLOCK: tl.constexpr,
             S_BLOCK: tl.constexpr):
    """After a gathering pass: the goal's threshold from the gathered values x (all of [lo, hi)), pairwise.
    Top-k: the smallest x with c_hi + #{gathered > x} < k. Top-p: the smallest x with f_hi + the weight of the
    gathered values > x < top_p * w (none: hi). When top-k's gathering covered [lo, +inf), top-p is decided on
    the same values, with w their weight above top-k's threshold; else top-p's search starts over [tau_k, +inf).
    Also returns, when the search ends here with a threshold below hi, the weight the row keeps per chunk (that
    at or above hi, the gathering's, plus the gathered values' >= tau), and whether it does: the node's law
    without a statistics pass through the threshold."""
    n = tl.load(sb.pivot_counts + recs * NUM_PIVOTS, mask=have, other=0)
    ends = tl.cumsum(n, 0)
    starts = ends - n
    total = tl.reduce(n, 0, _SUM)
    g = tl.arange(0, CAP)
    x, owner = _gathered(sb, recs, starts, ends, total, g, CAP)
    weight = tl.where(g < total, tl.exp((x.to(tl.float64) - srch.m_x.to(tl.float64)) / req.t.to(tl.float64)), 0.0)
    goal, mode, c_hi, lo, hi, tau, m_x, f_hi, w = srch
    pair = tl.arange(0, PAIR_BLOCK)
    if goal == GOAL_K:
        tau_k = tl.full((), POS_INF, tl.float32)
        for i0 in range(0, total, PAIR_BLOCK):
            xi, _ = _gathered(sb, recs, starts, ends, total, i0 + pair, CAP)
            larger = tl.reduce((x[None, :] > xi[:, None]).to(tl.int32), 1, _SUM)
            kept = (i0 + pair < total) & (c_hi + larger < req.k)
            tau_k = tl.minimum(tau_k, tl.reduce(tl.where(kept, xi, POS_INF), 0, _MIN))
        tau = tl.maximum(tau, tau_k)
        goal = tl.where(req.top_p < 1.0, GOAL_P, GOAL_DONE).to(tl.int32)
        lo = _top_p_floor(req, tau_k)
        if (hi == POS_INF) & (req.order != ORDER_SGLANG):  # every value >= tau_k was gathered: top-p on them, below
            w = tl.reduce(tl.where(x >= tau_k, weight, 0.0), 0, _SUM)
        else:  # top-p's own search over [lo, +inf)
            mode = tl.full((), MODE_FIRST, tl.int32)
            hi = tl.full((), POS_INF, tl.float32)
            c_hi = tl.full((), 0, tl.int32)
            f_hi = tl.full((), 0.0, tl.float64)
            w = tl.full((), -1.0, tl.float64)
    if (goal == GOAL_P) & (mode == MODE_COMPACT):
        tau_p = hi
        for i0 in range(0, total, PAIR_BLOCK):
            xi, _ = _gathered(sb, recs, starts, ends, total, i0 + pair, CAP)
            heavier = tl.reduce(tl.where(x[None, :] > xi[:, None], weight[None, :], 0.0), 1, _SUM)
            kept = (i0 + pair < total) & (xi >= lo) & (f_hi + heavier < req.top_p * w)
            tau_p = tl.minimum(tau_p, tl.reduce(tl.where(kept, xi, POS_INF), 0, _MIN))
        tau = tl.maximum(tau, tau_p)
        goal = tl.full((), GOAL_DONE, tl.int32)
    exact = (goal == GOAL_DONE) & (tau < hi)
    sidx = tl.arange(0, S_BLOCK)
    kept = tl.load(sb.pivot_masses + recs * NUM_PIVOTS, mask=have, other=0.0)
    kept += tl.reduce(tl.where((owner[None, :] == sidx[:, None]) & (x[None, :] >= tau), weight[None, :], 0.0), 1, _SUM)
    return Search(goal, mode, c_hi, lo, hi, tau, m_x, f_hi, w), kept.to(tl.float32), exact


@triton.jit
def _select_step(req, srch, recs, have, sb, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                 S_BLOCK: tl.constexpr):
    """A row's search one step on: (the search, its kept weight per chunk, whether that is known)."""
    kept = tl.full((S_BLOCK,), 0.0, tl.float32)
    exact = srch.goal < 0  # (False)
    if srch.goal != GOAL_DONE:
        if srch.mode == MODE_COMPACT:
            srch, kept, exact = _resolve(req, srch, recs, have, sb, NUM_PIVOTS, CAP, PAIR_BLOCK, S_BLOCK)
        else:
            srch = _narrow(req, srch, recs, have, sb, NUM_PIVOTS, CAP)
    return srch, kept, exact
