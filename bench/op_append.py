"""KV append in the benchmark: inputs, minimal bytes moved, and the PyTorch peer.

params: B, T new rows per request, Hkv, D, L committed prefix, dtype, page (block size, 0 = contiguous).
One layer, K and V.

Minimal bytes: B x T rows x Hkv x D x 2 (K and V) x 2 (read the new row, write the cache row).

Peer: index_put  the logical positions turned into (block, row) indices, then
                 k_cache.index_put_((blk, row), k_new) and the same for V.
"""
from __future__ import annotations

import torch

import specdec

from .common import DTYPES, cache_layout, physical_rows

OP = "append"


class Inputs:
    def __init__(self, p: dict, device: torch.device, gen: torch.Generator):
        B, T, Hkv, D, L = (p[k] for k in ("B", "T", "Hkv", "D", "L"))
        self.dtype = DTYPES[p["dtype"]]
        self.page = p.get("page", 0)
        shape, self.block_table = cache_layout(B, L + T, Hkv, D, self.page, gen, device)
        self.k_cache = torch.randn(shape, dtype=self.dtype, device=device)
        self.v_cache = torch.randn(shape, dtype=self.dtype, device=device)
        self.k_new = torch.randn(B, T, Hkv, D, dtype=self.dtype, device=device)
        self.v_new = torch.randn(B, T, Hkv, D, dtype=self.dtype, device=device)
        self.cache_lens = torch.full((B,), L, dtype=torch.int32, device=device)
        positions = self.cache_lens.unsqueeze(1) + torch.arange(T, device=device)
        self.new_rows = physical_rows(positions, self.block_table, self.page)

    def reset(self):
        """Poison the destination rows so that a row the op does not write shows in the check."""
        for cache in (self.k_cache, self.v_cache):
            cache[self.new_rows] = float("nan")


def specdec_fn(x: Inputs, backend: str):
    def run():
        specdec.kv_append(x.k_cache, x.v_cache, x.k_new, x.v_new, x.cache_lens, block_table=x.block_table,
                          backend=backend)
    return run


def torch_index_put(x: Inputs):
    """The PyTorch way: logical positions -> (block, row) -> index_put_."""
    T = x.k_new.shape[1]
    positions = x.cache_lens.long().unsqueeze(1) + torch.arange(T, device=x.k_new.device)
    where = physical_rows(positions, x.block_table, x.page)
    x.k_cache.index_put_(where, x.k_new)
    x.v_cache.index_put_(where, x.v_new)


def peers(x: Inputs, case) -> dict:
    return {"index_put": lambda: (lambda: torch_index_put(x))}


def min_bytes(x: Inputs, out) -> int:
    return 2 * 2 * x.k_new.numel() * x.k_new.element_size()


def reference_value(x: Inputs):
    return x.k_new, x.v_new


def check(x: Inputs, out, expected) -> str:
    same = torch.equal(x.k_cache[x.new_rows], expected[0]) and torch.equal(x.v_cache[x.new_rows], expected[1])
    return "ok (exact)" if same else "MISMATCH (cache rows)"


def summary(x: Inputs, out) -> dict:
    return {}


def describe(p: dict) -> str:
    layout = f"paged{p['page']}" if p.get("page") else "contig"
    return f"B{p['B']} T{p['T']} L{p['L']} Hkv{p['Hkv']} D{p['D']} {p['dtype']} {layout}"
