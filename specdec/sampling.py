"""The processed law of `specdec.accept`, vectorized in PyTorch: for engines and drafters that must sample from
exactly the law accept verifies against, and for launchers that mask the logits before a kernel.

At temperature t >= GREEDY_BELOW (1e-5 as a float32) a row of logits is processed in this order
(specdec/reference.py spells out each step):
  1. mask: tokens the grammar disallows get -inf;
  2. temperature: l = logits / t (computed as (logits - the row's finite max) / t: no overflow);
  3. top-k: x is kept iff fewer than k allowed tokens have a strictly larger l (ties at the k-th value kept);
  4. top-p: with p the softmax of the kept tokens, x is kept iff the mass of the tokens with a strictly larger p
     is < top_p (the top token and the ties at the boundary are kept);
  5. min-p: x is kept iff p(x) >= min_p * max p;
  6. renormalize.
Greedy rows (t < GREEDY_BELOW, as in specdec.accept) are only masked: top-k, top-p and min-p never remove the
argmax.

Every kept set is an upper set of l (steps 3-5 keep the tokens at or above a threshold), so `keep_mask` is
`allowed & (logits >= threshold)` per row, and `processed_logits` (the dropped entries at -inf, the others
unchanged, in the original scale) satisfies softmax(processed_logits / t) == the processed law exactly: a
kernel that divides by t itself can take it as it is.

This implementation sorts each row (torch.sort, float64 math as the reference), in chunks of rows; it equals
reference.processed_keep exactly, ties included, and never syncs with the host. Parameters are per row:
top_k (N,) int (0 or >= V: off), top_p (N,) float (1: off), min_p (N,) float (0: off), each None (off for every
row) or a Python number (the same for every row).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ._layout import pack_bitmask, unpack_bitmask  # (public here: the grammar bitmask layout accept takes)
from .reference import GREEDY_BELOW

Param = Union[None, int, float, torch.Tensor]

_CHUNK_ELEMENTS = 1 << 22  # rows are processed in chunks of about this many entries (float64 sort buffers)


def _per_row(x: Param, N: int, dtype, device) -> Optional[torch.Tensor]:
    if x is None or isinstance(x, torch.Tensor):
        return None if x is None else x.to(device)
    return torch.full((N,), x, dtype=dtype, device=device)


def keep_mask(logits: torch.Tensor, temperature: Union[float, torch.Tensor], top_k: Param = None,
              top_p: Param = None, min_p: Param = None, allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, V) bool: the tokens the processed law keeps, for logits (N, V), temperature (N,) (or a float) and the
    per-row parameters. allowed: (N, V) bool (e.g. unpack_bitmask) or None. Greedy rows (t < GREEDY_BELOW) keep
    every allowed finite entry; rows left with no finite allowed entry keep nothing."""
    N, V = logits.shape
    dev = logits.device
    x = logits.double()
    if allowed is not None:
        x = x.masked_fill(~allowed, -math.inf)
    finite = x > -math.inf
    k, tp, mp = (_per_row(top_k, N, torch.int64, dev), _per_row(top_p, N, torch.float64, dev),
                 _per_row(min_p, N, torch.float64, dev))
    if k is None and tp is None and mp is None:
        return finite
    t = _per_row(temperature, N, torch.float64, dev).double()
    sampling = t >= GREEDY_BELOW
    # l = (x - the row's finite max) / t: logits / t up to a constant per row, which no filter sees, without overflow
    top = torch.where(torch.isfinite(x), x, -math.inf).amax(-1, keepdim=True)
    l = (x - torch.where(top > -math.inf, top, 0.0)) / torch.where(sampling, t, 1.0).unsqueeze(1)
    rows = max(1, _CHUNK_ELEMENTS // max(V, 1))
    thresholds = [_thresholds(l[i:i + rows], sampling[i:i + rows],
                              *(None if a is None else a[i:i + rows] for a in (k, tp, mp)))
                  for i in range(0, N, rows)]
    threshold = torch.cat(thresholds).unsqueeze(1)  # in l; -inf for greedy rows
    return finite & (l >= threshold)


def _thresholds(l, sampling, k, tp, mp) -> torch.Tensor:
    """(n,) the smallest kept l of each row (-inf: no filter, or a greedy row). l: (n, V) float64, the masked
    logits scaled as keep_mask scales them; sampling (n,) bool: the rows with t >= GREEDY_BELOW."""
    n, V = l.shape
    s = torch.sort(l, dim=-1, descending=True).values  # -inf last
    finite = s > -math.inf
    cols = torch.arange(V, device=l.device)
    thr = torch.full((n,), -math.inf, dtype=torch.float64, device=l.device)
    if k is not None:  # top-k: the k-th largest value (ties at it kept)
        on = sampling & (k > 0) & (k < V)
        kth = s.gather(1, (k.clamp(1, V) - 1).unsqueeze(1)).squeeze(1)
        thr = torch.where(on, torch.maximum(thr, kth), thr)

    def probs(kept):  # softmax of the kept (sorted) entries
        return torch.softmax(s.masked_fill(~kept, -math.inf), -1).nan_to_num(0.0)

    def smallest_kept(kept):  # the l of the last kept sorted entry; the top one at least
        last = (kept.sum(-1) - 1).clamp(min=0)
        return s.gather(1, last.unsqueeze(1)).squeeze(1)

    if tp is not None:  # top-p: keep a tie group iff the mass strictly above it is < top_p
        kept = finite & (s >= thr.unsqueeze(1))
        p = probs(kept)
        cum = p.cumsum(-1)
        start = torch.ones_like(finite)
        start[:, 1:] = s[:, 1:] != s[:, :-1]
        first = torch.where(start, cols, 0).cummax(-1).values  # first sorted index of each entry's tie group
        above = torch.where(first > 0, cum.gather(1, (first - 1).clamp(min=0)), 0.0)
        on = sampling & (tp < 1)
        thr = torch.where(on, torch.maximum(thr, smallest_kept(kept & (above < tp.unsqueeze(1)))), thr)
    if mp is not None:  # min-p: p(x) >= min_p * max p
        kept = finite & (s >= thr.unsqueeze(1))
        p = probs(kept)
        on = sampling & (mp > 0)
        keep_m = kept & (p >= mp.unsqueeze(1) * p[:, :1])
        thr = torch.where(on, torch.maximum(thr, smallest_kept(keep_m)), thr)
    return thr


def processed_logits(logits: torch.Tensor, temperature: Union[float, torch.Tensor], top_k: Param = None,
                     top_p: Param = None, min_p: Param = None, allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits (N, V) with the entries the processed law drops at -inf, the others unchanged (same dtype and
    scale): softmax(processed_logits / t) is the processed law, the argmax of a greedy row is the masked argmax."""
    return logits.masked_fill(~keep_mask(logits, temperature, top_k, top_p, min_p, allowed), -math.inf)


def processed_tree_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor] = None,
                          top_p: Optional[torch.Tensor] = None, min_p: Optional[torch.Tensor] = None,
                          token_bitmask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """accept's arguments as they reach a kernel (logits (B, T, V); temperature, top_k, top_p, min_p (B,) or None;
    token_bitmask (B, T, ceil(V/32)) int32 or None) -> (B, T, V) logits processed row by row: node i of request b
    with request b's parameters and node i's bitmask row. For target and draft logits alike."""
    B, T, V = logits.shape
    per_node = [None if a is None else a.repeat_interleave(T) for a in (temperature, top_k, top_p, min_p)]
    allowed = None if token_bitmask is None else unpack_bitmask(token_bitmask, V).reshape(B * T, V)
    return processed_logits(logits.reshape(B * T, V), *per_node, allowed=allowed).view(B, T, V)


def chain_acceptance_probs(target_logits: torch.Tensor, tokens: torch.Tensor, draft_logits: Optional[torch.Tensor],
                           temperature: torch.Tensor, params: "SamplingParams") -> torch.Tensor:
    """(B, T - 1) float32: for chain proposals (node d's parent is node d - 1; target_logits (B, T, V), tokens
    (B, T), draft_logits (B, T, V) or None, temperature (B,)), the probability that token-wise rejection sampling
    accepts level d once the path to it is accepted, with p the target's processed law at node d - 1: for a
    draft drawn from the drafter's law q there (draft_logits), sum_x min(p(x), q(x)) (the mean over the draw of
    min(1, p(x) / q(x)), accept's chance for the token drawn); for a given proposal x (no draft_logits), p(x). The
    accept/reject outcome has the same mean, with more chance in it: the adaptive policy learns sampled requests'
    rates from these. Rows of greedy requests (temperature < GREEDY_BELOW) are meaningless."""
    t = temperature.clamp(min=GREEDY_BELOW).view(-1, 1, 1)

    def law(logits):
        x = params.process(logits[:, :-1].float(), temperature)
        top = x.amax(-1, keepdim=True)  # (subtracted first: huge logits / t overflow)
        return torch.softmax((x - torch.where(torch.isfinite(top), top, 0.0)) / t, -1)

    p = law(target_logits)
    if draft_logits is None:
        return p.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.minimum(p, law(draft_logits)).sum(-1).clamp(max=1.0)


class SamplingParams(NamedTuple):
    """A batch's sampling filters, as the loop hands them to its drafter and to `specdec.accept`: top_k (B,)
    int32, top_p and min_p (B,) float32, each None when off for every request; bitmask (B, W) int32 or None:
    the tokens each request may emit at every position, packed (vLLM's `allowed_token_ids`, or a regex's
    character class over a byte vocabulary), a grammar mask that does not change along the sequence."""
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    bitmask: Optional[torch.Tensor] = None

    @staticmethod
    def for_batch(B: int, V: int, device, top_k=0, top_p=1.0, min_p=0.0,
                  allowed_token_ids: Optional[Sequence[int]] = None) -> "SamplingParams":
        """Parameters one for every request (a number) or one per request (a sequence of B); off values (top_k
        0, top_p 1, min_p 0) everywhere give None. allowed_token_ids: None (every token) or the token ids every
        request may emit."""
        def per_request(name, x, dtype, off):
            values = [x] * B if isinstance(x, (int, float)) else list(x)
            if len(values) != B:
                raise ValueError(f"{name}: give one value or one per request ({B}), got {len(values)}")
            return None if all(v == off for v in values) else torch.tensor(values, dtype=dtype, device=device)
        bitmask = None
        if allowed_token_ids is not None:
            ids = torch.as_tensor(list(allowed_token_ids), dtype=torch.long)
            if ids.numel() == 0 or bool(((ids < 0) | (ids >= V)).any()):
                raise ValueError(f"allowed_token_ids: need at least one id, each in [0, {V})")
            allowed = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
            # (a row per request, not an expanded view: a loop's kept graphs take a later call's mask into it)
            bitmask = pack_bitmask(allowed).to(device).expand(B, -1).contiguous()
        return SamplingParams(per_request("top_k", top_k, torch.int32, 0),
                              per_request("top_p", top_p, torch.float32, 1.0),
                              per_request("min_p", min_p, torch.float32, 0.0), bitmask)

    def node_bitmask(self, T: int) -> Optional[torch.Tensor]:
        """The bitmask as accept takes it, (B, T, W): the same row for each of T nodes."""
        return None if self.bitmask is None else self.bitmask.unsqueeze(1).expand(-1, T, -1)

    def accept_kwargs(self, T: int) -> dict:
        """The keyword arguments of `specdec.accept` for trees of T nodes."""
        return dict(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, token_bitmask=self.node_bitmask(T))

    def process(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """logits (B, N, V) -> the same rows processed with each request's parameters (processed_tree_logits):
        what a drafter samples from, softmax(. / t), so that accept's q is the law it used. Unchanged when off."""
        if all(x is None for x in self):
            return logits
        return processed_tree_logits(logits, temperature, *self[:3], self.node_bitmask(logits.shape[1]))
