"""DeepSeek-V3's layers for `Llama` (a config with kv_lora_rank > 0): multi-head latent attention (MLA) and the
group-limited mixture of experts with shared experts. Module and parameter names are Hugging Face's
(DeepseekV3ForCausalLM), so checkpoints load without renaming.

MLA (arXiv 2405.04434): a token's keys and values come from one latent per token, c = RMSNorm(x W_DKV) of
kv_lora_rank channels, plus one shared rotary key k_rope of qk_rope_head_dim channels: head h's key is
[c W_UK_h ; k_rope] and its value c W_UV_h (kv_b_proj holds W_UK and W_UV). The cache holds only [c ; k_rope] per
token and layer, one KV head. The causal forward (training, ground truth) expands keys and values per head, as
written; the cached forward runs MLA's absorbed form on specdec's ops: the query's no-rope part is taken into
latent space (q_nope W_UK_h^T), so scores are [q_nope W_UK_h^T ; q_rope] . [c ; k_rope] over the cached rows as
they are, the output is attention over c (V = the latent's first kv_lora_rank channels, a view of the same rows),
and W_UV_h maps it back per head. Nothing is expanded per head, and a step reads each cached row once for all heads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from .llama import CachedStep, LlamaConfig

# DeepSeek's q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: "LlamaConfig") -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale(factor, mscale_all_dim)^2 where the rope
    scaling gives mscale_all_dim (DeepSeek scales every query-key channel, not only the rotary ones)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
        from .llama import yarn_mscale
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    """MLA (module docstring). q: q_proj, or the low-rank q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank);
    kv_a_proj_with_mqa gives [c (kv_lora_rank) ; k_rope (qk_rope_head_dim)] per token; kv_b_proj (H * (nope + v),
    kv_lora_rank) holds each head's W_UK and W_UV. Rotary over the rope channels, DeepSeek's interleaved pairs
    when rope_interleave (taken apart into the half-split layout first: the same dot products)."""

    def __init__(self, cfg: "LlamaConfig"):
        super().__init__()
        self.cfg = cfg
        H, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = _norm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = _norm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.dim, bias=cfg.o_bias)
        self.scale = softmax_scale(cfg)

    def _rope(self, x, cos, sin):
        from .llama import apply_rope
        if self.cfg.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...)
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def project(self, x, cos, sin):
        """x (B, T, dim) -> q_nope (B, T, H, nope), q_rope (B, T, H, rope) rotated, latent (B, T, 1, kv_lora_rank
        + rope): [c ; k_rope rotated], the cache's row."""
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(B, T, cfg.n_heads, -1).split((cfg.qk_nope_head_dim, cfg.qk_rope_head_dim), dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split((cfg.kv_lora_rank, cfg.qk_rope_head_dim), dim=-1)
        latent = torch.cat((self.kv_a_layernorm(c), self._rope(k_rope.unsqueeze(2), cos, sin).squeeze(2)), dim=-1)
        return q_nope, self._rope(q_rope, cos, sin), latent.unsqueeze(2)

    def _up_weights(self):
        """W_UK (H, nope, kv_lora_rank) and W_UV (H, v, kv_lora_rank), views of kv_b_proj's weight."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, :cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def forward(self, x, cos, sin):
        """Causal attention over whole sequences, keys and values expanded per head (the unabsorbed form)."""
        cfg = self.cfg
        B, T, _ = x.shape
        q_nope, q_rope, latent = self.project(x, cos, sin)
        kv = self.kv_b_proj(latent[:, :, 0, :cfg.kv_lora_rank]).view(B, T, cfg.n_heads, -1)
        k_nope, v = kv.split((cfg.qk_nope_head_dim, cfg.v_head_dim), dim=-1)
        k = torch.cat((k_nope, latent[:, :, :, cfg.kv_lora_rank:].expand(-1, -1, cfg.n_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(self, x, latent_cache, v_cache, step: "CachedStep"):
        """The new tokens x (B, F, dim) against this layer's latent cache (v_cache: None, MLA has one cache), in
        the absorbed form (module docstring)."""
        cfg = self.cfg
        B, F_new, _ = x.shape
        q_nope, q_rope, latent = self.project(x, step.cos, step.sin)
        step.calls.kv_append(latent_cache, None, latent, None)
        w_uk, w_uv = self._up_weights()
        q = torch.cat((torch.einsum("bthn,hnr->bthr", q_nope, w_uk), q_rope), dim=-1)
        if step.first_new:  # the cached nodes' queries are not needed: zero rows stand in for them
            q = torch.cat((q.new_zeros(B, step.first_new, *q.shape[2:]), q), dim=1)
        out = step.calls.tree_attention(q, latent_cache, latent_cache[..., :cfg.kv_lora_rank], scale=self.scale)
        out = torch.einsum("bthr,hvr->bthv", out[:, step.first_new:], w_uv)
        return self.o_proj(out.reshape(B, F_new, -1))


class SwiGLU(nn.Module):
    """gate_proj / up_proj / down_proj, unfused (DeepSeek's shared experts, under Hugging Face's names)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DeepSeek-V3's router: sigmoid scores of a float32 linear (weight (E, dim)); experts are chosen by score plus
    e_score_correction_bias, first among the topk_group best of n_group groups (a group's score: the sum of its
    two best), and weighted by their plain scores, normalized over the chosen (norm_topk_prob), times
    routed_scaling_factor."""

    def __init__(self, cfg: "LlamaConfig"):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.n_routed_experts, cfg.dim) * cfg.dim ** -0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, tokens):
        """tokens (N, dim) -> weights (N, E) float32, 0 for the experts not chosen."""
        cfg = self.cfg
        scores = F.linear(tokens.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
        in_group = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~in_group.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        picked = choice.topk(cfg.experts_per_token, dim=-1).indices
        top = scores.gather(1, picked)
        if cfg.norm_topk_prob:
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        return torch.zeros_like(scores).scatter_(1, picked, top * cfg.routed_scaling_factor)


class Experts(nn.Module):
    """The routed experts in Hugging Face's layout: gate_up_proj (E, 2I, dim) (gate rows, then up rows) and
    down_proj (E, dim, I)."""

    def __init__(self, cfg: "LlamaConfig"):
        super().__init__()
        E, D, I = cfg.n_routed_experts, cfg.dim, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, D) * D ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(E, D, I) * I ** -0.5)


class DeepseekMoE(nn.Module):
    """Routed experts (SwiGLU each) weighed by the `Router`, plus n_shared_experts shared ones every token uses
    (one SwiGLU of n_shared_experts * moe_intermediate_size). Every expert runs on every token and the unchosen
    weigh 0, as `MoEMLP` does (no data-dependent shapes: no host sync, capturable)."""

    def __init__(self, cfg: "LlamaConfig"):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = SwiGLU(cfg.dim, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])  # (N, dim)
        weight = self.gate(tokens).to(x.dtype)  # (N, E)
        gate, up = torch.einsum("nd,efd->enf", tokens, self.experts.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("enf,edf->end", F.silu(gate) * up, self.experts.down_proj)
        return torch.einsum("ne,end->nd", weight, out).reshape(x.shape) + self.shared_experts(x)


def _norm(dim: int) -> nn.Module:
    from .llama import RMSNorm
    return RMSNorm(dim, LATENT_NORM_EPS)
