"""Traversal verification of a tree (method "traversal", draft logits): `_traversal_step`, one decision per pass.

The walk is the reference's post-order visit (`_traversal_verify`). At node v of weight w the current law
is L = max(p - c q, 0) / Z(c), one scalar c as in the token-wise walk (c = 0, Z = 1 after the statistics):
a failed child updates r = max(w L - q, 0) = (w / Z) max(p - c' q, 0) with c' = c + Z / w, so its mass is
S = (w / Z) Z(c') (one Z pass over v's rows) and the new law is max(p - c' q, 0) / Z(c'). A visit descends
into a child and may come back to v: v's state (c, Z, w, log-sum-exps, thresholds) is kept in v's node
record while its subtree is walked, never recomputed."""
from __future__ import annotations

import triton
import triton.language as tl
# Reductions call tl.reduce with tl.max/tl.min/tl.sum's own combine functions: the same code as those
# wrappers, without a device-function call per reduction (~0.3 ms each under the interpreter).
from triton.language.standard import _sum_combine as _SUM

from .passes import _total_mass
from .records import (
    C, LOCATE, LSE_P, LSE_Q, NEG_INF, RowLaw, SHIFT_P, SHIFT_Q, STATE_FLOATS, STATS, TAU_P, TAU_Q, TRAVERSAL_FROM_P,
    TRIAL, WEIGHT, Z, ZPASS, _traversal_updated, _updated, _walk_to)
from .rows import _child, _descend, _first_child, _log_prob, _rows


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
    tl.store(rec + WEIGHT, walk.traversal.w, mask=req.writer)
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
    w = walk.traversal.w
    weight = tl.minimum(w * tl.maximum(ratio - walk.c, 0.0) / tl.where(walk.z > 0, walk.z, 1.0), 1.0)
    weight = tl.where(lq == NEG_INF, 1.0, weight)
    return tl.where((lp == NEG_INF) | (not walk.z > 0) | (not w > 0), 0.0, weight)


@triton.jit
def _after_failed_child(walk, child):
    """Node v after child's subtree failed: its law becomes max(p - c' q, 0) / Z(c'), c' = c + Z / w; the Z pass
    next (walk.z keeps Z(c) through it for the new weight, `_weight_after_z`). A law of mass 0 (Z = 0, only at a
    node of weight 1) stays as it is."""
    c = tl.where(walk.z > 0, walk.c + walk.z / walk.traversal.w, walk.c)
    return _updated(walk, kind=tl.full((), ZPASS, tl.int32), cursor=child, c=c)


@triton.jit
def _weight_after_z(walk, z_before):
    """After the Z pass of a failed child's update: S = (w / Z(c)) Z(c') and w' = S / (S + 1 - w) (1 when
    S + 1 - w = 0: the failure was impossible). 1 - w first, so that the root (w = 1) keeps w = 1 exactly."""
    w = walk.traversal.w
    s = tl.where(z_before > 0, w / tl.where(z_before > 0, z_before, 1.0) * walk.z, 0.0)
    den = s + (1.0 - w)
    # (w = 1 stays 1 exactly: on a GPU fp32 division is within 2 ulp, and s / s below 1 would take a weight-1 node's
    # last failed child off the direct draw, `_try_child`'s certain)
    w = tl.where(den > 0, tl.minimum(s / tl.where(den > 0, den, 1.0), 1.0), 1.0)
    # (the root's weight is 1: its visit always emits)
    w = tl.where((walk.traversal.w == 1.0) | (walk.node == 0), 1.0, w)
    return _updated(walk, traversal=_traversal_updated(walk.traversal, w=w))


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
    back = _updated(walk, node=parent, depth=walk.depth - 1, c=tl.load(rec + C), z=tl.load(rec + Z),
                    law_p=RowLaw(tl.load(rec + SHIFT_P), tl.load(rec + LSE_P)),
                    law_q=RowLaw(tl.load(rec + SHIFT_Q), tl.load(rec + LSE_Q)), sel=tl.full((), 1, tl.int32),
                    tau_p=tl.load(rec + TAU_P), tau_q=tl.load(rec + TAU_Q),
                    traversal=_traversal_updated(walk.traversal, w=tl.load(rec + WEIGHT)))
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
        walk = _updated(walk, kind=tl.full((), STATS, tl.int32), node=child, depth=depth, cursor=child, c=zero,
                        z=zero + 1.0, sel=tl.full((), 0, tl.int32), tau_p=zero + NEG_INF, tau_q=zero + NEG_INF,
                        traversal=_traversal_updated(walk.traversal, w=w_c))
    else:
        last = _first_child(req, walk.node, child, req.valid, T_BLOCK) == T_BLOCK
        certain = last & (walk.traversal.w == 1.0)  # (w' = S / (S + 1 - w) = 1)
        walk = _after_failed_child(walk, child)
        if certain:
            walk = _updated(walk, kind=tl.full((), TRIAL, tl.int32))
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
    TRAVERSAL_FROM_P: the draw from p after a residual of mass 0 by rounding (its Z pass with c = 0)."""
    v = walk.node
    if walk.traversal.phase == TRAVERSAL_FROM_P:
        walk = _updated(walk, kind=tl.full((), LOCATE, tl.int32))
    else:
        if walk.kind == ZPASS:
            walk = _weight_after_z(walk, z_before)
        if not walk.traversal.w > 0:
            walk = _fail_to_parent(req, walk)
        else:
            child = _first_child(req, v, walk.cursor, req.valid, T_BLOCK)
            if child < T_BLOCK:
                walk = _try_child(req, walk, child, T_BLOCK)
            else:
                _, u = _child(req, v)
                if (v == 0) | (walk.cursor == v) | (u < walk.traversal.w):
                    if (not _total_mass(res.mass, NUM_SPLITS, S_BLOCK) > 0) & (walk.c != 0.0):
                        walk = _walk_to(walk, ZPASS, v, 0.0,
                                        traversal=_traversal_updated(walk.traversal, phase=TRAVERSAL_FROM_P))
                    else:
                        walk = _updated(walk, kind=tl.full((), LOCATE, tl.int32))
                else:
                    walk = _fail_to_parent(req, walk)
    return walk, res
