"""Triton kernels, installed as `specdec.kernels` (never as a top-level `kernels` module).

One op per file: tree_attention.py, accept.py, kv_cache.py. Each exposes a launcher taking the
normalized arguments of the matching `torch.ops.specdec` schema (see specdec/ops.py).
"""
