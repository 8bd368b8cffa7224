"""specdec.integrations: the peers' entry points, called as the peers are called.

Behaviours pinned by the peers' own tests (rewritten here, not copied): FlashInfer's docstring example, its
one-hot and -1 layout checks and its counters; vLLM's greedy cases (perfect match, early mismatch, several
sequences, an empty one), seeded determinism, top-k; SGLang's greedy tree example and its sampled twin. Then
what the peers do not test: the output law (chi-square) of every sampled entry point, SGLang's repeated siblings
(where its own kernel is biased: a simulation of its rule fails the same test), and the errors.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.integrations import flashinfer, sglang, vllm
from tests.stats import assert_law, chi_square_pvalue

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _two_tokens(step):
    """(n, 2) the first two tokens of n requests under context-free laws: step(k) is a verification call's output
    rows (n, >= 2) with its own drafts and randomness; a row that emitted one token continues with the first
    token of the next call (a fresh step from the same law)."""
    first, again = step(0), step(1)
    return torch.stack([first[:, 0], torch.where(first[:, 1] >= 0, first[:, 1], again[:, 0])], 1).long()


def _laws(gen, V, zeros=0.2):
    p = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    q = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    p[torch.rand(V, generator=gen) < zeros] = 0.0
    p[0] = max(float(p[0]), 0.05)
    return p / p.sum(), q / q.sum()


# ----------------------------------------------------------------------------------------------
# FlashInfer
# ----------------------------------------------------------------------------------------------
def test_flashinfer_docstring_example():
    draft = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]])
    target = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]])
    out, accepted, emitted = flashinfer.chain_speculative_sampling(draft, torch.tensor([[2, 1]]), target,
                                                                   seed=42, offset=0)
    assert out.dtype == torch.int32 and out.tolist() == [[2, 0, -1]]
    assert accepted.tolist() == [1] and emitted.tolist() == [1]


def test_flashinfer_one_hot_target_equal_to_the_draft_accepts_everything_and_counters_add_up():
    gen = torch.Generator().manual_seed(0)
    B, S, V = 7, 4, 50
    ids = torch.randint(0, V, (B, S + 1), generator=gen)
    target = torch.nn.functional.one_hot(ids, V).float()
    draft = torch.rand(B, S, V, generator=gen)
    accepted = torch.full((B,), 3, dtype=torch.int32)
    emitted = torch.zeros(B, dtype=torch.int32)
    out, acc, emi = flashinfer.chain_speculative_sampling(draft, ids[:, :S].int(), target, accepted, emitted,
                                                          seed=1, offset=2)
    assert torch.equal(out, ids.int()) and acc is accepted and emi is emitted
    assert accepted.tolist() == [3 + S] * B and emitted.tolist() == [S] * B  # added to, in place


def test_flashinfer_layout_counters_and_determinism():
    gen = torch.Generator().manual_seed(1)
    B, S, V = 64, 3, 9
    target = torch.rand(B, S + 1, V, generator=gen) ** 3
    draft = torch.rand(B, S, V, generator=gen) ** 3
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=gen).view(B, S).int()
    out, acc, emi = flashinfer.chain_speculative_sampling(draft, ids, target, seed=5, offset=7)
    assert torch.equal((out != -1).sum(1), emi + 1)
    assert (acc >= emi).all() and int(emi.max()) >= 1 and int(emi.min()) < S
    for b in range(B):  # the accepted prefix is the drafts; -1 after the final token
        n = int(emi[b])
        assert out[b, :n].tolist() == ids[b, :n].tolist() and (out[b, n + 1:] == -1).all()
    again = flashinfer.chain_speculative_sampling(draft, ids, target, seed=5, offset=7)
    assert torch.equal(out, again[0]) and torch.equal(acc, again[1])
    other = flashinfer.chain_speculative_sampling(draft, ids, target, seed=5, offset=8)[0]
    assert not torch.equal(out, other)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(flashinfer.chain_speculative_sampling(draft, ids, target, generator=gen_a)[0],
                       flashinfer.chain_speculative_sampling(draft, ids, target, generator=gen_b)[0])
    with pytest.raises(TypeError, match="maybe_output_accepted_token_num: expected a"):
        flashinfer.chain_speculative_sampling(draft, ids, target, torch.zeros(B, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_probs: expected shape"):
        flashinfer.chain_speculative_sampling(draft, ids, target[:, :S])


def test_flashinfer_follows_the_target_law():
    """Context-free laws p (target) and q (draft), 2 drafts from q per row: the first two emitted tokens are i.i.d.
    p (chi-square over the V^2 pairs)."""
    gen = torch.Generator().manual_seed(2)
    n, S, V = 4000, 2, 5
    p, q = _laws(gen, V)

    def step(k):
        ids = torch.multinomial(q.float(), n * S, replacement=True, generator=gen).view(n, S).int()
        return flashinfer.chain_speculative_sampling(q.float().expand(n, S, V), ids, p.float().expand(n, S + 1, V),
                                                     seed=11, offset=k)[0]

    pairs = _two_tokens(step)
    assert_law(pairs[:, 0] * V + pairs[:, 1], (p[:, None] * p).flatten(), "flashinfer, two tokens")


# ----------------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------------
def _vllm_inputs(spec_tokens, target_ids, bonus_ids, V=20):
    """vLLM's model-runner layout: per request its draft rows then its bonus row in `logits`; metadata and a
    greedy SamplingMetadata, duck-typed. target_ids[b][i]: the argmax at request b's position i."""
    num = [len(s) for s in spec_tokens]
    rows, target_idx, bonus_idx = [], [], []
    for b, s in enumerate(spec_tokens):
        for i in range(len(s)):
            target_idx.append(len(rows))
            rows.append(target_ids[b][i])
        bonus_idx.append(len(rows))
        rows.append(bonus_ids[b])
    logits = torch.full((len(rows), V), -100.0)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 100.0
    metadata = SimpleNamespace(draft_token_ids=torch.tensor([t for s in spec_tokens for t in s], dtype=torch.int32),
                               num_draft_tokens=num, cu_num_draft_tokens=torch.tensor(num).cumsum(0).int(),
                               target_logits_indices=torch.tensor(target_idx, dtype=torch.int64),
                               bonus_logits_indices=torch.tensor(bonus_idx, dtype=torch.int64))
    greedy = SimpleNamespace(temperature=None, all_greedy=True, all_random=False, top_k=None, top_p=None,
                             generators={})
    return metadata, logits, greedy


@pytest.mark.parametrize("spec,target,bonus,expected", [
    ([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]]),  # perfect match
    ([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, -1, -1]]),  # early mismatch
    ([[1, 2], [3]], [[1, 2], [3]], [5, 4], [[1, 2, 5], [3, 4, -1]]),  # several sequences
    ([[]], [[]], [5], [[5]]),  # no drafts: the bonus alone
    ([[1, 2, 3], [4, 5]], [[1, 2, 7], [4, 8]], [6, 9], [[1, 2, 7, -1], [4, 8, -1, -1]]),  # several mismatches
])
def test_vllm_greedy_cases(spec, target, bonus, expected):
    metadata, logits, greedy = _vllm_inputs(spec, target, bonus)
    out = vllm.RejectionSampler().forward(metadata, None, logits, greedy).sampled_token_ids
    assert out.dtype == torch.int32 and out.tolist() == expected
    # the module-level function, with the bonus given and the target's probabilities
    probs = torch.softmax(logits[metadata.target_logits_indices], -1)
    got = vllm.rejection_sample(metadata.draft_token_ids, metadata.num_draft_tokens, max(map(len, spec)),
                                metadata.cu_num_draft_tokens, None, probs, torch.tensor(bonus).view(-1, 1), greedy)
    assert got.tolist() == expected


def _sampled_metadata(B, temperature, generators=None, **filters):
    return SimpleNamespace(temperature=torch.full((B,), temperature), all_greedy=False, all_random=True,
                           top_k=filters.get("top_k"), top_p=filters.get("top_p"), generators=generators or {})


def test_vllm_rejection_sample_follows_the_target_law():
    """k = 2 drafts from q per request, with and without draft_probs: each emitted position's token follows p."""
    gen = torch.Generator().manual_seed(4)
    B, k, V = 3000, 2, 6
    p, q = _laws(gen, V)
    for draft_probs in (q.float().expand(B * k, V).contiguous(), None):
        def step(_):
            draft = torch.multinomial(q.float(), B * k, replacement=True, generator=gen).int()
            bonus = torch.multinomial(p.float(), B, replacement=True, generator=gen).view(B, 1)
            return vllm.rejection_sample(draft, [k] * B, k, torch.arange(1, B + 1).int() * k, draft_probs,
                                         p.float().expand(B * k, V).contiguous(), bonus, _sampled_metadata(B, 1.0))

        pairs = _two_tokens(step)
        assert_law(pairs[:, 0] * V + pairs[:, 1], (p[:, None] * p).flatten(),
                   f"vllm, two tokens, draft_probs {draft_probs is not None}")


def test_vllm_forward_samples_at_temperature_with_top_k_and_seeded_requests_repeat():
    gen = torch.Generator().manual_seed(6)
    B, k, V, t = 2000, 2, 8, 0.7
    target_logits = torch.randn(V, generator=gen, dtype=torch.float64) * 1.5
    q = _laws(gen, V, zeros=0.0)[1]
    logits = target_logits.float().expand(B * (k + 1), V).contiguous()
    idx = torch.arange(B * (k + 1)).view(B, k + 1)

    def metadata_of(draft):
        return SimpleNamespace(draft_token_ids=draft, num_draft_tokens=[k] * B,
                               cu_num_draft_tokens=torch.arange(1, B + 1).int() * k,
                               target_logits_indices=idx[:, :k].reshape(-1), bonus_logits_indices=idx[:, k])

    def step(_):
        draft = torch.multinomial(q.float(), B * k, replacement=True, generator=gen).int()
        return vllm.RejectionSampler().forward(metadata_of(draft), q.float().expand(B * k, V).contiguous(), logits,
                                               _sampled_metadata(B, t)).sampled_token_ids

    pairs = _two_tokens(step)
    p = torch.softmax(target_logits / t, -1)
    assert_law(pairs[:, 0] * V + pairs[:, 1], (p[:, None] * p).flatten(), "vllm forward, two tokens")
    metadata = metadata_of(torch.multinomial(q.float(), B * k, replacement=True, generator=gen).int())
    top = vllm.RejectionSampler().forward(metadata, q.float().expand(B * k, V).contiguous(), logits,
                                          _sampled_metadata(B, t, top_k=torch.full((B,), 2))).sampled_token_ids
    allowed = set(torch.topk(target_logits, 2).indices.tolist())
    assert set(top[top >= 0].tolist()) <= allowed  # (the accepted drafts as well as the drawn tokens)
    small = SimpleNamespace(draft_token_ids=metadata.draft_token_ids[:8 * k], num_draft_tokens=[k] * 8,
                            cu_num_draft_tokens=metadata.cu_num_draft_tokens[:8],
                            target_logits_indices=idx[:8, :k].reshape(-1), bonus_logits_indices=idx[:8, k])
    runs = [vllm.RejectionSampler().forward(
        small, q.float().expand(8 * k, V).contiguous(), logits,
        _sampled_metadata(8, 1.0, {i: torch.Generator().manual_seed(100 + i) for i in range(0, 8, 2)}))
        .sampled_token_ids for _ in range(6)]
    assert all(torch.equal(r[::2], runs[0][::2]) for r in runs)  # the seeded requests repeat
    assert any(not torch.equal(r[1::2], runs[0][1::2]) for r in runs)  # the others are random


# ----------------------------------------------------------------------------------------------
# SGLang
# ----------------------------------------------------------------------------------------------
CANDIDATES = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
RETRIVE_INDEX = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
NEXT_TOKEN = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
NEXT_SIBLING = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])  # row 1 lists node 4 before 1
TARGET_PREDICT = torch.tensor([[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]])
EXPECTED = ([3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2])


def _sglang_outputs(bs=2, N=6, K=4):
    return (torch.full((bs * N,), -1, dtype=torch.int32), torch.full((bs, K), -1, dtype=torch.int32),
            torch.full((bs,), -7, dtype=torch.int32))


def test_sglang_greedy_example():
    predicts, accept_index, accept_num = _sglang_outputs()
    sglang.verify_tree_greedy(predicts, accept_index, accept_num, CANDIDATES, RETRIVE_INDEX, NEXT_TOKEN, NEXT_SIBLING,
                              TARGET_PREDICT)
    assert (predicts.tolist(), accept_index.tolist(), accept_num.tolist()) == EXPECTED


def test_sglang_greedy_takes_the_first_matching_sibling_in_list_order():
    """Two siblings with the same (matching) token: the first in the list wins, as in SGLang, whatever the node
    numbering."""
    candidates = torch.tensor([[0, 6, 6]])
    predicts, accept_index, accept_num = _sglang_outputs(1, 3, 3)
    sglang.verify_tree_greedy(predicts, accept_index, accept_num, candidates, torch.tensor([[0, 1, 2]]),
                              torch.tensor([[2, -1, -1]]), torch.tensor([[-1, -1, 1]]), torch.tensor([[6, 9, 8]]))
    assert accept_index.tolist() == [[0, 2, -1]] and predicts.tolist() == [6, -1, 8] and accept_num.tolist() == [1]


def test_sglang_sampled_twin_of_the_greedy_example():
    """Near one-hot target laws (softmax of the greedy example's logits / 0.01): the sampled verifier gives the
    greedy result."""
    V = 20
    logits = torch.full((2, 6, V), -10.0)
    logits.scatter_(2, TARGET_PREDICT.unsqueeze(-1), 10.0)
    probs = torch.softmax(logits / 0.01, -1)
    predicts, accept_index, accept_num = _sglang_outputs()
    gen = torch.Generator().manual_seed(0)
    sglang.tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, CANDIDATES, RETRIVE_INDEX, NEXT_TOKEN, NEXT_SIBLING,
        torch.rand(2, 6, generator=gen), torch.rand(2, generator=gen), probs, torch.zeros_like(probs))
    assert (predicts.tolist(), accept_index.tolist(), accept_num.tolist()) == EXPECTED
    with pytest.raises(ValueError, match="threshold_single, threshold_acc: only 1.0"):
        sglang.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_num, CANDIDATES, RETRIVE_INDEX, NEXT_TOKEN, NEXT_SIBLING,
            torch.rand(2, 6), torch.rand(2), probs, torch.zeros_like(probs), threshold_single=0.9)


def _sglang_rule_first_token(p, siblings, coin, final_coin):
    """SGLang's target-only rule at the root of a star, simulated: one coin against the running sum of the
    siblings' target probabilities (a repeated token counted again); on rejecting all, a draw from p with the
    rejected tokens' mass removed."""
    acc = 0.0
    for x in siblings:
        acc += float(p[x])
        if coin <= acc:
            return x
    rest = p.clone()
    rest[list(siblings)] = 0.0
    return int(torch.searchsorted(rest.cumsum(0), final_coin * rest.sum()).clamp(max=len(p) - 1))


def test_sglang_repeated_siblings_stay_lossless():
    """A star whose three children repeat one token: the first emitted token follows p; SGLang's own rule,
    simulated on the same draws, does not (it accepts the repeated token with probability 3 p(x))."""
    gen = torch.Generator().manual_seed(8)
    bs, V = 3000, 6
    p = torch.tensor([0.2, 0.1, 0.3, 0.15, 0.05, 0.2], dtype=torch.float64)
    N = 4
    candidates = torch.zeros(bs, N, dtype=torch.int64)
    candidates[:, 1:] = 4  # every child proposes token 4
    next_token = torch.full((bs, N), -1)
    next_token[:, 0] = 1
    next_sibling = torch.tensor([-1, 2, 3, -1]).expand(bs, N).contiguous()
    retrive_index = torch.arange(bs * N).view(bs, N)
    coins, final = torch.rand(bs, N, generator=gen), torch.rand(bs, generator=gen)
    predicts, accept_index, accept_num = _sglang_outputs(bs, N, 2)
    sglang.tree_speculative_sampling_target_only(predicts, accept_index, accept_num, candidates, retrive_index,
                                                 next_token, next_sibling, coins, final,
                                                 p.float().expand(bs, N, V).contiguous(),
                                                 torch.zeros(bs, N, V))
    first = predicts.view(bs, N)[:, 0].long()
    assert_law(first, p, "sglang entry point, repeated siblings")
    theirs = torch.tensor([_sglang_rule_first_token(p, [4, 4, 4], float(coins[b, 0]), float(final[b]))
                           for b in range(bs)])
    assert chi_square_pvalue(theirs, p) < 1e-6  # the peer's rule is biased here: the test can tell


def _with(x, index, value):
    x = x.clone()
    x[index] = value
    return x


SGLANG_BAD_LINKS = [  # (argument named, message, changes to the greedy example's arguments)
    ("retrive_next_token", r"every link must be -1 or a node in \[1, 6\)", dict(next_token=_with(NEXT_TOKEN, (0, 1), 6))),
    ("retrive_next_sibling", r"every link must be -1 or a node in \[1, 6\)", dict(next_sibling=_with(NEXT_SIBLING, (1, 4), 0))),
    ("retrive_next_sibling", r"every link must be -1 or a node in \[1, 6\)", dict(next_sibling=_with(NEXT_SIBLING, (1, 4), -2))),
    ("retrive_next_token", "a node is linked to twice", dict(next_token=_with(NEXT_TOKEN, (0, 3), 2))),
    ("retrive_next_token", "reachable from the root", dict(next_token=_with(NEXT_TOKEN, (0, 3), -1))),  # 4, 5 cut off
    ("retrive_next_token", "come after its parent", dict(next_token=_with(_with(NEXT_TOKEN, (0, 0), 3), (0, 3), 1),
                                                        next_sibling=_with(NEXT_SIBLING, (0, 1), -1))),  # 3 -> 1
    ("retrive_index", r"flat indices must be in \[0, 12\)", dict(retrive_index=_with(RETRIVE_INDEX, (1, 5), 12))),
    ("retrive_index", r"flat indices must be in \[0, 12\)", dict(retrive_index=_with(RETRIVE_INDEX, (0, 0), -1))),
    ("accept_index", r"expected \(2, K\) with K >= 1", dict(accept_index=torch.zeros(2, 0, dtype=torch.int32))),
    ("candidates", "expected 2 dimensions", dict(candidates=CANDIDATES[0])),
    ("retrive_next_sibling", "expected shape", dict(next_sibling=NEXT_SIBLING[:, :5])),
    ("predicts", "dtype float32 not supported", dict(predicts=torch.zeros(12))),
]


@pytest.mark.parametrize("name,message,changes", SGLANG_BAD_LINKS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(SGLANG_BAD_LINKS)])
def test_sglang_entry_points_check_links_and_indices(name, message, changes):
    """Malformed links and indices: a ValueError / TypeError naming SGLang's argument, outputs untouched (an index
    out of range used to fail deep inside a scatter, a cut-off node as specdec's `parents`)."""
    predicts, accept_index, accept_num = _sglang_outputs()
    args = dict(predicts=predicts, accept_index=accept_index, accept_num=accept_num, candidates=CANDIDATES,
                retrive_index=RETRIVE_INDEX, next_token=NEXT_TOKEN, next_sibling=NEXT_SIBLING)
    args.update(changes)
    outputs = [args[k].clone() for k in ("predicts", "accept_index", "accept_num")]
    probs = torch.softmax(torch.randn(2, 6, 20), -1)
    for verify, extra in ((sglang.verify_tree_greedy, (TARGET_PREDICT,)),
                          (sglang.tree_speculative_sampling_target_only,
                           (torch.rand(2, 6), torch.rand(2), probs, torch.zeros_like(probs)))):
        with pytest.raises((ValueError, TypeError), match=f"^{name}: .*{message}"):
            verify(*args.values(), *extra)
        assert all(torch.equal(args[k], o) for k, o in zip(("predicts", "accept_index", "accept_num"), outputs))


def test_sglang_sampled_checks_draft_tokens_against_the_vocabulary():
    predicts, accept_index, accept_num = _sglang_outputs()
    probs = torch.softmax(torch.randn(2, 6, 12), -1)  # V = 12: candidate 12 of request 1 is out of range
    with pytest.raises(ValueError, match=r"^candidates: draft tokens must be in \[0, 12\)"):
        sglang.tree_speculative_sampling_target_only(predicts, accept_index, accept_num, CANDIDATES, RETRIVE_INDEX,
                                                     NEXT_TOKEN, NEXT_SIBLING, torch.rand(2, 6), torch.rand(2), probs,
                                                     torch.zeros_like(probs))
