"""A compact Llama-architecture decoder (gpt-fast style) whose cached attention runs on specdec's ops.

Covers Llama 1-3, Mistral, Qwen2, Qwen3, gpt-oss and DeepSeek-V3 checkpoints: RMSNorm, rotary embeddings (incl.
Llama-3, linear and YaRN rope scaling), SwiGLU MLP, grouped-query attention, tied or untied embeddings, optional
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, Qwen2/3, gpt-oss's alternating
ones), attention sinks and gpt-oss's mixture-of-experts MLP (`MoEMLP`), DeepSeek-V3's multi-head latent attention
and its experts (deepseek.py), and a float8 KV cache (KVCache dtype).
Module names follow the Hugging Face parameter names, except that q/k/v and gate/up projections are
fused into one matmul each (`qkv_proj`, `gate_up_proj`; hf.py splits and joins them).

Forward paths:
  * `forward(tokens)`: plain causal attention (F.scaled_dot_product_attention) over a whole sequence,
    used for training and as the ground truth in tests;
  * `forward_cached(tokens, cache, ...)`: T new tokens per request (a draft tree, or one decode token)
    at positions cache.lens + depth; logits of every new token, or `at=` one node per request. Their K/V
    are written with `specdec.kv_append` at logical slots cache.lens .. cache.lens + T - 1 and attention
    runs through `specdec.tree_attention` with the tree's ancestor mask. cache.lens is not advanced
    here: the caller commits with `specdec.kv_rollback` (the accepted path) or `KVCache.commit`;
  * `prefill(cache, tokens, lengths)`: prompts into the cache as chain-shaped trees, committed, no logits.
Both cached paths run the layers through `_run_layers`, which builds one `CachedStep` per forward.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import specdec
from specdec._layout import FP8_DTYPES


@dataclass
class LlamaConfig:
    vocab_size: int = 260
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int = 2
    intermediate_size: int = 1024
    head_dim: Optional[int] = None  # default dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3" | "linear", "factor": ..., ...}
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: a per-head RMSNorm of q and of k (weights (head_dim,)) before the rotary
    mlp_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    # sliding-window attention (Mistral, Qwen2): a token sees the last `sliding_window` positions, itself
    # included, in the layers layer_types marks "sliding_attention" (transformers' field), every layer if None
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = None
    # gpt-oss: a learned logit per query head in each layer's softmax denominator (no value), and a mixture of
    # experts: num_experts > 0 replaces the MLP by `MoEMLP` (experts_per_token of them per token)
    attention_sinks: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3's multi-head latent attention (kv_lora_rank > 0; deepseek.py): queries through a rank
    # q_lora_rank (None: one projection), one cached latent per token of kv_lora_rank + qk_rope_head_dim channels,
    # per-head query/key channels qk_nope_head_dim + qk_rope_head_dim and value channels v_head_dim; the rotary on
    # the qk_rope_head_dim channels, in interleaved pairs when rope_interleave
    kv_lora_rank: int = 0
    q_lora_rank: Optional[int] = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek-V3's experts (n_routed_experts > 0): from layer first_k_dense_replace on, experts_per_token of
    # n_routed_experts (group-limited: topk_group of n_group groups) plus n_shared_experts, each of
    # moe_intermediate_size (deepseek.DeepseekMoE)
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    extra: dict = field(default_factory=dict)  # unknown config.json fields, kept for saving

    def __post_init__(self):
        if self.kv_lora_rank and (self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2 or self.v_head_dim <= 0):
            raise ValueError("multi-head latent attention: qk_rope_head_dim must be even and > 0, v_head_dim > 0")
        if self.n_routed_experts and (self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group
                                      or not 0 < self.experts_per_token <= self.n_routed_experts):
            raise ValueError("DeepSeek experts: n_group must divide n_routed_experts, topk_group be in [1, n_group] "
                             "and experts_per_token in [1, n_routed_experts]")
        if self.head_dim is None:  # (an MLA model's: its rope channels, as transformers' DeepseekV3Config has it)
            self.head_dim = self.qk_rope_head_dim if self.kv_lora_rank else self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token: must be in [1, num_experts = {self.num_experts}], got "
                             f"{self.experts_per_token}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def rope_dim(self) -> int:
        """The channels the rotary turns: MLA's rope channels, else a head's."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def cache_row(self) -> tuple:
        """(heads, channels) of a token's cached row per layer: MLA's one latent [c ; k_rope], else K's (V's)."""
        if self.kv_lora_rank:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return self.n_kv_heads, self.head_dim

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer`, or None for full attention. Layers past the last (MTP modules, which
        DeepSeek numbers n_layers, n_layers + 1, ...) repeat the pattern from layer 0."""
        if self.layer_types is not None and self.layer_types[layer % self.n_layers] != "sliding_attention":
            return None
        return self.sliding_window


# ----------------------------------------------------------------------------------------------
# rotary embeddings
# ----------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (rope_dim // 2,) float32 with the checkpoint's rope scaling applied, computed
    exactly as transformers does (float32), so both runners produce the same logits."""
    d = cfg.rope_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":  # YaRN (arXiv 2309.00071): interpolated below a band of dimensions, extrapolated above
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def dimension(rotations):  # the dimension that turns `rotations` times over old_len positions
            return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        low, high = dimension(fast), dimension(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        extrapolated = 1 - ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        positions_per_turn = cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        return 1.0 / (factor * positions_per_turn) * (1 - extrapolated) + inv_freq * extrapolated
    raise ValueError(f"rope_scaling: rope_type {kind!r} not supported (default, linear, llama3, yarn)")


def rope_attention_factor(cfg: LlamaConfig) -> float:
    """The factor YaRN scales cos and sin by (transformers' attention_factor; 1 for the other kinds)."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"]))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale of a context stretched `factor` times: 0.1 * m * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rotary(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float, dtype: torch.dtype):
    """cos and signed sin (-sin, sin) (B, T, 2 * len(inv_freq)) in dtype for integer positions (B, T) (apply_rope's
    inputs), scaled by attention_factor (`rope_attention_factor`)."""
    angles = positions.float().unsqueeze(-1) * inv_freq  # (B, T, D/2)
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D); cos, signed_sin (B, T, D) from `Llama.rope`. The Hugging Face (half-split) rotary
    convention x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, D/2) * (-sin1, sin2)."""
    return x * cos.unsqueeze(2) + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin.unsqueeze(2)


# ----------------------------------------------------------------------------------------------
# the KV cache
# ----------------------------------------------------------------------------------------------
class KVCache:
    """Every layer's K/V in one stacked tensor, contiguous (layers, B, L_max, Hkv, D) or paged
    (layers, num_blocks, block_size, Hkv, D) with block_table (B, max_blocks); lens (B,) int32 counts
    each request's committed tokens. A float8 cache (dtype float8_e4m3fn / float8_e5m2) stores K / k_scale
    and V / v_scale: `scales` holds the keyword arguments kv_append and tree_attention take for it.
    An MLA model's cache is its latents alone (Hkv = 1, D = kv_lora_rank + qk_rope_head_dim; v None)."""

    def __init__(self, cfg: LlamaConfig, batch_size: int, max_len: int, *, dtype=torch.float32, device="cpu",
                 block_size: Optional[int] = None, k_scale: float = 1.0, v_scale: float = 1.0):
        shape_tail = cfg.cache_row
        if block_size is None:
            shape = (cfg.n_layers, batch_size, max_len) + shape_tail
            self.block_table = None
        else:
            per = -(-max_len // block_size)
            shape = (cfg.n_layers, batch_size * per, block_size) + shape_tail
            # a simple static page assignment; any permutation works (the ops only follow the table)
            self.block_table = torch.arange(batch_size * per, dtype=torch.int32, device=device).view(batch_size, per)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = None if cfg.kv_lora_rank else torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.rollback_plan = specdec.RollbackPlan(self.k, self.v, self.block_table)  # every layer, planned once
        self.max_len = max_len
        self.scales = dict(k_scale=k_scale, v_scale=v_scale) if dtype in FP8_DTYPES else {}

    @classmethod
    def reused(cls, old: Optional["KVCache"], cfg: LlamaConfig, batch_size: int, max_len: int, *, dtype,
               device) -> "KVCache":
        """old, emptied (lens 0), where it is contiguous and of this shape, dtype and device; else a new contiguous
        cache. For a drafter's next call: a cache is the largest buffer, and a loop's kept CUDA graphs would copy a
        new one into the one they read."""
        shape = (cfg.n_layers, batch_size, max_len) + cfg.cache_row
        if old is not None and old.block_table is None and tuple(old.k.shape) == shape and old.k.dtype == dtype \
                and old.k.device == torch.device(device):
            old.lens.zero_()
            return old
        return cls(cfg, batch_size, max_len, dtype=dtype, device=device)

    def commit(self, n: torch.Tensor) -> None:
        """Keep the first n[b] written slots of request b as they are (a chain: no moves needed)."""
        self.lens += n.to(torch.int32)

    def rollback(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep the accepted tree path (moved to be contiguous) and advance lens."""
        self.rollback_plan.run(self.lens, accepted_nodes, num_accepted)


@dataclass(frozen=True)
class CachedStep:
    """What every layer needs for one cached forward, built once per forward (`Llama.cached_step`).

    The tree has T = first_new + F nodes; node i's K/V lives at slot cache.lens + i. The F new tokens are
    nodes first_new .. T-1 (nodes before are cached already: a drafter growing its tree level by level)."""
    cos: torch.Tensor  # (B, F, head_dim) rotary of the new tokens' positions (Llama.rope)
    sin: torch.Tensor  # (B, F, head_dim) signed sin
    first_new: int
    # kv_append at cache.lens + first_new and tree_attention over the tree (its mask, num_nodes), on the cache's
    # block table and scales: checked at the first layer, dispatched at the others
    calls: specdec.ops.LayerCalls


# ----------------------------------------------------------------------------------------------
# layers
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == torch.float32:  # one fused op, same values as the three-op form below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, window: Optional[int] = None):
        super().__init__()
        self.cfg = cfg
        self.window = window
        hd = cfg.head_dim
        # q, k and v projections fused into one matmul (hf.py splits/joins them for checkpoints)
        self.qkv_proj = nn.Linear(cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(cfg.n_heads))

    def qkv(self, x, cos, sin):
        B, T, _ = x.shape
        hq, hkv = self.cfg.n_heads, self.cfg.n_kv_heads
        qkv = self.qkv_proj(x).view(B, T, hq + 2 * hkv, self.cfg.head_dim)
        qk = qkv[:, :, :hq + hkv]
        if self.cfg.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :, :hq]), self.k_norm(qk[:, :, hq:])), dim=2)
        qk = apply_rope(qk, cos, sin)  # q and k heads rotated together
        return qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv:]

    def forward(self, x, cos, sin):
        """Causal self-attention over the whole sequence (training / ground truth)."""
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x, cos, sin))
        back = torch.arange(T, device=x.device).unsqueeze(1) - torch.arange(T, device=x.device)
        visible = (back >= 0) & (back < (T if self.window is None else self.window))  # causal, in the window
        if self.cfg.attention_sinks:  # the sink: one more logit per head in the softmax, whose value is 0
            group = self.cfg.n_heads // self.cfg.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            scores = (q @ k.transpose(-1, -2) * self.cfg.head_dim ** -0.5).masked_fill(~visible, float("-inf"))
            sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(B, -1, T, 1)
            weights = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
            out = weights @ v
        elif self.window is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(self, x, k_cache, v_cache, step: CachedStep):
        """The new tokens x (B, F, dim) against this layer's cache (see CachedStep)."""
        B, F_new, _ = x.shape
        q, k, v = self.qkv(x, step.cos, step.sin)
        step.calls.kv_append(k_cache, v_cache, k, v)
        if step.first_new:  # the cached nodes' queries are not needed: zero rows stand in for them
            q = torch.cat((q.new_zeros(B, step.first_new, *q.shape[2:]), q), dim=1)
        out = step.calls.tree_attention(q, k_cache, v_cache, -1 if self.window is None else self.window - 1,
                                        sinks=self.sinks.float() if self.cfg.attention_sinks else None)
        return self.o_proj(out[:, step.first_new:].reshape(B, F_new, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # fused
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """gpt-oss's experts, in Hugging Face's layouts: gate_up_proj (E, dim, 2I) with the gate and up columns
    interleaved, gate_up_proj_bias (E, 2I), down_proj (E, I, dim), down_proj_bias (E, dim)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.dim, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.randn(E, D, 2 * I) * D ** -0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.randn(E, I, D) * I ** -0.5)
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D))


class MoEMLP(nn.Module):
    """gpt-oss's mixture of experts: a biased linear router picks each token's experts_per_token experts and
    weighs them by the softmax of their router logits; an expert is a SwiGLU with clamps, (up + 1) *
    gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit. Every expert runs on every token and the
    unpicked ones weigh 0 (a small model's runner: no data-dependent shapes, so no host sync and CUDA graphs
    capture it; a large model's engine dispatches the tokens instead)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=True)
        self.experts = Experts(cfg)

    def forward(self, x):
        cfg, e = self.cfg, self.experts
        tokens = x.reshape(-1, x.shape[-1])  # (N, dim)
        top, picked = self.router(tokens).topk(cfg.experts_per_token, dim=-1)
        weight = torch.zeros(tokens.shape[0], cfg.num_experts, dtype=x.dtype, device=x.device)
        weight.scatter_(1, picked, torch.softmax(top, dim=-1))  # (N, E): 0 for the experts not picked
        gate_up = torch.einsum("nd,edf->enf", tokens, e.gate_up_proj) + e.gate_up_proj_bias.unsqueeze(1)
        gate = gate_up[..., ::2].clamp(max=cfg.swiglu_limit)
        up = gate_up[..., 1::2].clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * cfg.swiglu_alpha)  # (E, N, I)
        out = torch.einsum("enf,efd->end", hidden, e.down_proj) + e.down_proj_bias.unsqueeze(1)
        return torch.einsum("ne,end->nd", weight, out).reshape(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        from .deepseek import DeepseekMoE, MultiHeadLatentAttention
        self.self_attn = MultiHeadLatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg, cfg.window(layer))
        if cfg.n_routed_experts and layer >= cfg.first_k_dense_replace:
            self.mlp = DeepseekMoE(cfg)
        else:
            self.mlp = MoEMLP(cfg) if cfg.num_experts else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, k_cache, v_cache, step: CachedStep):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), k_cache, v_cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Llama(nn.Module):
    """The decoder plus its LM head. `model.*` / `lm_head` match Hugging Face's LlamaForCausalLM."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.attention_factor = rope_attention_factor(cfg)
        self._compiled = None  # forward_cached through torch.compile (see compile_cached)

    @property
    def device(self):
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.model.embed_tokens.weight.dtype

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def rope(self, positions: torch.Tensor):
        """cos and signed sin (-sin, sin) (B, T, head_dim) for integer positions (B, T) (see apply_rope), scaled by
        YaRN's attention factor."""
        return rotary(positions, self.inv_freq, self.attention_factor, self.dtype)

    @property
    def output_weight(self) -> torch.Tensor:
        """The LM head's weight (V, dim): the embedding's when tied (also what MTP modules share)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def shard_lm_head(self, start: int, end: int) -> None:
        """Keep only the LM head's rows [start, end) (tensor parallelism over the vocabulary): the logits become
        those columns of the full ones. cfg.vocab_size stays the full vocabulary's size."""
        weight = self.output_weight
        self.lm_head = nn.Linear(self.cfg.dim, end - start, bias=False, device=weight.device, dtype=weight.dtype)
        self.lm_head.weight = nn.Parameter(weight[start:end].detach().clone(), requires_grad=False)

    def head(self, x):
        return F.linear(self.model.norm(x), self.output_weight)

    def hidden_layers(self, return_hidden) -> tuple:
        """What a forward's return_hidden asks for, as the ids of the residual streams it returns: () for False,
        (n_layers,) for True (the last layer's output), else return_hidden itself: layer ids in [0, n_layers], each
        the stream entering that layer (n_layers: the last layer's output), as vLLM's and EAGLE-3's targets
        collect their auxiliary hidden states; they are concatenated in increasing order."""
        if return_hidden is False:
            return ()
        if return_hidden is True:
            return (self.cfg.n_layers,)
        ids = tuple(return_hidden)
        if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > self.cfg.n_layers:
            raise ValueError(f"return_hidden: layer ids {ids!r} must be increasing, distinct and in "
                             f"[0, {self.cfg.n_layers}]")
        return ids

    def forward(self, tokens: torch.Tensor, *, return_hidden=False):
        """Logits (B, T, V) of a causal forward over whole sequences tokens (B, T) from position 0; with
        return_hidden, (logits, hidden): True, hidden (B, T, dim) is the last layer's output before the final norm;
        layer ids (`hidden_layers`), hidden (B, T, len(ids) * dim) their residual streams concatenated."""
        B, T = tokens.shape
        cos, sin = self.rope(torch.arange(T, device=tokens.device).expand(B, T))
        ids = self.hidden_layers(return_hidden)
        x, taken = self.model.embed_tokens(tokens), []
        for i, layer in enumerate(self.model.layers):
            if i in ids:
                taken.append(x)
            x = layer(x, cos, sin)
        return (self.head(x), _joined(taken, x, ids, self.cfg.n_layers)) if ids else self.head(x)

    def forward_cached(self, tokens: torch.Tensor, cache: KVCache, depth: torch.Tensor, tree_mask: torch.Tensor,
                       num_nodes: Optional[torch.Tensor] = None, *, start: int = 0,
                       at: Optional[torch.Tensor] = None, return_hidden=False):
        """Run new tokens (B, F) of a tree against the cache; returns their logits (B, F, V), or with
        `at` (B,) the logits (B, V) of new token at[b] only (the head runs on those rows alone). With
        return_hidden, (logits, hidden) where hidden (B, F, dim) (or (B, dim) with `at`) is the last layer's
        output before the final norm, what DeepSeek-V3's MTP modules (through their own `hnorm`) condition on;
        with layer ids (`hidden_layers`), hidden (B, F, len(ids) * dim) holds those layers' residual streams, what
        EAGLE-3 heads condition on. They are computed anyway, so asking costs no more than the concatenation.

        The tree has T = start + F nodes; the new tokens are nodes start .. T-1, and nodes < start are
        already in the cache (a drafter growing its tree level by level). Node i's K/V lives at slot
        cache.lens + i and its position is cache.lens + depth[i].
        depth (B, F): the new nodes' depth below node 0; tree_mask (B, T, ceil(T/32)) int32 ancestor bits
        of all T nodes (specdec.build_tree(...).mask); num_nodes (B,): nodes >= num_nodes[b] are padding.
        cache.lens is not changed (see KVCache.commit and KVCache.rollback).
        """
        run = self._compiled or self._forward_cached
        return run(tokens, cache, depth, tree_mask, num_nodes, start, at, return_hidden)

    def _forward_cached(self, tokens, cache, depth, tree_mask, num_nodes, start, at, return_hidden):
        ids = self.hidden_layers(return_hidden)
        x, hidden = self._run_layers(tokens, cache, depth, tree_mask, num_nodes, start, ids)
        if at is not None:
            x, hidden = (t if t is None else t.gather(1, at.long().view(-1, 1, 1).expand(-1, 1, t.shape[-1])).squeeze(1)
                         for t in (x, hidden))
        return (self.head(x), hidden) if ids else self.head(x)

    def compile_cached(self, enabled: bool = True) -> "Llama":
        """forward_cached through torch.compile (compile_static: one graph per shape, e.g. per tree level of a
        drafter), or back to eager."""
        if enabled and self._compiled is None:
            self._compiled = compile_static(self._forward_cached, self.device)
        elif not enabled:
            self._compiled = None
        return self

    @torch.inference_mode()
    def prefill(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor, chunk: int = 256, *,
                return_hidden=False) -> Optional[torch.Tensor]:
        """Run tokens[b, :lengths[b]] into `cache` and commit them, in chain-shaped chunks of <= chunk. With
        return_hidden, the hidden states (B, max(lengths), dim) of those tokens (the last layer's output before
        the final norm, as forward_cached returns them; rows past lengths[b] are padding), what a drafter that
        conditions on the target's features (MTP, EAGLE-3) prefills its own cache from; with layer ids, those
        layers' residual streams (B, max(lengths), len(ids) * dim) (`hidden_layers`)."""
        B, ids = tokens.shape[0], self.hidden_layers(return_hidden)
        hidden = []
        for c0, T, n, tree in self.prefill_chunks(lengths, chunk):
            _, h = self._run_layers(tokens[:, c0:c0 + T], cache, tree.depth, tree.mask, tree.num_nodes, 0, ids)
            hidden.append(h)
            cache.commit(n)
        if ids:
            return torch.cat(hidden, dim=1) if hidden else \
                tokens.new_zeros(B, 0, len(ids) * self.cfg.dim, dtype=self.dtype)
        return None

    def prefill_chunks(self, lengths: torch.Tensor, chunk: int):
        """The chain-shaped chunks of a prefill of lengths (B,) tokens: (first position c0, width T, tokens of
        each request in it n (B,), its tree); a chunk's last token must still see its first (windows)."""
        windows = [w for w in map(self.cfg.window, range(self.cfg.n_layers)) if w is not None]
        chunk = min([chunk] + windows)
        n_max = int(lengths.max())
        for c0 in range(0, n_max, chunk):
            T = min(chunk, n_max - c0)
            n = (lengths.to(torch.int32) - c0).clamp(0, T)
            yield c0, T, n, chain_tree(lengths.shape[0], T, n.clamp(min=1), device=lengths.device)  # empty: pads

    def cached_step(self, cache: KVCache, depth, tree_mask, num_nodes=None, start: int = 0) -> CachedStep:
        """What every layer of a cached forward over new tree nodes needs (see forward_cached); also used by
        modules that run on their own cache with this model's rotary (MTP)."""
        return cached_step(self.rope, cache, depth, tree_mask, num_nodes, start)

    def _run_layers(self, tokens, cache: KVCache, depth, tree_mask, num_nodes=None, start: int = 0, ids=()):
        """The decoder layers over new tree tokens (see forward_cached); returns the last layer's output (B, F, dim)
        and the residual streams of layers `ids` concatenated (None without ids)."""
        step = self.cached_step(cache, depth, tree_mask, num_nodes, start)
        x, taken = self.model.embed_tokens(tokens), []
        v_caches = [None] * len(cache.k) if cache.v is None else cache.v  # (MLA: the latents alone)
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.model.layers, cache.k, v_caches)):
            if i in ids:
                taken.append(x)
            x = layer.forward_cached(x, k_cache, v_cache, step)
        return x, _joined(taken, x, ids, self.cfg.n_layers) if ids else None

    def new_cache(self, batch_size: int, max_len: int, block_size: Optional[int] = None,
                  kv_dtype: Optional[torch.dtype] = None, reuse: Optional[KVCache] = None) -> KVCache:
        """kv_dtype: the model's dtype (default) or a float8 dtype (scales 1, as an uncalibrated vLLM fp8 cache).
        reuse: a contiguous cache to return instead where it fits (`KVCache.reused`)."""
        if kv_dtype not in (None, self.dtype) + FP8_DTYPES:
            raise ValueError(f"kv_dtype: {kv_dtype} is neither the model's dtype ({self.dtype}) nor a float8 dtype")
        if block_size is None:
            return KVCache.reused(reuse, self.cfg, batch_size, max_len, dtype=kv_dtype or self.dtype, device=self.device)
        return KVCache(self.cfg, batch_size, max_len, dtype=kv_dtype or self.dtype, device=self.device,
                       block_size=block_size)


def _joined(taken: list, last: torch.Tensor, ids: tuple, n_layers: int) -> torch.Tensor:
    """The residual streams entering layers ids (taken, in order; id n_layers: the last layer's output), one tensor."""
    streams = taken + [last] if ids[-1] == n_layers else taken
    return streams[0] if len(streams) == 1 else torch.cat(streams, dim=-1)


def cached_step(rope, cache: KVCache, depth, tree_mask, num_nodes=None, start: int = 0) -> CachedStep:
    """The CachedStep of new tree nodes (see Llama.forward_cached) on `cache`, with the rotary `rope` (positions
    (B, F) -> cos, signed sin: `Llama.rope`, or a head's own, as an EAGLE-3 head's)."""
    cos, sin = rope(cache.lens.unsqueeze(1).long() + depth.long())
    calls = specdec.ops.LayerCalls(cache.lens, tree_mask, write_start=cache.lens + start, num_nodes=num_nodes,
                                   block_table=cache.block_table, **cache.scales)
    return CachedStep(cos, sin, first_new=start, calls=calls)


def compile_static(fn, device: torch.device):
    """fn through torch.compile (fullgraph, static shapes: one graph per shape; specdec's ops are opaque custom ops
    inside; Inductor caches the graphs on disk for later processes), called with the value checks off (their host
    reads would break the graph; the callers build the op inputs themselves). On the CPU the graph's wrapper is
    C++ (Inductor's cpp_wrapper): a step launches a few hundred small kernels, and a Python wrapper's overhead
    per kernel is a noticeable part of a step, worth a longer first compile
    (bench/results/loop-compile-time.md)."""
    # every shape adds a graph for fn's code object, shared by all model instances (target and draft): a decoder
    # has a few per batch size and tree level, adaptive depths and dynamic trees add more, and past the limit a
    # fullgraph compile fails instead of running eagerly
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 1024)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": device.type == "cpu"})

    def run(*args):
        with specdec.value_checks(False):
            return compiled(*args)
    return run


def chain_tree(B: int, T: int, num_nodes: Optional[torch.Tensor] = None, device="cpu") -> specdec.TreeInfo:
    """A causal chain of T nodes per request (prefill chunks, sequential drafts)."""
    parents = torch.arange(-1, T - 1, dtype=torch.int32, device=device).expand(B, T).contiguous()
    return specdec.build_tree(parents, num_nodes)
