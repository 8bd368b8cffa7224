"""The draft -> verify -> accept loop: greedy speculative output == greedy autoregressive output token for
token (every drafter and tree shape), independent finishing, lossless sampling on the shipped pair, CLI."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specdec.loop.decoding import SpeculativeDecoder, batch_bucket, generate_ar
from specdec.loop.drafters import DraftModelDrafter, Drafter, NgramDrafter, NoDrafter, Proposal, parse_tree
from specdec.loop.cli import ASSETS, main as cli_main
from specdec.loop.models.hf import load_model, save_model
from specdec.loop.models.llama import Llama, LlamaConfig
from specdec.loop.models.tokenizer import VOCAB_SIZE, ByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed, vocab=24, dim=32, layers=2, eos=None, window=None, **kw) -> Llama:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, intermediate_size=2 * dim,
                      eos_token_id=eos, sliding_window=window, **kw)
    model = Llama(cfg).eval()
    with torch.no_grad():  # sharper next-token laws than the default init, so drafts get accepted sometimes
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def pair():
    return tiny(0), tiny(1, dim=16, layers=1)


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7], [3, 9, 1, 2, 9, 1, 2, 9, 1]]


@pytest.mark.parametrize("tree", ["chain:1", "chain:4", "tree:2,2,1", "parents:-1,0,0,0,1,1,2,4", "dynamic:7,3,2",
                                  "dynamic:12,4,3"])
def test_greedy_draft_model_equals_ar(pair, tree):
    target, draft = pair
    ar = generate_ar(target, PROMPTS, 10)
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, tree)).generate(PROMPTS, 10)
    assert out.tokens == ar.tokens
    assert all(len(t) == 10 for t in out.tokens)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_greedy_with_float8_target_cache_equals_ar(pair, kv_dtype):
    """A float8 target cache (quantized by kv_append, dequantized by tree_attention): greedy speculative output
    equals greedy autoregressive output over the same cache dtype, contiguous and paged. The cache really is
    lossy: with e5m2 the output differs from the full-precision cache's."""
    target, draft = pair
    ar = generate_ar(target, PROMPTS, 10, kv_dtype=kv_dtype)
    for tree, block_size, draft_kv in (("chain:4", None, None), ("dynamic:7,3,2", 4, kv_dtype)):
        drafter = DraftModelDrafter(draft, tree, kv_dtype=draft_kv)  # the draft's cache in float8 too
        out = SpeculativeDecoder(target, drafter, block_size=block_size, kv_dtype=kv_dtype)
        assert out.generate(PROMPTS, 10).tokens == ar.tokens
        assert drafter.cache.k.dtype == (draft_kv or draft.dtype)
    if kv_dtype == torch.float8_e5m2:
        assert ar.tokens != generate_ar(target, PROMPTS, 10).tokens


def test_greedy_with_sliding_window_target_equals_ar(pair):
    """A target whose layers see the last 8 positions only (Mistral-style): the sequences outgrow the window,
    greedy speculative output still equals greedy autoregressive output, and the window changes the output."""
    target, draft = tiny(0, window=8), pair[1]
    ar = generate_ar(target, PROMPTS, 12)
    for tree, block_size in (("chain:4", None), ("dynamic:7,3,2", 4)):
        out = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), block_size=block_size)
        assert out.generate(PROMPTS, 12).tokens == ar.tokens
    assert ar.tokens != generate_ar(pair[0], PROMPTS, 12).tokens


def test_greedy_with_gpt_oss_style_target_equals_ar(pair):
    """A gpt-oss-style target (attention sinks through tree_attention, experts, a window of 8 in every other layer,
    YaRN): greedy speculative output equals greedy autoregressive output, for a chain and a dynamic tree on a
    paged cache; the sinks change the output."""
    import copy
    target = tiny(0, window=8, layer_types=["sliding_attention", "full_attention"], attention_sinks=True,
                  num_experts=4, experts_per_token=2, qkv_bias=True, o_bias=True,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    ar = generate_ar(target, PROMPTS, 12)
    for tree, block_size in (("chain:4", None), ("dynamic:7,3,2", 4)):
        out = SpeculativeDecoder(target, DraftModelDrafter(pair[1], tree), block_size=block_size)
        assert out.generate(PROMPTS, 12).tokens == ar.tokens
    sinkless = copy.deepcopy(target)
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))
    assert generate_ar(sinkless, PROMPTS, 12).tokens != ar.tokens


def test_greedy_with_deepseek_style_target_equals_ar(pair):
    """A DeepSeek-V3-style target (multi-head latent attention in its absorbed form on a latent-only cache, group-
    limited experts with a shared one, YaRN): greedy speculative output equals greedy autoregressive output, for a
    chain, a dynamic tree on a paged cache and a float8 latent cache (AR over the same cache dtype)."""
    target = tiny(0, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=8, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16, n_group=4,
                  topk_group=2, experts_per_token=2, first_k_dense_replace=1,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                "mscale": 1.0, "mscale_all_dim": 1.0})
    ar = generate_ar(target, PROMPTS, 12)
    for tree, block_size in (("chain:4", None), ("dynamic:7,3,2", 4)):
        out = SpeculativeDecoder(target, DraftModelDrafter(pair[1], tree), block_size=block_size)
        assert out.generate(PROMPTS, 12).tokens == ar.tokens
    fp8 = generate_ar(target, PROMPTS, 12, kv_dtype=torch.float8_e4m3fn)
    out = SpeculativeDecoder(target, DraftModelDrafter(pair[1], "tree:2,2,1"), kv_dtype=torch.float8_e4m3fn)
    assert out.generate(PROMPTS, 12).tokens == fp8.tokens

def test_greedy_loop_on_the_triton_kernels_equals_ar(monkeypatch):
    """The whole loop on the Triton kernels (the GPU path; here through the interpreter): greedy speculative
    output equals greedy autoregressive output, which equals the default CPU backend's."""
    target, draft = tiny(0, dim=64), tiny(1, dim=64, layers=1)  # head dim 16: the Triton kernels' smallest
    prompts = PROMPTS[:2]
    default_ar = generate_ar(target, prompts, 5).tokens
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    assert generate_ar(target, prompts, 5).tokens == default_ar
    for block_size in (None, 4):
        out = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1"), block_size=block_size)
        assert out.generate(prompts, 5).tokens == default_ar
    float8_ar = generate_ar(target, prompts, 5, kv_dtype=torch.float8_e4m3fn).tokens  # vLLM's fp8 KV cache
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1"), block_size=4, kv_dtype=torch.float8_e4m3fn)
    assert out.generate(prompts, 5).tokens == float8_ar


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:7,3,2"])
def test_greedy_qwen3_pair_equals_ar(tree):
    """A Qwen3 target with a Qwen3 draft (q/k norms, head_dim apart from dim / heads): greedy speculative output
    equals greedy AR token for token."""
    target, draft = tiny(10, qk_norm=True, head_dim=16), tiny(11, dim=16, layers=1, qk_norm=True, head_dim=8)
    ar = generate_ar(target, PROMPTS, 10)
    assert SpeculativeDecoder(target, DraftModelDrafter(draft, tree)).generate(PROMPTS, 10).tokens == ar.tokens


def test_greedy_with_paged_target_cache(pair):
    target, draft = pair
    ar = generate_ar(target, PROMPTS, 10)
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1,1"), block_size=4).generate(PROMPTS, 10)
    assert out.tokens == ar.tokens


def test_greedy_ngram_equals_ar(pair):
    target, _ = pair
    ar = generate_ar(target, PROMPTS, 12)
    out = SpeculativeDecoder(target, NgramDrafter(num_tokens=4)).generate(PROMPTS, 12)
    assert out.tokens == ar.tokens
    assert out.summary["tokens_per_step"] > 1.0  # a random model loops, so lookup finds continuations


def test_ngram_lookup_choice():
    """The latest match with a full continuation; else the earliest (longest) one; longest n first."""
    drafter = NgramDrafter(num_tokens=2, max_ngram=3)
    assert drafter.lookup(torch.tensor([1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 1, 2, 3])).tolist() == [7, 7]
    assert NgramDrafter(num_tokens=3, max_ngram=2).lookup(torch.tensor([5, 5, 5, 5])).tolist() == [5, 5]
    assert drafter.lookup(torch.tensor([4, 1, 2, 8, 6, 2])).tolist() == [8, 6]  # falls back to n = 1
    assert drafter.lookup(torch.tensor([1, 2, 3])).tolist() == []


def test_ngram_index_follows_ragged_growth():
    """The per-request index (extended from the columns new to any request in one read) proposes what a scan of
    each sequence does, while requests grow by different counts per step, none included, from ragged prompts."""
    gen = torch.Generator().manual_seed(0)
    B, L = 5, 120
    tokens = torch.randint(0, 4, (B, L), generator=gen)  # a small vocabulary: many matches of every order
    seq_lens = torch.randint(1, 30, (B,), generator=gen)
    drafter = NgramDrafter(num_tokens=4, max_ngram=3)
    drafter.start(tokens, seq_lens)
    for _ in range(12):
        want = [drafter.lookup(tokens[b, :n]).tolist() for b, n in enumerate(seq_lens.tolist())]
        assert drafter._continuations(tokens, seq_lens) == want
        seq_lens = (seq_lens + torch.randint(0, 6, (B,), generator=gen)).clamp(max=L)


def test_self_drafting_accepts_everything(pair):
    """The target as its own draft: every draft token is accepted, greedy and sampling alike."""
    target, _ = pair
    for temperature in (0.0, 1.0):
        out = SpeculativeDecoder(target, DraftModelDrafter(target, "chain:3")).generate(PROMPTS, 8, temperature)
        assert out.summary["acceptance_by_depth"] == out.summary["acceptance_rate_by_depth"] == [1.0, 1.0, 1.0]
        assert out.summary["tokens_per_step"] == 4.0


@pytest.mark.parametrize("tree", ["chain:3", "tree:2,2,1", "dynamic:7,3,2"])
def test_draft_cache_after_rollbacks_equals_fresh_prefill(pair, tree):
    """After many propose/commit rounds with partial acceptance, the drafter's committed K/V equal those of
    prefilling the committed tokens from scratch (so rollback kept exactly the accepted path)."""
    target, _ = pair
    draft = tiny(0)
    with torch.no_grad():  # the target, perturbed: long but not always complete acceptance
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    drafter = DraftModelDrafter(draft, tree)
    out = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    hist = out.summary["acceptance_by_depth"]
    assert 0.1 < hist[-1] < 1.0  # full and partial acceptance both happened
    for b, prompt in enumerate(PROMPTS):
        seq = torch.tensor([prompt + out.tokens[b]])
        n = min(int(drafter.cache.lens[b]), seq.shape[1])
        fresh = draft.new_cache(1, 96)
        draft.prefill(fresh, seq, torch.tensor([n]))
        torch.testing.assert_close(drafter.cache.k[:, b, :n], fresh.k[:, 0, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(drafter.cache.v[:, b, :n], fresh.v[:, 0, :n], atol=1e-5, rtol=1e-5)


def test_requests_finish_independently(pair):
    """EOS cuts one request early; the others run to max_new_tokens; greedy output still equals AR's."""
    target, draft = pair
    free = generate_ar(target, PROMPTS, 10).tokens
    cut = next(k for k in range(1, 10) if free[0].index(free[0][k]) == k)  # a token request 0 first emits at k
    eos = free[0][cut]
    target.cfg.eos_token_id = eos
    try:
        ar = generate_ar(target, PROMPTS, 10)
        spec = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:3")).generate(PROMPTS, 10)
    finally:
        target.cfg.eos_token_id = None
    for b, seq in enumerate(free):
        expected = seq[:seq.index(eos)] if eos in seq else seq
        assert ar.tokens[b] == expected and spec.tokens[b] == expected
    assert len(spec.tokens[0]) == cut and spec.stats[0]["new_tokens"] == cut
    assert spec.stats[0]["steps"] <= spec.summary["steps"]


def test_mixed_temperatures_keep_greedy_requests_exact(pair):
    target, draft = pair
    ar = generate_ar(target, PROMPTS, 8)
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1")).generate(PROMPTS, 8, [0.0, 1.0, 0.0])
    assert out.tokens[0] == ar.tokens[0] and out.tokens[2] == ar.tokens[2]


def test_sampled_request_does_not_depend_on_its_batch(pair, monkeypatch):
    """A sampled request's drafts and output depend on its own seed only: alone or beside other requests
    (sampling or greedy), the same tokens. Negative control: streams keyed by the position in the batch instead
    of the seed change them."""
    import specdec.loop.drafters.draft_model as dm
    target, draft = pair
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,2,1"))
    alone = decoder.generate([PROMPTS[1]], 16, temperature=1.0, seed=[6]).tokens[0]
    for temps in ([1.0, 1.0, 1.0], [0.0, 1.0, 0.7]):
        assert decoder.generate(PROMPTS, 16, temperature=temps, seed=[5, 6, 7]).tokens[1] == alone
    own = dm.DraftRandom
    monkeypatch.setattr(dm, "DraftRandom", lambda seeds, device: own(list(range(len(seeds))), device))
    assert decoder.generate(PROMPTS, 16, temperature=1.0, seed=[5, 6, 7]).tokens[1] != alone


def test_vocab_mismatch_is_rejected(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="vocab mismatch"):
        SpeculativeDecoder(target, DraftModelDrafter(tiny(3, vocab=30), "chain:2"))


@pytest.mark.parametrize("spec", ["chain:0", "tree:", "parents:0,1", "parents:-1,0,1,0", "dynamic:100,2,2", "star:3",
                                  "chain:x"])
def test_bad_tree_specs(spec):
    with pytest.raises(ValueError, match="tree spec"):
        parse_tree(spec)


# ----------------------------------------------------------------------------------------------
# lossless sampling, on the shipped pair
# ----------------------------------------------------------------------------------------------
def exact_two_token_law(target, prompt, temperature):
    """{(x1, x2): p} for the first two sampled tokens, over x1 with p(x1) > 1e-4 (the rest is 'other')."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1].double() / temperature, -1)
        firsts = (p1 > 1e-4).nonzero().flatten().tolist()
        seqs = torch.tensor([prompt + [x] for x in firsts])
        p2 = torch.softmax(target(seqs)[:, -1].double() / temperature, -1)
    return {(x1, x2): float(p1[x1] * p2[i, x2]) for i, x1 in enumerate(firsts) for x2 in range(p2.shape[1])}


@pytest.mark.parametrize("tree, method", [("chain:3", "token"), ("tree:3,1", "token"), ("dynamic:6,3,2", "token"),
                                          ("chain:4", "block"), ("tree:2,2,1", "traversal")])
def test_sampling_is_lossless_on_shipped_pair(tree, method):
    """Many seeds in one batch: the first two tokens' empirical law matches the target's exact law
    (chi-square, cells with expected count >= 5, the rest pooled). chain:3 and tree:3,1 pass draft logits
    (children drawn i.i.d. from the draft; several siblings in the tree); the dynamic tree passes given
    proposals; chain:4 is verified by block verification, tree:2,2,1 by traversal verification."""
    target = load_model(os.path.join(ASSETS, "target"))
    draft = load_model(os.path.join(ASSETS, "draft"))
    prompt = ByteTokenizer().encode("import os\nimport s")
    temperature, n = 0.8, 600
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), method=method).generate(
        [prompt] * n, 2, temperature, seed=list(range(1000, 1000 + n)))
    law = exact_two_token_law(target, prompt, temperature)
    cells = [c for c, p in law.items() if p * n >= 5]
    counts = {c: 0 for c in cells}
    for toks in out.tokens:
        key = tuple(toks[:2])
        if key in counts:
            counts[key] += 1
    observed = np.array([counts[c] for c in cells] + [n - sum(counts.values())], dtype=float)
    expected = np.array([law[c] * n for c in cells] + [n * (1 - sum(law[c] for c in cells))])
    assert len(cells) >= 3  # a law with several likely outcomes, or the test proves little
    stat = float(((observed - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(0.999, len(cells)), (stat, observed, expected)


def test_sampling_test_detects_a_biased_sampler():
    """Negative control for the chi-square above: a sampler at the wrong temperature fails it."""
    target = load_model(os.path.join(ASSETS, "target"))
    prompt = ByteTokenizer().encode("import os\nimport s")
    n = 600
    law = exact_two_token_law(target, prompt, 0.8)
    biased = generate_ar(target, [prompt] * n, 2, 1.2, seed=list(range(n))).tokens
    cells = [c for c, p in law.items() if p * n >= 5]
    observed = np.array([sum(tuple(t[:2]) == c for t in biased) for c in cells], dtype=float)
    expected = np.array([law[c] * n for c in cells])
    observed = np.append(observed, n - observed.sum())
    expected = np.append(expected, n - expected.sum())
    assert float(((observed - expected) ** 2 / expected).sum()) > chi2.ppf(0.999, len(cells))


# ----------------------------------------------------------------------------------------------
# sampling filters and a grammar-like mask in the loop
# ----------------------------------------------------------------------------------------------
def masked_greedy_ar(target, prompts, n, allowed):
    """Greedy decoding that shares nothing with the loop: the full forward of the whole sequence at every step
    (no cache, no specdec op), the argmax over the allowed tokens."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(n):
                row = target(torch.tensor([seq]))[0, -1].masked_fill(~allowed, float("-inf"))
                seq.append(int(row.argmax()))
            outs.append(seq[len(prompt):])
    return outs


@pytest.mark.parametrize("drafter", ["chain:4", "tree:2,2,1", "dynamic:7,3,2", "ngram"])
def test_masked_greedy_equals_masked_ar(pair, drafter):
    """A regex's character class as the grammar (tokens 2-9 of the tiny vocabulary: `[2-9]*`): greedy
    speculative output equals masked greedy autoregressive decoding token for token. The mask matters: the
    unmasked output leaves the class."""
    target, draft = pair
    ids = list(range(2, 10))
    allowed = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
    allowed[ids] = True
    expected = masked_greedy_ar(target, PROMPTS, 10, allowed)
    d = NgramDrafter(num_tokens=4) if drafter == "ngram" else DraftModelDrafter(draft, drafter)
    out = SpeculativeDecoder(target, d).generate(PROMPTS, 10, allowed_token_ids=ids)
    assert out.tokens == expected
    assert generate_ar(target, PROMPTS, 10, allowed_token_ids=ids).tokens == expected
    assert any(t not in ids for seq in generate_ar(target, PROMPTS, 10).tokens for t in seq)


def exact_filtered_two_token_law(target, prompt, temperature, top_k=0, top_p=1.0, min_p=0.0, allowed=None):
    """{(x1, x2): p} of the first two tokens under the processed law (reference.processed_probs at each), over
    its whole support."""
    from specdec.reference import processed_probs
    with torch.no_grad():
        p1 = processed_probs(target(torch.tensor([prompt]))[0, -1], temperature, top_k, top_p, min_p, allowed)
        firsts = (p1 > 0).nonzero().flatten().tolist()
        rows = target(torch.tensor([prompt + [x] for x in firsts]))[:, -1]
    law = {}
    for i, x1 in enumerate(firsts):
        p2 = processed_probs(rows[i], temperature, top_k, top_p, min_p, allowed)
        law.update({(x1, x2): float(p1[x1] * p2[x2]) for x2 in p2.nonzero().flatten().tolist()})
    return law


def chi_square_two_tokens(tokens, law, n):
    """(statistic, threshold at 0.999, cells) of the first two tokens' counts against `law`; tokens outside
    the law's support count in the pooled cell, whose expected count may be ~0 (then any hit fails)."""
    cells = [c for c, p in law.items() if p * n >= 5]
    counts = {c: 0 for c in cells}
    for toks in tokens:
        key = tuple(toks[:2])
        if key in counts:
            counts[key] += 1
    observed = np.array([counts[c] for c in cells] + [n - sum(counts.values())], dtype=float)
    expected = np.array([law[c] * n for c in cells] + [max(n * (1 - sum(law[c] for c in cells)), 1e-3)])
    return float(((observed - expected) ** 2 / expected).sum()), chi2.ppf(0.999, len(cells)), cells


@pytest.mark.parametrize("tree, filters", [
    ("chain:3", dict(top_k=6, top_p=0.8)),
    ("tree:3,1", dict(min_p=0.15)),
    ("chain:3", dict(allowed_token_ids=list(range(97, 123)) + [10, 32, 95])),  # [a-z\n _]
    ("dynamic:6,3,2", dict(top_p=0.7, min_p=0.05)),
])
def test_filtered_sampling_is_lossless_on_shipped_pair(tree, filters):
    """Sampling with the filters (draft logits on chain/tree: the drafter samples from the processed law, and
    accept processes q the same way; given proposals on the dynamic tree): the first two tokens follow the
    exact processed law of the target (chi-square), and never leave its support."""
    target = load_model(os.path.join(ASSETS, "target"))
    draft = load_model(os.path.join(ASSETS, "draft"))
    prompt = ByteTokenizer().encode("import os\nimport s")
    temperature, n = 1.0, 600
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, tree)).generate(
        [prompt] * n, 2, temperature, seed=list(range(2000, 2000 + n)), **filters)
    ids = filters.pop("allowed_token_ids", None)
    allowed = None
    if ids is not None:
        allowed = torch.zeros(target.cfg.vocab_size, dtype=torch.bool)
        allowed[ids] = True
    law = exact_filtered_two_token_law(target, prompt, temperature, allowed=allowed, **filters)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 3
    assert all(tuple(t[:2]) in law for t in out.tokens)
    assert stat < threshold, stat


def test_filtered_sampling_test_detects_unfiltered_sampling():
    """Negative control for the test above: plain sampling (no filters) fails the top-k/top-p law."""
    target = load_model(os.path.join(ASSETS, "target"))
    prompt = ByteTokenizer().encode("import os\nimport s")
    n = 600
    law = exact_filtered_two_token_law(target, prompt, 1.0, top_k=6, top_p=0.8)
    plain = generate_ar(target, [prompt] * n, 2, 1.0, seed=list(range(n))).tokens
    stat, threshold, _ = chi_square_two_tokens(plain, law, n)
    assert stat > threshold


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_model(tiny(5, vocab=VOCAB_SIZE, eos=257), str(root / "target"))
    save_model(tiny(6, vocab=VOCAB_SIZE, dim=16, layers=1), str(root / "draft"))
    save_model(tiny(7, vocab=100), str(root / "other_vocab"))
    return root


def run_cli(capsys, *args):
    rc = cli_main(["generate", "--no-progress", *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_json(capsys, byte_pair):
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--prompt", "import", "--target", str(byte_pair / "target"),
                         "--draft", str(byte_pair / "draft"), "--tree", "tree:2,1", "--max-new-tokens", "6",
                         "--compare-ar", "--json")
    assert rc == 0
    r = json.loads(out)
    for key in ("text", "tokens", "tokens_per_step", "acceptance_by_depth", "acceptance_rate_by_depth",
                "judged_by_depth", "spec_tokens_per_s", "ar_tokens", "ar_tokens_per_s", "identical"):
        assert key in r
    assert r["identical"] is True and r["tokens"] == r["ar_tokens"] and len(r["text"]) == 2
    assert len(r["acceptance_by_depth"]) == len(r["acceptance_rate_by_depth"]) == 2 and r["tokens_per_step"] >= 1.0


def test_cli_passes_alternate_and_report_the_fastest(capsys, byte_pair, monkeypatch):
    """--passes 3 --compare-ar: after the warm-up, speculative and plain passes alternate, and each reports its
    fastest pass (the summaries' speeds are made up here, so that the fastest is known)."""
    calls, speeds = [], iter([5.0, 7.0, 9.0, 3.0, 6.0, 8.0])
    generate = SpeculativeDecoder.generate

    def timed(self, prompts, max_new_tokens, *args, **kwargs):
        out = generate(self, prompts, max_new_tokens, *args, **kwargs)
        if max_new_tokens == 6:  # (not the warm-up's)
            calls.append("ar" if isinstance(self.drafter, NoDrafter) else "spec")
            out.summary["tokens_per_s"] = next(speeds)
        return out
    monkeypatch.setattr(SpeculativeDecoder, "generate", timed)
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--target", str(byte_pair / "target"), "--draft",
                         str(byte_pair / "draft"), "--max-new-tokens", "6", "--compare-ar", "--passes", "3", "--json")
    assert rc == 0
    r = json.loads(out)
    assert calls == ["spec", "ar"] * 3
    assert r["passes"] == 3 and r["spec_tokens_per_s"] == 9.0 and r["ar_tokens_per_s"] == 8.0 and r["identical"]
    assert r["speedup"] == pytest.approx(9 / 8)


def test_cli_warms_replayed_graphs_up_with_the_timed_runs_shape(capsys, byte_pair, monkeypatch):
    """With steps replayed as graphs (--cuda-graphs, emulated here), the warm-up decodes the timed runs' batch, length
    and filters, so that every graph they replay is captured before them (graphs are per batch shape: a 4-token
    warm-up of one prompt captured none of them, and the one timed pass did)."""
    from helpers import ReplayGraph
    from specdec.loop import decoding
    made = []

    class Counted(ReplayGraph):
        def __init__(self, fn, pool=None):
            made.append(timed)
            super().__init__(fn, pool)

    class Emulated(SpeculativeDecoder):  # (--cuda-graphs on the CPU: graphs with CUDA's semantics)
        def __init__(self, *args, cuda_graphs=None, **kwargs):
            super().__init__(*args, cuda_graphs=Counted if cuda_graphs else None, **kwargs)

        def generate(self, prompts, max_new_tokens, *args, **kwargs):
            calls.append((len(prompts), max_new_tokens, kwargs.get("top_k")))
            return super().generate(prompts, max_new_tokens, *args, **kwargs)
    monkeypatch.setattr(decoding, "SpeculativeDecoder", Emulated)  # (the CLI imports it as it runs)
    calls, timed = [], False
    generate = Emulated.generate

    def marking(self, *args, **kwargs):  # (the passes after the warm-ups are the timed ones)
        nonlocal timed
        timed = len(calls) >= 2
        return generate(self, *args, **kwargs)
    monkeypatch.setattr(Emulated, "generate", marking)
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--prompt", "import", "--target", str(byte_pair / "target"),
                         "--draft", str(byte_pair / "draft"), "--tree", "chain:2", "--max-new-tokens", "8",
                         "--temperature", "0.7", "--top-k", "5", "--cuda-graphs", "--compare-ar", "--json")
    assert rc == 0 and json.loads(out)["passes"] == 1
    assert calls == [(2, 8, 5)] * 4 and made and not any(made)


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent/folder"], "does not exist"),
    (["--draft", "{root}/other_vocab"], "vocab mismatch"),
    (["--tree", "chain:0"], "tree spec"),
    (["--drafter", "ngram", "--tree", "tree:2,2"], "ngram drafter proposes chains"),
    (["--method", "block", "--tree", "tree:2,2"], "method: 'block' verifies chains only"),
    (["--method", "traversal", "--tree", "dynamic:6,3,2"], "method: 'traversal' needs a drafter"),
    (["--method", "traversal", "--drafter", "ngram"], "method: 'traversal' needs a drafter"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--passes", "0"], "--passes"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--min-p", "1"], "--min-p"),
    (["--top-k", "-2"], "--top-k"),
    (["--device", "tpu"], "expected cpu or cuda"),
    (["--drafter", "mtp", "--tp", "2"], "--drafter mtp with --tp"),
    (["--drafter", "mtp", "--mtp", "{root}/target"], "no MTP layers"),
    (["--drafter", "mtp"], "differ from the target"),  # the shipped module, for another target
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "no CUDA device")]))
def test_cli_bad_inputs(capsys, byte_pair, args, message):
    args = [a.format(root=byte_pair) for a in args]
    base = ["--target", str(byte_pair / "target"), "--draft", str(byte_pair / "draft")]
    rc, out, err = run_cli(capsys, "--prompt", "x", *base, *args)
    assert rc == 2 and message in err and out == ""


def test_cli_sampling_filters(capsys, byte_pair):
    """--top-k/--top-p/--min-p reach the loop (drafter and accept): every sampled token is inside the target's
    processed law at its position (here top-k 1: the filtered law is the argmax, so the output is greedy's)."""
    base = ["--prompt", "def f(x):", "--target", str(byte_pair / "target"), "--draft", str(byte_pair / "draft"),
            "--max-new-tokens", "8", "--json", "--compare-ar"]
    rc, out, _ = run_cli(capsys, *base)
    greedy = json.loads(out)["tokens"]
    rc, out, _ = run_cli(capsys, *base, "--temperature", "1.5", "--top-k", "1", "--top-p", "0.9", "--min-p", "0.1")
    assert rc == 0
    r = json.loads(out)
    assert (r["top_k"], r["top_p"], r["min_p"]) == (1, 0.9, 0.1)
    assert r["tokens"] == greedy and r["ar_tokens"] == greedy


def test_cli_half_precision(capsys, byte_pair):
    """--dtype: weights, activations and caches in bf16 (the C++ ops on CPU, Triton on CUDA)."""
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--target", str(byte_pair / "target"), "--draft",
                         str(byte_pair / "draft"), "--max-new-tokens", "6", "--dtype", "bf16", "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["dtype"] == "bf16" and r["device"] == "cpu" and len(r["tokens"][0]) == 6


def test_cli_float8_kv_cache(capsys, byte_pair):
    """--kv-cache-dtype fp8: the target's cache in float8_e4m3fn; greedy speculative == greedy AR on it."""
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--target", str(byte_pair / "target"), "--draft",
                         str(byte_pair / "draft"), "--max-new-tokens", "6", "--kv-cache-dtype", "fp8", "--compare-ar",
                         "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["kv_cache_dtype"] == "fp8" and r["identical"] is True and len(r["tokens"][0]) == 6


def test_cli_shipped_pair_text(capsys):
    rc, out, _ = run_cli(capsys, "--prompt", "import os\n", "--max-new-tokens", "24", "--compare-ar")
    assert rc == 0
    assert "tokens/step" in out and "outputs identical" in out


def test_static_trees_are_built_once_per_batch_not_per_step(pair, monkeypatch):
    """A static tree's depths and masks come with the proposal (built at start, per depth limit): the number
    of build_tree calls does not grow with the steps (only the prefill's chunks and the start use it)."""
    import specdec
    target, draft = pair
    calls = []
    build = specdec.build_tree
    monkeypatch.setattr(specdec, "build_tree", lambda *a, **kw: calls.append(1) or build(*a, **kw))
    counts = []
    for n in (4, 24):
        calls.clear()
        out = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1")).generate(PROMPTS, n)
        counts.append((len(calls), out.summary["steps"]))
    assert counts[0][0] == counts[1][0] and counts[1][1] > counts[0][1]


def test_compiled_loop_equals_eager_and_ar():
    """compile=True: each step is one graph (drafting, verification, accept, rollbacks, bookkeeping), so greedy
    output equals AR and a sampled run draws exactly what the eager loop draws (counter-based draft streams);
    the graphs are reused by a later batch of another prompt length (cache lengths in buckets)."""
    from torch._dynamo.utils import counters
    target, draft = tiny(0), tiny(1, dim=16, layers=1)
    ar = generate_ar(target, PROMPTS, 8).tokens
    drafter = DraftModelDrafter(draft, "chain:2")
    decoder = SpeculativeDecoder(target, drafter, compile=True)
    counters.clear()
    assert decoder.generate(PROMPTS, 8).tokens == ar
    assert counters["stats"]["unique_graphs"] == 1  # the whole step, for this batch and tree
    longer = [p + [7] for p in PROMPTS]
    assert decoder.generate(longer, 8).tokens == generate_ar(target, longer, 8).tokens
    assert counters["stats"]["unique_graphs"] == 1  # no new graph
    four = PROMPTS + [[2, 6, 1]]  # (three requests ran padded to the bucket of four: the same graph)
    out = decoder.generate(four, 8)
    assert out.tokens == generate_ar(target, four, 8).tokens and len(out.stats) == out.summary["requests"] == 4
    assert counters["stats"]["unique_graphs"] == 1
    sampled = dict(temperature=[1.0, 0.7, 1.0], seed=[3, 4, 5])
    eager = SpeculativeDecoder(target, drafter).generate(PROMPTS, 8, **sampled).tokens
    assert decoder.generate(PROMPTS, 8, **sampled).tokens == eager
    assert counters["stats"]["unique_graphs"] == 2  # the sampling step (draft logits, draws) is another graph


def test_batch_padded_to_its_bucket_gives_the_requests_outputs_alone(pair):
    """A batch runs padded to a bucket size with finished rows: the outputs, stats and acceptance are the real
    requests' alone, as without padding; per-request parameters of the wrong length are still refused."""
    from helpers import ReplayGraph
    target, draft = pair
    kw = dict(temperature=[0.0, 0.9, 0.0], seed=[1, 2, 3], top_k=[0, 5, 0])
    exact = SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:3")).generate(PROMPTS, 10, **kw)
    for decoder in (SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:3"), batch_buckets=(2, 8)),
                    SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:3"), cuda_graphs=ReplayGraph)):
        padded = decoder.generate(PROMPTS, 10, **kw)
        assert padded.tokens == exact.tokens and padded.stats == [
            {**st, "wall_s": p["wall_s"], "tokens_per_s": p["tokens_per_s"]} for st, p in zip(exact.stats, padded.stats)]
        assert padded.summary["requests"] == 3 and padded.summary["tokens_per_step"] == exact.summary["tokens_per_step"]
        for key in ("acceptance_by_depth", "acceptance_rate_by_depth", "judged_by_depth"):  # (padding rows judge none)
            assert padded.summary[key] == exact.summary[key]
    with pytest.raises(ValueError, match="top_k"):
        decoder.generate(PROMPTS, 4, top_k=[1, 2])
    with pytest.raises(ValueError, match="batch_buckets"):
        SpeculativeDecoder(target, batch_buckets=(0, 4))
    assert [batch_bucket(n) for n in (1, 3, 5, 9, 17, 600)] == [1, 4, 8, 16, 24, 600]


def test_compiled_and_replayed_steps_over_a_paged_float8_cache_equal_ar(pair):
    """compile=True and (emulated) CUDA graphs over a paged float8 target cache, the draft's cache in float8
    too: greedy output equals AR over the same cache dtype."""
    from helpers import ReplayGraph
    target, draft = pair
    kv = torch.float8_e4m3fn
    ar = generate_ar(target, PROMPTS, 8, kv_dtype=kv).tokens
    for kw in ({"compile": True}, {"cuda_graphs": ReplayGraph}):
        drafter = DraftModelDrafter(draft, "tree:2,1", kv_dtype=kv)
        assert SpeculativeDecoder(target, drafter, block_size=4, kv_dtype=kv, **kw).generate(PROMPTS, 8).tokens == ar


def test_cli_compile(capsys, tmp_path):
    """--compile: a warm-up run that compiles (reported as compile_s) and the same output as eager."""
    save_model(tiny(5, vocab=VOCAB_SIZE, eos=257), str(tmp_path / "target"))  # fresh models: compiling sticks
    save_model(tiny(6, vocab=VOCAB_SIZE, dim=16, layers=1), str(tmp_path / "draft"))
    base = ["--prompt", "def f(x):", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
            "--tree", "chain:1", "--max-new-tokens", "4", "--json"]
    _, eager, _ = run_cli(capsys, *base)
    rc, out, _ = run_cli(capsys, *base, "--compile")
    r = json.loads(out)
    assert rc == 0 and r["compile_s"] > 0 and r["tokens"] == json.loads(eager)["tokens"]


class RepeatTheRoot(Drafter):
    """A drafter of the core alone (start, propose, commit, skip; no model, no state): a chain of `depth` copies
    of the root token."""
    max_nodes, max_depth = 4, 3

    def propose(self, tokens, seq_lens, temperature, depth=None):
        B, T = tokens.shape[0], (self.max_depth if depth is None else depth) + 1
        root = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1))
        parents = torch.arange(-1, T - 1, dtype=torch.int32, device=tokens.device).expand(B, T)
        return Proposal(root.expand(B, T).contiguous(), parents, torch.full((B,), T, dtype=torch.int32,
                                                                            device=tokens.device))


def test_a_drafter_of_the_core_alone_runs_fixed_and_adaptive_loops(pair):
    """A new drafter writes start/propose/commit/skip only: its drafts are judged (every step judges its first
    level) and greedy output equals AR's, with every depth and plain steps too (a scripted policy); CUDA graphs,
    which need a declared step state (StepState), are refused."""
    from helpers import ReplayGraph
    from test_adaptive import scripted
    target = pair[0]
    prompts = PROMPTS + [[7, 7, 7, 7]]
    ar = generate_ar(target, prompts, 12)
    fixed = SpeculativeDecoder(target, RepeatTheRoot()).generate(prompts, 12)
    assert fixed.tokens == ar.tokens and fixed.summary["judged_by_depth"][0] == sum(s["steps"] for s in fixed.stats)
    adaptive = SpeculativeDecoder(target, RepeatTheRoot(), adaptive=scripted((0, 2, 0, 3, 1))).generate(prompts, 12)
    assert adaptive.tokens == ar.tokens and adaptive.summary["depth_chosen"][0] > 0
    with pytest.raises(ValueError, match="StepState"):
        SpeculativeDecoder(target, RepeatTheRoot(), cuda_graphs=ReplayGraph)
