"""The public ops, their torch.library registration and backend dispatch.

Every op exists as a torch custom op `torch.ops.specdec.<name>` with a fake (meta) implementation and
declared mutations, so it traces under `torch.compile(fullgraph=True)` and can be called from C++. One
record per op, `OPS[name]` (an OpSpec: schema, reference, fake, Triton implementation, input checks), drives
the registration and the dispatch:
  * the schemas are defined by the C++ extension (`specdec._C`, csrc/) when it is built, else here;
  * CPU kernel: the C++ implementation when built, else the PyTorch reference;
  * CUDA kernel: the Triton implementation (specdec.kernels).

`backend=` picks an implementation explicitly: "torch" (reference), "triton" (also on CPU tensors when
TRITON_INTERPRET=1 is set), "cpp" (CPU tensors). The default (None) is the registered op for the
tensors' device; the environment variable SPECDEC_BACKEND overrides that default.

`RollbackPlan` is kv_rollback split into a plan, made once for a set of caches, and a run per step;
`kv_rollback` itself is a one-step plan.
"""
from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import _validation as val
from . import reference

BACKENDS = ("torch", "triton", "cpp")


# ----------------------------------------------------------------------------------------------
# the op table
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpSpec:
    """Everything registration and dispatch need to know about one op `torch.ops.specdec.<name>`.

    signature: the schema after the name, "(args) -> results"; csrc/ops.cpp declares the same schema
    strings (tests/backends/test_registration.py and tests/backends/test_cpp.py compare them).
    reference: the PyTorch reference (specdec/reference.py), the CPU kernel when the C++ extension is not built.
    fake: the fake (meta) implementation: output shapes and dtypes, for torch.compile and opcheck.
    triton: (module, attribute) of the implementation for CUDA tensors and backend="triton", imported on first
    use (importing triton is slow); relative to the specdec package.
    check: the Python input checks of the public op (its arguments in schema order before normalization,
    then `values`: run the value checks), the ones the C++ op mirrors with the same messages.
    """
    name: str
    signature: str
    reference: Callable
    fake: Callable
    triton: tuple[str, str]
    check: Callable

    @property
    def schema(self) -> str:
        return self.name + self.signature

    def triton_impl(self) -> Callable:
        module, attribute = self.triton
        return getattr(importlib.import_module(module, __package__), attribute)


def _fake_build_tree(parents, num_nodes):
    B, T = parents.shape
    return (parents.new_empty((B, T), dtype=torch.int32), parents.new_empty((B, T, (T + 31) // 32), dtype=torch.int32))


def _fake_tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, block_table, num_nodes, scale, k_scale=1.0,
                         v_scale=1.0, window_left=-1, logits_soft_cap=0.0, row_offsets=None, max_nodes=0,
                         sinks=None):
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _fake_accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None,
                 top_k=None, top_p=None, min_p=None, token_bitmask=None, method="token", probs=False, row_offsets=None,
                 repetition_penalty=None, frequency_penalty=None, presence_penalty=None, output_token_counts=None,
                 prompt_token_mask=None, logit_bias_ids=None, logit_bias_values=None, min_tokens=None,
                 stop_token_ids=None, filter_order="hf", return_logprobs=-1, logprobs_mode="raw"):
    B, T = tokens.shape
    positions, N = (T, return_logprobs) if return_logprobs >= 0 else (0, 0)
    return (tokens.new_empty((B, T), dtype=torch.int32), tokens.new_empty((B,), dtype=torch.int32),
            tokens.new_empty((B,), dtype=torch.int64), tokens.new_empty((B, positions), dtype=torch.float32),
            tokens.new_empty((B, positions, N), dtype=torch.float32),
            tokens.new_empty((B, positions, N), dtype=torch.int64), tokens.new_empty((B, positions), dtype=torch.int64))


def _fake_mutating(*args):
    return None


OPS = {spec.name: spec for spec in (
    OpSpec("build_tree", "(Tensor parents, Tensor num_nodes) -> (Tensor, Tensor)",
           reference.build_tree, _fake_build_tree,
           (".tree", "build_tree_vectorized"),  # plain torch ops, sync-free: the GPU needs no kernel of its own
           val.check_build_tree),
    OpSpec("tree_attention",
           "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_lens, Tensor tree_mask, Tensor? block_table, "
           "Tensor num_nodes, float scale, float k_scale=1.0, float v_scale=1.0, int window_left=-1, "
           "float logits_soft_cap=0.0, Tensor? row_offsets=None, int max_nodes=0, Tensor? sinks=None) "
           "-> (Tensor, Tensor)",
           reference.tree_attention, _fake_tree_attention, (".kernels.tree_attention", "tree_attention"),
           val.check_tree_attention),
    OpSpec("accept",
           "(Tensor target_logits, Tensor tokens, Tensor parents, Tensor? draft_logits, Tensor temperature, "
           "Tensor seeds, Tensor num_nodes, int offset, Tensor? offsets=None, Tensor? top_k=None, Tensor? top_p=None, "
           "Tensor? min_p=None, Tensor? token_bitmask=None, str method=\"token\", bool probs=False, "
           "Tensor? row_offsets=None, Tensor? repetition_penalty=None, Tensor? frequency_penalty=None, "
           "Tensor? presence_penalty=None, Tensor? output_token_counts=None, Tensor? prompt_token_mask=None, "
           "Tensor? logit_bias_ids=None, Tensor? logit_bias_values=None, Tensor? min_tokens=None, "
           "Tensor? stop_token_ids=None, str filter_order=\"hf\", int return_logprobs=-1, "
           "str logprobs_mode=\"raw\") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
           reference.accept, _fake_accept, (".kernels.accept", "accept"), val.check_accept),
    OpSpec("kv_append",
           "(Tensor(a!) k_cache, Tensor(b!)? v_cache, Tensor k_new, Tensor? v_new, Tensor cache_lens, "
           "Tensor? block_table, float k_scale=1.0, float v_scale=1.0) -> ()",
           reference.kv_append, _fake_mutating, (".kernels.kv_cache", "kv_append"), val.check_kv_append),
    OpSpec("kv_rollback",
           "(Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor(c!) cache_lens, Tensor accepted_nodes, "
           "Tensor num_accepted, Tensor? block_table) -> ()",
           reference.kv_rollback, _fake_mutating, (".kernels.kv_cache", "kv_rollback"), val.check_kv_rollback),
)}

# The full schema strings, as csrc/ops.cpp declares them.
SCHEMAS = {name: spec.schema for name, spec in OPS.items()}


# ----------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------
def _load_cpp() -> bool:
    """Loads the C++ ops (loading the library runs TORCH_LIBRARY(specdec, ...)): specdec._C as built at
    install, else the one compiled on first use from the sources a wheel built without torch ships (cached;
    SPECDEC_JIT=0 skips it). Without them CPU tensors use the reference backend, with a warning."""
    try:
        importlib.import_module("specdec._C")
        return True
    except ImportError as exc:
        from . import _cpp_build
        if getattr(exc, "name", None) != "specdec._C":
            reason = f"failed to load: {exc}"
        elif not _cpp_build.sources(_cpp_build.SHIPPED_SOURCES):
            reason = "not built"
        elif os.environ.get("SPECDEC_JIT") == "0":
            reason = "not built (SPECDEC_JIT=0 skips compiling it on first use)"
        else:
            try:
                _cpp_build.load()
                return True
            except Exception as build_error:  # no compiler, no Python headers, a read-only cache: any of them
                reason = f"could not be compiled on first use: {str(build_error)[-2000:]}"
    warnings.warn(f"specdec: C++ extension specdec._C {reason}; CPU tensors use the PyTorch reference backend. "
                  "Build it ahead of time with `pip install --no-build-isolation .` (`-e .` in a checkout).",
                  stacklevel=3)
    return False


HAS_CPP = _load_cpp()


def _register() -> None:
    for spec in OPS.values():
        qualname = f"specdec::{spec.name}"
        if not HAS_CPP:
            torch.library.define(qualname, spec.signature)
            torch.library.register_kernel(qualname, "cpu", spec.reference)
        torch.library.register_fake(qualname, spec.fake)
        torch.library.register_kernel(qualname, "cuda", lambda *a, _spec=spec: _spec.triton_impl()(*a))


_register()


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------
def resolve_backend(backend: Optional[str], device: torch.device) -> Optional[str]:
    """The explicit backend to call, or None for the registered op of `device`."""
    if backend is None:
        backend = os.environ.get("SPECDEC_BACKEND") or None
        if backend is None:
            return None
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    if backend == "cpp":
        if device.type != "cpu":
            raise ValueError(f"backend: 'cpp' runs on CPU tensors, got tensors on {device}")
        if not HAS_CPP:
            raise ValueError("backend: 'cpp' requested but the C++ extension specdec._C is not built")
        return None  # the registered CPU kernel is the C++ one
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend: 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before import")
    return backend


def _python_value_checks(backend: Optional[str], x) -> bool:
    """False when the call on `x`'s device goes to the C++ op: it runs the same value checks itself,
    before writing. True for anything else (a non-tensor `x` then fails the Python type checks)."""
    if not (HAS_CPP and isinstance(x, torch.Tensor) and x.device.type == "cpu"):
        return True
    return resolve_backend(backend, x.device) is not None


def _call(name: str, backend: Optional[str], device: torch.device, *args):
    return _dispatch(name, resolve_backend(backend, device), *args)


def _dispatch(name: str, chosen: Optional[str], *args):
    """Op `name` on normalized (schema) arguments, by `chosen` = resolve_backend(...)."""
    if chosen is None:
        return getattr(torch.ops.specdec, name)(*args)
    if chosen == "torch":
        return OPS[name].reference(*args)
    return OPS[name].triton_impl()(*args)


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------
class TreeInfo(NamedTuple):
    """A batch of draft trees. parents (B, T) int32; depth (B, T) int32 (root 0); mask (B, T, ceil(T/32))
    int32, bit j % 32 of word j // 32 of mask[b, i] set iff j is i or an ancestor of i; num_nodes (B,)."""
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor
    num_nodes: torch.Tensor


class Logprobs(NamedTuple):
    """The logprobs of accept's emitted tokens (return_logprobs=N): position j of request b is its emitted token j
    (the accepted draft tokens, then the next token; AcceptResult.emitted_tokens), j <= num_accepted[b].
    token_logprobs (B, T) float32: each emitted token's logprob, NaN after; top_logprobs (B, T, N) float32 and
    top_token_ids (B, T, N) int64: the N largest logprobs of each emitted position's law and their tokens, in
    decreasing order (ties: the lower id first), NaN / -1 after; token_ranks (B, T) int64: each emitted token's
    rank in its law, the number of tokens whose value is at least its own (1 = the most likely; vLLM's
    selected_token_ranks), -1 after."""
    token_logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_token_ids: torch.Tensor
    token_ranks: torch.Tensor


class _AcceptedPaths(NamedTuple):
    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    next_tokens: torch.Tensor


class AcceptResult(_AcceptedPaths):
    """accepted_nodes (B, T) int32: the accepted path's node indices from 0, padded with -1;
    num_accepted (B,) int32: accepted draft nodes; next_tokens (B,) int64: correction or bonus token.
    Unpacks as those three; .logprobs: a `Logprobs` when accept was asked for them, else None."""
    logprobs: Optional[Logprobs] = None

    @classmethod
    def from_op(cls, outputs) -> "AcceptResult":
        """The result of the op's seven outputs (the logprob tensors are empty when they were not asked for)."""
        result = cls(*outputs[:3])
        if outputs[3].shape[1]:
            result.logprobs = Logprobs(*outputs[3:])
        return result

    def emitted_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) int64: request b's new tokens, the accepted draft tokens tokens[b, accepted_nodes[b, 1:]] then
        next_tokens[b], padded with -1 (vLLM's output_token_ids layout); on the device, no host sync."""
        B, T = self.accepted_nodes.shape
        drafted = tokens.long().gather(1, self.accepted_nodes[:, 1:].clamp(min=0).long())  # (B, T - 1)
        out = torch.cat((drafted, drafted.new_empty(B, 1)), dim=1)
        count = self.num_accepted.long().unsqueeze(1)
        out = torch.where(torch.arange(T, device=out.device) < count, out, -1)
        return out.scatter_(1, count, self.next_tokens.long().unsqueeze(1))


def build_tree(parents: torch.Tensor, num_nodes: Optional[torch.Tensor] = None, *,
               backend: Optional[str] = None) -> TreeInfo:
    """Depths and packed ancestor masks of a batch of trees.

    parents: (B, T) int, parents[:, 0] == -1 and 0 <= parents[b, i] < i for real nodes.
    num_nodes: (B,) int or None (all T nodes real). Nodes >= num_nodes[b] are padding.
    """
    num_nodes = OPS["build_tree"].check(parents, num_nodes, _python_value_checks(backend, parents))
    parents = parents.to(torch.int32)
    depth, mask = _call("build_tree", backend, parents.device, parents, num_nodes)
    return TreeInfo(parents, depth, mask, num_nodes)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lens: torch.Tensor,
                   tree_mask: torch.Tensor, *, block_table: Optional[torch.Tensor] = None,
                   num_nodes: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                   k_scale: Optional[float] = None, v_scale: Optional[float] = None, window_left: int = -1,
                   logits_soft_cap: float = 0.0, sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
                   cu_num_nodes: Optional[torch.Tensor] = None, max_nodes: Optional[int] = None,
                   backend: Optional[str] = None):
    """Attention of T draft-tree queries over the committed prefix plus their ancestors.

    q: (B, T, Hq, D). k_cache: (B, L_max, Hkv, D) contiguous, or (num_blocks, block_size, Hkv, D) paged with
    block_table (B, max_blocks) int32; v_cache: the same with its own head dim Dv <= D (usually Dv = D); in q's
    dtype, or float8 (e4m3fn / e5m2) holding K / k_scale and V / v_scale (per-tensor scales, None = 1.0; only
    float8 caches take scales).
    MLA (DeepSeek-V2/V3, Kimi-K2) in its absorbed form: q (..., Hq, Dqk) holds the absorbed queries
    [q_nope W_UK ; q_rope] (Dqk = kv_lora_rank + rope dims, 576 for DeepSeek-V3), k_cache (..., 1, Dqk) the
    latent rows [c_kv ; k_rope], and V is c_kv, the first Dv = kv_lora_rank channels of those rows: pass
    v_cache = k_cache[..., :Dv], a view (no copy). A view of k_cache's leading channels (same storage, first
    element and strides) is recognized: each row is read once for K and V and for all Hq heads, and its V shares
    K's scale (v_scale None or k_scale, else ValueError). out is c_kv-space (..., Hq, Dv); the caller applies
    W_UV. A view rather than FlashInfer's split ckv / kpe tensors: the latent row stays one tensor, the one
    kv_append writes and kv_rollback moves (v_cache=None there), and the op keeps one signature for GQA and MLA.
    scale: the model's softmax scale (for MLA, 1/sqrt(qk_nope + qk_rope head dims), not 1/sqrt(Dqk)).
    cache_lens: (B,) int32
    committed tokens; the tree's K/V are already stored at logical positions cache_lens[b] .. cache_lens[b]
    + T - 1. tree_mask: (B, T, ceil(T/32)) int32 (TreeInfo.mask). num_nodes: (B,) or None. scale: default
    1/sqrt(D). window_left (sliding-window layers, FlashInfer's convention; a Hugging Face `sliding_window` w is
    w - 1): node i, at position cache_lens[b] + depth_i (depth_i = the tree nodes it sees - 1, TreeInfo.depth),
    sees committed positions >= cache_lens[b] + depth_i - window_left only; -1 = no window, else >= T - 1 so
    every node still sees its ancestors. logits_soft_cap c > 0 (Gemma 2): scores become c * tanh(score / c).
    sinks (gpt-oss's attention sinks): None or (Hq,) float32 on q's device, a learned logit per query head in the
    softmax's denominator with no value: with s_j the scaled (and capped) scores of the keys node i sees,
    out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sinks[h])); the sink itself is neither scaled nor capped.
    -inf is no sink (the same result, bit for bit); NaN and +inf are refused (value checks).
    Returns out (B, T, Hq, Dv) in q.dtype, and lse (B, T, Hq) float32 (of the capped scores, and the sink:
    log(sum_j exp(s_j) + exp(sinks[h])), so out * exp(lse) is the numerator) if return_lse.
    Padding nodes get out = 0 and lse = -inf (no sink there).
    Packed (ragged) form, as accept's: with cu_num_nodes (B + 1,), q is (N, Hq, D) and tree_mask (N, ceil(T/32))
    with T = max_nodes (a Python int), request b's nodes being rows cu_num_nodes[b] .. cu_num_nodes[b + 1] - 1;
    num_nodes is then not given. Returns out (N, Hq, Dv) and lse (N, Hq), read and written in place (no padding).
    """
    row_offsets = None
    if cu_num_nodes is None:
        max_nodes = 0  # the schema's "not packed"
    else:
        if num_nodes is not None:
            raise TypeError("num_nodes: with cu_num_nodes the counts are its differences; give one of them")
        val._tensor("q", q, dim=3, dtypes=val.FLOAT_DTYPES)  # (before its rows are counted)
        num_nodes, row_offsets = val.packed_rows(cu_num_nodes, max_nodes, q.shape[0])
    num_nodes, scale, k_scale, v_scale, window_left, logits_soft_cap = OPS["tree_attention"].check(
        q, k_cache, v_cache, cache_lens, tree_mask, block_table, num_nodes, scale, k_scale, v_scale, window_left,
        logits_soft_cap, row_offsets, max_nodes, sinks, _python_value_checks(backend, q))
    out, lse = _call("tree_attention", backend, q.device, q, k_cache, v_cache, cache_lens, tree_mask,
                     block_table, num_nodes, scale, k_scale, v_scale, window_left, logits_soft_cap, row_offsets,
                     max_nodes, sinks)
    return (out, lse) if return_lse else out


def accept(target_logits: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None,
           parents: Optional[torch.Tensor] = None, *, draft_logits: Optional[torch.Tensor] = None,
           target_probs: Optional[torch.Tensor] = None, draft_probs: Optional[torch.Tensor] = None,
           temperature: Union[None, float, torch.Tensor] = None, seeds: Optional[torch.Tensor] = None,
           num_nodes: Optional[torch.Tensor] = None, offset: Union[int, torch.Tensor] = 0,
           top_k: Union[None, int, torch.Tensor] = None, top_p: Union[None, float, torch.Tensor] = None,
           min_p: Union[None, float, torch.Tensor] = None, token_bitmask: Optional[torch.Tensor] = None,
           method: str = "token", cu_num_nodes: Optional[torch.Tensor] = None, max_nodes: Optional[int] = None,
           repetition_penalty: Union[None, float, torch.Tensor] = None,
           frequency_penalty: Union[None, float, torch.Tensor] = None,
           presence_penalty: Union[None, float, torch.Tensor] = None,
           output_token_counts: Optional[torch.Tensor] = None, prompt_token_mask: Optional[torch.Tensor] = None,
           logit_bias: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
           min_tokens: Union[None, int, torch.Tensor] = None, stop_token_ids: Optional[torch.Tensor] = None,
           filter_order: str = "hf", return_logprobs: Optional[int] = None, logprobs_mode: str = "raw",
           backend: Optional[str] = None) -> AcceptResult:
    """Verify draft trees against the target: the longest accepted path plus one next token.

    target_logits: (B, T, V) the target's logits at each node. tokens: (B, T) int, tokens[b, i] is node
    i's draft token (tokens[:, 0], the root, is unused). parents: (B, T) int. draft_logits: (B, T, V) or
    None: the drafter's logits at each node, whose softmax at the same temperature is the law node's
    children were drawn from (i.i.d.); None means the children are given proposals. temperature: None/0
    (greedy), a float, or (B,) floats, finite and >= 0; below 1e-5 (reference.GREEDY_BELOW: 0, tiny and
    subnormal values) a request is greedy, as vLLM's, so the mask's guarantee holds at every temperature.
    seeds: (B,) int64 (None draws seeds from torch's generator). offset: the position in the request's random
    stream, an int for the whole batch or a (B,) int tensor on the device, one per request (e.g. each request's
    own step counter: an engine updates it in place, so a captured CUDA graph draws fresh numbers at every
    replay, and a request's numbers do not depend on when it joined the batch); 0 <= offset < 2**60. Request
    b's result depends only on its own inputs, seeds[b] and its offset.

    Sampling filters, per request, and a grammar mask per tree node (real traffic):
    top_k: None, an int or a (B,) int tensor (0 or >= V: off). top_p: None, a float or a (B,) float tensor in
    (0, 1] (1: off). min_p: None, a float or a (B,) float tensor in [0, 1) (0: off). token_bitmask: None or
    (B, T, ceil(V/32)) int32, bit v % 32 of word v // 32 of row [b, i] set iff token v may follow node i
    (xgrammar's / vLLM's layout, one row per tree node). The law at node i of a sampling request b is the
    processed law of row [b, i] (its steps, in order: the docstring of specdec.sampling) with request b's
    parameters and node i's mask row; the emitted tokens follow it exactly. With draft_logits the same
    processing of the drafter's row defines q, the law the drafter sampled from: a drafter samples from
    specdec.sampling.processed_logits. Greedy requests take the argmax of the masked row (the filters never
    remove it). A real node's row that the mask leaves without a finite logit is a ValueError with the value
    checks on (the C++ op, whose inputs are on the host, always checks); with them off no backend writes an
    out-of-range id (the reference stops the walk at that node and emits token 0). A number meaning off (or
    None) drops that parameter for the whole batch; a tensor is read per request.
    specdec.reference.processed_probs is the law of one row.

    method: the verifier of sampling requests (one for the batch; greedy requests are unaffected).
    "token": token-wise (multi-step) rejection sampling, any tree. "block": block verification (Sun et al.,
    arXiv 2403.10444), which decides a chain jointly and accepts at least as many tokens on average, with
    the same output law; chains only (parents[b, i] = i - 1, a value check) and draft_logits required. It
    reads every row of a sampled chain (token-wise stops at the first rejection). "traversal": traversal
    verification (Weng et al., arXiv 2505.12398), any tree with draft_logits: the tree is visited leaf to
    root in post-order with sequence-level weights, so a rejected node's siblings and their subtrees still
    count; on a chain it is block verification. Same output law, at least as many accepted tokens on
    average as "token" on trees of depth >= 2 (equal on stars). It reads the rows of every inner node it
    enters and a leaf's target row only when the next token is drawn there (reference._traversal_verify).
    Packed (ragged) form, vLLM's and SGLang's: with cu_num_nodes (B + 1,) int offsets, request b's nodes are the
    rows cu_num_nodes[b] .. cu_num_nodes[b + 1] - 1 of target_logits (N, V) / target_probs, draft_logits (N, V),
    tokens (N,), parents (N,) (indices within the request: parents of a request's first row is -1) and
    token_bitmask (N, ceil(V/32)); num_nodes is then not given, and max_nodes, a Python int, bounds every
    request's nodes (the launch configuration depends on it, never on the data). The kernels read the packed
    rows in place; the results are the padded form's, (B, max_nodes) with indices within the request.
    Penalties, logit bias and min-tokens (step 0 of the processed law, before the mask; vLLM's meanings, order
    and float32 arithmetic, saturated where it would overflow: specdec.reference.penalized_row), per request, each None (or a number meaning off)
    = off for the batch: repetition_penalty (> 0; 1: off), frequency_penalty, presence_penalty (0: off): floats
    or (B,) float tensors. The state they read, in vLLM's layouts: output_token_counts (B, V) int32, the counts
    of each token in request b's output so far (its last committed token, the tree's root, included), required
    with a penalty or min_tokens; prompt_token_mask (B, ceil(V/32)) int32, bit v % 32 of word v // 32 set iff
    token v is in the prompt (None: no prompt token). Inside a tree, node i sees the counts plus the draft
    tokens of its path from the root (node 0's excluded): what sampling without speculation would see there, so
    each node has its own law, for the target and the drafter alike. logit_bias: (ids (B, K) int, -1 =
    padding, values (B, K) float), added to the logits (entries in order). min_tokens (an int or (B,) int)
    with stop_token_ids (B, S) int (-1 = padding): at a node where request b has generated fewer than
    min_tokens[b] tokens (sum of output_token_counts[b] plus the node's path), its stop tokens are masked.
    filter_order: the order of top-k, top-p and min-p, "hf" (default: top-k, top-p, min-p, as Hugging Face),
    "vllm" (min-p first, as vLLM's sampler) or "sglang" (top-p over the whole law, jointly with top-k);
    reference.processed_keep has each.
    return_logprobs: None (off) or N in [0, 20]: the result's .logprobs holds the logprob of every emitted
    token, its rank, and the N largest logprobs at each emitted position (`Logprobs`); logprobs_mode "raw" (the target's
    log-softmax as given) or "processed" (the law the token was sampled from; a greedy request's row after
    step 0 and the mask at temperature 1), as vLLM's logprobs_mode names them.
    Returns AcceptResult(accepted_nodes (B, T) int32, num_accepted (B,) int32, next_tokens (B,) int64), and
    .logprobs.
    """
    target_logits, draft_logits, probs = _accept_laws(target_logits, draft_logits, target_probs, draft_probs)
    if tokens is None or parents is None:
        raise TypeError(f"{'tokens' if tokens is None else 'parents'}: required")
    values = _python_value_checks(backend, target_logits)
    val._tensor("target_probs" if probs else "target_logits", target_logits, dim=3 if cu_num_nodes is None else 2,
                dtypes=val.FLOAT_DTYPES)  # (before its rows are counted)
    # (the packed offsets' checks run on every backend: the op sees only the rows they give)
    tokens, parents, num_nodes, row_offsets = val.accept_nodes(cu_num_nodes, max_nodes, num_nodes, tokens, parents,
                                                               target_logits.shape[0])
    # the sampling parameters first, like the filters: their checks come before the rows' values are read
    params = val.check_sampling_params(target_logits.shape[-1], target_logits.shape[0] if cu_num_nodes is None
                                       else tokens.shape[0], target_logits.device, repetition_penalty,
                                       frequency_penalty, presence_penalty, output_token_counts, prompt_token_mask,
                                       logit_bias, min_tokens, stop_token_ids, filter_order, return_logprobs,
                                       logprobs_mode, values)
    num_nodes, temperature, seeds, offset, offsets, top_k, top_p, min_p, token_bitmask = OPS["accept"].check(
        target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, top_k, top_p, min_p,
        token_bitmask, method, probs, row_offsets, values)
    if values:  # (the C++ op checks it itself)
        val.check_rows_after_min_tokens("target_probs" if probs else "target_logits", target_logits, params,
                                        parents, num_nodes, token_bitmask, probs, row_offsets)
    res = _call("accept", backend, target_logits.device, target_logits, tokens.to(torch.int32),
                parents.to(torch.int32), draft_logits, temperature, seeds, num_nodes, offset, offsets, top_k, top_p,
                min_p, token_bitmask, method, probs, row_offsets, *params)
    return AcceptResult.from_op(res)


def _accept_laws(target_logits, draft_logits, target_probs, draft_probs):
    """(target, draft, probs): the laws accept was given, logits or probabilities, never a mix."""
    if target_probs is None:
        if target_logits is None:
            raise TypeError("target_logits: required (or target_probs)")
        if draft_probs is not None:
            raise TypeError("draft_probs: goes with target_probs; with target_logits give draft_logits")
        return target_logits, draft_logits, False
    if target_logits is not None:
        raise TypeError("target_probs: give target_logits or target_probs, not both")
    if draft_logits is not None:
        raise TypeError("draft_logits: goes with target_logits; with target_probs give draft_probs")
    return target_probs, draft_probs, True


def kv_append(k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], k_new: torch.Tensor,
              v_new: Optional[torch.Tensor],
              cache_lens: torch.Tensor, *, block_table: Optional[torch.Tensor] = None,
              k_scale: Optional[float] = None, v_scale: Optional[float] = None,
              backend: Optional[str] = None) -> None:
    """Write k_new[b, i], v_new[b, i] ((B, T, Hkv, D)) at logical position cache_lens[b] + i of one
    layer's cache (in place; cache_lens is not changed). Cache layouts as in `tree_attention`.
    k_new/v_new are in the cache's dtype, or any float dtype for a float8 cache, which stores them
    quantized: fp32(x) * fp32(1 / scale), clamped to the format's finite range, rounded to nearest even
    (k_scale, v_scale: per-tensor, None = 1.0). A single-cache layer (MLA's latent cache [c_kv ; k_rope], whose
    V tree_attention reads as a view of its rows) passes v_cache=None and v_new=None: its rows are written once."""
    k_scale, v_scale = OPS["kv_append"].check(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale,
                                              v_scale, _python_value_checks(backend, k_new))
    _call("kv_append", backend, k_cache.device, k_cache, v_cache, k_new, v_new, cache_lens, block_table,
          k_scale, v_scale)


class LayerCalls:
    """kv_append and tree_attention for every layer of one cached forward (a model runner's hot path): the
    first call of each op checks its arguments in full (value checks too, when on) and keeps the normalized
    ones; a later call whose arguments have the same shapes, dtypes and devices (every later layer's) only
    dispatches. The arguments the layers share are the plan's, so they are the same tensors at every call:

        calls = specdec.ops.LayerCalls(cache_lens, tree_mask, write_start=..., block_table=..., num_nodes=...)
        for layer: calls.kv_append(k_cache, v_cache, k, v); out = calls.tree_attention(q, k_cache, v_cache)
        MLA:       calls.kv_append(latent, None, c_kv_and_k_rope, None)
                   out = calls.tree_attention(q_absorbed, latent, latent[..., :kv_lora_rank])

    A layer's own arguments: window_left (sliding-window layers), sinks (its attention sinks, (Hq,) float32) and
    scale (the softmax scale, default 1/sqrt(D); MLA's is the model's, not 1/sqrt(Dqk)).

    cache_lens: tree_attention's (node 0's slot); write_start: kv_append's cache_lens (default cache_lens).
    Other arguments as the ops'; backend is resolved once."""

    def __init__(self, cache_lens: torch.Tensor, tree_mask: torch.Tensor, *, write_start: Optional[torch.Tensor] = None,
                 block_table: Optional[torch.Tensor] = None, num_nodes: Optional[torch.Tensor] = None,
                 k_scale: Optional[float] = None, v_scale: Optional[float] = None, backend: Optional[str] = None):
        self.cache_lens, self.tree_mask = cache_lens, tree_mask
        self.block_table, self.num_nodes = block_table, num_nodes
        self.write_start = cache_lens if write_start is None else write_start
        self.k_scale, self.v_scale, self.backend = k_scale, v_scale, backend
        self._append = self._attend = None  # (signature, normalized arguments) of the last checked call

    @staticmethod
    def _signature(*tensors, extra=()):
        return tuple(None if t is None else (t.shape, t.dtype, t.device) for t in tensors) + tuple(extra)

    def kv_append(self, k_cache, v_cache, k_new, v_new) -> None:
        sig = self._signature(k_cache, v_cache, k_new, v_new)
        if self._append is None or self._append[0] != sig:
            k_scale, v_scale = OPS["kv_append"].check(k_cache, v_cache, k_new, v_new, self.write_start,
                                                      self.block_table, self.k_scale, self.v_scale,
                                                      _python_value_checks(self.backend, k_new))
            self._append = (sig, (k_scale, v_scale), resolve_backend(self.backend, k_cache.device))
        _, scales, chosen = self._append
        _dispatch("kv_append", chosen, k_cache, v_cache, k_new, v_new, self.write_start, self.block_table, *scales)

    def tree_attention(self, q, k_cache, v_cache, window_left: int = -1, *, sinks: Optional[torch.Tensor] = None,
                       scale: Optional[float] = None) -> torch.Tensor:
        # (whether V is K's leading channels decides V's scale: part of what a check normalizes)
        sig = self._signature(q, k_cache, v_cache, *(() if sinks is None else (sinks,)),
                              extra=(window_left, scale, val.v_reads_k(k_cache, v_cache)))
        if self._attend is None or self._attend[0] != sig:
            normalized = OPS["tree_attention"].check(
                q, k_cache, v_cache, self.cache_lens, self.tree_mask, self.block_table, self.num_nodes, scale,
                self.k_scale, self.v_scale, window_left, 0.0, None, 0, sinks, _python_value_checks(self.backend, q))
            self._attend = (sig, normalized, resolve_backend(self.backend, q.device))
        _, (num_nodes, scale, k_scale, v_scale, window, cap), chosen = self._attend
        out, _ = _dispatch("tree_attention", chosen, q, k_cache, v_cache, self.cache_lens, self.tree_mask,
                           self.block_table, num_nodes, scale, k_scale, v_scale, window, cap, None, 0, sinks)
        return out


CacheArg = Union[torch.Tensor, Sequence[torch.Tensor]]


class RollbackPlan:
    """kv_rollback planned once for a set of caches, then run at every verification step (FlashInfer's
    plan / run split):

        plan = specdec.RollbackPlan(k_cache, v_cache, block_table=block_table)  # once, outside CUDA graphs
        plan.run(cache_lens, accepted_nodes, num_accepted)                      # every step; capturable

    k_cache, v_cache: one layer (4-D), a stack of layers (layers, ...) (5-D), or a list of either, every layer
    of one shape, dtype and device (v_cache None: single-cache layers, MLA's latent caches, each row moved once;
    a view of K's rows as v_cache is refused, it would move rows twice): contiguous (B, L_max, Hkv, D) with
    block_table None, or paged
    (num_blocks, block_size, Hkv, D) with block_table (B, max_blocks) int32. backend: as the other ops
    ("torch", "triton", "cpp"; None: the registered op of the caches' device, or SPECDEC_BACKEND), resolved
    here, once.

    The constructor checks the cache metadata (ValueError / TypeError naming the argument) and, for the
    Triton kernel (backend "triton", or the default on CUDA), builds the device table of every (K or V,
    layer) base offset: one small asynchronous host-to-device copy, owned by the plan. `run` then launches
    the kernel on that table; the other backends call the registered op or the reference with the held
    caches. The plan holds the tensors themselves (never copies) and the table addresses their memory as it
    is now: a cache that is reallocated needs a new plan. block_table is read at every run, so an engine
    may rewrite its entries in place between steps. Build the plan outside a CUDA-graph capture and run it
    inside: a table first built during a capture makes its host source live as long as the process.
    """

    def __init__(self, k_cache: CacheArg, v_cache: Optional[CacheArg],
                 block_table: Optional[torch.Tensor] = None, *, backend: Optional[str] = None):
        self._ks, self._vs = val.check_rollback_caches(k_cache, v_cache, block_table)
        self._block_table = block_table
        device = self._ks[0].device
        self._backend = resolve_backend(backend, device)
        self._python_values = _python_value_checks(backend, self._ks[0])
        self._tables = None  # the Triton kernel's layer tables (kernels/kv_cache.py), None on other backends
        uses_triton = self._backend == "triton" or (self._backend is None and device.type == "cuda")
        if uses_triton and not torch.compiler.is_compiling():  # traced: the registered op builds its own
            from .kernels import kv_cache
            self._tables = kv_cache.layer_tables(self._ks, self._vs)

    def run(self, cache_lens: torch.Tensor, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """One step: for each request b, move row cache_lens[b] + accepted_nodes[b, i] to cache_lens[b] + i
        for i <= num_accepted[b] in every layer, then cache_lens[b] += num_accepted[b] + 1 (in place, on the
        device). cache_lens (B,) int32; accepted_nodes (B, P) int, strictly increasing from 0
        (AcceptResult.accepted_nodes); num_accepted (B,) int. The checks of kv_rollback (the value checks
        when enabled) run first: nothing is written on bad input."""
        val.check_rollback_step(self._ks, self._block_table, cache_lens, accepted_nodes, num_accepted,
                                self._python_values)
        path, num = accepted_nodes.to(torch.int32), num_accepted.to(torch.int32)
        if self._tables is not None and not torch.compiler.is_compiling():
            from .kernels import kv_cache
            kv_cache.rollback(self._tables, cache_lens, path, num, self._block_table)
        else:
            _dispatch("kv_rollback", self._backend, self._ks, self._vs, cache_lens, path, num, self._block_table)


def kv_rollback(k_cache: CacheArg, v_cache: Optional[CacheArg], cache_lens: torch.Tensor,
                accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, *, block_table: Optional[torch.Tensor] = None,
                backend: Optional[str] = None) -> None:
    """Keep only the accepted path's K/V, for every layer given, then advance cache_lens (in place).

    k_cache/v_cache: one layer (4-D), a stack of layers (layers, ...) (5-D), or a list of either; v_cache None for
    single-cache layers (MLA). accepted_nodes: (B, P) int, strictly increasing from 0
    (AcceptResult.accepted_nodes); num_accepted (B,).
    Moves row cache_lens[b] + accepted_nodes[b, i] to cache_lens[b] + i for i <= num_accepted[b], then
    cache_lens[b] += num_accepted[b] + 1. A one-step RollbackPlan; an engine that rolls back the same caches
    every step makes the plan once instead.
    """
    RollbackPlan(k_cache, v_cache, block_table, backend=backend).run(cache_lens, accepted_nodes, num_accepted)
