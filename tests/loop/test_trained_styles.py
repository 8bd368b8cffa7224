"""DeepSeek-style and gpt-oss-style pairs trained for a few seconds on the pair's corpus (Python source bytes):
a DeepSeek-V3-style target (MLA, experts) with its MTP module, and a gpt-oss-style target (sinks, alternating
windows, experts) with a small draft model, each drafter trained on its target's greedy text. Through the CLI,
as a user runs a checkpoint folder: greedy output identical to AR, and drafts accepted far beyond chance."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from specdec.loop.decoding import generate_ar
from specdec.loop.models.hf import save_model
from specdec.loop.models.llama import Llama, LlamaConfig
from specdec.loop.models.mtp import MTP, save_mtp
from specdec.loop.models.tokenizer import BOS, EOS, VOCAB_SIZE, ByteTokenizer

from test_loop import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

BYTES = dict(vocab_size=VOCAB_SIZE, bos_token_id=BOS, eos_token_id=EOS)
STYLES = {
    "deepseek": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=128, kv_lora_rank=32,
                     q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                     n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1, experts_per_token=2,
                     first_k_dense_replace=1),
    "gpt-oss": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], attention_sinks=True, num_experts=4,
                    experts_per_token=2, qkv_bias=True, o_bias=True),
}
PROMPTS = ["def main(", "import os\n", "class Config:\n    "]


def _text(n_bytes=60_000) -> torch.Tensor:
    """The pair's corpus, a slice of it: Python standard-library source bytes (os.py, then more if short)."""
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    data = b""
    for name in ("os.py", "argparse.py", "textwrap.py"):
        with open(os.path.join(root, name), "rb") as f:
            data += f.read()
    return torch.tensor(list(data[:n_bytes]), dtype=torch.long)


def _train(model, loss_fn, steps, lr=3e-3):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def _lm_loss(model, text, gen, batch=16, width=64):
    starts = torch.randint(0, len(text) - width - 1, (batch,), generator=gen)
    x = torch.stack([text[s:s + width + 1] for s in starts.tolist()])
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _greedy_text(target, n_prompts=48, length=48, gen=None) -> torch.Tensor:
    """(n_prompts, 4 + length) token rows: random 4-byte prompts from the corpus and the target's greedy text."""
    text = _text()
    starts = torch.randint(0, len(text) - 4, (n_prompts,), generator=gen)
    prompts = [text[s:s + 4].tolist() for s in starts.tolist()]
    return torch.tensor([p + t for p, t in zip(prompts, generate_ar(target, prompts, length).tokens)])


@pytest.fixture(scope="module", params=["deepseek", "gpt-oss"])
def trained(request, tmp_path_factory):
    """(style, target folder, the drafter's CLI arguments, target, drafter) of a trained pair."""
    style, tmp_path = request.param, tmp_path_factory.mktemp(request.param)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    text = _text()
    target = Llama(LlamaConfig(**BYTES, **STYLES[style]))
    _train(target, lambda: _lm_loss(target, text, gen), 120)
    own = _greedy_text(target, gen=gen)
    folder = tmp_path / "target"
    save_model(target, str(folder), dtype=torch.float32)
    if style == "deepseek":  # its MTP module, stored in the target's folder as DeepSeek-V3 stores it
        with torch.no_grad():
            _, hidden = target(own, return_hidden=True)
        mtp = MTP(target.cfg, 1)

        def mtp_loss():
            logits = mtp(target, hidden, own)[0][:, :-1]
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), own[:, 2:].reshape(-1))
        _train(mtp, mtp_loss, 150)
        save_mtp(mtp, str(tmp_path / "mtp"), dtype=torch.float32)
        os.replace(tmp_path / "mtp" / "model.safetensors", folder / "model-mtp.safetensors")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
        drafter, model = ["--drafter", "mtp"], mtp
    else:  # a one-layer draft model distilled on the target's greedy text
        draft = Llama(LlamaConfig(**BYTES, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64))

        def draft_loss():
            logits = draft(own[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), own[:, 1:].reshape(-1))
        _train(draft, draft_loss, 150)
        save_model(draft, str(tmp_path / "draft"), dtype=torch.float32)
        drafter, model = ["--drafter", "model", "--draft", str(tmp_path / "draft")], draft
    return style, folder, drafter, target, model


def test_trained_style_pair_through_the_cli(trained, capsys):
    style, folder, drafter, _, _ = trained
    prompts = sum((["--prompt", p] for p in PROMPTS), [])
    for tree in ("chain:3", "dynamic:6,3,2"):
        rc, out, _ = run_cli(capsys, *prompts, "--target", str(folder), *drafter, "--tree", tree,
                             "--max-new-tokens", "24", "--compare-ar", "--json")
        result = json.loads(out)
        assert rc == 0 and result["identical"], (style, tree)
        # (an untrained drafter's byte is accepted about 1 time in 259)
        assert result["acceptance_by_depth"][0] > 0.3, (style, tree, result["acceptance_by_depth"])
    assert ByteTokenizer().decode(result["tokens"][0])  # (bytes the tokenizer reads back)


def test_trained_style_pair_samples_the_targets_law(trained):
    """Sampled at temperature 1 with the trained drafter (MTP or draft model, chain of 3: draft logits): the first
    two tokens follow the target's exact two-token law (chi-square at 0.999), and the test has the power to tell
    it from the law at temperature 0.7."""
    from specdec.loop.decoding import SpeculativeDecoder
    from specdec.loop.drafters import DraftModelDrafter, MTPDrafter
    from test_loop import chi_square_two_tokens, exact_filtered_two_token_law
    style, _, _, target, model = trained
    drafter = MTPDrafter(target, model, "chain:3") if style == "deepseek" else DraftModelDrafter(model, "chain:3")
    prompt, n = ByteTokenizer().encode("import os\nimport s"), 500
    out = SpeculativeDecoder(target, drafter).generate([prompt] * n, 2, 1.0, seed=list(range(3000, 3000 + n)))
    law = exact_filtered_two_token_law(target, prompt, 1.0)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 3 and stat < threshold, (style, stat, threshold)
    wrong, wrong_threshold, _ = chi_square_two_tokens(out.tokens, exact_filtered_two_token_law(target, prompt, 0.7), n)
    assert wrong > wrong_threshold, (style, wrong, wrong_threshold)
