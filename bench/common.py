"""What every op's benchmark shares: cases and targets, random trees, cache layouts, output checks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# Tolerances of the harness's sanity check (every timed implementation must compute the op; the real
# correctness tests live in tests/). Results in a low precision dtype are compared with a float32 peer.
CHECK_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    """A performance target: `impl` reaches `threshold` percent of the copy ceiling (vs == "copy") or
    runs `threshold` times faster than peer `vs` on the same case."""
    impl: str
    vs: str
    threshold: float
    source: str  # what kind of target it is ("CPU floor: C++ vs PyTorch", "H200 floor", a goal)


@dataclass
class Case:
    """One shape of one op. `params` feed the op module's Inputs (and name the case through its
    `describe`); `toy` cases also run the (slow) reference backend and the Triton interpreter smoke run."""
    op: str
    params: dict
    toy: bool = False
    flex: bool = False  # also time FlexAttention (GPU; compiling it costs tens of seconds per shape)
    targets: tuple = field(default_factory=tuple)


def random_parents(B: int, T: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """(B, T) int32 parents: 'chain' (node i's parent is i - 1) or 'tree' (uniform random attachment:
    node i's parent uniform in [0, i), the shape of sampled draft trees)."""
    idx = torch.arange(T)
    if kind == "chain":
        parents = (idx - 1).expand(B, T)
    else:
        parents = (torch.rand(B, T, generator=gen) * idx).long()
        parents[:, 0] = -1
    return parents.to(torch.int32).contiguous()


def block_table(B: int, blocks_per_request: int, gen: torch.Generator, spare: int = 2):
    """A shuffled (B, blocks_per_request) int32 block table over B * blocks_per_request + spare blocks."""
    num_blocks = B * blocks_per_request + spare
    table = torch.randperm(num_blocks, generator=gen)[: B * blocks_per_request]
    return table.view(B, blocks_per_request).to(torch.int32), num_blocks


def cache_layout(B: int, capacity: int, Hkv: int, D: int, page: int, gen: torch.Generator, device):
    """One layer's cache shape for `capacity` positions per request, and its shuffled block table
    (None for a contiguous cache, page == 0)."""
    if not page:
        return (B, capacity, Hkv, D), None
    table, num_blocks = block_table(B, -(-capacity // page), gen)
    return (num_blocks, page, Hkv, D), table.to(device)


def physical_rows(positions: torch.Tensor, table: Optional[torch.Tensor], block_size: int):
    """(block-or-request index, row) of logical `positions` (B, n) -> two (B, n) int64 tensors."""
    positions = positions.long()
    if table is None:
        rows_of = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        return rows_of.expand_as(positions), positions
    return table.long().gather(1, positions // block_size), positions % block_size


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max()) if actual.numel() else 0.0


def close_check(actual: torch.Tensor, expected: torch.Tensor, dtype) -> str:
    """'ok (err ...)' when |actual - expected| <= tol * (1 + |expected|) everywhere, else 'MISMATCH ...'."""
    tol = CHECK_TOL[dtype]
    diff = (actual.float() - expected.float()).abs()
    bad = diff > tol * (1 + expected.float().abs())
    err = float(diff.max()) if diff.numel() else 0.0
    if bool(torch.isnan(actual.float()).any()):
        return "MISMATCH (NaN in output)"
    return f"ok (max err {err:.1e})" if not bool(bad.any()) else f"MISMATCH (max err {err:.1e}, tol {tol:g})"
