"""vLLM 0.34's model-runner-v2 rejection sampler (`vllm.v1.worker.gpu.spec_decode.rejection_sampler`) on
specdec.accept. The module imports without vllm; vllm is imported when a RejectionSampler is built.

`RejectionSampler(sampler, spec_config, device, *, watermark_key=None)` and
`__call__(logits, input_batch, draft_logits=None) -> SamplerOutput` are vLLM's (same signatures, vLLM's own
SamplerOutput, the same sampled / num_sampled / num_rejected / logprobs layouts), so the model runner can build
it in place of its own (specdec.integrations.vllm_plugin does that).

What changes is the verification. vLLM first materializes every request's processed fp32 logits
(`sampler.apply_sampling_params`, chunked at 1 GB) and then runs its rejection kernels on them. Here accept
reads the model's logits rows in place (packed form, `cu_num_nodes`) and fuses, in vLLM's order, the logit
bias and min-tokens, the repetition, frequency and presence penalties (reading vLLM's own state:
output_bin_counts, prompt_bin_mask, its bias and stop-token buffers, gathered by request state), then
temperature, min-p, top-k and top-p (filter_order="vllm": min-p first). Along a draft chain a row's penalties
count the drafts before it, as vLLM's penalty kernel does. The vLLM sampler it was given processes, on those
requests' rows only, the requests that need more:
  - requests that another logits processor modifies (bad words, custom processors) or that a thinking budget
    can force, recorded as the sampler admits them (`Sampler.add_request`; the runner builds its rejection
    sampler before any request arrives); requests with allowed_token_ids; min-tokens with structured output
    (vLLM restores the stop tokens when the grammar masks every other token; accept refuses an empty row);
  - sampled requests with a filter, a penalty, a bias or min-tokens when draft logits are given: vLLM's
    drafter draws from softmax(draft_logits / t), unprocessed, while accept would process the draft's law
    like the target's.
Those rows are then verified at temperature 1 against draft_logits / t: vLLM's law exactly.
The grammar bitmask is not the sampler's in vLLM 0.34: the runner applies it to the logits in place before
this call, so the rows read here are already masked.

The rules are vLLM's: greedy requests (temperature 0; vLLM maps t < 1e-5 to 0, as specdec does) keep drafts
while they equal the target's argmax; sampled ones use token-wise rejection sampling ("standard") or block
verification ("block"), against the cached draft logits (`DraftLogitsCache`, pre-temperature) when given, else
against the proposals as one-hot drafts. A draft id of -1 (a placeholder, `gather_draft_sampled`) is rejected at
its position. num_sampled / num_rejected are vLLM's (`get_num_sampled_and_rejected`). Logprobs in vLLM's
"raw_logprobs", "processed_logprobs" and "raw_logits" modes come out of accept (return_logprobs: the emitted
tokens', their ranks and the top N at each emitted row, N <= 20, in the same pass over each emitted row; the
processed law is accept's own, the one it verified with) when no request is routed and none asks for
logprob_token_ids; otherwise vLLM's own `_get_logprobs_tensors` computes them on the logits vLLM would use (the
raw ones, or the processed ones for the processed modes, materialized only then).
Randomness: request b draws from specdec's stream (sampling_states.seeds[b], pos of its first logits row), so
its draws are deterministic per (seed, position), as vLLM's are; they are not vLLM's numbers.

Refused (a ValueError naming the setting): rejection_sample_method "synthetic" and "fly" (lossy),
watermark_key, enable_adaptive_verification, and a batch-sharded DraftLogitsCache.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

import specdec
from specdec import _validation as val

LOSSLESS_METHODS = {"standard": "token", "block": "block"}
LOSSY_METHODS = ("synthetic", "fly")
# vLLM's logprobs modes that accept computes: its mode of the law, and whether vLLM's scores are the raw logits
FUSED_LOGPROBS_MODES = {"raw_logprobs": ("raw", False), "processed_logprobs": ("processed", False),
                        "raw_logits": ("raw", True)}


class RejectionSampler:
    """vLLM MRv2's RejectionSampler, verifying with specdec.accept (see the module docstring)."""

    def __init__(self, sampler, spec_config, device: torch.device, *, watermark_key: Optional[int] = None):
        method = spec_config.rejection_sample_method
        if method in LOSSY_METHODS:
            raise ValueError(f"spec_config.rejection_sample_method: {method!r} is not supported: 'synthetic' and "
                             "'fly' are lossy (they change the output law); use 'standard' or 'block'")
        if method not in LOSSLESS_METHODS:
            raise ValueError(f"spec_config.rejection_sample_method: expected one of 'standard', 'block', got "
                             f"{method!r}")
        if watermark_key is not None:
            raise ValueError("watermark_key: watermarked verification is not supported; use vLLM's "
                             "RejectionSampler with watermarking")
        if spec_config.enable_adaptive_verification:
            raise ValueError("spec_config.enable_adaptive_verification: not supported (it compacts the logits "
                             "rows behind cu_num_logits_np)")
        self.sampler = sampler
        self.watermark_key = watermark_key
        self.num_speculative_steps = spec_config.num_speculative_tokens
        self.enable_adaptive_verification = False
        self.method = LOSSLESS_METHODS[method]
        from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
        from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

        # vLLM's penalties, logit bias and min-tokens states, whose buffers accept reads; per request state,
        # whether another logits processor (bad words, a custom one) or the thinking budget modifies its logits
        self.penalties = next(p for p in sampler.logits_processors if isinstance(p, PenaltiesState))
        self.logit_bias = next(p for p in sampler.logits_processors if isinstance(p, LogitBiasState))
        max_num_reqs = sampler.sampling_states.max_num_reqs
        self._processor_active = []
        for processor in (*sampler.logits_processors, sampler.thinking_budget_state):
            if processor is self.penalties or processor is self.logit_bias:
                continue
            active = np.zeros(max_num_reqs, dtype=bool)
            processor.add_request = _recording(processor.add_request, active)
            self._processor_active.append(active)

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None):
        from vllm.config.model import PROCESSED_LOGPROBS_MODES
        from vllm.v1.outputs import LogprobsTensors
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.metrics.logits import get_num_nans
        from vllm.v1.worker.gpu.sample.output import SamplerOutput, SamplingMaskTensors
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler as VllmRejectionSampler
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

        sampler = self.sampler
        # (before any processing, as vLLM counts them)
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        draft_sampled, pos = gather_draft_sampled(
            input_batch.input_ids, input_batch.positions, input_batch.logits_indices,
            input_batch.expanded_idx_mapping, input_batch.expanded_local_pos, sampler.req_states.prefill_len.gpu)
        batch = _Batch(self, logits, input_batch, draft_logits, draft_sampled, pos)

        B, T = input_batch.num_reqs, self.num_speculative_steps + 1
        sampled = torch.full((B, T), -1, dtype=torch.int64, device=logits.device)
        num_sampled = torch.zeros(B, dtype=torch.int32, device=logits.device)
        logprobs_dims = sampler.get_logprobs_dims(input_batch.idx_mapping_np)
        # logprobs come out of accept (with their ranks) when every request is fused and asks for at most accept's
        # number of top entries, with no logprob_token_ids; otherwise vLLM computes them (_get_logprobs_tensors)
        fused_logprobs = None
        if (logprobs_dims is not None and sampler.logprobs_mode in FUSED_LOGPROBS_MODES and logprobs_dims[1] == 0
                and logprobs_dims[0] <= val.MAX_LOGPROBS and not batch.routed.any()):
            rows = (logits.shape[0], 1 + logprobs_dims[0])
            # (rows past the emitted ones hold token 0 and rank 0, which vLLM's consumers slice away, as vLLM's own)
            fused_logprobs = (torch.zeros(rows, dtype=torch.int64, device=logits.device),
                              torch.full(rows, float("-inf"), device=logits.device),
                              torch.zeros(rows[0], dtype=torch.int64, device=logits.device))
        fused = ~batch.routed
        if fused.any():
            self._verify(batch, logits, batch.all_rows, fused, processed=False, out=(sampled, num_sampled),
                         logprobs=fused_logprobs)
        if batch.routed.any():
            routed_reqs = np.flatnonzero(batch.routed)
            rows = batch.rows_of(routed_reqs)
            processed = batch.processed_logits(routed_reqs, rows)
            self._verify(batch, processed, rows, batch.routed, processed=True, out=(sampled, num_sampled))
        if sampler.trace_replay_state is not None:
            sampler.trace_replay_state.apply_trace_to_verified(
                sampled, num_sampled, draft_sampled, input_batch.cu_num_logits, input_batch.idx_mapping)

        vllm_logprobs = logprobs_dims is not None and fused_logprobs is None
        wants_processed = (vllm_logprobs and sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES
                           or sampler.return_sampling_mask)
        all_processed = batch.processed_logits(np.arange(B), batch.all_rows) if wants_processed else None
        if fused_logprobs is not None:
            token_ids, scores, ranks = fused_logprobs
            expanded = logits.shape[0] != B
            logprobs_tensors = LogprobsTensors(token_ids, scores, ranks, input_batch.cu_num_logits_np.tolist()
                                               if expanded else None)
        else:
            logprobs_tensors = VllmRejectionSampler._get_logprobs_tensors(
                self, sampled, num_sampled,
                all_processed if sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits,
                input_batch.cu_num_logits, input_batch.cu_num_logits_np, input_batch.expanded_idx_mapping,
                logprobs_dims)
        sampling_mask_tensors = None
        if sampler.return_sampling_mask:
            max_num_kept = int(np.max(sampler.sampling_states.top_k.np[input_batch.idx_mapping_np]))
            sampling_mask_tensors = SamplingMaskTensors.from_logits(
                all_processed, input_batch.cu_num_logits, num_sampled, max_num_kept, T)

        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping,
            sampler.req_states.prefill_len.gpu)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors, num_nans=num_nans,
                             num_sampled=num_sampled, num_rejected=num_rejected,
                             sampling_mask_tensors=sampling_mask_tensors)

    def _verify(self, batch: "_Batch", target: torch.Tensor, rows: np.ndarray, reqs: np.ndarray, *,
                processed: bool, out, logprobs=None) -> None:
        """Verify the requests `reqs` (a (B,) bool mask) with one accept call on `target`, whose row r is the
        batch's logits row rows[r] (the rows of whole requests, in batch order), and write their sampled tokens
        and counts into out = (sampled (B, T), num_sampled (B,)).

        The call's requests (accept's segments) are the batch's requests, each cut after its first row when
        its drafts are placeholders (vLLM emits then one token, from that row); the cut-off rows and the
        requests not in `reqs` ride along as greedy segments whose results are dropped. With processed rows
        (vLLM's processing applied, temperature included) a sampled request is verified at temperature 1,
        unfiltered, against draft_logits / t; with the model's rows, accept applies the requests' penalties,
        logit bias and min-tokens (`_Batch.sampling_params`) and filters. logprobs: None, or (token ids, scores,
        ranks), (rows, 1 + N), (rows, 1 + N) and (rows,), vLLM's layout (the emitted token, then the N largest, and
        the emitted token's rank), written at the kept segments' emitted rows from accept's logprobs in vLLM's
        logprobs mode (model rows only)."""
        dev = target.device
        seg = batch.segments(rows, reqs)
        seg_req = torch.from_numpy(seg.req).to(dev)
        real = torch.from_numpy(seg.real).to(dev)
        rows_t = torch.from_numpy(rows).to(dev)
        tokens = batch.draft_sampled[rows_t].clamp(min=0)  # placeholders lie only in dropped segments
        temperature = batch.temperature[seg_req]
        sampling = real & (temperature != 0)
        start = torch.from_numpy(seg.start).to(dev)
        first_pos = batch.pos[rows_t][start]
        if processed:
            temperature = sampling.float()  # (the processed rows carry the temperature)
            params = {}
        else:
            temperature = torch.where(real, temperature, 0.0)
            params = dict(batch.filters(seg_req, seg.req), **batch.sampling_params(seg, seg_req, first_pos),
                          filter_order="vllm")
            if logprobs is not None:
                params.update(return_logprobs=logprobs[0].shape[1] - 1,
                              logprobs_mode=FUSED_LOGPROBS_MODES[self.sampler.logprobs_mode][0])
        draft = batch.draft_rows(rows_t, tokens, seg, dev)
        if draft is not None and processed:
            row_temperature = batch.temperature[seg_req].repeat_interleave(torch.from_numpy(seg.length).to(dev))
            draft = draft.float() / torch.where(row_temperature > 0, row_temperature, 1.0).unsqueeze(1)
        T = self.num_speculative_steps + 1
        res = specdec.accept(target, tokens, torch.from_numpy(seg.parents).to(dev), draft_logits=draft,
                             temperature=temperature, seeds=batch.seeds[seg_req], offset=first_pos,
                             method=self.method, cu_num_nodes=torch.from_numpy(seg.cu).to(dev), max_nodes=T,
                             **params)
        # emitted tokens of a chain: the accepted drafts (rows start + 1 ..), then the next token
        i = torch.arange(T, device=dev)
        num = res.num_accepted.long().unsqueeze(1)
        draft_rows = (start.unsqueeze(1) + 1 + i).clamp(max=len(rows) - 1)
        emitted = torch.where(i < num, tokens[draft_rows], torch.where(i == num, res.next_tokens.unsqueeze(1), -1))
        keep = torch.from_numpy(np.flatnonzero(seg.real)).to(dev)
        out[0][seg_req[keep]] = emitted[keep]
        out[1][seg_req[keep]] = (res.num_accepted[keep] + 1).to(out[1].dtype)
        if logprobs is not None:  # the emitted positions' rows (rows = all rows: a row's index is its own)
            lp = res.logprobs
            at = (i <= num) & torch.from_numpy(seg.real).to(dev).unsqueeze(1)
            row = (start.unsqueeze(1) + i)[at]
            ids = torch.cat([emitted[at].unsqueeze(1), lp.top_token_ids[at]], 1)
            logprobs[0][row] = ids
            if FUSED_LOGPROBS_MODES[self.sampler.logprobs_mode][1]:  # (raw_logits: the scores are the logits)
                logprobs[1][row] = target[rows_t[row]].gather(1, ids).float()
            else:
                logprobs[1][row] = torch.cat([lp.token_logprobs[at].unsqueeze(1), lp.top_logprobs[at]], 1)
            logprobs[2][row] = lp.token_ranks[at]


def _recording(add_request, active: np.ndarray):
    """A processor's add_request that also records, per request state, whether the processor modifies it."""
    def add_request_recorded(req_idx, sampling_params):
        active[req_idx] = modifies = add_request(req_idx, sampling_params)
        return modifies
    return add_request_recorded


def _first_entries(table: torch.Tensor, state: torch.Tensor, counts: np.ndarray, pad) -> torch.Tensor:
    """(segments, max(counts)): the first counts[s] entries of vLLM's per-request-state table row state[s] (its
    bias or stop-token buffers, stale past a request's count), the rest `pad` (accept's padding)."""
    width = int(counts.max())
    given = torch.arange(width, device=table.device) < torch.from_numpy(counts).to(table.device).unsqueeze(1)
    return torch.where(given, table[state, :width], pad)


class _Segments:
    """accept's requests over some rows: per segment its request (batch index), whether its results are kept,
    its first row and length (host); cu (segments + 1,) and parents (rows,) within the segment."""

    def __init__(self, req, real, start, length):
        self.req, self.real, self.start, self.length = req, real, start, length
        self.cu = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
        self.parents = np.arange(int(self.cu[-1]), dtype=np.int64) - np.repeat(start, length) - 1


class _Batch:
    """One call's requests, as vLLM's runner gives them, with their sampling parameters."""

    def __init__(self, rs: RejectionSampler, logits, input_batch, draft_logits, draft_sampled, pos):
        sampler, states = rs.sampler, rs.sampler.sampling_states
        self.sampler, self.input_batch, self.draft_sampled, self.pos = sampler, input_batch, draft_sampled, pos
        self.logits, self.method = logits, rs.method
        self.vocab_size = logits.shape[1]
        idx_np = input_batch.idx_mapping_np
        idx = input_batch.idx_mapping
        self.cu_np = input_batch.cu_num_logits_np.astype(np.int64)
        self.all_rows = np.arange(int(self.cu_np[-1]), dtype=np.int64)
        self.temperature = states.temperature.gpu[idx].float()
        self.seeds = states.seeds.gpu[idx]
        self.top_k_np, self.top_p_np = states.top_k.np[idx_np], states.top_p.np[idx_np]
        self.min_p_np = states.min_p.np[idx_np]
        self.top_k, self.top_p, self.min_p = states.top_k.gpu[idx], states.top_p.gpu[idx], states.min_p.gpu[idx]
        self.draft_logits = draft_logits
        if draft_logits is not None:
            if draft_logits.row_mapping is not None:
                raise ValueError("draft_logits: a batch-sharded DraftLogitsCache is not supported")
            if draft_logits.values.shape[-1] != self.vocab_size:
                raise ValueError(f"draft_logits: vocabulary {draft_logits.values.shape[-1]} differs from the "
                                 f"target's {self.vocab_size}")
        self.penalties, self.logit_bias = rs.penalties, rs.logit_bias
        lb = rs.logit_bias
        self.use_penalty = rs.penalties.use_penalty[idx_np]
        self.num_logit_bias = lb.num_logit_bias.np[idx_np]
        self.use_min_tokens = lb.num_stop_token_ids.np[idx_np] > 0  # (set only with min_tokens > 0)
        sampling = states.temperature.np[idx_np] != 0
        filtered = (self.top_k_np < states.vocab_size) | (self.top_p_np < 1) | (self.min_p_np > 0)
        step0 = self.use_penalty | (self.num_logit_bias > 0) | self.use_min_tokens
        # routed to vLLM's processing: requests that another processor modifies; allowed_token_ids (a -inf
        # overwrite of the row); min-tokens with structured output (vLLM restores the stop tokens when the
        # grammar masked every other token, where accept refuses an empty row)
        by_processor = (lb.num_allowed_token_ids.np[idx_np] > 0) | (
            self.use_min_tokens & (lb.restore_when_all_masked.np[idx_np] != 0))
        for active in rs._processor_active:
            by_processor |= active[idx_np]
        self.routed = by_processor | sampling & (filtered | step0) & (draft_logits is not None)
        # Placeholders (-1 drafts) only fill the steps of requests still in their prefill: read them (a host
        # sync) only for batches that have some.
        self.placeholder = np.zeros(len(idx_np), dtype=bool)
        if input_batch.has_prefill:
            row_placeholder = (draft_sampled < 0).cpu().numpy()
            self.placeholder = np.logical_or.reduceat(row_placeholder, self.cu_np[:-1]) & (np.diff(self.cu_np) > 0)

    def rows_of(self, reqs: np.ndarray) -> np.ndarray:
        return np.concatenate([np.arange(self.cu_np[b], self.cu_np[b + 1]) for b in reqs])

    def segments(self, rows: np.ndarray, reqs: np.ndarray) -> _Segments:
        """The segments over `rows` (whole requests, batch order), keeping the requests of the mask `reqs`."""
        batch_reqs = np.unique(np.searchsorted(self.cu_np, rows, side="right") - 1)
        n = self.cu_np[batch_reqs + 1] - self.cu_np[batch_reqs]
        head = np.where(self.placeholder[batch_reqs], 1, n)
        start = np.cumsum(n) - n
        # per request: its head (kept if in reqs), then the rest of its rows (dropped), where not empty
        req = np.stack([batch_reqs, batch_reqs], 1).ravel()
        real = np.stack([reqs[batch_reqs], np.zeros_like(batch_reqs, dtype=bool)], 1).ravel()
        starts = np.stack([start, start + head], 1).ravel()
        length = np.stack([head, n - head], 1).ravel()
        nonempty = length > 0
        return _Segments(req[nonempty], real[nonempty], starts[nonempty], length[nonempty])

    def filters(self, seg_req: torch.Tensor, seg_req_np: np.ndarray) -> dict:
        """accept's top_k / top_p / min_p per segment, each left out when off for all of them."""
        out = {}
        if np.any(self.top_k_np[seg_req_np] < self.vocab_size):
            out["top_k"] = self.top_k[seg_req]
        if np.any(self.top_p_np[seg_req_np] < 1):
            out["top_p"] = self.top_p[seg_req]
        if np.any(self.min_p_np[seg_req_np] > 0):
            out["min_p"] = self.min_p[seg_req]
        return out

    def sampling_params(self, seg: _Segments, seg_req: torch.Tensor, first_pos: torch.Tensor) -> dict:
        """accept's penalties, logit bias and min-tokens per segment from vLLM's states (read from its buffers,
        gathered by request state), each left out when off for all the kept segments. vLLM counts a request's
        output (output_bin_counts) from its prefill only for requests with a penalty, so the counts of the
        others are zeros here. min-tokens: vLLM masks the stop tokens at a row of position pos while
        pos + 1 < prompt_len + min_tokens (min_lens); accept's node at depth d has generated sum(counts) + d
        tokens, so the segment's min_tokens is its remaining count from the root, plus sum(counts)."""
        out = {}
        real = seg.real
        pen = self.use_penalty[seg.req] & real
        min_tok = self.use_min_tokens[seg.req] & real
        num_bias = np.where(real, self.num_logit_bias[seg.req], 0)
        state = self.input_batch.idx_mapping[seg_req].long()
        dev = first_pos.device
        if pen.any() or min_tok.any():
            pen_t = torch.from_numpy(pen).to(dev)
            counts = torch.where(pen_t.unsqueeze(1), self.penalties.output_bin_counts[state], 0)
            out["output_token_counts"] = counts
        if pen.any():
            ps = self.penalties
            out.update(repetition_penalty=ps.repetition_penalty.gpu[state],
                       frequency_penalty=ps.frequency_penalty.gpu[state],
                       presence_penalty=ps.presence_penalty.gpu[state],
                       prompt_token_mask=torch.where(pen_t.unsqueeze(1), ps.prompt_bin_mask[state], 0))
        lb = self.logit_bias
        if num_bias.any():
            out["logit_bias"] = (_first_entries(lb.logit_bias_token_ids.gpu, state, num_bias, -1),
                                 _first_entries(lb.logit_bias.gpu, state, num_bias, 0.0))
        if min_tok.any():
            num_stop = np.where(min_tok, lb.num_stop_token_ids.np[self.input_batch.idx_mapping_np[seg.req]], 0)
            remaining = (lb.min_lens.gpu[state] - first_pos - 1).clamp(min=0)
            min_tok_t = torch.from_numpy(min_tok).to(dev)
            out["min_tokens"] = torch.where(min_tok_t, remaining + counts.sum(-1), 0).to(torch.int32)
            out["stop_token_ids"] = _first_entries(lb.stop_token_ids.gpu, state, num_stop, -1)
        return out

    def draft_rows(self, rows_t: torch.Tensor, tokens: torch.Tensor, seg: _Segments, dev) -> Optional[torch.Tensor]:
        """accept's draft_logits for the rows: the cached pre-temperature draft logits of each row's step, or, for
        block verification without them, the proposals as one-hot logits (0 at the next row's token)."""
        ib = self.input_batch
        if self.draft_logits is not None:
            values = self.draft_logits.values
            step = ib.expanded_local_pos[rows_t].long().clamp(max=values.shape[1] - 1)  # (a last row has no draft)
            return values[ib.expanded_idx_mapping[rows_t].long(), step]
        if self.method != "block":
            return None
        next_token = torch.roll(tokens, -1)  # (the last row's entry is unused; it only keeps the row finite)
        one_hot = torch.full((len(tokens), self.vocab_size), float("-inf"), device=dev)
        return one_hot.scatter_(1, next_token.unsqueeze(1), 0.0)

    def processed_logits(self, reqs: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """vLLM's processed fp32 logits (its sampler's apply_sampling_params) of the requests reqs, whose rows
        are `rows`."""
        ib, rows_t = self.input_batch, torch.from_numpy(rows).to(self.logits.device)
        reqs_t = torch.from_numpy(reqs).to(self.logits.device)
        processed = self.sampler.apply_sampling_params(
            self.logits[rows_t], ib.expanded_idx_mapping[rows_t], ib.idx_mapping[reqs_t], ib.idx_mapping_np[reqs],
            self.pos[rows_t], self.draft_sampled[rows_t], ib.expanded_local_pos[rows_t],
            ib.seq_lens_cpu_upper_bound.numpy()[reqs])
        return processed.float()
