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

import torch

from ._validation import FP8_DTYPES


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


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 32*W) bool -> (..., W) int32 where bit k of word w is element 32*w + k."""
    *lead, n = bits.shape
    words = bits.reshape(*lead, n // 32, 32).to(torch.int64)
    shifts = torch.arange(32, dtype=torch.int64, device=bits.device)
    packed = (words << shifts).sum(-1)  # value in [0, 2^32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as signed int32
    return packed.to(torch.int32)


def unpack_bits(mask: torch.Tensor, n: int) -> torch.Tensor:
    """(..., W) int32 -> (..., n) bool; inverse of `pack_bits` (truncated to n)."""
    shifts = torch.arange(32, dtype=torch.int64, device=mask.device)
    bits = (mask.to(torch.int64).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*mask.shape[:-1], -1)[..., :n].bool()


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
                   v_scale=1.0, window_left=-1, logits_soft_cap=0.0):
    """out (B, T, Hq, D) in q.dtype and lse (B, T, Hq) float32.

    Node i of request b attends to committed positions [0, L) (L = cache_lens[b]) and to tree position
    L + j for every j whose bit is set in tree_mask[b, i]. Keys are k_cache * k_scale, values
    v_cache * v_scale (scales other than 1 come with float8 caches). With window_left >= 0, node i (at
    position L + depth_i, depth_i = its set bits - 1) sees only committed positions >= L + depth_i -
    window_left. With logits_soft_cap c > 0 the scores are c * tanh(score / c). Padding nodes get out = 0,
    lse = -inf.
    """
    B, T, Hq, D = q.shape
    group = Hq // k_cache.shape[-2]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
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
        lse[b, :n] = torch.logsumexp(scores, -1).T
        out[b, :n] = torch.einsum("hip,phd->ihd", torch.softmax(scores, -1), vals)
    return out.to(q.dtype).to(q.device), lse.float().to(q.device)


def kv_append(k_cache, v_cache, k_new, v_new, cache_lens, block_table, k_scale=1.0, v_scale=1.0) -> None:
    """Write k_new[b, i], v_new[b, i] at logical position cache_lens[b] + i (in place), quantized for a
    float8 cache."""
    B, T = k_new.shape[:2]
    for b in range(B):
        L = int(cache_lens[b])
        for i in range(T):
            where = physical_row(k_cache.shape, block_table, b, L + i)
            k_cache[where] = quantize(k_new[b, i], k_scale, k_cache.dtype)
            v_cache[where] = quantize(v_new[b, i], v_scale, v_cache.dtype)


def kv_rollback(k_caches, v_caches, cache_lens, accepted_nodes, num_accepted, block_table) -> None:
    """Compact the accepted path of every layer in place, then advance cache_lens.

    `k_caches`/`v_caches` are lists of tensors, each one layer (4-D) or a stack of layers (5-D).
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


def accept(target_logits, tokens, parents, draft_logits, temperature, seeds, num_nodes, offset, offsets=None):
    """Walk each request's tree from the root and return (accepted_nodes, num_accepted, next_tokens).

    Greedy (temperature 0): descend into the first child (node order) whose token is the target argmax.
    Sampling: p = softmax(target / t). At each node the residual r starts as p; children are tried in
    node order. With draft logits (children drawn i.i.d. from q = softmax(draft / t)), child x is
    accepted iff u * q(x) < r(x), else r <- max(r - q, 0). Without draft logits (given proposals),
    x is accepted iff u < r(x) / sum(r), else r(x) <- 0. The next token is drawn from r (normalized).
    Request b's random stream: request_generator(seeds[b], offset + offsets[b]) (offsets None: 0).
    """
    B, T, V = target_logits.shape
    accepted = torch.full((B, T), -1, dtype=torch.int32)
    num_acc = torch.zeros(B, dtype=torch.int32)
    next_tok = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        n = int(num_nodes[b])
        kids = children_of(parents[b].tolist(), n)
        t = float(temperature[b])
        gen = request_generator(int(seeds[b]), offset + (0 if offsets is None else int(offsets[b])))
        path, node = [0], 0
        while True:
            logits = target_logits[b, node].double().cpu()
            chosen = None
            if t == 0.0:
                best = int(torch.argmax(logits))
                chosen = next((c for c in kids[node] if int(tokens[b, c]) == best), None)
                token = best
            else:
                r = torch.softmax(logits / t, 0)
                q = None if draft_logits is None else torch.softmax(draft_logits[b, node].double().cpu() / t, 0)
                for c in kids[node]:
                    x = int(tokens[b, c])
                    u = float(torch.rand((), dtype=torch.float64, generator=gen))
                    if q is not None:
                        if u * q[x] < r[x]:
                            chosen = c
                            break
                        r = torch.clamp(r - q, min=0.0)
                    else:
                        if u * r.sum() < r[x]:
                            chosen = c
                            break
                        r[x] = 0.0
                    r = r / r.sum()
                if chosen is None:
                    token = int(torch.multinomial(r, 1, generator=gen))
            if chosen is None:
                next_tok[b] = token
                break
            path.append(chosen)
            node = chosen
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_acc[b] = len(path) - 1
    dev = target_logits.device
    return accepted.to(dev), num_acc.to(dev), next_tok.to(dev)
