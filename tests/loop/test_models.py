"""The Llama runner: checkpoint I/O, and its cached forward (on specdec's ops) against the plain causal
forward, for prefill + decode and for tree verification; the shipped model pair."""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

import specdec
from specdec.loop.cli import ASSETS
from specdec.loop.models.hf import CheckpointError, load_model, save_model, to_hf_state
from specdec.loop.models.llama import Llama, LlamaConfig, chain_tree
from specdec.loop.models.tokenizer import VOCAB_SIZE, ByteTokenizer

from tests.helpers import random_parents, transformers_or_skip

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed=0, **kw) -> Llama:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48)
    cfg.update(kw)
    model = Llama(LlamaConfig(**cfg)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up of names shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True),
                                dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                     rope_theta=500000.0)])
def test_save_load_round_trip(tmp_path, kw):
    model = tiny(**kw)
    save_model(model, str(tmp_path), dtype=torch.float32)
    loaded = load_model(str(tmp_path))
    assert loaded.cfg.to_dict() == model.cfg.to_dict()
    for (name, a), (name_b, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == name_b and torch.equal(a, b), name
    x = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
    files = set(os.listdir(tmp_path))
    assert files == {"config.json", "model.safetensors"}


def test_qwen2_names_and_biases(tmp_path):
    """A Qwen2-style folder: q/k/v biases, no o_proj bias, tied embeddings without lm_head.weight."""
    src = tiny(qkv_bias=True, tie_embeddings=True)
    state = {k: v.contiguous() for k, v in to_hf_state(src).items()}
    assert "model.layers.0.self_attn.q_proj.bias" in state and "model.layers.0.self_attn.o_proj.bias" not in state
    save_file(state, str(tmp_path / "model.safetensors"))
    cfg = {"model_type": "qwen2", "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu", "sliding_window": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = load_model(str(tmp_path))
    assert model.cfg.qkv_bias and not model.cfg.o_bias and model.lm_head is None
    assert model.cfg.extra == {"sliding_window": None}
    x = torch.randint(0, 40, (1, 7))
    with torch.no_grad():
        assert torch.equal(model(x), src(x))


def test_qwen3_matches_transformers_both_ways(tmp_path):
    """Qwen3 (per-head RMSNorm of q and k before the rotary, head_dim apart from hidden_size / heads, tied
    embeddings as in Qwen3-0.6B): ours saved as qwen3 gives transformers' Qwen3ForCausalLM logits, and a folder
    transformers wrote loads into ours with the same logits. The norms matter: without them the logits move."""
    transformers = transformers_or_skip()
    model = tiny(qk_norm=True, head_dim=16, tie_embeddings=True)
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    save_model(model, str(tmp_path / "ours"), dtype=torch.float32)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "qwen3"
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(tmp_path / "ours"), torch_dtype=torch.float32).eval()
    x = torch.randint(0, 40, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
        for layer in hf.model.layers:  # other norms than ours, written by transformers
            layer.self_attn.q_norm.weight.mul_(1.5)
            layer.self_attn.k_norm.weight.add_(0.3)
        hf.save_pretrained(str(tmp_path / "theirs"), safe_serialization=True)
        loaded = load_model(str(tmp_path / "theirs"))
        assert loaded.cfg.qk_norm and loaded.cfg.head_dim == 16 and not loaded.cfg.qkv_bias
        torch.testing.assert_close(loaded(x), hf(x).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(loaded(x), model(x), atol=1e-3)


def test_qwen3_config_and_round_trip(tmp_path):
    """model_type qwen3 reads as a q/k-norm model without q/k/v biases (Qwen2's windows rules apply), saves
    back as qwen3, and the cached forward on specdec's ops matches its causal forward (no transformers)."""
    base = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 48, "head_dim": 16}
    from specdec.loop.models.hf import config_from_hf
    cfg = config_from_hf(dict(base, model_type="qwen3"))
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim == 16 and cfg.window(0) is None
    windowed = config_from_hf(dict(base, model_type="qwen3", use_sliding_window=True, sliding_window=8,
                                   max_window_layers=1))
    assert [windowed.window(i) for i in range(2)] == [None, 8]
    assert not config_from_hf(dict(base, model_type="qwen2")).qk_norm
    model = tiny(qk_norm=True, head_dim=16)
    save_model(model, str(tmp_path), dtype=torch.float32)
    loaded = load_model(str(tmp_path))
    assert loaded.cfg.to_dict() == model.cfg.to_dict()
    x = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
        cache = model.new_cache(2, 16)
        model.prefill(cache, x, torch.full((2,), 8, dtype=torch.int32))
        tree = specdec.build_tree(torch.tensor([[-1]] * 2, dtype=torch.int32))
        step = model.forward_cached(x[:, 8:], cache, tree.depth, tree.mask)
        torch.testing.assert_close(step[:, 0], model(x)[:, 8], atol=1e-5, rtol=1e-5)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path))
    save_model(tiny(), str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match="missing weights"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid config"):
        load_model(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_matches_transformers(tmp_path):
    """Same logits as transformers' LlamaForCausalLM on our saved folder (when transformers is installed)."""
    transformers = transformers_or_skip()
    model = tiny(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    save_model(model, str(tmp_path), dtype=torch.float32)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    x = torch.randint(0, 40, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)


def test_sliding_window_matches_transformers_mistral(tmp_path):
    """A windowed model is saved as Mistral and gives transformers' MistralForCausalLM logits (so the window's
    off-by-one is Hugging Face's: a token sees the last sliding_window positions, itself included)."""
    transformers = transformers_or_skip()
    model = tiny(sliding_window=5)
    save_model(model, str(tmp_path), dtype=torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mistral"
    assert [load_model(str(tmp_path)).cfg.window(i) for i in range(2)] == [5, 5]
    hf = transformers.MistralForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    x = torch.randint(0, 40, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(model(x), tiny()(x), atol=1e-2)  # the window matters at this length


GPT_OSS = dict(head_dim=16, qkv_bias=True, o_bias=True, attention_sinks=True, num_experts=4, experts_per_token=2,
               sliding_window=10, layer_types=["sliding_attention", "full_attention"], rope_theta=150000.0,
               rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16})


def gpt_oss_tiny(seed=0) -> Llama:
    """A gpt-oss-style model: attention sinks, alternating sliding and full layers, experts, YaRN; its router
    biases and sinks far from 0, so that a mix-up of names or a dropped sink shows."""
    model = tiny(seed, **GPT_OSS)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 2)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.3)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.3)
    return model


def test_gpt_oss_matches_transformers_both_ways(tmp_path):
    """gpt-oss (sinks, experts with clamped SwiGLU and a biased top-k router, alternating windows, YaRN with its
    attention factor): ours saved as gpt_oss gives transformers' GptOssForCausalLM logits, and a folder transformers
    wrote (its own random init) loads into ours with the same logits. Sequences longer than the window, so the
    sliding layers differ from full ones; the sinks matter (without them the logits move)."""
    transformers = transformers_or_skip()
    model = gpt_oss_tiny()
    save_model(model, str(tmp_path / "ours"), dtype=torch.float32)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "gpt_oss"
    hf = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "ours"), torch_dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    x = torch.randint(0, 40, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
        sinkless = gpt_oss_tiny()
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
        assert not torch.allclose(sinkless(x), model(x), atol=1e-3)
        theirs = transformers.GptOssForCausalLM(hf.config).eval()  # (transformers' own initialization)
        theirs.save_pretrained(str(tmp_path / "theirs"), safe_serialization=True)
        loaded = load_model(str(tmp_path / "theirs"))
        assert loaded.cfg.attention_sinks and loaded.cfg.num_experts == 4 and loaded.cfg.window(1) is None
        torch.testing.assert_close(loaded(x), theirs(x).logits, atol=1e-5, rtol=1e-5)


def test_gpt_oss_round_trip_and_yarn():
    """gpt_oss configs read back as written; YaRN's inverse frequencies and attention factor equal transformers'
    formulas (checked here on their closed form at the band's edges: extrapolated fast dims, interpolated slow)."""
    from specdec.loop.models.hf import config_from_hf, config_to_hf
    from specdec.loop.models.llama import rope_attention_factor, rope_inv_freq
    model = gpt_oss_tiny()
    assert config_from_hf(config_to_hf(model.cfg, torch.float32)).to_dict() == model.cfg.to_dict()
    cfg = model.cfg
    inv = rope_inv_freq(cfg)
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(inv[0], plain[0]) and torch.allclose(inv[-1], plain[-1] / 8)
    assert rope_attention_factor(cfg) == pytest.approx(0.1 * math.log(8.0) + 1)
    with pytest.raises(ValueError, match="gpt-oss"):
        config_to_hf(dataclasses.replace(cfg, num_experts=0, experts_per_token=0), torch.float32)


def test_window_configs():
    """transformers' rules: Mistral windows every layer (4096 by default, null = none); Qwen2 only with
    use_sliding_window, in the layers layer_types names, else from max_window_layers on; Llama never."""
    from specdec.loop.models.hf import config_from_hf
    base = dict(vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                sliding_window=16, max_window_layers=2)
    mistral = config_from_hf(dict(base, model_type="mistral"))
    qwen = config_from_hf(dict(base, model_type="qwen2", use_sliding_window=True))
    qwen_types = config_from_hf(dict(base, model_type="qwen2", use_sliding_window=True,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    qwen_off = config_from_hf(dict(base, model_type="qwen2", use_sliding_window=False))
    llama = config_from_hf(dict(base, model_type="llama"))
    mistral_default = config_from_hf({k: v for k, v in dict(base, model_type="mistral").items() if k != "sliding_window"})
    mistral_none = config_from_hf(dict(base, model_type="mistral", sliding_window=None))
    assert [mistral.window(i) for i in range(3)] == [16, 16, 16]
    assert [mistral_default.window(i) for i in range(3)] == [4096] * 3
    assert [qwen.window(i) for i in range(3)] == [None, None, 16]
    assert [qwen_types.window(i) for i in range(3)] == [16, None, 16]
    assert [c.window(i) for c in (qwen_off, llama, mistral_none) for i in range(3)] == [None] * 9
    with pytest.raises(ValueError, match="Mistral"):  # per-layer windows: not expressible as Mistral
        save_model(Llama(dataclasses.replace(mistral, layer_types=qwen_types.layer_types)), "/nonexistent",
                   dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# cached forward == causal forward
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 10, "deepseek"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_prefill_then_decode_matches_causal_forward(block_size, window):
    """Ragged prompts prefilled in one chain-shaped call, then one token per call: every logit equals the
    full causal forward's (with a sliding window shorter than the sequences too; and for the DeepSeek-style
    model, whose cache holds one latent row of kv_lora_rank + rope channels per token and layer and no V, the
    absorbed attention against the unabsorbed causal forward)."""
    model = deepseek_tiny(seed=1) if window == "deepseek" else tiny(seed=1, sliding_window=window)
    B, n = 3, 14
    x = torch.randint(0, 40, (B, n))
    lens = torch.tensor([6, 3, 9], dtype=torch.int32)
    cache = model.new_cache(B, 32, block_size=block_size)
    if window == "deepseek":
        assert cache.v is None and tuple(cache.k.shape[-2:]) == (1, 20)
    with torch.no_grad():
        full = model(x)
        tree = chain_tree(B, 9, lens)
        pre = model.forward_cached(x[:, :9], cache, tree.depth, tree.mask, tree.num_nodes)
        cache.commit(lens)
        for b in range(B):
            torch.testing.assert_close(pre[b, :lens[b]], full[b, :lens[b]], atol=1e-5, rtol=1e-5)
        one = chain_tree(B, 1)
        for _ in range(4):
            pos = cache.lens.long()
            step = model.forward_cached(x.gather(1, pos.unsqueeze(1)), cache, one.depth, one.mask)
            torch.testing.assert_close(step[:, 0], full[torch.arange(B), pos], atol=1e-5, rtol=1e-5)
            cache.commit(torch.ones(B, dtype=torch.int32))


@pytest.mark.parametrize("chunk", [4, 256])
def test_prefill_returns_the_causal_forwards_hidden_states(chunk):
    """prefill(return_hidden=True): every prompt token's hidden state (before the final norm) equals the
    causal forward's, across chunk boundaries and for ragged prompts; without it, nothing is returned."""
    model = tiny(seed=2)
    B, n = 3, 11
    x = torch.randint(0, 40, (B, n))
    lens = torch.tensor([11, 5, 8], dtype=torch.int32)
    with torch.no_grad():
        _, full = model(x, return_hidden=True)
        assert model.prefill(model.new_cache(B, 32), x, lens, chunk=chunk) is None
        hidden = model.prefill(model.new_cache(B, 32), x, lens, chunk=chunk, return_hidden=True)
    assert hidden.shape == (B, n, model.cfg.dim)
    for b in range(B):
        torch.testing.assert_close(hidden[b, :lens[b]], full[b, :lens[b]], atol=1e-5, rtol=1e-5)


def test_float8_cache_with_scales_tracks_the_causal_forward(monkeypatch):
    """A float8 cache with per-tensor scales (K stored as K / 0.05, V as V / 0.2): the cached forward stays
    within float8 precision of the full-precision causal forward. A runner that passed the scales to
    kv_append but not to tree_attention (the mutant below) is off by far more, so the bound means something."""
    from specdec.loop.models.llama import KVCache
    model = tiny(seed=1)
    B, n = 2, 12
    x = torch.randint(0, 40, (B, n))
    tree = chain_tree(B, n)

    def error():
        cache = KVCache(model.cfg, B, 16, dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.2)
        with torch.no_grad():
            return float((model.forward_cached(x, cache, tree.depth, tree.mask) - model(x)).abs().max())

    assert error() < 0.1
    attention = specdec.ops.LayerCalls.tree_attention

    def without_scales(calls, *args, **kwargs):  # the mutant: tree_attention called without the cache's scales
        calls.k_scale = calls.v_scale = calls._attend = None
        return attention(calls, *args, **kwargs)

    monkeypatch.setattr(specdec.ops.LayerCalls, "tree_attention", without_scales)
    assert error() > 0.5


@pytest.mark.parametrize("window", [None, 9, "gpt-oss", "deepseek"])
@pytest.mark.parametrize("block_size", [None, 8])
def test_tree_verification_matches_each_branch(block_size, window):
    """Node i's logits from one tree pass == the causal forward of prefix + the path root..i (a window of 9
    hides the oldest prefix tokens from the deeper nodes: each node's window ends at its own position; the
    gpt-oss-style model's sinks go through tree_attention, its window of 10 in every other layer; the
    DeepSeek-style model's absorbed latent attention against its unabsorbed causal forward); so
    are its hidden states (return_hidden: the last layer's output before the final norm, what MTP and EAGLE
    drafters condition on), and the head of those is the logits."""
    if window in ("gpt-oss", "deepseek"):
        model = gpt_oss_tiny(seed=2) if window == "gpt-oss" else deepseek_tiny(seed=2)
    else:
        model = tiny(seed=2, sliding_window=window)
    gen = torch.Generator().manual_seed(0)
    B, T, L = 2, 9, 5
    prefix = torch.randint(0, 40, (B, L))
    tokens = torch.randint(0, 40, (B, T))
    parents = torch.tensor([random_parents(T, "random", gen) for _ in range(B)], dtype=torch.int32)
    cache = model.new_cache(B, 24, block_size=block_size)
    with torch.no_grad():
        model.prefill(cache, prefix, torch.full((B,), L))
        tree = specdec.build_tree(parents)
        logits = model.forward_cached(tokens, cache, tree.depth, tree.mask)
        same, hidden = model.forward_cached(tokens, cache, tree.depth, tree.mask, return_hidden=True)
        assert torch.equal(same, logits) and hidden.shape == (B, T, model.cfg.dim)
        assert torch.equal(model.head(hidden), logits)
        picked = torch.tensor([T - 1, 3])  # at=: one node's logits per request, the same values
        torch.testing.assert_close(model.forward_cached(tokens, cache, tree.depth, tree.mask, at=picked),
                                   logits[torch.arange(B), picked], atol=1e-5, rtol=1e-5)
        _, hidden_at = model.forward_cached(tokens, cache, tree.depth, tree.mask, at=picked, return_hidden=True)
        torch.testing.assert_close(hidden_at, hidden[torch.arange(B), picked], atol=1e-5, rtol=1e-5)
        for b in range(B):
            for i in range(T):
                path, j = [], i
                while j >= 0:
                    path.append(int(tokens[b, j]))
                    j = int(parents[b, j])
                seq = torch.cat((prefix[b], torch.tensor(path[::-1])))
                full_logits, full_hidden = model(seq.unsqueeze(0), return_hidden=True)
                torch.testing.assert_close(logits[b, i], full_logits[0, -1], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(hidden[b, i], full_hidden[0, -1], atol=1e-5, rtol=1e-5)


def test_growing_a_tree_level_by_level_matches_one_pass():
    """forward_cached(start=s): adding nodes s.. to a tree whose first s nodes are cached gives the same
    logits as running the whole tree at once (how drafters grow trees)."""
    model = tiny(seed=3)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 3]], dtype=torch.int32)
    tokens = torch.randint(0, 40, (1, 7))
    tree = specdec.build_tree(parents)
    with torch.no_grad():
        one = model.new_cache(1, 16)
        one.lens += 3
        whole = model.forward_cached(tokens, one, tree.depth, tree.mask)
        grown = model.new_cache(1, 16)
        grown.k.copy_(one.k)
        grown.v.copy_(one.v)
        grown.lens += 3
        parts = []
        for s, e in [(0, 1), (1, 3), (3, 7)]:
            part = specdec.build_tree(parents[:, :e])
            parts.append(model.forward_cached(tokens[:, s:e], grown, part.depth[:, s:e], part.mask, start=s))
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# the shipped pair
# ----------------------------------------------------------------------------------------------
def test_shipped_pair_loads():
    target = load_model(os.path.join(ASSETS, "target"))
    draft = load_model(os.path.join(ASSETS, "draft"))
    assert target.cfg.vocab_size == draft.cfg.vocab_size == VOCAB_SIZE
    assert target.num_params() >= 8e6 and draft.num_params() <= target.num_params() / 5
    size = sum(os.path.getsize(os.path.join(ASSETS, d, f)) for d in ("target", "draft")
               for f in os.listdir(os.path.join(ASSETS, d)))
    assert size <= 40e6
    tok = ByteTokenizer()
    x = torch.tensor([tok.encode("import os\nimport sys\n\n\ndef main():\n    ")])
    with torch.no_grad():  # trained: the next byte of an indented body is predictable
        assert torch.softmax(target(x)[0, -1], -1).max() > 0.2


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3: multi-head latent attention and its experts
# ----------------------------------------------------------------------------------------------
DEEPSEEK = dict(n_kv_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                n_layers=3, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=8, n_group=4, topk_group=2,
                experts_per_token=3, first_k_dense_replace=1, routed_scaling_factor=2.5,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8})


def deepseek_tiny(seed=0, **kw) -> Llama:
    """A DeepSeek-V3-style model: MLA with a query LoRA, YaRN with mscale_all_dim (it scales the softmax), a dense
    first layer, then group-limited experts with a shared one; its score-correction biases far from 0 (they pick
    experts: a name mix-up shows)."""
    model = tiny(seed, **{**DEEPSEEK, **kw})
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    return model


def test_deepseek_matches_transformers_both_ways(tmp_path):
    """DeepSeek-V3 (MLA with q LoRA and interleaved rotary, YaRN's mscale in the softmax scale, a dense layer then
    group-limited experts and a shared one): ours saved as deepseek_v3 gives transformers' DeepseekV3ForCausalLM
    logits, and a folder transformers wrote (its own init, the correction biases set) loads into ours with the
    same logits; the same without the query LoRA."""
    transformers = transformers_or_skip()
    x = torch.randint(0, 40, (2, 13))
    for kw in (dict(), dict(q_lora_rank=None, rope_scaling=None, rope_interleave=False)):
        model = deepseek_tiny(**kw)
        folder = tmp_path / f"ours{len(kw)}"
        save_model(model, str(folder), dtype=torch.float32)
        assert json.loads((folder / "config.json").read_text())["model_type"] == "deepseek_v3"
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32,
                                                                attn_implementation="eager").eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=1e-5)
            theirs = transformers.DeepseekV3ForCausalLM(hf.config).eval()
            for layer in theirs.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
            theirs.save_pretrained(str(tmp_path / f"theirs{len(kw)}"), safe_serialization=True)
            loaded = load_model(str(tmp_path / f"theirs{len(kw)}"))
            assert loaded.cfg.kv_lora_rank == 16 and loaded.cfg.n_routed_experts == 8
            torch.testing.assert_close(loaded(x), theirs(x).logits, atol=1e-5, rtol=1e-5)


def test_deepseek_config_round_trip_and_refusals():
    from specdec.loop.models.hf import config_from_hf, config_to_hf
    model = deepseek_tiny()
    assert config_from_hf(config_to_hf(model.cfg, torch.float32)).to_dict() == model.cfg.to_dict()
    with pytest.raises(ValueError, match="DeepSeek-V3"):
        config_to_hf(dataclasses.replace(model.cfg, attention_sinks=True), torch.float32)
    with pytest.raises(ValueError, match="n_group"):
        LlamaConfig(**{**DEEPSEEK, "n_group": 3})
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        LlamaConfig(**{**DEEPSEEK, "qk_rope_head_dim": 3})
