"""The processed law of `specdec.accept`, vectorized in PyTorch: for engines and drafters that must sample from
exactly the law accept verifies against, and for launchers that mask the logits before a kernel.

At temperature t >= GREEDY_BELOW (1e-5 as a float32) a row of logits is processed in this order
(specdec/reference.py spells out each step):
  0. penalties (`penalized_logits`, reference.penalized_row): the logit bias, min-tokens' stop tokens at -inf, then
     the repetition, frequency and presence penalties from the row's counts (the request's output so far plus
     the draft tokens on the node's path), in vLLM's order and float32 arithmetic;
  1. mask: tokens the grammar disallows get -inf;
  2. temperature: l = logits / t (computed as (logits - the row's finite max) / t: no overflow);
  3. top-k: x is kept iff fewer than k allowed tokens have a strictly larger l (ties at the k-th value kept);
  4. top-p: with p the softmax of the kept tokens, x is kept iff the mass of the tokens with a strictly larger p
     is < top_p (the top token and the ties at the boundary are kept);
  5. min-p: x is kept iff p(x) >= min_p * max p;
  6. renormalize.
Steps 3-5 run in `filter_order`: "hf" as listed; "vllm" min-p, top-k, then top-p over the min-p and top-k set;
"sglang" top-p over every allowed token (not renormalized after top-k) jointly with top-k, then min-p
(reference.processed_keep). Greedy rows (t < GREEDY_BELOW, as in specdec.accept) are only penalized and masked:
top-k, top-p and min-p never remove the argmax.

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
from .reference import FILTER_ORDERS, GREEDY_BELOW, saturated

Param = Union[None, int, float, torch.Tensor]

_CHUNK_ELEMENTS = 1 << 22  # rows are processed in chunks of about this many entries (float64 sort buffers)


def _per_row(x: Param, N: int, dtype, device) -> Optional[torch.Tensor]:
    if x is None or isinstance(x, torch.Tensor):
        return None if x is None else x.to(device)
    return torch.full((N,), x, dtype=dtype, device=device)


def penalized_logits(logits: torch.Tensor, counts: Optional[torch.Tensor] = None,
                     prompt_token_mask: Optional[torch.Tensor] = None,
                     repetition_penalty: Optional[torch.Tensor] = None,
                     frequency_penalty: Optional[torch.Tensor] = None, presence_penalty: Optional[torch.Tensor] = None,
                     logit_bias_ids: Optional[torch.Tensor] = None, logit_bias_values: Optional[torch.Tensor] = None,
                     min_tokens: Optional[torch.Tensor] = None,
                     stop_token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Step 0 of rows logits (N, V): reference.penalized_row of every row, bit for bit, on the device. Every
    argument is per row, None = off for every row: counts (N, V) int, the row's token counts (its request's
    output so far plus the draft tokens on its path; a row has generated counts.sum() tokens), required with a
    penalty or min_tokens; prompt_token_mask (N, ceil(V/32)) int32 (the packed prompt tokens); the penalties
    (N,) float32; logit_bias_ids (N, K) int (-1 = padding) with logit_bias_values (N, K) float32; min_tokens (N,)
    int with stop_token_ids (N, S) int (-1 = padding). Returns (N, V) float32, float64 for float64 rows: each
    step one rounded operation in that dtype, in vLLM's order (bias, min-tokens, repetition, frequency,
    presence; min-tokens' stop tokens applied last, the same), f * count clamped and the result saturated as the
    reference's (`reference.saturated`)."""
    N, V = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    given = logits.to(dtype)
    x = given.clone()
    if logit_bias_ids is not None:  # entries in order, each one rounded add; padding adds -0.0 (an exact no-op)
        valid = logit_bias_ids >= 0
        ids = torch.where(valid, logit_bias_ids, 0).long()
        values = torch.where(valid, logit_bias_values.to(dtype), -0.0)
        for k in range(ids.shape[1]):
            at = ids[:, k:k + 1]
            x.scatter_(1, at, x.gather(1, at) + values[:, k:k + 1])
    if counts is None and any(a is not None for a in (repetition_penalty, frequency_penalty, presence_penalty,
                                                       min_tokens)):
        raise ValueError("counts: required with a penalty or min_tokens")
    if counts is not None:
        present = counts > 0
        if repetition_penalty is not None:
            rep = repetition_penalty.to(dtype).unsqueeze(1)
            seen = present if prompt_token_mask is None else present | unpack_bitmask(prompt_token_mask, V)
            x = torch.where(seen & (rep != 1.0), x * torch.where(x > 0, 1.0 / rep, rep), x)
        if frequency_penalty is not None:
            freq = frequency_penalty.to(dtype).unsqueeze(1)
            top = torch.finfo(dtype).max
            x = torch.where(freq != 0.0, x - (freq * counts.to(dtype)).clamp(-top, top), x)
        if presence_penalty is not None:
            pres = presence_penalty.to(dtype).unsqueeze(1)
            x = torch.where(pres != 0.0, x - pres * present.to(dtype), x)
    x = saturated(given, x)
    if min_tokens is not None:  # (after the penalties, which keep a -inf as it is: the same as vLLM's order)
        masking = counts.sum(-1) < min_tokens  # (N,): fewer tokens generated than min_tokens
        ids = torch.where((stop_token_ids >= 0) & masking.unsqueeze(1), stop_token_ids, V).long()
        stop = torch.zeros(N, V + 1, dtype=torch.bool, device=x.device).scatter_(1, ids, True)[:, :V]
        x = x.masked_fill(stop, -math.inf)
    return x


def node_counts(output_token_counts: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(B, T, V) int32: the counts step 0 reads at each node of a batch of trees: output_token_counts (B, V) plus
    the draft tokens on the node's path (tokens (B, T), parents (B, T), node 0's token excluded). Padding nodes
    (any parent) get counts that are never read, and nothing is read out of bounds."""
    B, T = tokens.shape
    V = output_token_counts.shape[1]
    counts = output_token_counts.to(torch.int32).unsqueeze(1).repeat(1, T, 1)
    cols = torch.arange(T, device=tokens.device)
    node = cols.expand(B, T)
    toks = tokens.long().clamp(0, V - 1)
    for _ in range(T - 1):  # walk every node up to the root, one level a round (a path has at most T - 1 drafts)
        on = node > 0
        counts.scatter_add_(2, toks.gather(1, node).unsqueeze(2), on.to(torch.int32).unsqueeze(2))
        up = parents.long().gather(1, node)
        node = torch.where(on & (up >= 0) & (up < node), up, 0)  # (a malformed parent ends the walk)
    return counts


def keep_mask(logits: torch.Tensor, temperature: Union[float, torch.Tensor], top_k: Param = None,
              top_p: Param = None, min_p: Param = None, allowed: Optional[torch.Tensor] = None,
              filter_order: str = "hf") -> torch.Tensor:
    """(N, V) bool: the tokens the processed law keeps, for logits (N, V), temperature (N,) (or a float) and the
    per-row parameters, steps 3-5 in filter_order ("hf" | "vllm" | "sglang"). allowed: (N, V) bool (e.g.
    unpack_bitmask) or None. Greedy rows (t < GREEDY_BELOW) keep every allowed finite entry; rows left with no
    finite allowed entry keep nothing."""
    if filter_order not in FILTER_ORDERS:
        raise ValueError(f"filter_order: expected one of {FILTER_ORDERS}, got {filter_order!r}")
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
                              *(None if a is None else a[i:i + rows] for a in (k, tp, mp)), filter_order)
                  for i in range(0, N, rows)]
    threshold = torch.cat(thresholds).unsqueeze(1)  # in l; -inf for greedy rows
    return finite & (l >= threshold)


def _thresholds(l, sampling, k, tp, mp, filter_order) -> torch.Tensor:
    """(n,) the smallest kept l of each row (-inf: no filter, or a greedy row). l: (n, V) float64, the masked
    logits scaled as keep_mask scales them; sampling (n,) bool: the rows with t >= GREEDY_BELOW. Every filter keeps
    an upper set of l, so a set is a threshold and an intersection is the largest threshold; each filter below
    returns its threshold over the set kept so far (the tokens at or above `kept_from`)."""
    n, V = l.shape
    s = torch.sort(l, dim=-1, descending=True).values  # -inf last
    finite = s > -math.inf
    cols = torch.arange(V, device=l.device)
    off = torch.full((n,), -math.inf, dtype=torch.float64, device=l.device)

    def probs(kept):  # softmax of the kept (sorted) entries
        return torch.softmax(s.masked_fill(~kept, -math.inf), -1).nan_to_num(0.0)

    def smallest_kept(kept):  # the l of the last kept sorted entry; the top one at least
        last = (kept.sum(-1) - 1).clamp(min=0)
        return s.gather(1, last.unsqueeze(1)).squeeze(1)

    top_k = off  # the k-th largest value (ties at it kept): the same over every upper set of k tokens or more
    if k is not None:
        kth = s.gather(1, (k.clamp(1, V) - 1).unsqueeze(1)).squeeze(1)
        top_k = torch.where(sampling & (k > 0) & (k < V), kth, off)

    def top_p_from(kept_from):  # keep a tie group iff the mass strictly above it is < top_p
        if tp is None:
            return off
        kept = finite & (s >= kept_from.unsqueeze(1))
        cum = probs(kept).cumsum(-1)
        start = torch.ones_like(finite)
        start[:, 1:] = s[:, 1:] != s[:, :-1]
        first = torch.where(start, cols, 0).cummax(-1).values  # first sorted index of each entry's tie group
        above = torch.where(first > 0, cum.gather(1, (first - 1).clamp(min=0)), 0.0)
        return torch.where(sampling & (tp < 1), smallest_kept(kept & (above < tp.unsqueeze(1))), off)

    def min_p_from(kept_from):  # p(x) >= min_p * max p
        if mp is None:
            return off
        kept = finite & (s >= kept_from.unsqueeze(1))
        p = probs(kept)
        return torch.where(sampling & (mp > 0), smallest_kept(kept & (p >= mp.unsqueeze(1) * p[:, :1])), off)

    if filter_order == "vllm":
        thr = torch.maximum(min_p_from(off), top_k)
        return torch.maximum(thr, top_p_from(thr))
    if filter_order == "sglang":
        thr = torch.maximum(top_k, top_p_from(off))
        return torch.maximum(thr, min_p_from(thr))
    thr = torch.maximum(top_k, top_p_from(top_k))
    return torch.maximum(thr, min_p_from(thr))


def processed_logits(logits: torch.Tensor, temperature: Union[float, torch.Tensor], top_k: Param = None,
                     top_p: Param = None, min_p: Param = None, allowed: Optional[torch.Tensor] = None,
                     filter_order: str = "hf") -> torch.Tensor:
    """logits (N, V) with the entries the processed law drops at -inf, the others unchanged (same dtype and
    scale): softmax(processed_logits / t) is the processed law, the argmax of a greedy row is the masked argmax."""
    return logits.masked_fill(~keep_mask(logits, temperature, top_k, top_p, min_p, allowed, filter_order), -math.inf)


def processed_tree_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: Optional[torch.Tensor] = None,
                          top_p: Optional[torch.Tensor] = None, min_p: Optional[torch.Tensor] = None,
                          token_bitmask: Optional[torch.Tensor] = None, filter_order: str = "hf") -> torch.Tensor:
    """accept's arguments as they reach a kernel (logits (B, T, V); temperature, top_k, top_p, min_p (B,) or None;
    token_bitmask (B, T, ceil(V/32)) int32 or None) -> (B, T, V) logits processed row by row: node i of request b
    with request b's parameters and node i's bitmask row. For target and draft logits alike (after step 0:
    `Penalties.rows`)."""
    B, T, V = logits.shape
    per_node = [None if a is None else a.repeat_interleave(T) for a in (temperature, top_k, top_p, min_p)]
    allowed = None if token_bitmask is None else unpack_bitmask(token_bitmask, V).reshape(B * T, V)
    return processed_logits(logits.reshape(B * T, V), *per_node, allowed=allowed,
                            filter_order=filter_order).view(B, T, V)


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

    T = tokens.shape[1]
    chain = (torch.arange(T, device=tokens.device) - 1).expand(tokens.shape[0], T)
    counts = None if params.penalties is None else params.penalties.node_counts(tokens, chain)[:, :-1]

    def law(logits):
        x = params.process(logits[:, :-1].float(), temperature, counts)
        top = x.amax(-1, keepdim=True)  # (subtracted first: huge logits / t overflow)
        return torch.softmax((x - torch.where(torch.isfinite(top), top, 0.0)) / t, -1)

    p = law(target_logits)
    if draft_logits is None:
        return p.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.minimum(p, law(draft_logits)).sum(-1).clamp(max=1.0)


class Penalties(NamedTuple):
    """A batch's step-0 state as `specdec.accept` takes it, per request (each None: off for every request):
    output_token_counts (B, V) int32, the counts of each request's output tokens so far (a loop updates it in
    place after each step: whoever holds it sees the new counts); prompt_token_mask (B, ceil(V/32)) int32;
    repetition_penalty, frequency_penalty, presence_penalty (B,) float32; logit_bias_ids (B, K) int32 (-1 =
    padding) with logit_bias_values (B, K) float32; min_tokens (B,) int32 with stop_token_ids (B, S) int32 (-1 =
    padding)."""
    output_token_counts: torch.Tensor
    prompt_token_mask: Optional[torch.Tensor] = None
    repetition_penalty: Optional[torch.Tensor] = None
    frequency_penalty: Optional[torch.Tensor] = None
    presence_penalty: Optional[torch.Tensor] = None
    logit_bias_ids: Optional[torch.Tensor] = None
    logit_bias_values: Optional[torch.Tensor] = None
    min_tokens: Optional[torch.Tensor] = None
    stop_token_ids: Optional[torch.Tensor] = None

    def node_counts(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """(B, T, V) int32: the counts at each node of trees tokens / parents (B, T) (`node_counts`)."""
        return node_counts(self.output_token_counts, tokens, parents)

    def rows(self, logits: torch.Tensor, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """logits (B, N, V) after step 0 (`penalized_logits`), row [b, n] with request b's parameters and the
        counts counts[b, n] (B, N, V) (None: the output counts, rows at the trees' roots)."""
        B, N, V = logits.shape
        if counts is None:
            counts = self.output_token_counts.unsqueeze(1).expand(B, N, V)
        per_row = [None if a is None else a.repeat_interleave(N, dim=0) for a in self[1:]]
        return penalized_logits(logits.reshape(B * N, V), counts.reshape(B * N, V), *per_row).view(B, N, V)

    def accept_kwargs(self) -> dict:
        """The keyword arguments of `specdec.accept` that carry them."""
        bias = None if self.logit_bias_ids is None else (self.logit_bias_ids, self.logit_bias_values)
        return dict(repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
                    presence_penalty=self.presence_penalty, output_token_counts=self.output_token_counts,
                    prompt_token_mask=self.prompt_token_mask, logit_bias=bias, min_tokens=self.min_tokens,
                    stop_token_ids=self.stop_token_ids)


    @staticmethod
    def for_batch(prompts: Sequence[Sequence[int]], V: int, device, repetition_penalty=1.0, frequency_penalty=0.0,
                  presence_penalty=0.0, logit_bias=None, min_tokens=0, stop_token_ids: Sequence = (),
                  padding: int = 0) -> Optional["Penalties"]:
        """The state of a batch of len(prompts) requests about to generate (no output yet), or None when every
        argument is off. Each argument one for every request or a sequence of one per request:
        repetition_penalty (> 0, off 1), frequency_penalty and presence_penalty (off 0) numbers; logit_bias a
        dict {token id: bias} (None: off); min_tokens an int >= 0 (off 0); stop_token_ids a sequence of token
        ids (the tokens masked until min_tokens are generated). padding: that many more rows after the requests',
        every argument off (a batch padded to its bucket)."""
        B = len(prompts)

        def per_request(name, x, one, off):
            values = [x] * B if one(x) else list(x)
            if len(values) != B:
                raise ValueError(f"{name}: give one value or one per request ({B}), got {len(values)}")
            return values + [off] * padding

        def number(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def ids_ok(name, ids):
            if any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < V for x in ids):
                raise ValueError(f"{name}: token ids must be ints in [0, {V})")

        penalties = {}
        for name, x, off in (("repetition_penalty", repetition_penalty, 1.0),
                             ("frequency_penalty", frequency_penalty, 0.0),
                             ("presence_penalty", presence_penalty, 0.0)):
            values = [float(v) for v in per_request(name, x, number, off)]
            if not all(math.isfinite(v) for v in values) or (off == 1.0 and min(values) <= 0):
                raise ValueError(f"{name}: must be finite{' and > 0' if off == 1.0 else ''}, got {values[:B]}")
            if any(v != off for v in values):
                penalties[name] = torch.tensor(values, dtype=torch.float32, device=device)
        biases = [d or {} for d in per_request("logit_bias", logit_bias, lambda x: x is None or isinstance(x, dict),
                                                None)]
        bias_ids = bias_values = None
        if any(biases):
            K = max(len(d) for d in biases)
            ids, values = [[-1] * K for _ in biases], [[0.0] * K for _ in biases]
            for b, d in enumerate(biases):
                ids_ok("logit_bias", list(d))
                if not all(math.isfinite(float(v)) for v in d.values()):
                    raise ValueError("logit_bias: biases must be finite numbers")
                for k, (x, v) in enumerate(d.items()):
                    ids[b][k], values[b][k] = x, float(v)
            bias_ids = torch.tensor(ids, dtype=torch.int32, device=device)
            bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        mins = per_request("min_tokens", min_tokens, lambda x: isinstance(x, int), 0)
        if any(not isinstance(m, int) or isinstance(m, bool) or m < 0 for m in mins):
            raise ValueError(f"min_tokens: must be ints >= 0, got {mins[:B]}")
        stops = per_request("stop_token_ids", stop_token_ids,
                            lambda x: len(x) == 0 or not isinstance(x[0], (list, tuple)), ())
        min_tok = stop_ids = None
        if any(mins):
            for ids in stops:
                ids_ok("stop_token_ids", list(ids))
            if not any(ids for ids, m in zip(stops, mins) if m):
                raise ValueError("stop_token_ids: required with min_tokens (the tokens it holds back)")
            S = max(1, max(len(ids) for ids in stops))
            min_tok = torch.tensor(mins, dtype=torch.int32, device=device)
            stop_ids = torch.tensor([list(ids) + [-1] * (S - len(ids)) for ids in stops], dtype=torch.int32,
                                    device=device)
        if not penalties and bias_ids is None and min_tok is None:
            return None
        prompt_mask = None
        if "repetition_penalty" in penalties:
            in_prompt = torch.zeros(B + padding, V, dtype=torch.bool)
            for b, p in enumerate(prompts):
                in_prompt[b, torch.as_tensor(list(p), dtype=torch.long)] = True
            prompt_mask = pack_bitmask(in_prompt).to(device)
        return Penalties(torch.zeros(B + padding, V, dtype=torch.int32, device=device), prompt_mask,
                         penalties.get("repetition_penalty"), penalties.get("frequency_penalty"),
                         penalties.get("presence_penalty"), bias_ids, bias_values, min_tok, stop_ids)

    def first_on(self) -> str:
        """The name of the first argument that is on, as for_batch names it (one is: else for_batch gave None)."""
        on = {"repetition_penalty": self.repetition_penalty, "frequency_penalty": self.frequency_penalty,
              "presence_penalty": self.presence_penalty, "logit_bias": self.logit_bias_ids,
              "min_tokens": self.min_tokens}
        return next(name for name, x in on.items() if x is not None)


class SamplingParams(NamedTuple):
    """A batch's sampling parameters, as the loop hands them to its drafter and to `specdec.accept`: top_k (B,)
    int32, top_p and min_p (B,) float32, each None when off for every request; bitmask (B, W) int32 or None:
    the tokens each request may emit at every position, packed (vLLM's `allowed_token_ids`, or a regex's
    character class over a byte vocabulary), a grammar mask that does not change along the sequence;
    penalties: step 0 (`Penalties`) or None; filter_order: the order of top-k, top-p and min-p (keep_mask);
    logprobs (-1: off, else the top logprobs per position) and logprobs_mode: what accept returns besides."""
    top_k: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    min_p: Optional[torch.Tensor] = None
    bitmask: Optional[torch.Tensor] = None
    penalties: Optional[Penalties] = None
    filter_order: str = "hf"
    logprobs: int = -1
    logprobs_mode: str = "raw"

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
        kwargs = dict(top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, token_bitmask=self.node_bitmask(T))
        if self.penalties is not None:
            kwargs.update(self.penalties.accept_kwargs())
        if self.filter_order != "hf":
            kwargs.update(filter_order=self.filter_order)
        if self.logprobs >= 0:
            kwargs.update(return_logprobs=self.logprobs, logprobs_mode=self.logprobs_mode)
        return kwargs

    def process(self, logits: torch.Tensor, temperature: torch.Tensor,
                counts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """logits (B, N, V) -> the same rows processed with each request's parameters (step 0 with the counts
        counts (B, N, V) int32, None: the output counts, rows at the trees' roots; then processed_tree_logits):
        what a drafter samples from, softmax(. / t), so that accept's q is the law it used. Unchanged when off."""
        if self.penalties is not None:
            logits = self.penalties.rows(logits, counts)
        if all(x is None for x in self[:4]):
            return logits
        return processed_tree_logits(logits, temperature, *self[:3], self.node_bitmask(logits.shape[1]),
                                     self.filter_order)
