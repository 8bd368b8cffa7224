"""EAGLE-3 heads (specdec.loop.models.eagle3) and their drafter (specdec.loop.drafters.eagle3): checkpoints in the
EAGLE authors' and vLLM speculators' layouts against a forward written from their raw tensors, greedy speculative
output equal to AR, the sampled law the target's (chi-square), and the head's cache after rejected paths equal to a
fresh run over the accepted tokens."""
from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import draft_model
from specdec.loop.drafters.eagle3 import Eagle3Drafter
from specdec.loop.models.eagle3 import Eagle3, default_aux_layers, load_eagle3, save_eagle3
from specdec.loop.models.hf import CheckpointError
from specdec.loop.models.llama import LlamaConfig

from test_adaptive import PROMPTS4, scripted
from test_loop import PROMPTS, chi_square_two_tokens, exact_filtered_two_token_law, tiny
from test_mtp import _rms, assert_heads_cache_matches_a_fresh_run

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = (1, 2, 4)  # of a 4-layer target: the streams entering layers 1 and 2, and the last layer's output
DRAFT_IDS = [0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 17, 18, 19, 20, 22, 23]  # 20 of the 24 target tokens


def head_config(dim=32, vocab=24) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, dim=dim, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=48)


@pytest.fixture(scope="module")
def target_and_head():
    """A tiny 4-layer target and an EAGLE-3 head over a draft vocabulary of 20 of its 24 tokens, trained for a few
    seconds on the target's own greedy text (depth 2: the recycled step too), so that drafts are accepted sometimes
    and rejected sometimes."""
    target = tiny(0, layers=4)
    torch.manual_seed(3)
    head = Eagle3(head_config(), target_dim=32, aux_layers=AUX, draft_vocab_size=len(DRAFT_IDS))
    head.d2t.copy_(torch.tensor(DRAFT_IDS) - torch.arange(len(DRAFT_IDS)))
    t2d = torch.full((24,), -100, dtype=torch.long)
    t2d[DRAFT_IDS] = torch.arange(len(DRAFT_IDS))
    prompts = torch.randint(0, 24, (64, 3)).tolist()
    text = torch.tensor([p + t for p, t in zip(prompts, generate_ar(target, prompts, 29).tokens)])
    with torch.no_grad():
        _, hidden = target(text, return_hidden=AUX)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(150):
        h, loss = head.condition(hidden), 0.0
        for k in range(2):  # the draft vocabulary's logits against the labels it has (others ignored)
            n = text.shape[1] - k - 1
            cos, sin = head.rope(torch.arange(n).expand(text.shape[0], n))
            h = head.midlayer(head.embed(target, text[:, k + 1:]), h[:, :n], cos, sin)
            logits = head.draft_logits(h)[:, :-1]
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                            t2d[text[:, k + 2:]].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, head.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# the head
# ----------------------------------------------------------------------------------------------
def test_draft_law_is_exact_over_the_target_vocabulary(target_and_head):
    """The logits given to accept: the draft token i's at target id i + d2t[i], -inf at the 4 ids no draft token
    maps to (their draft probability is 0)."""
    target, head = target_and_head
    out = torch.randn(3, 32)
    full, draft = head.logits(out), head.draft_logits(out)
    assert torch.equal(full[:, DRAFT_IDS], draft)
    outside = [t for t in range(24) if t not in DRAFT_IDS]
    assert torch.isneginf(full[:, outside]).all() and torch.isfinite(full[:, DRAFT_IDS]).all()


def _streams_entering_layers(target, tokens):
    """The target's residual stream entering each layer, run layer by layer, then its last layer's output:
    n_layers + 1 tensors (1, T, dim)."""
    T = tokens.shape[1]
    cos, sin = target.rope(torch.arange(T).expand(1, T))
    x, entering = target.model.embed_tokens(tokens), []
    for layer in target.model.layers:
        entering.append(x)
        x = layer(x, cos, sin)
    return entering + [x]


def test_target_streams_are_the_residuals_entering_the_layers(target_and_head):
    """return_hidden=layer ids: the residual streams entering those layers (n_layers: the last layer's output), as
    vLLM's targets collect them, concatenated in layer order; the same from the cached forward and the prefill."""
    target, _ = target_and_head
    tokens = torch.tensor([PROMPTS[0]])
    T = tokens.shape[1]
    entering = _streams_entering_layers(target, tokens)
    _, hidden = target(tokens, return_hidden=AUX)
    torch.testing.assert_close(hidden, torch.cat([entering[i] for i in AUX], dim=-1))
    _, last = target(tokens, return_hidden=True)
    torch.testing.assert_close(last, entering[-1])
    prefilled = target.prefill(target.new_cache(1, 32), tokens, torch.tensor([T]), chunk=3, return_hidden=AUX)
    torch.testing.assert_close(prefilled, hidden, atol=1e-5, rtol=1e-5)
    for bad in [(2, 1, 3), (1, 1, 2), (0, 5)]:
        with pytest.raises(ValueError, match="return_hidden"):
            target(tokens, return_hidden=bad)


# ----------------------------------------------------------------------------------------------
# checkpoints: the EAGLE authors' and vLLM speculators' layouts, against a forward from the raw tensors
# ----------------------------------------------------------------------------------------------
def _random_checkpoint(cfg, layout, gen, *, target_dim, n_aux=3, draft_vocab=16, own_embedding=False):
    """A head's tensors by the layout's public names (q/k/v, gate/up apart; non-trivial norms, a d2t onto a subset)."""
    d, hd, f = cfg.dim, cfg.head_dim, cfg.intermediate_size
    layer = "midlayer." if layout == "eagle" else "layers.0."
    shapes = {"self_attn.q_proj.weight": (cfg.n_heads * hd, 2 * d),
              "self_attn.k_proj.weight": (cfg.n_kv_heads * hd, 2 * d),
              "self_attn.v_proj.weight": (cfg.n_kv_heads * hd, 2 * d),
              "self_attn.o_proj.weight": (d, cfg.n_heads * hd), "mlp.gate_proj.weight": (f, d),
              "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f), "input_layernorm.weight": (d,),
              "hidden_norm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    w = {layer + k: torch.randn(s, generator=gen) * 0.2 + (1.0 if len(s) == 1 else 0.0) for k, s in shapes.items()}
    w["fc.weight"] = torch.randn(d, n_aux * target_dim, generator=gen) * 0.1
    w["norm.weight"] = torch.randn(d, generator=gen) * 0.2 + 1
    w["lm_head.weight"] = torch.randn(draft_vocab, d, generator=gen) * 0.3
    ids = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab].sort().values
    w["d2t"] = ids - torch.arange(draft_vocab)
    w["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill(0, ids, True)
    if own_embedding:
        w["embed_tokens.weight"] = torch.randn(cfg.vocab_size, d, generator=gen) * 0.5
    return w, layer


def _write(path, layout, w, cfg, *, target_dim, draft_vocab, aux=None, norm_before_residual=None, dtype=None,
           pickled=False):
    """The tensors w as model.safetensors (or, pickled, pytorch_model.bin as the authors' first heads) and the
    layout's config.json."""
    os.makedirs(path, exist_ok=True)
    w = {k: v if dtype is None or not v.is_floating_point() else v.to(dtype) for k, v in w.items()}
    if pickled:
        torch.save(w, os.path.join(path, "pytorch_model.bin"))
    else:
        save_file(w, os.path.join(path, "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": cfg.dim, "num_attention_heads": cfg.n_heads,
             "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
             "num_hidden_layers": 1, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
             "vocab_size": cfg.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False}
    extra = {"draft_vocab_size": draft_vocab}
    if target_dim != cfg.dim:
        extra["target_hidden_size"] = target_dim
    if norm_before_residual is not None:
        extra["norm_before_residual"] = norm_before_residual
    if layout == "eagle":  # SafeAILab/EAGLE's LlamaForCausalLMEagle3 config: flat, aux ids under eagle_config
        hf = {"architectures": ["LlamaForCausalLMEagle3"], **layer, **extra}
        if aux is not None:
            hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    else:  # speculators' Eagle3SpeculatorConfig
        hf = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer, **extra,
              "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}}}
        if aux is not None:
            hf["eagle_aux_hidden_state_layer_ids"] = list(aux)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


def _reference_eagle3(w, p, cfg, target, tokens, aux, norm_before_residual, swap_norms=False):
    """EAGLE-3's first step straight from the tensors named as in the checkpoint: the target's residual streams
    entering layers aux (run layer by layer here), fc, the layer over cat(input_layernorm(embedding),
    hidden_norm(hidden)) with the hidden state as residual, final norm, lm_head, and the draft logits placed at
    their target ids (-inf elsewhere). Position j reads the streams at j and the embedding of tokens[j + 1]."""
    T = tokens.shape[1]
    entering = _streams_entering_layers(target, tokens)
    streams = torch.cat([entering[i] for i in aux], dim=-1)[:, :T - 1]
    embedding = w.get("embed_tokens.weight", target.model.embed_tokens.weight)[tokens[:, 1:]]
    eps, hd, n = cfg.norm_eps, cfg.head_dim, T - 1
    hidden = streams @ w["fc.weight"].T
    norm_e, norm_h = p + "input_layernorm.weight", p + "hidden_norm.weight"
    if swap_norms:
        norm_e, norm_h = norm_h, norm_e
    normed = _rms(hidden, w[norm_h], eps)
    a = torch.cat((_rms(embedding, w[norm_e], eps), normed), dim=-1)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(n).float()[:, None] * inv
    c, s = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(t):
        t1, t2 = t.chunk(2, -1)
        return t * c + torch.cat((-t2, t1), -1) * s

    q = rope((a @ w[p + "self_attn.q_proj.weight"].T).view(1, n, cfg.n_heads, hd).transpose(1, 2))
    k = rope((a @ w[p + "self_attn.k_proj.weight"].T).view(1, n, cfg.n_kv_heads, hd).transpose(1, 2))
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(1, n, cfg.n_kv_heads, hd).transpose(1, 2)
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2) / hd ** 0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                                float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n, -1) @ w[p + "self_attn.o_proj.weight"].T
    x = (normed if norm_before_residual else hidden) + attended
    m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    m = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
    x = x + m @ w[p + "mlp.down_proj.weight"].T
    draft = _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    full = torch.full((1, n, cfg.vocab_size), float("-inf"))
    full[..., torch.arange(draft.shape[-1]) + w["d2t"]] = draft
    return full


@pytest.mark.parametrize("layout, aux, norm_before_residual, own_embedding, pickled", [
    ("eagle", None, None, False, True),      # the authors' defaults: vLLM's aux layers, residual the hidden state
    ("eagle", [1, 3, 8], None, True, False),  # aux ids in eagle_config (8: the last layer's output), own embedding
    ("speculators", [2, 5, 6], False, True, False),
    ("speculators", None, None, False, False),  # no norm_before_residual: vLLM reads a speculators config as True
])
def test_public_layouts_load_and_match_a_forward_from_their_tensors(tmp_path, layout, aux, norm_before_residual,
                                                                    own_embedding, pickled):
    target = tiny(1, layers=8)
    cfg, gen = head_config(), torch.Generator().manual_seed(5)
    w, p = _random_checkpoint(cfg, layout, gen, target_dim=32, own_embedding=own_embedding)
    _write(tmp_path, layout, w, cfg, target_dim=32, draft_vocab=16, aux=aux, norm_before_residual=norm_before_residual,
           pickled=pickled)
    head = load_eagle3(str(tmp_path), target)
    expected_aux = tuple(aux) if aux else default_aux_layers(8)
    before_residual = layout == "speculators" if norm_before_residual is None else norm_before_residual
    assert head.aux_layers == expected_aux and (aux is not None or expected_aux == (2, 4, 5))
    assert head.norm_before_residual == before_residual and (head.embed_tokens is not None) == own_embedding
    tokens = torch.tensor([[3, 7, 1, 0, 22, 9, 4, 4, 15, 2]])
    _, streams = target(tokens, return_hidden=head.aux_layers)
    ours = head(target, streams, tokens)[0]
    reference = _reference_eagle3(w, p, cfg, target, tokens, expected_aux, before_residual)
    assert torch.equal(torch.isneginf(ours), torch.isneginf(reference)) and torch.isneginf(ours).any()
    finite = torch.isfinite(reference)
    torch.testing.assert_close(ours[finite], reference[finite], atol=1e-4, rtol=1e-4)
    # the comparison sees a mapping error: the two input norms swapped, or the other residual, change the output
    for wrong in (dict(swap_norms=True), dict(norm_before_residual=not before_residual)):
        kw = dict(norm_before_residual=before_residual) | wrong
        other = _reference_eagle3(w, p, cfg, target, tokens, expected_aux, **kw)
        assert (other[finite] - reference[finite]).abs().max() > 1e-2


def test_checkpoint_dtype_is_kept_and_a_wider_target_reads_fc(tmp_path):
    """A float16 checkpoint loads as float16 (unless a dtype is asked for); a head narrower than its target
    (target_hidden_size) with its own embedding loads, fc reading 3 * the target's width."""
    target = tiny(1, layers=8, dim=48)
    cfg, gen = head_config(dim=32), torch.Generator().manual_seed(6)
    w, _ = _random_checkpoint(cfg, "speculators", gen, target_dim=48, own_embedding=True)
    _write(tmp_path, "speculators", w, cfg, target_dim=48, draft_vocab=16, dtype=torch.float16)
    head = load_eagle3(str(tmp_path), target)
    assert head.dtype == torch.float16 and head.fc.weight.shape == (32, 144) and head.d2t.dtype == torch.long
    assert load_eagle3(str(tmp_path), target, dtype=torch.float32).dtype == torch.float32


def test_mismatched_heads_are_refused_by_name(tmp_path):
    cfg, gen = head_config(), torch.Generator().manual_seed(7)
    w, _ = _random_checkpoint(cfg, "eagle", gen, target_dim=32)
    _write(tmp_path / "ok", "eagle", w, cfg, target_dim=32, draft_vocab=16)
    with pytest.raises(CheckpointError, match="vocab_size 24 differs from the target's 30"):
        load_eagle3(str(tmp_path / "ok"), tiny(1, vocab=30, layers=8))
    with pytest.raises(CheckpointError, match="target hidden size 32 .* hidden_size 48"):
        load_eagle3(str(tmp_path / "ok"), tiny(1, dim=48, layers=8))
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle3(str(tmp_path / "ok"), tiny(1, layers=4))  # vLLM's defaults (2, 2, 1): not distinct, increasing
    both = w | {f"layers.0.{k[9:]}": v.clone() for k, v in w.items() if k.startswith("midlayer.")}
    _write(tmp_path / "aux", "speculators", both, cfg, target_dim=32, draft_vocab=16, aux=[1, 3, 9])
    with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids \[1, 3, 9\]"):
        load_eagle3(str(tmp_path / "aux"), tiny(1, layers=8))
    with pytest.raises(CheckpointError, match="unexpected weights"):  # the speculators names beside the authors'
        load_eagle3(str(tmp_path / "aux"), tiny(1, layers=9))
    bad = dict(w, d2t=w["d2t"] + 30)
    _write(tmp_path / "d2t", "eagle", bad, cfg, target_dim=32, draft_vocab=16)
    with pytest.raises(CheckpointError, match="d2t"):
        load_eagle3(str(tmp_path / "d2t"), tiny(1, layers=8))
    _write(tmp_path / "fc", "eagle", dict(w, **{"fc.weight": w["fc.weight"][:, :64].contiguous()}), cfg, target_dim=32,
           draft_vocab=16)
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_eagle3(str(tmp_path / "fc"), tiny(1, layers=8))
    with open(tmp_path / "ok" / "config.json") as f:
        hf = json.load(f)
    with open(tmp_path / "ok" / "config.json", "w") as f:
        json.dump(dict(hf, architectures=["LlamaForCausalLM"]), f)
    with pytest.raises(CheckpointError, match="LlamaForCausalLMEagle3"):
        load_eagle3(str(tmp_path / "ok"), tiny(1, layers=8))


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_saved_heads_load_back_exactly(tmp_path, target_and_head, layout):
    target, head = target_and_head
    save_eagle3(head, str(tmp_path), layout=layout, dtype=torch.float32)
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert (hf.get("speculators_model_type") == "eagle3") == (layout == "speculators")
    back = load_eagle3(str(tmp_path), target)
    tokens = torch.tensor([PROMPTS[2]])
    _, streams = target(tokens, return_hidden=AUX)
    assert back.aux_layers == AUX and torch.equal(back.d2t, head.d2t)
    torch.testing.assert_close(back(target, streams, tokens, 2), head(target, streams, tokens, 2))


# ----------------------------------------------------------------------------------------------
# the drafter: greedy equals AR, the sampled law is the target's, the state after rejections
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", ["chain:1", "chain:4", "tree:2,2,1", "dynamic:7,3,2"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_greedy_eagle3_equals_ar(target_and_head, tree, block_size):
    target, head = target_and_head
    ar = generate_ar(target, PROMPTS4, 16)  # batch of 4, one of them a one-token prompt (no entry before its root)
    out = SpeculativeDecoder(target, Eagle3Drafter(target, head, tree), block_size=block_size).generate(PROMPTS4, 16)
    assert out.tokens == ar.tokens
    one = SpeculativeDecoder(target, Eagle3Drafter(target, head, tree), block_size=block_size).generate(PROMPTS4[:1],
                                                                                                        16)
    assert one.tokens == ar.tokens[:1]


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_adaptive_eagle3_equals_ar(target_and_head, tree, batch):
    """Adaptive depth (the policy's, twice; and a script of skipped, shallow and full steps) keeps AR's output."""
    target, head = target_and_head
    prompts = PROMPTS4[:batch]
    ar = generate_ar(target, prompts, 24)
    decoder = SpeculativeDecoder(target, Eagle3Drafter(target, head, tree), adaptive=True, block_size=4)
    for _ in range(2):
        assert decoder.generate(prompts, 24).tokens == ar.tokens
    script = (0, 2, 0, 0, 9, 1, 0, 3)
    out = SpeculativeDecoder(target, Eagle3Drafter(target, head, tree), adaptive=scripted(script)).generate(prompts, 24)
    assert out.tokens == ar.tokens


def test_eagle3_drafts_get_accepted(target_and_head):
    """Not only lossless: the trained head's chain drafts are accepted well beyond chance."""
    target, head = target_and_head
    out = SpeculativeDecoder(target, Eagle3Drafter(target, head, "chain:4")).generate(PROMPTS, 24)
    assert out.summary["acceptance_by_depth"][0] > 0.5


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1", "dynamic:7,3,2"])
def test_eagle3_state_after_rejections_equals_a_fresh_run(target_and_head, tree):
    """After many steps with partial acceptance, the head's committed K/V and its pending entries (the accepted
    path's hidden inputs, from the target's streams) equal those of a drafter started from scratch on the committed
    tokens, and at every step its root logits equal its causal forward over the committed sequence."""
    target, head = target_and_head
    drafter = Eagle3Drafter(target, head, tree)
    run_root, compared = drafter._root_logits, []

    def checked(tokens, seq_lens):
        # before: the pending entries (positions cache.lens .. n - 2) are the head's hidden inputs from the target's
        # streams at their positions; after: the root's logits are the head's causal forward's
        lens, pending = drafter.cache.lens.tolist(), drafter.num_pending.tolist()
        streams = [target(tokens[b:b + 1, :n], return_hidden=AUX)[1] for b, n in enumerate(seq_lens.tolist())]
        for b, n in enumerate(seq_lens.tolist()):
            assert lens[b] + pending[b] == n - 1
            torch.testing.assert_close(drafter.pending[b, :pending[b]], head.condition(streams[b][0, lens[b]:n - 1]),
                                       atol=1e-5, rtol=1e-5)
        logits = run_root(tokens, seq_lens)
        for b, n in enumerate(seq_lens.tolist()):
            seq = tokens[b:b + 1, :n]
            torch.testing.assert_close(logits[b], head(target, streams[b], seq)[0][0, n - 2], atol=1e-4, rtol=1e-4)
            compared.append(n)
        return logits

    drafter._root_logits = checked
    out = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    hist = out.summary["acceptance_by_depth"]
    assert 0.0 < hist[-1] < 1.0 and hist[0] > 0.0 and len(compared) > 3 * len(PROMPTS)
    assert_heads_cache_matches_a_fresh_run(target, head, drafter, tree, PROMPTS, out.tokens)


class TopCandidatesAsDraws(Eagle3Drafter):
    """Negative control: each node's children are the head's top candidates, told to accept as draws from its law."""

    def propose(self, tokens, seq_lens, temperature, depth=None):
        top = lambda logits, temperature, k, *args, **kwargs: logits.topk(k, dim=-1).indices  # noqa: E731
        with mock.patch.object(draft_model, "sample", top):
            return super().propose(tokens, seq_lens, temperature, depth)


def _two_token_chi_square(target, drafter, filters):
    prompt, n = [3, 9, 4, 1], 800
    out = SpeculativeDecoder(target, drafter).generate([prompt] * n, 2, 1.0, seed=list(range(100, 100 + n)),
                                                       **filters)
    law = exact_filtered_two_token_law(target, prompt, 1.0, **filters)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 5
    return stat, threshold, out


@pytest.mark.parametrize("tree, filters", [("chain:3", {}), ("tree:2,2,1", {}), ("dynamic:6,3,2", {}),
                                           ("chain:3", dict(top_k=8, min_p=0.02))])
def test_eagle3_sampling_is_lossless(target_and_head, tree, filters):
    """Many seeds in one batch at T=1: the first two tokens follow the target's exact (processed) law (chi-square),
    with drafts from the draft vocabulary that do get accepted (chain and tree: children drawn from the head's law
    over the target's ids; dynamic: given proposals)."""
    target, head = target_and_head
    stat, threshold, out = _two_token_chi_square(target, Eagle3Drafter(target, head, tree), filters)
    assert stat < threshold, stat
    assert out.summary["acceptance_by_depth"][0] > 0.1  # the drafts took part


def test_sampling_test_detects_children_not_drawn_from_the_law(target_and_head):
    """Negative control for the test above: the top candidates told to accept as draws fail it by far."""
    target, head = target_and_head
    stat, threshold, _ = _two_token_chi_square(target, TopCandidatesAsDraws(target, head, "tree:3,2"), {})
    assert stat > 10 * threshold, stat


def test_heads_that_do_not_fit_the_target_are_refused(target_and_head):
    target, head = target_and_head
    with pytest.raises(ValueError, match="vocabulary 24"):
        Eagle3Drafter(tiny(2, vocab=30, layers=4), head)
    with pytest.raises(ValueError, match="return_hidden"):
        Eagle3Drafter(tiny(2, layers=2), head)  # its layers 3 and 4 do not exist


def test_cli_eagle3_drafter(capsys, tmp_path):
    """--drafter eagle3 --eagle3 DIR on the shipped target, with a random head saved in each public layout: greedy
    output identical to AR (chain and --tree auto); a head for another target, or no --eagle3, is refused by name."""
    from specdec.loop.models.hf import load_model
    from specdec.loop.cli import ASSETS
    from test_loop import run_cli
    target = load_model(os.path.join(ASSETS, "target"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, dim=384, n_layers=1, n_heads=6, n_kv_heads=2, intermediate_size=256)
    head = Eagle3(cfg, target_dim=384, aux_layers=(1, 3, 5), draft_vocab_size=128)
    head.d2t.copy_(torch.arange(128))  # the even target ids
    for layout in ("eagle", "speculators"):
        save_eagle3(head, str(tmp_path / layout), layout=layout)
        base = ["--prompt", "def main():", "--prompt", "import os", "--drafter", "eagle3", "--eagle3",
                str(tmp_path / layout), "--max-new-tokens", "10", "--compare-ar", "--json"]
        for tree in ("chain:3", "auto"):
            rc, out, _ = run_cli(capsys, *base, "--tree", tree)
            result = json.loads(out)
            assert rc == 0 and result["drafter"] == "eagle3" and result["identical"], (layout, tree)
    assert target.cfg.n_layers == 6
    rc, out, err = run_cli(capsys, "--prompt", "x", "--drafter", "eagle3", "--eagle3", str(tmp_path / "eagle"),
                           "--target", os.path.join(ASSETS, "draft"), "--max-new-tokens", "4")
    assert rc == 2 and "EAGLE-3" in err and out == ""
    rc, out, err = run_cli(capsys, "--prompt", "x", "--drafter", "eagle3", "--max-new-tokens", "4")
    assert rc == 2 and "--eagle3 DIR" in err and out == ""


def test_replayed_eagle3_steps_equal_eager_steps(target_and_head):
    """Replayed steps (emulated CUDA graphs: the drafter's state written in place, no host read) over skipped,
    shallow and full steps give the eager loop's output and acceptance, and AR's output."""
    from helpers import ReplayGraph
    target, head = target_and_head
    script = (0, 2, 0, 0, 9, 1, 0, 3)
    eager = SpeculativeDecoder(target, Eagle3Drafter(target, head, "tree:2,2,1"),
                               adaptive=scripted(script)).generate(PROMPTS4, 24)
    out = SpeculativeDecoder(target, Eagle3Drafter(target, head, "tree:2,2,1"), cuda_graphs=ReplayGraph,
                             adaptive=scripted(script)).generate(PROMPTS4, 24)
    assert out.tokens == eager.tokens == generate_ar(target, PROMPTS4, 24).tokens
    assert [s["acceptance_by_depth"] for s in out.stats] == [s["acceptance_by_depth"] for s in eager.stats]


def test_compiled_eagle3_drafter_equals_ar(target_and_head):
    """compile=True: the step (the target's aux streams, the head's pending entries and levels, accept, commit) is
    one graph."""
    from torch._dynamo.utils import counters
    target, head = target_and_head
    ar = generate_ar(target, PROMPTS, 10).tokens
    counters.clear()
    out = SpeculativeDecoder(target, Eagle3Drafter(target, head, "chain:2"), compile=True).generate(PROMPTS, 10)
    assert out.tokens == ar and counters["stats"]["unique_graphs"] == 1
