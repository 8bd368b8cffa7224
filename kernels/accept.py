"""specdec.accept, backend="triton": greedy and exactly lossless rejection sampling over draft chains
and trees, fused from logits.

Shapes: target_logits (B, T, V) and draft_logits (B, T, V) or None (any float dtype, last dim
contiguous), tokens/parents (B, T) int32, temperature (B,) float32 (0 = greedy), seeds (B,) int64,
num_nodes (B,) int32, offset int >= 0 and offsets (B,) int or None (request b's stream offset is
offset + offsets[b], read on the device). Returns accepted_nodes (B, T) int32 (the path from node 0, padded
with -1), num_accepted (B,) int32, next_tokens (B,) int64. Semantics are those of reference.accept.

Algorithm (per request, walking from the root; p = softmax(target/t), q = softmax(draft/t)):
  * greedy: argmax of the node's target row (first index on ties); descend into the first child whose
    token matches, else emit the argmax.
  * draft logits (children i.i.d. from q), children tried in node order: accept x iff
    u * q(x) < r(x). After k rejections r = max(p - c_k q, 0) / Z_k with c_0 = 0, Z_0 = 1 and
    c_{k+1} = c_k + Z_k, Z_k = sum_x max(p - c_k q, 0): the normalized residual of the reference is
    recomputed elementwise from one scalar c, so each rejection costs one V-pass (for Z_k). The test
    uses the logit ratio rho = q/p = exp((l_q - lse_q) - (l_p - lse_p)): accept iff
    u * Z_k * rho < 1 - c_k * rho.
  * given proposals (no draft logits): accept x iff u * S_k < p(x) (x not already rejected), with the
    closed-form residual mass S_{k+1} = S_k - p(x); no extra pass.
  * the next token (correction or bonus) is drawn from the unnormalized final residual r (p at a leaf,
    p minus the rejected tokens for given proposals, max(p - c q, 0) after rejections with draft logits)
    by inverse transform with ONE uniform u per request: the last full pass (statistics, or Z after the
    last rejection) leaves each chunk's residual mass; the chunk holding u * sum(r) is found from those,
    and only the program of that chunk scans it (tile sums, then a cumulative sum inside one tile).
    Entries with -inf target logits or >= V have r = 0 and are never drawn.
  * after the LAST rejection with draft logits (a chain's rejected child, a node's last child) no Z is
    needed, only a draw from r = max(p - c q, 0): rejection sampling from the residual the merged pass
    already has chunk masses of, r' = max(p - c' q, 0) with c' < c (p itself after statistics): candidate
    j is drawn from r' by the two-level inverse transform (one chunk scanned, target only) and accepted
    with probability r(x) / r'(x) <= 1, i.e. with probability Z / Z' overall. Up to TRIALS candidates (in
    parallel over a split launch's programs, the first accepted one wins; in order in the walker: the
    same result), then the exact Z-pass draw as the fallback; a truncated rejection sampler followed by an
    exact one is exact. This replaces a second pass over both rows by a few chunk scans of one.
Only the rows of walked nodes are read (plus chunks of the last row for the draw); no softmax row is
materialized.

Cost per vocab entry (why this shape): every pass keeps per-lane running statistics (max, sum of exp
against the lane max, first argmax, residual sums) and reduces across lanes once per chunk, not once per
tile: a block-wide reduction costs barriers and shuffles that would otherwise dominate a memory-bound
pass. The draw needs no random number per vocab entry (an exponential race would need a Philox call and
two logs per entry, several times the instruction budget of a bf16 row read at HBM speed on an H200).

Randomness: Philox-4x32-10 (tl.philox) keyed by seeds[b], counters (index, word, 4 * (offset >> 31) +
STREAM_U, offset mod 2^31), with request b's offset = offset + offsets[b] (< 2^60): u of child i's test
is word 0 of (i, 0), u of the draw at node n is word 0 of (n, 1), candidate j's pair at node n words 0 and
1 of (n, 2 + j). A request's result therefore depends only on its own inputs, seed and offset, never on
the batch or the tiling.

Parallel schedule (the choice and why). A walk is a chain of dependent V-reductions (one per pass:
node statistics, Z_k), so one program per request streaming V leaves most of the GPU idle at B=64
(64 CTAs, each latency-bound at a fraction of its SM's bandwidth) and makes every request pay its
whole path serially. Instead each pass is split over the vocab: the row is cut into NUM_SPLITS chunks of
SPLIT_V entries, one program per (request, chunk) writes partial statistics, and the next launch merges
them and takes the decisions. Every program of a launch takes the same decisions redundantly (same
inputs, same merge order, so bit-identical results); chunk 0 alone writes the walk state and the path,
and the program whose chunk holds the drawn token writes the outputs; nothing waits on another program,
so there are no atomics, no spin locks and no host syncs. SPLIT_STEPS such launches run (grid
(B, NUM_SPLITS)), then one walker launch (grid (B,)) merges the last partials and finishes any walk
still running by looping over the same chunk passes itself. The walker merges its chunk results exactly
like the split launches do, so the result does not depend on SPLIT_STEPS (bit-identical on the
interpreter). A walk needs at most T + 1 launches (path nodes + rejections + the draw), so with
SPLIT_STEPS = T + 1 every pass runs at full width; requests that finished early exit at once.
Launch count: SPLIT_STEPS + 1 (fixed by shapes: CUDA-graph capturable).

Bytes floor (for the benchmark): sum_b (num_accepted[b] + 1) * V * (target itemsize + draft itemsize if
draft logits are given and temperature[b] > 0). Extra traffic over the floor: the draw's chunk scans of
the last target row (one, or one per candidate after a last rejection with draft logits), and a Z pass (a
re-read of the node's rows, partly from L2) after a rejection with more children to try, or when every
candidate was rejected.

Tunables (functions of T, V and the device only, never of B, so results are batch invariant):
BLOCK_V (tile), NUM_SPLITS, SPLIT_V = chunk size, SPLIT_STEPS, PREFETCH (tiles in flight ahead), num_warps;
see `_config`.
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

# pass kinds (walk state "kind": the pass to run next at the current node)
STATS = tl.constexpr(0)  # argmax (greedy) or log-sum-exp of target/draft rows (sampling)
ZPASS = tl.constexpr(1)  # Z_k = sum max(p - c q, 0) after a rejection with draft logits
LOCATE = tl.constexpr(2)  # the draw: the chosen chunk's scan for the token holding the threshold
DONE = tl.constexpr(3)
TRIAL = tl.constexpr(4)  # the draw after a last rejection with draft logits: candidates from the previous residual
STREAM_U = tl.constexpr(0)  # the Philox stream of every uniform
NEG_INF = tl.constexpr(float("-inf"))
INT_MAX = tl.constexpr(2147483647)


@triton.jit
def _uniform(seed, idx, word, off_lo, stream_base):
    """U[0, 1) (24 bits): word 0 of Philox(seed; idx, word, stream_base | U, off_lo)."""
    r, _, _, _ = tl.philox(seed, idx, word, stream_base + STREAM_U, off_lo)
    return (r >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _uniform_pair(seed, idx, word, off_lo, stream_base):
    """Two independent U[0, 1): words 0 and 1 of Philox(seed; idx, word, stream_base | U, off_lo)."""
    r0, r1, _, _ = tl.philox(seed, idx, word, stream_base + STREAM_U, off_lo)
    return (r0 >> 8).to(tl.float32) * 5.9604644775390625e-08, (r1 >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _lane_lse(m, s, x):
    """Fold x into per-lane (max, sum exp(. - max)) with one exp per entry; -inf entries add nothing."""
    t = tl.exp(-tl.abs(x - m))  # exp(min - max) of the pair; the max's own term is 1
    t = tl.where(x == NEG_INF, 0.0, t)
    up = x > m
    return tl.maximum(m, x), tl.where(up, s * t + 1.0, s + t)


@triton.jit
def _lanes_to_lse(m, s):
    """(max, sum exp(. - max)) of per-lane pairs."""
    mm = tl.reduce(m, 0, _MAX)
    return mm, tl.reduce(s * tl.exp(m - tl.where(mm == NEG_INF, 0.0, mm)), 0, _SUM)


@triton.jit
def _has_children(node, par, valid):
    """Whether `node` has a real child (par, valid: the request's parents and real-node mask)."""
    return tl.reduce(((par == node) & valid).to(tl.int32), 0, _MAX) > 0


@triton.jit
def _tile(row, start, hi, ar):
    """Entries start + ar of a row, -inf past hi (hi = start: nothing is read)."""
    return tl.load(row + start + ar, mask=start + ar < hi, other=float("-inf"))


@triton.jit
def _residual(a, b, lse_p, lse_q, c, HAS_DRAFT: tl.constexpr):
    """r = max(p - c q, 0) (p itself when c <= 0: q is not read then), from logits already divided by t."""
    p = tl.exp(a - lse_p)
    if HAS_DRAFT:
        p = tl.where(c > 0, tl.maximum(p - c * tl.exp(b - lse_q), 0.0), p)
    return p


@triton.jit
def _chunk_pass(kind, t_row, d_row, lo, hi, inv_t, greedy, use_q, lse_p, lse_q, c, HAS_DRAFT: tl.constexpr,
                BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr):
    """One STATS or ZPASS pass over vocab entries [lo, hi) of the current node's rows (PREFETCH: tiles in
    flight ahead of the one being folded in, 1 or 2).

    Returns (r0, r1, r2, r3, ri), merged across chunks by `_merge`:
      STATS: (max, sum exp(. - max)) of target/t in (r0, r1) (greedy: the max alone) and of draft/t in
             (r2, r3) when `use_q`, the first argmax of target in ri;
      ZPASS: (0, sum max(p - c q, 0)).
    """
    ar = tl.arange(0, BLOCK_V)
    zero = tl.zeros([BLOCK_V], tl.float32)
    # scalar conditions enter masks through the bound (the interpreter mis-types vector & scalar bools)
    hi_q = tl.where(((kind == STATS) & use_q) | (kind == ZPASS), hi, lo)
    ri = tl.full((), -1, tl.int32)
    # per-lane accumulators over the tiles, one cross-lane reduction at the end
    m_a = zero + float("-inf")
    s_a = zero
    m_b = m_a
    s_b = zero
    best_i = tl.full([BLOCK_V], -1, tl.int32)
    # prefetch: the next PREFETCH tiles' loads are in flight while this tile is folded in (the compiler
    # does not pipeline loads that feed no dot)
    a_next = _tile(t_row, lo, hi, ar)
    b_next = a_next  # (the draft's tiles exist only with draft logits)
    if HAS_DRAFT:
        b_next = _tile(d_row, lo, hi_q, ar)
    a_later = a_next
    b_later = b_next
    if PREFETCH == 2:
        a_later = _tile(t_row, lo + BLOCK_V, hi, ar)
        if HAS_DRAFT:
            b_later = _tile(d_row, lo + BLOCK_V, hi_q, ar)
    for start in range(lo, hi, BLOCK_V):
        cols = start + ar
        a = a_next.to(tl.float32) * inv_t
        b = a
        if HAS_DRAFT:
            b = b_next.to(tl.float32) * inv_t
        if PREFETCH == 2:
            a_next = a_later
            a_later = _tile(t_row, start + 2 * BLOCK_V, hi, ar)
            if HAS_DRAFT:
                b_next = b_later
                b_later = _tile(d_row, start + 2 * BLOCK_V, hi_q, ar)
        else:
            a_next = _tile(t_row, start + BLOCK_V, hi, ar)
            if HAS_DRAFT:
                b_next = _tile(d_row, start + BLOCK_V, hi_q, ar)
        if kind == STATS:
            best_i = tl.where(a > m_a, cols, best_i)  # strictly greater: a lane keeps its first maximum
            if greedy:  # the argmax alone: no exp
                m_a = tl.maximum(m_a, a)
            else:
                m_a, s_a = _lane_lse(m_a, s_a, a)
            if HAS_DRAFT:
                m_b, s_b = _lane_lse(m_b, s_b, b)
        else:  # ZPASS (only after a rejection with draft logits)
            s_a += _residual(a, b, lse_p, lse_q, c, HAS_DRAFT)
    if kind == ZPASS:
        m_a = zero  # a plain sum: merged like a log-sum-exp with a common max 0
    r0, r1 = _lanes_to_lse(m_a, s_a)
    r2, r3 = _lanes_to_lse(m_b, s_b)
    if kind == STATS:
        ri = tl.reduce(tl.where((m_a == r0) & (best_i >= 0), best_i, INT_MAX), 0, _MIN)
        ri = tl.where(ri == INT_MAX, -1, ri)
    return r0, r1, r2, r3, ri


@triton.jit
def _locate(t_row, d_row, lo, hi, inv_t, lse_p, lse_q, c, thresh, node, par_row, tok_row, n_real,
            HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr):
    """The draw's scan of one chunk [lo, hi), tile by tile until the residual's running sum passes `thresh`:
    the first such entry (the last entry with r > 0 if rounding leaves the sum short). Given proposals skip
    the rejected children's tokens unless c < 0 (a fallback that draws from p itself)."""
    ar = tl.arange(0, BLOCK_V)
    hi_q = tl.where(c > 0, hi, lo)  # q is needed only for a residual max(p - c q, 0) with c > 0
    token = tl.full((), -1, tl.int32)
    last = token
    acc = inv_t * 0.0  # the residual's running sum over the tiles scanned
    start = lo
    while (start < hi) & (token < 0):
        cols = start + ar
        a = _tile(t_row, start, hi, ar).to(tl.float32) * inv_t
        b = a
        if HAS_DRAFT:
            b = _tile(d_row, start, hi_q, ar).to(tl.float32) * inv_t
        r = _residual(a, b, lse_p, lse_q, c, HAS_DRAFT)
        if not HAS_DRAFT:
            if c >= 0:
                for j in range(node + 1, n_real):
                    is_child = tl.load(par_row + j) == node
                    r = tl.where(cols == tl.where(is_child, tl.load(tok_row + j), -1), 0.0, r)
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
def _merge(f0, f1, f2, f3, fi, S_BLOCK: tl.constexpr):
    """Merge per-chunk results (vectors over chunks, identity-padded) in chunk order."""
    sidx = tl.arange(0, S_BLOCK)
    m0, r1 = _lanes_to_lse(f0, f1)
    m2, r3 = _lanes_to_lse(f2, f3)
    first = tl.reduce(tl.where(f0 == m0, sidx, S_BLOCK), 0, _MIN)
    ri = tl.reduce(tl.where(sidx == first, fi, 0), 0, _SUM)
    return m0, r1, m2, r3, ri


@triton.jit
def _row_pass(kind, t_row, d_row, V, inv_t, greedy, use_q, lse_p, lse_q, c, HAS_DRAFT: tl.constexpr,
              NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, S_BLOCK: tl.constexpr,
              PREFETCH: tl.constexpr):
    """A whole-row STATS/ZPASS pass in one program: the chunk passes of every split, as per-chunk vectors
    (what the split launches' partials hold)."""
    sidx = tl.arange(0, S_BLOCK)
    f0 = tl.full((S_BLOCK,), NEG_INF, tl.float32)
    f1 = tl.full((S_BLOCK,), 0.0, tl.float32)
    f2 = f0
    f3 = f1
    fi = tl.full((S_BLOCK,), -1, tl.int32)
    for s in range(NUM_SPLITS):
        lo = s * SPLIT_V
        q0, q1, q2, q3, qi = _chunk_pass(kind, t_row, d_row, lo, tl.minimum(lo + SPLIT_V, V), inv_t, greedy, use_q,
                                         lse_p, lse_q, c, HAS_DRAFT, BLOCK_V, PREFETCH)
        here = sidx == s
        f0 = tl.where(here, q0, f0)
        f1 = tl.where(here, q1, f1)
        f2 = tl.where(here, q2, f2)
        f3 = tl.where(here, q3, f3)
        fi = tl.where(here, qi, fi)
    return f0, f1, f2, f3, fi


@triton.jit
def _draw(t_row, d_row, pick, thresh, V, inv_t, lse_p, lse_q, c, node, par_row, tok_row, n_real, depth, out_num,
          out_next, HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr):
    """The draw's second level: scan chunk `pick` for the token holding the threshold, then write the
    request's outputs."""
    lo = pick * SPLIT_V
    token = _locate(t_row, d_row, lo, tl.minimum(lo + SPLIT_V, V), inv_t, lse_p, lse_q, c, thresh, node, par_row,
                    tok_row, n_real, HAS_DRAFT, BLOCK_V)
    tl.store(out_num, depth)
    tl.store(out_next, token.to(tl.int64))


@triton.jit
def _pick_chunk(kind, f0, f1, lse_p, c, u, node, inv_t, par, tok, idx_t, valid, t_base, stride_tt, V,
                HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """The draw's first level, from the chunk partials of the pass just merged: the chunk holding
    u * (total residual mass), the threshold inside it, and the total. After a Z pass the partials are
    the residual masses; after statistics they give p's masses, minus (given proposals) the rejected
    children's tokens, each counted once."""
    sidx = tl.arange(0, S_BLOCK)
    if kind == ZPASS:
        mass = f1
    else:
        mass = f1 * tl.exp(f0 - lse_p)
        if not HAS_DRAFT:
            if c >= 0:
                child = (par == node) & valid
                dup = tl.reduce(((tok[:, None] == tok[None, :]) & child[None, :]
                                 & (idx_t[None, :] < idx_t[:, None])).to(tl.int32), 1, _MAX) > 0
                rejected = child & (dup == 0) & (tok >= 0) & (tok < V)
                lp = tl.load(t_base + node.to(tl.int64) * stride_tt + tok, mask=rejected, other=NEG_INF)
                p = tl.exp(lp.to(tl.float32) * inv_t - lse_p)
                owner = tok // SPLIT_V
                mass -= tl.reduce(tl.where(owner[:, None] == sidx[None, :], p[:, None], 0.0), 0, _SUM)
    mass = tl.where(sidx < NUM_SPLITS, tl.maximum(mass, 0.0), 0.0)
    total = tl.reduce(mass, 0, _SUM)
    run = tl.cumsum(mass, 0)
    target = u * total
    pick = tl.reduce(tl.where((run > target) & (mass > 0), sidx, S_BLOCK), 0, _MIN)
    last = tl.reduce(tl.where(mass > 0, sidx, -1), 0, _MAX)
    pick = tl.where(pick == S_BLOCK, tl.maximum(last, 0), pick)  # rounding left u * total past the sum
    before = tl.reduce(tl.where(sidx < pick, mass, 0.0), 0, _SUM)
    return pick, target - before, total


@triton.jit
def _trial(j, f0, f1, c_prev, c, node, inv_t, lse_p, lse_q, seed, off_lo, stream_base, t_row, d_row, par, tok, idx_t,
           valid, t_base, stride_tt, par_row, tok_row, n_real, V, HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr,
           NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Candidate j of the draw from r = max(p - c q, 0) after a walk's last rejection: x drawn from the residual
    the merged pass left chunk masses of, r' = max(p - c_prev q, 0) (p when c_prev = 0; r <= r' as c > c_prev),
    by the usual pick-a-chunk-then-scan-it inverse transform, and accepted with probability r(x) / r'(x).
    Returns (accepted, x)."""
    u_x, u_ok = _uniform_pair(seed, node, 2 + j, off_lo, stream_base)
    source = tl.where(c_prev > 0, ZPASS, STATS)
    pick, thresh, _ = _pick_chunk(source, f0, f1, lse_p, c_prev, u_x, node, inv_t, par, tok, idx_t, valid, t_base,
                                  stride_tt, V, HAS_DRAFT, SPLIT_V, NUM_SPLITS, S_BLOCK)
    lo = pick * SPLIT_V
    x = _locate(t_row, d_row, lo, tl.minimum(lo + SPLIT_V, V), inv_t, lse_p, lse_q, c_prev, thresh, node, par_row,
                tok_row, n_real, HAS_DRAFT, BLOCK_V)
    x_ok = x >= 0
    p = tl.exp(tl.load(t_row + x, mask=x_ok, other=NEG_INF).to(tl.float32) * inv_t - lse_p)
    q = tl.exp(tl.load(d_row + x, mask=x_ok, other=NEG_INF).to(tl.float32) * inv_t - lse_q)
    return x_ok & (u_ok * tl.maximum(p - c_prev * q, 0.0) < tl.maximum(p - c * q, 0.0)), x


@triton.jit
def _first_accepted(j0, step, f0, f1, c_prev, c, node, inv_t, lse_p, lse_q, seed, off_lo, stream_base, t_row, d_row,
                    par, tok, idx_t, valid, t_base, stride_tt, par_row, tok_row, n_real, V, HAS_DRAFT: tl.constexpr,
                    SPLIT_V: tl.constexpr, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
                    TRIALS: tl.constexpr):
    """Candidates j0, j0 + step, ... < TRIALS in order until one is accepted: (its j as a float, its token),
    or (+inf, -1). The walker tries them all (step 1); a split launch's program its share (step NUM_SPLITS)."""
    first = inv_t * 0.0 + float("inf")
    x_first = tl.full((), -1, tl.int32)
    j = j0
    while (j < TRIALS) & (first == float("inf")):
        ok, x = _trial(j, f0, f1, c_prev, c, node, inv_t, lse_p, lse_q, seed, off_lo, stream_base, t_row, d_row, par,
                       tok, idx_t, valid, t_base, stride_tt, par_row, tok_row, n_real, V, HAS_DRAFT, SPLIT_V,
                       NUM_SPLITS, S_BLOCK, BLOCK_V)
        if ok:
            first = j.to(tl.float32)
            x_first = x
        j += step
    return first, x_first


@triton.jit
def _advance(kind, node, depth, cursor, c, z, lse_p, lse_q, r0, r1, r2, r3, ri, f0, f1,
             greedy, inv_t, u_all, seed, off_lo, stream_base, par, tok, idx_t, valid, t_base, d_base, stride_tt,
             stride_dt, V, acc_row, out_num, out_next, writer, HAS_DRAFT: tl.constexpr, T_BLOCK: tl.constexpr,
             SPLIT_V: tl.constexpr, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Consume the result of the pass `kind` (merged r0..ri; per-chunk f0, f1) and walk on until the next
    pass is needed.

    State: kind (next pass), node, depth (its index on the path), cursor (last child tested at node),
    c and z (draft residual max(p - c q, 0) / z, or given-proposal residual mass z), lse_p/lse_q.
    Writes the accepted path, and for greedy walks the outputs (only where `writer`). A sampling walk
    ends with kind = LOCATE and (pick, thresh): the chunk of the draw and the threshold inside it, or, after
    a last rejection with draft logits, kind = TRIAL and c_prev: the residual the candidates come from.
    """
    pick = tl.full((), 0, tl.int32)
    c_prev = c
    thresh = inv_t * 0.0
    merged = kind
    testing = kind == ZPASS
    if kind == ZPASS:
        z = r1
    if kind == STATS:
        if greedy:
            match = tl.reduce(tl.where((par == node) & valid & (idx_t > node) & (tok == ri), idx_t, T_BLOCK), 0, _MIN)
            if match < T_BLOCK:
                depth += 1
                node = match
                tl.store(acc_row + depth, node, mask=writer)
            else:
                tl.store(out_num, depth, mask=writer)
                tl.store(out_next, ri.to(tl.int64), mask=writer)
                kind = tl.full((), DONE, tl.int32)
        else:
            lse_p = r0 + tl.log(r1)
            lse_q = r2 + tl.log(r3)
            c = inv_t * 0.0
            z = c + 1.0
            cursor = node
            testing = kind == kind
    while testing:
        child = tl.reduce(tl.where((par == node) & valid & (idx_t > cursor), idx_t, T_BLOCK), 0, _MIN)
        if child == T_BLOCK:  # every child rejected (or a leaf): the next token is drawn from the residual
            u = _uniform(seed, node, tl.full((), 1, tl.int32), off_lo, stream_base)
            pick, thresh, total = _pick_chunk(merged, f0, f1, lse_p, c, u, node, inv_t, par, tok, idx_t, valid,
                                              t_base, stride_tt, V, HAS_DRAFT, SPLIT_V, NUM_SPLITS, S_BLOCK)
            kind = tl.full((), LOCATE, tl.int32)
            if not total > 0:  # the residual rounded to zero (a rejection of probability ~0): draw from p
                if HAS_DRAFT:
                    c = inv_t * 0.0
                    kind = tl.full((), ZPASS, tl.int32)  # p's chunk masses, then the draw
                else:
                    c = inv_t * 0.0 - 1.0
                    pick, thresh, total = _pick_chunk(merged, f0, f1, lse_p, c, u, node, inv_t, par, tok, idx_t,
                                                      valid, t_base, stride_tt, V, HAS_DRAFT, SPLIT_V, NUM_SPLITS,
                                                      S_BLOCK)
            testing = kind != kind
        else:
            x = tl.reduce(tl.where(idx_t == child, tok, 0), 0, _SUM)
            u = tl.reduce(tl.where(idx_t == child, u_all, 0.0), 0, _SUM)
            x_ok = (x >= 0) & (x < V)
            lp = tl.load(t_base + node.to(tl.int64) * stride_tt + x, mask=x_ok, other=NEG_INF).to(tl.float32)
            lp = lp * inv_t - lse_p
            if HAS_DRAFT:
                lq = tl.load(d_base + node.to(tl.int64) * stride_dt + x, mask=x_ok, other=NEG_INF).to(tl.float32)
                rho = tl.exp(lq * inv_t - lse_q - tl.where(lp == NEG_INF, 0.0, lp))  # q(x) / p(x)
                ok = (lp > NEG_INF) & (u * z * rho < 1.0 - c * rho)
            else:
                p = tl.exp(lp)
                dup = tl.reduce(((par == node) & valid & (idx_t < child) & (tok == x)).to(tl.int32), 0, _MAX) > 0
                ok = (dup == 0) & (u * z < p)
            cursor = child
            if ok:
                depth += 1
                node = child
                tl.store(acc_row + depth, node, mask=writer)
                kind = tl.full((), STATS, tl.int32)
                c = inv_t * 0.0
                z = c + 1.0
                testing = kind != kind
            else:
                if HAS_DRAFT:  # the next child's test needs Z of the new residual; a last rejection only a draw
                    more = tl.reduce(((par == node) & valid & (idx_t > child)).to(tl.int32), 0, _MAX) > 0
                    c_prev = c
                    c = c + z
                    kind = tl.where(more, ZPASS, TRIAL).to(tl.int32)
                    testing = kind != kind
                else:
                    z = tl.where(dup, z, tl.maximum(z - p, 0.0))
    return kind, node, depth, cursor, c, z, lse_p, lse_q, pick, thresh, c_prev


@triton.jit(do_not_specialize=["offset_lo", "offset_hi", "read_buf", "write_buf"])
def _accept_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   acc_ptr, num_acc_ptr, next_ptr, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr,
                   B, T, V, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, read_buf, write_buf,
                   HAS_DRAFT: tl.constexpr, HAS_OFFSETS: tl.constexpr, IS_FIRST: tl.constexpr, WALK: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr,
                   T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, TRIALS: tl.constexpr):
    """Split launch (WALK=False, grid (B, NUM_SPLITS)): merge the previous launch's partials, decide,
    run this chunk of the next pass. Walker (WALK=True, grid (B,)): merge, decide, finish the walk."""
    b = tl.program_id(0)
    split = tl.program_id(1)  # 0 in the walker's 1-D grid
    writer = split == 0
    t = tl.load(temp_ptr + b)
    greedy = t == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, t)
    seed = tl.load(seeds_ptr + b)
    # the int offset arrives as two int32 words (one argument type for every value: a Python int in
    # [2^31, 2^32) would be typed uint32 and one above as int64)
    off = offset_hi.to(tl.int64) * 2147483648 + offset_lo.to(tl.int64)
    if HAS_OFFSETS:
        off += tl.load(offsets_ptr + b).to(tl.int64)
    off_lo = (off & 0x7FFFFFFF).to(tl.int32)  # the Philox counter words of this request's offset
    stream_base = (((off >> 31) & 0x1FFFFFFF) * 4).to(tl.int32)
    n_nodes = tl.load(num_nodes_ptr + b)
    idx_t = tl.arange(0, T_BLOCK)
    n_real = tl.minimum(n_nodes, T)
    valid = idx_t < n_real  # (paths only ascend: a walk ends even on unchecked input)
    par_row = parents_ptr + b * T
    tok_row = tokens_ptr + b * T
    par = tl.load(par_row + idx_t, mask=valid, other=-2)
    tok = tl.load(tok_row + idx_t, mask=valid, other=-1)
    # u of every node's acceptance test (node i is tested at most once), drawn up front in one call
    u_all = tl.full((T_BLOCK,), 0.0, tl.float32)
    if WALK or not IS_FIRST:  # launches that take decisions
        if t != 0.0:
            u_all = _uniform(seed, idx_t, tl.full((), 0, tl.int32), off_lo, stream_base)
    t_base = target_ptr + b.to(tl.int64) * stride_tb
    d_base = draft_ptr + b.to(tl.int64) * stride_db
    acc_row = acc_ptr + b * T
    sidx = tl.arange(0, S_BLOCK)
    pick = tl.full((), 0, tl.int32)
    thresh = inv_t * 0.0
    c_prev = thresh
    f0 = tl.full((S_BLOCK,), NEG_INF, tl.float32)  # the chunk partials of the last pass merged
    f1 = tl.full((S_BLOCK,), 0.0, tl.float32)

    if IS_FIRST:
        node = tl.full((), 0, tl.int32)
        kind = tl.full((), STATS, tl.int32)
        depth = node
        cursor = node
        c = inv_t * 0.0
        z = c + 1.0
        lse_p = c
        lse_q = c
        tl.store(acc_row + idx_t, tl.where(idx_t == 0, 0, -1), mask=idx_t < tl.where(writer, T, 0))
    else:
        s_i = state_i_ptr + (read_buf * B + b) * 4
        s_f = state_f_ptr + (read_buf * B + b) * 4
        kind = tl.load(s_i)
        node = tl.load(s_i + 1)
        depth = tl.load(s_i + 2)
        cursor = tl.load(s_i + 3)
        c = tl.load(s_f)
        z = tl.load(s_f + 1)
        lse_p = tl.load(s_f + 2)
        lse_q = tl.load(s_f + 3)
        if kind != DONE:
            part = (read_buf * B + b) * NUM_SPLITS + sidx
            have = sidx < NUM_SPLITS
            f0 = tl.load(part_f_ptr + part * 4, mask=have, other=NEG_INF)
            f1 = tl.load(part_f_ptr + part * 4 + 1, mask=have, other=0.0)
            f2 = tl.load(part_f_ptr + part * 4 + 2, mask=have, other=NEG_INF)
            f3 = tl.load(part_f_ptr + part * 4 + 3, mask=have, other=0.0)
            fi = tl.load(part_i_ptr + part, mask=have, other=-1)
            if kind == TRIAL:  # the programs' candidates: the first accepted one (lowest j) is the next token
                first = tl.reduce(tl.where(have, f0, float("inf")), 0, _MIN)
                if first < TRIALS:
                    tl.store(num_acc_ptr + b, depth, mask=writer)
                    tl.store(next_ptr + b, tl.reduce(tl.where(f0 == first, fi, INT_MAX), 0, _MIN).to(tl.int64),
                             mask=writer)
                    kind = tl.full((), DONE, tl.int32)
                else:  # every candidate rejected: Z of the residual, then the exact two-level draw
                    kind = tl.full((), ZPASS, tl.int32)
            else:
                r0, r1, r2, r3, ri = _merge(f0, f1, f2, f3, fi, S_BLOCK)
                kind, node, depth, cursor, c, z, lse_p, lse_q, pick, thresh, c_prev = _advance(
                    kind, node, depth, cursor, c, z, lse_p, lse_q, r0, r1, r2, r3, ri, f0, f1, greedy, inv_t, u_all,
                    seed, off_lo, stream_base, par, tok, idx_t, valid, t_base, d_base, stride_tt, stride_dt, V,
                    acc_row, num_acc_ptr + b, next_ptr + b, writer, HAS_DRAFT, T_BLOCK, SPLIT_V, NUM_SPLITS, S_BLOCK)
    # draft statistics are needed only at a sampling node that has children (a leaf's q is never used)
    use_q = (t != 0.0) & _has_children(node, par, valid)

    if WALK:
        while kind != DONE:
            t_row = t_base + node.to(tl.int64) * stride_tt
            d_row = d_base + node.to(tl.int64) * stride_dt
            if kind == LOCATE:
                _draw(t_row, d_row, pick, thresh, V, inv_t, lse_p, lse_q, c, node, par_row, tok_row, n_real, depth,
                      num_acc_ptr + b, next_ptr + b, HAS_DRAFT, SPLIT_V, BLOCK_V)
                kind = tl.full((), DONE, tl.int32)
            elif kind == TRIAL:  # candidates in order until one is accepted, else the Z pass
                first, x = _first_accepted(tl.full((), 0, tl.int32), 1, f0, f1, c_prev, c, node, inv_t, lse_p, lse_q,
                                           seed, off_lo, stream_base, t_row, d_row, par, tok, idx_t, valid, t_base,
                                           stride_tt, par_row, tok_row, n_real, V, HAS_DRAFT, SPLIT_V, NUM_SPLITS,
                                           S_BLOCK, BLOCK_V, TRIALS)
                if first < TRIALS:
                    tl.store(num_acc_ptr + b, depth)
                    tl.store(next_ptr + b, x.to(tl.int64))
                    kind = tl.full((), DONE, tl.int32)
                else:
                    kind = tl.full((), ZPASS, tl.int32)
            else:
                f0, f1, f2, f3, fi = _row_pass(kind, t_row, d_row, V, inv_t, greedy, use_q, lse_p, lse_q, c,
                                               HAS_DRAFT, NUM_SPLITS, SPLIT_V, BLOCK_V, S_BLOCK, PREFETCH)
                r0, r1, r2, r3, ri = _merge(f0, f1, f2, f3, fi, S_BLOCK)
                kind, node, depth, cursor, c, z, lse_p, lse_q, pick, thresh, c_prev = _advance(
                    kind, node, depth, cursor, c, z, lse_p, lse_q, r0, r1, r2, r3, ri, f0, f1, greedy, inv_t, u_all,
                    seed, off_lo, stream_base, par, tok, idx_t, valid, t_base, d_base, stride_tt, stride_dt, V,
                    acc_row, num_acc_ptr + b, next_ptr + b, writer, HAS_DRAFT, T_BLOCK, SPLIT_V, NUM_SPLITS, S_BLOCK)
                use_q = (t != 0.0) & _has_children(node, par, valid)
    else:
        w_i = state_i_ptr + (write_buf * B + b) * 4
        w_f = state_f_ptr + (write_buf * B + b) * 4
        tl.store(w_i, tl.where(kind == LOCATE, DONE, kind), mask=writer)  # the draw ends the walk here
        tl.store(w_i + 1, node, mask=writer)
        tl.store(w_i + 2, depth, mask=writer)
        tl.store(w_i + 3, cursor, mask=writer)
        tl.store(w_f, c, mask=writer)
        tl.store(w_f + 1, z, mask=writer)
        tl.store(w_f + 2, lse_p, mask=writer)
        tl.store(w_f + 3, lse_q, mask=writer)
        t_row = t_base + node.to(tl.int64) * stride_tt
        d_row = d_base + node.to(tl.int64) * stride_dt
        if kind == LOCATE:
            if split == pick:  # the program whose chunk holds the threshold draws and writes the outputs
                _draw(t_row, d_row, pick, thresh, V, inv_t, lse_p, lse_q, c, node, par_row, tok_row, n_real, depth,
                      num_acc_ptr + b, next_ptr + b, HAS_DRAFT, SPLIT_V, BLOCK_V)
        elif kind == TRIAL:  # candidates j = split, split + NUM_SPLITS, ...: this program's first accepted one
            first, x_first = _first_accepted(split, NUM_SPLITS, f0, f1, c_prev, c, node, inv_t, lse_p, lse_q, seed,
                                             off_lo, stream_base, t_row, d_row, par, tok, idx_t, valid, t_base,
                                             stride_tt, par_row, tok_row, n_real, V, HAS_DRAFT, SPLIT_V, NUM_SPLITS,
                                             S_BLOCK, BLOCK_V, TRIALS)
            part = ((write_buf * B + b) * NUM_SPLITS + split)
            tl.store(part_f_ptr + part * 4, first)
            tl.store(part_i_ptr + part, x_first)
        elif kind != DONE:
            lo = split * SPLIT_V
            r0, r1, r2, r3, ri = _chunk_pass(kind, t_row, d_row, lo, tl.minimum(lo + SPLIT_V, V), inv_t, greedy,
                                             use_q, lse_p, lse_q, c, HAS_DRAFT, BLOCK_V, PREFETCH)
            part = ((write_buf * B + b) * NUM_SPLITS + split)
            tl.store(part_f_ptr + part * 4, r0)
            tl.store(part_f_ptr + part * 4 + 1, r1)
            tl.store(part_f_ptr + part * 4 + 2, r2)
            tl.store(part_f_ptr + part * 4 + 3, r3)
            tl.store(part_i_ptr + part, ri)


# Candidates the draw after a last rejection with draft logits tries before it falls back to the Z pass: each
# costs a scan of (a prefix of) one chunk of the target row instead of a pass over both rows, and is accepted
# with probability Z (the total variation between target and draft), so 8 leave ~0.3% of the draws to the
# fallback at Z = 0.5 and ~17% at Z = 0.2. Not a function of the schedule: results stay schedule invariant.
TRIALS = 8


def _config(T: int, V: int, elem_bytes: int, device: torch.device) -> dict:
    """Tile sizes and schedule from shapes, logit width and device only (never B: results stay batch
    invariant).

    GPU: 2048-entry tiles over 8 warps (one 16-byte load per thread and row; the next tile prefetched,
    the next two for 16-bit logits so that a CTA keeps as many bytes in flight as with fp32;
    ptxas for sm_90 with triton 3.6: 105 registers in a split launch, no spills; the statistics loop is
    ~33 PTX instructions per vocab entry of a bf16 target + draft pair, no barrier or shuffle inside the
    loop), up to 16 chunks per row (V = 128K: 8192-entry chunks, 4 tiles each), every pass of a walk of
    up to 15 nodes in its own full-width launch. Untuned: to be set from the H200 benchmark (bench.sweep).
    Interpreter: 16-entry tiles so small test vocabularies span several tiles, one chunk and only the
    walker (cheapest; test_accept.py checks that the split schedules give identical results).
    """
    if device.type == "cuda":
        block_v = max(16, min(2048, triton.next_power_of_2(V)))
        num_splits = min(16, triton.cdiv(V, block_v))
        # a row of one chunk gains nothing from split launches: the walker alone, one launch
        return dict(block_v=block_v, num_splits=num_splits, split_steps=min(T + 1, 16) if num_splits > 1 else 0,
                    num_warps=8, prefetch=2 if elem_bytes <= 2 else 1, trials=TRIALS)
    return dict(block_v=16, num_splits=1, split_steps=0, num_warps=4, prefetch=1, trials=TRIALS)


def accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None, *,
           block_v=None, num_splits=None, split_steps=None, num_warps=None, prefetch=None, trials=None):
    """Normalized arguments of the `specdec::accept` schema (validated by specdec.ops.accept).

    Keyword tunables override `_config` (tests use them to compare schedules).
    """
    B, T, V = target_logits.shape
    dev = target_logits.device
    elem_bytes = max(target_logits.element_size(), 0 if draft_logits is None else draft_logits.element_size())
    cfg = _config(T, V, elem_bytes, dev)
    for name, value in (("block_v", block_v), ("num_splits", num_splits), ("split_steps", split_steps),
                        ("num_warps", num_warps), ("prefetch", prefetch), ("trials", trials)):
        if value is not None:
            cfg[name] = value
    accepted = torch.empty((B, T), dtype=torch.int32, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    next_tokens = torch.empty((B,), dtype=torch.int64, device=dev)
    if B == 0:
        return accepted, num_accepted, next_tokens
    target = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    draft = None if draft_logits is None else (draft_logits if draft_logits.stride(-1) == 1
                                               else draft_logits.contiguous())
    d = target if draft is None else draft
    S = cfg["num_splits"]
    if (cfg["block_v"] < 16 or cfg["block_v"] & (cfg["block_v"] - 1) or S < 1 or cfg["split_steps"] < 0
            or cfg["prefetch"] not in (1, 2) or cfg["trials"] < 0):
        raise ValueError(f"accept: invalid tunables {cfg} (block_v: a power of 2 >= 16, num_splits >= 1, "
                         "prefetch 1 or 2, trials >= 0)")
    split_v = triton.cdiv(triton.cdiv(V, S), cfg["block_v"]) * cfg["block_v"]
    state_i = torch.empty((2, B, 4), dtype=torch.int32, device=dev)
    state_f = torch.empty((2, B, 4), dtype=torch.float32, device=dev)
    part_f = torch.empty((2, B, S, 4), dtype=torch.float32, device=dev)
    part_i = torch.empty((2, B, S), dtype=torch.int32, device=dev)
    has_offsets = offsets is not None
    offsets = offsets.contiguous() if has_offsets else seeds  # absent: any int tensor stands in, never read
    args = (target, d, tokens.contiguous(), parents.contiguous(), temperature.contiguous(), seeds.contiguous(),
            num_nodes.contiguous(), offsets, accepted, num_accepted, next_tokens, state_i, state_f, part_f, part_i,
            B, T, V, target.stride(0), target.stride(1), d.stride(0), d.stride(1), offset & 0x7FFFFFFF, offset >> 31)
    meta = dict(HAS_DRAFT=draft is not None, HAS_OFFSETS=has_offsets, NUM_SPLITS=S, SPLIT_V=split_v,
                BLOCK_V=cfg["block_v"], T_BLOCK=triton.next_power_of_2(T), S_BLOCK=triton.next_power_of_2(S),
                PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"], num_warps=cfg["num_warps"])
    steps = cfg["split_steps"]
    for step in range(steps):
        _accept_kernel[(B, S)](*args, (step + 1) % 2, step % 2, IS_FIRST=step == 0, WALK=False, **meta)
    _accept_kernel[(B,)](*args, (steps + 1) % 2, steps % 2, IS_FIRST=steps == 0, WALK=True, **meta)
    return accepted, num_accepted, next_tokens
