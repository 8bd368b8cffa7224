"""specdec.accept, backend="triton": greedy and exactly lossless rejection sampling over draft chains
and trees, fused from logits.

Shapes: target_logits (B, T, V) and draft_logits (B, T, V) or None (any float dtype, last dim
contiguous), tokens/parents (B, T) int32, temperature (B,) float32 (0 = greedy), seeds (B,) int64,
num_nodes (B,) int32, offset int >= 0 and offsets (B,) int or None (request b's stream offset is
offset + offsets[b], read on the device), top_k / top_p / min_p (B,) or None and token_bitmask
(B, T, ceil(V/32)) int32 or None (see `accept`: the bitmask alone is applied in the kernel, `_allowed`).
Returns accepted_nodes (B, T) int32 (the path from node 0, padded with -1), num_accepted (B,) int32,
next_tokens (B,) int64. Semantics are those of reference.accept.

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
is word 0 of (i, U_TEST = 0), u of the draw at node n is word 0 of (n, U_DRAW = 1), candidate j's pair at
node n words 0 and 1 of (n, U_CANDIDATE + j = 2 + j). A request's result therefore depends only on its own
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
SPLIT_STEPS = T + 1 every pass runs at full width; requests that finished early exit at once.
Launch count: SPLIT_STEPS + 1 (fixed by shapes: CUDA-graph capturable).

Code layout. Both kernels start alike: `_request` gathers the request's read-only context (a `Request`),
`_resume` loads the walk state (a `Walk`; its kind is the step to run next) and merges and decides on the
partials the previous launch left (`_decide`). Then the split kernel stores the new state and runs its part
of the next step; the walker loops over whole-row passes (`_row_pass`), decisions and the draw
(`_draw_if_due`) until the walk is done. The kinds of step:
  STATS   `_chunk_pass`: (max, sum exp) of target/t and draft/t per chunk, and the first argmax;
  ZPASS   `_chunk_pass`: the mass of the residual max(p - c q, 0) per chunk (draft logits only);
  TRIAL   `_first_accepted`: the candidates after a last rejection (draft logits only);
  LOCATE  `_pick_chunk` + `_locate`: the draw's chunk and its scan;
  DONE.
A decision (`_decide`) is the greedy step (`_greedy_step`) or, sampling, the node's fresh residual
(`_start_node`) or the Z just summed (`_after_z`) followed by the verifier: `_draft_verify` (one child's
test per pass, `_draft_accepts`) or `_proposal_verify` (every child in one go, `_proposal_accepts`), which
ends in a descent (`_descend`), the next pass, or the draw from a `Residual` (chunk masses and c). Between
launches the state lives in records of named int slots (KIND, NODE, DEPTH, CURSOR) and float slots (C, Z,
LSE_P, LSE_Q), the partials in per-chunk records (MAX_P, SUM_P, MAX_Q, SUM_Q, MASS; ARGMAX, CANDIDATE,
CANDIDATE_TOKEN), double-buffered by launch parity (a launch reads one buffer while chunk 0 writes the
other). Context and state travel as named tuples (flattened by the compiler: free at run time).

Bytes floor (for the benchmark): sum_b (num_accepted[b] + 1) * V * (target itemsize + draft itemsize if
draft logits are given and temperature[b] > 0), plus V / 8 per walked row with a bitmask. Extra traffic
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

# walk kinds (state slot KIND: the step to run next at the current node)
STATS = tl.constexpr(0)  # argmax (greedy) or log-sum-exp of target/draft rows (sampling)
ZPASS = tl.constexpr(1)  # Z_k = sum max(p - c q, 0) after a rejection with draft logits
LOCATE = tl.constexpr(2)  # the draw: the chosen chunk's scan for the token holding the threshold
DONE = tl.constexpr(3)
TRIAL = tl.constexpr(4)  # the draw after a last rejection with draft logits: candidates from the previous residual

# walk state records (2, B, slots), one slot per `Walk` field: int slots, then float slots
KIND = tl.constexpr(0)
NODE = tl.constexpr(1)
DEPTH = tl.constexpr(2)
CURSOR = tl.constexpr(3)
STATE_INTS = tl.constexpr(4)
C = tl.constexpr(0)
Z = tl.constexpr(1)
LSE_P = tl.constexpr(2)
LSE_Q = tl.constexpr(3)
STATE_FLOATS = tl.constexpr(4)

# chunk partial records (2, B, NUM_SPLITS, slots): what a split launch's program leaves for the next launch
MAX_P = tl.constexpr(0)  # statistics: (max, sum exp(. - max)) of target/t and draft/t over the chunk
SUM_P = tl.constexpr(1)
MAX_Q = tl.constexpr(2)
SUM_Q = tl.constexpr(3)
MASS = tl.constexpr(4)  # Z pass: sum max(p - c q, 0) over the chunk
PART_FLOATS = tl.constexpr(5)
ARGMAX = tl.constexpr(0)  # statistics: the chunk's first argmax of target
CANDIDATE = tl.constexpr(1)  # candidates: the program's first accepted j (TRIALS: none)
CANDIDATE_TOKEN = tl.constexpr(2)  # and its token
PART_INTS = tl.constexpr(3)

STREAM_U = tl.constexpr(0)  # the Philox stream of every uniform
U_TEST = tl.constexpr(0)  # Philox counter word 1: a child's acceptance test (counter 0: the child)
U_DRAW = tl.constexpr(1)  # the draw at a node (counter 0: the node)
U_CANDIDATE = tl.constexpr(2)  # + j: candidate j at a node
NEG_INF = tl.constexpr(float("-inf"))
INT_MAX = tl.constexpr(2147483647)


class Stream(NamedTuple):
    """A request's Philox key and the counter words of its offset."""
    seed: tl.tensor
    off_lo: tl.tensor  # offset mod 2^31
    base: tl.tensor  # 4 * (offset >> 31)


class Request(NamedTuple):
    """What one program knows of its request, read-only."""
    greedy: tl.tensor  # temperature 0
    inv_t: tl.tensor  # 1 / temperature (1 when greedy)
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
    path: tl.tensor  # its accepted_nodes row
    out_num: tl.tensor  # its num_accepted and next_tokens entries
    out_next: tl.tensor
    writer: tl.tensor  # chunk 0's program: writes the state and the path


class Walk(NamedTuple):
    """A walk's state (between launches: the state record's slots)."""
    kind: tl.tensor  # the step to run next at the node
    node: tl.tensor
    depth: tl.tensor  # the node's index on the path
    cursor: tl.tensor  # the last child tested at the node
    c: tl.tensor  # the residual is max(p - c q, 0) / z (given proposals: p minus the rejected tokens, of mass z)
    z: tl.tensor
    lse_p: tl.tensor  # log-sum-exp of target/t and draft/t at the node
    lse_q: tl.tensor


class Chunks(NamedTuple):
    """A pass's partials: one chunk's (`_chunk_pass`) or vectors over the chunks (identity past NUM_SPLITS).
    STATS: max_p .. argmax; ZPASS: mass."""
    max_p: tl.tensor
    sum_p: tl.tensor
    max_q: tl.tensor
    sum_q: tl.tensor
    argmax: tl.tensor
    mass: tl.tensor


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
def _lane_lse(m, s, x):
    """Fold x into per-lane (max, sum exp(. - max)) with one exp per entry; -inf entries add nothing."""
    t = tl.exp(-tl.abs(x - m))  # exp(min - max) of the pair; the max's own term is 1
    t = tl.where(x == NEG_INF, 0.0, t)
    up = x > m
    return tl.maximum(m, x), tl.where(up, s * t + 1.0, s + t)


@triton.jit
def _merge_lse(m, s):
    """(max, sum exp(. - max)) of a vector of such pairs (a tile's lanes, or a row's chunks)."""
    mm = tl.reduce(m, 0, _MAX)
    return mm, tl.reduce(s * tl.exp(m - tl.where(mm == NEG_INF, 0.0, mm)), 0, _SUM)


@triton.jit
def _residual(a, b, lse_p, lse_q, c, HAS_DRAFT: tl.constexpr):
    """r = max(p - c q, 0) (p itself when c <= 0: q is not read then), from logits already divided by t."""
    p = tl.exp(a - lse_p)
    if HAS_DRAFT:
        p = tl.where(c > 0, tl.maximum(p - c * tl.exp(b - lse_q), 0.0), p)
    return p


# ----------------------------------------------------------------------------------------------
# the request, its tree and rows
# ----------------------------------------------------------------------------------------------
@triton.jit
def _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr, mask_ptr,
             acc_ptr, num_acc_ptr, next_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi,
             HAS_OFFSETS: tl.constexpr, T_BLOCK: tl.constexpr):
    """The `Request` of this program (request program_id(0))."""
    b = tl.program_id(0)
    t = tl.load(temp_ptr + b)
    greedy = t == 0.0
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
    u_test = tl.full((T_BLOCK,), 0.0, tl.float32)
    if t != 0.0:  # drawn up front in one call
        u_test = _uniform(stream, idx, U_TEST)
    return Request(greedy=greedy, inv_t=1.0 / tl.where(greedy, 1.0, t), stream=stream, idx=idx, valid=valid,
                   par=tl.load(par_row + idx, mask=valid, other=-2), tok=tl.load(tok_row + idx, mask=valid, other=-1),
                   u_test=u_test, par_row=par_row, tok_row=tok_row, n_real=n_real,
                   t_rows=target_ptr + b.to(tl.int64) * stride_tb, d_rows=draft_ptr + b.to(tl.int64) * stride_db,
                   stride_tt=stride_tt, stride_dt=stride_dt, V=V, masks=mask_ptr + b.to(tl.int64) * T * W, W=W,
                   path=acc_ptr + b * T, out_num=num_acc_ptr + b,
                   out_next=next_ptr + b, writer=tl.program_id(1) == 0)


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
def _logit(req, row, node, x):
    """row[x] / t at node, -inf for an x outside the vocabulary or disallowed by the node's bitmask row."""
    logit = tl.load(row + x, mask=(x >= 0) & (x < req.V), other=NEG_INF).to(tl.float32) * req.inv_t
    if req.W > 0:
        logit = tl.where(_allowed(req, node, x), logit, NEG_INF)
    return logit


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
    return Walk(kind, walk.node, walk.depth, walk.cursor, walk.c, walk.z, walk.lse_p, walk.lse_q)


@triton.jit
def _start(req, T):
    """The walk at the root: statistics at node 0, the path [0, -1, ...] (written by chunk 0)."""
    tl.store(req.path + req.idx, tl.where(req.idx == 0, 0, -1), mask=req.idx < tl.where(req.writer, T, 0))
    root = tl.full((), 0, tl.int32)
    zero = tl.full((), 0.0, tl.float32)
    return Walk(kind=root + STATS, node=root, depth=root, cursor=root, c=zero, z=zero + 1.0, lse_p=zero, lse_q=zero)


@triton.jit
def _load_state(state_i_ptr, state_f_ptr, buf):
    """Request program_id(0)'s state in buffer `buf`."""
    rec = buf * tl.num_programs(0) + tl.program_id(0)
    si = state_i_ptr + rec * STATE_INTS
    sf = state_f_ptr + rec * STATE_FLOATS
    return Walk(kind=tl.load(si + KIND), node=tl.load(si + NODE), depth=tl.load(si + DEPTH),
                cursor=tl.load(si + CURSOR), c=tl.load(sf + C), z=tl.load(sf + Z), lse_p=tl.load(sf + LSE_P),
                lse_q=tl.load(sf + LSE_Q))


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
    tl.store(sf + C, walk.c, mask=mask)
    tl.store(sf + Z, walk.z, mask=mask)
    tl.store(sf + LSE_P, walk.lse_p, mask=mask)
    tl.store(sf + LSE_Q, walk.lse_q, mask=mask)


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
def _prefetch(row, lo, hi, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr):
    cols = lo + tl.arange(0, BLOCK_V)
    tile_next = tl.load(row + cols, mask=cols < hi, other=NEG_INF)
    tile_later = tile_next
    if PREFETCH == 2:
        tile_later = tl.load(row + cols + BLOCK_V, mask=cols + BLOCK_V < hi, other=NEG_INF)
    return tile_next, tile_later


@triton.jit
def _next_tile(row, start, hi, tile_next, tile_later, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr):
    ahead = start + PREFETCH * BLOCK_V + tl.arange(0, BLOCK_V)
    new = tl.load(row + ahead, mask=ahead < hi, other=NEG_INF)
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
    """Pass walk.kind over chunk s of the node's rows, as a `Chunks` of scalars. STATS: (max, sum exp(. - max))
    of target/t (greedy: the max alone) and, where `use_q`, of draft/t, and the chunk's first argmax of target;
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
    a_next, a_later = _prefetch(t_row, lo, hi, BLOCK_V, PREFETCH)
    b_next, b_later = a_next, a_later  # (the draft's tiles exist only with draft logits)
    if HAS_DRAFT:
        b_next, b_later = _prefetch(d_row, lo, hi_q, BLOCK_V, PREFETCH)
    for start in range(lo, hi, BLOCK_V):
        a, a_next, a_later = _next_tile(t_row, start, hi, a_next, a_later, BLOCK_V, PREFETCH)
        b = a
        if HAS_DRAFT:
            b, b_next, b_later = _next_tile(d_row, start, hi_q, b_next, b_later, BLOCK_V, PREFETCH)
        # logits / t here, in the block before the pass's own fold: in one block, fp fusion would contract
        # `x * inv_t - m` into one fma (another rounding: other results on a GPU than the interpreter's checks)
        a = a.to(tl.float32) * req.inv_t
        b = b.to(tl.float32) * req.inv_t
        if req.W > 0:
            ok = _allowed(req, walk.node, start + ar)
            a = tl.where(ok, a, NEG_INF)
            b = tl.where(ok, b, NEG_INF)
        if stats:
            best = tl.where(a > m_p, start + ar, best)  # strictly greater: a lane keeps its first maximum
            if req.greedy:  # the argmax alone: no exp
                m_p = tl.maximum(m_p, a)
            else:
                m_p, s_p = _lane_lse(m_p, s_p, a)
            if HAS_DRAFT:
                m_q, s_q = _lane_lse(m_q, s_q, b)
        elif HAS_DRAFT:  # ZPASS: the residual's per-lane sums, in the accumulator of target's sums
            s_p += _residual(a, b, walk.lse_p, walk.lse_q, walk.c, True)
    if not stats:
        m_p = tl.full([BLOCK_V], 0.0, tl.float32)  # the residual's sums merge against max 0: a plain sum
    max_p, sum_p = _merge_lse(m_p, s_p)
    max_q, sum_q = _merge_lse(m_q, s_q)
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
    kind, node, depth, cursor, c, z, lse_p, lse_q = walk
    child = _first_child(req, node, node, req.tok == argmax, T_BLOCK)
    if child < T_BLOCK:
        depth = _descend(req, child, depth)
        node = child
    else:
        _emit(req, depth, argmax, req.writer)
        kind = tl.full((), DONE, tl.int32)
    return Walk(kind, node, depth, cursor, c, z, lse_p, lse_q)


@triton.jit
def _start_node(walk, chunks):
    """Sampling, after the statistics: the node's log-sum-exps and its first residual r = p (c = 0, Z = 1),
    whose chunk masses a draw at a leaf uses."""
    max_p, sum_p = _merge_lse(chunks.max_p, chunks.sum_p)
    max_q, sum_q = _merge_lse(chunks.max_q, chunks.sum_q)
    lse_p = max_p + tl.log(sum_p)
    zero = tl.full((), 0.0, tl.float32)
    # cursor = node: no child tested yet
    walk = Walk(walk.kind, walk.node, walk.depth, walk.node, zero, zero + 1.0, lse_p, max_q + tl.log(sum_q))
    return walk, Residual(chunks.sum_p * tl.exp(chunks.max_p - lse_p), zero)


@triton.jit
def _after_z(walk, chunks):
    """After a Z pass: Z of the residual r = max(p - c q, 0), and r's chunk masses."""
    kind, node, depth, cursor, c, z, lse_p, lse_q = walk
    z = tl.reduce(chunks.mass, 0, _SUM)
    return Walk(kind, node, depth, cursor, c, z, lse_p, lse_q), Residual(chunks.mass, c)


@triton.jit
def _draft_accepts(req, node, x, u, c, z, lse_p, lse_q):
    """Draft logits: accept x iff u * q(x) < r(x) = max(p - c q, 0)(x) / z, on the logit ratio
    rho = q(x) / p(x): iff u * z * rho < 1 - c * rho (never an x with p(x) = 0)."""
    t_row, d_row = _rows(req, node)
    lp = _logit(req, t_row, node, x) - lse_p
    rho = tl.exp(_logit(req, d_row, node, x) - lse_q - tl.where(lp == NEG_INF, 0.0, lp))
    return (lp > NEG_INF) & (u * z * rho < 1.0 - c * rho)


@triton.jit
def _draft_verify(req, walk, res, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Draft logits (children i.i.d. from q), children in node order, one test per pass: the next child is
    accepted (descend: STATS), or rejected (the residual's c grows by its Z: the next child's test needs Z
    of the new residual, ZPASS; after the last child only a draw from it, TRIAL), or none is left (the draw
    from `res`, LOCATE)."""
    kind, node, depth, cursor, c, z, lse_p, lse_q = walk
    child = _first_child(req, node, cursor, req.valid, T_BLOCK)
    if child < T_BLOCK:
        cursor = child
        x, u = _child(req, child)
        if _draft_accepts(req, node, x, u, c, z, lse_p, lse_q):
            depth = _descend(req, child, depth)
            node = child
            kind = tl.full((), STATS, tl.int32)
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
    return Walk(kind, node, depth, cursor, c, z, lse_p, lse_q), res


@triton.jit
def _proposal_accepts(req, node, child, z, lse_p):
    """Given proposals: accept the child's token x iff u * z < p(x), never an x an earlier sibling proposed
    (already rejected). Returns (accepted, the residual mass z after a rejection)."""
    x, u = _child(req, child)
    t_row, _ = _rows(req, node)
    p = tl.exp(_logit(req, t_row, node, x) - lse_p)
    dup = tl.reduce(((req.par == node) & req.valid & (req.idx < child) & (req.tok == x)).to(tl.int32), 0, _MAX) > 0
    return (dup == 0) & (u * z < p), tl.where(dup, z, tl.maximum(z - p, 0.0))


@triton.jit
def _rejected_masses(req, node, lse_p, SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr):
    """Given proposals, every child rejected: p of the node's distinct child tokens, summed per chunk."""
    child = (req.par == node) & req.valid
    dup = tl.reduce(((req.tok[:, None] == req.tok[None, :]) & child[None, :]
                     & (req.idx[None, :] < req.idx[:, None])).to(tl.int32), 1, _MAX) > 0
    rejected = child & (dup == 0) & (req.tok >= 0) & (req.tok < req.V)
    if req.W > 0:  # a disallowed token has p = 0
        rejected = rejected & _allowed(req, node, req.tok)
    t_row, _ = _rows(req, node)
    p = tl.exp(tl.load(t_row + req.tok, mask=rejected, other=NEG_INF).to(tl.float32) * req.inv_t - lse_p)
    owner = req.tok // SPLIT_V
    return tl.reduce(tl.where(owner[:, None] == tl.arange(0, S_BLOCK)[None, :], p[:, None], 0.0), 0, _SUM)


@triton.jit
def _proposal_verify(req, walk, res, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                     S_BLOCK: tl.constexpr):
    """Given proposals (no draft logits): every child in node order in one go (the residual's mass is
    closed-form) until one is accepted (descend: STATS), else the draw (LOCATE) from p minus the rejected
    tokens, or from p itself (c = -1) when rounding left nothing of it."""
    kind, node, depth, cursor, c, z, lse_p, lse_q = walk
    accepted = tl.full((), T_BLOCK, tl.int32)
    child = _first_child(req, node, node, req.valid, T_BLOCK)
    while (child < T_BLOCK) & (accepted == T_BLOCK):
        ok, z = _proposal_accepts(req, node, child, z, lse_p)
        accepted = tl.where(ok, child, accepted)
        child = _first_child(req, node, child, req.valid, T_BLOCK)
    if accepted < T_BLOCK:
        depth = _descend(req, accepted, depth)
        node = accepted
        kind = tl.full((), STATS, tl.int32)
    else:
        kind = tl.full((), LOCATE, tl.int32)
        mass = res.mass - _rejected_masses(req, node, lse_p, SPLIT_V, S_BLOCK)
        if _total_mass(mass, NUM_SPLITS, S_BLOCK) > 0:
            res = Residual(mass, c)
        else:
            c = tl.full((), -1.0, tl.float32)
            res = Residual(res.mass, c)
    return Walk(kind, node, depth, cursor, c, z, lse_p, lse_q), res


@triton.jit
def _decide(req, walk, chunks, HAS_DRAFT: tl.constexpr, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
            SPLIT_V: tl.constexpr, S_BLOCK: tl.constexpr):
    """Merge the partials of the pass walk.kind (STATS or ZPASS) and walk on until the next pass is needed.
    Returns the walk and the `Residual` a draw (LOCATE) or the candidates (TRIAL) pick from."""
    res = Residual(chunks.mass, walk.c)  # (a greedy walk never draws)
    if req.greedy:
        walk = _greedy_step(req, walk, chunks, T_BLOCK, S_BLOCK)
    else:
        if walk.kind == STATS:
            walk, res = _start_node(walk, chunks)
        else:
            walk, res = _after_z(walk, chunks)
        if HAS_DRAFT:
            walk, res = _draft_verify(req, walk, res, T_BLOCK, NUM_SPLITS, S_BLOCK)
        else:
            walk, res = _proposal_verify(req, walk, res, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
    return walk, res


# ----------------------------------------------------------------------------------------------
# the draw's second level (a chunk's scan) and the candidates after a last rejection
# ----------------------------------------------------------------------------------------------
@triton.jit
def _tile(row, start, hi, ar):
    """Entries start + ar of a row, -inf past hi (hi = start: nothing is read)."""
    return tl.load(row + start + ar, mask=start + ar < hi, other=NEG_INF)


@triton.jit
def _locate(req, node, pick, thresh, c, lse_p, lse_q, HAS_DRAFT: tl.constexpr, SPLIT_V: tl.constexpr,
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
        a = _tile(t_row, start, hi, ar).to(tl.float32) * req.inv_t
        b = a
        if HAS_DRAFT:
            b = _tile(d_row, start, hi_q, ar).to(tl.float32) * req.inv_t
        if req.W > 0:
            ok = _allowed(req, node, cols)
            a = tl.where(ok, a, NEG_INF)
            b = tl.where(ok, b, NEG_INF)
        r = _residual(a, b, lse_p, lse_q, c, HAS_DRAFT)
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
    x = _locate(req, walk.node, pick, thresh, res.c, walk.lse_p, walk.lse_q, True, SPLIT_V, BLOCK_V)
    t_row, d_row = _rows(req, walk.node)
    p = tl.exp(_logit(req, t_row, walk.node, x) - walk.lse_p)
    q = tl.exp(_logit(req, d_row, walk.node, x) - walk.lse_q)
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
def _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, buf, IS_FIRST: tl.constexpr,
            HAS_DRAFT: tl.constexpr, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
            S_BLOCK: tl.constexpr, TRIALS: tl.constexpr):
    """The walk where the previous launch left it (buffer `buf`), its last pass merged and decided on; the
    first launch starts at the root. Returns the walk and the `Residual` of its draw."""
    # (only a decision leads to a draw)
    res = Residual(tl.full((S_BLOCK,), 0.0, tl.float32), tl.full((), 0.0, tl.float32))
    if IS_FIRST:
        walk = _start(req, T)
    else:
        walk = _load_state(state_i_ptr, state_f_ptr, buf)
        if walk.kind == TRIAL:
            if HAS_DRAFT:
                walk = _merge_candidates(req, walk, part_f_ptr, part_i_ptr, buf, NUM_SPLITS, S_BLOCK, TRIALS)
        elif walk.kind != DONE:
            walk, res = _decide(req, walk, _load_chunks(part_f_ptr, part_i_ptr, buf, walk.kind, NUM_SPLITS, S_BLOCK),
                                HAS_DRAFT, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
    return walk, res


@triton.jit(do_not_specialize=["offset_lo", "offset_hi", "read_buf"])
def _split_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                  mask_ptr, acc_ptr, num_acc_ptr, next_ptr, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr,
                  T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, read_buf,
                  HAS_DRAFT: tl.constexpr, HAS_OFFSETS: tl.constexpr, IS_FIRST: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr,
                  T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, TRIALS: tl.constexpr):
    """A split launch, grid (B, NUM_SPLITS): merge the previous launch's partials and decide (every program
    alike), store the state, then run this program's chunk of the next pass, or its part of the draw."""
    split = tl.program_id(1)
    req = _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, acc_ptr, num_acc_ptr, next_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo,
                   offset_hi, HAS_OFFSETS, T_BLOCK)
    walk, res = _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, read_buf, IS_FIRST, HAS_DRAFT,
                        T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, TRIALS)
    buf = 1 - read_buf
    _store_state(state_i_ptr, state_f_ptr, buf, walk, req.writer)
    if walk.kind == LOCATE:
        pick, thresh = _pick_chunk(res.mass, _uniform(req.stream, walk.node, U_DRAW), NUM_SPLITS, S_BLOCK)
        if split == pick:  # the program whose chunk holds the threshold draws and writes the outputs
            token = _locate(req, walk.node, pick, thresh, res.c, walk.lse_p, walk.lse_q, HAS_DRAFT, SPLIT_V, BLOCK_V)
            _emit(req, walk.depth, token, True)
    elif walk.kind == TRIAL:
        if HAS_DRAFT:  # candidates j = split, split + NUM_SPLITS, ...: this program's first accepted one
            first, token = _first_accepted(req, walk, res, split, NUM_SPLITS, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V,
                                           TRIALS)
            _, pi = _part_records(part_f_ptr, part_i_ptr, buf, split, NUM_SPLITS)
            tl.store(pi + CANDIDATE, first)
            tl.store(pi + CANDIDATE_TOKEN, token)
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
        token = _locate(req, walk.node, pick, thresh, res.c, walk.lse_p, walk.lse_q, HAS_DRAFT, SPLIT_V, BLOCK_V)
        _emit(req, walk.depth, token, req.writer)
        walk = _with_kind(walk, tl.full((), DONE, tl.int32))
    return walk


@triton.jit(do_not_specialize=["offset_lo", "offset_hi", "read_buf"])
def _walk_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                 mask_ptr, acc_ptr, num_acc_ptr, next_ptr, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr,
                 T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, read_buf,
                 HAS_DRAFT: tl.constexpr, HAS_OFFSETS: tl.constexpr, IS_FIRST: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr,
                 T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr, TRIALS: tl.constexpr):
    """The last launch, grid (B,): merge the last split launch's partials, decide, and finish the walk, each
    pass over the whole row in this one program."""
    req = _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, acc_ptr, num_acc_ptr, next_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo,
                   offset_hi, HAS_OFFSETS, T_BLOCK)
    walk, res = _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, read_buf, IS_FIRST, HAS_DRAFT,
                        T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, TRIALS)
    walk = _draw_if_due(req, walk, res, HAS_DRAFT, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V, TRIALS)
    while walk.kind != DONE:
        walk, res = _decide(req, walk, _row_pass(req, walk, HAS_DRAFT, T_BLOCK, NUM_SPLITS, SPLIT_V, BLOCK_V, S_BLOCK,
                                                 PREFETCH), HAS_DRAFT, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
        walk = _draw_if_due(req, walk, res, HAS_DRAFT, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V, TRIALS)


# Candidates the draw after a last rejection with draft logits tries before it falls back to the Z pass: each
# costs a scan of (a prefix of) one chunk of the target row instead of a pass over both rows, and is accepted
# with probability Z (the total variation between target and draft), so 8 leave ~0.3% of the draws to the
# fallback at Z = 0.5 and ~17% at Z = 0.2. Not a function of the schedule: results stay schedule invariant.
TRIALS = 8


def _config(T: int, V: int, elem_bytes: int, device: torch.device) -> dict:
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
    walker (cheapest; test_accept.py checks that the split schedules give identical results).
    """
    if device.type == "cuda":
        block_v = max(16, min(2048, triton.next_power_of_2(V)))
        num_splits = min(16, triton.cdiv(V, block_v))
        # a row of one chunk gains nothing from split launches: the walker alone, one launch
        return dict(block_v=block_v, num_splits=num_splits, split_steps=min(T + 1, 16) if num_splits > 1 else 0,
                    num_warps=8, prefetch=2 if elem_bytes <= 2 else 1, trials=TRIALS)
    return dict(block_v=16, num_splits=1, split_steps=0, num_warps=4, prefetch=1, trials=TRIALS)


def accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None,
           top_k=None, top_p=None, min_p=None, token_bitmask=None, *,
           block_v=None, num_splits=None, split_steps=None, num_warps=None, prefetch=None, trials=None):
    """Normalized arguments of the `specdec::accept` schema (validated by specdec.ops.accept).

    The grammar mask (token_bitmask) alone is fused: the kernel reads a walked row's bitmask words beside its
    logits (`_allowed`). With top_k / top_p / min_p, for now, the rows are processed before the kernel by
    specdec.sampling.processed_tree_logits (mask included; exact and sync-free, but a sort and a copy of every
    row, walked or not), and the kernel walks the processed rows as plain logits. Keyword tunables override
    `_config` (tests use them to compare schedules).
    """
    B, T, V = target_logits.shape
    dev = target_logits.device
    if any(f is not None for f in (top_k, top_p, min_p)):
        from ..sampling import processed_tree_logits
        target_logits, draft_logits = (
            None if x is None else processed_tree_logits(x, temperature, top_k, top_p, min_p, token_bitmask)
            for x in (target_logits, draft_logits))
        token_bitmask = None  # applied by the processing
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
    # walk state and chunk partials, double-buffered: launch `step` reads buffer (step + 1) % 2, writes step % 2
    state_i = torch.empty((2, B, STATE_INTS.value), dtype=torch.int32, device=dev)
    state_f = torch.empty((2, B, STATE_FLOATS.value), dtype=torch.float32, device=dev)
    part_f = torch.empty((2, B, S, PART_FLOATS.value), dtype=torch.float32, device=dev)
    part_i = torch.empty((2, B, S, PART_INTS.value), dtype=torch.int32, device=dev)
    has_offsets = offsets is not None
    offsets = offsets.contiguous() if has_offsets else seeds  # absent: any int tensor stands in, never read
    W = 0 if token_bitmask is None else token_bitmask.shape[-1]
    masks = num_nodes if token_bitmask is None else token_bitmask.contiguous()  # (W = 0: never read)
    args = (target, d, tokens.contiguous(), parents.contiguous(), temperature.contiguous(), seeds.contiguous(),
            num_nodes.contiguous(), offsets, masks, accepted, num_accepted, next_tokens, state_i, state_f, part_f,
            part_i, T, V, W, target.stride(0), target.stride(1), d.stride(0), d.stride(1), offset & 0x7FFFFFFF,
            offset >> 31)
    meta = dict(HAS_DRAFT=draft is not None, HAS_OFFSETS=has_offsets, NUM_SPLITS=S, SPLIT_V=split_v,
                BLOCK_V=cfg["block_v"], T_BLOCK=triton.next_power_of_2(T), S_BLOCK=triton.next_power_of_2(S),
                PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"], num_warps=cfg["num_warps"])
    steps = cfg["split_steps"]
    for step in range(steps):
        _split_kernel[(B, S)](*args, (step + 1) % 2, IS_FIRST=step == 0, **meta)
    _walk_kernel[(B,)](*args, (steps + 1) % 2, IS_FIRST=steps == 0, **meta)
    return accepted, num_accepted, next_tokens
