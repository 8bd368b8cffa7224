"""Plain-PyTorch reference implementations: the executable spec of every public op.

Written for obviousness, not speed: Python loops over requests, nodes and positions, float64 math.
Every other backend (Triton, C++) is tested against these functions. They assume inputs that already
passed `specdec._validation` (the public ops in `specdec.ops` validate before calling them).

Conventions (see README "Op contract"): B requests, T tree nodes (node 0 is the root), V vocab,
Hq/Hkv query/KV heads, D head dim. A contiguous cache is (B, L_max, Hkv, D); a paged cache is
(num_blocks, block_size, Hkv, D) addressed through `block_table` (B, max_blocks).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ._layout import FP8_DTYPES, pack_bits, packed_row_index, padded_rows, unpack_bits


# ----------------------------------------------------------------------------------------------
# Trees
# ----------------------------------------------------------------------------------------------
def build_tree(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """depth (B, T) int32 and packed ancestor-or-self mask (B, T, ceil(T/32)) int32.

    Padding nodes (i >= num_nodes[b]) get depth 0 and only their own bit, so attention over them
    stays well defined; their outputs are ignored.
    """
    B, T = parents.shape
    words = (T + 31) // 32
    depth = torch.zeros(B, T, dtype=torch.int32)
    bits = torch.zeros(B, T, words * 32, dtype=torch.bool)
    par = parents.cpu().tolist()
    nn = num_nodes.cpu().tolist()
    for b in range(B):
        for i in range(T):
            bits[b, i, i] = True
            if 0 < i < nn[b]:
                p = par[b][i]
                depth[b, i] = depth[b, p] + 1
                bits[b, i] |= bits[b, p]
    return depth.to(parents.device), pack_bits(bits).to(parents.device)


# ----------------------------------------------------------------------------------------------
# Caches
# ----------------------------------------------------------------------------------------------
def physical_row(cache_shape, block_table, b: int, pos: int) -> tuple[int, int]:
    """(block or request index, row) holding logical position `pos` of request b."""
    if block_table is None:
        return b, pos
    block_size = cache_shape[1]
    return int(block_table[b, pos // block_size]), pos % block_size


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of `dtype` stores for values x: float8 holds fp32(x) * fp32(1 / scale), clamped to the
    format's finite range (NaN stays NaN), rounded to nearest even; other dtypes hold x as it is."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    y = x.float() * torch.tensor(1.0 / scale, dtype=torch.float32)
    return torch.where(y > limit, limit, torch.where(y < -limit, -limit, y)).to(dtype)


def tree_attention(q, k_cache, v_cache, cache_lens, tree_mask, block_table, num_nodes, scale, k_scale=1.0,
                   v_scale=1.0, window_left=-1, logits_soft_cap=0.0, row_offsets=None, max_nodes=0, sinks=None):
    """out (B, T, Hq, Dv) in q.dtype and lse (B, T, Hq) float32 (Dv = v_cache's head dim, D = q's and k_cache's;
    MLA's absorbed form reads V as the first Dv channels of K's rows: v_cache = k_cache[..., :Dv]).

    Node i of request b attends to committed positions [0, L) (L = cache_lens[b]) and to tree position
    L + j for every j whose bit is set in tree_mask[b, i]. Keys are k_cache * k_scale, values
    v_cache * v_scale (scales other than 1 come with float8 caches). With window_left >= 0, node i (at
    position L + depth_i, depth_i = its set bits - 1) sees only committed positions >= L + depth_i -
    window_left. With logits_soft_cap c > 0 the scores are c * tanh(score / c). sinks (Hq,) float32 (gpt-oss's
    attention sinks): query head h's scores gain one more column, the logit sinks[h] (neither scaled nor capped),
    in the softmax and then dropped (it has no value): out shrinks by the sink's share, lse includes it; -inf is
    no sink. Padding nodes get out = 0, lse = -inf. row_offsets (B,) (the packed form): q (N, Hq, D)
    and tree_mask (N, W) rows, node i of request b at row row_offsets[b] + i, T = max_nodes; unpacked first, and
    the outputs packed back.
    """
    if row_offsets is not None:
        rows = packed_row_index(row_offsets.cpu(), max_nodes, q.shape[0])
        out_p, lse_p = tree_attention(q[rows], k_cache, v_cache, cache_lens, tree_mask[rows], block_table, num_nodes,
                                      scale, k_scale, v_scale, window_left, logits_soft_cap, sinks=sinks)
        real = torch.arange(max_nodes) < num_nodes.cpu().long().unsqueeze(1)
        out = q.new_zeros((*q.shape[:-1], v_cache.shape[-1]))
        lse = torch.full(q.shape[:-1], -math.inf, device=q.device)
        out[rows[real]], lse[rows[real]] = out_p[real], lse_p[real]
        return out, lse
    B, T, Hq, _ = q.shape
    group = Hq // k_cache.shape[-2]
    out = torch.zeros(B, T, Hq, v_cache.shape[-1], dtype=torch.float64)
    lse = torch.full((B, T, Hq), -math.inf, dtype=torch.float64)
    allowed_tree = unpack_bits(tree_mask.cpu(), T)  # (B, T, T) bool
    for b in range(B):
        L, n = int(cache_lens[b]), int(num_nodes[b])
        first = max(0, L - window_left) if window_left >= 0 else 0  # older rows are never read
        rows = [physical_row(k_cache.shape, block_table, b, p) for p in range(first, L + T)]
        where = (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]))
        # (L+T, Hq, D): query head h reads KV head h // group
        keys = (k_cache.cpu()[where].double() * k_scale).repeat_interleave(group, dim=1)
        vals = (v_cache.cpu()[where].double() * v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("ihd,phd->hip", q[b, :n].cpu().double(), keys) * scale  # (Hq, n, L+T-first)
        if logits_soft_cap > 0:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        prefix = torch.ones(n, L - first, dtype=torch.bool)
        if window_left >= 0:
            depth = allowed_tree[b, :n].sum(-1) - 1  # (n,)
            prefix = torch.arange(first, L).unsqueeze(0) >= (L + depth - window_left).unsqueeze(1)
        allowed = torch.cat([prefix, allowed_tree[b, :n]], dim=1)  # (n, L+T-first)
        scores = scores.masked_fill(~allowed, -math.inf)
        if sinks is not None:  # one more column, the sink's logit: in the softmax's denominator, dropped after
            scores = torch.cat([scores, sinks.cpu().double().view(Hq, 1, 1).expand(Hq, n, 1)], dim=-1)
        lse[b, :n] = torch.logsumexp(scores, -1).T
        weights = torch.softmax(scores, -1)[..., :vals.shape[0]]
        out[b, :n] = torch.einsum("hip,phd->ihd", weights, vals)
    return out.to(q.dtype).to(q.device), lse.float().to(q.device)


def kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale=1.0, v_scale=1.0) -> None:
    """Write k_new[b, i], v_new[b, i] at logical position cache_lens[b] + i (in place), quantized for a
    float8 cache. A single-cache layer (MLA's latent cache) has v_cache and v_new None."""
    B, T = k_new.shape[:2]
    for b in range(B):
        L = int(cache_lens[b])
        for i in range(T):
            where = physical_row(k_cache.shape, block_table, b, L + i)
            k_cache[where] = quantize(k_new[b, i], k_scale, k_cache.dtype)
            if v_cache is not None:
                v_cache[where] = quantize(v_new[b, i], v_scale, v_cache.dtype)


def kv_rollback(k_caches, v_caches, cache_lens, accepted_nodes, num_accepted, block_table) -> None:
    """Compact the accepted path of every layer in place, then advance cache_lens.

    `k_caches`/`v_caches` are lists of tensors, each one layer (4-D) or a stack of layers (5-D); v_caches is
    empty for single-cache layers (MLA).
    Moves row L + accepted_nodes[b, i] to L + i for i = 0..num_accepted[b], in ascending i, which never
    overwrites a row before it is read because the path is strictly increasing from 0.
    """
    B = cache_lens.shape[0]
    for cache in list(k_caches) + list(v_caches):
        layers = cache if cache.dim() == 5 else cache.unsqueeze(0)
        for layer in layers:
            for b in range(B):
                L = int(cache_lens[b])
                for i in range(int(num_accepted[b]) + 1):
                    src = physical_row(layer.shape, block_table, b, L + int(accepted_nodes[b, i]))
                    dst = physical_row(layer.shape, block_table, b, L + i)
                    layer[dst] = layer[src].clone()
    cache_lens += (num_accepted + 1).to(cache_lens.dtype)


# ----------------------------------------------------------------------------------------------
# Acceptance
# ----------------------------------------------------------------------------------------------
def request_generator(seed: int, offset: int) -> torch.Generator:
    """The reference backend's random stream for one request: a function of (seed, offset) only."""
    return torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + int(offset)) % (2**63))


def children_of(parents_row: list[int], n: int) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parents_row[i]].append(i)
    return kids


# ----------------------------------------------------------------------------------------------
# The processed law, step by step (the steps in order: the docstring of specdec.sampling)
# ----------------------------------------------------------------------------------------------
# A temperature below this is greedy, on every backend (vLLM's _SAMPLING_EPS, 1e-5): 1 / t stays <= 1e5, so no
# backend's scaling of a row overflows or rounds the law away, and greedy's argmax of the masked row keeps the
# grammar. 1e-5 as a float32, as temperatures reach the backends: the Triton and C++ comparisons are in float32.
GREEDY_BELOW = float(torch.tensor(1e-5, dtype=torch.float32))


class NodePenalties(NamedTuple):
    """Step 0's inputs at one node of one request (`node_penalties`); None / neutral values are off.
    counts (V,) int64: the request's output counts plus the node's path tokens; in_prompt (V,) bool;
    repetition, frequency, presence: the request's penalties; bias: [(token, value)] in the order given;
    stop (V,) bool: the stop tokens, masked at this node (min_tokens not reached yet), or None."""
    counts: Optional[torch.Tensor] = None
    in_prompt: Optional[torch.Tensor] = None
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    bias: tuple = ()
    stop: Optional[torch.Tensor] = None


def penalized_row(row: torch.Tensor, pen: NodePenalties) -> torch.Tensor:
    """Step 0 (before the mask), in the order and arithmetic of vLLM's model runner (its logits processors in list
    order: the logit bias, each entry's value added in the order given, and min-tokens' stop tokens at -inf; then
    the penalties: repetition on the tokens in the prompt or the output so far, x * (1 / r) above 0 and x * r
    otherwise, frequency x -= f * count, presence x -= p * [count > 0]). The bias comes first: a repetition
    penalty scales the biased logit. Each step is one rounded operation in float32 for 16- and 32-bit rows
    (vLLM's dtype: every backend gets the same bits) and in float64 for float64 rows, with the product f * count
    clamped to the dtype's range and the result `saturated`: a finite logit stays finite where the arithmetic
    overflowed, -inf stays -inf. -> float64 (V,)."""
    dtype = torch.float64 if row.dtype == torch.float64 else torch.float32
    top = torch.finfo(dtype).max
    given = row.to("cpu", dtype)
    x = given.clone()  # (the bias writes into it)
    for token, value in pen.bias:
        x[token] = x[token] + torch.tensor(value, dtype=dtype)
    if pen.counts is not None:
        present = pen.counts > 0
        if pen.repetition != 1.0:
            rep = torch.tensor(pen.repetition, dtype=dtype)
            seen = present if pen.in_prompt is None else present | pen.in_prompt
            x = torch.where(seen, x * torch.where(x > 0, 1.0 / rep, rep), x)
        if pen.frequency != 0.0:
            x = x - (torch.tensor(pen.frequency, dtype=dtype) * pen.counts.to(dtype)).clamp(-top, top)
        if pen.presence != 0.0:
            x = x - torch.tensor(pen.presence, dtype=dtype) * present.to(dtype)
    x = saturated(given, x)
    if pen.stop is not None:  # (after the penalties, which keep a -inf as it is: the same as vLLM's order)
        x = x.masked_fill(pen.stop, -math.inf)
    return x.double()


def saturated(given: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Step 0's result x of logits `given`, saturated: clamped to the dtype's finite range where the given logit was
    finite, so that an overflow (a huge logit biased or scaled past the range: +-inf) leaves the law defined (an
    infinite logit makes it NaN, and a kernel's sampling of a NaN law can land on a token the grammar forbids);
    -inf (an impossible token) stays -inf. x itself wherever nothing overflowed: vLLM's arithmetic is unchanged.
    (No NaN reaches it: the products f * count are clamped before they are subtracted, so inf - inf never
    happens.)"""
    top = torch.finfo(x.dtype).max
    return torch.where(given > -math.inf, x.clamp(-top, top), x)


def path_tokens(parents_row: list[int], tokens_row: list[int], i: int) -> list[int]:
    """The draft tokens on the path from the root to node i, node 0's excluded (it is already in the output)."""
    found = []
    while i > 0:
        found.append(tokens_row[i])
        i = parents_row[i]
    return found[::-1]


def node_penalties(b: int, path: list[int], V: int, repetition_penalty=None, frequency_penalty=None,
                   presence_penalty=None, output_token_counts=None, prompt_token_mask=None, logit_bias_ids=None,
                   logit_bias_values=None, min_tokens=None, stop_token_ids=None) -> NodePenalties:
    """Request b's step-0 inputs at a node whose path (its draft tokens, node 0's excluded) is `path`: the counts
    see the output so far plus the path, and the node has generated sum(output counts) + len(path) tokens."""
    counts = None
    if output_token_counts is not None:
        counts = output_token_counts[b].cpu().long().clone()
        for x in path:
            counts[x] += 1
    in_prompt = None if prompt_token_mask is None else unpack_bits(prompt_token_mask[b].cpu(), V)
    bias = ()
    if logit_bias_ids is not None:
        bias = tuple((int(x), float(v)) for x, v in zip(logit_bias_ids[b].tolist(), logit_bias_values[b].tolist())
                     if x >= 0)
    stop = None
    if min_tokens is not None and int(output_token_counts[b].sum()) + len(path) < int(min_tokens[b]):
        stop = torch.zeros(V, dtype=torch.bool)
        stop[[x for x in stop_token_ids[b].tolist() if x >= 0]] = True
    return NodePenalties(counts, in_prompt, 1.0 if repetition_penalty is None else float(repetition_penalty[b]),
                         0.0 if frequency_penalty is None else float(frequency_penalty[b]),
                         0.0 if presence_penalty is None else float(presence_penalty[b]), bias, stop)


def mask_disallowed(logits_row: torch.Tensor, allowed) -> torch.Tensor:
    """Step 1: the row in float64, disallowed tokens (allowed[x] False) at -inf. allowed None: all allowed."""
    row = logits_row.double().cpu()
    return row if allowed is None else row.masked_fill(~allowed.cpu(), -math.inf)


def apply_temperature(row: torch.Tensor, t: float) -> torch.Tensor:
    """Step 2: l = logits / t (t >= GREEDY_BELOW), computed as (logits - M) / t with M the row's largest finite
    logit: the same law (every later step depends on differences of l only), and no overflow for huge finite
    logits (a difference that overflows is -inf, weight 0, which is exact)."""
    finite = row[torch.isfinite(row)]
    return (row - finite.max()) / t if finite.numel() else row / t


def softmax_over(l: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax of l over the kept tokens (0 elsewhere); all zeros when nothing is kept."""
    if not bool(keep.any()):
        return torch.zeros_like(l)
    return torch.softmax(l.masked_fill(~keep, -math.inf), 0)


def top_k_keep(l: torch.Tensor, keep: torch.Tensor, k: int) -> torch.Tensor:
    """Step 3: a kept x stays iff fewer than k kept tokens have a strictly larger l (so every tie at the k-th
    value stays). k <= 0 or k >= V: off."""
    if k <= 0 or k >= l.numel():
        return keep
    ascending = torch.sort(l[keep]).values
    larger = ascending.numel() - torch.searchsorted(ascending, l, right=True)  # kept tokens with a larger l
    return keep & (larger < k)


def top_p_keep(l: torch.Tensor, keep: torch.Tensor, top_p: float) -> torch.Tensor:
    """Step 4: with p the softmax of the kept tokens, a kept x stays iff the mass of the tokens with a
    strictly larger p is < top_p (p is increasing in l, so "larger p" is "larger l", and tokens of equal l
    share one p: ties stay or go together). The top token always stays (the mass above it is 0). top_p >= 1:
    off."""
    if top_p >= 1.0 or not bool(keep.any()):
        return keep
    p = softmax_over(l, keep)
    ascending, order = torch.sort(l[keep])
    mass = p[keep][order]
    # above[j] = mass of the kept tokens sorted after position j - 1 (summed from the largest down)
    above = torch.cat([mass.flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=mass.dtype)])
    larger_mass = above[torch.searchsorted(ascending, l, right=True)]  # mass of kept tokens with l > l(x)
    return keep & ((larger_mass < top_p) | (l == l[keep].max()))


def min_p_keep(l: torch.Tensor, keep: torch.Tensor, min_p: float) -> torch.Tensor:
    """Step 5: with p the softmax of the kept tokens, a kept x stays iff p(x) >= min_p * max p (the top token
    always stays). min_p <= 0: off."""
    if min_p <= 0.0 or not bool(keep.any()):
        return keep
    p = softmax_over(l, keep)
    return keep & (p >= min_p * p.max())


FILTER_ORDERS = ("hf", "vllm", "sglang")


def processed_keep(logits_row: torch.Tensor, t: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   allowed=None, filter_order: str = "hf") -> torch.Tensor:
    """(V,) bool: the tokens the processed law keeps (steps 1-5; t >= GREEDY_BELOW). Only finite l is ever kept.

    filter_order names whose steps 3-5 these are. min-p's set depends on the max only (kept by every filter), so
    it is the same wherever it runs; the orders differ in the set top-p normalizes its softmax over:
      "hf"     (Hugging Face's warpers, accept's default): top-k, top-p over the top-k set, min-p;
      "vllm"   (vLLM's sampler applies min-p first): min-p, top-k, top-p over the min-p and top-k set;
      "sglang" (SGLang's joint top-k / top-p): top-p over every finite l (not renormalized after top-k),
               intersected with top-k, then min-p."""
    l = apply_temperature(mask_disallowed(logits_row, allowed), t)
    keep = l > -math.inf
    k, p_top, p_min = int(top_k), float(top_p), float(min_p)
    if filter_order == "vllm":
        return top_p_keep(l, top_k_keep(l, min_p_keep(l, keep, p_min), k), p_top)
    if filter_order == "sglang":
        return min_p_keep(l, top_k_keep(l, keep, k) & top_p_keep(l, keep, p_top), p_min)
    return min_p_keep(l, top_p_keep(l, top_k_keep(l, keep, k), p_top), p_min)


def processed_probs(logits_row: torch.Tensor, t: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    allowed=None, filter_order: str = "hf") -> torch.Tensor:
    """(V,) float64: the processed law of one row at temperature t >= GREEDY_BELOW, step 6: the softmax of
    l = logits / t renormalized over the kept tokens (processed_keep). All zeros when the mask leaves no finite
    logit. With every parameter off this is softmax(logits / t)."""
    l = apply_temperature(mask_disallowed(logits_row, allowed), t)
    return softmax_over(l, processed_keep(logits_row, t, top_k, top_p, min_p, allowed, filter_order))


def greedy_token(logits_row: torch.Tensor, allowed=None):
    """The argmax of the masked row (first index on ties), or None when the mask leaves no finite logit.
    Top-k, top-p and min-p never remove the argmax, so greedy needs only the mask."""
    row = mask_disallowed(logits_row, allowed)
    best = int(torch.argmax(row))
    return best if row[best] > -math.inf else None


def request_filters(b: int, top_k=None, top_p=None, min_p=None) -> tuple[int, float, float]:
    """Request b's (top_k, top_p, min_p), the "off" value for an absent parameter."""
    return (0 if top_k is None else int(top_k[b]), 1.0 if top_p is None else float(top_p[b]),
            0.0 if min_p is None else float(min_p[b]))


# ----------------------------------------------------------------------------------------------
# Block verification of a chain (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification
# Accelerates Speculative Decoding", arXiv 2403.10444, Algorithm 2)
# ----------------------------------------------------------------------------------------------
def block_weights(p_rows, q_rows, drafted: list[int]) -> tuple[list[float], list[float]]:
    """The weights of block verification along a chain of gamma = len(drafted) draft tokens X_1..X_gamma:
    p_rows[i], q_rows[i] are the target's and the drafter's laws after X^i (i = 0..gamma; q_rows[gamma] is
    unused). Returns (p_0..p_gamma, h_1..h_gamma): X^i is accepted as the block's prefix iff i is the last
    index with eta_i < h_i (eta_i i.i.d. uniform; none: i = 0)."""
    gamma = len(drafted)
    weights, h = [1.0], []  # step 2: p_0 = 1
    for i in range(1, gamma + 1):
        x, p_prev = drafted[i - 1], weights[-1]
        # step 4: p_i = min(p_{i-1} Mb(X_i | X^{i-1}) / Ms(X_i | X^{i-1}), 1) (0 once it is 0; a token the
        # drafter could not draw but the target can: ratio +inf)
        big, small = float(p_rows[i - 1][x]), float(q_rows[i - 1][x])
        ratio = big / small if small > 0 else (math.inf if big > 0 else 0.0)
        weights.append(0.0 if p_prev == 0.0 else min(p_prev * ratio, 1.0))
        if i < gamma:
            # step 5: h_i = sum_x max(p_i Mb(x | X^i) - Ms(x | X^i), 0) / (that sum + 1 - p_i)
            s = float(torch.clamp(weights[i] * p_rows[i] - q_rows[i], min=0.0).sum())
            h.append(s / (s + 1.0 - weights[i]) if s + 1.0 - weights[i] > 0 else 1.0)
        else:
            h.append(weights[i])  # step 5, i = gamma: h_gamma = p_gamma
    return weights, h


def block_residual(p_row, q_row, weight: float) -> torch.Tensor:
    """Step 9: the law of the next token after accepting X^tau, tau < gamma, unnormalized:
    max(p_tau Mb(. | X^tau) - Ms(. | X^tau), 0). (tau = gamma: Mb(. | X^gamma) itself.)"""
    return torch.clamp(weight * p_row - q_row, min=0.0)


def _block_verify(P, Q, drafted, gen, fallback):
    """One request's block verification (Algorithm 2) with its random stream: (tau, next token)."""
    weights, h = block_weights(P, Q, drafted)
    gamma = len(drafted)
    eta = [float(torch.rand((), dtype=torch.float64, generator=gen)) for _ in range(gamma)]  # step 1
    tau = max([i for i in range(1, gamma + 1) if eta[i - 1] < h[i - 1]], default=0)  # steps 3-8
    r = P[tau] if tau == gamma else block_residual(P[tau], Q[tau], weights[tau])
    if bool(r.sum() > 0):
        return tau, int(torch.multinomial(r, 1, generator=gen))
    return tau, fallback(tau)  # an empty row, or a residual of probability 0 (by rounding)


# ----------------------------------------------------------------------------------------------
# Traversal verification of a tree (Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi, "Traversal Verification for
# Speculative Tree Decoding", arXiv 2505.12398): leaf-to-root, in post-order, with sequence-level weights.
# Written here for children drawn i.i.d. from q (the paper's full text was not at hand); exact losslessness
# is proven by enumeration in tests/ops/accept/test_traversal.py. On a chain it is block verification.
# ----------------------------------------------------------------------------------------------
def traversal_child_weight(w: float, law: torch.Tensor, q_row: torch.Tensor, x: int) -> float:
    """The weight of child x of a node of weight w whose current law is `law` (P at first, a residual after a
    rejected child): min(w law(x) / q(x), 1); 0 when law(x) = 0, 1 when q(x) = 0 < law(x)."""
    big, small = float(law[x]), float(q_row[x])
    if w == 0.0 or big == 0.0:
        return 0.0
    return 1.0 if small == 0.0 else min(w * big / small, 1.0)


def traversal_residual(w: float, law: torch.Tensor, q_row: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A node after one child's whole subtree was rejected: (its new law, its new weight). With r = max(w law -
    q, 0) and S = sum r: law' = r / S and w' = S / (S + 1 - w) (the conditional chance of still emitting from
    this node, given that the child failed: that has probability 1 - w + S). S + 1 - w = 0 (law = q, w = 1)
    makes the failure impossible: w' = 1 then. S = 0: law' is all zeros."""
    r = torch.clamp(w * law - q_row, min=0.0)
    s = float(r.sum())
    return (r / s if s > 0 else r), (s / (s + 1.0 - w) if s + 1.0 - w > 0 else 1.0)


def _traversal_verify(P, Q, tokens, kids, gen, fallback):
    """One request's traversal verification with its random stream: (accepted path, next token).

    visit(v, w) walks v's subtree in post-order (children in node order) and emits the continuation y after
    v's path with probability w * P(y | v's path), or fails with probability 1 - w: that is what makes the root
    (w = 1) lossless. Step by step:
      1. a node of weight 0 fails at once (nothing below it can be emitted; none of its rows is read);
      2. each child c, in node order, is visited with weight traversal_child_weight(w, law, Q[v], x_c); its
         subtree either emits (done) or fails, and then the node's law and weight become traversal_residual's;
      3. after the last child, the node emits with probability w (one uniform u < w; the root's w is 1): the
         next token is drawn from its current law (P at a leaf); else the node fails to its parent.
    """
    def visit(v, w, path):
        if w == 0.0:  # step 1
            return None
        law = P[v]
        for c in kids[v]:  # step 2
            found = visit(c, traversal_child_weight(w, law, Q[v], int(tokens[c])), path + [c])
            if found is not None:
                return found
            law, w = traversal_residual(w, law, Q[v])
            if w == 0.0:
                return None
        if float(torch.rand((), dtype=torch.float64, generator=gen)) >= w:  # step 3
            return None
        token = int(torch.multinomial(law, 1, generator=gen)) if bool(law.sum() > 0) else fallback(v)
        return path, token

    return visit(0, 1.0, [0])


def accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None,
           top_k=None, top_p=None, min_p=None, token_bitmask=None, method="token", probs=False, row_offsets=None,
           repetition_penalty=None, frequency_penalty=None, presence_penalty=None, output_token_counts=None,
           prompt_token_mask=None, logit_bias_ids=None, logit_bias_values=None, min_tokens=None,
           stop_token_ids=None, filter_order="hf", return_logprobs=-1, logprobs_mode="raw"):
    """Walk each request's tree from the root and return (accepted_nodes, num_accepted, next_tokens, logprobs,
    top_logprobs, top_token_ids, token_ranks).

    row_offsets (B,) (the packed form): target_logits, draft_logits (N, V) and token_bitmask (N, W) are packed
    rows, node i of request b being row row_offsets[b] + i; they are unpacked to (B, T, ...) first.

    probs=True: target_logits and draft_logits hold probabilities (unnormalized, zeros impossible), which mean
    what the logits log(probs) mean: everything below runs on those logs.

    At node i, the target's law p and (with draft logits) the drafter's law q are the processed laws of
    rows target_logits[b, i] and draft_logits[b, i]: step 0 (`penalized_row` with `node_penalties`: the
    penalties, logit bias and min-tokens of request b after node i's path; each argument None = off for every
    request), then processed_probs (node i's row of token_bitmask, temperature, top_k[b], top_p[b], min_p[b] in
    `filter_order`; None = off for every request). Greedy requests take the argmax of the row after step 0 and
    the mask.
    Greedy (temperature < GREEDY_BELOW, 0 included): descend into the first child (node order) whose token is the
    argmax of the masked target row. Sampling: at each node the residual r starts as p; children are tried in node
    order. With draft logits (children drawn i.i.d. from q), child x is accepted iff u * q(x) < r(x), else
    r <- max(r - q, 0). Without draft logits (given proposals), x is accepted iff u < r(x) / sum(r), else
    r(x) <- 0. The next token is drawn from r (normalized).
    A node whose masked target row has no finite logit (bad input, rejected by the value checks) accepts no
    child and emits token 0.
    method="block" (sampling requests; chains with draft logits): block verification (`block_weights`,
    Algorithm 2 of Sun et al.) decides the chain jointly: the accepted prefix X^tau and the next token from
    `block_residual`; the uniforms eta_1..eta_gamma come first in the stream, then the draw. (A non-chain tree
    is rejected by the validation; unchecked, the nodes are read as the chain 0, 1, ..., num_nodes - 1.)
    method="traversal" (sampling requests; any tree with draft logits): traversal verification
    (`_traversal_verify`): the subtrees are visited in post-order, one uniform per node that decides, then the
    draw. Greedy requests are unaffected by the method.
    Request b's random stream: request_generator(seeds[b], offset + offsets[b]) (offsets None: 0).
    return_logprobs >= 0: logprobs[b, j] is the log-law of emitted token j (the accepted drafts, then the next
    token) at its parent row, and top_logprobs / top_token_ids hold the return_logprobs largest entries of that
    log-law (`log_law`), and token_ranks[b, j] the emitted token's rank in it, the number of entries whose value is
    at least its own (1 for the most likely token; vLLM's selected_token_ranks), NaN / -1 after the emitted
    positions; -1: off, shapes (B, 0), (B, 0, 0), (B, 0, 0) and (B, 0).
    """
    if row_offsets is not None:
        target_logits, draft_logits, token_bitmask = padded_rows(row_offsets, tokens.shape[1], target_logits,
                                                                 draft_logits, token_bitmask)
    if probs:
        target_logits = target_logits.double().log()
        draft_logits = None if draft_logits is None else draft_logits.double().log()
    B, T, V = target_logits.shape
    accepted = torch.full((B, T), -1, dtype=torch.int32)
    num_acc = torch.zeros(B, dtype=torch.int32)
    next_tok = torch.zeros(B, dtype=torch.int64)
    N = max(return_logprobs, 0)
    logprobs = torch.full((B, T if return_logprobs >= 0 else 0), math.nan, dtype=torch.float32)
    top_shape = (B, T, N) if return_logprobs >= 0 else (B, 0, 0)
    top_logprobs = torch.full(top_shape, math.nan, dtype=torch.float32)
    top_ids = torch.full(top_shape, -1, dtype=torch.int64)
    ranks = torch.full(logprobs.shape, -1, dtype=torch.int64)
    allowed = None if token_bitmask is None else unpack_bits(token_bitmask.cpu(), V)  # (B, T, V)
    step0 = dict(repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                 presence_penalty=presence_penalty, output_token_counts=output_token_counts,
                 prompt_token_mask=prompt_token_mask, logit_bias_ids=logit_bias_ids,
                 logit_bias_values=logit_bias_values, min_tokens=min_tokens, stop_token_ids=stop_token_ids)
    penalized = any(x is not None for x in step0.values())
    for b in range(B):
        n = int(num_nodes[b])
        parents_row, tokens_row = parents[b].tolist(), tokens[b].tolist()
        kids = children_of(parents_row, n)
        t = float(temperature[b])
        k, p_top, p_min = request_filters(b, top_k, top_p, min_p)
        gen = request_generator(int(seeds[b]), offset + (0 if offsets is None else int(offsets[b])))

        def row(logits, i, b=b, parents_row=parents_row, tokens_row=tokens_row):
            """Node i's row after step 0 (float64), or as given when step 0 is off."""
            if not penalized:
                return logits[b, i]
            pen = node_penalties(b, path_tokens(parents_row, tokens_row, i), V, **step0)
            return penalized_row(logits[b, i], pen)

        def law(logits, i, mask, b=b, t=t, k=k, p_top=p_top, p_min=p_min):
            return processed_probs(row(logits, i), t, k, p_top, p_min, mask, filter_order)

        if method != "token" and t >= GREEDY_BELOW:
            rows = [None if allowed is None else allowed[b, i] for i in range(n)]
            P = [law(target_logits, i, rows[i]) for i in range(n)]
            Q = [law(draft_logits, i, rows[i]) for i in range(n)]
            fallback = lambda i: greedy_token(row(target_logits, i), rows[i]) or 0  # noqa: E731
            if method == "block":
                tau, token = _block_verify(P, Q, [int(tokens[b, i]) for i in range(1, n)], gen, fallback)
                path = list(range(tau + 1))
            else:
                path, token = _traversal_verify(P, Q, tokens_row, kids, gen, fallback)
        else:
            path, token = _tokenwise_verify(b, target_logits, draft_logits, tokens, kids, allowed, t, gen, row, law)
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_acc[b], next_tok[b] = len(path) - 1, token
        if return_logprobs < 0:
            continue
        emitted = [tokens_row[c] for c in path[1:]] + [token]
        for j, (r, e) in enumerate(zip(path, emitted)):
            mask = None if allowed is None else allowed[b, r]
            values, log_p = log_law(target_logits[b, r], row(target_logits, r), mask, t, k, p_top, p_min,
                                    filter_order, logprobs_mode)
            logprobs[b, j] = log_p[e]
            ranks[b, j] = int((values >= values[e]).sum())
            top = torch.sort(values, descending=True, stable=True).indices[:N]  # (ties: the lower id first)
            top_logprobs[b, j, : len(top)], top_ids[b, j, : len(top)] = log_p[top], top  # (N > V: padded)
    dev = target_logits.device
    return tuple(x.to(dev) for x in (accepted, num_acc, next_tok, logprobs, top_logprobs, top_ids, ranks))


def log_law(raw_row, penalized, allowed, t, top_k=0, top_p=1.0, min_p=0.0, filter_order="hf", mode="raw"):
    """(values, log-law), (V,) float64 each, of an emitted position whose parent row is raw_row (penalized: the same
    row after step 0). "raw": log_softmax of the row as given. "processed": the log of the law the token was
    sampled from, the processed law (temperature t >= GREEDY_BELOW); a greedy row's is log_softmax of the row
    after step 0 and the mask (temperature 1, no filter: vLLM's convention). values rank the tokens for the top
    logprobs: the row's own values (the dropped ones at -inf), so ranks never depend on a logprob's rounding."""
    if mode == "raw":
        values = raw_row.double().cpu()
        return values, torch.log_softmax(values, 0)
    values = mask_disallowed(penalized, allowed)
    if t < GREEDY_BELOW:
        return values, torch.log_softmax(values, 0)
    keep = processed_keep(penalized, t, top_k, top_p, min_p, allowed, filter_order)
    return values.masked_fill(~keep, -math.inf), processed_probs(penalized, t, top_k, top_p, min_p, allowed,
                                                                 filter_order).log()


def _tokenwise_verify(b, target_logits, draft_logits, tokens, kids, allowed, t, gen, row, law):
    """One request's token-wise walk (accept's docstring): (accepted path, next token). row(logits, i): node i's
    row after step 0; law(logits, i, mask): its processed law."""
    path, node = [0], 0
    while True:
        mask = None if allowed is None else allowed[b, node]
        chosen = None
        if t < GREEDY_BELOW:
            token = greedy_token(row(target_logits, node), mask)
            if token is None:  # nothing allowed: stop here
                token = 0
            else:
                chosen = next((c for c in kids[node] if int(tokens[b, c]) == token), None)
        else:
            r = law(target_logits, node, mask)
            q = None if draft_logits is None else law(draft_logits, node, mask)
            for c in (kids[node] if bool(r.sum() > 0) else []):  # an empty row accepts nothing
                x = int(tokens[b, c])
                u = float(torch.rand((), dtype=torch.float64, generator=gen))
                if q is not None:
                    if u * q[x] < r[x]:
                        chosen = c
                        break
                    r = torch.clamp(r - q, min=0.0)
                    if not bool(r.sum() > 0):  # r == q: a rejection of probability 0 (q never draws x)
                        break
                else:
                    if u * r.sum() < r[x]:
                        chosen = c
                        break
                    r[x] = 0.0
                r = r / r.sum()
            if chosen is None:
                if bool(r.sum() > 0):
                    token = int(torch.multinomial(r, 1, generator=gen))
                else:  # an empty row, or r == q above: the argmax of the masked row (0 if none)
                    token = greedy_token(row(target_logits, node), mask) or 0
        if chosen is None:
            return path, token
        path.append(chosen)
        node = chosen
