"""Data layouts the ops share: packed bit masks, packed (ragged) rows, the float8 cache formats.

A leaf module (it imports torch only): validation, the reference, the vectorized sampling and the kernels'
launchers all read these layouts, so none of them has to import another to convert one.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # KV caches only, dequantized with a per-tensor scale


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
    return bits.reshape(*mask.shape[:-1], 32 * mask.shape[-1])[..., :n].bool()  # (no -1: a batch may be empty)


def unpack_bitmask(bitmask: torch.Tensor, V: int) -> torch.Tensor:
    """(..., W) int32 -> (..., V) bool: bit v % 32 of word v // 32 is token v (xgrammar / vLLM layout, the one
    of build_tree's ancestor masks)."""
    return unpack_bits(bitmask, V)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """(..., V) bool -> (..., ceil(V / 32)) int32, the inverse of `unpack_bitmask` (bits past V are 0)."""
    V = allowed.shape[-1]
    return pack_bits(torch.nn.functional.pad(allowed, (0, -V % 32)))


def packed_row_index(row_offsets: torch.Tensor, max_nodes: int, num_rows: int) -> torch.Tensor:
    """(B, max_nodes) int64: the packed row of node i of request b, row_offsets[b] + i, clamped into
    [0, num_rows) so that a padding node (i >= num_nodes[b]) indexes some row; what it reads there is unused."""
    i = torch.arange(max_nodes, device=row_offsets.device)
    return (row_offsets.long().unsqueeze(1) + i).clamp(0, max(num_rows - 1, 0))


def padded_rows(row_offsets: torch.Tensor, max_nodes: int, *packed):
    """Packed (N, ...) tensors (None passes through), one row per node, node i of request b at row
    row_offsets[b] + i -> the padded (B, max_nodes, ...) copies (a padding node's row is some row's, unused)."""
    rows = packed_row_index(row_offsets, max_nodes, next(x for x in packed if x is not None).shape[0])
    return tuple(None if x is None else x[rows] for x in packed)
