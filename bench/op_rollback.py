"""KV rollback in the benchmark: inputs, minimal bytes moved, and the PyTorch peers.

params: layers, B, Hkv, D, L committed prefix, T tree nodes whose K/V follow the prefix, P accepted path
nodes (root included: num_accepted = P - 1), path ("random": P nodes out of T, strictly increasing from 0;
"chain": 0..P-1, already in place), dtype, page (block size, 0 = contiguous), form ("stacked": one
(layers, ...) tensor for K and one for V; "list": one tensor per layer).

Minimal bytes: rows that really move (path[i] != i) x layers x Hkv x D x 2 (K and V) x 2 (read + write).
An accepted chain moves nothing. Every timed call first restores cache_lens (a B-element copy, in both the
op's and the peers' timings), since the op advances it.

Peers (what a user writes in PyTorch; the moves are computed once, with boolean-mask indexing, then):
  torch-index          per layer: layer[dst_rows] = layer[src_rows] (advanced-indexing gather/scatter)
  torch-index-stacked  the same over the whole stacked tensor at once (stacked form only)
"""
from __future__ import annotations

import torch

import specdec

from .common import DTYPES, cache_layout, physical_rows

OP = "rollback"


class Inputs:
    def __init__(self, p: dict, device: torch.device, gen: torch.Generator):
        layers, B, Hkv, D, L, T, P = (p[k] for k in ("layers", "B", "Hkv", "D", "L", "T", "P"))
        self.dtype = DTYPES[p["dtype"]]
        self.page, self.form = p.get("page", 0), p.get("form", "stacked")
        shape, self.block_table = cache_layout(B, L + T, Hkv, D, self.page, gen, device)
        if self.form == "stacked":
            self.k_caches = [torch.randn(layers, *shape, dtype=self.dtype, device=device)]
            self.v_caches = [torch.randn(layers, *shape, dtype=self.dtype, device=device)]
        else:
            self.k_caches = [torch.randn(shape, dtype=self.dtype, device=device) for _ in range(layers)]
            self.v_caches = [torch.randn(shape, dtype=self.dtype, device=device) for _ in range(layers)]
        self.layers, self.row_bytes = layers, Hkv * D * torch.finfo(self.dtype).bits // 8
        self.lens0 = torch.full((B,), L, dtype=torch.int32, device=device)
        self.cache_lens = self.lens0.clone()
        if p["path"] == "chain":
            path = torch.arange(P).expand(B, P)
        else:
            picks = torch.rand(B, T - 1, generator=gen).argsort(dim=1)[:, : P - 1] + 1
            path = torch.cat([torch.zeros(B, 1, dtype=torch.long), picks.sort(dim=1).values], dim=1)
        accepted = torch.full((B, T), -1, dtype=torch.int32)
        accepted[:, :P] = path.to(torch.int32)
        self.accepted_nodes = accepted.to(device)
        self.num_accepted = torch.full((B,), P - 1, dtype=torch.int32, device=device)
        # the tree rows (positions L .. L+T-1) of every cache, saved to restore them before each check
        positions = self.lens0.unsqueeze(1) + torch.arange(T, device=device)
        self.tree_rows = physical_rows(positions, self.block_table, self.page)
        self.snapshot = [self._region(c).clone() for c in self.k_caches + self.v_caches]

    def _region(self, cache):
        """(layers, B, T, Hkv, D) tree rows of a 4-D or 5-D cache."""
        blk, row = self.tree_rows
        return (cache if cache.dim() == 5 else cache.unsqueeze(0))[:, blk, row]

    def reset(self):
        for cache, saved in zip(self.k_caches + self.v_caches, self.snapshot):
            blk, row = self.tree_rows
            (cache if cache.dim() == 5 else cache.unsqueeze(0))[:, blk, row] = saved
        self.cache_lens.copy_(self.lens0)


def _caches(x: Inputs):
    return (x.k_caches[0], x.v_caches[0]) if x.form == "stacked" else (x.k_caches, x.v_caches)


def specdec_fn(x: Inputs, backend: str):
    k, v = _caches(x)
    plan = specdec.RollbackPlan(k, v, x.block_table, backend=backend)  # once, as an engine does

    def run():
        x.cache_lens.copy_(x.lens0)
        plan.run(x.cache_lens, x.accepted_nodes, x.num_accepted)
    return run


def torch_index_rollback(x: Inputs, stacked: bool):
    """The PyTorch way (see the module docstring)."""
    x.cache_lens.copy_(x.lens0)
    B, T = x.accepted_nodes.shape
    idx = torch.arange(T, device=x.cache_lens.device)
    on_path = idx.unsqueeze(0) <= x.num_accepted.unsqueeze(1)
    lens = x.cache_lens.long().unsqueeze(1)
    src_blk, src_row = physical_rows(lens + x.accepted_nodes.long().clamp(min=0), x.block_table, x.page)
    dst_blk, dst_row = physical_rows(lens + idx, x.block_table, x.page)
    src_blk, src_row, dst_blk, dst_row = (t[on_path] for t in (src_blk, src_row, dst_blk, dst_row))
    for cache in x.k_caches + x.v_caches:
        if stacked:
            cache[:, dst_blk, dst_row] = cache[:, src_blk, src_row]
        else:
            for layer in (cache if cache.dim() == 5 else cache.unsqueeze(0)):
                layer[dst_blk, dst_row] = layer[src_blk, src_row]
    x.cache_lens += x.num_accepted + 1


def peers(x: Inputs, case) -> dict:
    found = {"torch-index": lambda: (lambda: torch_index_rollback(x, stacked=False))}
    if x.form == "stacked":
        found["torch-index-stacked"] = lambda: (lambda: torch_index_rollback(x, stacked=True))
    return found


def moved_rows(x: Inputs) -> int:
    T = x.accepted_nodes.shape[1]
    idx = torch.arange(T, device=x.accepted_nodes.device)
    on_path = idx.unsqueeze(0) <= x.num_accepted.unsqueeze(1)
    return int((on_path & (x.accepted_nodes != idx)).sum())


def min_bytes(x: Inputs, out) -> int:
    return moved_rows(x) * x.layers * x.row_bytes * 2 * 2


def reference_value(x: Inputs):
    """The tree rows every cache must hold afterwards (from the snapshot), and the new cache_lens."""
    B, T = x.accepted_nodes.shape
    idx = torch.arange(T, device=x.accepted_nodes.device)
    on_path = idx.unsqueeze(0) <= x.num_accepted.unsqueeze(1)
    src = torch.where(on_path, x.accepted_nodes.long(), idx)  # rows off the path stay as they were
    rows_of = torch.arange(B, device=src.device).unsqueeze(1)
    return [s[:, rows_of, src] for s in x.snapshot], x.lens0 + x.num_accepted + 1


def check(x: Inputs, out, expected) -> str:
    regions, lens = expected
    same = all(torch.equal(x._region(c), e) for c, e in zip(x.k_caches + x.v_caches, regions))
    if not torch.equal(x.cache_lens, lens):
        return "MISMATCH (cache_lens)"
    return "ok (exact)" if same else "MISMATCH (cache rows)"


def summary(x: Inputs, out) -> dict:
    return {"moved_rows": moved_rows(x)}


def describe(p: dict) -> str:
    layout = f"paged{p['page']}" if p.get("page") else "contig"
    return (f"layers{p['layers']} B{p['B']} Hkv{p['Hkv']} D{p['D']} path{p['P']}/{p['T']} {p['path']} "
            f"{p['dtype']} {layout} {p.get('form', 'stacked')}")
