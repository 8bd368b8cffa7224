"""The walk's vocabulary: its kinds of step, the named tuples it travels in (a `Request`, a `Walk`, a pass's
`Chunks`, a row's `Search`, a draw's `Residual`), and the records that carry them between launches, with their
loads and stores. Shapes of the records: (2, B, slots), double-buffered by launch parity; chunk partials
(2, B, NUM_SPLITS, slots); searches (2, B, 2 rows, slots)."""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

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
def _walk_to(walk, kind, node, c, final):
    """The walk at another step: `kind` next at `node` (a new node: its thresholds not known yet), Z-pass c."""
    zero = tl.full((), 0, tl.int32)
    moved = node != walk.node
    return Walk(tl.full((), kind, tl.int32), node, walk.depth, walk.cursor, c, walk.z, walk.law_p, walk.law_q,
                tl.where(moved, zero, walk.sel), tl.where(moved, NEG_INF, walk.tau_p),
                tl.where(moved, NEG_INF, walk.tau_q), walk.w, walk.tau_node, walk.w_tau, zero + final)


@triton.jit
def _select_buffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr):
    return SelectBuffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr)
