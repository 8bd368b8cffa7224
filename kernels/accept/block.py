"""Block verification of a chain (method "block", draft logits): `_block_step`, one decision per pass."""
from __future__ import annotations

import triton
import triton.language as tl

from .passes import _total_mass
from .records import (
    BLOCK_FROM_P, BLOCK_TAU_STATS, BLOCK_TAU_Z, LOCATE, NEG_INF, POS_INF, Residual, STATS, WALKING, ZPASS,
    _block_updated, _updated, _walk_to)
from .rows import _child, _log_prob, _rows


@triton.jit
def _block_to(walk, kind, node, c, phase):
    """The walk at another step (`_walk_to`) in block verification's `phase`."""
    return _walk_to(walk, kind, node, c, block=_block_updated(walk.block, phase=phase))


@triton.jit
def _block_draw(req, walk, res):
    """The draw after block verification accepted nodes 1..tau of the chain (the walk at node tau, `res` the
    chunk masses of the law to draw from): the path is written, then LOCATE."""
    tau = walk.block.tau_node
    tl.store(req.path + req.idx, req.idx, mask=(req.idx >= 1) & (req.idx < tl.where(req.writer, tau + 1, 0)))
    walk = _updated(walk, kind=tl.full((), LOCATE, tl.int32), depth=tau, c=res.c)
    return walk, res


@triton.jit
def _block_step(req, walk, res, NUM_SPLITS: tl.constexpr, S_BLOCK: tl.constexpr):
    """Block verification of the request's chain (Sun et al., arXiv 2403.10444, Algorithm 2; the reference's
    block_weights), one decision per pass. Walking (WALKING), at node i after its statistics: i < gamma (not
    the root) needs S_i = sum max(p_i P_i - Q_i, 0) first: a Z pass with c = 1 / p_i gives S_i / p_i. Then
    h_i = S_i / (S_i + 1 - p_i) (h_gamma = p_gamma) and node i's test u_i < h_i makes i the last accepted node
    tau so far; the next weight p_{i+1} = min(p_i P_i(X_{i+1}) / Q_i(X_{i+1}), 1) from two lookups, and the walk
    moves to node i + 1, unless i = gamma or the weight is 0 (every later h is 0): then the draw at tau, from
    max(p_tau P_tau - Q_tau, 0) (tau = gamma: P_gamma), the Z-pass residual with c = 1 / p_tau. Back at an
    earlier tau (BLOCK_TAU_STATS: its statistics; BLOCK_TAU_Z: its residual's Z pass; BLOCK_FROM_P: a residual
    of mass 0 by rounding, P itself) the rows of tau are read again."""
    gamma = req.n_real - 1
    i = walk.node
    blk = walk.block
    if blk.phase == WALKING:
        tested = (walk.kind == ZPASS) | (i == gamma)  # (node i's statistics first, then its Z pass if i < gamma)
        if (walk.kind == STATS) & (i > 0) & (i < gamma):
            walk = _block_to(walk, ZPASS, i, 1.0 / blk.w, WALKING)
        else:
            w = blk.w
            tau_node = blk.tau_node
            w_tau = blk.w_tau
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
                ratio = tl.where(lq == NEG_INF, tl.where(lp > NEG_INF, POS_INF, 0.0),
                                 tl.exp(lp - tl.where(lq == NEG_INF, 0.0, lq)))
                nxt = tl.where(w == 0.0, 0.0, tl.minimum(w * ratio, 1.0))
            walk = _updated(walk, block=_block_updated(blk, w=nxt, tau_node=tau_node, w_tau=w_tau))
            if nxt > 0.0:
                walk = _block_to(walk, STATS, i + 1, 0.0, WALKING)
            elif tau_node == i:
                if i == gamma:  # the draw from P_gamma: its statistics' chunk masses
                    walk, res = _block_draw(req, walk, Residual(res.mass, 0.0 * res.c))
                elif walk.kind == ZPASS:  # the Z pass's residual is the draw's (S_i > 0: u_i < h_i)
                    walk, res = _block_draw(req, walk, res)
                else:  # tau = 0 at the root, after its statistics: max(P - Q, 0) needs its Z pass
                    walk = _block_to(walk, ZPASS, i, 1.0 / w_tau, BLOCK_TAU_Z)
            else:
                walk = _block_to(walk, STATS, tau_node, 0.0, BLOCK_TAU_STATS)
    elif blk.phase == BLOCK_TAU_STATS:
        if blk.tau_node == gamma:
            walk, res = _block_draw(req, walk, Residual(res.mass, 0.0 * res.c))
        else:
            walk = _block_to(walk, ZPASS, walk.node, 1.0 / blk.w_tau, BLOCK_TAU_Z)
    else:
        if (blk.phase == BLOCK_TAU_Z) & (not _total_mass(res.mass, NUM_SPLITS, S_BLOCK) > 0):
            walk = _block_to(walk, ZPASS, walk.node, 0.0, BLOCK_FROM_P)
        else:
            walk, res = _block_draw(req, walk, res)
    return walk, res
