"""EAGLE-3 heads as a drafter (models/eagle3.py): the MTP drafter's machinery (`FeatureHeadDrafter`: the head's own
KV cache, the accepted path's entries recomputed from the target's hidden states, trees grown level by level,
adaptive depth), conditioned on the target's residual streams entering the head's aux layers (the loop asks the
target's forwards for them: `uses_target_hidden` is those layer ids), recycling the layer's own output past depth 1
as the EAGLE authors' drafting does. Its draft law is exact over the target's vocabulary: the draft vocabulary's
logits at their target ids (d2t), -inf elsewhere, so accept's q is what children are drawn from."""
from __future__ import annotations

from typing import Optional

import torch

from ..models.eagle3 import Eagle3
from ..models.llama import Llama
from .draft_model import TreeSpec
from .mtp import FeatureHeadDrafter


class Eagle3Drafter(FeatureHeadDrafter):
    def __init__(self, target: Llama, head: Eagle3, tree: TreeSpec | str = "chain:4", *,
                 kv_dtype: Optional[torch.dtype] = None):
        if head.cfg.vocab_size != target.cfg.vocab_size or head.target_dim != target.cfg.dim:
            raise ValueError(f"head: vocabulary {head.cfg.vocab_size} and target hidden size {head.target_dim}, the "
                             f"target's {target.cfg.vocab_size} and {target.cfg.dim}")
        target.hidden_layers(head.aux_layers)  # (a ValueError for layers the target does not have)
        super().__init__(target, head.cfg, head.dtype, tree, kv_dtype=kv_dtype)
        self.head = head
        self.uses_target_hidden = head.aux_layers

    def condition(self, target_hidden):
        return self.head.condition(target_hidden)

    def _layer(self, tokens, hidden, k_cache, v_cache, step):
        return self.head.midlayer.forward_cached(self.head.embed(self.model, tokens), hidden, k_cache, v_cache, step)

    def _step(self, depth, mask, num_nodes, start):
        return self.head.cached_step(self.cache, depth, mask, num_nodes, start)

    def head_logits(self, out):
        return self.head.logits(out)

    def recycled(self, out):
        return out
