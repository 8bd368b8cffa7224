"""The MTP drafter (specdec.drafters.mtp): greedy speculative output equals greedy AR, and the heads' cache
after rejected paths equals a fresh run over the accepted tokens."""
from __future__ import annotations

import pytest
import torch

from specdec.decoding import SpeculativeDecoder, generate_ar
from specdec.drafters.mtp import MTPDrafter
from specdec.models.mtp import MTP

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
    for b, prompt in enumerate(PROMPTS):
        seq = prompt + out.tokens[b]
        n = int(drafter.cache.lens[b])
        assert n >= len(prompt) - 1
        fresh = MTPDrafter(target, mtp, tree)
        x = torch.tensor([seq + [0] * 8])
        lens = torch.tensor([n + 2], dtype=torch.int32)  # its cache commits positions 0 .. lens - 3
        with torch.no_grad():
            hidden = target.prefill(target.new_cache(1, 96), x, lens - 1, return_hidden=True)
            fresh.start(x, lens, 96, torch.zeros(1), [0], target_hidden=hidden)
        assert int(fresh.cache.lens[0]) == n
        m = min(n, len(seq) - 1)  # (a finished request rides along past its cut output: compare what it shows)
        assert m > len(prompt)
        torch.testing.assert_close(drafter.cache.k[:, b, :m], fresh.cache.k[:, 0, :m], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(drafter.cache.v[:, b, :m], fresh.cache.v[:, 0, :m], atol=1e-5, rtol=1e-5)


def test_long_prompt_prefills_in_chunks(target_and_mtp, monkeypatch):
    target, mtp = target_and_mtp
    import specdec.drafters.mtp as mod
    monkeypatch.setattr(mod, "PREFILL_CHUNK", 7)
    ar = generate_ar(target, LONG, 12)
    assert SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:3")).generate(LONG, 12).tokens == ar.tokens


def test_more_than_one_module_is_refused(target_and_mtp):
    target, _ = target_and_mtp
    with pytest.raises(ValueError, match="mtp"):
        MTPDrafter(target, MTP(target.cfg, 2))
