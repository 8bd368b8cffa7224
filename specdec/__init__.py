"""specdec: fused kernels for speculative decoding (tree-attention verification, lossless acceptance,
KV-cache append and rollback), with PyTorch reference, Triton (GPU) and C++ (CPU) backends."""
from . import sampling  # the processed law of accept's filters, vectorized: for drafters and engines
from ._validation import set_value_checks, value_checks
from .ops import (AcceptResult, RollbackPlan, TreeInfo, accept, build_tree, kv_append, kv_rollback, tree_attention)
from . import distributed  # accept on vocab-sharded logits (tensor parallelism), over torch.distributed

__version__ = "0.1.0"

__all__ = ["AcceptResult", "RollbackPlan", "TreeInfo", "accept", "build_tree", "kv_append", "kv_rollback",
           "set_value_checks", "tree_attention", "value_checks"]
