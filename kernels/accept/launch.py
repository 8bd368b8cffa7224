"""The entry kernel `_accept_kernel`: one launch of a walk, a split launch (grid (B, NUM_SPLITS), one chunk of a
pass per program) or the walker (grid (B,), the walk finished in one program), both starting with `_resume`."""
from __future__ import annotations

import triton
import triton.language as tl

from .decide import _decide, _select_decide
from .filters import _idle_search, _select_chunk
from .passes import _after_candidates, _chunk_pass, _first_accepted, _locate, _merge_candidates, _pick_chunk, _row_pass
from .records import (
    ARGMAX, CANDIDATE, CANDIDATE_TOKEN, DONE, LOCATE, MASS, MAX_P, MAX_Q, Residual, SELECT, STATS, SUM_P, SUM_Q, TRIAL,
    U_DRAW, _load_chunks, _load_search, _load_state, _node_thresholds, _part_records, _select_buffers, _start,
    _store_search, _store_state, _updated)
from .penalties import _request_penalties
from .rows import _emit, _request, _uniform, _uses_q


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
def _split_part(req, walk, res, sp, sq, sb, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, buf, split,
                HAS_DRAFT: tl.constexpr, HAS_FILTERS: tl.constexpr, TRAVERSAL: tl.constexpr, T_BLOCK: tl.constexpr,
                NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, S_BLOCK: tl.constexpr,
                PREFETCH: tl.constexpr, TRIALS: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
                SELECT_BLOCK: tl.constexpr):
    """A split launch's program after the decision: the state for the next launch (buffer `buf`), then this
    program's chunk of the next pass, or its part of the draw."""
    _store_state(state_i_ptr, state_f_ptr, buf, walk, req.writer, TRAVERSAL)
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
        walk = _updated(walk, kind=tl.full((), DONE, tl.int32))
    return walk


@triton.jit
def _walk_on(req, walk, res, sp, sq, sb, buf, HAS_DRAFT: tl.constexpr, HAS_FILTERS: tl.constexpr,
             BLOCK: tl.constexpr, TRAVERSAL: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
             BLOCK_V: tl.constexpr, T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
             TRIALS: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr, SELECT_BLOCK: tl.constexpr,
             PAIR_BLOCK: tl.constexpr):
    """The walker after the decision: the walk finished in this program, each pass over the whole row (a SELECT
    pass's partials through buffer `buf`, which it no longer needs: barriers order the program's own stores and
    loads)."""
    walk = _draw_if_due(req, walk, res, HAS_DRAFT, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V, TRIALS)
    while walk.kind != DONE:
        if walk.kind == SELECT:
            if HAS_FILTERS:
                tl.debug_barrier()  # (the buffer's previous readers are done)
                for s in range(NUM_SPLITS):
                    _select_chunk(req, walk, sp, sq, s, sb, buf, HAS_DRAFT, NUM_SPLITS, NUM_PIVOTS, CAP, SPLIT_V,
                                  SELECT_BLOCK)
                tl.debug_barrier()
                walk, res, sp, sq = _select_decide(req, walk, sp, sq, sb, buf, HAS_DRAFT, BLOCK, TRAVERSAL,
                                                   T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, NUM_PIVOTS, CAP, PAIR_BLOCK)
        else:
            walk, res, sp, sq = _decide(req, walk, _row_pass(req, walk, HAS_DRAFT, T_BLOCK, NUM_SPLITS, SPLIT_V,
                                                             BLOCK_V, S_BLOCK, PREFETCH), HAS_DRAFT, HAS_FILTERS,
                                        BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK)
        walk = _draw_if_due(req, walk, res, HAS_DRAFT, NUM_SPLITS, SPLIT_V, S_BLOCK, BLOCK_V, TRIALS)


@triton.jit(do_not_specialize=["offset_lo", "offset_hi", "read_buf"])
def _accept_kernel(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                   state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, search_i_ptr, search_f_ptr, search_d_ptr,
                   sel_count_ptr, sel_mass_ptr, sel_value_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt,
                   offset_lo, offset_hi, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, bias_ids_ptr,
                   bias_values_ptr, min_tokens_ptr, stop_ids_ptr, generated_ptr, counted, prompt_words, K, S,
                   read_buf, WALKER: tl.constexpr, HAS_DRAFT: tl.constexpr,
                   HAS_OFFSETS: tl.constexpr, HAS_FILTERS: tl.constexpr, PROBS: tl.constexpr, PACKED: tl.constexpr,
                   BLOCK: tl.constexpr, TRAVERSAL: tl.constexpr, IS_FIRST: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr,
                   PREFETCH: tl.constexpr, TRIALS: tl.constexpr, NUM_PIVOTS: tl.constexpr, CAP: tl.constexpr,
                   SELECT_BLOCK: tl.constexpr, PAIR_BLOCK: tl.constexpr, HAS_PENALTIES: tl.constexpr,
                   FILTER_ORDER: tl.constexpr):
    """One launch of a walk: merge the previous launch's partials (buffer `read_buf`) and decide, every program
    alike (`_resume`); then a split launch (grid (B, NUM_SPLITS)) stores the state and runs its chunk of the next
    pass (`_split_part`), and the walker (WALKER, grid (B,), the last launch) finishes the walk (`_walk_on`).
    rep_ptr ... S: step 0's arguments (penalties.py `penalty_args`; read only with HAS_PENALTIES). search_f_ptr
    (HAS_FILTERS): the search records, then each node's target threshold, written where the walk finds its law
    (`_node_thresholds`; for the processed logprobs of filtered rows, logprobs.py)."""
    split = tl.program_id(1)  # (the walker's grid has one program per request: 0)
    pen = _request_penalties(tl.program_id(0), rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, bias_ids_ptr,
                             bias_values_ptr, min_tokens_ptr, stop_ids_ptr, generated_ptr, counted, prompt_words, K, S,
                             tokens_ptr, parents_ptr, T, V, PROBS, HAS_PENALTIES)
    req = _request(target_ptr, draft_ptr, tokens_ptr, parents_ptr, temp_ptr, seeds_ptr, num_nodes_ptr, offsets_ptr,
                   mask_ptr, row_offsets_ptr, top_k_ptr, top_p_ptr, min_p_ptr, acc_ptr, num_acc_ptr, next_ptr,
                   state_f_ptr, T, V, W, stride_tb, stride_tt, stride_db, stride_dt, offset_lo, offset_hi, pen,
                   _node_thresholds(search_f_ptr), HAS_OFFSETS, HAS_FILTERS, PROBS, PACKED, T_BLOCK, HAS_PENALTIES,
                   FILTER_ORDER)
    sb = _select_buffers(search_i_ptr, search_f_ptr, search_d_ptr, sel_count_ptr, sel_mass_ptr, sel_value_ptr)
    walk, res, sp, sq = _resume(req, T, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, sb, read_buf, IS_FIRST,
                                HAS_DRAFT, HAS_FILTERS, BLOCK, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, S_BLOCK, TRIALS,
                                NUM_PIVOTS, CAP, PAIR_BLOCK)
    if WALKER:
        _walk_on(req, walk, res, sp, sq, sb, read_buf, HAS_DRAFT, HAS_FILTERS, BLOCK, TRAVERSAL, NUM_SPLITS, SPLIT_V,
                 BLOCK_V, T_BLOCK, S_BLOCK, PREFETCH, TRIALS, NUM_PIVOTS, CAP, SELECT_BLOCK, PAIR_BLOCK)
    else:
        _split_part(req, walk, res, sp, sq, sb, state_i_ptr, state_f_ptr, part_f_ptr, part_i_ptr, 1 - read_buf, split,
                    HAS_DRAFT, HAS_FILTERS, TRAVERSAL, T_BLOCK, NUM_SPLITS, SPLIT_V, BLOCK_V, S_BLOCK, PREFETCH,
                    TRIALS, NUM_PIVOTS, CAP, SELECT_BLOCK)
