"""The draft -> verify -> accept loop.

    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"))
    out = decoder.generate(prompts, max_new_tokens=128, temperature=0.0, seed=0)

One step for the whole batch:
  1. the drafter proposes a tree per request (node 0 = the last emitted token, the root); with adaptive
     speculation (specdec.adaptive) of the depth the policy chose for this step, or none (the root alone);
  2. the target runs the tree against its cache (`kv_append` + `tree_attention`, positions lens + depth);
  3. `specdec.accept` picks the longest accepted path plus one next token (greedy, or lossless sampling
     with per-request temperature, seed and step counter as the random-stream offset);
  4. `kv_rollback` keeps the path's K/V in the target's cache (and the drafter's, in `commit`, which gets
     the proposal back with the accepted path);
  5. the path's tokens and the next token are appended to each sequence.
Requests finish independently (EOS or max_new_tokens); a finished request keeps riding along with
one token per step (its output is cut), so shapes stay static. The only host read per step is the
stopping rule (with adaptive speculation it also brings back the accepted counts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

import specdec
from . import distributed
from .adaptive import AdaptiveDepth, measure_target_costs
from .drafters.base import Drafter, NoDrafter
from .models.llama import Llama
from ._validation import check_method_name
from .sampling import SamplingParams

CACHE_BUCKET = 256  # with compile=True, cache lengths are rounded up to a multiple of this


@dataclass
class GenerationOutput:
    """tokens[b]: request b's new tokens (cut at EOS, excluded, and max_new_tokens); stats[b]: its steps,
    tokens_per_step (tau), acceptance_by_depth (fraction of steps accepting >= d draft tokens, d = 1..),
    wall_s, tokens_per_s; summary: the same over the batch."""
    tokens: list
    stats: list
    summary: dict = field(default_factory=dict)


class SpeculativeDecoder:
    def __init__(self, target: Llama, drafter: Optional[Drafter] = None, *, eos_token_id: Optional[int] = None,
                 block_size: Optional[int] = None, kv_dtype: Optional[torch.dtype] = None, method: str = "token",
                 vocab_shard=None, adaptive=False, compile: bool = False):
        """block_size: page the target's KV cache in blocks of this many tokens (default contiguous).
        kv_dtype: the target's KV cache dtype, its own (default) or float8 (torch.float8_e4m3fn / e5m2).
        method: accept's verifier for sampling requests: "token", "block" (chains) or "traversal" (any
        static tree); the last two need a drafter that samples its children (the draft model's static trees).
        vocab_shard: tensor parallelism over the vocabulary, a specdec.distributed.VocabShard (from
        shard_lm_head(target, group)): the target's logits are this rank's columns, verified by
        specdec.distributed.accept; every rank of the group runs the same generate call.
        adaptive: choose each step's draft depth, 0 (plain decoding) included, from the target's measured
        cost per verified token count and the requests' running acceptance (specdec.adaptive); True, or a
        factory (batch_size, max_depth, device) -> policy with the methods of adaptive.AdaptiveDepth.
        compile: the target's and the drafter's cached forwards through torch.compile (Llama.compile_cached;
        one graph per shape, compiled at first use: run a warm-up generate of the same batch size and tree first),
        with caches sized in buckets of 256 positions so that later batches reuse the graphs."""
        self.target = target
        self.block_size, self.kv_dtype = block_size, kv_dtype
        self.drafter = drafter or NoDrafter()
        check_method_name(method)
        if method != "token" and self.drafter.max_nodes > 1 and not self.drafter.samples_children:
            raise ValueError(f"method: {method!r} needs a drafter whose children are drawn from its own laws "
                             f"(draft_logits); {type(self.drafter).__name__} gives proposals: use method='token'")
        if method == "block" and self.drafter.max_nodes != self.drafter.max_depth + 1:
            raise ValueError(f"method: 'block' verifies chains only; the drafter proposes trees of "
                             f"{self.drafter.max_nodes} nodes and depth {self.drafter.max_depth}")
        self.method, self.vocab_shard = method, vocab_shard
        V = target.cfg.vocab_size
        if self.drafter.vocab_size is not None and self.drafter.vocab_size != V:
            raise ValueError(f"vocab mismatch: the drafter has {self.drafter.vocab_size} tokens, the target {V}")
        self.eos = target.cfg.eos_token_id if eos_token_id is None else eos_token_id
        if adaptive and vocab_shard is not None:
            raise ValueError("adaptive: not with vocab_shard (every rank would have to choose the same depths)")
        self.adaptive = self._default_policy if adaptive is True else adaptive or None
        self.compile = compile
        if compile:
            target.compile_cached()
            self.drafter.compile_cached()

    def _default_policy(self, batch_size: int, max_depth: int, device) -> AdaptiveDepth:
        """A policy for this batch; it starts from what the previous generate call's policy learned (the draft
        and step costs, and its requests' mean acceptance as the new requests' prior)."""
        costs = measure_target_costs(self.target, batch_size, max_depth + 1)
        self._policy = AdaptiveDepth(batch_size, max_depth, costs, previous=getattr(self, "_policy", None))
        return self._policy

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                 temperature: Union[float, Sequence[float]] = 0.0, seed: Union[int, Sequence[int]] = 0,
                 progress: bool = False, *, top_k: Union[int, Sequence[int]] = 0,
                 top_p: Union[float, Sequence[float]] = 1.0, min_p: Union[float, Sequence[float]] = 0.0,
                 allowed_token_ids: Optional[Sequence[int]] = None) -> GenerationOutput:
        """Generate for a batch of token-id prompts (each non-empty). temperature/seed: one for all or one
        per request (0 = greedy); request b samples with seed[b] (or seed + b). top_k/top_p/min_p: one for all
        or one per request (off: 0, 1, 0), the filters of `specdec.accept`; allowed_token_ids: the only tokens
        any request may emit (None: all). The drafter samples from the same processed law."""
        B, dev, T, depth = len(prompts), self.target.device, self.drafter.max_nodes, self.drafter.max_depth
        if B == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one request, each with at least one token (e.g. BOS)")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        temps = [float(temperature)] * B if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
        seeds = [int(seed) + b for b in range(B)] if isinstance(seed, int) else [int(s) for s in seed]
        if len(temps) != B or len(seeds) != B:
            raise ValueError("temperature/seed: give one value or one per prompt")
        temp = torch.tensor(temps, dtype=torch.float32, device=dev)
        params = SamplingParams.for_batch(B, self.target.cfg.vocab_size, dev, top_k, top_p, min_p, allowed_token_ids)
        seeds_t = torch.tensor(seeds, dtype=torch.int64, device=dev)
        method = self.method if any(t > 0 for t in temps) else "token"  # (greedy requests: any method is token-wise)

        prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        # room for: prompt + max_new for live requests (+ a last tree) and one token per step once finished
        L = int(prompt_lens.max()) + 2 * max_new_tokens + 2 * T + 2
        if self.compile:  # cache shapes in buckets: compiled graphs are specialized to them
            L = -(-L // CACHE_BUCKET) * CACHE_BUCKET
        tokens = torch.zeros(B, L, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(list(p), dtype=torch.long)
        seq_lens = prompt_lens.clone()

        t0 = time.perf_counter()
        cache = self.target.new_cache(B, L, block_size=self.block_size, kv_dtype=self.kv_dtype)
        # the last prompt token is the first root; a drafter on the target's features gets its hidden states
        features = getattr(self.drafter, "uses_target_hidden", False)
        hidden = self.target.prefill(cache, tokens, seq_lens - 1, return_hidden=features)
        self.drafter.start(tokens, seq_lens, L, temp, seeds, params, **({"target_hidden": hidden} if features else {}))

        done = torch.zeros(B, dtype=torch.bool, device=dev)
        steps = torch.zeros(B, dtype=torch.long, device=dev)
        emitted_live = torch.zeros(B, dtype=torch.long, device=dev)  # tokens emitted while unfinished
        accepted_hist = torch.zeros(B, depth + 1, dtype=torch.long, device=dev)  # steps that accepted n draft tokens
        finish_step = torch.zeros(B, dtype=torch.long, device=dev)
        step_times = []
        cols = torch.arange(T, device=dev)
        bar = _progress(max_new_tokens) if progress else None
        policy = self.adaptive(B, depth, dev) if self.adaptive is not None and depth > 0 else None
        live_host = [True] * B
        step = 0
        while True:
            t_step = time.perf_counter()
            k = None if policy is None else policy.choose(live_host)
            if k == 0:  # plain decoding this step: the root alone, and the drafter is told it was skipped
                prop = NoDrafter().propose(tokens, seq_lens, temp)
            else:
                t_draft = time.perf_counter()
                if policy is None:
                    prop = self.drafter.propose(tokens, seq_lens, temp)
                else:
                    prop = self.drafter.propose(tokens, seq_lens, temp, depth=k)
                    policy.drafted(k, time.perf_counter() - t_draft)
            tree = specdec.build_tree(prop.parents, prop.num_nodes)
            logits = self.target.forward_cached(prop.tokens, cache, tree.depth, tree.mask, prop.num_nodes,
                                                return_hidden=features)
            hidden_kw = {}
            if features:
                logits, hidden = logits
                hidden_kw = {"target_hidden": hidden}
            res = self._accept(logits, prop, temperature=temp, seeds=seeds_t, num_nodes=prop.num_nodes, offset=steps,
                               method="token" if k == 0 else method, **params.accept_kwargs(prop.tokens.shape[1]))
            live = ~done
            num_acc = torch.where(live, res.num_accepted, 0)
            cache.rollback(res.accepted_nodes, num_acc)
            if k == 0:
                self.drafter.skip(**hidden_kw)
            else:
                self.drafter.commit(prop, res.accepted_nodes, num_acc, **hidden_kw)

            # append the path's draft tokens and the next token (finished requests: the next token only)
            Tp = prop.tokens.shape[1]
            new = res._replace(num_accepted=num_acc).emitted_tokens(prop.tokens)
            n_new = num_acc.long() + 1
            where = (seq_lens.long().unsqueeze(1) + cols[:Tp]).clamp(max=L - 1)
            keep = cols[:Tp] < n_new.unsqueeze(1)
            tokens.scatter_(1, where, torch.where(keep, new, tokens.gather(1, where)))
            seq_lens += n_new.to(torch.int32)

            steps += live
            emitted_live += torch.where(live, n_new, 0)
            accepted_hist[torch.arange(B, device=dev), num_acc.long()] += live
            hit_eos = ((new == self.eos) & keep).any(1) if self.eos is not None else torch.zeros_like(done)
            finished_now = live & (hit_eos | (seq_lens - prompt_lens >= max_new_tokens))
            finish_step = torch.where(finished_now, step, finish_step)
            done |= finished_now
            step += 1
            step_times.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(int((seq_lens - prompt_lens).clamp(max=max_new_tokens).min()) - bar.n)
            if policy is not None:  # the one host read per step: the stopping rule, and what the policy learns
                flags = torch.cat((num_acc.long(), done.long())).tolist()
                policy.update(flags[:B], k, live_host, time.perf_counter() - t_step)
                live_host = [not f for f in flags[B:]]
                if not any(live_host):
                    break
            elif bool(done.all()):  # the one host read per step: the stopping rule
                break
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - t0
        out = self._collect(tokens, prompt_lens, seq_lens, max_new_tokens, steps, emitted_live, accepted_hist,
                            finish_step, step_times, wall)
        if policy is not None:
            out.summary["depth_chosen"] = list(policy.chosen)  # steps per draft depth, 0 = plain decoding
        return out

    def _accept(self, logits, prop, **kwargs) -> specdec.AcceptResult:
        if self.vocab_shard is None:
            return specdec.accept(logits, prop.tokens, prop.parents, draft_logits=prop.draft_logits, **kwargs)
        start, size, group = self.vocab_shard
        draft = None if prop.draft_logits is None else prop.draft_logits[..., start:start + logits.shape[-1]]
        return distributed.accept(logits, prop.tokens, prop.parents, draft_logits_shard=draft, vocab_start=start,
                                  vocab_size=size, group=group, **kwargs)

    def _collect(self, tokens, prompt_lens, seq_lens, max_new, steps, emitted_live, accepted_hist, finish_step,
                 step_times, wall) -> GenerationOutput:
        outs, stats = [], []
        tokens, hist = tokens.cpu(), accepted_hist.cpu()
        for b in range(tokens.shape[0]):
            seq = tokens[b, int(prompt_lens[b]):int(seq_lens[b])].tolist()[:max_new]
            if self.eos is not None and self.eos in seq:
                seq = seq[:seq.index(self.eos)]
            outs.append(seq)
            n_steps = int(steps[b])
            at_least = hist[b].flip(0).cumsum(0).flip(0)  # steps accepting >= d draft tokens
            t_b = step_times[int(finish_step[b])]
            stats.append({"new_tokens": len(seq), "steps": n_steps,
                          "tokens_per_step": int(emitted_live[b]) / max(n_steps, 1),
                          "acceptance_by_depth": [round(float(x) / max(n_steps, 1), 4) for x in at_least[1:]],
                          "wall_s": t_b, "tokens_per_s": len(seq) / t_b})
        total_steps = int(steps.sum())
        at_least = hist.sum(0).flip(0).cumsum(0).flip(0)
        summary = {"requests": len(outs), "new_tokens": sum(len(o) for o in outs), "steps": int(len(step_times)),
                   "tokens_per_step": int(emitted_live.sum()) / max(total_steps, 1),
                   "acceptance_by_depth": [round(float(x) / max(total_steps, 1), 4) for x in at_least[1:]],
                   "wall_s": wall, "tokens_per_s": sum(len(o) for o in outs) / wall}
        return GenerationOutput(outs, stats, summary)


def generate_ar(target: Llama, prompts, max_new_tokens: int = 128, temperature=0.0, seed=0,
                progress: bool = False, kv_dtype: Optional[torch.dtype] = None, **filters) -> GenerationOutput:
    """Plain autoregressive decoding through the same ops (one-node trees): the baseline. filters: generate's
    top_k, top_p, min_p, allowed_token_ids."""
    return SpeculativeDecoder(target, kv_dtype=kv_dtype).generate(prompts, max_new_tokens, temperature, seed, progress,
                                                                  **filters)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="tok", leave=False, desc="generating")
