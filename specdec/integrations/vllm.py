"""vLLM v1's rejection sampler (`vllm.v1.sample.rejection_sampler`) on specdec.accept, without importing vllm.

`RejectionSampler().forward(metadata, draft_probs, logits, sampling_metadata)` and the module-level
`rejection_sample(...)` take vLLM's packed layout (a batch's draft tokens flattened, `cu_num_draft_tokens`
inclusive, no leading 0) and duck-typed `SpecDecodeMetadata` / `SamplingMetadata`, and return vLLM's output
layout: `[batch, max_spec_len + 1]` int32, accepted drafts then the recovered or bonus token, padded with -1.

The rules are vLLM's: a greedy request (temperature 0, or all_greedy) keeps drafts while they equal the
target's argmax, then emits the argmax (or the bonus); a sampled one accepts draft x with probability
min(1, p(x) / q(x)) and draws a rejected position's token from relu(p - q) (with draft_probs None: accepts x with
probability p(x) and draws from p without x). Same output law as vLLM's. Randomness: vLLM draws its uniforms from
`sampling_metadata.generators[i]` for seeded requests and from torch's global generator otherwise; here each
request's specdec seed is drawn from that same generator (once per call, only for requests with drafts, as vLLM
consumes a seeded generator only then), so seeded requests are deterministic and the rest are random.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

import specdec
from specdec import _validation as val
from ..sampling import processed_tree_logits
from . import seeds_from

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0
MAX_SPEC_LEN = 128


class SamplerOutput(NamedTuple):
    """vLLM's SamplerOutput, duck-typed: sampled_token_ids [batch, max_spec_len + 1] int32 (-1 padded)."""
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Optional[object] = None


class _Chains(NamedTuple):
    """A batch of packed drafts as accept's chains: request b's node i < n_b is flat draft position
    starts[b] + i (tokens[b, i + 1] is its draft token), its node n_b the bonus position."""
    starts: torch.Tensor  # (B,) int64
    lengths: torch.Tensor  # (B,) int64: n_b
    tokens: torch.Tensor  # (B, S + 1) int64
    parents: torch.Tensor  # (B, S + 1) int64


def _check_drafts(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, V):
    """vLLM's packed drafts, checked as specdec's ops check theirs (a ValueError / TypeError naming the argument;
    the value checks while they are on); returns num_draft_tokens as a list."""
    val._tensor("draft_token_ids", draft_token_ids, dim=1, dtypes=val.INT_DTYPES)
    dev = draft_token_ids.device
    if not isinstance(num_draft_tokens, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in num_draft_tokens):
        raise TypeError("num_draft_tokens: expected a list of ints >= 0 (the drafts of each request)")
    num = list(num_draft_tokens)
    if sum(num) != draft_token_ids.shape[0]:
        raise ValueError(f"num_draft_tokens: they add up to {sum(num)}, but draft_token_ids holds "
                         f"{draft_token_ids.shape[0]}")
    if not isinstance(max_spec_len, int) or isinstance(max_spec_len, bool) or max_spec_len < max(num, default=0):
        raise ValueError(f"max_spec_len: expected an int >= every request's drafts ({max(num, default=0)}), got "
                         f"{max_spec_len!r}")
    val._tensor("cu_num_draft_tokens", cu_num_draft_tokens, dim=1, dtypes=val.INT_DTYPES, device=dev)
    val._shape("cu_num_draft_tokens", cu_num_draft_tokens, (len(num),))
    if val.value_checks_enabled():
        expected = torch.tensor(num, dtype=torch.int64, device=dev).cumsum(0)
        val._fail_if("cu_num_draft_tokens", cu_num_draft_tokens.long() != expected,
                     "must be the inclusive cumulative sum of num_draft_tokens")
        val._fail_if("draft_token_ids", (draft_token_ids < 0) | (draft_token_ids >= V), f"must be in [0, {V})")
    return num


def _check_rows(name, rows, num_rows, device, V=None):
    """(num_rows, V) float rows of probabilities or logits; returns V."""
    val._tensor(name, rows, dim=2, dtypes=val.FLOAT_DTYPES, device=device)
    if rows.shape[0] != num_rows or rows.shape[1] < 1 or (V is not None and rows.shape[1] != V):
        raise ValueError(f"{name}: expected shape ({num_rows}, {'V' if V is None else V}), got {tuple(rows.shape)}")
    return rows.shape[1]


def _chains(draft_token_ids, num_draft_tokens: Sequence[int], max_spec_len: int, cu_num_draft_tokens) -> _Chains:
    if max_spec_len > MAX_SPEC_LEN:
        raise ValueError(f"max_spec_len: at most {MAX_SPEC_LEN}, got {max_spec_len}")
    dev = draft_token_ids.device
    B, T = len(num_draft_tokens), max_spec_len + 1
    lengths = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=dev)
    starts = cu_num_draft_tokens.to(device=dev, dtype=torch.int64) - lengths
    i = torch.arange(T, device=dev)
    drafted = (i >= 1) & (i <= lengths.unsqueeze(1))
    flat = (starts.unsqueeze(1) + i - 1).clamp(0, max(draft_token_ids.numel() - 1, 0))
    tokens = torch.where(drafted, draft_token_ids.long()[flat] if draft_token_ids.numel() else 0, 0)
    return _Chains(starts, lengths, tokens, torch.arange(-1, T - 1, device=dev).expand(B, T))


def _draft_positions(chains: _Chains, T: int) -> torch.Tensor:
    """(B, T) flat draft positions of each node's law; nodes from n_b on (the bonus position, whose law the
    caller's target rows do not hold, and padding) stand in with the request's last position (or 0): accept
    reads them at most for a draw the bonus then replaces."""
    i = torch.arange(T, device=chains.starts.device)
    last = torch.where(chains.lengths > 0, chains.starts + chains.lengths - 1, 0).unsqueeze(1)
    return torch.where(i < chains.lengths.unsqueeze(1), chains.starts.unsqueeze(1) + i, last)


def _seeds(sampling_metadata, lengths: Sequence[int], device) -> torch.Tensor:
    seeds = seeds_from(None, len(lengths), device)
    for i, g in (getattr(sampling_metadata, "generators", None) or {}).items():
        if lengths[i] > 0:
            seeds[i] = seeds_from(g, 1, g.device).to(device)[0]
    return seeds


def _temperature(sampling_metadata, B: int, device) -> torch.Tensor:
    """(B,) float32, 0 for greedy requests (vLLM: temperature None or all_greedy means all greedy)."""
    t = getattr(sampling_metadata, "temperature", None)
    if getattr(sampling_metadata, "all_greedy", False) or t is None:
        return torch.zeros(B, device=device)
    return t.to(device=device, dtype=torch.float32)


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list, max_spec_len: int,
                     cu_num_draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor],
                     target_probs: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata) -> torch.Tensor:
    """vLLM's rejection_sample: draft_token_ids [num_tokens]; num_draft_tokens [batch] list; cu_num_draft_tokens
    [batch] inclusive cumsum; draft_probs [num_tokens, V] or None; target_probs [num_tokens, V] (the processed
    target law, temperature and top-k/top-p applied, as vLLM passes it); bonus_token_ids [batch, 1] (or
    [batch]). Returns [batch, max_spec_len + 1] int32, -1 padded."""
    val._tensor("draft_token_ids", draft_token_ids, dim=1, dtypes=val.INT_DTYPES)
    V = _check_rows("target_probs", target_probs, draft_token_ids.shape[0], draft_token_ids.device)
    num_draft_tokens = _check_drafts(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, V)
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, draft_token_ids.shape[0], draft_token_ids.device, V)
    B, T, dev = len(num_draft_tokens), max_spec_len + 1, target_probs.device
    val._tensor("bonus_token_ids", bonus_token_ids, dtypes=val.INT_DTYPES, device=dev)
    if bonus_token_ids.numel() != B or bonus_token_ids.dim() not in (1, 2):
        raise ValueError(f"bonus_token_ids: expected ({B}, 1) or ({B},), got shape {tuple(bonus_token_ids.shape)}")
    if val.value_checks_enabled():
        val._fail_if("bonus_token_ids", (bonus_token_ids < 0) | (bonus_token_ids >= V), f"must be in [0, {V})")
    chains = _chains(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens)
    bonus = bonus_token_ids.reshape(B).long()
    if target_probs.shape[0] == 0:  # no drafts anywhere: the bonus tokens alone
        out = torch.full((B, T), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
        out[:, 0] = bonus.to(torch.int32)
        return out
    positions = _draft_positions(chains, T)
    greedy = _temperature(sampling_metadata, B, dev) == GREEDY_TEMPERATURE
    res = specdec.accept(tokens=chains.tokens, parents=chains.parents, target_probs=target_probs[positions],
                         draft_probs=None if draft_probs is None else draft_probs[positions],
                         temperature=torch.where(greedy, 0.0, 1.0),  # (the probabilities carry the temperature)
                         seeds=_seeds(sampling_metadata, num_draft_tokens, dev), num_nodes=chains.lengths + 1)
    return _output(res, chains, bonus)


def _output(res, chains: _Chains, bonus: torch.Tensor) -> torch.Tensor:
    """vLLM's layout; a request that accepted all its drafts ends with the given bonus token."""
    out = res.emitted_tokens(chains.tokens)
    complete = (res.num_accepted.long() == chains.lengths).unsqueeze(1)
    at_end = torch.arange(out.shape[1], device=out.device) == chains.lengths.unsqueeze(1)
    return torch.where(complete & at_end, bonus.unsqueeze(1), out).to(torch.int32)


class RejectionSampler(nn.Module):
    """vLLM v1's RejectionSampler: forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput.

    logits [num_tokens + batch, V]: the target's rows at metadata.target_logits_indices and the bonus rows at
    metadata.bonus_logits_indices. The bonus token is drawn inside (vLLM asks its Sampler): the bonus row is the
    chain's last node, so every token comes from one accept call with the request's temperature, top-k and
    top-p (min-p too, where SamplingMetadata has it). vLLM's other logits processors (penalties, bad words,
    logit bias, allowed-token masks) are not applied: apply them to `logits` before the call. `sampler` is
    accepted for the signature and unused."""

    def __init__(self, sampler=None):
        super().__init__()
        self.sampler = sampler

    def forward(self, metadata, draft_probs: Optional[torch.Tensor], logits: torch.Tensor,
                sampling_metadata) -> SamplerOutput:
        val._tensor("logits", logits, dim=2, dtypes=val.FLOAT_DTYPES)
        num_draft = _check_drafts(metadata.draft_token_ids, list(metadata.num_draft_tokens),
                                  max(metadata.num_draft_tokens, default=0), metadata.cu_num_draft_tokens,
                                  logits.shape[1])
        B, max_spec_len = len(num_draft), max(num_draft, default=0)
        T, dev = max_spec_len + 1, logits.device
        if draft_probs is not None and draft_probs.numel() > 0:
            _check_rows("draft_probs", draft_probs, len(metadata.draft_token_ids), dev, logits.shape[1])
        for name, index in (("target_logits_indices", metadata.target_logits_indices),
                            ("bonus_logits_indices", metadata.bonus_logits_indices)):
            val._tensor(name, index, dim=1, dtypes=val.INT_DTYPES, device=dev)
            if val.value_checks_enabled():
                val._fail_if(name, (index < 0) | (index >= logits.shape[0]), f"must be in [0, {logits.shape[0]})")
        chains = _chains(metadata.draft_token_ids, num_draft, max_spec_len, metadata.cu_num_draft_tokens)
        positions = _draft_positions(chains, T)
        i = torch.arange(T, device=dev)
        target_index = metadata.target_logits_indices.long()
        rows = torch.where(i < chains.lengths.unsqueeze(1),
                           target_index[positions] if target_index.numel() else 0,
                           metadata.bonus_logits_indices.long().unsqueeze(1))  # node n_b (and padding): the bonus row
        t = _temperature(sampling_metadata, B, dev)
        greedy = t == GREEDY_TEMPERATURE
        t_sampled = torch.where(greedy, 1.0, t)
        target = logits[rows].float()
        top_k, top_p, min_p = (getattr(sampling_metadata, name, None) for name in ("top_k", "top_p", "min_p"))
        if any(x is not None for x in (top_k, top_p, min_p)):
            # vLLM filters the target's law only; the draft probabilities are the drafter's law as it sampled
            target = processed_tree_logits(target, t_sampled, top_k, top_p, min_p)
        draft = None
        if draft_probs is not None and draft_probs.shape[0] > 0:
            # q = softmax(t log q / t): accept's drafter law at the request's temperature is draft_probs itself
            draft = draft_probs[positions].float().log() * t_sampled.view(B, 1, 1)
        elif draft_probs is not None:
            draft = torch.zeros_like(target)
        res = specdec.accept(target, chains.tokens, chains.parents, draft_logits=draft, temperature=t,
                             seeds=_seeds(sampling_metadata, num_draft, dev), num_nodes=chains.lengths + 1)
        return SamplerOutput(res.emitted_tokens(chains.tokens).to(torch.int32))

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int, discard_req_indices: Sequence[int] = (),
                     return_cu_num_tokens: bool = False):
        """(per-request lists of the valid token ids (!= -1, < vocab_size; discarded requests empty),
        [0] + their cumulative counts if asked, else None). A host copy: for the engine's bookkeeping."""
        ids = output_token_ids.cpu().tolist()
        out = [[x for x in row if x != PLACEHOLDER_TOKEN_ID and x < vocab_size] for row in ids]
        for i in discard_req_indices:
            out[i] = []
        if not return_cu_num_tokens:
            return out, None
        cu = [0]
        for row in out:
            cu.append(cu[-1] + len(row))
        return out, cu
