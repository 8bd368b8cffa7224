"""FlashInfer's chain verifier, `flashinfer.sampling.chain_speculative_sampling` (FlashInfer 0.7.4), on
specdec.accept.

Same signature, dtypes, outputs and counters; the acceptance rule is FlashInfer's (accept draft x iff
u * q(x) < p(x), else draw from relu(p - q), the bonus from the last target row), so the output law is the
same. Randomness: FlashInfer keys row b's Philox stream with (seed[b], b, offset[b]) (seed / offset: ints, or 1-D
int64/uint64 tensors of length 1 or B, read per row) or with the generator's state. Here row b's stream is
specdec's, keyed by seed[b] and b with offset[b] as the stream offset (0 <= offset < 2**60), or by a seed drawn
from `generator` (or torch's default generator): deterministic for a given (seed[b], offset[b], b), independent
across rows, but not FlashInfer's numbers. The accepted-token counter's re-tests use uniforms hashed from the
same key. `deterministic` is accepted and has no effect (specdec is always deterministic).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

import specdec
from specdec import _validation as val
from specdec.distributed import _GOLDEN, _mix, _signed, _uniform
from . import seeds_from


def _per_row(name, x, B, dev) -> torch.Tensor:
    """(B,) int64: an int, or FlashInfer's 1-D int64/uint64 tensor of length 1 (broadcast) or B (one per row);
    uint64 values keep their bits."""
    if isinstance(x, torch.Tensor):
        val._tensor(name, x, dim=1, dtypes=(torch.int64, torch.uint64), device=dev)
        if x.shape[0] not in (1, B):
            raise ValueError(f"{name}: expected length 1 or {B} (one value per row), got {x.shape[0]}")
        return x.view(torch.int64).expand(B)
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: expected an int or a 1-D int64 tensor, got {type(x).__name__}")
    return torch.full((B,), _signed(x % 2**64), dtype=torch.int64, device=dev)


def _row_streams(generator, seed, offset, B, dev):
    """(seeds (B,), offsets (B,)) int64: row b's specdec stream, keyed by (seed[b], offset[b]) and the row index
    (as FlashInfer's Philox subsequence is), or by a seed drawn from generator (torch's default one if None)."""
    if (seed is None) != (offset is None):
        raise ValueError("seed, offset: give both or neither")
    if seed is None:
        return seeds_from(generator, B, dev), torch.zeros(B, dtype=torch.int64, device=dev)
    if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
        raise ValueError("seed, offset: both tensors or both ints, as FlashInfer requires")
    rows = torch.arange(B, device=dev, dtype=torch.int64)
    seeds = (_per_row("seed", seed, B, dev) + rows * _GOLDEN) & (2**63 - 1)  # rows never share a stream
    return seeds, _per_row("offset", offset, B, dev)


def chain_speculative_sampling(draft_probs, draft_token_ids, target_probs,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True, generator: Optional[torch.Generator] = None,
                               seed: Optional[Union[int, torch.Tensor]] = None,
                               offset: Optional[Union[int, torch.Tensor]] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify B chains of S draft tokens.

    draft_probs (B, S, V): the drafter's law at each draft position. draft_token_ids (B, S) int. target_probs
    (B, S + 1, V): the target's law at each position and after the last draft. Rows need not be normalized.
    maybe_output_accepted_token_num / maybe_output_emitted_draft_token_num: (B,) int32 counters ADDED to in
    place (None: new zeros): emitted = the accepted prefix length (the emitted draft tokens, without the final
    token); accepted = emitted plus how many of the positions after the first rejected one, each tested on its
    own with a fresh uniform, would have been accepted (FlashInfer's measure of draft/target agreement, >=
    emitted; the first rejected position is not tested again, as in FlashInfer's kernel). seed / offset: ints or
    (1,) / (B,) int64 (or uint64) tensors, both or neither (see the module docstring).
    Returns (output_token_ids (B, S + 1) int32: the accepted drafts, then the correction or bonus token, then
    -1; the two counters).
    """
    val._tensor("draft_token_ids", draft_token_ids, dim=2, dtypes=val.INT_DTYPES)
    B, S = draft_token_ids.shape
    dev = draft_token_ids.device
    val._tensor("draft_probs", draft_probs, dim=3, dtypes=val.FLOAT_DTYPES, device=dev)
    if draft_probs.shape[:2] != (B, S):
        raise ValueError(f"draft_probs: expected shape ({B}, {S}, V), got {tuple(draft_probs.shape)}")
    V = draft_probs.shape[2]
    val._tensor("target_probs", target_probs, dim=3, dtypes=val.FLOAT_DTYPES, device=dev)
    if target_probs.shape != (B, S + 1, V):
        raise ValueError(f"target_probs: expected shape ({B}, {S + 1}, {V}), got {tuple(target_probs.shape)}")
    if val.value_checks_enabled():
        val._fail_if("draft_token_ids", (draft_token_ids < 0) | (draft_token_ids >= V), f"must be in [0, {V})")
    counters = []
    for name, counter in (("maybe_output_accepted_token_num", maybe_output_accepted_token_num),
                          ("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num)):
        if counter is None:
            counter = torch.zeros(B, dtype=torch.int32, device=target_probs.device)
        elif not isinstance(counter, torch.Tensor) or counter.dtype != torch.int32 or counter.shape != (B,):
            # (FlashInfer would add into an int32 copy and leave the caller's tensor unchanged)
            got = f"{tuple(counter.shape)} {counter.dtype}" if isinstance(counter, torch.Tensor) else type(counter).__name__
            raise TypeError(f"{name}: expected a ({B},) int32 tensor, got {got}")
        counters.append(counter)
    dev = target_probs.device
    seeds, stream_offset = _row_streams(generator, seed, offset, B, dev)
    tokens = torch.cat((draft_token_ids.new_zeros(B, 1), draft_token_ids), 1)
    # the leaf's draft row is never read (nothing is drawn below it); the target's last row stands in for it
    draft = torch.cat((draft_probs, target_probs[:, S:]), 1)
    res = specdec.accept(tokens=tokens, parents=torch.arange(-1, S, device=dev).expand(B, S + 1),
                         target_probs=target_probs, draft_probs=draft, temperature=1.0, seeds=seeds,
                         offset=stream_offset)
    output = res.emitted_tokens(tokens).to(torch.int32)
    emitted = res.num_accepted
    # positions after the first rejection, each tested on its own (the rows normalized as accept normalizes them)
    x = draft_token_ids.long().unsqueeze(-1)
    p = target_probs[:, :S].gather(2, x)[..., 0].double() / target_probs[:, :S].double().sum(-1)
    q = draft_probs.gather(2, x)[..., 0].double() / draft_probs.double().sum(-1)
    u = _uniform(_mix(seeds ^ _mix(stream_offset))[:, None], torch.arange(S, device=dev))
    later = torch.arange(S, device=dev) > emitted.unsqueeze(1)  # (the first rejected position is not retested)
    counters[0] += emitted + (later & (u * q < p)).sum(1, dtype=torch.int32)
    counters[1] += emitted
    return output, counters[0], counters[1]

