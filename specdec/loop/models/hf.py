"""Hugging Face-format checkpoint folders (config.json + *.safetensors) <-> `Llama`.

Reads Llama, Mistral, Qwen2, Qwen3, gpt-oss and DeepSeek-V3 configs and weights (the parameter names are ours,
except our fused q/k/v and gate/up projections); writes a folder that transformers loads as is: LlamaForCausalLM,
or MistralForCausalLM (a window in every layer), or Qwen3ForCausalLM (q/k norms), or GptOssForCausalLM (attention
sinks and experts), or DeepseekV3ForCausalLM (multi-head latent attention).
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .llama import Llama, LlamaConfig, rope_inv_freq

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt_oss", "deepseek_v3")
QWEN = ("qwen2", "qwen3")  # the same window rules; Qwen2 has q/k/v biases, Qwen3 a q/k norm instead
# config.json fields we translate; everything else is kept in LlamaConfig.extra and written back (the window
# fields too: read into LlamaConfig and kept as they were)
_KNOWN = {"model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "intermediate_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
          "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id",
          "eos_token_id", "hidden_act", "torch_dtype", "rope_parameters", "num_local_experts", "num_experts_per_tok",
          "swiglu_alpha", "swiglu_limit"}
# DeepSeek-V3's fields, the same names in its config.json and LlamaConfig (qk_head_dim: derived, written back)
_DEEPSEEK = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave",
             "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "n_group", "topk_group",
             "norm_topk_prob", "routed_scaling_factor", "first_k_dense_replace")


# (gpt-oss's windows are always written from the config: not kept apart)
_GPT_OSS_WINDOW = ("sliding_window", "layer_types")


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, incomplete or of an unsupported architecture."""


def config_from_hf(hf: dict) -> LlamaConfig:
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise CheckpointError(f"config.json: model_type {kind!r} not supported (expected one of {SUPPORTED})")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} not supported (silu only)")
    eos = hf.get("eos_token_id")
    n_heads = hf["num_attention_heads"]
    # transformers' rules and defaults: Mistral windows every layer (sliding_window 4096 unless given, null = no
    # window); Qwen2 only with use_sliding_window, in the layers layer_types marks "sliding_attention", or
    # else from layer max_window_layers (default 28) on
    windowed = hf.get("use_sliding_window", False) if kind in QWEN else kind in ("mistral", "gpt_oss")
    window = hf.get("sliding_window", 4096) if windowed else None
    if window is not None and kind in QWEN:
        first = hf.get("max_window_layers", 28)
        layer_types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                                for i in range(hf["num_hidden_layers"])]
    elif kind == "gpt_oss":  # (transformers' default: sliding and full layers alternating, sliding first)
        layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(hf["num_hidden_layers"])]
    else:
        layer_types = None
    # transformers 5 writes the rotary's base and scaling together (rope_parameters), earlier versions apart
    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    gpt_oss = kind == "gpt_oss"
    deepseek = {}
    if kind == "deepseek_v3":  # (transformers' defaults where a field is absent)
        defaults = dict(rope_interleave=True, n_shared_experts=1, n_routed_experts=256, moe_intermediate_size=2048,
                        n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
                        first_k_dense_replace=3, q_lora_rank=1536)
        deepseek = {k: hf.get(k, defaults.get(k)) for k in _DEEPSEEK}
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("qk_rope_head_dim") if deepseek else hf.get("head_dim"),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
        rope_scaling=rope_scaling, max_seq_len=hf.get("max_position_embeddings", 4096),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=kind == "qwen2" or hf.get("attention_bias", gpt_oss),
        o_bias=kind != "qwen2" and hf.get("attention_bias", gpt_oss), mlp_bias=hf.get("mlp_bias", False),
        qk_norm=kind == "qwen3",
        bos_token_id=hf.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
        sliding_window=window, layer_types=layer_types, attention_sinks=gpt_oss,
        num_experts=hf.get("num_local_experts", 0) if gpt_oss else 0,
        experts_per_token=hf.get("num_experts_per_tok", 0) if gpt_oss else hf.get("num_experts_per_tok", 8) if deepseek
        else 0,
        swiglu_alpha=hf.get("swiglu_alpha", 1.702), swiglu_limit=hf.get("swiglu_limit", 7.0), **deepseek,
        extra={k: v for k, v in hf.items() if k not in _KNOWN and not (gpt_oss and k in _GPT_OSS_WINDOW)
               and not (deepseek and (k in _DEEPSEEK or k == "qk_head_dim"))})


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    """A Llama config, a Qwen3 one for a model with a q/k norm (no window), a Mistral one for a model with a
    sliding window in every layer, or a gpt-oss one for a model with attention sinks and experts."""
    if cfg.kv_lora_rank:
        return _deepseek_config(cfg, dtype)
    if cfg.attention_sinks or cfg.num_experts:
        return _gpt_oss_config(cfg, dtype)
    if cfg.qkv_bias != cfg.o_bias:
        raise ValueError("saving: q/k/v biases without an o_proj bias is Qwen2-only, not expressible as Llama")
    kind = "llama"
    if cfg.qk_norm:
        if cfg.sliding_window is not None or cfg.mlp_bias:
            raise ValueError("saving: a q/k norm is written as Qwen3, here without a window or MLP biases")
        kind = "qwen3"
    elif cfg.sliding_window is not None:
        if any(cfg.window(i) is None for i in range(cfg.n_layers)) or cfg.qkv_bias or cfg.mlp_bias:
            raise ValueError("saving: a sliding window is written as Mistral, which has no biases and windows "
                             "every layer")
        kind = "mistral"
    window = {"sliding_window": cfg.sliding_window} if kind == "mistral" else {}
    return {
        "architectures": [f"{kind.capitalize()}ForCausalLM"], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "hidden_act": "silu",
        "torch_dtype": str(dtype).replace("torch.", ""), **cfg.extra, **window}


def _gpt_oss_config(cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    if not (cfg.attention_sinks and cfg.num_experts and cfg.qkv_bias == cfg.o_bias) or cfg.qk_norm or cfg.mlp_bias:
        raise ValueError("saving: attention sinks or experts are written as gpt-oss, which has both, q/k/v and o "
                         "biases alike, and no q/k norm")
    layer_types = [("sliding_attention" if cfg.window(i) is not None else "full_attention")
                   for i in range(cfg.n_layers)]
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias, "sliding_window": cfg.sliding_window, "layer_types": layer_types,
        "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
        "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id, "hidden_act": "silu", "torch_dtype": str(dtype).replace("torch.", ""),
        **cfg.extra}


def _deepseek_config(cfg: LlamaConfig, dtype: torch.dtype) -> dict:
    if cfg.qkv_bias != cfg.o_bias or cfg.attention_sinks or cfg.num_experts or cfg.qk_norm or cfg.mlp_bias \
            or cfg.sliding_window is not None:
        raise ValueError("saving: multi-head latent attention is written as DeepSeek-V3, which has kv_a / q_a and o "
                         "biases alike, no sinks, gpt-oss experts, q/k norm, MLP biases or window")
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.qk_rope_head_dim, "qk_head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        **{k: getattr(cfg, k) for k in _DEEPSEEK}, "num_experts_per_tok": cfg.experts_per_token,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.qkv_bias, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "hidden_act": "silu", "torch_dtype": str(dtype).replace("torch.", ""), **cfg.extra}


# our fused projections: (the module holding it, its Hugging Face parts in the order they are joined)
FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up_proj": ("mlp", ("gate_proj", "up_proj"))}


def from_hf_state(state: dict, cfg: LlamaConfig) -> dict:
    """Hugging Face parameter names -> ours: q/k/v and gate/up projections joined (fused matmuls), DeepSeek's
    per-expert weights (experts.{e}.gate_proj / up_proj / down_proj, its checkpoints' layout) stacked."""
    layers = [f"model.layers.{i}" for i in range(cfg.n_layers)]
    return stack_experts(join_fused(state, layers), layers, cfg.n_routed_experts)


def stack_experts(state: dict, layers, num_experts: int) -> dict:
    """A copy of state with each layer's per-expert SwiGLU weights stacked: experts.gate_up_proj (E, 2I, dim), the
    gate rows then the up rows, and experts.down_proj (E, dim, I) (transformers' DeepseekV3Experts)."""
    state = dict(state)
    for layer in layers:
        group = f"{layer}.mlp.experts"
        names = [[f"{group}.{e}.{part}.weight" for e in range(num_experts)]
                 for part in ("gate_proj", "up_proj", "down_proj")]
        if num_experts and all(n in state for n in sum(names, [])):
            gate, up, down = ([state.pop(n) for n in part] for part in names)
            state[f"{group}.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
            state[f"{group}.down_proj"] = torch.stack(down)
    return state


def join_fused(state: dict, layers) -> dict:
    """A copy of state with each decoder layer's (named by its prefix in `layers`) Hugging Face q/k/v and gate/up
    projections joined into our fused ones."""
    state = dict(state)
    for layer in layers:
        for fused, (module, parts) in FUSED.items():
            group = f"{layer}.{module}"
            for kind in ("weight", "bias"):
                names = [f"{group}.{p}.{kind}" for p in parts]
                if all(n in state for n in names):
                    state[f"{group}.{fused}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state


def to_hf_state(model: Llama) -> dict:
    """Our state dict with Hugging Face parameter names (fused projections split)."""
    return to_hf_state_names(model.state_dict(), model.cfg)


def to_hf_state_names(state: dict, cfg: LlamaConfig) -> dict:
    """A state dict of ours (a model's or a decoder layer's) with the fused projections split (HF names)."""
    out = {}
    sizes = {"qkv_proj": [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim],
             "gate_up_proj": [cfg.intermediate_size] * 2}
    parts = {fused: names for fused, (_, names) in FUSED.items()}
    for name, value in state.items():
        group, module, kind = ("." + name).rsplit(".", 2)  # "lm_head.weight" -> ("", "lm_head", "weight")
        if cfg.n_routed_experts and module == "experts":  # DeepSeek's checkpoints: one SwiGLU per expert
            for e, weight in enumerate(value):
                if kind == "gate_up_proj":
                    gate, up = weight.chunk(2)
                    out[f"{group[1:]}.experts.{e}.gate_proj.weight"] = gate
                    out[f"{group[1:]}.experts.{e}.up_proj.weight"] = up
                else:
                    out[f"{group[1:]}.experts.{e}.down_proj.weight"] = weight
        elif module in parts:
            for part, piece in zip(parts[module], value.split(sizes[module])):
                out[f"{group[1:]}.{part}.{kind}"] = piece
        else:
            out[name] = value
    return out


def is_mtp_weight(name: str, n_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to MTP layers (not to the target) in either layout."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return name.startswith("mtp.") or (m is not None and int(m.group(1)) >= n_layers)


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device="cpu") -> Llama:
    """A `Llama` from a Hugging Face checkpoint folder, weights cast to `dtype` (eval mode)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"checkpoint folder {path!r} has no config.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"checkpoint folder {path!r} has no *.safetensors weights")
    try:
        with open(config_path) as f:
            cfg = config_from_hf(json.load(f))
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(f"{config_path}: invalid config ({exc})") from exc
    state = {}
    for name in files:  # MTP layers stored with the target (DeepSeek-V3, Qwen3-Next) are load_mtp's
        state.update({k: v for k, v in load_file(name).items() if not is_mtp_weight(k, cfg.n_layers)})
    state = from_hf_state(state, cfg)
    with torch.device("meta"):
        model = Llama(cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if cfg.tie_embeddings:
        unexpected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint folder {path!r}: missing weights {sorted(missing)[:5]}, "
                              f"unexpected weights {sorted(unexpected)[:5]}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)  # to_empty left the meta buffer uninitialized
    return model.to(dtype).eval()


def save_model(model: Llama, path: str, *, dtype: torch.dtype = torch.float16, extra_files: Optional[dict] = None):
    """Write config.json + model.safetensors (weights cast to `dtype`) to folder `path`."""
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in to_hf_state(model).items()}
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))  # atomic: a reader never sees half a file
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.cfg, dtype), f, indent=2)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
