"""The MTP drafter (specdec.loop.drafters.mtp): greedy speculative output equals greedy AR, and the heads' cache
after rejected paths equals a fresh run over the accepted tokens."""
from __future__ import annotations

import pytest
import torch

from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters.mtp import MTPDrafter
from specdec.loop.models.mtp import MTP

from test_loop import PROMPTS, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target_and_mtp():
    """A tiny target and an MTP module trained for a few seconds on the target's own greedy text, so that
    drafts are accepted sometimes and rejected sometimes."""
    target = tiny(0)
    torch.manual_seed(3)
    mtp = MTP(target.cfg, 1)
    prompts = torch.randint(0, target.cfg.vocab_size, (64, 3)).tolist()
    text = torch.tensor([p + t for p, t in zip(prompts, generate_ar(target, prompts, 29).tokens)])
    with torch.no_grad():
        _, hidden = target(text, return_hidden=True)
    opt = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    for _ in range(150):
        logits = mtp(target, hidden, text)[0][:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), text[:, 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, mtp.eval().requires_grad_(False)


LONG = [list(range(1, 20)) * 2]  # longer than the prefill chunk used below


@pytest.mark.parametrize("tree", ["chain:1", "chain:4", "tree:2,2,1", "parents:-1,0,0,1,1,2", "dynamic:7,3,2"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_greedy_mtp_equals_ar(target_and_mtp, tree, block_size):
    target, mtp = target_and_mtp
    prompts = PROMPTS + [[5]]  # batch of 4, one of them a one-token prompt (no hidden state before its root)
    ar = generate_ar(target, prompts, 16)
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, tree), block_size=block_size).generate(prompts, 16)
    assert out.tokens == ar.tokens
    one = SpeculativeDecoder(target, MTPDrafter(target, mtp, tree)).generate(prompts[:1], 16)
    assert one.tokens == ar.tokens[:1]


def test_mtp_drafts_get_accepted(target_and_mtp):
    """Not only lossless: the trained head's chain drafts are accepted well beyond chance."""
    target, mtp = target_and_mtp
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:4")).generate(PROMPTS, 24)
    assert out.summary["acceptance_by_depth"][0] > 0.5


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1", "dynamic:7,3,2"])
def test_mtp_cache_after_rejections_equals_a_fresh_run(target_and_mtp, tree):
    """After many steps with partial acceptance, the heads' committed K/V equal those of a drafter started
    from scratch on the committed tokens (rejected and recycled-hidden entries were not kept)."""
    target, mtp = target_and_mtp
    drafter = MTPDrafter(target, mtp, tree)
    out = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    hist = out.summary["acceptance_by_depth"]
    assert 0.0 < hist[-1] < 1.0 and hist[0] > 0.0  # both full-depth and rejected drafts happened
    assert_heads_cache_matches_a_fresh_run(target, mtp, drafter, tree, PROMPTS, out.tokens)


def assert_heads_cache_matches_a_fresh_run(target, head, drafter, tree, prompts, outputs):
    """The heads' committed K/V of each request equal those of a drafter of its kind (MTP, EAGLE-3: `head` its
    module) started from scratch on its committed tokens."""
    for b, prompt in enumerate(prompts):
        seq = prompt + outputs[b]
        n = int(drafter.cache.lens[b])
        assert n >= len(prompt) - 1
        fresh = type(drafter)(target, head, tree)
        x = torch.tensor([seq + [0] * 8])
        lens = torch.tensor([n + 2], dtype=torch.int32)  # its cache commits positions 0 .. lens - 3
        with torch.no_grad():
            hidden = target.prefill(target.new_cache(1, 96), x, lens - 1, return_hidden=drafter.uses_target_hidden)
            fresh.start(x, lens, 96, torch.zeros(1), [0], target_hidden=hidden)
        assert int(fresh.cache.lens[0]) == n
        m = min(n, len(seq) - 1)  # (a finished request rides along past its cut output: compare what it shows)
        assert m > len(prompt)
        torch.testing.assert_close(drafter.cache.k[:, b, :m], fresh.cache.k[:, 0, :m], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(drafter.cache.v[:, b, :m], fresh.cache.v[:, 0, :m], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree, filters", [("chain:3", {}), ("tree:2,2,1", {}), ("dynamic:6,3,2", {}),
                                           ("chain:3", dict(top_k=5, min_p=0.05))])
def test_mtp_sampling_is_lossless(target_and_mtp, tree, filters):
    """Many seeds in one batch at T=1: the first two tokens follow the target's exact (processed) law
    (chi-square), with drafts that do get accepted (chain and tree: the module's sampled children with its
    logits; dynamic: given proposals)."""
    from test_loop import chi_square_two_tokens, exact_filtered_two_token_law
    target, mtp = target_and_mtp
    prompt, n = [3, 9, 4, 1], 800
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, tree)).generate(
        [prompt] * n, 2, 1.0, seed=list(range(100, 100 + n)), **filters)
    law = exact_filtered_two_token_law(target, prompt, 1.0, **filters)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 5 and all(tuple(t[:2]) in law for t in out.tokens)
    assert stat < threshold, stat
    assert out.summary["acceptance_by_depth"][0] > 0.2  # the drafts took part


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1", "dynamic:7,3,2"])
def test_mtp_root_logits_after_rejections_equal_the_causal_forward(target_and_mtp, tree):
    """At every step, after whatever the previous step accepted and rejected, the module's logits for the root
    (from its cache plus the pending entries) equal its causal forward over the committed sequence."""
    target, mtp = target_and_mtp
    drafter = MTPDrafter(target, mtp, tree)
    run_root, compared = drafter._root_logits, []

    def checked(tokens, seq_lens):
        logits = run_root(tokens, seq_lens)
        for b, n in enumerate(seq_lens.tolist()):
            if n >= 2:
                seq = tokens[b:b + 1, :n]
                _, hidden = target(seq, return_hidden=True)
                torch.testing.assert_close(logits[b], mtp(target, hidden, seq)[0][0, n - 2], atol=1e-4, rtol=1e-4)
                compared.append(n)
        return logits

    drafter._root_logits = checked
    out = SpeculativeDecoder(target, drafter).generate(PROMPTS, 20)
    hist = out.summary["acceptance_by_depth"]
    assert 0.0 < hist[-1] < 1.0 and len(compared) > 3 * len(PROMPTS)  # paths were cut, at many steps


def test_long_prompt_prefills_in_chunks(target_and_mtp, monkeypatch):
    target, mtp = target_and_mtp
    import specdec.loop.drafters.mtp as mod
    monkeypatch.setattr(mod, "PREFILL_CHUNK", 7)
    ar = generate_ar(target, LONG, 12)
    assert SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:3")).generate(LONG, 12).tokens == ar.tokens


def test_more_than_one_module_is_refused(target_and_mtp):
    target, _ = target_and_mtp
    with pytest.raises(ValueError, match="mtp"):
        MTPDrafter(target, MTP(target.cfg, 2))


# ----------------------------------------------------------------------------------------------
# checkpoints: DeepSeek-V3 and Qwen3-Next names, against a forward written from the raw tensors
# ----------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_layer(w, p, x, cfg, norm):
    """A Llama/Qwen3 decoder layer straight from Hugging Face tensors named p + '...' (rotate_half RoPE,
    GQA by repeating the KV heads, an explicit causal softmax)."""
    T, hd = x.shape[1], cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return t * cos + torch.cat((-t2, t1), -1) * sin

    h = norm(x, w[p + "input_layernorm.weight"])
    q = (h @ w[p + "self_attn.q_proj.weight"].T).view(1, T, cfg.n_heads, hd)
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(1, T, cfg.n_kv_heads, hd)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(1, T, cfg.n_kv_heads, hd)
    if cfg.qk_norm:
        q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
    q, k = rope(q.transpose(1, 2)), rope(k.transpose(1, 2))
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, T, -1)
    x = x + att @ w[p + "self_attn.o_proj.weight"].T
    h = norm(x, w[p + "post_attention_layernorm.weight"])
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def _random_mtp_tensors(cfg, layout, gen):
    """One MTP layer's tensors in `layout` (dense Llama/Qwen3 block), with non-trivial norms."""
    d, hd, f = cfg.dim, cfg.head_dim, cfg.intermediate_size
    shapes = {"self_attn.q_proj.weight": (cfg.n_heads * hd, d), "self_attn.k_proj.weight": (cfg.n_kv_heads * hd, d),
              "self_attn.v_proj.weight": (cfg.n_kv_heads * hd, d), "self_attn.o_proj.weight": (d, cfg.n_heads * hd),
              "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
              "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    if cfg.qk_norm:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    layer, own = ((f"model.layers.{cfg.n_layers}.", {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                                                      "norm": "shared_head.norm"})
                  if layout == "deepseek" else
                  ("mtp.layers.0.", {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc",
                                     "norm": "norm"}))
    own_prefix = f"model.layers.{cfg.n_layers}." if layout == "deepseek" else "mtp."
    w = {layer + k: torch.randn(s, generator=gen) * (0.3 if len(s) == 1 else 0.2) for k, s in shapes.items()}
    for role, name in own.items():
        shape = (d, 2 * d) if role == "eh_proj" else (d,)
        w[f"{own_prefix}{name}.weight"] = torch.randn(shape, generator=gen) * (0.3 if len(shape) == 1 else 0.1)
    if layout == "deepseek":
        w[layer + "embed_tokens.weight"] = torch.zeros(cfg.vocab_size, d)  # copies of the target's: not read
        w[layer + "shared_head.head.weight"] = torch.zeros(cfg.vocab_size, d)
    else:
        for name in list(w):
            if name.endswith("norm.weight") and not name.startswith("model."):
                w[name] = w[name] - 1  # Qwen3-Next stores zero-centred norms (scale 1 + w); these ones centre on 0
    return w, layer, own_prefix, own


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_hf_mtp_layer_loads_and_matches_a_forward_from_its_tensors(tmp_path, layout):
    """A target folder that also holds an MTP layer: load_model reads the target and skips the layer,
    load_mtp reads the layer; MTP.forward equals a forward written here from the raw tensors."""
    from test_models import tiny as tiny_target
    from specdec.loop.models.hf import load_model, save_model
    from specdec.loop.models.mtp import load_mtp, mtp_folder
    from safetensors.torch import save_file
    import json
    target = tiny_target(0, qk_norm=layout == "qwen3_next")
    save_model(target, str(tmp_path), dtype=torch.float32)
    w, layer, own_prefix, own = _random_mtp_tensors(target.cfg, layout, torch.Generator().manual_seed(1))
    save_file(w, str(tmp_path / "model-mtp.safetensors"))
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    key = "num_nextn_predict_layers" if layout == "deepseek" else "mtp_num_hidden_layers"
    (tmp_path / "config.json").write_text(json.dumps({**cfg_json, key: 1}))
    assert mtp_folder(str(tmp_path)) and not mtp_folder(str(tmp_path / "absent"))

    loaded = load_model(str(tmp_path))
    x = torch.randint(0, target.cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, hidden = target(x, return_hidden=True)
        assert torch.equal(loaded(x), logits)
        ours = load_mtp(str(tmp_path), target.cfg)(target, hidden, x)[0]

    eps = target.cfg.norm_eps
    shift = 1.0 if layout == "qwen3_next" else 0.0
    norm = lambda t, wt: _rms(t, wt + shift, eps)  # noqa: E731
    name = {role: f"{own_prefix}{n}.weight" for role, n in own.items()}
    h = _rms(hidden, target.model.norm.weight, eps)[:, :-1]
    e = target.model.embed_tokens.weight[x[:, 1:]]
    fused = torch.cat((norm(e, w[name["enorm"]]), norm(h, w[name["hnorm"]])), -1) @ w[name["eh_proj"]].T
    out = _reference_layer(w, layer, fused, target.cfg, norm)
    expected = norm(out, w[name["norm"]]) @ target.lm_head.weight.T
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_bad_mtp_folders(tmp_path):
    from test_models import tiny as tiny_target
    from specdec.loop.models.hf import CheckpointError, save_model
    from specdec.loop.models.mtp import load_mtp, save_mtp
    from safetensors.torch import load_file, save_file
    target = tiny_target(0)
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_mtp(str(tmp_path), target.cfg)
    save_model(target, str(tmp_path))  # a target without MTP layers
    with pytest.raises(CheckpointError, match="no MTP layers"):
        load_mtp(str(tmp_path), target.cfg)
    heads = tmp_path / "heads"
    save_mtp(MTP(target.cfg, 1), str(heads))
    other = tiny_target(0, dim=48)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_mtp(str(heads), other.cfg)
    state = load_file(str(heads / "model.safetensors"))
    state.pop(f"model.layers.{target.cfg.n_layers}.hnorm.weight")
    save_file(state, str(heads / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing weights.*hnorm"):
        load_mtp(str(heads), target.cfg)


def test_saved_heads_load_back_exactly(tmp_path, target_and_mtp):
    from specdec.loop.models.mtp import load_mtp, save_mtp
    target, mtp = target_and_mtp
    save_mtp(mtp, str(tmp_path), dtype=torch.float32)
    back = load_mtp(str(tmp_path), target.cfg)
    assert back.state_dict().keys() == mtp.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), mtp.state_dict().values()))


# ----------------------------------------------------------------------------------------------
# CLI and the shipped module
# ----------------------------------------------------------------------------------------------
from test_loop import byte_pair, run_cli  # noqa: E402,F401  (the CLI tests' tiny checkpoints)


def test_cli_mtp_drafter(capsys, byte_pair, tmp_path):  # noqa: F811
    """--drafter mtp with --mtp DIR, and by default from a target folder that holds its MTP layer (DeepSeek-V3
    style): greedy output identical to AR, chain and dynamic tree."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    from specdec.loop.cli import main as cli_main  # noqa: F401
    from specdec.loop.models.hf import load_model
    from specdec.loop.models.mtp import save_mtp
    target = load_model(str(byte_pair / "target"))
    torch.manual_seed(0)
    save_mtp(MTP(target.cfg, 1), str(tmp_path / "heads"))
    base = ["--prompt", "def f(x):", "--prompt", "import", "--target", str(byte_pair / "target"), "--drafter", "mtp",
            "--max-new-tokens", "8", "--compare-ar", "--json"]
    for tree in ("chain:3", "dynamic:6,3,2"):
        rc, out, _ = run_cli(capsys, *base, "--mtp", str(tmp_path / "heads"), "--tree", tree)
        r = json.loads(out)
        assert rc == 0 and r["drafter"] == "mtp" and r["identical"] and len(r["tokens"][0]) == 8
    both = tmp_path / "target_with_mtp"
    shutil.copytree(byte_pair / "target", both)
    save_file(load_file(str(tmp_path / "heads" / "model.safetensors")), str(both / "model-mtp.safetensors"))
    cfg = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    rc, out, _ = run_cli(capsys, *base[:5], str(both), *base[6:])
    assert rc == 0 and json.loads(out)["identical"]


def test_shipped_mtp_module_drafts_the_shipped_target():
    """specdec/loop/assets/mtp: loads for the shipped target, and its drafts are accepted on a held-out prompt
    (greedy output equal to AR)."""
    import os
    from specdec.loop.cli import ASSETS
    from specdec.loop.models.hf import load_model
    from specdec.loop.models.mtp import load_mtp
    from specdec.loop.models.tokenizer import ByteTokenizer
    target = load_model(os.path.join(ASSETS, "target"))
    mtp = load_mtp(os.path.join(ASSETS, "mtp"), target.cfg)
    prompt = [ByteTokenizer().encode("import os\n\n\ndef main(argv):\n    parser = ")]
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:3")).generate(prompt, 32)
    assert out.tokens == generate_ar(target, prompt, 32).tokens
    assert out.summary["acceptance_by_depth"][0] > 0.6


def test_compiled_mtp_drafter_equals_ar(target_and_mtp):
    """compile=True: the MTP step (pending entries, the levels, the target's forward, accept, commit) is one
    graph (with adaptive depths: test_adaptive)."""
    from torch._dynamo.utils import counters
    target, mtp = target_and_mtp
    ar = generate_ar(target, PROMPTS, 10).tokens
    counters.clear()
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:2"), compile=True).generate(PROMPTS, 10)
    assert out.tokens == ar and counters["stats"]["unique_graphs"] == 1


# real DeepSeek-V3 checkpoints' names for one MTP layer (model.layers.61.* of its safetensors index), per expert e
DEEPSEEK_V3_MTP_NAMES = (
    "eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "shared_head.head.weight",
    "embed_tokens.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
    "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")


@pytest.fixture(scope="module")
def deepseek_target_and_mtp():
    """A DeepSeek-V3-style target (MLA, experts) and an untrained MTP module of its kind (MLA + experts)."""
    from test_models import deepseek_tiny
    target = deepseek_tiny(seed=4)
    torch.manual_seed(5)
    mtp = MTP(target.cfg, 1).eval().requires_grad_(False)
    with torch.no_grad():
        mtp.layers[0].block.mlp.gate.e_score_correction_bias.normal_(0, 0.5)
    return target, mtp


def test_deepseek_v3_mtp_layer_loads_from_its_real_names_and_shapes(tmp_path, deepseek_target_and_mtp):
    """An MTP layer stored as DeepSeek-V3 stores it (model.layers.{n_layers}.*, MLA and MoE with per-expert
    weights, its own copies of the embedding and head): load_mtp reads it into an MLA + MoE module that equals
    the one saved (its logits too), from exactly DeepSeek-V3's tensor names; shapes follow the config."""
    from safetensors.torch import load_file, save_file
    from specdec.loop.models.mtp import load_mtp, save_mtp
    target, mtp = deepseek_target_and_mtp
    save_mtp(mtp, str(tmp_path), dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    n, cfg = target.cfg.n_layers, target.cfg
    state[f"model.layers.{n}.embed_tokens.weight"] = target.model.embed_tokens.weight.clone()
    state[f"model.layers.{n}.shared_head.head.weight"] = target.lm_head.weight.clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    names = {f"model.layers.{n}." + name.format(e=e) for name in DEEPSEEK_V3_MTP_NAMES
             for e in range(cfg.n_routed_experts)}
    assert set(state) == names
    assert state[f"model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight"].shape == (
        cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.dim)
    assert state[f"model.layers.{n}.mlp.experts.0.gate_proj.weight"].shape == (cfg.moe_intermediate_size, cfg.dim)
    loaded = load_mtp(str(tmp_path), cfg)
    assert loaded.state_dict().keys() == mtp.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), mtp.state_dict().values()))
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        _, hidden = target(x, return_hidden=True)
        assert torch.equal(loaded(target, hidden, x)[0], mtp(target, hidden, x)[0])


@pytest.mark.parametrize("tree,block_size", [("chain:3", None), ("dynamic:7,3,2", 4)])
def test_greedy_mtp_on_a_deepseek_style_target_equals_ar(deepseek_target_and_mtp, tree, block_size):
    """--drafter mtp on a DeepSeek-V3-style target, its MTP module MLA + MoE on a latent-only cache: greedy
    speculative output equals greedy AR."""
    target, mtp = deepseek_target_and_mtp
    ar = generate_ar(target, PROMPTS, 12)
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, tree), block_size=block_size).generate(PROMPTS, 12)
    assert out.tokens == ar.tokens
