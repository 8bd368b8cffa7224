"""Tree attention in the benchmark: inputs, minimal bytes moved, and the PyTorch peers.

params: B requests, T tree nodes (random trees), Hq/Hkv heads, D head dim, L committed prefix (equal for
every request), dtype ("fp32"/"fp16"/"bf16"), page (block size of a paged cache, 0 = contiguous), kv
("fp8": a float8_e4m3fn cache with per-tensor scales, as vLLM's fp8 KV cache; default: q's dtype), window
(window_left of a sliding-window layer; default none).

Minimal bytes: the K and V rows of the prefix any node sees (min(L, window_left) positions with a window) and
of the tree read once in the cache's dtype, q read once, out written once, lse (float32) written once.

Peers, timed from the same inputs as the op:
  sdpa  what a user writes in plain PyTorch: gather the cache rows (dequantized to q's dtype for a float8
        cache), expand the KV heads to Hq (GQA), build the (B, Hq, T, L+T) bool mask from the packed tree
        mask, F.scaled_dot_product_attention.
  flex  FlexAttention (compiled; CUDA only) with a tree mask_mod reading the same packed mask, native GQA.
        Its block mask is built once outside the timed call, which favours it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import specdec
from specdec._layout import unpack_bits
from specdec.reference import quantize
from specdec.tree import build_tree_vectorized

from .common import DTYPES, cache_layout, close_check, random_parents

OP = "attention"
FP8_SCALES = (0.01, 0.02)  # k_scale, v_scale of a float8 cache: N(0, 1) values stored around +-100 and +-50


class Inputs:
    def __init__(self, p: dict, device: torch.device, gen: torch.Generator):
        B, T, Hq, Hkv, D, L = (p[k] for k in ("B", "T", "Hq", "Hkv", "D", "L"))
        self.dtype = DTYPES[p["dtype"]]
        self.L, self.page = L, p.get("page", 0)
        self.q = torch.randn(B, T, Hq, D, generator=gen).to(self.dtype).to(device)
        shape, self.block_table = cache_layout(B, L + T, Hkv, D, self.page, gen, device)
        self.k_cache = torch.randn(shape, dtype=self.dtype, device=device)
        self.v_cache = torch.randn(shape, dtype=self.dtype, device=device)
        self.k_scale = self.v_scale = None
        if p.get("kv") == "fp8":
            self.k_scale, self.v_scale = FP8_SCALES
            self.k_cache = quantize(self.k_cache, self.k_scale, torch.float8_e4m3fn)
            self.v_cache = quantize(self.v_cache, self.v_scale, torch.float8_e4m3fn)
        self.cache_lens = torch.full((B,), L, dtype=torch.int32, device=device)
        parents = random_parents(B, T, "tree", gen).to(device)
        self.num_nodes = torch.full((B,), T, dtype=torch.int32, device=device)
        self.depth, self.tree_mask = build_tree_vectorized(parents, self.num_nodes)
        self.window_left = p.get("window", -1)
        self.scale = D ** -0.5

    def reset(self):
        """Nothing to restore: the op is pure."""


def min_bytes(x: Inputs, out) -> int:
    B, T, Hq, D = x.q.shape
    Hkv = x.k_cache.shape[2]
    e = x.q.element_size()
    prefix = x.L if x.window_left < 0 else min(x.L, x.window_left)
    return 2 * B * (prefix + T) * Hkv * D * x.k_cache.element_size() + 2 * B * T * Hq * D * e + B * T * Hq * 4


def specdec_fn(x: Inputs, backend: str):
    def run():
        return specdec.tree_attention(x.q, x.k_cache, x.v_cache, x.cache_lens, x.tree_mask,
                                      block_table=x.block_table, num_nodes=x.num_nodes, scale=x.scale,
                                      k_scale=x.k_scale, v_scale=x.v_scale, window_left=x.window_left,
                                      return_lse=True, backend=backend)[0]
    return run


def _gathered(x: Inputs, cache: torch.Tensor, scale) -> torch.Tensor:
    """(B, L+T, Hkv, D): the logical rows of every request (a view for a contiguous cache), dequantized to
    q's dtype when the cache is float8 (scale not None)."""
    n = x.L + x.q.shape[1]
    if x.block_table is None:
        rows = cache[:, :n]
    else:
        blocks = -(-n // x.page)
        rows = cache[x.block_table[:, :blocks].long()].flatten(1, 2)[:, :n]
    return rows if scale is None else rows.to(x.q.dtype) * scale


def sdpa_tree_attention(x: Inputs, dtype=None) -> torch.Tensor:
    """The plain-PyTorch way (optionally in another dtype: the harness's float32 check value)."""
    B, T, Hq, D = x.q.shape
    group = Hq // x.k_cache.shape[2]
    q = x.q if dtype is None else x.q.to(dtype)
    keys, vals = _gathered(x, x.k_cache, x.k_scale), _gathered(x, x.v_cache, x.v_scale)
    if dtype is not None:
        keys, vals = keys.to(dtype), vals.to(dtype)
    keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # (B, Hq, L+T, D)
    vals = vals.repeat_interleave(group, dim=2).transpose(1, 2)
    tree = unpack_bits(x.tree_mask, T)  # (B, T, T) bool
    prefix = tree.new_ones(B, T, x.L)
    if x.window_left >= 0:  # node i at position L + depth_i sees positions >= L + depth_i - window_left
        prefix = torch.arange(x.L, device=q.device) >= (x.L + x.depth - x.window_left).unsqueeze(-1)
    allowed = torch.cat([prefix, tree], dim=-1).unsqueeze(1).expand(B, Hq, T, x.L + T)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=allowed, scale=x.scale)
    return out.transpose(1, 2)


_compiled_flex = None


def flex_tree_attention(x: Inputs):
    """A FlexAttention runner for x (its block mask built here, once, outside the timed call)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    B, T, Hq, D = x.q.shape
    n = x.L + T
    lens, packed, depth, window_left = x.cache_lens, x.tree_mask, x.depth, x.window_left

    def tree_mask_mod(b, h, q_idx, kv_idx):
        j = kv_idx - lens[b]  # tree position (negative: committed prefix)
        jc = j.clamp(0, T - 1)
        bit = (packed[b, q_idx, jc // 32] >> (jc % 32)) & 1
        prefix = j < 0
        if window_left >= 0:
            prefix = prefix & (kv_idx >= lens[b] + depth[b, q_idx] - window_left)
        return prefix | ((j < T) & (bit == 1))

    block_mask = create_block_mask(tree_mask_mod, B, None, T, n, device=x.q.device)

    def run():
        keys = _gathered(x, x.k_cache, x.k_scale).transpose(1, 2)
        vals = _gathered(x, x.v_cache, x.v_scale).transpose(1, 2)
        out = _compiled_flex(x.q.transpose(1, 2), keys, vals, block_mask=block_mask, scale=x.scale,
                             enable_gqa=True)
        return out.transpose(1, 2)
    return run


def peers(x: Inputs, case) -> dict:
    found = {"sdpa": lambda: (lambda: sdpa_tree_attention(x))}
    if case.flex:
        found["flex"] = lambda: flex_tree_attention(x)
    return found


def reference_value(x: Inputs):
    """The float32 SDPA result every implementation is checked against."""
    return sdpa_tree_attention(x, dtype=torch.float32)


def check(x: Inputs, out, expected) -> str:
    return close_check(out, expected, x.dtype)


def bytes_for_check(x: Inputs) -> int:
    """Device memory the float32 check value needs (the harness skips the check above a limit)."""
    B, T, Hq, D = x.q.shape
    return 2 * B * (x.L + T) * Hq * D * 4 * 2 + B * Hq * T * (x.L + T) * 5


def summary(x: Inputs, out) -> dict:
    return {}


def describe(p: dict) -> str:
    layout = f"paged{p['page']}" if p.get("page") else "contig"
    kv = f" kv-{p['kv']}" if p.get("kv") else ""
    window = f" win{p['window']}" if "window" in p else ""
    return f"B{p['B']} T{p['T']} L{_k(p['L'])}{window} Hq{p['Hq']}/Hkv{p['Hkv']} D{p['D']} {p['dtype']}{kv} {layout}"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

