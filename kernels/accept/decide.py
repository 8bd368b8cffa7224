"""A decision: merge a pass's partials and walk on until the next pass is needed (`_decide`, and after a SELECT
pass `_select_decide`); sampling goes through `_verify` to the method's verifier."""
from __future__ import annotations

import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _sum_combine as _SUM

from .block import _block_step
from .filters import _after_search, _idle_search, _select_step, _start_search
from .records import Chunks, NEG_INF, Residual, RowLaw, STATS, _updated
from .rows import _merge_lse, _scaled, _shift, _uses_q
from .tokenwise import _draft_verify, _greedy_step, _proposal_verify
from .traversal import _traversal_step


@triton.jit
def _start_node(req, walk, chunks):
    """Sampling, after the statistics: the node's laws and its first residual r = p (c = 0, Z = 1), whose chunk
    masses a draw at a leaf uses. Every sampling node of the path gets here once its thresholds are known (after
    its last statistics pass, or a search's gathering: `_select_decide`), whatever the method, before any of its
    children is tested or its token drawn; with filters its target threshold is recorded here."""
    if req.record_taus:
        tl.store(req.taus + walk.node, walk.tau_p, mask=req.writer)
    max_p, sum_p = _merge_lse(chunks.max_p, chunks.sum_p, req.inv_t)
    max_q, sum_q = _merge_lse(chunks.max_q, chunks.sum_q, req.inv_t)
    law_p = RowLaw(_shift(max_p), tl.log(sum_p))
    zero = tl.full((), 0.0, tl.float32)
    # cursor = node: no child tested yet
    walk = _updated(walk, cursor=walk.node, c=zero, z=zero + 1.0, law_p=law_p,
                    law_q=RowLaw(_shift(max_q), tl.log(sum_q)))
    return walk, Residual(chunks.sum_p * tl.exp(_scaled(req, chunks.max_p, law_p) - law_p.lse), zero)


@triton.jit
def _after_z(walk, chunks):
    """After a Z pass: Z of the residual r = max(p - c q, 0), and r's chunk masses."""
    return _updated(walk, z=tl.reduce(chunks.mass, 0, _SUM)), Residual(chunks.mass, walk.c)


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
