"""FlashInfer's chain verifier, `flashinfer.sampling.chain_speculative_sampling`, on specdec.accept.

Same signature, dtypes, outputs and counters; the acceptance rule is FlashInfer's (accept draft x iff
u * q(x) < p(x), else draw from relu(p - q), the bonus from the last target row), so the output law is the
same. Randomness: FlashInfer keys a Philox stream per row with (seed, offset) or the generator's state. Here
request b's stream is specdec's, keyed by a seed derived from (seed, b) with `offset` as the stream offset, or
by a seed drawn from `generator` (or torch's default generator): deterministic for a given (seed, offset),
independent across rows, but not FlashInfer's numbers. The accepted-token counter's re-tests draw from
`generator`, or from a generator keyed by int (seed, offset), else from torch's default one. `deterministic` is
accepted and has no effect (specdec is always deterministic).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

import specdec
from specdec import _validation as val
from . import seeds_from

_GOLDEN = 0x9E3779B97F4A7C15  # row b's key: seed + b * golden ratio (mod 2^63), so rows never share a stream


def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True, generator: Optional[torch.Generator] = None,
                               seed: Optional[Union[int, torch.Tensor]] = None,
                               offset: Optional[Union[int, torch.Tensor]] = None):
    """Verify B chains of S draft tokens.

    draft_probs (B, S, V): the drafter's law at each draft position. draft_token_ids (B, S) int. target_probs
    (B, S + 1, V): the target's law at each position and after the last draft. Rows need not be normalized.
    maybe_output_accepted_token_num / maybe_output_emitted_draft_token_num: (B,) int32 counters ADDED to in
    place (None: new zeros): emitted = the accepted prefix length (the emitted draft tokens, without the final
    token); accepted = emitted plus how many of the later positions, each tested on its own with a fresh
    uniform, would have been accepted (FlashInfer's measure of draft/target agreement, >= emitted).
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
    if (seed is None) != (offset is None):
        raise ValueError("seed, offset: give both or neither")
    rows = torch.arange(B, device=dev, dtype=torch.int64)
    retest = generator  # the re-tests' uniforms (a statistic, not accept's stream)
    if seed is None:
        seeds, stream_offset = seeds_from(generator, B, dev), 0
    else:
        if not isinstance(seed, torch.Tensor) and not isinstance(offset, torch.Tensor):
            retest = torch.Generator(device=dev).manual_seed((int(seed) * 1000003 + int(offset)) % 2**63)
        key = seed.reshape(-1)[:1].to(device=dev, dtype=torch.int64) if isinstance(seed, torch.Tensor) else int(seed)
        seeds = (rows * _GOLDEN + key) & (2**63 - 1)
        stream_offset = offset.reshape(-1)[:1].to(device=dev, dtype=torch.int64).expand(B) \
            if isinstance(offset, torch.Tensor) else int(offset)
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
    u = torch.rand(B, S, dtype=torch.float64, device=dev, generator=retest)
    later = torch.arange(S, device=dev) >= emitted.unsqueeze(1)
    counters[0] += emitted + (later & (u * q < p)).sum(1, dtype=torch.int32)
    counters[1] += emitted
    return output, counters[0], counters[1]

