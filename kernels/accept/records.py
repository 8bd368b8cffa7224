"""The walk's vocabulary: its kinds of step, the named tuples it travels in (a `Request`, a `Walk`, a pass's
`Chunks`, a row's `Search`, a draw's `Residual`), and the records that carry them between launches, with their
loads and stores. Shapes of the records: (2, B, slots), double-buffered by launch parity; chunk partials
(2, B, NUM_SPLITS, slots); searches (2, B, 2 rows, slots), their floats followed by the nodes' target thresholds
(B, T) (`_node_thresholds`)."""
from __future__ import annotations

from typing import NamedTuple

import torch
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

# The walk's transition table, kind -> {outcome: next kind}: a decision (`_decide`, `_select_decide`) after the pass
# of a STATS, ZPASS or SELECT walk, or the draw of a TRIAL or LOCATE walk, takes one of the outcomes listed
# (docs/accept-kernel.md; tests/ops/accept/test_walk_states.py checks that the kernel takes no other). A sampling
# node's law known (after statistics, a Z pass, or a search's gathering), the verifier takes it on:
VERIFIED = {
    "a child accepted or entered, block's next chain node, or back at its tau: statistics": "STATS",
    "a rejection with siblings left, a failed child, a chain node's S_i, or a residual of mass 0 by rounding": "ZPASS",
    "a last rejection with draft logits, or a weight-1 node's last child failed at once: candidates": "TRIAL",
    "no child left to test, or the chain's tau found: the draw": "LOCATE",
}
TRANSITIONS = {
    "STATS": {"greedy: a child's token is the argmax: descend": "STATS",
              "greedy: no child's token is the argmax: emit it": "DONE",
              "a filtered node's first statistics: its threshold searches": "SELECT",
              "a filtered node's thresholds known at once (min-p alone): statistics through them": "STATS",
              **VERIFIED},
    "ZPASS": VERIFIED,
    "SELECT": {"a search goes on": "SELECT",
               "the thresholds found, the law not known from the gathered values: statistics through them": "STATS",
               **VERIFIED},
    "TRIAL": {"a candidate accepted: emitted": "DONE",
              "every candidate rejected: the exact draw's Z pass": "ZPASS"},
    "LOCATE": {"the token drawn and emitted": "DONE"},
    "DONE": {},
}

# a verifier's phase (`BlockState.phase`, `TraversalState.phase`): where block verification (`_block_step`) or
# traversal (`_traversal_step`) is
WALKING = tl.constexpr(0)  # testing the node's children (block: down the chain)
BLOCK_TAU_STATS = tl.constexpr(1)  # block: back at the last accepted node tau, its statistics
BLOCK_TAU_Z = tl.constexpr(2)  # block: the Z pass of tau's residual max(P - Q / p_tau, 0), then the draw from it
BLOCK_FROM_P = tl.constexpr(3)  # block: that residual had mass 0 by rounding: the draw from P (its Z pass, c = 0)
TRAVERSAL_FROM_P = tl.constexpr(1)  # traversal: the draw from p after a residual of mass 0 by rounding (c = 0)
FROM_P = tl.constexpr(-1.0)  # a given-proposals `Residual`'s c: the draw from p itself, no rejected token skipped

# walk state records (2, B, slots), one slot per `Walk` field (block's and traversal's weight and phase share
# WEIGHT and PHASE): int slots, then float slots
KIND = tl.constexpr(0)
NODE = tl.constexpr(1)
DEPTH = tl.constexpr(2)
CURSOR = tl.constexpr(3)
SEL = tl.constexpr(4)
TAU_NODE = tl.constexpr(5)
PHASE = tl.constexpr(6)
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
F32_MAX = tl.constexpr(3.4028234663852886e38)  # the largest float32: step 0 saturates there (reference.saturated)
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

# filter_order (FILTER_ORDER): steps 3-5 differ only in the set top-p normalizes over (filters.py)
ORDER_HF = tl.constexpr(0)  # over what top-k keeps (the default)
ORDER_VLLM = tl.constexpr(1)  # over what min-p and top-k keep
ORDER_SGLANG = tl.constexpr(2)  # over the whole (masked) row
FILTER_ORDERS = {"hf": 0, "vllm": 1, "sglang": 2}


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
    taus: tl.tensor  # the threshold of each node's target row, T float32 (record_taus: `_start_node` writes them)
    pen: Penalties  # step 0's inputs (neutral, nothing read, when the launch has none: HAS_PENALTIES off)
    # the launch's PROBS switch: the rows hold probabilities, read as their logs (`_load_row`, `_row_logits`).
    # A compile-time field rather than one more argument: every helper that reads a row has the request
    probs: tl.constexpr
    # HAS_PENALTIES: every row read goes through step 0 (`_values`, penalties.py); FILTER_ORDER: ORDER_HF,
    # ORDER_VLLM or ORDER_SGLANG, the set top-p normalizes over (filters.py)
    penalties: tl.constexpr
    order: tl.constexpr
    # HAS_FILTERS: the walk writes each sampling node's target threshold once its law is known (`_start_node`), for
    # the processed logprobs (logprobs.py), which read the emitted rows once, through it, instead of searching them
    # again
    record_taus: tl.constexpr


class Penalties(NamedTuple):
    """Step 0's inputs of one request (penalties.py: `_request_penalties`, `_penalized`); the node's path is
    chased at each read."""
    rep: tl.tensor  # repetition penalty (float32; 1: off) and 1 / rep computed in float32
    inv_rep: tl.tensor
    freq: tl.tensor  # frequency and presence penalties (float32; 0: off)
    pres: tl.tensor
    counts: tl.tensor  # the request's output_token_counts row (int32 per token)
    counted: tl.tensor  # entries of that row: V, or 0 without output_token_counts (nothing read)
    prompt: tl.tensor  # the request's prompt_token_mask row (int32 words, bit v % 32 of word v // 32)
    prompt_words: tl.tensor  # its words: ceil(V / 32), or 0 without a prompt mask (nothing read)
    bias_ids: tl.tensor  # the request's logit_bias_ids / logit_bias_values rows, K entries (-1: padding)
    bias_values: tl.tensor
    K: tl.tensor
    stop_ids: tl.tensor  # the request's stop_token_ids row, S entries (-1: padding)
    S: tl.tensor
    min_tokens: tl.tensor  # int32 (0: off)
    generated: tl.tensor  # int64: the sum of the request's output counts
    tok_row: tl.tensor  # the request's tokens and parents rows (T entries each)
    par_row: tl.tensor
    T: tl.tensor
    V: tl.tensor
    probs: tl.constexpr  # the entries are probabilities: step 0 on their float64 logs


class RowLaw(NamedTuple):
    """A sampling node's law of one row: p(x) = exp((x - shift) / t - lse), shift the row's largest kept raw value
    (0 when it keeps none) and lse the log-sum-exp of (x - shift) / t. Differences are scaled, never x / t itself:
    that overflows float32 for |x| > FLT_MAX * t, and the lse of a huge max / t would round the log-sum away (x - M
    overflows only to -inf, a weight of 0, which is exact)."""
    shift: tl.tensor
    lse: tl.tensor


class BlockState(NamedTuple):
    """Block verification's fields of a walk (`_block_step`)."""
    w: tl.tensor  # the node's weight p_i
    tau_node: tl.tensor  # the last accepted node tau so far and its weight p_tau
    w_tau: tl.tensor
    phase: tl.tensor  # WALKING, BLOCK_TAU_STATS, BLOCK_TAU_Z or BLOCK_FROM_P


class TraversalState(NamedTuple):
    """Traversal's fields of a walk (`_traversal_step`)."""
    w: tl.tensor  # the node's weight
    phase: tl.tensor  # WALKING or TRAVERSAL_FROM_P


class Walk(NamedTuple):
    """A walk's state (between launches: the state record's slots). Each verifier reads and updates only its own
    record, `block` or `traversal`; the two share the state record's WEIGHT and PHASE slots (`_store_state` stores
    the launch's verifier's), and token-wise verification carries them unread."""
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
    block: BlockState
    traversal: TraversalState


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
    the node's children's tokens, or p itself when c is FROM_P)."""
    mass: tl.tensor
    c: tl.tensor


@triton.jit
def _updated(walk, kind=None, node=None, depth=None, cursor=None, c=None, z=None, law_p=None, law_q=None, sel=None,
             tau_p=None, tau_q=None, block=None, traversal=None):
    """The walk with the fields given (by name) replaced: every update says which fields it changes."""
    return Walk(kind=walk.kind if kind is None else kind, node=walk.node if node is None else node,
                depth=walk.depth if depth is None else depth, cursor=walk.cursor if cursor is None else cursor,
                c=walk.c if c is None else c, z=walk.z if z is None else z,
                law_p=walk.law_p if law_p is None else law_p, law_q=walk.law_q if law_q is None else law_q,
                sel=walk.sel if sel is None else sel, tau_p=walk.tau_p if tau_p is None else tau_p,
                tau_q=walk.tau_q if tau_q is None else tau_q, block=walk.block if block is None else block,
                traversal=walk.traversal if traversal is None else traversal)


@triton.jit
def _block_updated(block, w=None, tau_node=None, w_tau=None, phase=None):
    """Block verification's fields with those given (by name) replaced; `phase` a code (WALKING, BLOCK_*)."""
    return BlockState(w=block.w if w is None else w, tau_node=block.tau_node if tau_node is None else tau_node,
                      w_tau=block.w_tau if w_tau is None else w_tau,
                      phase=block.phase if phase is None else tl.full((), 0, tl.int32) + phase)


@triton.jit
def _traversal_updated(traversal, w=None, phase=None):
    """Traversal's fields with those given (by name) replaced; `phase` a code (WALKING, TRAVERSAL_FROM_P)."""
    return TraversalState(w=traversal.w if w is None else w,
                          phase=traversal.phase if phase is None else tl.full((), 0, tl.int32) + phase)


@triton.jit
def _start(req, T):
    """The walk at the root: statistics at node 0, the path [0, -1, ...] (written by chunk 0)."""
    tl.store(req.path + req.idx, tl.where(req.idx == 0, 0, -1), mask=req.idx < tl.where(req.writer, T, 0))
    root = tl.full((), 0, tl.int32)
    zero = tl.full((), 0.0, tl.float32)
    return Walk(kind=root + STATS, node=root, depth=root, cursor=root, c=zero, z=zero + 1.0,
                law_p=RowLaw(zero, zero), law_q=RowLaw(zero, zero),
                sel=root, tau_p=zero + NEG_INF, tau_q=zero + NEG_INF,
                block=BlockState(w=zero + 1.0, tau_node=root, w_tau=zero + 1.0, phase=root + WALKING),
                traversal=TraversalState(w=zero + 1.0, phase=root + WALKING))


@triton.jit
def _load_state(state_i_ptr, state_f_ptr, buf):
    """Request program_id(0)'s state in buffer `buf`."""
    rec = buf * tl.num_programs(0) + tl.program_id(0)
    si = state_i_ptr + rec * STATE_INTS
    sf = state_f_ptr + rec * STATE_FLOATS
    walk = Walk(kind=tl.load(si + KIND), node=tl.load(si + NODE), depth=tl.load(si + DEPTH),
                cursor=tl.load(si + CURSOR), c=tl.load(sf + C), z=tl.load(sf + Z),
                law_p=RowLaw(tl.load(sf + SHIFT_P), tl.load(sf + LSE_P)),
                law_q=RowLaw(tl.load(sf + SHIFT_Q), tl.load(sf + LSE_Q)), sel=tl.load(si + SEL),
                tau_p=tl.load(sf + TAU_P), tau_q=tl.load(sf + TAU_Q),
                block=BlockState(w=tl.load(sf + WEIGHT), tau_node=tl.load(si + TAU_NODE), w_tau=tl.load(sf + W_TAU),
                                 phase=tl.load(si + PHASE)),
                traversal=TraversalState(w=None, phase=None))
    # traversal's fields are block's loads of the same slots: one load per slot, in slot order, whichever verifier
    # the launch uses
    return _updated(walk, traversal=TraversalState(w=walk.block.w, phase=walk.block.phase))


@triton.jit
def _store_state(state_i_ptr, state_f_ptr, buf, walk, mask, TRAVERSAL: tl.constexpr):
    """The state for the next launch: a draw (LOCATE) ends the walk in the launch that decides it. The WEIGHT and
    PHASE slots hold the fields of the launch's verifier (TRAVERSAL: `walk.traversal`, else `walk.block`)."""
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
    if TRAVERSAL:
        weight, phase = walk.traversal.w, walk.traversal.phase
    else:
        weight, phase = walk.block.w, walk.block.phase
    tl.store(sf + WEIGHT, weight, mask=mask)
    tl.store(si + TAU_NODE, walk.block.tau_node, mask=mask)
    tl.store(sf + W_TAU, walk.block.w_tau, mask=mask)
    tl.store(si + PHASE, phase, mask=mask)
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
def _node_thresholds(search_f_ptr):
    """Where the nodes' target thresholds, (B, T) float32, follow the (2, B, 2, SEARCH_FLOATS) search records in
    search_f (`node_thresholds` on the host)."""
    return search_f_ptr + 4 * tl.num_programs(0) * SEARCH_FLOATS


def search_floats(B: int, T: int, device):
    """The float slots of a filtered walk: its search records (2, B, 2, SEARCH_FLOATS), then the nodes' target
    thresholds (B, T) (`_node_thresholds`), flat."""
    return torch.empty(4 * B * SEARCH_FLOATS.value + B * T, dtype=torch.float32, device=device)


def node_thresholds(search_f, B: int, T: int):
    """The (B, T) nodes' target thresholds of a filtered walk's `search_floats`, as the walk left them: entry
    (b, i) is written for every sampling node i of request b whose law the walk took (its path's, all of them)."""
    return search_f[4 * B * SEARCH_FLOATS.value:].view(B, T)


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
def _walk_to(walk, kind, node, c, block=None, traversal=None):
    """The walk at another step: `kind` next at `node` (a new node: its thresholds not known yet), Z-pass c, and
    the verifier's fields given (`block` or `traversal`: its phase)."""
    zero = tl.full((), 0, tl.int32)
    moved = node != walk.node
    return _updated(walk, kind=tl.full((), kind, tl.int32), node=node, c=c, sel=tl.where(moved, zero, walk.sel),
                    tau_p=tl.where(moved, NEG_INF, walk.tau_p), tau_q=tl.where(moved, NEG_INF, walk.tau_q),
                    block=block, traversal=traversal)


@triton.jit
def _select_buffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr):
    return SelectBuffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr)
