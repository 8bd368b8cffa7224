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
so there are no atomics, no spin locks and no host syncs. SPLIT_STEPS such launches of `_accept_kernel`
run (grid (B, NUM_SPLITS)), then one walker launch of it (WALKER, grid (B,)) merges the last partials and
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

import torch
import triton

from .launch import _accept_kernel
from .records import PART_FLOATS, PART_INTS, SEARCH_DOUBLES, SEARCH_FLOATS, SEARCH_INTS, STATE_FLOATS, STATE_INTS

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
    walker (cheapest; tests/ops/accept/test_against_reference.py checks that the split schedules give identical
    results).
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
        _accept_kernel[(B, S)](*args, (step + 1) % 2, WALKER=False, IS_FIRST=step == 0, **meta)
    _accept_kernel[(B,)](*args, (steps + 1) % 2, WALKER=True, IS_FIRST=steps == 0, **meta)
    return accepted, num_accepted, next_tokens
