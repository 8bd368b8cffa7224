"""The parallel drafter (one forward drafts every level): its laws are a causal forward's over the context and the
masks, greedy speculative output equals AR token for token (chains, trees, batches, paged target caches, adaptive
depth), its cache after rejections equals a fresh prefill, and sampling through it keeps the target's law."""
from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from specdec.loop.cli import ASSETS
from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import ParallelDrafter
from specdec.loop.drafters import draft_model
from specdec.loop.drafters.parallel import add_mask_token
from specdec.loop.models.hf import load_model
from specdec.loop.models.tokenizer import ByteTokenizer

from helpers import ReplayGraph
from test_adaptive import PROMPTS4, scripted
from test_loop import exact_two_token_law, tiny

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7], [3, 9, 1, 2, 9, 1, 2, 9, 1], [5, 4, 3, 2, 1, 0, 11]]


def perturbed(model, scale, seed=0):
    """A copy of model with Gaussian noise of this scale on every weight."""
    copy = add_mask_token(model)  # (the copy's mask row is new; the draws below only perturb)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return copy.eval()


@pytest.fixture(scope="module")
def target():
    return tiny(0)


@pytest.fixture(scope="module")
def parallel(target):
    """The target plus a mask token, slightly perturbed: depth 1 is mostly accepted, deeper depths sometimes."""
    return perturbed(target, 0.02)


def test_position_laws_are_a_causal_forward_over_context_and_masks(parallel):
    """position_laws' logits at depth d equal a full causal forward's over the committed tokens then d - 1 masks,
    per request of a ragged batch, and it commits all but the root."""
    drafter = ParallelDrafter(parallel, "chain:4")
    B, L = len(PROMPTS), max(map(len, PROMPTS))
    tokens = torch.zeros(B, L + 8, dtype=torch.long)
    for b, p in enumerate(PROMPTS):
        tokens[b, :len(p)] = torch.tensor(p)
    seq_lens = torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)
    drafter.start(tokens, seq_lens, L + 8, torch.zeros(B), list(range(B)))
    drafter.catch_up(tokens, seq_lens)
    laws = drafter.position_laws(tokens, seq_lens, 4)
    mask = drafter.mask_token_id
    for b, p in enumerate(PROMPTS):
        with torch.no_grad():
            full = parallel(torch.tensor([p + [mask] * 3]))[0, len(p) - 1:, :mask]
        torch.testing.assert_close(laws[b], full, atol=1e-4, rtol=1e-4)
    assert drafter.cache.lens.tolist() == [len(p) - 1 for p in PROMPTS]


def test_one_forward_per_proposal_for_any_depth(target, parallel, monkeypatch):
    """The point of the drafter: a proposal of any depth, chain or tree, costs one forward of its model."""
    calls = []
    original = parallel.forward_cached
    monkeypatch.setattr(parallel, "forward_cached", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    for tree in ("chain:6", "tree:2,2,2"):
        drafter = ParallelDrafter(parallel, tree)
        out = SpeculativeDecoder(target, drafter).generate(PROMPTS[:1], 12)
        assert len(calls) == out.summary["steps"], (tree, calls)
        calls.clear()


@pytest.mark.parametrize("tree", ["chain:1", "chain:5", "tree:2,2,1", "parents:-1,0,0,1,1,2", "dynamic:7,3,2"])
@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_ar(target, parallel, tree, block_size, batch):
    prompts = PROMPTS[:batch]
    ar = generate_ar(target, prompts, 14)
    out = SpeculativeDecoder(target, ParallelDrafter(parallel, tree), block_size=block_size).generate(prompts, 14)
    assert out.tokens == ar.tokens


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1"])
def test_greedy_with_allowed_tokens_and_penalties_equals_ar(target, parallel, tree):
    """A token mask and penalties (each node's law at its own path's counts) keep the output AR's under the same
    sampling parameters; the mask matters (the free output leaves it)."""
    ids = list(range(2, 10))
    kw = dict(allowed_token_ids=ids, repetition_penalty=1.3, frequency_penalty=0.2)
    expected = generate_ar(target, PROMPTS, 12, **kw).tokens
    assert SpeculativeDecoder(target, ParallelDrafter(parallel, tree)).generate(PROMPTS, 12, **kw).tokens == expected
    assert all(t in ids for seq in expected for t in seq)
    assert any(t not in ids for seq in generate_ar(target, PROMPTS, 12).tokens for t in seq)


@pytest.mark.parametrize("tree", ["chain:5", "tree:2,2,1"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_adaptive_equals_ar(target, parallel, tree, batch):
    """Adaptive depth (skipped steps, catch-up, every depth of the tree) keeps the output AR's."""
    prompts = PROMPTS[:batch]
    ar = generate_ar(target, prompts, 24)
    decoder = SpeculativeDecoder(target, ParallelDrafter(parallel, tree), adaptive=True, block_size=4)
    for _ in range(2):  # (the second call starts from the first one's policy)
        assert decoder.generate(prompts, 24).tokens == ar.tokens


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1"])
def test_cache_after_rejections_equals_fresh_prefill(target, tree):
    """After many steps with partial acceptance, the drafter's committed K/V equal a fresh prefill of the committed
    tokens (all but the root): the masks' and the rejected nodes' K/V never stay."""
    model = perturbed(target, 0.05)
    drafter = ParallelDrafter(model, tree)
    out = SpeculativeDecoder(target, drafter).generate(PROMPTS, 24)
    hist = out.summary["acceptance_by_depth"]
    assert hist[0] < 1.0 and hist[1] > 0.0  # rejections and acceptances past depth 1 both happened
    for b, prompt in enumerate(PROMPTS):
        seq = torch.tensor([prompt + out.tokens[b]])
        n = min(int(drafter.cache.lens[b]), seq.shape[1])  # (the last step may run past the output kept)
        assert n > len(prompt)
        fresh = model.new_cache(1, 96)
        model.prefill(fresh, seq, torch.tensor([n]))
        torch.testing.assert_close(drafter.cache.k[:, b, :n], fresh.k[:, 0, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(drafter.cache.v[:, b, :n], fresh.v[:, 0, :n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1"])
def test_replayed_steps_equal_eager_steps(target, parallel, tree):
    """Replayed steps (emulated CUDA graphs: no host read, state written in place) over skipped, shallow and full
    steps give the eager loop's output and acceptance, and AR's output; sampled runs draw what eager ones draw."""
    script = (0, 2, 0, 0, 9, 1, 0, 3)
    eager = SpeculativeDecoder(target, ParallelDrafter(parallel, tree),
                               adaptive=scripted(script)).generate(PROMPTS4, 24)
    out = SpeculativeDecoder(target, ParallelDrafter(parallel, tree), cuda_graphs=ReplayGraph,
                             adaptive=scripted(script)).generate(PROMPTS4, 24)
    assert out.tokens == eager.tokens == generate_ar(target, PROMPTS4, 24).tokens
    assert [s["acceptance_by_depth"] for s in out.stats] == [s["acceptance_by_depth"] for s in eager.stats]
    kw = dict(temperature=[1.0, 0.0, 0.8, 0.5], seed=[1, 2, 3, 4], top_k=8)
    eager = SpeculativeDecoder(target, ParallelDrafter(parallel, tree), block_size=4).generate(PROMPTS, 16, **kw)
    replayed = SpeculativeDecoder(target, ParallelDrafter(parallel, tree), block_size=4,
                                  cuda_graphs=ReplayGraph).generate(PROMPTS, 16, **kw)
    assert replayed.tokens == eager.tokens


def test_mask_token_must_be_the_last_row(target, parallel):
    with pytest.raises(ValueError, match="mask_token_id"):
        ParallelDrafter(target)  # no mask token in its config
    with pytest.raises(ValueError, match="mask_token_id"):
        ParallelDrafter(parallel, mask_token_id=3)
    with pytest.raises(ValueError, match="vocab mismatch"):
        SpeculativeDecoder(tiny(2, vocab=30), ParallelDrafter(parallel))


# ----------------------------------------------------------------------------------------------
# lossless sampling, on the shipped target with the shipped parallel drafter
# ----------------------------------------------------------------------------------------------
class TopCandidatesAsDraws(ParallelDrafter):
    """Negative control: a tree built the greedy way (each level's top candidates, the same under every node) proposed
    to sampling requests with the levels' laws, as if its children had been drawn from them: the laws accept is
    told are not the children's."""

    def propose(self, tokens, seq_lens, temperature, depth=None):
        top = lambda logits, temperature, k, *args, **kwargs: logits.topk(k, dim=-1).indices  # noqa: E731
        with mock.patch.object(draft_model, "sample", top):
            return super().propose(tokens, seq_lens, temperature, depth)


def two_token_chi_square(drafter_class, tree, method):
    """The first two sampled tokens of many requests against the target's exact law: (statistic, threshold at
    p = 0.001)."""
    target = load_model(os.path.join(ASSETS, "target"))
    drafter = drafter_class(load_model(os.path.join(ASSETS, "parallel")), tree)
    prompt = ByteTokenizer().encode("import os\nimport s")
    temperature, n = 0.8, 600
    out = SpeculativeDecoder(target, drafter, method=method).generate([prompt] * n, 2, temperature,
                                                                      seed=list(range(1000, 1000 + n)))
    law = exact_two_token_law(target, prompt, temperature)
    cells = [c for c, p in law.items() if p * n >= 5]
    assert len(cells) >= 3  # a law with several likely outcomes, or the test proves little
    counts = {c: 0 for c in cells}
    for toks in out.tokens:
        counts[tuple(toks[:2])] = counts.get(tuple(toks[:2]), 0) + 1
    observed = np.array([counts[c] for c in cells] + [n - sum(counts[c] for c in cells)], dtype=float)
    expected = np.array([law[c] * n for c in cells] + [n * (1 - sum(law[c] for c in cells))])
    return float(((observed - expected) ** 2 / expected).sum()), chi2.ppf(0.999, len(cells)), out


@pytest.mark.parametrize("tree, method", [("chain:3", "token"), ("tree:3,2", "token"), ("chain:4", "block"),
                                          ("tree:2,2,1", "traversal")])
def test_sampling_is_lossless(tree, method):
    """Children drawn i.i.d. from their level's law, fresh per node, with that law told to accept: the first two
    tokens follow the target's exact law (chi-square). Depth 1 was accepted often, so the second token was mostly
    judged against the depth-2 law (a mask position's)."""
    stat, threshold, out = two_token_chi_square(ParallelDrafter, tree, method)
    assert stat < threshold, stat
    assert out.summary["acceptance_by_depth"][0] > 0.3


def test_sampling_test_detects_a_tree_not_drawn_from_its_laws():
    """Negative control for the test above: the greedy tree told to accept as draws from the levels' laws fails it
    by far."""
    stat, threshold, _ = two_token_chi_square(TopCandidatesAsDraws, "tree:3,2", "token")
    assert stat > 10 * threshold, stat


def test_cli_parallel_drafter(capsys):
    """--drafter parallel on the shipped pair's target and parallel drafter: greedy output identical to AR for a
    chain and with --tree auto; a folder without the mask token (the plain draft model) is refused by name."""
    import json
    from test_loop import run_cli
    base = ["--prompt", "def main():", "--prompt", "import os", "--drafter", "parallel", "--max-new-tokens", "12",
            "--compare-ar", "--json"]
    for tree in ("chain:4", "auto"):
        rc, out, _ = run_cli(capsys, *base, "--tree", tree)
        result = json.loads(out)
        assert rc == 0 and result["drafter"] == "parallel" and result["identical"], tree
    rc, out, err = run_cli(capsys, *base, "--parallel", os.path.join(ASSETS, "draft"))
    assert rc == 2 and "mask token" in err and out == ""
