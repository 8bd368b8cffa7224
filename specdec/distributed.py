"""Vocab-parallel acceptance: `accept` on logits sharded by vocabulary columns over a torch.distributed group.

Under tensor parallelism each rank's LM head computes the columns [vocab_start, vocab_start + width) of the
logits. Engines all-gather the full rows before sampling (B * T * V numbers per step); `accept` here exchanges
per-row statistics only, O(B * T) numbers a round:

  round          what each rank contributes                                              when
  stats          per row (B, T): max and log-sum-exp of l = masked logits / t, the first  always
                 argmax, l at each node's draft token in its parent's row
  filters        per row: the shard's 64 largest l, which settle top-k / top-p exactly     1 round (+1: the kept
                 when the kept tokens lie above every rank's last candidate; rows they    tokens' stats)
                 leave open: a count / a mass above a candidate threshold, a bisection   +32 per filter, only
                 over the float32 order (exact, ties kept as the reference keeps them)    for rows left open
  residuals      per request: the mass of max(r - q, 0) after a rejected child            <= T - 1 rounds (token,
                 (traversal: of max(w law - q, 0) after a failed subtree)                 draft laws; traversal);
                                                                                          1 (block)
  the draw       per request: the Gumbel-max winner (key, token id) of its last law        1 round

Every collective is an all_gather whose pieces all ranks combine in the same order, so every rank computes
the same numbers bit for bit and returns the same AcceptResult. The random numbers are counter-based
(splitmix64 of the seed, the offset, the node and the token id), so for a seed the result depends neither on
the rank nor, rounding aside, on how the vocabulary is split. The output law is `specdec.accept`'s (the same
processing, the same acceptance rules); the random stream is not the single-device backends'.

Bad input raises on every rank alike: each rank runs its own checks, then (value checks on) one exchange of
(error flag, shard layout, a fingerprint of the replicated inputs) decides for all, before any other
collective. With the value checks off (CUDA-graph capture, torch.compile) nothing is exchanged or read on the
host off the CPU: the walk runs a fixed number of rounds, the same on every rank (on the CPU, where a read
costs no sync, an all-greedy batch, settled filters and finished walks skip their remaining rounds).
"""
from __future__ import annotations

import math
import zlib
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import _validation as val
from ._layout import padded_rows
from .ops import AcceptResult, _accept_laws
from .reference import GREEDY_BELOW

__all__ = ["VocabShard", "accept", "shard_lm_head", "shard_range"]


def shard_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's columns when vocab_size is split as evenly as possible (the first ranks one more)."""
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class VocabShard(NamedTuple):
    """This rank's columns [start, start + width) of a vocabulary of `size` tokens, split over `group`."""
    start: int
    size: int
    group: object = None


def shard_lm_head(model, group=None) -> VocabShard:
    """Split model's LM head over the ranks of group (shard_range's columns): its logits become this rank's
    columns, for `accept` here (and SpeculativeDecoder(..., vocab_shard=)). model: a specdec Llama."""
    size = model.cfg.vocab_size
    start, end = shard_range(size, dist.get_rank(group), dist.get_world_size(group))
    model.shard_lm_head(start, end)
    return VocabShard(start, size, group)


# ----------------------------------------------------------------------------------------------
# counter-based random numbers, the same on every rank
# ----------------------------------------------------------------------------------------------
def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_MIX1, _MIX2, _GOLDEN = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB), _signed(0x9E3779B97F4A7C15)
_DRAW = 1 << 40  # counters: node i's uniform is i; the draw's noise at token x is _DRAW + x


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (products wrap; logical right shifts by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _uniform(stream: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1): the request streams (B, 1..) at the counters (broadcast)."""
    bits = (_mix(stream + _mix(counter)) >> 11) & ((1 << 53) - 1)
    return (bits.double() + 0.5) * 2.0 ** -53


# ----------------------------------------------------------------------------------------------
# collectives
# ----------------------------------------------------------------------------------------------
class _Exchange:
    """all_gather of small tensors over the group, counting what this rank contributes."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rounds = 0
        self.bytes = 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world, *x.shape): every rank's x, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        self.rounds += 1
        self.bytes += x.numel() * x.element_size()
        return torch.stack(parts)


def _keys(l: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 keys in the same order (-0.0 taken as +0.0); _keys is its own inverse on int32 bits."""
    bits = (l + 0.0).view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()


def _from_keys(k: torch.Tensor) -> torch.Tensor:
    bits = k.to(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).view(torch.float32)


_LOWEST_KEY = int(_keys(torch.tensor([-torch.finfo(torch.float32).max])).item())  # the smallest finite l
_KEY_BITS = 32  # bisection rounds: the key range has 2**32 values
_CANDIDATES = 64  # per row and rank: the largest l each rank sends for the filters' thresholds


# ----------------------------------------------------------------------------------------------
# the processed laws on a shard: l (L, B, T, width) float32, dropped tokens at -inf, and their log-sum-exp
# ----------------------------------------------------------------------------------------------
def _top_k_threshold(ex, keys, top, k):
    """The largest key with at least k kept tokens at or above it (keys (L, B, T, w), top the global max key
    (L, B, T), k (B,)): top-k keeps the tokens at or above it, every tie at the k-th value included."""
    lo, hi = torch.full_like(top, _LOWEST_KEY), top
    k = k.long().view(1, -1, 1)
    for _ in range(_KEY_BITS):
        mid = (lo + hi + 1) >> 1
        count = ex.gather((keys >= mid.unsqueeze(-1)).sum(-1, dtype=torch.int32)).sum(0)
        ok = count >= k
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    return lo


def _top_p_threshold(ex, keys, p, top, top_p):
    """The smallest key above which the kept mass (p, the kept tokens' softmax) is < top_p: top-p keeps the
    tokens at or above it (the mass strictly above a token's l decides, so ties go together)."""
    lo, hi = torch.full_like(top, _LOWEST_KEY), top
    top_p = top_p.double().view(1, -1, 1)
    for _ in range(_KEY_BITS):
        mid = (lo + hi) >> 1
        mass = ex.gather(torch.where(keys > mid.unsqueeze(-1), p, 0.0).sum(-1, dtype=torch.float64)).sum(0)
        ok = mass < top_p
        lo, hi = torch.where(ok, lo, mid + 1), torch.where(ok, mid, hi)
    return hi


def _bisection_thresholds(ex, l, top, lse, top_k, top_p, vocab_size):
    """(L, B, T) float32: top-k then top-p's thresholds (keep l >= it; -inf: off) by bisections over the whole
    shard rows, 32 rounds each (+1 for the top-k kept tokens' log-sum-exp)."""
    keys, top_key = _keys(l), _keys(top.float())
    theta = torch.full_like(top, -math.inf, dtype=torch.float32)
    if top_k is not None:
        on = ((top_k > 0) & (top_k < vocab_size)).view(1, -1, 1)
        theta = torch.where(on, _from_keys(_top_k_threshold(ex, keys, top_key, top_k)), theta)
        l = l.masked_fill(l < theta.unsqueeze(-1), -math.inf)
        lse = torch.logsumexp(ex.gather(torch.logsumexp(l, -1).double()), 0)
    if top_p is not None:
        p = torch.exp(l.double() - lse.unsqueeze(-1)).float()
        at = _from_keys(_top_p_threshold(ex, keys, p, top_key, top_p))
        theta = torch.where((top_p < 1.0).view(1, -1, 1), torch.maximum(theta, at), theta)
    return theta


def _candidate_thresholds(ex, l, lse, top_k, top_p, vocab_size):
    """(theta, resolved), both (L, B, T): top-k then top-p's thresholds from each rank's _CANDIDATES largest l
    per row, one round. They are exact where the kept tokens all lie above the floor, the largest of the ranks'
    last candidates (every l above it is a candidate on its rank): `resolved`; elsewhere theta is a guess."""
    L, B, T, w = l.shape
    C = _CANDIDATES  # (the same on every rank: a narrower shard pads with -inf)
    mine = torch.nn.functional.pad(l.topk(min(C, w), dim=-1).values, (0, max(C - w, 0)), value=-math.inf)
    floor = mine[..., -1] if w > C else torch.full_like(mine[..., -1], -math.inf)  # all sent: no floor
    g = ex.gather(torch.cat([mine, floor.unsqueeze(-1)], -1))
    floor = g[..., C].amax(0)
    union = g[..., :C].movedim(0, -2).flatten(-2).sort(-1, descending=True).values  # (L, B, T, n)
    n = union.shape[-1]
    theta = torch.full_like(floor, -math.inf)
    resolved = torch.ones_like(floor, dtype=torch.bool)
    complete = floor == -math.inf
    if top_k is not None:
        k = top_k.long().view(1, B, 1)
        on = (k > 0) & (k < vocab_size)
        kth = union.gather(-1, (k - 1).clamp(0, n - 1).expand(L, B, T).unsqueeze(-1)).squeeze(-1)
        kth = torch.where(k <= n, kth, -math.inf)  # (more than n: only when complete, and then all are kept)
        theta = torch.where(on, kth, theta)
        resolved = resolved & (~on | (kth > floor) | complete)
        kept = union >= theta.unsqueeze(-1)
        lse = torch.where(on, torch.logsumexp(union.double().masked_fill(~kept, -math.inf), -1), lse)
    if top_p is not None:
        on = (top_p < 1.0).view(1, B, 1)
        mass = torch.exp(union.double() - lse.unsqueeze(-1)).masked_fill(union < theta.unsqueeze(-1), 0.0)
        ascending = union.flip(-1).contiguous()
        greater = n - torch.searchsorted(ascending, union.contiguous(), right=True)  # candidates with a larger l
        above = torch.cat([torch.zeros_like(mass[..., :1]), mass.cumsum(-1)], -1).gather(-1, greater)
        keep = (above < top_p.double().view(1, B, 1, 1)) & (mass > 0)
        at = torch.where(keep, union, math.inf).amin(-1)
        theta = torch.where(on, torch.maximum(theta, at), theta)
        reached = mass.masked_fill(union <= floor.unsqueeze(-1), 0.0).sum(-1) >= top_p.double().view(1, B, 1)
        resolved = resolved & (~on | reached | complete)
    return theta, resolved


def _filter(ex, l, top, lse, top_k, top_p, min_p, vocab_size):
    """Steps 3-5 of the processed law on the shard rows l (L, B, T, w): top-k, top-p, min-p, each on what the
    previous kept. Returns l with the dropped tokens at -inf. The thresholds come from the candidates; rows they
    leave unresolved (a nucleus or k larger than the candidates hold) are bisected (on the CPU only when some
    row needs it: knowing that costs no sync there)."""
    theta = torch.full_like(top, -math.inf, dtype=torch.float32)
    if top_k is not None or top_p is not None:
        theta, resolved = _candidate_thresholds(ex, l, lse, top_k, top_p, vocab_size)
        if l.device.type != "cpu" or not bool(resolved.all()):
            theta = torch.where(resolved, theta, _bisection_thresholds(ex, l, top, lse, top_k, top_p, vocab_size))
    if min_p is not None:  # p(x) >= min_p * max p  <=>  l(x) >= max l + log(min_p)
        theta = torch.maximum(theta, top.float() + torch.log(min_p.float()).view(1, -1, 1))
    return l.masked_fill(l < theta.unsqueeze(-1), -math.inf)


# ----------------------------------------------------------------------------------------------
# the public op
# ----------------------------------------------------------------------------------------------
def accept(target_logits_shard: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None,
           parents: Optional[torch.Tensor] = None, *, vocab_start: int, vocab_size: int, group=None,
           draft_logits_shard: Optional[torch.Tensor] = None, target_probs_shard: Optional[torch.Tensor] = None,
           draft_probs_shard: Optional[torch.Tensor] = None, temperature: Union[None, float, torch.Tensor] = None,
           seeds: Optional[torch.Tensor] = None, num_nodes: Optional[torch.Tensor] = None,
           offset: Union[int, torch.Tensor] = 0, top_k=None, top_p=None, min_p=None,
           token_bitmask: Optional[torch.Tensor] = None, method: str = "token",
           cu_num_nodes: Optional[torch.Tensor] = None, max_nodes: Optional[int] = None,
           stats: Optional[dict] = None) -> AcceptResult:
    """`specdec.accept` on vocab-sharded rows; every rank of `group` calls it and gets the same AcceptResult.

    target_logits_shard (B, T, w) (or (N, w) packed, with cu_num_nodes / max_nodes as in specdec.accept): this
    rank's columns [vocab_start, vocab_start + w) of the target's logits; draft_logits_shard the same columns
    of the drafter's (or target_probs_shard / draft_probs_shard: probabilities, unnormalized). The shards of
    the group tile [0, vocab_size) in any order, any widths (uneven is fine). tokens, parents, num_nodes,
    temperature, seeds, offset, top_k, top_p, min_p, token_bitmask ((B, T, ceil(vocab_size / 32)), the full
    vocabulary's words) and method ("token", "block" or "traversal") mean what they mean in specdec.accept and
    must be the same on every rank (checked, with the value checks on). seeds None: rank 0's fresh seeds, sent to all.
    Greedy results equal specdec.accept on the gathered logits; sampled results follow its law (see the
    module's docstring for the random stream).
    stats: a dict, or None; if given it receives {"rounds": collectives, "bytes": bytes this rank sent into
    them} (each rank receives world - 1 times that).
    """
    ex = _Exchange(group)
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    checked = val.value_checks_enabled()
    error, args = None, None
    try:
        args = _checked_args(target_logits_shard, tokens, parents, vocab_start, vocab_size, draft_logits_shard,
                             target_probs_shard, draft_probs_shard, temperature, seeds, num_nodes, offset, top_k,
                             top_p, min_p, token_bitmask, method, cu_num_nodes, max_nodes, checked)
    except (TypeError, ValueError) as e:
        if not checked:
            raise
        error = e
    if checked:
        _agree(ex, error, args, vocab_size, device, seeds is not None)
    if seeds is None:  # rank 0's
        args["seeds"] = ex.gather(args["seeds"])[0]
    result = _accept(ex, **args)
    if stats is not None:
        stats.update(rounds=ex.rounds, bytes=ex.bytes)
    return result


def _checked_args(target, tokens, parents, vocab_start, vocab_size, draft, target_probs, draft_probs, temperature,
                  seeds, num_nodes, offset, top_k, top_p, min_p, token_bitmask, method, cu_num_nodes, max_nodes,
                  checked):
    """This rank's checks (they raise before any collective) and the normalized arguments of _accept."""
    target, draft, probs = _accept_laws(target, draft, target_probs, draft_probs)
    names = ("target_probs_shard", "draft_probs_shard") if probs else ("target_logits_shard", "draft_logits_shard")
    for name, v in (("vocab_size", vocab_size), ("vocab_start", vocab_start)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "vocab_size" else 0):
            raise TypeError(f"{name}: expected an int >= {1 if name == 'vocab_size' else 0}, got {v!r}")
    if tokens is None or parents is None:
        raise TypeError(f"{'tokens' if tokens is None else 'parents'}: required")
    for name, x in ((names[0], target), (names[1], draft)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.dim() < 2):
            raise TypeError(f"{name}: expected a (B, T, w) or packed (N, w) tensor")
    width = target.shape[-1]
    if width < 1:
        raise ValueError(f"{names[0]}: a shard needs at least one column, got shape {tuple(target.shape)}")
    if vocab_start + width > vocab_size:
        raise ValueError(f"vocab_start: the shard's columns [{vocab_start}, {vocab_start + width}) pass vocab_size "
                         f"{vocab_size}")
    tokens, parents, num_nodes, row_offsets = val.accept_nodes(cu_num_nodes, max_nodes, num_nodes, tokens, parents,
                                                               target.shape[0])
    # the full vocabulary's checks on a zero-copy (.., vocab_size) view (never read: values=False)
    def wide(x):
        return None if x is None else x[..., :1].expand(*x.shape[:-1], vocab_size)
    num_nodes, temperature, seeds, offset, offsets, top_k, top_p, min_p, token_bitmask = val.check_accept(
        wide(target), tokens, parents, wide(draft), temperature, seeds, num_nodes, offset, top_k, top_p, min_p,
        token_bitmask, method, probs, row_offsets, values=False)
    for name, x in ((names[0], target), (names[1], draft)):
        if x is not None and x.shape[-1] != width:
            raise ValueError(f"{name}: expected {width} columns (the target shard's), got {x.shape[-1]}")
    if checked:
        val.check_parents(parents, num_nodes, True)
        val.check_accept_nodes(tokens, parents, num_nodes, temperature, offsets, top_k, top_p, min_p, method,
                               vocab_size, row_offsets, target.shape[0])
        for name, x in ((names[0], target), (names[1], draft)):
            if x is not None:
                val.check_finite_rows(name, x, probs)
    if row_offsets is not None:  # this shard's rows to the padded layout (a gather of the local columns)
        target, draft, token_bitmask = padded_rows(row_offsets, tokens.shape[1], target, draft, token_bitmask)
    offsets = torch.full_like(seeds, offset) if offsets is None else offsets.long() + offset
    return dict(target=target, draft=draft, probs=probs, names=names, tokens=tokens.long(), parents=parents.long(),
                num_nodes=num_nodes.long(), temperature=temperature, seeds=seeds, offsets=offsets, top_k=top_k,
                top_p=top_p, min_p=min_p, token_bitmask=token_bitmask, method=method, vocab_start=vocab_start,
                vocab_size=vocab_size, checked=checked)


def _fingerprint(*xs) -> int:
    """A hash of the replicated inputs (ints, and floats by their bits), to check that every rank got the same."""
    h = 0
    for i, x in enumerate(xs):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            h = (h * 1000003 + zlib.crc32(repr(x).encode())) % (1 << 61)
            continue
        x = x.reshape(-1)
        bits = x.double().view(torch.int64) if x.is_floating_point() else x.long()
        idx = torch.arange(bits.numel(), device=bits.device) + (i << 32)
        h = (h * 1000003 + int(_mix(bits ^ _mix(idx)).sum()) % (1 << 61)) % (1 << 61)
    return h


def _agree(ex, error, args, vocab_size, device, seeds_given):
    """One exchange that makes every rank raise the same error, or none: a rank's own error, a layout whose
    shards do not tile [0, vocab_size), or replicated inputs that differ across ranks."""
    if error is None:
        replicated = [args[k] for k in ("tokens", "parents", "num_nodes", "temperature", "offsets", "top_k", "top_p",
                                        "min_p", "token_bitmask", "method", "vocab_size")]
        mine = [0, args["vocab_start"], args["target"].shape[-1],
                _fingerprint(*replicated, args["seeds"] if seeds_given else None)]
    else:
        mine = [1, 0, 0, 0]
    seen = ex.gather(torch.tensor(mine, dtype=torch.int64, device=device)).tolist()
    failed = [r for r, row in enumerate(seen) if row[0]]
    if failed:
        messages = [None] * ex.world
        dist.all_gather_object(messages, None if error is None else (type(error).__name__, str(error)),
                               group=ex.group)
        kind, message = messages[failed[0]]
        raise (TypeError if kind == "TypeError" else ValueError)(f"{message} (raised on rank {failed[0]})")
    spans = sorted((row[1], row[1] + row[2]) for row in seen)
    if spans[0][0] != 0 or spans[-1][1] != vocab_size or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"vocab_start: the ranks' shards {spans} do not tile [0, {vocab_size}) without gaps or "
                         "overlaps")
    if len({row[3] for row in seen}) > 1:
        raise ValueError("tokens: the replicated inputs (tokens, parents, num_nodes, temperature, seeds, offset, "
                         "filters, token_bitmask, method) differ across ranks")


# ----------------------------------------------------------------------------------------------
# the walk: every rank runs it on the same gathered numbers
# ----------------------------------------------------------------------------------------------
def _shard_allowed(token_bitmask, vocab_start, width):
    """(B, T, width) bool: this shard's columns of the full vocabulary's bitmask."""
    w0, w1 = vocab_start // 32, (vocab_start + width + 31) // 32
    words = token_bitmask[..., w0:w1]
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=words.device, dtype=words.dtype)) & 1
    first = vocab_start - 32 * w0
    return bits.flatten(-2)[..., first:first + width].bool()


class _Laws:
    """This shard's processed laws: l (L, B, T, w) float32 (L = 1, or 2 with the drafter's; dropped tokens at
    -inf) and their global log-sum-exp lse (L, B, T) (-inf for a row with nothing kept)."""

    def __init__(self, l, lse, vocab_start):
        self.l, self.vocab_start = l, vocab_start
        self.lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # (exp(-inf - 0) = 0, no NaN)
        self.empty = ~torch.isfinite(lse)

    def rows(self, i):  # (B, T, w) float32: law i's probabilities
        return torch.exp(self.l[i] - self.lse[i].unsqueeze(-1).float())

    def row(self, i, node):  # (B, w) float64: law i's probabilities at node[b]
        B, _, w = self.l[i].shape
        at = self.l[i].gather(1, node.view(B, 1, 1).expand(B, 1, w)).squeeze(1).double()
        return torch.exp(at - self.lse[i].gather(1, node.view(B, 1)))

    def without(self, weights, tokens, drop):
        """weights (B, w) with the tokens tokens[b, j] (drop[b, j]) that lie in this shard set to 0."""
        local = tokens - self.vocab_start
        w = weights.shape[1]
        spot = torch.where(drop & (local >= 0) & (local < w), local, w)  # (column w: a spare for the others)
        dropped = torch.zeros(weights.shape[0], w + 1, dtype=torch.bool, device=weights.device).scatter_(1, spot, True)
        return weights.masked_fill(dropped[:, :w], 0.0)


def _accept(ex, target, draft, probs, names, tokens, parents, num_nodes, temperature, seeds, offsets, top_k, top_p,
            min_p, token_bitmask, method, vocab_start, vocab_size, checked):
    B, T, width = target.shape
    dev = target.device
    sampled = temperature >= GREEDY_BELOW  # (below: greedy, as on every backend)
    # an all-greedy batch needs only the rows' maxima (on the CPU, knowing that costs no sync)
    sampling = dev.type != "cpu" or bool(sampled.any())
    laws_in = [target] if draft is None else [target, draft]
    if probs:
        laws_in = [x.float().log() for x in laws_in]  # zeros: impossible tokens (-inf), as in specdec.accept
    if sampling:  # l = logits / t, (L, B, T, w) float32
        l = torch.empty((len(laws_in), B, T, width), dtype=torch.float32, device=dev)
        t = torch.where(sampled, temperature, torch.ones_like(temperature)).view(B, 1, 1)
        for i, x in enumerate(laws_in):
            torch.div(x, t, out=l[i])
    else:  # (greedy: the logits themselves, no copy when they are float32 already)
        l = laws_in[0].float().unsqueeze(0) if len(laws_in) == 1 else torch.stack([x.float() for x in laws_in])
    if token_bitmask is not None:
        l = l.masked_fill(~_shard_allowed(token_bitmask, vocab_start, width), -math.inf)
    idx = torch.arange(T, device=dev)
    real = idx < num_nodes.unsqueeze(1)
    child = real & (idx > 0)
    up = parents.clamp(min=0)

    def token_values(l):  # (L, B, T) float64: l of each node's token in its parent's row (-inf off this shard)
        local = tokens - vocab_start
        mine = child & (local >= 0) & (local < width)
        at = l[:, torch.arange(B, device=dev).view(B, 1), up, local.clamp(0, width - 1)]
        return torch.where(mine, at, -math.inf).double()

    # round 1: per row, the max and first argmax (the target's), and when sampling the log-sum-exp and the tokens' l;
    # with probabilities also the max of greedy's key, the probabilities themselves for greedy rows (their float32
    # logs round probabilities an ulp apart to one value)
    m = l.amax(-1)
    greedy_key = l[0]
    if probs:
        greedy_key = torch.where(sampled.view(B, 1, 1) | (l[0] == -math.inf), l[0], target.float())
    first = (greedy_key.argmax(-1) + vocab_start).double().unsqueeze(0).expand_as(m)
    stats = [m.double(), first] + ([torch.logsumexp(l, -1).double(), token_values(l)] if sampling else [])
    if probs:
        stats.append(greedy_key.amax(-1).double().unsqueeze(0).expand_as(m))
    g = ex.gather(torch.stack(stats))
    top = g[:, 0].amax(0)
    key_max = g[:, -1 if probs else 0, 0]  # (ranks, B, T)
    argmax = torch.where(key_max == key_max.amax(0), g[:, 1, 0], math.inf).amin(0)
    greedy = torch.where(torch.isfinite(top[0]), argmax, 0.0).long()  # (B, T); 0: a row with no finite logit
    if checked:
        what = ("0 on every token token_bitmask allows" if probs else "-inf on every token token_bitmask allows"
                ) if token_bitmask is not None else "all zeros" if probs else "entirely -inf"
        for i in range(l.shape[0]):
            val._fail_if(names[i], real & (top[i] == -math.inf), f"a real node's row is {what}")
    greedy_node = _greedy_walk(greedy, tokens, parents, child)
    if not sampling:
        return _result(greedy_node, greedy.gather(1, greedy_node.view(B, 1)).squeeze(1), up)
    lse, at = torch.logsumexp(g[:, 2], 0), g[:, 3].amax(0)
    if any(f is not None for f in (top_k, top_p, min_p)):
        l = _filter(ex, l, top, lse, top_k, top_p, min_p, vocab_size)
        g = ex.gather(torch.stack([torch.logsumexp(l, -1).double(), token_values(l)]))
        lse, at = torch.logsumexp(g[:, 0], 0), g[:, 1].amax(0)
    laws = _Laws(l, lse, vocab_start)
    p_at = torch.exp(at - laws.lse.gather(2, up.unsqueeze(0).expand_as(at)))  # p_parent(c)(x_c); 0 if dropped
    stream = _mix(_mix(seeds) + offsets * _GOLDEN)

    if method == "block":
        node, weights = _block_walk(ex, laws, p_at, num_nodes, stream)
    elif method == "traversal":
        node, weights = _traversal_walk(ex, laws, p_at, tokens, parents, child, sampled, stream)
    else:
        node, weights = _token_walk(ex, laws, p_at, tokens, parents, child, sampled, stream)
    node = torch.where(sampled, node, greedy_node)
    # the draw: the Gumbel-max winner of the last law's weights (B, w); none (an empty residual): the argmax
    cols = torch.arange(width, device=dev) + vocab_start
    noise = -torch.log(-torch.log(_uniform(stream.unsqueeze(1), _DRAW + cols.unsqueeze(0))))
    best, where = torch.where(weights > 0, weights.log() + noise, -math.inf).max(-1)
    g = ex.gather(torch.stack([best, (where + vocab_start).double()]))
    winner = torch.where(g[:, 0] == g[:, 0].amax(0), g[:, 1], math.inf).amin(0)
    argmax_at_node = greedy.gather(1, node.view(B, 1)).squeeze(1)
    drawn = torch.where(torch.isfinite(g[:, 0].amax(0)), winner, argmax_at_node.double()).long()
    return _result(node, torch.where(sampled, drawn, argmax_at_node), up)


def _result(node, next_tokens, up):
    """The AcceptResult of paths that end at node (B,): node's ancestors, root first."""
    B, T = up.shape
    up_path = torch.empty(B, T, dtype=torch.long, device=up.device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=up.device)
    cur = node
    for d in range(T):
        up_path[:, d] = cur
        num_accepted += (cur > 0).long()
        cur = up.gather(1, cur.view(B, 1)).squeeze(1)  # (the root's parent, clamped, is the root)
    back = num_accepted.view(B, 1) - torch.arange(T, device=up.device)
    accepted = torch.where(back >= 0, up_path.gather(1, back.clamp(min=0)), -1)
    return AcceptResult(accepted.to(torch.int32), num_accepted.to(torch.int32), next_tokens)


def _greedy_walk(greedy, tokens, parents, child):
    """Descend into the first child whose token is its parent's argmax, while there is one."""
    B, T = tokens.shape
    node = torch.zeros(B, dtype=torch.long, device=tokens.device)
    idx = torch.arange(T, device=tokens.device)
    for _ in range(T - 1):
        match = child & (parents == node.view(B, 1)) & (tokens == greedy.gather(1, node.view(B, 1)))
        node = torch.where(match.any(1), torch.where(match, idx, T).amin(1), node)
    return node


def _token_walk(ex, laws, p_at, tokens, parents, child, sampled, stream):
    """Token-wise (multi-step) rejection sampling, as specdec.reference.accept, in lockstep over the batch.

    At the current node with residual r (P at first) the children are tried in node order: child c (token x)
    is accepted iff u_c * q(x) < r(x) (draft laws) or u_c * sum r < r(x) (given proposals). A rejection sets
    r <- max(r - q, 0) / S with draft laws (S, a vocabulary sum: the round's one exchange, a number per
    request), or r(x) <- 0 with proposals (nothing to exchange). Returns (the node each request stopped at,
    the residual's weights there on this shard (B, w); all 0 when r == q: the argmax then, as the reference)."""
    B, T = tokens.shape
    dev = tokens.device
    has_draft = laws.l.shape[0] == 2
    idx = torch.arange(T, device=dev)
    node = torch.zeros(B, dtype=torch.long, device=dev)
    last = torch.zeros(B, dtype=torch.long, device=dev)  # the last child of `node` tried (children are > node)
    stopped = ~sampled | laws.empty[0, :, 0]  # (an empty root row accepts nothing)
    r_at = p_at[0].clone()  # r(x_c): child c's token in its parent's current residual
    r_sum = torch.ones(B, dtype=torch.float64, device=dev)  # proposals: the residual's mass
    zeroed = torch.zeros(B, T, dtype=torch.bool, device=dev)  # proposals: children whose token r dropped
    r_row, r_node = laws.row(0, node), node.clone()  # draft laws: the residual row of node r_node
    for _ in range(T - 1 if has_draft else 1):  # with draft laws a round ends at a rejection (<= T - 1 of them)
        pending = torch.zeros(B, dtype=torch.bool, device=dev)
        for _ in range(T - 1):
            cand = child & (parents == node.view(B, 1)) & (idx > last.view(B, 1))
            c = torch.where(cand, idx, T - 1).amin(1)
            active = ~stopped & ~pending
            stopped = stopped | (active & ~cand.any(1))
            active = active & cand.any(1)
            r_x = r_at.gather(1, c.view(B, 1)).squeeze(1)
            if has_draft:
                ok = _uniform(stream, c) * p_at[1].gather(1, c.view(B, 1)).squeeze(1) < r_x
            else:
                ok = _uniform(stream, c) * r_sum < r_x
            took, rejected = active & ok, active & ~ok
            if has_draft:
                pending = pending | rejected
            else:  # r(x) <- 0, for every child of the node with that token
                same = rejected.view(B, 1) & (parents == node.view(B, 1)) & (tokens == tokens.gather(1, c.view(B, 1)))
                r_sum = torch.where(took, 1.0, torch.where(rejected, r_sum - r_x, r_sum))
                r_at = torch.where(same, 0.0, r_at)
                zeroed = zeroed | same
            last = torch.where(active, c, last)
            node = torch.where(took, c, node)
        if not has_draft:
            break
        # the round's rejections: r <- max(r - q, 0) / S (a node just entered starts from its P)
        r = torch.where((r_node == node).view(B, 1), r_row, laws.row(0, node))
        r = (r - laws.row(1, node)).clamp(min=0)
        S = ex.gather(torch.where(pending, r.sum(-1), 0.0)).sum(0)
        scale = torch.where(S > 0, S, 1.0)
        r_row = torch.where(pending.view(B, 1), r / scale.view(B, 1), r_row)
        r_node = torch.where(pending, node, r_node)
        kids = pending.view(B, 1) & (parents == node.view(B, 1))
        r_at = torch.where(kids, (r_at - p_at[1]).clamp(min=0) / scale.view(B, 1), r_at)
        stopped = stopped | (pending & (S == 0))  # r == q: nothing left to accept or draw (the argmax, below)
        if dev.type == "cpu" and bool(stopped.all()):  # (the same on every rank; no sync to save on CPU)
            break
    if has_draft:
        return node, torch.where((r_node == node).view(B, 1), r_row, laws.row(0, node))
    return node, laws.without(laws.row(0, node), tokens, zeroed & (parents == node.view(B, 1)))


def _traversal_walk(ex, laws, p_at, tokens, parents, child, sampled, stream):
    """Traversal verification (specdec.reference._traversal_verify), a post-order walk in lockstep over the batch.

    Each step of a request is one event at its current node v of weight w_v: w_v = 0 fails v at once; else
    the next untried child c is entered with weight min(w_v law_v(x_c) / q_v(x_c), 1); a node with no child
    left emits with probability w_v (its uniform u_v < w_v: the walk stops there, the next token drawn from
    its law) or fails. A failed node's parent takes law <- max(w law - q, 0) / S, w <- S / (S + 1 - w), S a
    vocabulary sum: the round's one exchange, one number per request. Every non-root node fails at most once:
    T rounds. Returns (the emitting node, its law's weights on this shard (B, w))."""
    B, T = tokens.shape
    dev = tokens.device
    rows = torch.arange(B, device=dev)
    idx = torch.arange(T, device=dev)
    up = parents.clamp(min=0)
    node = torch.zeros(B, dtype=torch.long, device=dev)
    weight = torch.ones(B, T, dtype=torch.float64, device=dev)  # each entered node's current weight
    last = torch.zeros(B, T, dtype=torch.long, device=dev)  # each node's last child entered (children are > it)
    law_at, q_at = p_at[0].clone(), p_at[1]  # law_parent(c)(x_c), q_parent(c)(x_c)
    law_rows = laws.rows(0)  # (B, T, w): each node's current law (P until a child fails)
    done = ~sampled | laws.empty[0, :, 0]
    for _ in range(T):
        failed = torch.zeros(B, dtype=torch.bool, device=dev)
        for _ in range(T):
            active = ~done & ~failed
            w_v = weight[rows, node]
            cand = child & (parents == node.view(B, 1)) & (idx > last[rows, node].view(B, 1))
            c = torch.where(cand, idx, T - 1).amin(1)
            enter = active & (w_v > 0) & cand.any(1)
            decide = active & (w_v > 0) & ~cand.any(1)
            law_x, q_x = law_at[rows, c], q_at[rows, c]
            w_c = torch.where(law_x == 0, 0.0, torch.where(q_x == 0, 1.0,
                              torch.minimum(w_v * law_x / q_x.clamp(min=1e-300), torch.ones_like(w_v))))
            weight[rows, c] = torch.where(enter, w_c, weight[rows, c])
            last[rows, node] = torch.where(enter, c, last[rows, node])
            emit = decide & (_uniform(stream, node) < w_v)
            done = done | emit
            failed = failed | (active & (w_v == 0)) | (decide & ~emit)
            node = torch.where(enter, c, node)
        # the failed nodes' parents: law <- max(w law - q, 0) / S, w <- S / (S + 1 - w)
        parent = up.gather(1, node.view(B, 1)).squeeze(1)
        w_p = weight[rows, parent]
        r = (w_p.float().view(B, 1) * law_rows[rows, parent] - laws.row(1, parent).float()).clamp(min=0)
        S = ex.gather(torch.where(failed, r.sum(-1).double(), 0.0)).sum(0)
        scale = torch.where(S > 0, S, 1.0)
        law_rows[rows, parent] = torch.where(failed.view(B, 1), r / scale.float().view(B, 1), law_rows[rows, parent])
        kids = failed.view(B, 1) & (parents == parent.view(B, 1)) & child
        law_at = torch.where(kids, (w_p.view(B, 1) * law_at - q_at).clamp(min=0) / scale.view(B, 1), law_at)
        weight[rows, parent] = torch.where(failed, torch.where(S + 1 - w_p > 0, S / (S + 1 - w_p), 1.0), w_p)
        node = torch.where(failed, parent, node)
        if dev.type == "cpu" and bool(done.all()):  # (the same on every rank; no sync to save on CPU)
            break
    return node, law_rows[rows, node].double()


def _block_walk(ex, laws, p_at, num_nodes, stream):
    """Block verification of a chain (specdec.reference.block_weights / _block_verify), all requests at once:
    the weights from the tokens' probability ratios, the residual masses S_i of every node in one exchange,
    then tau and the residual to draw from. Returns (tau, the residual's weights on this shard (B, w))."""
    B, T = p_at.shape[1:]
    dev = p_at.device
    big, small = p_at[0], p_at[1]  # node i's token in node i - 1's laws
    ratio = torch.where(small > 0, big / small.clamp(min=1e-300), torch.where(big > 0, math.inf, 0.0))
    w = torch.ones(B, T, dtype=torch.float64, device=dev)
    for i in range(1, T):
        w[:, i] = torch.where(w[:, i - 1] == 0, 0.0, (w[:, i - 1] * ratio[:, i]).clamp(max=1.0))
    P, Q = laws.rows(0), laws.rows(1)
    S = ex.gather((w.float().unsqueeze(-1) * P - Q).clamp(min=0).sum(-1).double()).sum(0)
    gamma = (num_nodes - 1).view(B, 1)
    idx = torch.arange(T, device=dev)
    h = torch.where(S + 1 - w > 0, S / (S + 1 - w), 1.0)
    h = torch.where(idx == gamma, w, h)
    hit = (idx >= 1) & (idx <= gamma) & (_uniform(stream.view(B, 1), idx.view(1, T)) < h)
    tau = torch.where(hit, idx, 0).amax(1)
    at = tau.view(B, 1, 1).expand(B, 1, P.shape[-1])
    P_tau, Q_tau = P.gather(1, at).squeeze(1), Q.gather(1, at).squeeze(1)
    w_tau = w.gather(1, tau.view(B, 1))
    residual = torch.where((tau == gamma.view(B)).view(B, 1), P_tau, (w_tau * P_tau - Q_tau).clamp(min=0))
    return tau, residual
