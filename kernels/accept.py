"""specdec.accept, backend="triton": greedy and exactly lossless rejection sampling over draft chains
and trees, fused from logits.

Shapes: target_logits (B, T, V) and draft_logits (B, T, V) or None (any float dtype, computed in float32: float64
rows come shifted into its range, `_in_float32_range`; last dim contiguous), tokens/parents (B, T) int32,
temperature (B,) float32 (below GREEDY_BELOW, 1e-5: greedy), seeds (B,) int64, num_nodes (B,) int32, offset
int >= 0 and offsets (B,) int or None (request b's stream offset is offset + offsets[b], read on the device),
top_k / top_p / min_p (B,) or None and token_bitmask (B, T, ceil(V/32)) int32 or None (all applied in the
kernel: `_allowed`, and the "filters" section).
Returns accepted_nodes (B, T) int32 (the path from node 0, padded with -1), num_accepted (B,) int32,
next_tokens (B,) int64. Semantics are those of reference.accept.
Two switches of the input form (constexprs; everything below is unchanged by them):
  * PROBS: the rows hold probabilities (unnormalized, 0 = impossible), which mean what their logs mean as
    logits: each entry's log is taken in float32 as it is read (`_load_row`, then `_row_logits`; a masked lane
    reads 0, i.e. -inf), never a log of a whole row outside the kernel;
  * PACKED: target / draft rows (N, V) and token_bitmask (N, ceil(V/32)) are packed, node i of request b being
    row row_offsets[b] + i; tokens / parents / num_nodes arrive padded (B, T), T = max_nodes. Only the request's
    row bases change (`_request`); the launch still depends on B, T and V alone.

Algorithm (per request, walking from the root; p = softmax(target/t), q = softmax(draft/t), each over what the
node's processed law keeps: its bitmask row, and with filters the row's threshold, `_kept`):
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
  * method "block" (chains with draft logits): block verification (`_block_step`): every chain node's
    statistics, then (inner nodes) a Z pass with c = 1 / p_i, whose mass times p_i is S_i; the test of node
    i is u_i < h_i = S_i / (S_i + 1 - p_i) (h_gamma = p_gamma), the last node passing it is tau, and the next
    token is drawn from max(p - q / p_tau, 0) at tau (p at gamma), tau's rows read again if needed;
  * method "traversal" (trees with draft logits): traversal verification (`_traversal_step`), the reference's
    post-order visit: node v of weight w (the root: 1) has the law L = max(p - c q, 0) / Z (c = 0, Z = 1 after
    its statistics); child x gets w_x = min(w max(p(x) / q(x) - c, 0) / Z, 1) from two lookups, and an inner
    child with w_x > 0 is entered (v's c, Z, w, log-sum-exps, thresholds kept in v's node record while its
    subtree is walked); a leaf child is entered only when it emits (u_x < w_x). A child's failure updates v:
    c' = c + Z / w, one Z pass for Z' = Z(c'), S = (w / Z) Z', w' = S / (S + 1 - w) (w' = 0: v fails at once).
    After its last child v emits with probability w' (u_v < w'): the next token is drawn from max(p - c q, 0)
    (at a leaf p), the chunk masses from the pass just merged (an inner node's last Z pass, a leaf's
    statistics); else v fails to its parent. A node of weight 1 (the root) whose last child fails at once
    emits for sure: its draw takes the candidates (TRIAL) from the residual before, as token-wise does;
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
materialized. Traversal reads exactly: both rows of every inner node entered with weight > 0 (statistics,
then a Z pass per failed child; its draw's chunk scans when it emits), the emitting leaf's target row
(statistics, the draw's scan), and single entries of an entered node's rows at its children's tokens (the
weights); no draft row of a leaf, nothing of a node entered with weight 0, of a leaf that does not emit, or
of a node never reached.

Cost per vocab entry (why this shape): every pass keeps per-lane running statistics (max, sum of exp
against the lane max, first argmax, residual sums) and reduces across lanes once per chunk, not once per
tile: a block-wide reduction costs barriers and shuffles that would otherwise dominate a memory-bound
pass. The draw needs no random number per vocab entry (an exponential race would need a Philox call and
two logs per entry, several times the instruction budget of a bf16 row read at HBM speed on an H200).

Randomness: Philox-4x32-10 (tl.philox) keyed by seeds[b], counters (index, word, 4 * (offset >> 31) +
STREAM_U, offset mod 2^31), with request b's offset = offset + offsets[b] (< 2^60): u of child i's test
is word 0 of (i, U_TEST = 0) (block: node i's test; traversal: node i's emission decision, each node deciding
at most once), u of the draw at node n is word 0 of (n, U_DRAW = 1), candidate j's pair at node n words 0
and 1 of (n, U_CANDIDATE + j = 2 + j). A request's result therefore depends only on its own
inputs, seed and offset, never on the batch or the tiling.

Parallel schedule (the choice and why). A walk is a chain of dependent V-reductions (one per pass:
node statistics, Z_k), so one program per request streaming V leaves most of the GPU idle at B=64
(64 CTAs, each latency-bound at a fraction of its SM's bandwidth) and makes every request pay its
whole path serially. Instead each pass is split over the vocab: the row is cut into NUM_SPLITS chunks of
SPLIT_V entries, one program per (request, chunk) writes partial statistics, and the next launch merges
them and takes the decisions. Every program of a launch takes the same decisions redundantly (same
inputs, same merge order, so bit-identical results); chunk 0 alone writes the walk state and the path,
and the program whose chunk holds the drawn token writes the outputs; nothing waits on another program,
so there are no atomics, no spin locks and no host syncs. SPLIT_STEPS such launches of `_split_kernel`
run (grid (B, NUM_SPLITS)), then one launch of `_walk_kernel` (grid (B,)) merges the last partials and
finishes any walk still running by looping over the same chunk passes itself. The walker merges its chunk
results exactly like the split launches do, so the result does not depend on SPLIT_STEPS (bit-identical
on the interpreter). A walk needs at most T + 1 launches (path nodes + rejections + the draw), so with
SPLIT_STEPS = T + 1 every pass runs at full width; requests that finished early exit at once (block and
traversal walks take more passes: see `_config`).
Launch count: SPLIT_STEPS + 1 (fixed by shapes: CUDA-graph capturable).

Code layout. Both kernels start alike: `_request` gathers the request's read-only context (a `Request`),
`_resume` loads the walk state (a `Walk`; its kind is the step to run next) and merges and decides on the
partials the previous launch left (`_decide`). Then the split kernel stores the new state and runs its part
of the next step; the walker loops over whole-row passes (`_row_pass`), decisions and the draw
(`_draw_if_due`) until the walk is done. The kinds of step:
  STATS   `_chunk_pass`: (raw max M, sum exp((x - M) / t)) of target and draft per chunk, and the first argmax
          (a node's law is then a `RowLaw`: every value is scaled as (x - M) / t, never x / t, which overflows);
  ZPASS   `_chunk_pass`: the mass of the residual max(p - c q, 0) per chunk (draft logits only; traversal:
          after a failed child, or c = 0 for a draw from p after a residual of mass 0 by rounding, final 1);
  TRIAL   `_first_accepted`: the candidates after a last rejection (draft logits only);
  LOCATE  `_pick_chunk` + `_locate`: the draw's chunk and its scan;
  SELECT  `_select_chunk`: a top-k / top-p threshold search's pivot or gathering pass (filters only);
  DONE.
A decision (`_decide`) is the greedy step (`_greedy_step`) or, sampling, the node's fresh residual
(`_start_node`) or the Z just summed (`_after_z`) followed by the verifier: `_draft_verify` (one child's
test per pass, `_draft_accepts`), `_block_step`, `_traversal_step` (one child's visit or one node's update
per pass; node records `_push_node` / `_fail_to_parent`, each written by chunk 0 and read by every program)
or `_proposal_verify` (every child in one go, `_proposal_accepts`), which
ends in a descent (`_descend`), the next pass, or the draw from a `Residual` (chunk masses and c). Between
launches the state lives in records of named int slots (KIND, NODE, DEPTH, CURSOR) and float slots (C, Z,
LSE_P, LSE_Q), the partials in per-chunk records (MAX_P, SUM_P, MAX_Q, SUM_Q, MASS; ARGMAX, CANDIDATE,
CANDIDATE_TOKEN), double-buffered by launch parity (a launch reads one buffer while chunk 0 writes the
other); traversal's node records (B, T, the float slots) follow the state records, single-buffered
(`_push_node`). Context and state travel as named tuples (flattened by the compiler: free at run time).

Bytes floor (for the benchmark): sum_b (num_accepted[b] + 1) * V * (target itemsize + draft itemsize if
draft logits are given and temperature[b] > 0), plus V / 8 per walked row with a bitmask (traversal: the
rows above instead: V * (target + draft itemsize) per inner node entered with weight > 0, V * target
itemsize for an emitting leaf; its Z passes re-read entered rows, one per failed child). With top-k / top-p a
walked sampling row is read 3 times, not once (min-p alone: twice; see "filters"). Extra traffic
over the floor: the draw's chunk scans of the last target row (one, or one per candidate after a last
rejection with draft logits), and a Z pass (a re-read of the node's rows, partly from L2) after a rejection
with more children to try, or when every candidate was rejected.

Tunables (functions of T, V and the device only, never of B, so results are batch invariant):
BLOCK_V (tile), NUM_SPLITS, SPLIT_V = chunk size, SPLIT_STEPS, PREFETCH (tiles in flight ahead), num_warps;
see `_config`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _elementwise_max as _MAX
from triton.language.standard import _elementwise_min as _MIN
from triton.language.standard import _sum_combine as _SUM

from specdec.reference import GREEDY_BELOW as _GREEDY_BELOW

# walk kinds (state slot KIND: the step to run next at the current node)
STATS = tl.constexpr(0)  # argmax (greedy) or log-sum-exp of target/draft rows (sampling)
ZPASS = tl.constexpr(1)  # Z_k = sum max(p - c q, 0) after a rejection with draft logits
LOCATE = tl.constexpr(2)  # the draw: the chosen chunk's scan for the token holding the threshold
DONE = tl.constexpr(3)
TRIAL = tl.constexpr(4)  # the draw after a last rejection with draft logits: candidates from the previous residual
SELECT = tl.constexpr(5)  # top-k / top-p thresholds: a pivot or a gathering pass over the node's rows (`Search`)

# walk state records (2, B, slots), one slot per `Walk` field: int slots, then float slots
KIND = tl.constexpr(0)
NODE = tl.constexpr(1)
DEPTH = tl.constexpr(2)
CURSOR = tl.constexpr(3)
SEL = tl.constexpr(4)
TAU_NODE = tl.constexpr(5)
FINAL = tl.constexpr(6)
STATE_INTS = tl.constexpr(7)
C = tl.constexpr(0)
Z = tl.constexpr(1)
LSE_P = tl.constexpr(2)
LSE_Q = tl.constexpr(3)
TAU_P = tl.constexpr(4)
TAU_Q = tl.constexpr(5)
WEIGHT = tl.constexpr(6)
W_TAU = tl.constexpr(7)
SHIFT_P = tl.constexpr(8)
SHIFT_Q = tl.constexpr(9)
STATE_FLOATS = tl.constexpr(10)

# chunk partial records (2, B, NUM_SPLITS, slots): what a split launch's program leaves for the next launch
MAX_P = tl.constexpr(0)  # statistics: (raw max M, sum exp((. - M) / t)) of target and draft over the chunk
SUM_P = tl.constexpr(1)
MAX_Q = tl.constexpr(2)
SUM_Q = tl.constexpr(3)
MASS = tl.constexpr(4)  # Z pass: sum max(p - c q, 0) over the chunk
PART_FLOATS = tl.constexpr(5)
ARGMAX = tl.constexpr(0)  # statistics: the chunk's first argmax of target
CANDIDATE = tl.constexpr(1)  # candidates: the program's first accepted j (TRIALS: none)
CANDIDATE_TOKEN = tl.constexpr(2)  # and its token
PART_INTS = tl.constexpr(3)

GREEDY_BELOW = tl.constexpr(_GREEDY_BELOW)  # a temperature below it is greedy (specdec.reference.GREEDY_BELOW)
STREAM_U = tl.constexpr(0)  # the Philox stream of every uniform
U_TEST = tl.constexpr(0)  # Philox counter word 1: a child's test (counter 0: the child; traversal: its emission)
U_DRAW = tl.constexpr(1)  # the draw at a node (counter 0: the node)
U_CANDIDATE = tl.constexpr(2)  # + j: candidate j at a node
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
INT_MAX = tl.constexpr(2147483647)

# a row's threshold search (`Search`): the goal, then how the next pass over the row serves it
GOAL_DONE = tl.constexpr(0)  # threshold final (or no search)
GOAL_K = tl.constexpr(1)  # top-k's k-th largest value
GOAL_P = tl.constexpr(2)  # top-p's boundary over what top-k keeps
MODE_FIRST = tl.constexpr(0)  # count and mass at pivots geometric below the max (a fresh range [lo, +inf))
MODE_EVEN = tl.constexpr(1)  # count and mass at pivots evenly spaced in key space over [lo, hi)
MODE_COMPACT = tl.constexpr(2)  # gather the values in [lo, hi) (at most CAP of them)
# search records (2, B, 2 rows, slots): int slots, float slots, float64 slots
GOAL = tl.constexpr(0)
MODE = tl.constexpr(1)
C_HI = tl.constexpr(2)
SEARCH_INTS = tl.constexpr(3)
LO = tl.constexpr(0)
HI = tl.constexpr(1)
TAU = tl.constexpr(2)
M_X = tl.constexpr(3)
SEARCH_FLOATS = tl.constexpr(4)
F_HI = tl.constexpr(0)
W_K = tl.constexpr(1)
SEARCH_DOUBLES = tl.constexpr(2)
FLT_LOWEST = tl.constexpr(-3.4028234663852886e38)


class Stream(NamedTuple):
    """A request's Philox key and the counter words of its offset."""
    seed: tl.tensor
    off_lo: tl.tensor  # offset mod 2^31
    base: tl.tensor  # 4 * (offset >> 31)


class Request(NamedTuple):
    """What one program knows of its request, read-only."""
    greedy: tl.tensor  # temperature < GREEDY_BELOW (0 included)
    inv_t: tl.tensor  # 1 / temperature (<= 1e5; 1 when greedy)
    stream: Stream
    idx: tl.tensor  # node indices, (T_BLOCK,)
    valid: tl.tensor  # real nodes
    par: tl.tensor  # parents (-2 past the real nodes)
    tok: tl.tensor  # tokens (-1 past the real nodes)
    u_test: tl.tensor  # u of each node's acceptance test (a node is tested at most once)
    par_row: tl.tensor  # parents and tokens in memory (the draw's scan reads them one by one)
    tok_row: tl.tensor
    n_real: tl.tensor
    t_rows: tl.tensor  # the request's target and draft logits (row of node n at n * stride)
    d_rows: tl.tensor
    stride_tt: tl.tensor
    stride_dt: tl.tensor
    V: tl.tensor
    masks: tl.tensor  # the request's token_bitmask rows, W int32 words per node (W = 0: no bitmask)
    W: tl.tensor
    t: tl.tensor  # temperature (float32)
    k: tl.tensor  # top_k (on iff 0 < k < V), top_p (on iff < 1), min_p (on iff > 0)
    top_p: tl.tensor
    min_p: tl.tensor
    filtered: tl.tensor  # sampling with top-k, top-p or min-p on: rows are read through thresholds (`_kept`)
    path: tl.tensor  # its accepted_nodes row
    out_num: tl.tensor  # its num_accepted and next_tokens entries
    out_next: tl.tensor
    writer: tl.tensor  # chunk 0's program: writes the state and the path
    records: tl.tensor  # traversal: its node records (STATE_FLOATS float slots per node; see `_push_node`)
    # the launch's PROBS switch: the rows hold probabilities, read as their logs (`_load_row`, `_row_logits`).
    # A compile-time field rather than one more argument: every helper that reads a row has the request
    probs: tl.constexpr


class RowLaw(NamedTuple):
    """A sampling node's law of one row: p(x) = exp((x - shift) / t - lse), shift the row's largest kept raw value
    (0 when it keeps none) and lse the log-sum-exp of (x - shift) / t. Differences are scaled, never x / t itself:
    that overflows float32 for |x| > FLT_MAX * t, and the lse of a huge max / t would round the log-sum away (x - M
    overflows only to -inf, a weight of 0, which is exact)."""
    shift: tl.tensor
    lse: tl.tensor


class Walk(NamedTuple):
    """A walk's state (between launches: the state record's slots)."""
    kind: tl.tensor  # the step to run next at the node
    node: tl.tensor
    depth: tl.tensor  # the node's index on the path
    cursor: tl.tensor  # the last child tested at the node
    c: tl.tensor  # the residual is max(p - c q, 0) / z (given proposals: p minus the rejected tokens, of mass z)
    z: tl.tensor
    law_p: RowLaw  # the node's target and draft laws
    law_q: RowLaw
    sel: tl.tensor  # filtered: 0 until the node's thresholds are known, then 1 (statistics through them)
    tau_p: tl.tensor  # the thresholds of the node's target and draft rows: raw values below are dropped
    tau_q: tl.tensor
    w: tl.tensor  # block verification: the node's weight p_i, the last accepted node tau and its weight p_tau,
    tau_node: tl.tensor  # and the phase (0: walking the chain; 1-3: the draw at tau, see `_block_step`);
    # traversal: w the node's weight, final 1 for the draw from p after a residual of mass 0 (`_traversal_step`)
    w_tau: tl.tensor
    final: tl.tensor


class Chunks(NamedTuple):
    """A pass's partials: one chunk's (`_chunk_pass`) or vectors over the chunks (identity past NUM_SPLITS).
    STATS: max_p .. argmax (the raw maxima M of the kept values, and the sums of exp((x - M) / t)); ZPASS: mass."""
    max_p: tl.tensor
    sum_p: tl.tensor
    max_q: tl.tensor
    sum_q: tl.tensor
    argmax: tl.tensor
    mass: tl.tensor


class Search(NamedTuple):
    """One row's threshold search (top-k, then top-p over what top-k keeps; min-p is closed-form). The
    threshold lies in the bracket [lo, hi) of raw values, whose count and mass above hi are c_hi, f_hi
    (weights exp((x - m_x) / t)); each pass narrows it at NUM_PIVOTS pivots or gathers its values."""
    goal: tl.tensor
    mode: tl.tensor
    c_hi: tl.tensor
    lo: tl.tensor
    hi: tl.tensor
    tau: tl.tensor  # the threshold so far: the max of those found (min-p's from the start)
    m_x: tl.tensor  # the row's raw max
    f_hi: tl.tensor  # float64
    w: tl.tensor  # top-p: the mass top-k keeps (float64; < 0: unknown until the first pivot pass)


class Residual(NamedTuple):
    """What a draw picks its chunk from: the chunk masses of r = max(p - c q, 0) (given proposals: p minus
    the node's children's tokens, or p itself when c < 0)."""
    mass: tl.tensor
    c: tl.tensor


# ----------------------------------------------------------------------------------------------
# randomness and elementwise pieces
# ----------------------------------------------------------------------------------------------
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
def _target_values(x, greedy, PROBS: tl.constexpr):
    """`_row_logits` of a statistics pass's target tile. A greedy row of probabilities keeps them as they are
    (0 = impossible: -inf): its argmax is theirs, where a float32 log rounds probabilities an ulp apart to one
    value (the first of them won)."""
    x = x.to(tl.float32)
    if PROBS:
        x = tl.where(greedy, tl.where(x > 0.0, x, NEG_INF), tl.log(x))
    return x


# ----------------------------------------------------------------------------------------------
# the request, its tree and rows
# ----------------------------------------------------------------------------------------------
@triton.jit
def _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr, mask_ptr,
             row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr, state_f_ptr, T, V, W,
             stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, HAS_OFFSETS: tl.constexpr,
             HAS_FILTERS: tl.constexpr, PROBS: tl.constexpr, PACKED: tl.constexpr, T_BLOCK: tl.constexpr):
    """The `Request` of this program (request program_id(0))."""
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
                   records=state_f_ptr + (2 * tl.num_programs(0) + b * T).to(tl.int64) * STATE_FLOATS, probs=PROBS)


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
    raw = _row_logits(_load_row(row + x, (x >= 0) & (x < req.V), req.probs), req.probs)
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


# ----------------------------------------------------------------------------------------------
# walk state and chunk partials between launches
# ----------------------------------------------------------------------------------------------
@triton.jit
def _with_kind(walk, kind):
    """The walk with its next step changed."""
    return Walk(kind, walk.node, walk.depth, walk.cursor, walk.c, walk.z, walk.law_p, walk.law_q, walk.sel, walk.tau_p,
                walk.tau_q, walk.w, walk.tau_node, walk.w_tau, walk.final)


@triton.jit
def _start(req, T):
    """The walk at the root: statistics at node 0, the path [0, -1, ...] (written by chunk 0)."""
    tl.store(req.path + req.idx, tl.where(req.idx == 0, 0, -1), mask=req.idx < tl.where(req.writer, T, 0))
    root = tl.full((), 0, tl.int32)
    zero = tl.full((), 0.0, tl.float32)
    return Walk(kind=root + STATS, node=root, depth=root, cursor=root, c=zero, z=zero + 1.0,
                law_p=RowLaw(zero, zero), law_q=RowLaw(zero, zero),
                sel=root, tau_p=zero + NEG_INF, tau_q=zero + NEG_INF, w=zero + 1.0, tau_node=root, w_tau=zero + 1.0,
                final=root)


@triton.jit
def _load_state(state_i_ptr, state_f_ptr, buf):
    """Request program_id(0)'s state in buffer `buf`."""
    rec = buf * tl.num_programs(0) + tl.program_id(0)
    si = state_i_ptr + rec * STATE_INTS
    sf = state_f_ptr + rec * STATE_FLOATS
    return Walk(kind=tl.load(si + KIND), node=tl.load(si + NODE), depth=tl.load(si + DEPTH),
                cursor=tl.load(si + CURSOR), c=tl.load(sf + C), z=tl.load(sf + Z),
                law_p=RowLaw(tl.load(sf + SHIFT_P), tl.load(sf + LSE_P)),
                law_q=RowLaw(tl.load(sf + SHIFT_Q), tl.load(sf + LSE_Q)), sel=tl.load(si + SEL),
                tau_p=tl.load(sf + TAU_P), tau_q=tl.load(sf + TAU_Q),
                w=tl.load(sf + WEIGHT), tau_node=tl.load(si + TAU_NODE), w_tau=tl.load(sf + W_TAU),
                final=tl.load(si + FINAL))


@triton.jit
def _store_state(state_i_ptr, state_f_ptr, buf, walk, mask):
    """The state for the next launch: a draw (LOCATE) ends the walk in the launch that decides it."""
    rec = buf * tl.num_programs(0) + tl.program_id(0)
    si = state_i_ptr + rec * STATE_INTS
    sf = state_f_ptr + rec * STATE_FLOATS
    tl.store(si + KIND, tl.where(walk.kind == LOCATE, DONE, walk.kind), mask=mask)
    tl.store(si + NODE, walk.node, mask=mask)
    tl.store(si + DEPTH, walk.depth, mask=mask)
    tl.store(si + CURSOR, walk.cursor, mask=mask)
    tl.store(si + SEL, walk.sel, mask=mask)
    tl.store(sf + TAU_P, walk.tau_p, mask=mask)
    tl.store(sf + TAU_Q, walk.tau_q, mask=mask)
    tl.store(sf + WEIGHT, walk.w, mask=mask)
    tl.store(si + TAU_NODE, walk.tau_node, mask=mask)
    tl.store(sf + W_TAU, walk.w_tau, mask=mask)
    tl.store(si + FINAL, walk.final, mask=mask)
    tl.store(sf + C, walk.c, mask=mask)
    tl.store(sf + Z, walk.z, mask=mask)
    tl.store(sf + SHIFT_P, walk.law_p.shift, mask=mask)
    tl.store(sf + LSE_P, walk.law_p.lse, mask=mask)
    tl.store(sf + SHIFT_Q, walk.law_q.shift, mask=mask)
    tl.store(sf + LSE_Q, walk.law_q.lse, mask=mask)


@triton.jit
def _part_records(part_f_ptr, part_i_ptr, buf, split, NUM_SPLITS: tl.constexpr):
    """The partial records (float slots, int slots) of chunk(s) `split` of request program_id(0) in buffer
    `buf`."""
    rec = (buf * tl.num_programs(0) + tl.program_id(0)) * NUM_SPLITS + split
    return part_f_ptr + rec * PART_FLOATS, part_i_ptr + rec * PART_INTS


@triton.jit
def _load_chunks(part_f_ptr, part_i_ptr, buf, kind, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """The partials the previous launch's pass `kind` (STATS or ZPASS) left, as `Chunks`."""
    sidx = tl.arange(0, S_BLOCK)
    pf, pi = _part_records(part_f_ptr, part_i_ptr, buf, sidx, NUM_SPLITS)
    # scalar conditions enter masks through the bound (the interpreter mis-types vector & scalar bools)
    stats = sidx < tl.where(kind == STATS, NUM_SPLITS, 0)
    mass = sidx < tl.where(kind == ZPASS, NUM_SPLITS, 0)
    return Chunks(max_p=tl.load(pf + MAX_P, mask=stats, other=NEG_INF),
                  sum_p=tl.load(pf + SUM_P, mask=stats, other=0.0),
                  max_q=tl.load(pf + MAX_Q, mask=stats, other=NEG_INF),
                  sum_q=tl.load(pf + SUM_Q, mask=stats, other=0.0),
                  argmax=tl.load(pi + ARGMAX, mask=stats, other=-1),
                  mass=tl.load(pf + MASS, mask=mass, other=0.0))


# ----------------------------------------------------------------------------------------------
# passes over a chunk of a node's rows
# ----------------------------------------------------------------------------------------------
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
    # (a scalar base and a tile-shaped offset: with a tile of 64-bit addresses live across the walker's loop,
    # Triton 3.6's filtered walker spilled)
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
        a = _target_values(a, req.greedy, req.probs)
        b = _row_logits(b, req.probs)
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


# ----------------------------------------------------------------------------------------------
# the draw's first level: a chunk picked by its residual mass
# ----------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------
# decisions: merge a pass's partials and walk on until the next pass is needed
# ----------------------------------------------------------------------------------------------
@triton.jit
def _greedy_step(req, walk, chunks, T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
    """Greedy, after the statistics: descend into the first child whose token is the row's argmax (the
    first index on ties: the first chunk holding the max), else emit the argmax."""
    sidx = tl.arange(0, S_BLOCK)
    first = tl.reduce(tl.where(chunks.max_p == tl.reduce(chunks.max_p, 0, _MAX), sidx, S_BLOCK), 0, _MIN)
    argmax = tl.reduce(tl.where(sidx == first, chunks.argmax, 0), 0, _SUM)
    kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final = walk
    child = _first_child(req, node, node, req.tok == argmax, T_BLOCK)
    if child < T_BLOCK:
        depth = _descend(req, child, depth)
        node = child
    else:
        _emit(req, depth, argmax, req.writer)
        kind = tl.full((), DONE, tl.int32)
    return Walk(kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final)


@triton.jit
def _start_node(req, walk, chunks):
    """Sampling, after the statistics: the node's laws and its first residual r = p (c = 0, Z = 1), whose chunk
    masses a draw at a leaf uses."""
    max_p, sum_p = _merge_lse(chunks.max_p, chunks.sum_p, req.inv_t)
    max_q, sum_q = _merge_lse(chunks.max_q, chunks.sum_q, req.inv_t)
    law_p = RowLaw(_shift(max_p), tl.log(sum_p))
    zero = tl.full((), 0.0, tl.float32)
    # cursor = node: no child tested yet
    walk = Walk(walk.kind, walk.node, walk.depth, walk.node, zero, zero + 1.0, law_p,
                RowLaw(_shift(max_q), tl.log(sum_q)), walk.sel, walk.tau_p, walk.tau_q, walk.w, walk.tau_node,
                walk.w_tau, walk.final)
    return walk, Residual(chunks.sum_p * tl.exp(_scaled(req, chunks.max_p, law_p) - law_p.lse), zero)


@triton.jit
def _after_z(walk, chunks):
    """After a Z pass: Z of the residual r = max(p - c q, 0), and r's chunk masses."""
    kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final = walk
    z = tl.reduce(chunks.mass, 0, _SUM)
    return Walk(kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final), \
        Residual(chunks.mass, c)


@triton.jit
def _draft_accepts(req, node, x, u, c, z, law_p, law_q, tau_p, tau_q):
    """Draft logits: accept x iff u * q(x) < r(x) = max(p - c q, 0)(x) / z, on the logit ratio
    rho = q(x) / p(x): iff u * z * rho < 1 - c * rho (never an x with p(x) = 0)."""
    t_row, d_row = _rows(req, node)
    lp = _log_prob(req, t_row, node, x, tau_p, law_p)
    rho = tl.exp(_log_prob(req, d_row, node, x, tau_q, law_q) - tl.where(lp == NEG_INF, 0.0, lp))
    return (lp > NEG_INF) & (u * z * rho < 1.0 - c * rho)


@triton.jit
def _draft_verify(req, walk, res, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Draft logits (children i.i.d. from q), children in node order, one test per pass: the next child is
    accepted (descend: STATS), or rejected (the residual's c grows by its Z: the next child's test needs Z
    of the new residual, ZPASS; after the last child only a draw from it, TRIAL), or none is left (the draw
    from `res`, LOCATE)."""
    kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final = walk
    child = _first_child(req, node, cursor, req.valid, T_BLOCK)
    if child < T_BLOCK:
        cursor = child
        x, u = _child(req, child)
        if _draft_accepts(req, node, x, u, c, z, law_p, law_q, tau_p, tau_q):
            depth = _descend(req, child, depth)
            node = child
            kind = tl.full((), STATS, tl.int32)
            sel = tl.full((), 0, tl.int32)  # the child's thresholds are not known yet
            tau_p = tl.full((), NEG_INF, tl.float32)
            tau_q = tau_p
        else:  # the candidates draw from `res`, the residual before this rejection
            kind = tl.where(_first_child(req, node, child, req.valid, T_BLOCK) < T_BLOCK, ZPASS, TRIAL).to(tl.int32)
            c = c + z
    else:
        kind = tl.full((), LOCATE, tl.int32)
        if (not _total_mass(res.mass, NUM_SPLITS, S_BLOCK) > 0) & (c != 0.0):
            # the residual rounded to zero (a rejection of probability ~0): p's chunk masses, then the draw.
            # Once only: p's own masses (c = 0) that are not > 0 are bad input (NaN, or a row without a finite
            # logit); the draw then finds no token and the walk ends with token 0 (`_emit`).
            c = tl.full((), 0.0, tl.float32)
            kind = tl.full((), ZPASS, tl.int32)
    return Walk(kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final), res


@triton.jit
def _proposal_accepts(req, node, child, z, law_p, tau_p):
    """Given proposals: accept the child's token x iff u * z < p(x), never an x an earlier sibling proposed
    (already rejected). Returns (accepted, the residual mass z after a rejection)."""
    x, u = _child(req, child)
    t_row, _ = _rows(req, node)
    p = tl.exp(_log_prob(req, t_row, node, x, tau_p, law_p))
    dup = tl.reduce(((req.par == node) & req.valid & (req.idx < child) & (req.tok == x)).to(tl.int32), 0, _MAX) > 0
    return (dup == 0) & (u * z < p), tl.where(dup, z, tl.maximum(z - p, 0.0))


@triton.jit
def _rejected_masses(req, node, law_p, tau_p, SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr):
    """Given proposals, every child rejected: p of the node's distinct child tokens, summed per chunk."""
    child = (req.par == node) & req.valid
    dup = tl.reduce(((req.tok[:, None] == req.tok[None, :]) & child[None, :]
                     & (req.idx[None, :] < req.idx[:, None])).to(tl.int32), 1, _MAX) > 0
    rejected = child & (dup == 0) & (req.tok >= 0) & (req.tok < req.V)
    t_row, _ = _rows(req, node)
    raw = _row_logits(_load_row(t_row + req.tok, rejected, req.probs), req.probs)
    p = tl.exp(_scaled(req, _kept(req, node, req.tok, raw, tau_p), law_p) - law_p.lse)  # (a dropped token: p = 0)
    owner = req.tok // SPLIT_V
    return tl.reduce(tl.where(owner[:, None] == tl.arange(0, S_BLOCK)[None, :], p[:, None], 0.0), 0, _SUM)


@triton.jit
def _proposal_verify(req, walk, res, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                     S_BLOCK: tl.constexpr):
    """Given proposals (no draft logits): every child in node order in one go (the residual's mass is
    closed-form) until one is accepted (descend: STATS), else the draw (LOCATE) from p minus the rejected
    tokens, or from p itself (c = -1) when rounding left nothing of it."""
    kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final = walk
    accepted = tl.full((), T_BLOCK, tl.int32)
    child = _first_child(req, node, node, req.valid, T_BLOCK)
    while (child < T_BLOCK) & (accepted == T_BLOCK):
        ok, z = _proposal_accepts(req, node, child, z, law_p, tau_p)
        accepted = tl.where(ok, child, accepted)
        child = _first_child(req, node, child, req.valid, T_BLOCK)
    if accepted < T_BLOCK:
        depth = _descend(req, accepted, depth)
        node = accepted
        kind = tl.full((), STATS, tl.int32)
        sel = tl.full((), 0, tl.int32)  # the child's thresholds are not known yet
        tau_p = tl.full((), NEG_INF, tl.float32)
        tau_q = tau_p
    else:
        kind = tl.full((), LOCATE, tl.int32)
        mass = res.mass - _rejected_masses(req, node, law_p, tau_p, SPLIT_V, S_BLOCK)
        if _total_mass(mass, NUM_SPLITS, S_BLOCK) > 0:
            res = Residual(mass, c)
        else:
            c = tl.full((), -1.0, tl.float32)
            res = Residual(res.mass, c)
    return Walk(kind, node, depth, cursor, c, z, law_p, law_q, sel, tau_p, tau_q, w, tau_node, w_tau, final), res


# ----------------------------------------------------------------------------------------------
# filters: the thresholds of top-k, top-p and min-p (sampling requests with any of them on)
# ----------------------------------------------------------------------------------------------
# Every kept set of the processed law is an upper set of the row's raw values (ties stay or go together), so
# a row's law is softmax(x / t) over its allowed x >= tau: the walk needs one threshold per row and applies it
# wherever it reads the row (`_kept`). At a filtered node the first statistics pass (sel 0) gives the raw max
# M; min-p's threshold is closed-form from it (`_min_p_threshold`). Top-k and top-p are found by SELECT
# passes over the node's rows (`_select_chunk`, decided by `_select_decide`), one `Search` per row: a pivot
# pass counts the entries and sums their weights at NUM_PIVOTS pivots (geometric below M for a fresh range,
# then evenly spaced in key space), which brackets the threshold between two pivots; once the bracket holds
# at most CAP entries a gathering pass collects their values, and the threshold is decided exactly, pairwise,
# by the definitions themselves (`_resolve`: fewer than k strictly larger values; mass of the strictly larger
# values < top_p times what top-k keeps). No sort. The gathering also gives what the row keeps per chunk (the
# weight above the bracket, plus the gathered values' above the threshold), so the node's law (log-sum-exp,
# chunk masses) is known and its children are tested in the same decision (`_select_decide`); otherwise (min-p
# alone, a threshold above the gathered bracket, a search that ended on pivots) a statistics pass through the
# thresholds (sel 1) gives it. Then the walk goes on as without filters.
# Reads of a filtered row: statistics, pivots, gathering (3); top-p after top-k is decided on the same
# gathered values when the gathering covered [lo, +inf) (k <= CAP entries kept); min-p alone: statistics
# twice. A bracket of more than CAP entries (ties of many values, or dense values) costs more pivot passes:
# each divides its key range by NUM_PIVOTS, and a bracket of one value is the threshold itself.
# Weights: exp((x - max x) / t) in float32, summed in float64 (the gathered values' in float64), so top-p's
# comparisons are those of the float64 reference unless the mass sits within ~1e-7 (relative) of top_p.
class SelectBuffers(NamedTuple):
    """The searches' records (2, B, 2 rows, slots), double-buffered like the walk state, and a SELECT pass's
    partials (2, B, NUM_SPLITS, 2 rows, ...): the count and mass at each pivot (gathering: count slot 0 holds
    the number gathered), and the gathered values."""
    search_i: tl.tensor
    search_f: tl.tensor
    search_d: tl.tensor
    pivot_counts: tl.tensor  # (..., NUM_PIVOTS) int32
    pivot_masses: tl.tensor  # (..., NUM_PIVOTS) float64
    gathered: tl.tensor  # (..., CAP) float32


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
    return Walk(tl.where(done, STATS, SELECT).to(tl.int32), walk.node, walk.depth, walk.cursor, walk.c, walk.z,
                walk.law_p, walk.law_q, done.to(tl.int32), sp.tau, sq.tau, walk.w, walk.tau_node, walk.w_tau, walk.final)


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
    for start in range(lo, hi, SELECT_BLOCK):
        cols = start + ar
        x = _kept(req, node, cols, _row_logits(_load_row(row + cols, cols < hi, req.probs), req.probs), NEG_INF)
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
            lo = new_lo
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
    Triton 3.6 computed the whole chain once per layout, and the walker spilled.)"""
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
        lo = tau_k
        if hi == POS_INF:  # every value >= tau_k was gathered: top-p on them, below
            w = tl.reduce(tl.where(x >= tau_k, weight, 0.0), 0, _SUM)
        else:  # top-p's own search over [tau_k, +inf)
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
def _search_records(sb, buf, r):
    """Row r's search records of request program_id(0) in buffer `buf`."""
    rec = (buf * tl.num_programs(0) + tl.program_id(0)) * 2 + r
    return sb.search_i + rec * SEARCH_INTS, sb.search_f + rec * SEARCH_FLOATS, sb.search_d + rec * SEARCH_DOUBLES


@triton.jit
def _load_search(sb, buf, r):
    si, sf, sd = _search_records(sb, buf, r)
    return Search(goal=tl.load(si + GOAL), mode=tl.load(si + MODE), c_hi=tl.load(si + C_HI), lo=tl.load(sf + LO),
                  hi=tl.load(sf + HI), tau=tl.load(sf + TAU), m_x=tl.load(sf + M_X),
                  f_hi=tl.load(sd + F_HI), w=tl.load(sd + W_K))


@triton.jit
def _store_search(sb, buf, r, srch, mask):
    si, sf, sd = _search_records(sb, buf, r)
    tl.store(si + GOAL, srch.goal, mask=mask)
    tl.store(si + MODE, srch.mode, mask=mask)
    tl.store(si + C_HI, srch.c_hi, mask=mask)
    tl.store(sf + LO, srch.lo, mask=mask)
    tl.store(sf + HI, srch.hi, mask=mask)
    tl.store(sf + TAU, srch.tau, mask=mask)
    tl.store(sf + M_X, srch.m_x, mask=mask)
    tl.store(sd + F_HI, srch.f_hi, mask=mask)
    tl.store(sd + W_K, srch.w, mask=mask)


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


@triton.jit
def _select_decide(req, walk, sp, sq, sb, buf, HAS_DRAFT: tl.constexpr, BLOCK: tl.constexpr, TRAVERSAL: tl.constexpr,
                   T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr,
                   NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, PAIR_BLOCK: tl.constexpr):
    """After a SELECT pass (partials in buffer `buf`): each row's search one step on. When both end in this
    step on gathered values that give their kept weights, the node's law is known (log-sum-exp and chunk
    masses from those weights) and its children are tested at once; else the next pass: more searching, or
    statistics through the thresholds. Returns the walk, the `Residual` of a draw and the searches."""
    sidx = tl.arange(0, S_BLOCK)
    have = sidx < NUM_SPLITS
    recs = ((buf * tl.num_programs(0) + tl.program_id(0)) * NUM_SPLITS + sidx) * 2
    sp, kept_p, exact = _select_step(req, sp, recs, have, sb, NUM_PIVOTS, CAP, PAIR_BLOCK, S_BLOCK)
    kept_q = kept_p
    use_q = sp.goal < 0  # (False)
    if HAS_DRAFT:
        sq, kept_q, exact_q = _select_step(req, sq, recs + 1, have, sb, NUM_PIVOTS, CAP, PAIR_BLOCK, S_BLOCK)
        use_q = _uses_q(req, walk.node, T_BLOCK)
        exact = exact & (exact_q | (~use_q))
    walk = _after_search(walk, sp, sq)
    res = Residual(tl.full((S_BLOCK,), 0.0, tl.float32), walk.c)
    if (walk.kind == STATS) & exact:
        q_on = sidx < tl.where(use_q, NUM_SPLITS, 0)  # (a scalar condition through the bound, as in _load_chunks)
        chunks = Chunks(max_p=tl.where(have, sp.m_x, NEG_INF), sum_p=kept_p, max_q=tl.where(q_on, sq.m_x, NEG_INF),
                        sum_q=tl.where(q_on, kept_q, 0.0), argmax=tl.full((S_BLOCK,), -1, tl.int32), mass=kept_p * 0.0)
        walk, res = _verify(req, walk, chunks, HAS_DRAFT, BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
    return walk, res, sp, sq


@triton.jit
def _decide(req, walk, chunks, HAS_DRAFT: tl.constexpr, HAS_FILTERS: tl.constexpr, BLOCK: tl.constexpr,
            TRAVERSAL: tl.constexpr, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
            S_BLOCK: tl.constexpr):
    """Merge the partials of the pass walk.kind (STATS or ZPASS) and walk on until the next pass is needed.
    Returns the walk, the `Residual` a draw (LOCATE) or the candidates (TRIAL) pick from, and the rows'
    searches (a filtered node's first statistics start them: SELECT next)."""
    res = Residual(chunks.mass, walk.c)  # (a greedy walk never draws)
    sp = _idle_search()
    sq = sp
    if req.greedy:
        walk = _greedy_step(req, walk, chunks, T_BLOCK, S_BLOCK)
    else:
        searching = False
        if HAS_FILTERS:
            searching = req.filtered & (walk.kind == STATS) & (walk.sel == 0)
        if searching:
            walk, sp, sq = _start_search(req, walk, chunks, HAS_DRAFT, T_BLOCK)
        else:
            walk, res = _verify(req, walk, chunks, HAS_DRAFT, BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
    return walk, res, sp, sq


@triton.jit
def _walk_to(walk, kind, node, c, final):
    """The walk at another step: `kind` next at `node` (a new node: its thresholds not known yet), Z-pass c."""
    zero = tl.full((), 0, tl.int32)
    moved = node != walk.node
    return Walk(tl.full((), kind, tl.int32), node, walk.depth, walk.cursor, c, walk.z, walk.law_p, walk.law_q,
                tl.where(moved, zero, walk.sel), tl.where(moved, NEG_INF, walk.tau_p),
                tl.where(moved, NEG_INF, walk.tau_q), walk.w, walk.tau_node, walk.w_tau, zero + final)


@triton.jit
def _block_draw(req, walk, res):
    """The draw after block verification accepted nodes 1..tau of the chain (the walk at node tau, `res` the
    chunk masses of the law to draw from): the path is written, then LOCATE."""
    tau = walk.tau_node
    tl.store(req.path + req.idx, req.idx, mask=(req.idx >= 1) & (req.idx < tl.where(req.writer, tau + 1, 0)))
    walk = Walk(tl.full((), LOCATE, tl.int32), walk.node, tau, walk.cursor, res.c, walk.z, walk.law_p, walk.law_q,
                walk.sel, walk.tau_p, walk.tau_q, walk.w, tau, walk.w_tau, walk.final)
    return walk, res


@triton.jit
def _block_step(req, walk, res, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Block verification of the request's chain (Sun et al., arXiv 2403.10444, Algorithm 2; the reference's
    block_weights), one decision per pass. Walking (final 0), at node i after its statistics: i < gamma (not
    the root) needs S_i = sum max(p_i P_i - Q_i, 0) first: a Z pass with c = 1 / p_i gives S_i / p_i. Then
    h_i = S_i / (S_i + 1 - p_i) (h_gamma = p_gamma) and node i's test u_i < h_i makes i the last accepted node
    tau so far; the next weight p_{i+1} = min(p_i P_i(X_{i+1}) / Q_i(X_{i+1}), 1) from two lookups, and the walk
    moves to node i + 1, unless i = gamma or the weight is 0 (every later h is 0): then the draw at tau, from
    max(p_tau P_tau - Q_tau, 0) (tau = gamma: P_gamma), the Z-pass residual with c = 1 / p_tau. Back at an
    earlier tau (final 1: its statistics; 2: its residual's Z pass; 3: a residual of mass 0 by rounding, P
    itself) the rows of tau are read again."""
    gamma = req.n_real - 1
    i = walk.node
    if walk.final == 0:
        tested = (walk.kind == ZPASS) | (i == gamma)  # (node i's statistics first, then its Z pass if i < gamma)
        if (walk.kind == STATS) & (i > 0) & (i < gamma):
            walk = _walk_to(walk, ZPASS, i, 1.0 / walk.w, 0)
        else:
            w = walk.w
            tau_node = walk.tau_node
            w_tau = walk.w_tau
            if tested & (i > 0):
                s = w * walk.z
                h = tl.where(i == gamma, w, tl.where(s + 1.0 - w > 0, s / (s + 1.0 - w), 1.0))
                _, u = _child(req, i)
                if u < h:
                    tau_node = i
                    w_tau = w
            nxt = w * 0.0
            if i < gamma:
                x, _ = _child(req, i + 1)
                t_row, d_row = _rows(req, i)
                lp = _log_prob(req, t_row, i, x, walk.tau_p, walk.law_p)
                lq = _log_prob(req, d_row, i, x, walk.tau_q, walk.law_q)
                ratio = tl.where(lq == NEG_INF, tl.where(lp > NEG_INF, POS_INF, 0.0), tl.exp(lp - tl.where(lq == NEG_INF, 0.0, lq)))
                nxt = tl.where(w == 0.0, 0.0, tl.minimum(w * ratio, 1.0))
            walk = Walk(walk.kind, walk.node, walk.depth, walk.cursor, walk.c, walk.z, walk.law_p, walk.law_q, walk.sel,
                        walk.tau_p, walk.tau_q, nxt, tau_node, w_tau, walk.final)
            if nxt > 0.0:
                walk = _walk_to(walk, STATS, i + 1, 0.0, 0)
            elif tau_node == i:
                if i == gamma:  # the draw from P_gamma: its statistics' chunk masses
                    walk, res = _block_draw(req, walk, Residual(res.mass, 0.0 * res.c))
                elif walk.kind == ZPASS:  # the Z pass's residual is the draw's (S_i > 0: u_i < h_i)
                    walk, res = _block_draw(req, walk, res)
                else:  # tau = 0 at the root, after its statistics: max(P - Q, 0) needs its Z pass
                    walk = _walk_to(walk, ZPASS, i, 1.0 / w_tau, 2)
            else:
                walk = _walk_to(walk, STATS, tau_node, 0.0, 1)
    elif walk.final == 1:  # back at tau, its statistics done
        if walk.tau_node == gamma:
            walk, res = _block_draw(req, walk, Residual(res.mass, 0.0 * res.c))
        else:
            walk = _walk_to(walk, ZPASS, walk.node, 1.0 / walk.w_tau, 2)
    else:
        if (walk.final == 2) & (not _total_mass(res.mass, NUM_SPLITS, S_BLOCK) > 0):
            walk = _walk_to(walk, ZPASS, walk.node, 0.0, 3)  # (a residual of mass 0 by rounding: P itself)
        else:
            walk, res = _block_draw(req, walk, res)
    return walk, res


# ----------------------------------------------------------------------------------------------
# traversal verification of a tree (method "traversal", draft logits: `_traversal_step`)
# ----------------------------------------------------------------------------------------------
# The walk is the reference's post-order visit (`_traversal_verify`). At node v of weight w the current law
# is L = max(p - c q, 0) / Z(c), one scalar c as in the token-wise walk (c = 0, Z = 1 after the statistics):
# a failed child updates r = max(w L - q, 0) = (w / Z) max(p - c' q, 0) with c' = c + Z / w, so its mass is
# S = (w / Z) Z(c') (one Z pass over v's rows) and the new law is max(p - c' q, 0) / Z(c'). A visit descends
# into a child and may come back to v: v's state (c, Z, w, log-sum-exps, thresholds) is kept in v's node
# record while its subtree is walked, never recomputed.
@triton.jit
def _push_node(req, walk):
    """Node walk.node's record, before the walk enters one of its inner children (written by chunk 0).

    One record per node and request, not double-buffered: every program of a launch takes the same decisions,
    and in one decision a record is either written (entering a child) or read (a child's subtree failed),
    never both (a read is always followed by a Z pass), so no program reads a record another program of its
    launch writes. The barrier orders the walker's own loads of the record before this store."""
    rec = req.records + walk.node.to(tl.int64) * STATE_FLOATS
    tl.debug_barrier()
    tl.store(rec + C, walk.c, mask=req.writer)
    tl.store(rec + Z, walk.z, mask=req.writer)
    tl.store(rec + WEIGHT, walk.w, mask=req.writer)
    tl.store(rec + SHIFT_P, walk.law_p.shift, mask=req.writer)
    tl.store(rec + LSE_P, walk.law_p.lse, mask=req.writer)
    tl.store(rec + SHIFT_Q, walk.law_q.shift, mask=req.writer)
    tl.store(rec + LSE_Q, walk.law_q.lse, mask=req.writer)
    tl.store(rec + TAU_P, walk.tau_p, mask=req.writer)
    tl.store(rec + TAU_Q, walk.tau_q, mask=req.writer)


@triton.jit
def _child_weight(req, walk, x):
    """The weight of child token x at node v of weight w and law max(p - c q, 0) / Z (the reference's
    traversal_child_weight): min(w max(p(x) - c q(x), 0) / (Z q(x)), 1) = min(w max(p(x) / q(x) - c, 0) / Z, 1)
    on the logit ratio; 0 when the law has no mass at x (p(x) = 0, p(x) <= c q(x), or Z = 0), 1 when
    q(x) = 0 < p(x). Two lookups in v's rows."""
    t_row, d_row = _rows(req, walk.node)
    lp = _log_prob(req, t_row, walk.node, x, walk.tau_p, walk.law_p)
    lq = _log_prob(req, d_row, walk.node, x, walk.tau_q, walk.law_q)
    ratio = tl.exp(lp - tl.where(lq == NEG_INF, 0.0, lq))  # p(x) / q(x) (q(x) > 0)
    weight = tl.minimum(walk.w * tl.maximum(ratio - walk.c, 0.0) / tl.where(walk.z > 0, walk.z, 1.0), 1.0)
    weight = tl.where(lq == NEG_INF, 1.0, weight)
    return tl.where((lp == NEG_INF) | (not walk.z > 0) | (not walk.w > 0), 0.0, weight)


@triton.jit
def _after_failed_child(walk, child):
    """Node v after child's subtree failed: its law becomes max(p - c' q, 0) / Z(c'), c' = c + Z / w; the Z pass
    next (walk.z keeps Z(c) through it for the new weight, `_weight_after_z`). A law of mass 0 (Z = 0, only at a
    node of weight 1) stays as it is."""
    c = tl.where(walk.z > 0, walk.c + walk.z / walk.w, walk.c)
    return Walk(tl.full((), ZPASS, tl.int32), walk.node, walk.depth, child, c, walk.z, walk.law_p, walk.law_q, walk.sel,
                walk.tau_p, walk.tau_q, walk.w, walk.tau_node, walk.w_tau, walk.final)


@triton.jit
def _weight_after_z(walk, z_before):
    """After the Z pass of a failed child's update: S = (w / Z(c)) Z(c') and w' = S / (S + 1 - w) (1 when
    S + 1 - w = 0: the failure was impossible). 1 - w first, so that the root (w = 1) keeps w = 1 exactly."""
    w = walk.w
    s = tl.where(z_before > 0, w / tl.where(z_before > 0, z_before, 1.0) * walk.z, 0.0)
    den = s + (1.0 - w)
    # (w = 1 stays 1 exactly: on a GPU fp32 division is within 2 ulp, and s / s below 1 would take a weight-1 node's
    # last failed child off the direct draw, `_try_child`'s certain)
    w = tl.where(den > 0, tl.minimum(s / tl.where(den > 0, den, 1.0), 1.0), 1.0)
    w = tl.where((walk.w == 1.0) | (walk.node == 0), 1.0, w)  # (the root's weight is 1: its visit always emits)
    return Walk(walk.kind, walk.node, walk.depth, walk.cursor, walk.c, walk.z, walk.law_p, walk.law_q, walk.sel,
                walk.tau_p, walk.tau_q, w, walk.tau_node, walk.w_tau, walk.final)


@triton.jit
def _fail_to_parent(req, walk):
    """Node v's subtree failed (v is not the root): back at its parent, from the parent's record, v dropped from
    the path; the parent's update (`_after_failed_child`) follows."""
    here = req.idx == walk.node
    parent = tl.reduce(tl.where(here, req.par, 0), 0, _SUM)
    tl.store(req.path + walk.depth, -1, mask=req.writer)
    rec = req.records + parent.to(tl.int64) * STATE_FLOATS
    tl.debug_barrier()  # (the walker's own store of the record, `_push_node`, is visible)
    # (sel 1: the parent's thresholds are known)
    back = Walk(walk.kind, parent, walk.depth - 1, walk.cursor, tl.load(rec + C), tl.load(rec + Z),
                RowLaw(tl.load(rec + SHIFT_P), tl.load(rec + LSE_P)),
                RowLaw(tl.load(rec + SHIFT_Q), tl.load(rec + LSE_Q)), tl.full((), 1, tl.int32), tl.load(rec + TAU_P),
                tl.load(rec + TAU_Q), tl.load(rec + WEIGHT), walk.tau_node, walk.w_tau, walk.final)
    return _after_failed_child(back, walk.node)


@triton.jit
def _try_child(req, walk, child, T_BLOCK: tl.constexpr):
    """Visit child of node v (w > 0) with its weight w_c (`_child_weight`): an inner child is entered (v's record
    pushed; its statistics next), a leaf child only when it emits (u_child < w_c: its statistics, then the
    draw); else (w_c = 0, or a leaf that does not emit) the child fails at once, no row of it read, and v's
    update follows. When that was v's last child and w = 1 (the root, always), v's new weight is 1 whatever
    Z' is: no Z pass, the draw's candidates (TRIAL) from the residual just merged, as after a token-wise
    walk's last rejection (a star costs what token-wise costs)."""
    x, u = _child(req, child)
    w_c = _child_weight(req, walk, x)
    inner = _first_child(req, child, child, req.valid, T_BLOCK) < T_BLOCK
    if (w_c > 0) & (inner | (u < w_c)):
        if inner:
            _push_node(req, walk)
        depth = _descend(req, child, walk.depth)
        zero = tl.full((), 0.0, tl.float32)
        # the child's thresholds are not known yet (sel 0); cursor = node: no child of it tried yet
        walk = Walk(tl.full((), STATS, tl.int32), child, depth, child, zero, zero + 1.0, walk.law_p, walk.law_q,
                    tl.full((), 0, tl.int32), zero + NEG_INF, zero + NEG_INF, w_c, walk.tau_node, walk.w_tau,
                    walk.final)
    else:
        last = _first_child(req, walk.node, child, req.valid, T_BLOCK) == T_BLOCK
        certain = last & (walk.w == 1.0)  # (w' = S / (S + 1 - w) = 1)
        walk = _after_failed_child(walk, child)
        if certain:
            walk = _with_kind(walk, tl.full((), TRIAL, tl.int32))
    return walk


@triton.jit
def _traversal_step(req, walk, res, z_before, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    S_BLOCK: tl.constexpr):
    """Traversal verification (the reference's `_traversal_verify`), one decision per pass at node v: after
    its statistics (c = 0, Z = 1, w its weight), or after the Z pass of a failed child's update (z_before =
    Z(c) before it: w' from `_weight_after_z`; w' = 0 fails v at once). Then v's next child (`_try_child`), or
    after its last child v's emission: with probability w (u_v < w; the root always; a leaf is entered only
    when it emits) the draw from v's law, whose chunk masses `res` are those of the pass just merged (a leaf:
    p from its statistics; an inner node: its last Z pass); else v fails to its parent (`_fail_to_parent`).
    final 1: the draw from p after a residual of mass 0 by rounding (its Z pass with c = 0)."""
    v = walk.node
    if walk.final == 1:
        walk = _with_kind(walk, tl.full((), LOCATE, tl.int32))
    else:
        if walk.kind == ZPASS:
            walk = _weight_after_z(walk, z_before)
        if not walk.w > 0:
            walk = _fail_to_parent(req, walk)
        else:
            child = _first_child(req, v, walk.cursor, req.valid, T_BLOCK)
            if child < T_BLOCK:
                walk = _try_child(req, walk, child, T_BLOCK)
            else:
                _, u = _child(req, v)
                if (v == 0) | (walk.cursor == v) | (u < walk.w):
                    if (not _total_mass(res.mass, NUM_SPLITS, S_BLOCK) > 0) & (walk.c != 0.0):
                        walk = _walk_to(walk, ZPASS, v, 0.0, 1)
                    else:
                        walk = _with_kind(walk, tl.full((), LOCATE, tl.int32))
                else:
                    walk = _fail_to_parent(req, walk)
    return walk, res


@triton.jit
def _verify(req, walk, chunks, HAS_DRAFT: tl.constexpr, BLOCK: tl.constexpr, TRAVERSAL: tl.constexpr,
            T_BLOCK: tl.constexpr,             NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr):
    """Sampling, after a pass over the node's rows: its residual (fresh after statistics, else after a Z pass),
    then its children's tests (BLOCK: block verification of the chain, `_block_step`; TRAVERSAL: traversal
    verification of the tree, `_traversal_step`)."""
    z_before = walk.z  # (the Z of the residual a Z pass updated: traversal's new weight needs it)
    if walk.kind == STATS:
        walk, res = _start_node(req, walk, chunks)
    else:
        walk, res = _after_z(walk, chunks)
    if BLOCK:
        walk, res = _block_step(req, walk, res, NUM_SPLITS, S_BLOCK)
    elif TRAVERSAL:
        walk, res = _traversal_step(req, walk, res, z_before, T_BLOCK, NUM_SPLITS, S_BLOCK)
    elif HAS_DRAFT:
        walk, res = _draft_verify(req, walk, res, T_BLOCK, NUM_SPLITS, S_BLOCK)
    else:
        walk, res = _proposal_verify(req, walk, res, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
    return walk, res


# ----------------------------------------------------------------------------------------------
# the draw's second level (a chunk's scan) and the candidates after a last rejection
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile(row, start, hi, ar, PROBS: tl.constexpr):
    """float32 logits of entries start + ar of a row, -inf past hi (hi = start: nothing is read)."""
    return _row_logits(_load_row(row + start + ar, start + ar < hi, PROBS), PROBS)


@triton.jit
def _locate(req, node, pick, thresh, c, law_p, law_q, tau_p, tau_q, HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr,
            BLOCK_V: tl.constexpr):
    """The draw's second level: chunk `pick`'s scan, tile by tile until the running sum of the residual
    max(p - c q, 0) passes `thresh`: the first such entry (the last entry with r > 0 if rounding leaves the sum
    short). Given proposals skip the node's children's tokens unless c < 0 (a fallback that draws from p)."""
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
        a = _scaled(req, _kept(req, node, cols, _tile(t_row, start, hi, ar, req.probs), tau_p), law_p)
        b = a
        if HAS_DRAFT:
            b = _scaled(req, _kept(req, node, cols, _tile(d_row, start, hi_q, ar, req.probs), tau_q), law_q)
        r = _residual(a, b, law_p, law_q, c, HAS_DRAFT)
        if not HAS_DRAFT:
            if c >= 0:
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
    return _with_kind(walk, kind)


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


# ----------------------------------------------------------------------------------------------
# the kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, sb, buf, IS_FIRST: tl.constexpr,
            HAS_DRAFT: tl.constexpr, HAS_FILTERS: tl.constexpr, BLOCK: tl.constexpr, TRAVERSAL: tl.constexpr,
            T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr,
            TRIALS: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, PAIR_BLOCK: tl.constexpr):
    """The walk where the previous launch left it (buffer `buf`), its last pass merged and decided on; the
    first launch starts at the root. Returns the walk, the `Residual` of its draw and the rows' searches."""
    # (only a decision leads to a draw)
    res = Residual(tl.full((S_BLOCK,), 0.0, tl.float32), tl.full((), 0.0, tl.float32))
    sp = _idle_search()
    sq = sp
    if IS_FIRST:
        walk = _start(req, T)
    else:
        walk = _load_state(state_i_ptr, state_f_ptr, buf)
        if walk.kind == TRIAL:
            if HAS_DRAFT:
                walk = _merge_candidates(req, walk, part_f_ptr, part_i_ptr, buf, NUM_SPLITS, S_BLOCK, TRIALS)
        elif walk.kind == SELECT:
            if HAS_FILTERS:
                walk, res, sp, sq = _select_decide(req, walk, _load_search(sb, buf, 0), _load_search(sb, buf, 1), sb,
                                                   buf, HAS_DRAFT, BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V,
                                                   S_BLOCK, NUM_PIVOTS, CAP, PAIR_BLOCK)
        elif walk.kind != DONE:
            walk, res, sp, sq = _decide(req, walk, _load_chunks(part_f_ptr, part_i_ptr, buf, walk.kind, NUM_SPLITS,
                                                                S_BLOCK), HAS_DRAFT, HAS_FILTERS, BLOCK, TRAVERSAL,
                                        T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
    return walk, res, sp, sq


@triton.jit
def _select_buffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr):
    return SelectBuffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr)


@triton.jit(do_not_specialize=["offset_lo", "offset_hi", "read_buf"])
def _split_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                  mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                  state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, search_i_ptr, search_f_ptr, search_d_ptr,
                  sel_count_ptr, sel_mass_ptr, sel_value_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt,
                  offset_lo, offset_hi, read_buf, HAS_DRAFT: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                  HAS_FILTERS: tl.constexpr, PROBS: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr,
                  TRAVERSAL: tl.constexpr, IS_FIRST: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                  BLOCK_V: tl.constexpr, T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
                  TRIALS: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, SELECT_BLOCK: tl.constexpr,
                  PAIR_BLOCK: tl.constexpr):
    """A split launch, grid (B, NUM_SPLITS): merge the previous launch's partials and decide (every program
    alike), store the state, then run this program's chunk of the next pass, or its part of the draw."""
    split = tl.program_id(1)
    req = _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                   state_f_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, HAS_OFFSETS,
                   HAS_FILTERS, PROBS, PACKED, T_BLOCK)
    sb = _select_buffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr)
    walk, res, sp, sq = _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, sb, read_buf, IS_FIRST,
                                HAS_DRAFT, HAS_FILTERS, BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, TRIALS,
                                NUM_PIVOTS, CAP, PAIR_BLOCK)
    buf = 1 - read_buf
    _store_state(state_i_ptr, state_f_ptr, buf, walk, req.writer)
    if HAS_FILTERS:
        _store_search(sb, buf, 0, sp, req.writer)
        _store_search(sb, buf, 1, sq, req.writer)
    if walk.kind == LOCATE:
        pick, thresh = _pick_chunk(res.mass, _uniform(req.stream, walk.node, U_DRAW), NUM_SPLITS, S_BLOCK)
        if split == pick:  # the program whose chunk holds the threshold draws and writes the outputs
            token = _locate(req, walk.node, pick, thresh, res.c, walk.law_p, walk.law_q, walk.tau_p, walk.tau_q,
                            HAS_DRAFT, SPLIT_V, BLOCK_V)
            _emit(req, walk.depth, token, True)
    elif walk.kind == TRIAL:
        if HAS_DRAFT:  # candidates j = split, split + NUM_SPLITS, ...: this program's first accepted one
            first, token = _first_accepted(req, walk, res, split, NUM_SPLITS, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V,
                                           TRIALS)
            _, pi = _part_records(part_f_ptr, part_i_ptr, buf, split, NUM_SPLITS)
            tl.store(pi + CANDIDATE, first)
            tl.store(pi + CANDIDATE_TOKEN, token)
    elif walk.kind == SELECT:
        if HAS_FILTERS:
            _select_chunk(req, walk, sp, sq, split, sb, buf, HAS_DRAFT, NUM_SPLITS, NUM_PIVOTS, CAP, SPLIT_V,
                          SELECT_BLOCK)
    elif walk.kind != DONE:
        chunk = _chunk_pass(req, walk, split, _uses_q(req, walk.node, T_BLOCK), HAS_DRAFT, SPLIT_V, BLOCK_V, PREFETCH)
        pf, pi = _part_records(part_f_ptr, part_i_ptr, buf, split, NUM_SPLITS)
        if walk.kind == STATS:
            tl.store(pf + MAX_P, chunk.max_p)
            tl.store(pf + SUM_P, chunk.sum_p)
            tl.store(pf + MAX_Q, chunk.max_q)
            tl.store(pf + SUM_Q, chunk.sum_q)
            tl.store(pi + ARGMAX, chunk.argmax)
        else:
            tl.store(pf + MASS, chunk.mass)


@triton.jit
def _draw_if_due(req, walk, res, HAS_DRAFT: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                 S_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr, TRIALS: tl.constexpr):
    """The walker's draw, when the walk is at it: the candidates in order until one is accepted (else the Z
    pass is next), or the draw from `res`."""
    if walk.kind == TRIAL:
        if HAS_DRAFT:
            first, token = _first_accepted(req, walk, res, tl.full((), 0, tl.int32), 1, NUM_SPLITS, SPLIT_V, S_BLOCK,
                                           BLOCK_V, TRIALS)
            walk = _after_candidates(req, walk, first, token, TRIALS)
    elif walk.kind == LOCATE:
        pick, thresh = _pick_chunk(res.mass, _uniform(req.stream, walk.node, U_DRAW), NUM_SPLITS, S_BLOCK)
        token = _locate(req, walk.node, pick, thresh, res.c, walk.law_p, walk.law_q, walk.tau_p, walk.tau_q, HAS_DRAFT,
                        SPLIT_V, BLOCK_V)
        _emit(req, walk.depth, token, req.writer)
        walk = _with_kind(walk, tl.full((), DONE, tl.int32))
    return walk


@triton.jit(do_not_specialize=["offset_lo", "offset_hi", "read_buf"])
def _walk_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                 mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                 state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, search_i_ptr, search_f_ptr, search_d_ptr,
                 sel_count_ptr, sel_mass_ptr, sel_value_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt,
                 offset_lo, offset_hi, read_buf, HAS_DRAFT: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                 HAS_FILTERS: tl.constexpr, PROBS: tl.constexpr, PACKED: tl.constexpr, BLOCK: tl.constexpr,
                 TRAVERSAL: tl.constexpr, IS_FIRST: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                 BLOCK_V: tl.constexpr, T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
                 TRIALS: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, SELECT_BLOCK: tl.constexpr,
                 PAIR_BLOCK: tl.constexpr):
    """The last launch, grid (B,): merge the last split launch's partials, decide, and finish the walk, each
    pass over the whole row in this one program (a SELECT pass's partials through buffer `read_buf`, which
    it no longer needs: barriers order the program's own stores and loads)."""
    req = _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                   state_f_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, HAS_OFFSETS,
                   HAS_FILTERS, PROBS, PACKED, T_BLOCK)
    sb = _select_buffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr)
    walk, res, sp, sq = _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, sb, read_buf, IS_FIRST,
                                HAS_DRAFT, HAS_FILTERS, BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, TRIALS,
                                NUM_PIVOTS, CAP, PAIR_BLOCK)
    walk = _draw_if_due(req, walk, res, HAS_DRAFT, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V, TRIALS)
    while walk.kind != DONE:
        if walk.kind == SELECT:
            if HAS_FILTERS:
                tl.debug_barrier()  # (the buffer's previous readers are done)
                for s in range(NUM_SPLITS):
                    _select_chunk(req, walk, sp, sq, s, sb, read_buf, HAS_DRAFT, NUM_SPLITS, NUM_PIVOTS, CAP, SPLIT_V,
                                  SELECT_BLOCK)
                tl.debug_barrier()
                walk, res, sp, sq = _select_decide(req, walk, sp, sq, sb, read_buf, HAS_DRAFT, BLOCK, TRAVERSAL,
                                                   T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, NUM_PIVOTS, CAP, PAIR_BLOCK)
        else:
            walk, res, sp, sq = _decide(req, walk, _row_pass(req, walk, HAS_DRAFT, T_BLOCK, NUM_SPLITS, SPLIT_V,
                                                             BLOCK_V, S_BLOCK, PREFETCH), HAS_DRAFT, HAS_FILTERS,
                                        BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
        walk = _draw_if_due(req, walk, res, HAS_DRAFT, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V, TRIALS)


# Candidates the draw after a last rejection with draft logits tries before it falls back to the Z pass: each
# costs a scan of (a prefix of) one chunk of the target row instead of a pass over both rows, and is accepted
# with probability Z (the total variation between target and draft), so 8 leave ~0.3% of the draws to the
# fallback at Z = 0.5 and ~17% at Z = 0.2. Not a function of the schedule: results stay schedule invariant.
TRIALS = 8
# Top-k / top-p searches: pivots per pivot pass (each divides a bracket's key range by this), and the most
# entries a bracket may hold to be gathered and decided pairwise (CAP^2 / PAIR_BLOCK-row blocks of compares).
NUM_PIVOTS = 16
CAP = 256


def _config(T: int, V: int, elem_bytes: int, device: torch.device, filtered: bool = False, block: bool = False,
            traversal: bool = False) -> dict:
    """Tile sizes and schedule from shapes, logit width and device only (never B: results stay batch
    invariant).

    GPU: 2048-entry tiles over 8 warps (one 16-byte load per thread and row; the next tile prefetched,
    the next two for 16-bit logits so that a CTA keeps as many bytes in flight as with fp32; ptxas for
    sm_90 with triton 3.6 at V = 128256: 108-118 registers in a split launch with draft logits, 64-72
    without, no spills; the statistics loop is ~33 PTX instructions per vocab entry of a bf16 target +
    draft pair, no barrier or shuffle inside the loop), up to 16 chunks per row (V = 128K: 8192-entry
    chunks, 4 tiles each), every pass of a walk of up to 15 nodes in its own full-width launch. Untuned: to
    be set from the H200 benchmark (bench.sweep).
    Interpreter: 16-entry tiles so small test vocabularies span several tiles, one chunk and only the
    walker (cheapest; tests/ops/accept/test_against_reference.py checks that the split schedules give identical results).
    Filters (top-k / top-p / min-p given): a node takes 3 passes (statistics, pivots, gathering), a few more
    for a long search, so up to 4 (T + 1) split launches (block verification: twice as many, every chain node
    taking a Z pass, plus the draw's at tau; traversal: statistics at up to T nodes, 4 T with filters, a Z pass
    per failed child, at most T - 1, and one for a draw from p: 2 T + 1, 5 T + 1; capped at 40); pivot passes
    over 256-entry tiles (their [tile, pivots] compares stay in registers). Untuned too.
    """
    select = dict(num_pivots=NUM_PIVOTS, cap=CAP, pair_block=16)
    if device.type == "cuda":
        block_v = max(16, min(2048, triton.next_power_of_2(V)))
        num_splits = min(16, triton.cdiv(V, block_v))
        passes = (4 if filtered else 1) * (T + 1) * (2 if block else 1) + (3 if block else 0)
        if traversal:  # statistics at every inner node entered and the emitting leaf, a Z pass per failed child
            passes = (4 if filtered else 1) * T + T + 1
        # a row of one chunk gains nothing from split launches: the walker alone, one launch
        return dict(block_v=block_v, num_splits=num_splits,
                    split_steps=min(passes, 40 if filtered or block or traversal else 16) if num_splits > 1 else 0,
                    num_warps=8, prefetch=2 if elem_bytes <= 2 else 1, trials=TRIALS, select_block=min(block_v, 256),
                    **select)
    return dict(block_v=16, num_splits=1, split_steps=0, num_warps=4, prefetch=1, trials=TRIALS, select_block=16,
                **select)


FLOAT32_TINY_NORMAL = 1.1754943508222875e-38


def _in_float32_range(rows, as_logits=False):
    """Rows as the kernel reads them (last dim contiguous). It computes in float32, so a float64 tensor comes as
    the same law within float32's range: each row of logits minus its largest finite value (computed in float64;
    a copy, of float64 rows only). A shift changes no law and no filter, a huge finite value read as float32
    would be inf, and after it the row's max is 0 and a value below it stays below it in float32 (a difference
    smaller than float32's smallest normal value, 1.2e-38, which would round to 0 or a subnormal, is made that
    value: exp of either is 1 in float32, so no law changes): greedy's argmax is the float64 one. Other dtypes fit
    float32 as they are. as_logits: the rows are probabilities, returned as
    their float64 logs (the law they mean; 0 is -inf), shifted the same way, for rows that hold float64
    probabilities (1 - 2**-53 and 1, a float32 tie, stay apart as logs)."""
    if as_logits:
        rows = rows.double().log()
    if rows.dtype == torch.float64:
        finite = torch.isfinite(rows)
        top = torch.where(finite, rows, -torch.inf).amax(-1, keepdim=True)
        rows = rows - torch.where(torch.isfinite(top), top, 0.0)  # (keeps a column-major row's strides)
        rows = torch.where((rows < 0) & (rows > -FLOAT32_TINY_NORMAL), -FLOAT32_TINY_NORMAL, rows)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None,
           top_k=None, top_p=None, min_p=None, token_bitmask=None, method="token", probs=False, row_offsets=None, *,
           block_v=None, num_splits=None, split_steps=None, num_warps=None, prefetch=None, trials=None,
           num_pivots=None, cap=None, select_block=None, pair_block=None):
    """Normalized arguments of the `specdec::accept` schema (validated by specdec.ops.accept).

    Everything is fused: the grammar mask (token_bitmask) is read beside a walked row's logits (`_allowed`),
    and top_k / top_p / min_p become one threshold per walked row, found by the kernel's own passes over it
    (see "filters" above): no sort, no processed copy of any row. method "block" (with draft logits; chains,
    checked by specdec.ops.accept): block verification, `_block_step`; method "traversal" (with draft logits;
    any tree): traversal verification, `_traversal_step` (its node records after the walk state in state_f).
    Greedy requests take the greedy walk whatever the method. probs=True (PROBS): target_logits /
    draft_logits hold probabilities, read as their logs entry by entry. row_offsets (B,) int (PACKED): the rows
    are packed, (N, V) and token_bitmask (N, W), request b's node i at row row_offsets[b] + i (tokens, parents,
    num_nodes (B, T) padded by specdec.ops.accept); read in place. Keyword tunables override `_config`
    (tests use them to compare schedules, and a small `cap` / `num_pivots` to exercise the long searches).
    """
    packed = row_offsets is not None
    B, T = tokens.shape  # (packed: B = len(row_offsets), T = max_nodes; the launch depends on shapes only)
    V = target_logits.shape[-1]
    dev = target_logits.device
    has_filters = any(f is not None for f in (top_k, top_p, min_p))
    elem_bytes = max(target_logits.element_size(), 0 if draft_logits is None else draft_logits.element_size())
    traversal = method == "traversal" and draft_logits is not None
    cfg = _config(T, V, elem_bytes, dev, has_filters, method == "block", traversal)
    for name, value in (("block_v", block_v), ("num_splits", num_splits), ("split_steps", split_steps),
                        ("num_warps", num_warps), ("prefetch", prefetch), ("trials", trials),
                        ("num_pivots", num_pivots), ("cap", cap), ("select_block", select_block),
                        ("pair_block", pair_block)):
        if value is not None:
            cfg[name] = value
    cfg["pair_block"] = min(cfg["pair_block"], cfg["cap"])
    accepted = torch.empty((B, T), dtype=torch.int32, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    next_tokens = torch.empty((B,), dtype=torch.int64, device=dev)
    if B == 0:
        return accepted, num_accepted, next_tokens
    # float64 probabilities come as their logs (both laws alike: the launch has one PROBS switch)
    logs = probs and any(x is not None and x.dtype == torch.float64 for x in (target_logits, draft_logits))
    probs = probs and not logs
    target = _in_float32_range(target_logits, logs)
    draft = None if draft_logits is None else _in_float32_range(draft_logits, logs)
    d = target if draft is None else draft
    S = cfg["num_splits"]
    if (cfg["block_v"] < 16 or cfg["block_v"] & (cfg["block_v"] - 1) or S < 1 or cfg["split_steps"] < 0
            or cfg["prefetch"] not in (1, 2) or cfg["trials"] < 0
            or any(cfg[n] < 4 or cfg[n] & (cfg[n] - 1) for n in ("num_pivots", "cap", "select_block", "pair_block"))):
        raise ValueError(f"accept: invalid tunables {cfg} (block_v: a power of 2 >= 16, num_splits >= 1, "
                         "prefetch 1 or 2, trials >= 0; num_pivots, cap, select_block, pair_block: powers of 2 >= 4)")
    split_v = triton.cdiv(triton.cdiv(V, S), cfg["block_v"]) * cfg["block_v"]
    # walk state and chunk partials, double-buffered: launch `step` reads buffer (step + 1) % 2, writes step % 2;
    # traversal: then the node records (B, T) of the walk's ancestors, same float slots (`_push_node`)
    state_i = torch.empty((2, B, STATE_INTS.value), dtype=torch.int32, device=dev)
    state_f = torch.empty((2 * B + (B * T if traversal else 0), STATE_FLOATS.value), dtype=torch.float32, device=dev)
    part_f = torch.empty((2, B, S, PART_FLOATS.value), dtype=torch.float32, device=dev)
    part_i = torch.empty((2, B, S, PART_INTS.value), dtype=torch.int32, device=dev)
    has_offsets = offsets is not None
    offsets = offsets.contiguous() if has_offsets else seeds  # absent: any int tensor stands in, never read
    row_offsets = row_offsets.contiguous() if packed else seeds  # (padded: never read)
    W = 0 if token_bitmask is None else token_bitmask.shape[-1]
    masks = num_nodes if token_bitmask is None else token_bitmask.contiguous()  # (W = 0: never read)
    NP, cap = cfg["num_pivots"], cfg["cap"]
    if has_filters:  # the parameters absent are off; out-of-range values (value checks off) as their nearest
        top_k = torch.zeros(B, dtype=torch.int32, device=dev) if top_k is None else top_k.contiguous()
        top_p = (torch.ones(B, device=dev) if top_p is None else top_p.float()).clamp(min=1e-30).contiguous()
        min_p = (torch.zeros(B, device=dev) if min_p is None else min_p.float()).clamp(max=1.0).contiguous()
        search = [torch.empty((2, B, 2, n.value), dtype=dtype, device=dev) for n, dtype in
                  ((SEARCH_INTS, torch.int32), (SEARCH_FLOATS, torch.float32), (SEARCH_DOUBLES, torch.float64))]
        select = [torch.empty((2, B, S, 2, n), dtype=dtype, device=dev) for n, dtype in
                  ((NP, torch.int32), (NP, torch.float64), (cap, torch.float32))]
    else:  # any tensors stand in, never read
        top_k = top_p = min_p = num_nodes
        search = [state_i, state_f, state_f]
        select = [state_i, state_f, state_f]
    # (request stride, node row stride) of a row tensor: packed rows (N, V) have no request stride
    strides = (lambda x: (0, x.stride(0))) if packed else (lambda x: (x.stride(0), x.stride(1)))
    args = (target, d, tokens.contiguous(), parents.contiguous(), temperature.contiguous(), seeds.contiguous(),
            num_nodes.contiguous(), offsets, masks, row_offsets, top_k, top_p, min_p, accepted, num_accepted,
            next_tokens, state_i, state_f, part_f, part_i, *search, *select, T, V, W, *strides(target), *strides(d),
            offset & 0x7FFFFFFF, offset >> 31)
    meta = dict(HAS_DRAFT=draft is not None, HAS_OFFSETS=has_offsets, HAS_FILTERS=has_filters, PROBS=bool(probs),
                PACKED=packed, BLOCK=method == "block" and draft is not None, TRAVERSAL=traversal, NUM_SPLITS=S,
                SPLIT_V=split_v, BLOCK_V=cfg["block_v"], T_BLOCK=triton.next_power_of_2(T),
                S_BLOCK=triton.next_power_of_2(S), PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"], NUM_PIVOTS=NP,
                CAP=cap, SELECT_BLOCK=cfg["select_block"], PAIR_BLOCK=cfg["pair_block"], num_warps=cfg["num_warps"])
    steps = cfg["split_steps"]
    for step in range(steps):
        _split_kernel[(B, S)](*args, (step + 1) % 2, IS_FIRST=step == 0, **meta)
    _walk_kernel[(B,)](*args, (steps + 1) % 2, IS_FIRST=steps == 0, **meta)
    return accepted, num_accepted, next_tokens
