"""Token-wise verification, one decision after a pass at the walk's node: greedy (`_greedy_step`), draft logits
(`_draft_verify`: one child's test per pass) and given proposals (`_proposal_verify`: every child in one go)."""
from __future__ import annotations

import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _elementwise_max as _MAX
from triton.language.standard import _elementwise_min as _MIN
from triton.language.standard import _sum_combine as _SUM

from .passes import _total_mass
from .records import DONE, FROM_P, LOCATE, NEG_INF, Residual, STATS, TRIAL, ZPASS, _updated
from .rows import _child, _descend, _emit, _first_child, _kept, _load_row, _log_prob, _rows, _scaled, _values


@triton.jit
def _greedy_step(req, walk, chunks, T_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr):
    """Greedy, after the statistics: descend into the first child whose token is the row's argmax (the
    first index on ties: the first chunk holding the max), else emit the argmax."""
    sidx = tl.arange(0, S_BLOCK)
    first = tl.reduce(tl.where(chunks.max_p == tl.reduce(chunks.max_p, 0, _MAX), sidx, S_BLOCK), 0, _MIN)
    argmax = tl.reduce(tl.where(sidx == first, chunks.argmax, 0), 0, _SUM)
    child = _first_child(req, walk.node, walk.node, req.tok == argmax, T_BLOCK)
    if child < T_BLOCK:
        walk = _updated(walk, node=child, depth=_descend(req, child, walk.depth))
    else:
        _emit(req, walk.depth, argmax, req.writer)
        walk = _updated(walk, kind=tl.full((), DONE, tl.int32))
    return walk


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
    node = walk.node
    child = _first_child(req, node, walk.cursor, req.valid, T_BLOCK)
    if child < T_BLOCK:
        x, u = _child(req, child)
        if _draft_accepts(req, node, x, u, walk.c, walk.z, walk.law_p, walk.law_q, walk.tau_p, walk.tau_q):
            unknown = tl.full((), NEG_INF, tl.float32)  # the child's thresholds are not known yet
            walk = _updated(walk, kind=tl.full((), STATS, tl.int32), node=child, depth=_descend(req, child, walk.depth),
                            cursor=child, sel=tl.full((), 0, tl.int32), tau_p=unknown, tau_q=unknown)
        else:  # the candidates draw from `res`, the residual before this rejection
            more = _first_child(req, node, child, req.valid, T_BLOCK) < T_BLOCK
            walk = _updated(walk, kind=tl.where(more, ZPASS, TRIAL).to(tl.int32), cursor=child, c=walk.c + walk.z)
    elif (not _total_mass(res.mass, NUM_SPLITS, S_BLOCK) > 0) & (walk.c != 0.0):
        # the residual rounded to zero (a rejection of probability ~0): p's chunk masses, then the draw.
        # Once only: p's own masses (c = 0) that are not > 0 are bad input (NaN, or a row without a finite
        # logit); the draw then finds no token and the walk ends with token 0 (`_emit`).
        walk = _updated(walk, kind=tl.full((), ZPASS, tl.int32), c=tl.full((), 0.0, tl.float32))
    else:
        walk = _updated(walk, kind=tl.full((), LOCATE, tl.int32))
    return walk, res


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
    raw = _values(req, node, req.tok, _load_row(t_row + req.tok, rejected, req.probs))
    p = tl.exp(_scaled(req, _kept(req, node, req.tok, raw, tau_p), law_p) - law_p.lse)  # (a dropped token: p = 0)
    owner = req.tok // SPLIT_V
    return tl.reduce(tl.where(owner[:, None] == tl.arange(0, S_BLOCK)[None, :], p[:, None], 0.0), 0, _SUM)


@triton.jit
def _proposal_verify(req, walk, res, T_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_V: tl.constexpr,
                     S_BLOCK: tl.constexpr):
    """Given proposals (no draft logits): every child in node order in one go (the residual's mass is
    closed-form) until one is accepted (descend: STATS), else the draw (LOCATE) from p minus the rejected
    tokens, or from p itself (c = FROM_P) when rounding left nothing of it."""
    node = walk.node
    z = walk.z
    accepted = tl.full((), T_BLOCK, tl.int32)
    child = _first_child(req, node, node, req.valid, T_BLOCK)
    while (child < T_BLOCK) & (accepted == T_BLOCK):
        ok, z = _proposal_accepts(req, node, child, z, walk.law_p, walk.tau_p)
        accepted = tl.where(ok, child, accepted)
        child = _first_child(req, node, child, req.valid, T_BLOCK)
    if accepted < T_BLOCK:
        unknown = tl.full((), NEG_INF, tl.float32)  # the child's thresholds are not known yet
        walk = _updated(walk, kind=tl.full((), STATS, tl.int32), node=accepted,
                        depth=_descend(req, accepted, walk.depth), z=z, sel=tl.full((), 0, tl.int32), tau_p=unknown,
                        tau_q=unknown)
    else:
        mass = res.mass - _rejected_masses(req, node, walk.law_p, walk.tau_p, SPLIT_V, S_BLOCK)
        if _total_mass(mass, NUM_SPLITS, S_BLOCK) > 0:
            walk = _updated(walk, kind=tl.full((), LOCATE, tl.int32), z=z)
            res = Residual(mass, walk.c)
        else:
            walk = _updated(walk, kind=tl.full((), LOCATE, tl.int32), c=tl.full((), FROM_P, tl.float32), z=z)
            res = Residual(res.mass, walk.c)
    return walk, res
