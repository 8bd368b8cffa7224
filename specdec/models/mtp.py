"""DeepSeek-V3-style multi-token-prediction (MTP) modules on specdec's ops.

Module k takes the hidden state h of position j (post final norm: the target's `model.norm(h_target)` for
the first module, as vLLM and SGLang feed DeepSeek-V3's MTP layer; the previous module's `norm(out)` when
recycled) and the embedding of token x_{j+k}, and predicts x_{j+k+1}:

    x = eh_proj(cat([enorm(Emb(t)), hnorm(h)]))      # embedding first, as the public checkpoints do
    out = one decoder layer over x                    # its own KV cache (kv_append / tree_attention)
    logits = lm_head(norm(out))                       # the target's embedding and LM head, shared

Parameter names follow DeepSeek-V3's `model.layers.{n}.*` (enorm, hnorm, eh_proj, shared_head.norm, and
the decoder layer's own names), with our fused q/k/v and gate/up projections.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import CachedStep, DecoderLayer, Llama, LlamaConfig, RMSNorm


class SharedHead(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class MTPLayer(nn.Module):
    """One MTP module: the fusion of (token embedding, hidden state), one decoder layer, a final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = DecoderLayer(cfg, 0)
        self.shared_head = SharedHead(cfg)

    def fuse(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embedded, hidden (B, T, dim) -> the decoder layer's input (B, T, dim)."""
        return self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))

    def forward(self, embedded, hidden, cos, sin):
        """Causal over whole sequences (training / ground truth); returns the layer's output (B, T, dim)."""
        return self.block(self.fuse(embedded, hidden), cos, sin)

    def forward_cached(self, embedded, hidden, k_cache, v_cache, step: CachedStep):
        return self.block.forward_cached(self.fuse(embedded, hidden), k_cache, v_cache, step)


class MTP(nn.Module):
    """`num_modules` MTP layers for a target whose config is `cfg`; the embedding and LM head are the
    target's, passed to each call (not parameters of this module)."""

    def __init__(self, cfg: LlamaConfig, num_modules: int = 1):
        super().__init__()
        self.cfg, self.num_modules = cfg, num_modules
        self.layers = nn.ModuleList(MTPLayer(cfg) for _ in range(num_modules))

    def logits(self, target: Llama, k: int, out: torch.Tensor) -> torch.Tensor:
        """Module k's output (..., dim) -> its logits (..., V) through the target's LM head."""
        weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        return F.linear(self.layers[k].shared_head.norm(out), weight)

    def forward(self, target: Llama, target_hidden: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """DeepSeek-V3's training forward over whole sequences tokens (B, T) with the target's hidden states
        target_hidden (B, T, dim) (before its final norm): module k (0-based) at position j sees
        tokens[j + k + 1] and returns the logits (B, T - k - 1, V) of tokens[j + k + 2] (the last one has no
        label: the caller drops it)."""
        B, T = tokens.shape
        h = target.model.norm(target_hidden)
        out = []
        for k, layer in enumerate(self.layers):
            n = T - k - 1
            cos, sin = target.rope(torch.arange(n, device=tokens.device).expand(B, n))
            x = layer(target.model.embed_tokens(tokens[:, k + 1:]), h[:, :n], cos, sin)
            out.append(self.logits(target, k, x))
            h = layer.shared_head.norm(x)
        return out
