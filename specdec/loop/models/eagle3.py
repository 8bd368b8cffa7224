"""EAGLE-3 draft heads (Li et al., arXiv 2503.01840) on specdec's ops.

The head sees the target's residual streams entering a few layers (`aux_layers`: vLLM's default (2, L // 2, L - 3)
for a target of L layers; a checkpoint's config may name others) at position j, concatenated (B, T, k * dim_target),
and the embedding of token x_{j+1}, and predicts x_{j+2}:

    h = fc(target streams)                              # k * dim_target -> dim (only for the target's features)
    a = attention(cat([input_layernorm(Emb(x)), hidden_norm(h)]))   # q/k/v read 2 * dim; its own KV cache
    out = h + a;  out = out + mlp(post_attention_layernorm(out))   # the residual is h (hidden_norm(h) with
                                                                    # norm_before_residual, as vLLM's option)
    logits = lm_head(norm(out))                          # a draft vocabulary: target id = draft id + d2t[draft id]

Past depth 1 the head runs on its own output `out` (before the final norm) in place of h, as the EAGLE authors'
drafting and vLLM's do. The embedding is the target's unless the checkpoint has its own. Parameter names are the
EAGLE authors' (fc, midlayer.*, norm, lm_head, d2t, embed_tokens) with our fused q/k/v and gate/up projections.

Checkpoints (`load_eagle3`), the two public layouts:
  * the EAGLE authors' (SafeAILab/EAGLE, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): a flat Llama config.json
    (architectures ["LlamaForCausalLMEagle3"], num_hidden_layers 1, draft_vocab_size, optionally target_hidden_size
    and eagle_config.eagle_aux_hidden_state_layer_ids) and tensors midlayer.*, fc.weight, norm.weight,
    lm_head.weight, d2t, t2d (and embed_tokens.weight where the head has its own);
  * vLLM speculators' (speculators_model_type "eagle3"): config.json with transformer_layer_config (the layer's
    Llama config), draft_vocab_size, target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids,
    and tensors layers.0.* in place of midlayer.*, otherwise the same names.
Both write q/k/v and gate/up projections apart (the Hugging Face names) and d2t as int64 offsets; t2d (a boolean
mask over the target vocabulary) is implied by d2t and not read.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Optional

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from .hf import CheckpointError, config_from_hf, config_to_hf, join_fused, to_hf_state_names
from .llama import (CachedStep, DecoderLayer, Llama, LlamaConfig, RMSNorm, cached_step, rope_attention_factor,
                    rope_inv_freq, rotary)


def default_aux_layers(n_layers: int) -> tuple:
    """vLLM's and the EAGLE authors' layers of a target of n_layers whose entering residual streams the head reads."""
    return (2, n_layers // 2, n_layers - 3)


class Eagle3Layer(DecoderLayer):
    """EAGLE-3's decoder layer: attention over cat(input_layernorm(embedding), hidden_norm(hidden)) (q/k/v read
    2 * dim), its residual the hidden state (normed first with norm_before_residual)."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool = False):
        super().__init__(cfg, 0)
        self.self_attn.qkv_proj = nn.Linear(2 * cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim,
                                            bias=cfg.qkv_bias)
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm_before_residual = norm_before_residual

    def _inputs(self, embedded, hidden):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat((self.input_layernorm(embedded), normed), dim=-1), residual

    def _after_attention(self, attended, residual):
        x = residual + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, embedded, hidden, cos, sin):
        """embedded, hidden (B, T, dim), causal over whole sequences -> the layer's output (B, T, dim)."""
        x, residual = self._inputs(embedded, hidden)
        return self._after_attention(self.self_attn(x, cos, sin), residual)

    def forward_cached(self, embedded, hidden, k_cache, v_cache, step: CachedStep):
        x, residual = self._inputs(embedded, hidden)
        return self._after_attention(self.self_attn.forward_cached(x, k_cache, v_cache, step), residual)


class Eagle3(nn.Module):
    """An EAGLE-3 head. cfg: its decoder layer's config (dim, heads, MLP, norms, rotary; vocab_size the target's
    vocabulary). target_dim: the target's hidden size; aux_layers: the target layers whose entering residual streams
    fc reads (as `Llama.forward`'s return_hidden names them); draft_vocab_size: the rows of lm_head; own_embedding:
    the head has an embedding of its own (else the target's is used)."""

    def __init__(self, cfg: LlamaConfig, *, target_dim: int, aux_layers, draft_vocab_size: Optional[int] = None,
                 norm_before_residual: bool = False, own_embedding: bool = False):
        super().__init__()
        self.cfg, self.target_dim, self.aux_layers = cfg, target_dim, tuple(aux_layers)
        self.draft_vocab_size = draft_vocab_size or cfg.vocab_size
        if not 0 < self.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(f"draft_vocab_size: {self.draft_vocab_size} must be in [1, {cfg.vocab_size}]")
        self.fc = nn.Linear(len(self.aux_layers) * target_dim, cfg.dim, bias=False)
        self.midlayer = Eagle3Layer(cfg, norm_before_residual)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, self.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.attention_factor = rope_attention_factor(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def norm_before_residual(self) -> bool:
        return self.midlayer.norm_before_residual

    def rope(self, positions: torch.Tensor):
        return rotary(positions, self.inv_freq, self.attention_factor, self.dtype)

    def cached_step(self, cache, depth, tree_mask, num_nodes=None, start: int = 0) -> CachedStep:
        """The head's CachedStep on its own cache (see Llama.forward_cached), with its own rotary."""
        return cached_step(self.rope, cache, depth, tree_mask, num_nodes, start)

    def embed(self, target: Llama, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        return table(tokens).to(self.dtype)

    def condition(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's streams (..., len(aux_layers) * target_dim) -> the head's hidden input (..., dim)."""
        return self.fc(target_hidden.to(self.dtype))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output (..., dim) -> logits over the draft vocabulary (..., draft_vocab_size)."""
        return self.lm_head(self.norm(out))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output (..., dim) -> logits over the target's vocabulary (..., V): draft token i's at target
        id i + d2t[i], -inf at the ids no draft token maps to (the draft law, exact over the target's ids)."""
        draft = self.draft_logits(out)
        full = draft.new_full(draft.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        return full.index_copy(-1, self.target_ids(), draft)

    def target_ids(self) -> torch.Tensor:
        """(draft_vocab_size,) int64: the target id of each draft token."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, target: Llama, target_hidden: torch.Tensor, tokens: torch.Tensor,
                depth: int = 1) -> list[torch.Tensor]:
        """The training forward over whole sequences tokens (B, T) with the target's streams target_hidden
        (B, T, len(aux_layers) * target_dim) (`Llama.forward(..., return_hidden=aux_layers)`): step k (0-based) at
        position j sees tokens[j + k + 1] and, for k = 0, the target's streams at j, past it the previous step's output
        at j (what drafting feeds), and returns the logits (B, T - k - 1, V) of tokens[j + k + 2] over the target's
        vocabulary (the last one has no label: the caller drops it). Each step is causal over its own inputs, as
        `MTP.forward` (training-time test in spirit)."""
        B, T = tokens.shape
        h, out = self.condition(target_hidden), []
        for k in range(depth):
            n = T - k - 1
            cos, sin = self.rope(torch.arange(n, device=tokens.device).expand(B, n))
            h = self.midlayer(self.embed(target, tokens[:, k + 1:]), h[:, :n], cos, sin)
            out.append(self.logits(h))
        return out


# ----------------------------------------------------------------------------------------------
# checkpoints: the EAGLE authors' and vLLM speculators' layouts
# ----------------------------------------------------------------------------------------------
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_SPECULATORS_LAYER = "layers.0."
_EAGLE_LAYER = "midlayer."
_OWN = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "embed_tokens.weight")


def _read_tensors(path: str) -> dict:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    state = {}
    for name in files:
        with safe_open(name, "pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    if not files:
        bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
        if not bins:
            raise CheckpointError(f"EAGLE-3 folder {path!r} has no *.safetensors or pytorch_model*.bin weights")
        for name in bins:
            state.update(torch.load(name, map_location="cpu", weights_only=True))
    return state


def _layout(hf: dict, path: str) -> str:
    if "speculators_model_type" in hf:
        if hf["speculators_model_type"] != "eagle3" or "transformer_layer_config" not in hf:
            raise CheckpointError(f"EAGLE-3 folder {path!r}: speculators_model_type "
                                  f"{hf['speculators_model_type']!r} (expected 'eagle3' with a "
                                  f"transformer_layer_config)")
        return "speculators"
    if not set(hf.get("architectures") or []) & set(EAGLE_ARCHITECTURES):
        raise CheckpointError(f"EAGLE-3 folder {path!r}: config.json is neither a speculators eagle3 config nor an "
                              f"EAGLE-3 one (architectures {hf.get('architectures')!r}, expected one of "
                              f"{EAGLE_ARCHITECTURES})")
    return "eagle"


def load_eagle3(path: str, target: Llama, *, dtype: Optional[torch.dtype] = None, device=None) -> Eagle3:
    """The EAGLE-3 head in folder `path` (either public layout) for `target`, in dtype (default: the checkpoint's),
    on device (default: the target's), in eval mode without gradients. A head whose vocabulary, hidden size, layer
    count, d2t or aux layers do not fit the target is refused with a CheckpointError (a ValueError) naming them."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: no readable config.json ({e})") from None
    layout = _layout(hf, path)
    layer_hf = hf["transformer_layer_config"] if layout == "speculators" else hf
    cfg = config_from_hf({"model_type": "llama", **layer_hf})
    if cfg.n_layers != 1:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: num_hidden_layers {cfg.n_layers} (one layer supported)")
    if hf.get("norm_before_fc"):
        raise CheckpointError(f"EAGLE-3 folder {path!r}: norm_before_fc (a norm over fc's input) not supported")
    tcfg = target.cfg
    if cfg.vocab_size != tcfg.vocab_size:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: vocab_size {cfg.vocab_size} differs from the target's "
                              f"{tcfg.vocab_size}")
    target_dim = hf.get("target_hidden_size") or cfg.dim
    if target_dim != tcfg.dim:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: target hidden size {target_dim} (target_hidden_size or "
                              f"hidden_size) differs from the target's hidden_size {tcfg.dim}")
    aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        hf.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(tcfg.n_layers)
    try:
        target.hidden_layers(tuple(aux))
    except ValueError:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: eagle_aux_hidden_state_layer_ids {list(aux)} are not "
                              f"increasing distinct layers of the target's {tcfg.n_layers}") from None
    # vLLM reads a speculators config without norm_before_residual as True, any other config as False
    norm_before_residual = hf.get("norm_before_residual", layout == "speculators")

    state, foreign, layer = {}, [], _SPECULATORS_LAYER if layout == "speculators" else _EAGLE_LAYER
    for name, value in _read_tensors(path).items():
        if name.startswith(layer):
            state["midlayer." + name[len(layer):]] = value
        elif name in _OWN:
            state[name] = value
        elif name != "t2d":  # (implied by d2t)
            foreign.append(name)
    state = join_fused(state, ["midlayer"])
    own_embedding = "embed_tokens.weight" in state
    if not own_embedding and cfg.dim != tcfg.dim:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: no embed_tokens of its own and hidden_size {cfg.dim} differs "
                              f"from the target's {tcfg.dim} (whose embedding it would read)")
    draft_vocab = hf.get("draft_vocab_size") or cfg.vocab_size
    with torch.device("meta"):
        head = Eagle3(cfg, target_dim=target_dim, aux_layers=aux, draft_vocab_size=draft_vocab,
                      norm_before_residual=norm_before_residual, own_embedding=own_embedding)
    if "d2t" not in state:  # (a head over the whole vocabulary may leave the identity out)
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    expected = {k: v.shape for k, v in head.state_dict().items()}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected) | set(foreign)
    wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        raise CheckpointError(f"EAGLE-3 folder {path!r} ({layout} layout): missing weights {sorted(missing)[:5]}, "
                              f"unexpected weights {sorted(unexpected)[:5]}, wrong shapes "
                              f"{[(k, tuple(state[k].shape), tuple(expected[k])) for k in wrong[:3]]}")
    ids = torch.arange(draft_vocab) + state["d2t"].long()
    if ids.min() < 0 or ids.max() >= tcfg.vocab_size or ids.unique().numel() != draft_vocab:
        raise CheckpointError(f"EAGLE-3 folder {path!r}: d2t maps draft tokens outside the target's vocabulary of "
                              f"{tcfg.vocab_size} or two draft tokens to one target token")
    dtype = dtype or state["fc.weight"].dtype
    state = {k: v.long() if k == "d2t" else v.to(dtype) for k, v in state.items()}
    head = head.to_empty(device=device or target.device)
    head.load_state_dict(state, assign=True)
    head.inv_freq = rope_inv_freq(cfg).to(head.d2t.device)
    return head.eval().requires_grad_(False)


def save_eagle3(head: Eagle3, path: str, *, layout: str = "eagle", dtype: torch.dtype = torch.float16,
                extra_files: Optional[dict] = None):
    """Write the head in a public layout: "eagle" (the EAGLE authors': midlayer.*, a flat config.json) or
    "speculators" (layers.0.*, transformer_layer_config), with d2t and t2d."""
    if layout not in ("eagle", "speculators"):
        raise ValueError(f"layout: expected 'eagle' or 'speculators', got {layout!r}")
    os.makedirs(path, exist_ok=True)
    cfg, prefix = head.cfg, _EAGLE_LAYER if layout == "eagle" else _SPECULATORS_LAYER
    state = {prefix + k: v for k, v in to_hf_state_names(head.midlayer.state_dict(), cfg).items()}
    state.update({k: v for k, v in head.state_dict().items() if not k.startswith("midlayer.")})
    state = {k: v.detach().contiguous() if k == "d2t" else v.detach().to(dtype).contiguous() for k, v in state.items()}
    state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill(0, head.target_ids().cpu(), True)
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file({k: v.cpu() for k, v in state.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    layer = {**config_to_hf(cfg, dtype), "num_hidden_layers": 1}
    eagle = {"draft_vocab_size": head.draft_vocab_size, "target_hidden_size": head.target_dim,
             "norm_before_residual": head.norm_before_residual,
             "eagle_aux_hidden_state_layer_ids": list(head.aux_layers)}
    if layout == "eagle":
        hf = {**layer, "architectures": [EAGLE_ARCHITECTURES[0]], **eagle}
    else:
        hf = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer, **eagle}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
