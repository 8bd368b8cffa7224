"""Triton kernels, installed as `specdec.kernels` (never as a top-level `kernels` module).

One op per file or package: tree_attention.py, kv_cache.py, accept/ (one verifier per module; its reading order
in accept/__init__.py, its design in docs/accept-kernel.md). Each exposes a launcher taking the normalized
arguments of the matching `torch.ops.specdec` schema (see specdec/ops.py).
"""
