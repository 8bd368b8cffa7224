"""DeepSeek-V3-style multi-token-prediction (MTP) modules on specdec's ops.

Module k takes the hidden state h of position j (post final norm: the target's `model.norm(h_target)` for
the first module, as vLLM and SGLang feed DeepSeek-V3's MTP layer; the previous module's `norm(out)` when
recycled) and the embedding of token x_{j+k}, and predicts x_{j+k+1}:

    x = eh_proj(cat([enorm(Emb(t)), hnorm(h)]))      # embedding first, as the public checkpoints do
    out = one decoder layer over x                    # its own KV cache (kv_append / tree_attention)
    logits = lm_head(norm(out))                       # the target's embedding and LM head, shared

Parameter names follow DeepSeek-V3's `model.layers.{n}.*` (enorm, hnorm, eh_proj, shared_head.norm, and
the decoder layer's own names), with our fused q/k/v and gate/up projections (and DeepSeek's per-expert weights
stacked). For an MLA target the layer is MLA and MoE, as DeepSeek-V3's, and its cache the latents alone.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from .hf import CheckpointError, config_to_hf, is_mtp_weight, join_fused, stack_experts, to_hf_state_names
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
        # the layer after the target's last, as DeepSeek numbers it: experts where the target's later layers have
        # them (DeepSeek-V3's MTP layer is MLA + MoE), layer 0's window
        self.block = DecoderLayer(cfg, cfg.n_layers)
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
        return F.linear(self.layers[k].shared_head.norm(out), target.output_weight)

    def forward(self, target: Llama, target_hidden: torch.Tensor, tokens: torch.Tensor,
                depth: Optional[int] = None) -> list[torch.Tensor]:
        """DeepSeek-V3's training forward over whole sequences tokens (B, T) with the target's hidden states
        target_hidden (B, T, dim) (before its final norm): step k (0-based) at position j sees tokens[j + k + 1]
        and the previous step's hidden state at j, and returns the logits (B, T - k - 1, V) of tokens[j + k + 2]
        (the last one has no label: the caller drops it). Steps past the modules reuse the last module on its
        own output, as drafting does (depth, default num_modules; EAGLE-3's training-time test in spirit)."""
        B, T = tokens.shape
        h = target.model.norm(target_hidden)
        out = []
        for k in range(depth or self.num_modules):
            m = min(k, self.num_modules - 1)
            n = T - k - 1
            cos, sin = target.rope(torch.arange(n, device=tokens.device).expand(B, n))
            x = self.layers[m](target.model.embed_tokens(tokens[:, k + 1:]), h[:, :n], cos, sin)
            out.append(self.logits(target, m, x))
            h = self.layers[m].shared_head.norm(x)
        return out


# ----------------------------------------------------------------------------------------------
# checkpoints: MTP layers in the public Hugging Face layouts
# ----------------------------------------------------------------------------------------------
# DeepSeek-V3 (and GLM-4.5, MiMo-style exports): the modules are extra decoder layers after the target's,
# model.layers.{n_layers + k}.{enorm, hnorm, eh_proj, shared_head.norm, <the decoder layer's names>}; their
# copies of the embedding and LM head (embed_tokens, shared_head.head) are the target's and are not read.
# Qwen3-Next: mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.{k}.*, norm}, zero-centred norms
# (the weight is w - 1: scale by 1 + w), one final norm for all modules.
_DEEPSEEK_OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
_DEEPSEEK_SHARED = ("embed_tokens", "shared_head.head")
_QWEN3_NEXT = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj"}
_NUM_MODULES_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def mtp_from_hf_state(state: dict, cfg: LlamaConfig) -> dict:
    """MTP tensors of a checkpoint (either layout) -> `MTP` parameter names (fused q/k/v and gate/up)."""
    out, n = {}, cfg.n_layers
    qwen3_next_modules = 1 + max([int(k.split(".")[2]) for k in state if k.startswith("mtp.layers.")], default=0)
    for name, value in state.items():
        if name.startswith("mtp."):
            rest = name[len("mtp."):]
            if rest.startswith("layers."):
                k, tail = rest[len("layers."):].split(".", 1)
                key = f"layers.{k}.block.{tail}"
            else:
                part, kind = rest.rsplit(".", 1)
                # one final norm shared by the modules (Qwen3-Next has one module): each module gets it
                key = f"layers.{{k}}.{_QWEN3_NEXT.get(part, 'shared_head.norm' if part == 'norm' else part)}.{kind}"
            if key.endswith("norm.weight"):
                value = value.float() + 1  # zero-centred RMSNorm
            keys = [key.format(k=k) for k in range(qwen3_next_modules)] if "{k}" in key else [key]
        else:
            m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
            if m is None or int(m.group(1)) < n:
                continue
            k, tail = int(m.group(1)) - n, m.group(2)
            if tail.startswith(_DEEPSEEK_SHARED):
                continue
            keys = [f"layers.{k}.{tail}" if tail.startswith(_DEEPSEEK_OWN) else f"layers.{k}.block.{tail}"]
        for key in keys:
            out[key] = value
    blocks = sorted({".".join(k.split(".")[:3]) for k in out if ".block." in k})
    return stack_experts(join_fused(out, blocks), blocks, cfg.n_routed_experts)


def mtp_folder(path: str) -> bool:
    """Whether the checkpoint folder's config.json declares MTP layers (a DeepSeek-V3 or Qwen3-Next target)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return any(hf.get(k) for k in _NUM_MODULES_KEYS)


def load_mtp(path: str, cfg: LlamaConfig, *, dtype: torch.dtype = torch.float32, device="cpu") -> MTP:
    """The MTP layers of a Hugging Face folder (DeepSeek-V3 or Qwen3-Next names; the target's weights in the
    same folder are skipped) for a target whose config is cfg, cast to dtype (eval mode, no gradients)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"MTP folder {path!r} has no *.safetensors weights")
    hf = {}
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        if hf.get("hidden_size", cfg.dim) != cfg.dim or hf.get("vocab_size", cfg.vocab_size) != cfg.vocab_size:
            raise CheckpointError(f"MTP folder {path!r}: hidden_size/vocab_size {hf.get('hidden_size')}/"
                                  f"{hf.get('vocab_size')} differ from the target's {cfg.dim}/{cfg.vocab_size}")
    state = {}
    for name in files:
        with safe_open(name, "pt") as f:  # only the MTP tensors are read (the target's may be in the same files)
            state.update({k: f.get_tensor(k) for k in f.keys() if is_mtp_weight(k, cfg.n_layers)})
    state = mtp_from_hf_state(state, cfg)
    found = 1 + max([int(k.split(".")[1]) for k in state], default=-1)
    num = next((hf[k] for k in _NUM_MODULES_KEYS if k in hf), found)
    if num < 1:
        raise CheckpointError(f"MTP folder {path!r}: no MTP layers (model.layers.{cfg.n_layers}.* or mtp.*)")
    with torch.device("meta"):
        mtp = MTP(cfg, num)
    expected = set(mtp.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise CheckpointError(f"MTP folder {path!r}: missing weights {sorted(missing)[:5]}, "
                              f"unexpected weights {sorted(unexpected)[:5]}")
    mtp = mtp.to_empty(device=device)
    mtp.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return mtp.to(dtype).eval().requires_grad_(False)


def save_mtp(mtp: MTP, path: str, *, dtype: torch.dtype = torch.float16, extra_files: Optional[dict] = None):
    """Write the modules in DeepSeek-V3's layout: config.json (the target's, with num_nextn_predict_layers) and
    model.safetensors holding model.layers.{n_layers + k}.* only (the target's weights stay in their folder)."""
    os.makedirs(path, exist_ok=True)
    cfg, n = mtp.cfg, mtp.cfg.n_layers
    state = {}
    for k, layer in enumerate(mtp.layers):
        for name, value in to_hf_state_names(layer.block.state_dict(), cfg).items():
            state[f"model.layers.{n + k}.{name}"] = value
        for name, value in layer.state_dict().items():
            if not name.startswith("block."):
                state[f"model.layers.{n + k}.{name}"] = value
    state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config_to_hf(cfg, dtype), "num_nextn_predict_layers": mtp.num_modules}, f, indent=2)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
