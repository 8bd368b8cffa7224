"""vLLM 0.33's v1 rejection sampler (`vllm.v1.sample.rejection_sampler`) on specdec.accept: swap the import.

`RejectionSampler(sampler, spec_config=None, device=None)`, its `forward(metadata, draft_probs, logits,
sampling_metadata)` and `parse_output(...)`, and the module-level `rejection_sample(...)` have vLLM 0.33's
signatures (annotations included), take vLLM's objects (`Sampler`, `SpecDecodeMetadata`, `SamplingMetadata`;
duck-typed, so vllm is imported only where vLLM's own code is called: its logits processors and logprob
helpers, when a request asks for them) and return vLLM's layout: `[batch, max_spec_len + 1]` int32, accepted
drafts then the recovered or bonus token, padded with -1 (PLACEHOLDER_TOKEN_ID).

What happens where, as in vLLM 0.33: `forward` asks the given sampler for the bonus tokens (vLLM's call:
`sampler(logits=bonus rows, sampling_metadata with max_num_logprobs=-1, predict_bonus_token=True,
logprobs_mode_override=...)`), applies vLLM's logits processors to the target rows (allowed-token mask, bad
words with the drafts, min-tokens, thinking budget: vLLM's own functions; the penalties too where a draft law is
given to sampled requests), verifies, and returns logprobs when `sampling_metadata.max_num_logprobs` is set: the
draft positions' from the accept call (`_fused_logprobs` says when), the bonus position's through the sampler's
`compute_logprobs` and `gather_logprobs` on its bonus rows; otherwise all through those functions on the target
rows (`_get_logprobs_tensors`). The repetition, frequency and presence penalties (counts from the request's output
token ids, the drafts of each row's path counted by accept) and the rest of vLLM's `apply_sampling_constraints`
(temperature, top-k, top-p) are not materialized: they are fused into one accept call. vLLM 0.33's min-p and
logit bias are logits processors that its rejection sampler leaves to the Sampler, so they reach the bonus token
only (the draft positions' law is the processors above, then temperature, top-k, top-p); the same here.

The rules are vLLM's: a greedy request (all_greedy, or temperature 0) keeps drafts while they equal the
target's argmax, then emits the argmax (or the bonus); a sampled one accepts draft x with probability
min(1, p(x) / q(x)) and draws a rejected position's token from relu(p - q) (with draft_probs None: accepts x
with probability p(x) and draws from p without x). A placeholder draft (-1) is rejected at its position: the
token there is the target's argmax (greedy) or drawn from p (vLLM draws from relu(p - q) when draft_probs is
given; the draft was never drawn from q, and p keeps the output law lossless). Same output law as vLLM's.
Randomness: vLLM draws from `sampling_metadata.generators[i]` for seeded requests and from torch's global
generator otherwise; here each request's specdec seed is drawn from that same generator (once per call, only
for requests with drafts, as vLLM consumes a seeded generator only then): seeded requests repeat.

Refused: `spec_config.rejection_sample_method` "fly" and "synthetic" (lossy; a ValueError naming them at
construction, and `rejection_sample`'s synthetic_mode / fly_window_size). "block" runs token-wise, as vLLM
0.33's v1 sampler does.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import torch
from torch import nn

import specdec
from specdec import _validation as val
from .._layout import pack_bitmask
from ..sampling import processed_tree_logits
from . import seeds_from

if TYPE_CHECKING:  # vLLM's types, for the annotations (equal to vLLM's, as text)
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1
GREEDY_TEMPERATURE = 0
MAX_SPEC_LEN = 128
PROCESSED_LOGPROBS_MODES = ("processed_logits", "processed_logprobs")
# vLLM's logprobs modes whose draft positions accept computes (where `_fused_logprobs` allows)
FUSED_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs")
LOGITS_LOGPROBS_MODES = ("raw_logits", "processed_logits")
REFUSED_METHODS = {"fly": "FLy verification (lossy)", "synthetic": "synthetic acceptance rates (lossy)"}


class SamplerOutput(NamedTuple):
    """vLLM's SamplerOutput where vllm is not installed: sampled_token_ids [batch, max_spec_len + 1] int32
    (-1 padded), logprobs_tensors (vLLM's LogprobsTensors) or None."""
    sampled_token_ids: torch.Tensor
    logprobs_tensors: Optional[object] = None


def _sampler_output(sampled_token_ids, logprobs_tensors):
    """vLLM's own SamplerOutput when vllm is installed (the engine type-checks nothing, but tests compare)."""
    try:
        from vllm.v1.outputs import SamplerOutput as VllmSamplerOutput
    except ImportError:
        return SamplerOutput(sampled_token_ids, logprobs_tensors)
    return VllmSamplerOutput(sampled_token_ids=sampled_token_ids, logprobs_tensors=logprobs_tensors)


class _Chains(NamedTuple):
    """A batch of packed drafts as accept's chains: request b's node i < lengths[b] is flat draft position
    starts[b] + i (tokens[b, i + 1] is its draft token); lengths[b] stops at the request's first placeholder."""
    starts: torch.Tensor  # (B,) int64
    lengths: torch.Tensor  # (B,) int64: the drafts before the first placeholder
    num_drafts: torch.Tensor  # (B,) int64: n_b, placeholders included
    tokens: torch.Tensor  # (B, S + 1) int64
    parents: torch.Tensor  # (B, S + 1) int64


def _check_drafts(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, V):
    """vLLM's packed drafts, checked as specdec's ops check theirs (a ValueError / TypeError naming the argument;
    the value checks while they are on); a draft id is in [0, V) or the placeholder -1. Returns
    num_draft_tokens as a list."""
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
    if max_spec_len > MAX_SPEC_LEN:
        raise ValueError(f"max_spec_len: at most {MAX_SPEC_LEN}, got {max_spec_len}")
    val._tensor("cu_num_draft_tokens", cu_num_draft_tokens, dim=1, dtypes=val.INT_DTYPES, device=dev)
    val._shape("cu_num_draft_tokens", cu_num_draft_tokens, (len(num),))
    if val.value_checks_enabled():
        expected = torch.tensor(num, dtype=torch.int64, device=dev).cumsum(0)
        val._fail_if("cu_num_draft_tokens", cu_num_draft_tokens.long() != expected,
                     "must be the inclusive cumulative sum of num_draft_tokens")
        val._fail_if("draft_token_ids", (draft_token_ids < PLACEHOLDER_TOKEN_ID) | (draft_token_ids >= V),
                     f"must be in [0, {V}) or the placeholder {PLACEHOLDER_TOKEN_ID}")
    return num


def _check_rows(name, rows, num_rows, device, V=None):
    """(num_rows, V) float rows of probabilities or logits; returns V."""
    val._tensor(name, rows, dim=2, dtypes=val.FLOAT_DTYPES, device=device)
    if rows.shape[0] != num_rows or rows.shape[1] < 1 or (V is not None and rows.shape[1] != V):
        raise ValueError(f"{name}: expected shape ({num_rows}, {'V' if V is None else V}), got {tuple(rows.shape)}")
    return rows.shape[1]


def _check_bonus(name, bonus_token_ids, B, V, device):
    """vLLM's bonus tokens, (B, 1) or (B,) int; returns them as (B,) int64."""
    val._tensor(name, bonus_token_ids, dtypes=val.INT_DTYPES, device=device)
    if bonus_token_ids.numel() != B or bonus_token_ids.dim() not in (1, 2):
        raise ValueError(f"{name}: expected ({B}, 1) or ({B},), got shape {tuple(bonus_token_ids.shape)}")
    if val.value_checks_enabled():
        val._fail_if(name, (bonus_token_ids < 0) | (bonus_token_ids >= V), f"must be in [0, {V})")
    return bonus_token_ids.reshape(B).long()


def _chains(draft_token_ids, num_draft_tokens: Sequence[int], max_spec_len: int, cu_num_draft_tokens) -> _Chains:
    dev = draft_token_ids.device
    B, T = len(num_draft_tokens), max_spec_len + 1
    num_drafts = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=dev)
    starts = cu_num_draft_tokens.to(device=dev, dtype=torch.int64) - num_drafts
    i = torch.arange(T, device=dev)
    drafted = (i >= 1) & (i <= num_drafts.unsqueeze(1))
    flat = (starts.unsqueeze(1) + i - 1).clamp(0, max(draft_token_ids.numel() - 1, 0))
    tokens = torch.where(drafted, draft_token_ids.long()[flat] if draft_token_ids.numel() else 0, 0)
    placeholder = drafted & (tokens == PLACEHOLDER_TOKEN_ID)
    # (node i + 1 holds draft i: the chain stops before the first placeholder)
    lengths = torch.where(placeholder, i - 1, num_drafts.unsqueeze(1)).amin(1)
    return _Chains(starts, lengths, num_drafts, tokens.clamp(min=0),
                   torch.arange(-1, T - 1, device=dev).expand(B, T))


def _draft_positions(chains: _Chains, T: int) -> torch.Tensor:
    """(B, T) flat draft positions of each node's law; nodes from n_b on (the bonus position, whose law the
    target rows do not hold, and padding) stand in with the request's last position (or 0): accept reads them
    at most for a draw the bonus then replaces."""
    i = torch.arange(T, device=chains.starts.device)
    last = torch.where(chains.num_drafts > 0, chains.starts + chains.num_drafts - 1, 0).unsqueeze(1)
    return torch.where(i < chains.num_drafts.unsqueeze(1), chains.starts.unsqueeze(1) + i, last)


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


def _verify(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
            bonus, sampling_metadata, temperature, top_k=None, top_p=None, penalties=None, logprobs=None):
    """One accept call over the batch. target_logits [num_tokens, V] float; temperature (B,) (0: greedy), applied
    with top_k / top_p ((B,) or None) to the target rows; draft_probs [num_tokens, V] or None, the drafter's law
    as given. penalties: accept's penalty arguments (`_penalties`) or None; given only where the target's law
    alone is processed (no draft_probs, or all greedy). logprobs: None or (N, accept's logprobs_mode). Returns
    (vLLM's output layout, accept's Logprobs (B, max_spec_len + 1, ...) or None)."""
    B, T, dev = len(num_draft_tokens), max_spec_len + 1, target_logits.device
    if target_logits.shape[0] == 0:  # no drafts anywhere: the bonus tokens alone
        out = torch.full((B, T), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=dev)
        out[:, 0] = bonus.to(torch.int32)
        return out, None
    chains = _chains(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens)
    positions = _draft_positions(chains, T)
    target = target_logits[positions].float()
    t_sampled = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature)
    draft = None
    if draft_probs is not None:
        if top_k is not None or top_p is not None:
            # vLLM filters the target's law only: accept would filter the drafter's law too
            target = processed_tree_logits(target, t_sampled, top_k, top_p)
            top_k = top_p = None
        # q = softmax(t log q / t): accept's drafter law at the request's temperature is draft_probs itself
        draft = draft_probs[positions].float().log() * t_sampled.view(B, 1, 1)
    wanted = {} if logprobs is None else dict(return_logprobs=logprobs[0], logprobs_mode=logprobs[1])
    res = specdec.accept(target, chains.tokens, chains.parents, draft_logits=draft, temperature=temperature,
                         top_k=top_k, top_p=top_p, seeds=_seeds(sampling_metadata, num_draft_tokens, dev),
                         num_nodes=chains.lengths + 1, **(penalties or {}), **wanted)
    out = res.emitted_tokens(chains.tokens)
    complete = (res.num_accepted.long() == chains.num_drafts).unsqueeze(1)
    at_end = torch.arange(out.shape[1], device=out.device) == chains.num_drafts.unsqueeze(1)
    return torch.where(complete & at_end, bonus.unsqueeze(1), out).to(torch.int32), res.logprobs


def _penalties(sampling_metadata, B: int, V: int, device) -> dict:
    """accept's penalty arguments from vLLM 0.33's metadata: its per-request penalties, output_token_counts
    (B, V) counted from output_token_ids (the output so far, root included; the -1 placeholders of async
    scheduling skipped, as vLLM pads them out) and prompt_token_mask from prompt_token_ids (B, P), padded with V.
    accept counts the drafts of each row's path itself (vLLM: _combine_outputs_with_spec_tokens)."""
    outputs = sampling_metadata.output_token_ids
    flat = torch.tensor([t for out in outputs for t in out], dtype=torch.int64)
    request = torch.repeat_interleave(torch.arange(B), torch.tensor([len(out) for out in outputs], dtype=torch.int64))
    real = flat >= 0
    counts = torch.zeros((B, V), dtype=torch.int32)
    counts.index_put_((request[real], flat[real]), torch.ones((), dtype=torch.int32), accumulate=True)
    prompt = sampling_metadata.prompt_token_ids
    in_prompt = torch.zeros((B, V + 1), dtype=torch.bool, device=prompt.device).scatter_(1, prompt.long(), True)
    return dict(repetition_penalty=sampling_metadata.repetition_penalties.to(device),
                frequency_penalty=sampling_metadata.frequency_penalties.to(device),
                presence_penalty=sampling_metadata.presence_penalties.to(device),
                output_token_counts=counts.to(device), prompt_token_mask=pack_bitmask(in_prompt[:, :V]).to(device))


def rejection_sample(
    # [num_tokens]
    draft_token_ids: torch.Tensor,
    # [batch_size]
    num_draft_tokens: list[int],
    max_spec_len: int,
    # [batch_size]
    cu_num_draft_tokens: torch.Tensor,
    # [num_tokens, vocab_size]
    draft_probs: torch.Tensor | None,
    # [num_tokens, vocab_size]
    target_logits: torch.Tensor,
    # [batch_size, 1]
    bonus_token_ids: torch.Tensor,
    sampling_metadata: SamplingMetadata,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
    fly_window_size: int | None = None,
    fly_entropy_threshold: float | None = None,
    fly_entropy_top_k: int = 3,
) -> torch.Tensor:
    """vLLM 0.33's rejection_sample: draft_token_ids [num_tokens] (-1: a placeholder, rejected);
    num_draft_tokens [batch] list; cu_num_draft_tokens [batch] inclusive cumsum; draft_probs [num_tokens, V] or
    None; target_logits [num_tokens, V]: the processed target logits (temperature, top-k, top-p applied, as
    vLLM's forward passes them; greedy requests take their argmax); bonus_token_ids [batch, 1] (or [batch]).
    Returns [batch, max_spec_len + 1] int32, -1 padded. use_fp64_gumbel sets the precision of vLLM's noise for
    recovered tokens, which accept does not use; synthetic_mode and fly_window_size (lossy modes) are refused."""
    if synthetic_mode or synthetic_conditional_rates is not None:
        raise ValueError(f"synthetic_mode: {REFUSED_METHODS['synthetic']} is not supported")
    if fly_window_size is not None:
        raise ValueError(f"fly_window_size: {REFUSED_METHODS['fly']} is not supported")
    val._tensor("draft_token_ids", draft_token_ids, dim=1, dtypes=val.INT_DTYPES)
    V = _check_rows("target_logits", target_logits, draft_token_ids.shape[0], draft_token_ids.device)
    num_draft_tokens = _check_drafts(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, V)
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, draft_token_ids.shape[0], draft_token_ids.device, V)
    B, dev = len(num_draft_tokens), target_logits.device
    bonus = _check_bonus("bonus_token_ids", bonus_token_ids, B, V, dev)
    greedy = _temperature(sampling_metadata, B, dev) == GREEDY_TEMPERATURE
    return _verify(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                   target_logits, bonus, sampling_metadata, torch.where(greedy, 0.0, 1.0))[0]


def _rows_processed(sampling_metadata) -> bool:
    """Whether a logits processor other than the penalties changes target rows (allowed tokens, bad words,
    min-tokens with requests, the thinking budget): apply_logits_processors' conditions."""
    if getattr(sampling_metadata, "allowed_token_ids_mask", None) is not None:
        return True
    if getattr(sampling_metadata, "bad_words_token_ids", None):
        return True
    logitsprocs = getattr(sampling_metadata, "logitsprocs", None)
    if any(getattr(p, "min_toks", None) for p in getattr(logitsprocs, "non_argmax_invariant", ())):
        return True
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    return holder is not None and holder.has_tracked_requests()


def _replaced(sampling_metadata, **fields):
    """`dataclasses.replace(sampling_metadata, **fields)` (vLLM's call), for duck-typed metadata too."""
    if dataclasses.is_dataclass(sampling_metadata):
        return dataclasses.replace(sampling_metadata, **fields)
    copy = type(sampling_metadata).__new__(type(sampling_metadata))
    copy.__dict__.update(vars(sampling_metadata), **fields)
    return copy


class RejectionSampler(nn.Module):
    """vLLM 0.33's v1 RejectionSampler on specdec.accept (see the module docstring).

    forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput: logits [num_tokens + batch, V],
    the target's rows at metadata.target_logits_indices and the bonus rows at metadata.bonus_logits_indices
    (handed to the sampler). sampler: vLLM's Sampler (its logprobs_mode, __call__, compute_logprobs,
    gather_logprobs are used). spec_config: vLLM's SpeculativeConfig or None; device: unused (vLLM puts its
    synthetic rates there)."""

    def __init__(
        self,
        sampler: Sampler,
        spec_config: SpeculativeConfig | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        method = getattr(spec_config, "rejection_sample_method", None)
        if method in REFUSED_METHODS:
            raise ValueError(f"spec_config: rejection_sample_method {method!r} ({REFUSED_METHODS[method]}) is not "
                             "supported by specdec; use 'standard'")
        self.sampler = sampler
        logprobs_mode = getattr(sampler, "logprobs_mode", "raw_logprobs")
        self.is_processed_logprobs_mode = logprobs_mode in PROCESSED_LOGPROBS_MODES
        self.is_logits_logprobs_mode = logprobs_mode in LOGITS_LOGPROBS_MODES

    def forward(
        self,
        metadata: SpecDecodeMetadata,
        # [num_tokens, vocab_size]
        draft_probs: torch.Tensor | None,
        # [num_tokens + batch_size, vocab_size]
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput:
        val._tensor("logits", logits, dim=2, dtypes=val.FLOAT_DTYPES)
        V, dev = logits.shape[1], logits.device
        num_draft = _check_drafts(metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                  metadata.cu_num_draft_tokens, V)
        B, num_tokens = len(num_draft), metadata.draft_token_ids.shape[0]
        for name, index in (("target_logits_indices", metadata.target_logits_indices),
                            ("bonus_logits_indices", metadata.bonus_logits_indices)):
            val._tensor(name, index, dim=1, dtypes=val.INT_DTYPES, device=dev)
            if val.value_checks_enabled():
                val._fail_if(name, (index < 0) | (index >= logits.shape[0]), f"must be in [0, {logits.shape[0]})")
        val._shape("target_logits_indices", metadata.target_logits_indices, (num_tokens,))
        if draft_probs is not None:
            _check_rows("draft_probs", draft_probs, num_tokens, dev, V)

        bonus_output = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=_replaced(sampling_metadata, max_num_logprobs=-1),
            predict_bonus_token=True,
            # (logits back, for the accepted tokens' logprobs below)
            logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits",
        )
        bonus = _check_bonus("sampler", bonus_output.sampled_token_ids, B, V, dev)
        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        fused_logprobs = self._fused_logprobs(sampling_metadata, draft_probs, num_tokens)
        # the penalties go into accept where only the target's law is processed (vLLM leaves draft_probs as
        # given) and no logprobs need vLLM's processed rows; the other processors (-inf masks, forcing) run here
        penalties = None
        if (not getattr(sampling_metadata, "no_penalties", True) and num_tokens > 0
                and (draft_probs is None or sampling_metadata.all_greedy)
                and not (self.is_processed_logprobs_mode and sampling_metadata.max_num_logprobs is not None
                         and fused_logprobs is None)):
            penalties = _penalties(sampling_metadata, B, V, dev)
            processors_metadata = _replaced(sampling_metadata, no_penalties=True)
        else:
            processors_metadata = sampling_metadata
        target_logits = self.apply_logits_processors(raw_target_logits.clone(), processors_metadata, metadata)

        temperature = _temperature(sampling_metadata, B, dev)
        top_k, top_p = getattr(sampling_metadata, "top_k", None), getattr(sampling_metadata, "top_p", None)
        output_token_ids, accept_logprobs = _verify(metadata.draft_token_ids, num_draft, metadata.max_spec_len,
                                                    metadata.cu_num_draft_tokens, draft_probs, target_logits, bonus,
                                                    sampling_metadata, temperature, top_k, top_p, penalties,
                                                    fused_logprobs)
        logprobs_tensors = None
        if fused_logprobs is not None:
            logprobs_tensors = self._fused_logprobs_tensors(
                fused_logprobs[0], accept_logprobs, num_draft, output_token_ids, raw_target_logits, metadata,
                bonus_output.logprobs_tensors.logprobs)
        elif getattr(sampling_metadata, "max_num_logprobs", None) is not None:
            if self.is_processed_logprobs_mode:
                target_logits = self._constrained(target_logits, sampling_metadata, temperature, num_draft)
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_output.logprobs_tensors.logprobs, output_token_ids)
        return _sampler_output(output_token_ids, logprobs_tensors)

    def _fused_logprobs(self, sampling_metadata, draft_probs, num_tokens: int):
        """(N, accept's logprobs_mode) when accept computes the draft positions' logprobs, else None (vLLM's
        functions on materialized rows, `_get_logprobs_tensors`): N in [0, 20]; the raw modes only where no
        processor changes the rows accept reads (raw logprobs are of the model's rows); the processed mode only
        where vLLM's processed law is accept's: no draft_probs with sampled requests (vLLM processes the target
        alone then), and no greedy request filtered beside sampled ones (vLLM's top-k / top-p apply to every
        row of a mixed batch, accept's greedy law is unfiltered)."""
        n = getattr(sampling_metadata, "max_num_logprobs", None)
        mode = getattr(self.sampler, "logprobs_mode", "raw_logprobs")
        if n is None or not 0 <= n <= val.MAX_LOGPROBS or mode not in FUSED_LOGPROBS_MODES or num_tokens == 0:
            return None
        if draft_probs is not None and not sampling_metadata.all_greedy:
            return None
        if mode == "processed_logprobs":
            filtered = (getattr(sampling_metadata, "top_k", None) is not None
                        or getattr(sampling_metadata, "top_p", None) is not None)
            mixed = not (sampling_metadata.all_greedy or sampling_metadata.all_random)
            return None if filtered and mixed else (n, "processed")
        return None if _rows_processed(sampling_metadata) else (n, "raw")

    def _fused_logprobs_tensors(self, n, lp, num_draft, output_token_ids, raw_target_logits, metadata,
                                bonus_logits):
        """vLLM's LogprobsTensors of the output positions [B * (max_spec_len + 1), 1 + n] from accept's logprobs
        at the draft positions and the sampler's bonus rows at a request's last position (vLLM's functions on its
        B bonus rows); positions past the emitted ones hold token 0 and -inf (parse_output drops them)."""
        B, T = output_token_ids.shape
        dev = output_token_ids.device
        ids = torch.zeros(B, T, 1 + n, dtype=torch.int64, device=dev)
        scores = torch.full((B, T, 1 + n), float("-inf"), device=dev)
        ranks = torch.zeros(B, T, dtype=torch.int64, device=dev)
        drafts = torch.tensor(num_draft, device=dev)
        j = torch.arange(T, device=dev)
        if lp is not None:
            width = min(lp.token_logprobs.shape[1], T)
            emitted = output_token_ids[:, :width].long()
            at = (emitted >= 0) & (j[:width] < drafts.unsqueeze(1))  # (the draft positions' rows)
            ids[:, :width] = torch.where(at.unsqueeze(-1), torch.cat((emitted.clamp(min=0).unsqueeze(-1),
                                                                      lp.top_token_ids[:, :width]), -1), 0)
            if self.is_logits_logprobs_mode:  # (raw_logits: the scores are the model's logits)
                rows = torch.zeros_like(drafts)
                rows[1:] = drafts.cumsum(0)[:-1]
                flat = (rows.unsqueeze(1) + j[:width]).clamp(max=max(raw_target_logits.shape[0] - 1, 0))
                values = raw_target_logits[flat].gather(-1, ids[:, :width])
            else:
                values = torch.cat((lp.token_logprobs[:, :width].unsqueeze(-1), lp.top_logprobs[:, :width]), -1)
            scores[:, :width] = torch.where(at.unsqueeze(-1), values, scores[:, :width])
            ranks[:, :width] = torch.where(at, lp.token_ranks[:, :width], 0)
        last = output_token_ids.gather(1, drafts.long().unsqueeze(1)).squeeze(1).long()  # the bonus position
        complete = last >= 0
        bonus_rows = bonus_logits if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(bonus_logits)
        bonus = self.sampler.gather_logprobs(bonus_rows, n, last.clamp(min=0))
        b = torch.arange(B, device=dev)[complete]
        at = drafts.long()[complete]
        ids[b, at] = bonus.logprob_token_ids[complete].long()
        scores[b, at] = bonus.logprobs[complete].float()
        ranks[b, at] = bonus.selected_token_ranks[complete].long()
        return type(bonus)(ids.view(B * T, -1), scores.view(B * T, -1), ranks.view(B * T))

    @staticmethod
    def _constrained(target_logits, sampling_metadata, temperature, num_draft):
        """vLLM's apply_sampling_constraints, materialized only for processed logprobs: logits / t (greedy rows
        by 1), then vLLM's own top-k/top-p masking; all-greedy batches keep their logits."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
        if sampling_metadata.all_greedy:
            return target_logits
        counts = torch.tensor(num_draft, device=target_logits.device)
        t, top_k, top_p = (None if x is None else x.repeat_interleave(counts)
                           for x in (temperature, sampling_metadata.top_k, sampling_metadata.top_p))
        return apply_top_k_top_p(target_logits / torch.where(t == GREEDY_TEMPERATURE, 1.0, t).unsqueeze(-1),
                                 top_k, top_p)

    def _get_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                              sampled_token_ids):
        """vLLM's: the logprobs of every output position (rejected ones included; parse_output drops them),
        from the target rows as processed for the logprobs mode and the sampler's bonus rows."""
        cu_num_sampled_tokens = torch.zeros_like(metadata.cu_num_sampled_tokens)
        cu_num_sampled_tokens[1:] = metadata.cu_num_sampled_tokens[:-1]
        final_logits = torch.zeros_like(logits, dtype=torch.float32)
        final_logits[metadata.target_logits_indices] = target_logits.to(torch.float32)
        final_logits[metadata.bonus_logits_indices] = bonus_logits.to(torch.float32)
        offsets = torch.arange(sampled_token_ids.shape[-1], device=cu_num_sampled_tokens.device,
                               dtype=cu_num_sampled_tokens.dtype)
        indices = (cu_num_sampled_tokens.unsqueeze(1) + offsets).flatten().clamp(max=final_logits.shape[0] - 1)
        tokens = sampled_token_ids.flatten().clamp(min=0)  # (a placeholder reads token 0)
        rows = final_logits[indices]
        logprobs = rows if self.is_logits_logprobs_mode else self.sampler.compute_logprobs(rows)
        return self.sampler.gather_logprobs(logprobs, max_num_logprobs, tokens.to(torch.int64))

    @staticmethod
    def parse_output(
        output_token_ids: torch.Tensor,
        vocab_size: int,
        discard_req_indices: Sequence[int] = (),
        logprobs_tensors: LogprobsTensors | None = None,
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """(per-request lists of the valid token ids (!= -1, < vocab_size; discarded requests empty), vLLM's
        LogprobsLists of the valid positions (discarded requests kept, as vLLM keeps them) or None). A host copy:
        for the engine's bookkeeping."""
        ids = output_token_ids.cpu()
        valid = (ids != PLACEHOLDER_TOKEN_ID) & (ids < vocab_size)
        output_logprobs = None
        if logprobs_tensors is not None:
            cu_num_tokens = [0] + valid.sum(1).cumsum(0).tolist()
            output_logprobs = logprobs_tensors.filter(valid.flatten()).tolists(cu_num_tokens)
        if len(discard_req_indices) > 0:
            valid[list(discard_req_indices)] = False
        return [row[keep].tolist() for row, keep in zip(ids, valid)], output_logprobs

    def apply_logits_processors(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        metadata: SpecDecodeMetadata,
    ) -> torch.Tensor:
        """vLLM 0.33's, with vLLM's own functions (imported when a request needs them): penalties, the allowed
        tokens, bad words (with the drafts), min-tokens and the thinking budget on the target rows [num_tokens,
        V], in place where vLLM's are."""
        has_penalties = not getattr(sampling_metadata, "no_penalties", True)
        bad_words = getattr(sampling_metadata, "bad_words_token_ids", None)
        allowed_mask = getattr(sampling_metadata, "allowed_token_ids_mask", None)
        output_token_ids = getattr(sampling_metadata, "output_token_ids", None)
        if bad_words or has_penalties:
            output_token_ids = self._combine_outputs_with_spec_tokens(output_token_ids,
                                                                      sampling_metadata.spec_token_ids)
        if allowed_mask is not None or has_penalties:
            counts = torch.tensor(metadata.num_draft_tokens, device="cpu")
            repeat_indices = torch.arange(len(counts)).repeat_interleave(counts).to(logits.device)
            if has_penalties:
                from vllm.v1.sample.ops.penalties import apply_all_penalties
                logits = apply_all_penalties(
                    logits, sampling_metadata.prompt_token_ids[repeat_indices],
                    sampling_metadata.presence_penalties[repeat_indices],
                    sampling_metadata.frequency_penalties[repeat_indices],
                    sampling_metadata.repetition_penalties[repeat_indices], output_token_ids)
            if allowed_mask is not None:
                logits.masked_fill_(allowed_mask[repeat_indices], float("-inf"))
        if bad_words:
            from vllm.v1.sample.ops.bad_words import apply_bad_words_with_drafts
            apply_bad_words_with_drafts(logits, bad_words, output_token_ids, metadata.num_draft_tokens)
        logitsprocs = getattr(sampling_metadata, "logitsprocs", None)
        for processor in getattr(logitsprocs, "non_argmax_invariant", ()):
            from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
            if isinstance(processor, MinTokensLogitsProcessor):
                logits = processor.apply_with_spec_decode(logits, metadata.num_draft_tokens)
        holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
        if holder is not None and holder.has_tracked_requests():
            logits = holder.apply_to_logits(logits, predict_bonus_token=False,
                                            spec_token_ids=sampling_metadata.spec_token_ids)
        return logits

    @staticmethod
    def _combine_outputs_with_spec_tokens(output_token_ids, spec_token_ids=None):
        """vLLM's: per draft position of each request with drafts, the request's output tokens followed by the
        drafts before that position (what a penalty or a bad word sees there)."""
        if spec_token_ids is None:
            return output_token_ids
        result = []
        for out, spec in zip(output_token_ids, spec_token_ids):
            if len(spec) == 0:
                continue
            result.append(out)
            for i in range(len(spec) - 1):
                result.append([*result[-1], spec[i]])
        return result
