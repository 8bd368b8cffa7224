"""Vectorized, sync-free tree construction (any device): the build_tree used on GPU tensors."""
from __future__ import annotations

import torch

from ._layout import pack_bits


def build_tree_vectorized(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as `reference.build_tree`, by pointer doubling: ceil(log2 T) gathers, no host sync.

    anc[i] starts as {i, parent(i)} and up[i] as parent(i); each round sets anc[i] |= anc[up[i]] and
    up[i] = up[up[i]], doubling the number of levels covered. Root and padding nodes point to themselves.
    """
    B, T = parents.shape
    dev = parents.device
    idx = torch.arange(T, device=dev).expand(B, T)
    real = (idx > 0) & (idx < num_nodes.to(dev).unsqueeze(1))
    up = torch.where(real, parents.long().clamp(min=0), idx)
    anc = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T).clone()
    anc.scatter_(2, up.unsqueeze(-1), True)
    covered = 1
    while covered < T:
        anc = anc | anc.gather(1, up.unsqueeze(-1).expand(B, T, T))
        up = up.gather(1, up)
        covered *= 2
    depth = (anc.sum(-1) - 1).to(torch.int32)
    words = (T + 31) // 32
    bits = torch.zeros(B, T, words * 32, dtype=torch.bool, device=dev)
    bits[..., :T] = anc
    return depth, pack_bits(bits)
