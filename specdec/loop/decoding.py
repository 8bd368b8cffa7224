"""The draft -> verify -> accept loop.

    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:4"))
    out = decoder.generate(prompts, max_new_tokens=128, temperature=0.0, seed=0)

One step for the whole batch:
  1. the drafter proposes a tree per request (node 0 = the last emitted token, the root); with adaptive
     speculation (specdec.loop.adaptive) of the depth the policy chose for this step, or none (the root alone);
  2. the target runs the tree against its cache (`kv_append` + `tree_attention`, positions lens + depth);
  3. `specdec.accept` picks the longest accepted path plus one next token (greedy, or lossless sampling
     with per-request temperature, seed and step counter as the random-stream offset);
  4. `kv_rollback` keeps the path's K/V in the target's cache (and the drafter's, in `commit`, which gets
     the proposal back with the accepted path);
  5. the path's tokens and the next token are appended to each sequence.
Requests finish independently (EOS or max_new_tokens); a finished request keeps riding along with
one token per step (its output is cut), so shapes stay static. A step (`_step`) works in place on the
batch's buffers (`_Batch`) and reads nothing back; the host decides the depth k before it and reads one small
tensor after it (`_Batch.flags`: the stopping rule, and the accepted counts the adaptive policy learns from), both
in `adaptive.StepSchedule`. So the step runs eagerly, compiled as one graph (compile=True) or replayed from a
captured graph (cuda_graphs) alike: a step runner (`_EagerSteps`, `_CompiledSteps`, `_GraphedSteps`) chosen once.
"""
from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import torch

import specdec
from .. import distributed
from .adaptive import PROB_SCALE, AdaptiveDepth, StepSchedule, compiled_depths, drafter_prior, measure_target_costs
from .drafters.base import DepthControl, Drafter, NoDrafter, Proposal, StepState
from .grammar import GrammarBackend, TreeMasks, XGrammarBackend
from .models.llama import Llama, compile_static
from .models.tokenizer import VOCAB_SIZE
from .._validation import check_method_name
from ..ops import Logprobs
from ..reference import FILTER_ORDERS, GREEDY_BELOW
from ..sampling import Penalties, SamplingParams, chain_acceptance_probs

CACHE_BUCKET = 256  # with compile=True or CUDA graphs, cache lengths are rounded up to a multiple of this
# the batch shapes whose CUDA graphs (and the buffers they read) a decoder keeps across generate calls
KEPT_GRAPH_SETS = 8
# with compile=True or CUDA graphs, a batch runs padded to the smallest of these sizes that holds it (vLLM's
# capture sizes), so that a server's varying batches share a few graphs
BATCH_BUCKETS = (1, 2, 4, 8) + tuple(range(16, 513, 8))


def batch_bucket(n: int, buckets: Sequence[int] = BATCH_BUCKETS) -> int:
    """The batch size n requests run at: the smallest bucket >= n (n itself past the largest)."""
    return next((b for b in sorted(buckets) if b >= n), n)


@dataclass
class GenerationOutput:
    """tokens[b]: request b's new tokens (cut at EOS, excluded, and max_new_tokens); stats[b]: its steps,
    tokens_per_step (tau), acceptance_by_depth (fraction of steps accepting >= d draft tokens, d = 1..),
    acceptance_rate_by_depth (of the steps that judged a draft at depth d, the fraction accepting it: how fast
    acceptance drops with depth, also where steps draft to different depths; None where none did),
    judged_by_depth (those steps' counts), wall_s, tokens_per_s; summary: the same over the batch, and prompt_s:
    the part of wall_s before the first step (the checks, the buffers, the prompts through the target and the
    drafter). With generate's logprobs=N: logprobs[b][j] is the logprob of tokens[b][j], token_ranks[b][j] its rank
    (1 = the most likely), top_logprobs[b][j] the N best (token id, logprob) pairs of its position, best first."""
    tokens: list
    stats: list
    summary: dict = field(default_factory=dict)
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    token_ranks: Optional[list] = None


class SpeculativeDecoder:
    def __init__(self, target: Llama, drafter: Optional[Drafter] = None, *, eos_token_id: Optional[int] = None,
                 block_size: Optional[int] = None, kv_dtype: Optional[torch.dtype] = None, method: str = "token",
                 vocab_shard=None, adaptive=False, compile: bool = False, cuda_graphs=None,
                 batch_buckets: Optional[Sequence[int]] = None, grammar_backend: Optional[GrammarBackend] = None,
                 jump_forward: int = 0):
        """block_size: page the target's KV cache in blocks of this many tokens (default contiguous).
        kv_dtype: the target's KV cache dtype, its own (default) or float8 (torch.float8_e4m3fn / e5m2).
        method: accept's verifier for sampling requests: "token", "block" (chains) or "traversal" (any
        static tree); the last two need a drafter that samples its children (the draft model's static trees).
        vocab_shard: tensor parallelism over the vocabulary, a specdec.distributed.VocabShard (from
        shard_lm_head(target, group)): the target's logits are this rank's columns, verified by
        specdec.distributed.accept; every rank of the group runs the same generate call.
        adaptive: choose each step's draft depth, 0 (plain decoding) included, from the target's measured
        cost per verified token count and the requests' running acceptance (specdec.loop.adaptive); True, or a
        factory (batch_size, max_depth, device) -> policy with the methods of adaptive.AdaptiveDepth.
        compile: each step through torch.compile as one graph (`compile_static`: the drafting, the target's
        forward, accept, both rollbacks and the bookkeeping; fullgraph, so no host sync inside), one graph per
        batch size, draft depth and drafter state (`StepState.graph_key`), compiled at first use: run a warm-up
        generate of the same batch size and tree first. Caches are sized in buckets of 256 positions so that later
        batches reuse the graphs.
        cuda_graphs: replay each step as a CUDA graph (None: on for a CUDA target without compile): one graph per
        draft depth and drafter state (`StepState.graph_key`; for prompt lookup the verification alone, per tree
        width), captured at that key's second step (the first runs eagerly: kernels compile and tune there) and
        replayed from its third. The graphs and the buffers they read are kept for later generate calls of the
        same batch shape (batch bucket, cache bucket of 256 positions, max_new_tokens, and whether requests sample
        and with which filters: `_GraphedSteps.begin`), the KEPT_GRAPH_SETS most recent ones. Or a class with
        CudaStepGraph's interface (the tests emulate CUDA graphs on the CPU with one).
        batch_buckets: the batch sizes a batch runs at, padded with finished requests that ride along (default:
        BATCH_BUCKETS with compile or CUDA graphs, whose graphs are per batch size; the exact size eagerly).
        grammar_backend: compiles generate's `grammar` specs for the target's vocabulary (specdec.loop.grammar;
        default: xgrammar over the shipped byte vocabulary, for a target of its 260 tokens, the EOS its stop
        token).
        jump_forward: under a grammar, up to this many tokens a request's grammar forces (masks that allow one token
        each) are proposed as a chain instead of the request's tree; the target verifies them like any draft, and
        accepts them all (a forced token's processed probability is 1). With no drafter, prompt lookup or suffix
        decoding (proposals without drafter state) wherever a token is forced; with the draft model, which drafts
        forced tokens itself under the masks, where at least the step's depth are: the drafter then hears that
        none of its nodes was accepted and its cache catches up on the chain before it drafts again
        (`DepthControl.catch_up`); with MTP likewise, where the chain's entries come from the target's hidden
        states of the verified chain, as an accepted path's do (no catch-up)."""
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
        # the drafter reads the target's hidden states: what the target's forwards return (return_hidden): True,
        # the last layer's output (MTP); layer ids, those layers' residual streams (EAGLE-3)
        self.features = self.drafter.uses_target_hidden
        self.compile = compile
        if compile and vocab_shard is not None:
            raise ValueError("compile: not with vocab_shard (the shards' collectives run eagerly)")
        # (a drafter's steps can be captured where its proposal runs on the host or it declares its step state)
        capturable = self.drafter.proposes_on_host or isinstance(self.drafter, StepState)
        if cuda_graphs is None:
            cuda_graphs = target.device.type == "cuda" and not compile and capturable
        if cuda_graphs is True:
            if target.device.type != "cuda":
                raise ValueError(f"cuda_graphs: the target is on {target.device}, not on a CUDA device")
            cuda_graphs = CudaStepGraph
        if cuda_graphs and (compile or vocab_shard is not None):
            raise ValueError("cuda_graphs: not with compile or vocab_shard")
        if cuda_graphs and not capturable:
            raise ValueError(f"cuda_graphs: {type(self.drafter).__name__} proposes on the device and declares no "
                             "step state (drafters.base.StepState)")
        self.graph_class = cuda_graphs or None
        # how a step runs, chosen once: eagerly, compiled, or replayed from graphs
        self.steps = _GraphedSteps(self, self.graph_class) if self.graph_class else \
            _CompiledSteps(self) if compile else _EagerSteps(self)
        if batch_buckets is not None and (not batch_buckets or min(batch_buckets) < 1):
            raise ValueError(f"batch_buckets: {batch_buckets!r} must be batch sizes >= 1")
        self.batch_buckets = batch_buckets if batch_buckets is not None else \
            BATCH_BUCKETS if compile or self.graph_class else ()
        self.grammar_backend = grammar_backend
        stateless = self.drafter.max_nodes == 1 or self.drafter.proposes_on_host
        catches_up = isinstance(self.drafter, DepthControl) and self.drafter.max_skips is None
        follows_target = self.drafter.uses_target_hidden and hasattr(self.drafter, "reserve_chain")
        if jump_forward < 0 or jump_forward and (method != "token" or self.adaptive is not None or
                                                 not (stateless or catches_up or follows_target)):
            raise ValueError(f"jump_forward: {jump_forward} needs >= 0, and for > 0 method 'token', no adaptive "
                             f"depth, and a drafter that proposes without state of its own or catches up on skipped "
                             f"steps (not {type(self.drafter).__name__})")
        self.jump_forward = jump_forward
        if jump_forward and follows_target:  # (room for a forced chain's entries)
            self.drafter.reserve_chain(jump_forward)
        # forced chains replace a proposal wherever a token is forced (else where the step's depth are)
        self.jump_stateless = stateless
        # the largest proposal a step verifies, and its depth: the drafter's, or a forced chain
        self.max_nodes = max(self.drafter.max_nodes, 1 + jump_forward)
        self.max_depth = max(self.drafter.max_depth, jump_forward)

    def _default_policy(self, batch_size: int, max_depth: int, device) -> AdaptiveDepth:
        """A policy for this batch; it starts from what the previous generate call's policy learned (the draft
        and step costs, and its requests' acceptance by depth as the new requests' prior)."""
        # (compiled, every depth is a graph: for a host drafter, whose graphs are per tree width, every depth is a width
        # that a prompt's matches may never have produced, and which would compile inside a timed run)
        depths = compiled_depths(max_depth) if self.compile else None
        costs = measure_target_costs(self.target, batch_size, max_depth + 1, compiled=self.compile,
                                     tokens=None if depths is None else [k + 1 for k in depths],
                                     graph_class=self.graph_class)
        self._policy = AdaptiveDepth(batch_size, max_depth, costs, previous=getattr(self, "_policy", None),
                                     depths=depths, prior=drafter_prior(self.drafter, max_depth),
                                     one_forward_proposals=self.drafter.one_forward_proposals)
        return self._policy

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 128,
                 temperature: Union[float, Sequence[float]] = 0.0, seed: Union[int, Sequence[int]] = 0,
                 progress: bool = False, *, top_k: Union[int, Sequence[int]] = 0,
                 top_p: Union[float, Sequence[float]] = 1.0, min_p: Union[float, Sequence[float]] = 0.0,
                 allowed_token_ids: Optional[Sequence[int]] = None, filter_order: str = "hf",
                 repetition_penalty: Union[float, Sequence[float]] = 1.0,
                 frequency_penalty: Union[float, Sequence[float]] = 0.0,
                 presence_penalty: Union[float, Sequence[float]] = 0.0,
                 logit_bias: Union[None, dict, Sequence[Optional[dict]]] = None,
                 min_tokens: Union[int, Sequence[int]] = 0, stop_token_ids: Optional[Sequence] = None,
                 logprobs: Optional[int] = None, logprobs_mode: str = "raw", grammar=None) -> GenerationOutput:
        """Generate for a batch of token-id prompts (each non-empty). temperature/seed: one for all or one
        per request (0 = greedy); request b samples with seed[b] (or seed + b). top_k/top_p/min_p: one for all
        or one per request (off: 0, 1, 0), the filters of `specdec.accept`, in filter_order ("hf", "vllm" or
        "sglang"); allowed_token_ids: the only tokens any request may emit (None: all). Step 0 of accept's law,
        vLLM's meanings, one for all or one per request: repetition_penalty (off 1), frequency_penalty,
        presence_penalty (off 0) over the request's output so far (and its prompt, for the repetition penalty);
        logit_bias a dict {token id: bias}; min_tokens (off 0): stop_token_ids (default: the EOS; ids for all
        requests, or a list per request) are masked until a request has generated that many tokens (the loop
        stops at the EOS alone). The drafter samples from the same processed law, along each draft path.
        logprobs N (None: off; 0..20): the output's logprobs[b] lists each generated token's logprob, token_ranks[b]
        its rank, and top_logprobs[b] its position's N best (token, logprob) pairs, of the law logprobs_mode names
        ("raw": the target's log-softmax; "processed": the law the token was drawn from, `specdec.accept`).
        grammar: structured output (specdec.loop.grammar): a spec {"json_schema": dict or JSON text} | {"regex": str}
        | {"ebnf": str} for every request, or a list of specs or None (free), one per request; each step walks the
        draft tree with each constrained request's matcher and accept verifies under the per-node masks (the drafter
        drafts under them too); a constrained request ends at the EOS, which its grammar allows only once its output
        is complete (max_new_tokens still applies). A bad spec raises ValueError naming `grammar` before anything
        runs. The penalties, logprobs and grammar run with eager steps (neither compile nor CUDA graphs nor
        vocab_shard).
        """
        # the adaptive policy's start-up (the target's costs measured at this batch size) is not decoding time
        policy, depth = None, self.drafter.max_depth
        if self.adaptive is not None and depth > 0 and len(prompts):
            B = batch_bucket(len(prompts), self.batch_buckets) if self.batch_buckets else len(prompts)
            policy = self.adaptive(B, depth, self.target.device)
        t0 = time.perf_counter()
        s = self._start(prompts, max_new_tokens, temperature, seed, top_k=top_k, top_p=top_p, min_p=min_p,
                        allowed_token_ids=allowed_token_ids, filter_order=filter_order,
                        penalties=dict(repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                                       presence_penalty=presence_penalty, logit_bias=logit_bias,
                                       min_tokens=min_tokens, stop_token_ids=stop_token_ids),
                        logprobs=logprobs, logprobs_mode=logprobs_mode, grammar=grammar)
        _sync(s.tokens.device)  # (the prompts' kernels may still run: their time is the prompts')
        prompt_s = time.perf_counter() - t0
        s = self.steps.begin(s)
        schedule = StepSchedule(policy, self.drafter, s, drafting_timed=self.steps.times_drafting(s))
        bar = _progress(max_new_tokens) if progress else None
        step_times = []  # seconds from the call's start to each step's end
        live = True
        while live:
            k = schedule.before_step()
            ran, proposed_at = self.steps.run(s, k)
            flags = s.flags.tolist()  # the one host read per step: the stopping rule, and what the policy learns
            step_times.append(time.perf_counter() - t0)
            live = schedule.after_step(k, flags, ran, proposed_at)
            if bar is not None:
                bar.update(int((s.seq_lens - s.prompt_lens).clamp(max=max_new_tokens).min()) - bar.n)
        if bar is not None:
            bar.close()
        out = self._collect(s, step_times, time.perf_counter() - t0)
        out.summary["prompt_s"] = prompt_s
        if s.grammar is not None:  # the matchers' host time, and the emitted tokens jump-forward proposed
            out.summary.update(grammar_s=s.grammar.host_s, forced_tokens=s.grammar.forced_emitted)
        if policy is not None:
            out.summary["depth_chosen"] = list(policy.chosen)  # steps per draft depth, 0 = plain decoding
        return out

    def _start(self, prompts, max_new_tokens, temperature, seed, *, top_k, top_p, min_p, allowed_token_ids,
               filter_order="hf", penalties=None, logprobs=None, logprobs_mode="raw", grammar=None) -> "_Batch":
        """generate's arguments checked, the batch's buffers, the prompts through the target and the drafter."""
        B, dev, T, depth = len(prompts), self.target.device, self.max_nodes, self.max_depth
        if B == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one request, each with at least one token (e.g. BOS)")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens: must be >= 1")
        temps = [float(temperature)] * B if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
        seeds = [int(seed) + b for b in range(B)] if isinstance(seed, int) else [int(s) for s in seed]
        if len(temps) != B or len(seeds) != B:
            raise ValueError("temperature/seed: give one value or one per prompt")
        sampled = any(t >= GREEDY_BELOW for t in temps)  # (t < 1e-5 is greedy, as in accept)
        method = self.method if sampled else "token"  # (greedy requests: any method is token-wise)
        # (chain_acceptance_probs is token-wise rejection sampling's acceptance per level of a chain)
        judge_probs = self.adaptive is not None and sampled and method == "token" and \
            self.drafter.max_nodes == self.drafter.max_depth + 1
        logprobs = self._logprob_args(logprobs, logprobs_mode, filter_order)
        matchers = self._matchers(grammar, B)
        requests = B
        B = batch_bucket(B, self.batch_buckets) if self.batch_buckets else B
        step0 = dict(penalties or {})
        if step0.get("stop_token_ids") is None:
            step0["stop_token_ids"] = () if self.eos is None else (self.eos,)
        V = self.target.cfg.vocab_size
        penalties = Penalties.for_batch(prompts, V, dev, **step0, padding=B - requests)
        if penalties is not None:
            self._eager_only(penalties.first_on())
        if B > requests:  # padding rows: one-token prompts, greedy, filters off, finished from the start
            pad = B - requests
            for name, x in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
                if not isinstance(x, (int, float)) and len(x) != requests:
                    raise ValueError(f"{name}: give one value or one per request ({requests}), got {len(x)}")
            prompts, temps, seeds = list(prompts) + [[0]] * pad, temps + [0.0] * pad, seeds + [0] * pad
            top_k, top_p, min_p = (x if isinstance(x, (int, float)) else list(x) + [off] * pad
                                   for x, off in ((top_k, 0), (top_p, 1.0), (min_p, 0.0)))
        temp = torch.tensor(temps, dtype=torch.float32, device=dev)
        params = SamplingParams.for_batch(B, V, dev, top_k, top_p, min_p, allowed_token_ids)._replace(
            penalties=penalties, filter_order=filter_order, logprobs=-1 if logprobs is None else logprobs,
            logprobs_mode=logprobs_mode)

        prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        # room for: prompt + max_new for live requests (+ a last tree) and one token per step once finished
        L = int(prompt_lens.max()) + 2 * max_new_tokens + 2 * T + 2
        if self.compile or self.graph_class:  # cache shapes in buckets: graphs are specialized to them
            L = -(-L // CACHE_BUCKET) * CACHE_BUCKET
        tokens = torch.zeros(B, L, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = torch.tensor(list(p), dtype=torch.long)

        cache = self.steps.kept_cache((B, L))
        if cache is None:
            cache = self.target.new_cache(B, L, block_size=self.block_size, kv_dtype=self.kv_dtype)
        cache.lens.zero_()
        s = _Batch.new(tokens, prompt_lens, max_new_tokens, temp, seeds, params, method, cache, depth, T, requests,
                       judge_probs)
        if any(m is not None for m in matchers):  # (padding rows are free)
            s.grammar = TreeMasks(matchers + [None] * (B - requests), V, self.grammar_backend.stop_token_ids, dev)
            if penalties is not None and penalties.min_tokens is not None:  # (the masks hold the stops back)
                for b, (matcher, least) in enumerate(zip(matchers, penalties.min_tokens.tolist())):
                    if matcher is not None and least > 0:
                        stops = [t for t in penalties.stop_token_ids[b].tolist() if t >= 0]
                        s.grammar.hold_back(b, least, stops)
                        penalties.min_tokens[b] = 0
        self.drafter.grammar = s.grammar
        if logprobs is not None:  # (room for the last step's whole path past max_new_tokens)
            s.logprobs = Logprobs(torch.full((B, max_new_tokens + T), math.nan, device=dev),
                                  torch.full((B, max_new_tokens + T, logprobs), math.nan, device=dev),
                                  torch.full((B, max_new_tokens + T, logprobs), -1, device=dev),
                                  torch.full((B, max_new_tokens + T), -1, device=dev))
        # the last prompt token is the first root; a drafter on the target's features gets its hidden states
        hidden = self.target.prefill(cache, tokens, prompt_lens - 1, return_hidden=self.features)
        if isinstance(self.drafter, StepState):  # (per call: a drafter may serve two loops)
            self.drafter.few_shapes = self.steps.few_shapes
        self.drafter.start(tokens, s.seq_lens, L, temp, seeds, params,
                           **({"target_hidden": hidden} if self.features else {}))
        # (an adaptive loop that never drafts never needs the drafter's catch-up on the prompts)
        if isinstance(self.drafter, DepthControl) and self.drafter.lagging and self.adaptive is None:
            self.drafter.catch_up(tokens, s.seq_lens)
        return s

    def _logprob_args(self, logprobs, logprobs_mode, filter_order) -> Optional[int]:
        """generate's logprobs (None or 0..20) checked; filter_order and logprobs_mode named as accept names
        them."""
        if filter_order not in FILTER_ORDERS:
            raise ValueError(f"filter_order: expected one of {FILTER_ORDERS}, got {filter_order!r}")
        if filter_order != "hf" and self.vocab_shard is not None:
            raise ValueError("filter_order: the vocabulary-parallel accept (vocab_shard) filters in the 'hf' order")
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode: expected 'raw' or 'processed', got {logprobs_mode!r}")
        if logprobs is None:
            return None
        if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= 20:
            raise ValueError(f"logprobs: expected None or an int in [0, 20], got {logprobs!r}")
        self._eager_only("logprobs")
        return logprobs

    def _matchers(self, grammar, batch_size: int) -> list:
        """generate's `grammar` as a matcher per request (None: free), every spec compiled (so checked) first."""
        if grammar is None or isinstance(grammar, (list, tuple)) and all(g is None for g in grammar):
            return [None] * batch_size
        self._eager_only("grammar")
        if self.eos is None:
            raise ValueError("grammar: a constrained request ends at the EOS; the decoder has no eos_token_id")
        if self.grammar_backend is None:
            V = self.target.cfg.vocab_size
            if V != VOCAB_SIZE:
                raise ValueError(f"grammar: the target's vocabulary ({V} tokens) is not the shipped byte vocabulary "
                                 f"({VOCAB_SIZE}); give the decoder a grammar_backend for it")
            self.grammar_backend = XGrammarBackend.byte_vocabulary(V, self.eos)
        return self.grammar_backend.matchers(grammar, batch_size)

    def _eager_only(self, name: str) -> None:
        """Refuse generate's argument `name` unless the steps run eagerly on one device (a decoder without compile,
        CUDA graphs and vocab_shard): the step-0 state and the logprob buffers are not carried through compiled or
        replayed steps, nor through the vocabulary-parallel accept."""
        mode = "compile" if self.compile else "cuda_graphs" if self.graph_class else \
            "vocab_shard" if self.vocab_shard is not None else None
        if mode is not None:
            raise ValueError(f"{name}: runs with eager steps only, not with {mode} (a decoder with "
                             f"{'cuda_graphs=False' if mode == 'cuda_graphs' else 'no ' + mode} runs it)")

    # one step, on the batch's buffers in place: _propose then _verify (with compile=True one graph per depth k,
    # or, for a drafter that proposes on the host, the verification alone)
    def _step(self, s: "_Batch", k: Optional[int]) -> None:
        self._verify(s, self._propose(s, k), k)

    def _propose(self, s: "_Batch", k: Optional[int]) -> Proposal:
        """k: the depth to draft (None: the drafter's whole tree; 0: the root alone, plain decoding)."""
        if s.grammar is not None:
            s.grammar.begin_step(s.done.tolist())
        if k == 0:
            return NoDrafter().propose(s.tokens, s.seq_lens, s.temp)
        prop = self.drafter.propose(s.tokens, s.seq_lens, s.temp, depth=k)
        if self.jump_forward and s.grammar is not None and s.grammar.constrained:
            at_least = 1 if self.jump_stateless else self.drafter.max_depth if k is None else k
            prop = s.grammar.with_forced_chains(prop, self.jump_forward, at_least)
        return prop

    def _verify(self, s: "_Batch", prop: Proposal, k: Optional[int]) -> None:
        """The target's forward over the proposal, accept, both rollbacks and the token bookkeeping."""
        tree = prop.tree if prop.tree is not None else specdec.build_tree(prop.parents, prop.num_nodes)
        logits = self.target.forward_cached(prop.tokens, s.cache, tree.depth, tree.mask, prop.num_nodes,
                                            return_hidden=self.features)
        hidden_kw = {}
        if self.features:
            logits, hidden = logits
            hidden_kw = {"target_hidden": hidden}
        Tp = prop.tokens.shape[1]
        accept_kw = s.params.accept_kwargs(Tp)
        if s.grammar is not None and s.grammar.constrained:
            rows = s.grammar.tree_bitmask(prop.tokens, prop.parents, prop.num_nodes)
            fixed = accept_kw["token_bitmask"]
            accept_kw["token_bitmask"] = rows if fixed is None else rows & fixed
        res = self._accept(logits, prop, temperature=s.temp, seeds=s.seeds, num_nodes=prop.num_nodes, offset=s.steps,
                           method="token" if k == 0 else s.method, **accept_kw)
        live = ~s.done
        num_acc = torch.where(live, res.num_accepted, 0)
        s.cache.rollback(res.accepted_nodes, num_acc)
        if k == 0:
            self.drafter.skip(**hidden_kw)
        elif s.grammar is not None and any(s.grammar.replaced) and self.drafter.uses_target_hidden:
            # a forced chain replaced some requests' trees: MTP's entries of the chain come from the target's
            # hidden states of its nodes, as any accepted path's
            self.drafter.commit(prop, res.accepted_nodes, num_acc, **hidden_kw)
            self.drafter.follow_chain(int(num_acc.max()))
        elif s.grammar is not None and any(s.grammar.replaced):
            # a forced chain replaced some requests' trees: none of their drafter's nodes was accepted but the root,
            # and a drafter with a cache of its own catches up on the chain before its next proposal (the loop's
            # catch_up, as after skipped steps)
            replaced = torch.tensor(s.grammar.replaced, device=num_acc.device)
            root_only = torch.where(s.cols[:Tp] == 0, 0, -1).to(res.accepted_nodes.dtype)
            self.drafter.commit(prop, torch.where(replaced.unsqueeze(1), root_only, res.accepted_nodes),
                                torch.where(replaced, 0, num_acc), **hidden_kw)
            if not self.jump_stateless:
                self.drafter.lagging = True
        else:
            self.drafter.commit(prop, res.accepted_nodes, num_acc, **hidden_kw)

        # append the path's draft tokens and the next token (finished requests: the next token only)
        new = res._replace(num_accepted=num_acc).emitted_tokens(prop.tokens)
        n_new = num_acc.long() + 1
        cols = s.cols[:Tp]
        # the deepest draft judged: the accepted ones, and one more where the path's last node has children (a
        # chain shorter than the proposal's depth, a tree's shallow leaf and a plain step judge nothing further)
        last = res.accepted_nodes.gather(1, num_acc.long().unsqueeze(1))
        has_child = ((prop.parents == last) & (cols < prop.num_nodes.unsqueeze(1))).any(1)
        s.judged_hist[s.rows, num_acc.long() + has_child] += live
        where = (s.seq_lens.long().unsqueeze(1) + cols).clamp(max=s.tokens.shape[1] - 1)
        keep = cols < n_new.unsqueeze(1)
        s.tokens.scatter_(1, where, torch.where(keep, new, s.tokens.gather(1, where)))
        if s.params.penalties is not None:  # (the output's counts, as accept reads them next step)
            s.params.penalties.output_token_counts.scatter_add_(1, new.clamp(min=0), (keep & live.unsqueeze(1)).int())
        if s.logprobs is not None:  # position j of the path is output token seq_lens - prompt_lens + j
            at = (s.seq_lens - s.prompt_lens).long().unsqueeze(1) + cols
            on = keep & live.unsqueeze(1) & (at < s.logprobs.token_logprobs.shape[1])
            at = at.clamp(max=s.logprobs.token_logprobs.shape[1] - 1)
            for buf, x in zip(s.logprobs, res.logprobs):
                at_x = at.view(at.shape + (1,) * (x.dim() - 2)).expand_as(x)
                on_x = on.view(on.shape + (1,) * (x.dim() - 2)).expand_as(x)
                buf.scatter_(1, at_x, torch.where(on_x, x, buf.gather(1, at_x)))
        s.seq_lens += n_new.to(torch.int32)
        if s.grammar is not None:  # (eager steps only: host reads)
            for b, n in enumerate(n_new.tolist()):
                if s.grammar.live[b]:
                    s.grammar.advance(b, new[b, :n].tolist())

        s.steps += live
        s.emitted_live += torch.where(live, n_new, 0)
        s.accepted_hist[s.rows, num_acc.long()] += live
        hit_eos = ((new == self.eos) & keep).any(1) if self.eos is not None else torch.zeros_like(s.done)
        finished_now = live & (hit_eos | (s.seq_lens - s.prompt_lens >= s.max_new))
        s.finish_step.copy_(torch.where(finished_now, s.step, s.finish_step))
        s.done |= finished_now
        s.step += 1
        B = len(live)
        s.flags[:B] = num_acc
        s.flags[B:2 * B] = s.done
        if s.judge_probs and k != 0:
            probs = chain_acceptance_probs(logits, prop.tokens, prop.draft_logits, s.temp, s.params)
            s.flags[2 * B:].view(B, -1)[:, :Tp - 1] = (probs * PROB_SCALE).round().long()

    def _accept(self, logits, prop, **kwargs) -> specdec.AcceptResult:
        if self.vocab_shard is None:
            return specdec.accept(logits, prop.tokens, prop.parents, draft_logits=prop.draft_logits, **kwargs)
        start, size, group = self.vocab_shard
        draft = None if prop.draft_logits is None else prop.draft_logits[..., start:start + logits.shape[-1]]
        return distributed.accept(logits, prop.tokens, prop.parents, draft_logits_shard=draft, vocab_start=start,
                                  vocab_size=size, group=group, **kwargs)

    def _collect(self, s: "_Batch", step_times, wall) -> GenerationOutput:
        outs, stats = [], []
        # (padding rows: no steps, nothing accepted or judged)
        tokens, hist, judged = s.tokens.cpu(), s.accepted_hist.cpu(), s.judged_hist.cpu()
        for b in range(s.requests):
            seq = tokens[b, int(s.prompt_lens[b]):int(s.seq_lens[b])].tolist()[:s.max_new]
            if self.eos is not None and self.eos in seq:
                seq = seq[:seq.index(self.eos)]
            outs.append(seq)
            n_steps = int(s.steps[b])
            t_b = step_times[int(s.finish_step[b])]
            stats.append({"new_tokens": len(seq), "steps": n_steps,
                          "tokens_per_step": int(s.emitted_live[b]) / max(n_steps, 1),
                          **_acceptance(hist[b], judged[b], n_steps),
                          "wall_s": t_b, "tokens_per_s": len(seq) / t_b})
        summary = {"requests": len(outs), "new_tokens": sum(len(o) for o in outs), "steps": int(len(step_times)),
                   "tokens_per_step": int(s.emitted_live.sum()) / max(int(s.steps.sum()), 1),
                   **_acceptance(hist.sum(0), judged.sum(0), int(s.steps.sum())),
                   "wall_s": wall, "tokens_per_s": sum(len(o) for o in outs) / wall}
        out = GenerationOutput(outs, stats, summary)
        if s.logprobs is not None:
            lp, top, ids, ranks = (x.cpu() for x in s.logprobs)
            out.logprobs = [lp[b, :len(seq)].tolist() for b, seq in enumerate(outs)]
            out.token_ranks = [ranks[b, :len(seq)].tolist() for b, seq in enumerate(outs)]
            out.top_logprobs = [[list(zip(ids[b, j].tolist(), top[b, j].tolist())) for j in range(len(seq))]
                                for b, seq in enumerate(outs)]
        return out


def _acceptance(accepted_hist: torch.Tensor, judged_hist: torch.Tensor, steps: int) -> dict:
    """acceptance_by_depth, acceptance_rate_by_depth and judged_by_depth (d = 1..) from the histograms of the
    drafts accepted and the deepest draft judged per step."""
    accepted = accepted_hist.flip(0).cumsum(0).flip(0)[1:].tolist()  # steps accepting >= d drafts
    judged = judged_hist.flip(0).cumsum(0).flip(0)[1:].tolist()  # steps judging a draft at depth d
    return {"acceptance_by_depth": [round(a / max(steps, 1), 4) for a in accepted],
            "acceptance_rate_by_depth": [round(a / j, 4) if j else None for a, j in zip(accepted, judged)],
            "judged_by_depth": judged}


@dataclass
class _Batch:
    """One generate call's decoding state. Every tensor is a buffer that a step updates in place and none is ever
    replaced, so that a compiled or captured step reads and writes the same memory each time."""
    tokens: torch.Tensor  # (B, L) int64: prompt then emitted tokens; seq_lens[b] of them are committed
    seq_lens: torch.Tensor  # (B,) int32
    prompt_lens: torch.Tensor  # (B,) int32
    max_new: int
    temp: torch.Tensor  # (B,) float32
    seeds: torch.Tensor  # (B,) int64
    params: SamplingParams
    method: str
    cache: object  # the target's KVCache
    done: torch.Tensor  # (B,) bool: finished (EOS or max_new tokens)
    steps: torch.Tensor  # (B,) int64: steps taken while unfinished (also accept's random-stream offset)
    emitted_live: torch.Tensor  # (B,) int64: tokens emitted while unfinished
    accepted_hist: torch.Tensor  # (B, depth + 1) int64: steps that accepted n draft tokens
    judged_hist: torch.Tensor  # (B, depth + 1) int64: steps whose deepest draft judged was at depth n
    finish_step: torch.Tensor  # (B,) int64: the step at which the request finished
    step: torch.Tensor  # () int64: steps taken by the batch
    # (2B,) int64: this step's accepted counts, then done: the one host read per step; with judge_probs, then
    # (B, depth): each chain level's acceptance probability (`chain_acceptance_probs`) times PROB_SCALE
    flags: torch.Tensor
    rows: torch.Tensor  # arange(B)
    cols: torch.Tensor  # arange(max_nodes)
    requests: int  # the real requests, rows 0 .. requests - 1; the rest pad the batch to its bucket (done)
    judge_probs: bool  # the step reports its levels' acceptance probabilities (an adaptive loop, sampled chains)
    # with generate's logprobs: (B, max_new + max_nodes) each output token's logprob, (B, max_new + max_nodes, N) the
    # best N of its position (and their tokens), output token j at column j
    logprobs: Optional[Logprobs] = None
    grammar: Optional[TreeMasks] = None  # with generate's grammar: the requests' matchers (eager steps only)

    @classmethod
    def new(cls, tokens, prompt_lens, max_new, temp, seeds, params, method, cache, depth, max_nodes,
            requests, judge_probs=False) -> "_Batch":
        B, dev = tokens.shape[0], tokens.device
        zeros = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        done = torch.arange(B, device=dev) >= requests
        return cls(tokens, prompt_lens.clone(), prompt_lens, max_new, temp,
                   torch.tensor(seeds, dtype=torch.int64, device=dev), params, method, cache,
                   done, zeros(B), zeros(B), zeros(B, depth + 1), zeros(B, depth + 1), zeros(B), zeros(),
                   zeros(2 * B + (B * depth if judge_probs else 0)), torch.arange(B, device=dev),
                   torch.arange(max_nodes, device=dev), requests, judge_probs)


def _verify_key(k: Optional[int]) -> Optional[int]:
    """The k a host drafter's verification runs with: 0 (a plain step: the drafter is told it skipped) or None (a
    proposal, of any depth). Its graphs are then per tree width alone, shared by every depth the proposals come
    from (a depth of 8 whose longest match is 5 is a width of 6 as a depth of 5 is), and by fixed and adaptive
    loops."""
    return 0 if k == 0 else None


class CudaStepGraph:
    """A step captured as a CUDA graph (`torch.cuda.graph`, in the batch's memory pool) with specdec's value checks
    off; constructing it captures fn, then replays it once (so it runs the step, as an eager call would)."""

    def __init__(self, fn, pool):
        self.graph = torch.cuda.CUDAGraph()
        with specdec.value_checks(False), torch.cuda.graph(self.graph, pool=pool):
            fn()
        self.graph.replay()

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def new_pool(device):
        return torch.cuda.graph_pool_handle()


class _StepGraphs:
    """A batch shape's step graphs by key: a key's first step runs eagerly, its second is captured (and run),
    later ones replay. inputs: static proposal buffers of host drafters, by key."""

    def __init__(self, graph_class, device):
        self.graph_class, self.pool = graph_class, graph_class.new_pool(device)
        self.graphs, self.warm, self.inputs = {}, set(), {}

    def run(self, key, step) -> bool:
        """The step; whether it was a replay."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
        elif key in self.warm:
            self.graphs[key] = self.graph_class(step, self.pool)
        else:
            self.warm.add(key)
            step()
        return graph is not None


class _EagerSteps:
    """Each step as Python calls: the proposal, then its verification."""

    few_shapes = False  # (StepState.few_shapes: an eager step may take any shape)

    def __init__(self, decoder: SpeculativeDecoder):
        self.decoder = decoder

    def kept_cache(self, shape: tuple) -> Optional[object]:
        """A cache for a batch of tokens of `shape` that kept graphs read (None: none, make one)."""
        return None

    def begin(self, s: _Batch) -> _Batch:
        """The batch a generate call runs (s, or kept buffers that take its values)."""
        return s

    def times_drafting(self, s: _Batch) -> bool:
        """Whether run times a step's drafting apart: only where the host's clock sees it, eager steps on the CPU (a
        device runs the launches later; a graph or a compiled step runs the drafting and the rest as one)."""
        return s.tokens.device.type == "cpu"

    def run(self, s: _Batch, k: Optional[int]) -> tuple[bool, Optional[float]]:
        """One step of depth k on s in place. Returns whether it compiled, warmed up or captured no graph (its time
        is then a steady state's, which the adaptive policy may learn from), and when its proposal was ready where
        that is timed apart (else None)."""
        prop = self.decoder._propose(s, k)
        proposed_at = time.perf_counter() if self.times_drafting(s) else None
        self.decoder._verify(s, prop, k)
        return True, proposed_at


class _CompiledSteps(_EagerSteps):
    """Each step through torch.compile as one graph: the whole step, or for a drafter that proposes on the host
    (prompt lookup) its proposal eagerly and the verification compiled."""

    few_shapes = True

    def __init__(self, decoder: SpeculativeDecoder):
        super().__init__(decoder)
        self.whole_step = compile_static(decoder._step, decoder.target.device)
        self.verify_step = compile_static(decoder._verify, decoder.target.device)

    def times_drafting(self, s: _Batch) -> bool:
        return False

    def run(self, s: _Batch, k: Optional[int]) -> tuple[bool, Optional[float]]:
        from torch._dynamo.utils import counters
        compiled = counters["stats"]["unique_graphs"]
        if self.decoder.drafter.proposes_on_host:
            self.verify_step(s, self.decoder._propose(s, k), _verify_key(k))
        else:
            self.whole_step(s, k)
        return counters["stats"]["unique_graphs"] == compiled, None


class _GraphedSteps(_EagerSteps):
    """Each step replayed from a graph (graph_class: CudaStepGraph's interface), keyed by the depth and the drafter's
    `StepState.graph_key`; a host drafter's proposal runs eagerly and its verification is graphed, keyed by the tree
    width. The graphs and the state they read are kept for later generate calls of the same state signature
    (`_state_signature`), the KEPT_GRAPH_SETS most recently used."""

    few_shapes = True

    def __init__(self, decoder: SpeculativeDecoder, graph_class):
        super().__init__(decoder)
        self.graph_class = graph_class
        self.graph_sets: dict = {}  # state signature -> _GraphSet, the most recently used last
        self.graphs: Optional[_StepGraphs] = None  # the running call's

    def kept_cache(self, shape: tuple) -> Optional[object]:
        # (a cache is the largest buffer, and a kept set's graphs read it)
        return next((kept.batch.cache for kept in self.graph_sets.values() if kept.batch.tokens.shape == shape), None)

    def times_drafting(self, s: _Batch) -> bool:
        return False

    def begin(self, s: _Batch) -> _Batch:
        """The kept graph set whose state has s's signature (every tensor's shape and every other value the steps
        could read, the drafter's state_dict included: the batch shape, max_new_tokens, the method, whether requests
        sample, the filters on), its buffers (the batch's and the drafter's) taking s's values in place, since the
        graphs read and write them; else new graphs for s, kept for later calls."""
        drafter = self.decoder.drafter
        state = {} if drafter.proposes_on_host else drafter.state_dict()  # (a host drafter's is not read)
        tensors = []
        # (how many rows are real requests only the host reads)
        signature = _state_signature((replace(s, requests=0), state), tensors)
        kept = self.graph_sets.pop(signature, None)
        if kept is None:
            kept = _GraphSet(_StepGraphs(self.graph_class, s.tokens.device), s, state, tensors)
            while len(self.graph_sets) >= KEPT_GRAPH_SETS:
                del self.graph_sets[next(iter(self.graph_sets))]  # the least recently used
        else:
            for buf, x in zip(kept.tensors, tensors):
                # (an expanded view is a constant, a tree's structure: it cannot be written, and needs not be)
                if buf is not x and not any(st == 0 and n > 1 for st, n in zip(buf.stride(), buf.shape)):
                    buf.copy_(x)
            kept.batch.requests = s.requests
            if not drafter.proposes_on_host:
                drafter.load_state(kept.drafter)
        self.graph_sets[signature] = kept
        self.graphs = kept.graphs
        return kept.batch

    def run(self, s: _Batch, k: Optional[int]) -> tuple[bool, Optional[float]]:
        """(A step is steady where it was a replay.) A host drafter's proposal is copied into static buffers of its
        width, which the graph of its verification reads."""
        decoder, graphs = self.decoder, self.graphs
        if not decoder.drafter.proposes_on_host:
            return graphs.run((k,) + decoder.drafter.graph_key(), lambda: decoder._step(s, k)), None
        prop = decoder._propose(s, k)
        key = (_verify_key(k), prop.tokens.shape[1])
        static = graphs.inputs.get(key)
        if static is None:
            static = graphs.inputs[key] = Proposal(*(x if x is None else x.clone() for x in prop))
        else:
            for buf, x in zip(static, prop):
                if buf is not None:
                    buf.copy_(x)
        return graphs.run(key, lambda: decoder._verify(s, static, key[0])), None


@dataclass
class _GraphSet:
    """Step graphs kept across generate calls, and the state they read and write: the batch, and the drafter's
    state_dict as it was when the graphs' batch started (loaded back, with the new batch's values, for a call
    that replays them)."""
    graphs: _StepGraphs
    batch: _Batch
    drafter: dict
    tensors: list  # the state's tensors in signature order (never replaced: the graphs read them)


def _state_signature(obj, tensors: Optional[list] = None, _seen: Optional[dict] = None) -> tuple:
    """What a recorded step can depend on in a state (the batch, the drafter's state_dict) besides its tensors'
    values: each tensor's shape, strides, dtype and device, every other value (a Python number or flag a step
    branches on; a module or function by identity) and the structure holding them. tensors: the state's tensors
    are appended to it, in the order of the signature (two states of one signature align)."""
    seen = {} if _seen is None else _seen
    if isinstance(obj, specdec.RollbackPlan):
        # derived from its caches' tensors, which sign and are copied where they are held: its device table holds
        # their addresses (anchor + offsets), and a kept set's graphs run its own plan on its own caches (a new
        # cache's offsets copied onto a kept plan would point its rollback at other memory)
        return ("RollbackPlan",)
    if isinstance(obj, torch.Tensor):
        if tensors is not None:
            tensors.append(obj)
        return ("tensor", tuple(obj.shape), obj.stride(), obj.dtype, obj.device)
    if isinstance(obj, (torch.nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return ("id", id(obj))
    if id(obj) in seen:  # (an object met before: the signature says it is the same one)
        return ("seen", seen[id(obj)])
    if isinstance(obj, (list, tuple, dict)) or hasattr(obj, "__dict__"):
        seen[id(obj)] = len(seen)
        items = obj.items() if isinstance(obj, dict) else vars(obj).items() if hasattr(obj, "__dict__") else \
            enumerate(obj)
        return (type(obj).__name__,) + tuple((key, _state_signature(v, tensors, seen)) for key, v in items)
    try:
        hash(obj)
    except TypeError:
        return ("value", repr(obj))
    return ("value", obj)


def generate_ar(target: Llama, prompts, max_new_tokens: int = 128, temperature=0.0, seed=0,
                progress: bool = False, kv_dtype: Optional[torch.dtype] = None, **filters) -> GenerationOutput:
    """Plain autoregressive decoding through the same ops (one-node trees): the baseline. filters: generate's
    keyword arguments (the filters, step 0 and logprobs)."""
    return SpeculativeDecoder(target, kv_dtype=kv_dtype).generate(prompts, max_new_tokens, temperature, seed, progress,
                                                                  **filters)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="tok", leave=False, desc="generating")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
