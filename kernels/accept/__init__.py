"""specdec.accept, backend="triton": greedy and exactly lossless rejection sampling over draft chains
and trees, fused from logits. The design (algorithm, parallel schedule, costs, the walk's states and their
transition table): docs/accept-kernel.md.

Shapes: target_logits (B, T, V) and draft_logits (B, T, V) or None (any float dtype, computed in float32: float64
rows come shifted into its range, `_in_float32_range`; last dim contiguous), tokens/parents (B, T) int32,
temperature (B,) float32 (below GREEDY_BELOW, 1e-5: greedy), seeds (B,) int64, num_nodes (B,) int32, offset
int >= 0 and offsets (B,) int or None (request b's stream offset is offset + offsets[b], read on the device),
top_k / top_p / min_p (B,) or None and token_bitmask (B, T, ceil(V/32)) int32 or None (all applied in the
kernel: `_allowed`, and filters.py).
Returns accepted_nodes (B, T) int32 (the path from node 0, padded with -1), num_accepted (B,) int32,
next_tokens (B,) int64, then the logprob outputs (`accept`). Semantics are those of reference.accept.
Two switches of the input form (constexprs; everything below is unchanged by them):
  * PROBS: the rows hold probabilities (unnormalized, 0 = impossible), which mean what their logs mean as
    logits: each entry's log is taken in float32 as it is read (`_load_row`, then `_row_logits`; a masked lane
    reads 0, i.e. -inf), never a log of a whole row outside the kernel;
  * PACKED: target / draft rows (N, V) and token_bitmask (N, ceil(V/32)) are packed, node i of request b being
    row row_offsets[b] + i; tokens / parents / num_nodes arrive padded (B, T), T = max_nodes. Only the request's
    row bases change (`_request`); the launch still depends on B, T and V alone.

Reading order: the entry kernel `_accept_kernel` (launch.py: `_request`, `_resume`, then a split launch's chunk
pass or the walker's loop) -> the decision after a pass (decide.py: `_decide`, `_select_decide`) -> `_verify` ->
the verifier: tokenwise.py (greedy, draft logits, given proposals), block.py or traversal.py. What they use:
passes.py (the passes over a chunk or a row, the draw, the candidates), filters.py (top-k / top-p / min-p
thresholds), penalties.py (step 0 at each read of a row), rows.py (the request and every read of its rows),
records.py (the walk's kinds and transition table, the named tuples, the records between launches); after the
walk, logprobs.py (the logprob outputs). This file: the host side, the launcher `accept` and
the schedule `_config`.
"""
from __future__ import annotations

import torch
import triton

from specdec._layout import unpack_bitmask

from .launch import _accept_kernel
from .logprobs import emitted_logprobs, empty_logprobs
from .penalties import penalty_args, penalized_rows
from .records import (
    FILTER_ORDERS, PART_FLOATS, PART_INTS, SEARCH_DOUBLES, SEARCH_INTS, STATE_FLOATS, STATE_INTS, search_floats)

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
    the next two for 16-bit logits so that a CTA keeps as many bytes in flight as with fp32; registers and
    spills of every launch variant: scripts/accept_codegen.py; no barrier or shuffle inside the statistics
    loop), up to 16 chunks per row (V = 128K: 8192-entry
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


def _in_float32_range(rows, as_logits=False, allowed=None):
    """Rows as the kernel reads them (last dim contiguous). It computes in float32, so a float64 tensor comes as
    the same law within float32's range: each row of logits minus its largest finite allowed value (computed in
    float64; a copy, of float64 rows only; allowed: the rows' grammar mask, same shape, or None: the law is the
    masked row, so a disallowed 1e300 must not push the allowed values out of float32's range). A shift changes
    no law and no filter, a huge finite value read as float32 would be inf, and after it the row's max is 0 and a
    value below it stays below it in float32 (a difference smaller than float32's smallest normal value, 1.2e-38,
    which would round to 0 or a subnormal, is made that value: exp of either is 1 in float32, so no law changes):
    greedy's argmax is the float64 one. Other dtypes fit float32 as they are. as_logits: the rows are
    probabilities, returned as
    their float64 logs (the law they mean; 0 is -inf), shifted the same way, for rows that hold float64
    probabilities (1 - 2**-53 and 1, a float32 tie, stay apart as logs)."""
    if as_logits:
        rows = rows.double().log()
    if rows.dtype == torch.float64:
        finite = torch.isfinite(rows)
        counted = finite if allowed is None else finite & allowed
        top = torch.where(counted, rows, -torch.inf).amax(-1, keepdim=True)
        rows = rows - torch.where(torch.isfinite(top), top, 0.0)  # (keeps a column-major row's strides)
        rows = torch.where((rows < 0) & (rows > -FLOAT32_TINY_NORMAL), -FLOAT32_TINY_NORMAL, rows)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None,
           top_k=None, top_p=None, min_p=None, token_bitmask=None, method="token", probs=False, row_offsets=None,
           repetition_penalty=None, frequency_penalty=None, presence_penalty=None, output_token_counts=None,
           prompt_token_mask=None, logit_bias_ids=None, logit_bias_values=None, min_tokens=None, stop_token_ids=None,
           filter_order="hf", return_logprobs=-1, logprobs_mode="raw", *, block_v=None, num_splits=None,
           split_steps=None, num_warps=None, prefetch=None, trials=None, num_pivots=None, cap=None, select_block=None,
           pair_block=None):
    """Normalized arguments of the `specdec::accept` schema (validated by specdec.ops.accept).

    Everything is fused: the grammar mask (token_bitmask) is read beside a walked row's logits (`_allowed`),
    and top_k / top_p / min_p become one threshold per walked row, found by the kernel's own passes over it
    (filters.py): no sort, no processed copy of any row. method "block" (with draft logits; chains,
    checked by specdec.ops.accept): block verification, `_block_step`; method "traversal" (with draft logits;
    any tree): traversal verification, `_traversal_step` (its node records after the walk state in state_f).
    Greedy requests take the greedy walk whatever the method. probs=True (PROBS): target_logits /
    draft_logits hold probabilities, read as their logs entry by entry. row_offsets (B,) int (PACKED): the rows
    are packed, (N, V) and token_bitmask (N, W), request b's node i at row row_offsets[b] + i (tokens, parents,
    num_nodes (B, T) padded by specdec.ops.accept); read in place. Step 0 (repetition_penalty ...
    stop_token_ids, per request, None = off; HAS_PENALTIES) is fused into every read of a walked row
    (penalties.py: the node's counts are the output counts plus its path's tokens); float64 rows get it on the
    host, in float64, in the copy `_in_float32_range` makes of them. filter_order "hf" / "vllm" / "sglang"
    (FILTER_ORDER) picks the set top-p normalizes over (filters.py). return_logprobs >= 0: the emitted tokens'
    logprobs and top entries, one program per (request, position) after the walk, one read of the position's
    row each (logprobs.py; "processed" with filters: through the threshold the walk recorded); the
    launch configuration still depends on shapes only, and nothing syncs with the host.
    Returns the op's six outputs: accepted_nodes, num_accepted, next_tokens, logprobs (B, T) / (B, 0),
    top_logprobs (B, T, N) / (B, 0, 0), top_token_ids (B, T, N) / (B, 0, 0).
    Keyword tunables override `_config` (tests use them to compare schedules, and a small `cap` / `num_pivots` to
    exercise the long searches).
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
        return (accepted, num_accepted, next_tokens, *empty_logprobs(B, T, return_logprobs, dev))
    # float64 probabilities come as their logs (both laws alike: the launch has one PROBS switch)
    logs = probs and any(x is not None and x.dtype == torch.float64 for x in (target_logits, draft_logits))
    probs = probs and not logs
    float64 = any(x is not None and x.dtype == torch.float64 for x in (target_logits, draft_logits))
    pen = penalty_args(B, V, dev, repetition_penalty, frequency_penalty, presence_penalty, output_token_counts,
                       prompt_token_mask, logit_bias_ids, logit_bias_values, min_tokens, stop_token_ids)
    # Step 0 on the host, in float64, for float64 rows (on the copy the shift makes anyway) and for probabilities:
    # their penalized float64 logs, shifted by the row's max, keep apart near-equal probabilities (greedy's argmax)
    # that penalized logs rounded to float32 in the kernel would tie.
    host_step0 = pen is not None and (float64 or probs)
    has_penalties = pen is not None and not host_step0
    raw_target, raw_logs = target_logits, logs or probs  # (the raw logprobs' rows: before step 0)
    if host_step0:
        rows = [None if x is None else penalized_rows(x.double().log() if logs or probs else x, pen, tokens,
                                                      parents, row_offsets) for x in (target_logits, draft_logits)]
        target_logits, draft_logits, logs, probs, float64 = rows[0], rows[1], False, False, True
    allowed = unpack_bitmask(token_bitmask, V) if float64 and token_bitmask is not None else None
    target = _in_float32_range(target_logits, logs, allowed)
    draft = None if draft_logits is None else _in_float32_range(draft_logits, logs, allowed)
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
        # (the float records followed by the nodes' target thresholds, which the processed logprobs read)
        search = [torch.empty((2, B, 2, SEARCH_INTS.value), dtype=torch.int32, device=dev), search_floats(B, T, dev),
                  torch.empty((2, B, 2, SEARCH_DOUBLES.value), dtype=torch.float64, device=dev)]
        select = [torch.empty((2, B, S, 2, n), dtype=dtype, device=dev) for n, dtype in
                  ((NP, torch.int32), (NP, torch.float64), (cap, torch.float32))]
    else:  # any tensors stand in, never read
        top_k = top_p = min_p = num_nodes
        search = [state_i, state_f, state_f]
        select = [state_i, state_f, state_f]
    # (request stride, node row stride) of a row tensor: packed rows (N, V) have no request stride
    strides = (lambda x: (0, x.stride(0))) if packed else (lambda x: (x.stride(0), x.stride(1)))
    if pen is None:  # any tensors stand in, never read
        pen = (num_nodes,) * 10 + (0,) * 4
    args = (target, d, tokens.contiguous(), parents.contiguous(), temperature.contiguous(), seeds.contiguous(),
            num_nodes.contiguous(), offsets, masks, row_offsets, top_k, top_p, min_p, accepted, num_accepted,
            next_tokens, state_i, state_f, part_f, part_i, *search, *select, T, V, W, *strides(target), *strides(d),
            offset & 0x7FFFFFFF, offset >> 31, *pen)
    meta = dict(HAS_DRAFT=draft is not None, HAS_OFFSETS=has_offsets, HAS_FILTERS=has_filters, PROBS=bool(probs),
                PACKED=packed, BLOCK=method == "block" and draft is not None, TRAVERSAL=traversal, NUM_SPLITS=S,
                SPLIT_V=split_v, BLOCK_V=cfg["block_v"], T_BLOCK=triton.next_power_of_2(T),
                S_BLOCK=triton.next_power_of_2(S), PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"], NUM_PIVOTS=NP,
                CAP=cap, SELECT_BLOCK=cfg["select_block"], PAIR_BLOCK=cfg["pair_block"], num_warps=cfg["num_warps"],
                HAS_PENALTIES=has_penalties, FILTER_ORDER=FILTER_ORDERS[filter_order])
    steps = cfg["split_steps"]
    for step in range(steps):
        _accept_kernel[(B, S)](*args, (step + 1) % 2, WALKER=False, IS_FIRST=step == 0, **meta)
    _accept_kernel[(B,)](*args, (steps + 1) % 2, WALKER=True, IS_FIRST=steps == 0, **meta)
    raw_rows = None
    if float64 and return_logprobs >= 0 and logprobs_mode == "raw":
        raw_rows = _in_float32_range(raw_target, raw_logs)
    return (accepted, num_accepted, next_tokens, *emitted_logprobs(args, meta, return_logprobs, logprobs_mode,
                                                                   raw_rows))
