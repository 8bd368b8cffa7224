"""specdec.integrations: the peers' entry points, called as the peers are called.

Behaviours pinned by the peers' own tests (rewritten here, not copied): FlashInfer's docstring example, its
one-hot and -1 layout checks and its counters; vLLM's greedy cases (perfect match, early mismatch, several
sequences, an empty one), seeded determinism, top-k; SGLang's greedy tree example and its sampled twin. Then
what the peers do not test: the output law (chi-square) of every sampled entry point (SGLang's chain verifier
token-wise and block, with a negative control), FlashInfer's per-row seeds and its counter, SGLang's repeated
siblings (where its own kernel is biased: a simulation of its rule fails the same test), and the errors.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.integrations import flashinfer, sglang, vllm
from specdec.sampling import processed_logits
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


def test_flashinfer_reads_seed_and_offset_per_row():
    """(B,) seed and offset tensors: row b's result is the one an int (seed[b], offset[b]) gives that row (it used
    to be keyed by element 0 for every row); a length-1 tensor broadcasts."""
    gen = torch.Generator().manual_seed(4)
    B, S, V = 16, 4, 8
    target = torch.rand(B, S + 1, V, generator=gen) ** 3
    draft = torch.rand(B, S, V, generator=gen) ** 3
    ids = torch.multinomial(draft.reshape(-1, V), 1, generator=gen).view(B, S).int()
    seed, offset = torch.arange(100, 100 + B), torch.arange(B) * 3
    out, acc, emi = flashinfer.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    for b in range(B):
        one = flashinfer.chain_speculative_sampling(draft, ids, target, seed=int(seed[b]), offset=int(offset[b]))
        assert [out[b].tolist(), int(acc[b]), int(emi[b])] == [one[0][b].tolist(), int(one[1][b]), int(one[2][b])]
    first_only = flashinfer.chain_speculative_sampling(draft, ids, target, seed=100, offset=0)[0]
    assert not torch.equal(out, first_only)  # (what reading element 0 gave)
    broadcast = flashinfer.chain_speculative_sampling(draft, ids, target, seed=seed[:1], offset=offset[:1])
    assert all(torch.equal(x, y) for x, y in zip(broadcast, flashinfer.chain_speculative_sampling(
        draft, ids, target, seed=100, offset=0)))
    for kwargs, message in ((dict(seed=seed[:2], offset=offset), "^seed: expected length 1 or 16"),
                            (dict(seed=seed, offset=offset.int()), "^offset: dtype"),
                            (dict(seed=seed, offset=3), "^seed, offset: both tensors or both ints"),
                            (dict(seed=3), "^seed, offset: give both or neither")):
        with pytest.raises((ValueError, TypeError), match=message):
            flashinfer.chain_speculative_sampling(draft, ids, target, **kwargs)


def test_flashinfer_accepted_counter_skips_the_first_rejected_position():
    """FlashInfer's accepted counter re-tests only the positions after the first rejected one. Position 0
    is accepted with probability 1/2, every later one surely: accepted = S - 1 after a rejection (the re-test of
    position 0 that used to be counted made it S half of the time), S when all are accepted."""
    B, S, V = 64, 3, 4
    ids = torch.tensor([[1, 2, 3]]).expand(B, S).int()
    draft = torch.nn.functional.one_hot(ids.long(), V).float()
    target = torch.cat((draft, torch.full((B, 1, V), 0.25)), 1)
    target[:, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    out, acc, emi = flashinfer.chain_speculative_sampling(draft, ids, target, seed=9, offset=0)
    assert set(emi.tolist()) == {0, S}
    assert acc.tolist() == torch.where(emi == S, S, S - 1).tolist()
    assert (out[emi == 0, 0] == 0).all()  # the correction: relu(p - q) leaves token 0


# ----------------------------------------------------------------------------------------------
# vLLM
# ----------------------------------------------------------------------------------------------
class _BonusSampler:
    """vLLM's Sampler as its rejection sampler calls it for the bonus tokens (duck-typed): the argmax of greedy
    requests, else a draw from the processed law (temperature, top-k, top-p) of the bonus rows; it records its
    calls."""
    logprobs_mode = "raw_logprobs"

    def __init__(self):
        self.calls = []

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        self.calls.append((logits.clone(), sampling_metadata.max_num_logprobs, predict_bonus_token))
        if sampling_metadata.all_greedy:
            return vllm.SamplerOutput(logits.argmax(-1, keepdim=True))
        t = sampling_metadata.temperature.view(-1, 1)
        kept = processed_logits(logits.float(), sampling_metadata.temperature, sampling_metadata.top_k,
                                sampling_metadata.top_p)
        return vllm.SamplerOutput(torch.multinomial(torch.softmax(kept / t, -1), 1))


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
    metadata = _vllm_metadata(torch.tensor([t for s in spec_tokens for t in s], dtype=torch.int32), num,
                              torch.tensor(target_idx, dtype=torch.int64), torch.tensor(bonus_idx, dtype=torch.int64))
    return metadata, logits, _sampled_metadata(len(num), None)


def _vllm_metadata(draft, num, target_idx, bonus_idx):
    """vLLM's SpecDecodeMetadata, duck-typed."""
    return SimpleNamespace(draft_token_ids=draft, num_draft_tokens=num, max_spec_len=max(num, default=0),
                           cu_num_draft_tokens=torch.tensor(num, dtype=torch.int64).cumsum(0).int(),
                           cu_num_sampled_tokens=(torch.tensor(num, dtype=torch.int64) + 1).cumsum(0).int(),
                           target_logits_indices=target_idx, bonus_logits_indices=bonus_idx)


def _sampled_metadata(B, temperature, generators=None, **filters):
    """vLLM's SamplingMetadata, duck-typed (temperature None: all greedy)."""
    return SimpleNamespace(temperature=None if temperature is None else torch.full((B,), float(temperature)),
                           all_greedy=temperature is None, all_random=temperature is not None,
                           top_k=filters.get("top_k"), top_p=filters.get("top_p"), generators=generators or {},
                           max_num_logprobs=None)


@pytest.mark.parametrize("spec,target,bonus,expected", [
    ([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]]),  # perfect match
    ([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, -1, -1]]),  # early mismatch
    ([[1, 2], [3]], [[1, 2], [3]], [5, 4], [[1, 2, 5], [3, 4, -1]]),  # several sequences
    ([[]], [[]], [5], [[5]]),  # no drafts: the bonus alone
    ([[1, 2, 3], [4, 5]], [[1, 2, 7], [4, 8]], [6, 9], [[1, 2, 7, -1], [4, 8, -1, -1]]),  # several mismatches
    ([[1, -1, 3], [4, 5]], [[1, 2, 3], [4, 5]], [6, 9], [[1, 2, -1, -1], [4, 5, 9, -1]]),  # a placeholder is rejected
])
def test_vllm_greedy_cases(spec, target, bonus, expected):
    metadata, logits, greedy = _vllm_inputs(spec, target, bonus)
    sampler = _BonusSampler()
    output = vllm.RejectionSampler(sampler).forward(metadata, None, logits, greedy)
    out = output.sampled_token_ids
    assert out.dtype == torch.int32 and out.tolist() == expected and output.logprobs_tensors is None
    # the bonus comes from the sampler, asked as vLLM asks it: the bonus rows, no logprobs, predict_bonus_token
    (bonus_rows, max_num_logprobs, predict_bonus_token), = sampler.calls
    assert torch.equal(bonus_rows, logits[metadata.bonus_logits_indices])
    assert max_num_logprobs == -1 and predict_bonus_token
    # the module-level function, with the bonus given and the target's (processed) logits
    got = vllm.rejection_sample(metadata.draft_token_ids, metadata.num_draft_tokens, max(map(len, spec)),
                                metadata.cu_num_draft_tokens, None, logits[metadata.target_logits_indices],
                                torch.tensor(bonus).view(-1, 1), greedy)
    assert got.tolist() == expected
    assert vllm.RejectionSampler.parse_output(out, 20, [0]) == ([[]] + [[t for t in row if t >= 0]
                                                                       for row in expected[1:]], None)


def test_vllm_sampled_placeholder_is_rejected_and_its_token_follows_the_target():
    """A placeholder draft (-1) ends the request's accepted drafts at its position; the token there follows p."""
    gen = torch.Generator().manual_seed(3)
    B, V = 4000, 6
    p, q = _laws(gen, V)
    draft = torch.tensor([int(torch.multinomial(q.float(), 1, generator=gen)), -1] * B, dtype=torch.int32)
    for draft_probs in (None, q.float().expand(2 * B, V).contiguous()):
        out = vllm.rejection_sample(draft, [2] * B, 2, torch.arange(1, B + 1).int() * 2, draft_probs,
                                    p.float().log().expand(2 * B, V).contiguous(), torch.zeros(B, 1, dtype=torch.int64),
                                    _sampled_metadata(B, 1.0))
        accepted = out[:, 1] >= 0
        assert (out[accepted, 2] == -1).all() and (out[~accepted, 1] == -1).all()
        assert_law(out[accepted, 1], p, f"vllm, token at a placeholder, draft_probs {draft_probs is not None}")


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
                                         p.float().log().expand(B * k, V).contiguous(), bonus,
                                         _sampled_metadata(B, 1.0))

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

    def metadata_of(draft, rows=B):
        return _vllm_metadata(draft[:rows * k], [k] * rows, idx[:rows, :k].reshape(-1), idx[:rows, k])

    def step(_):
        draft = torch.multinomial(q.float(), B * k, replacement=True, generator=gen).int()
        return vllm.RejectionSampler(_BonusSampler()).forward(
            metadata_of(draft), q.float().expand(B * k, V).contiguous(), logits,
            _sampled_metadata(B, t)).sampled_token_ids

    pairs = _two_tokens(step)
    p = torch.softmax(target_logits / t, -1)
    assert_law(pairs[:, 0] * V + pairs[:, 1], (p[:, None] * p).flatten(), "vllm forward, two tokens")
    draft = torch.multinomial(q.float(), B * k, replacement=True, generator=gen).int()
    for draft_probs in (q.float().expand(B * k, V).contiguous(), None):
        top = vllm.RejectionSampler(_BonusSampler()).forward(
            metadata_of(draft), draft_probs, logits, _sampled_metadata(B, t, top_k=torch.full((B,), 2))
        ).sampled_token_ids
        allowed = set(torch.topk(target_logits, 2).indices.tolist())
        assert set(top[top >= 0].tolist()) <= allowed  # (the accepted drafts as well as the drawn tokens)
    runs = [vllm.RejectionSampler(_BonusSampler()).forward(
        metadata_of(draft, 8), q.float().expand(8 * k, V).contiguous(), logits,
        _sampled_metadata(8, 1.0, {i: torch.Generator().manual_seed(100 + i) for i in range(0, 8, 2)}))
        .sampled_token_ids[:, :k] for _ in range(6)]  # (the bonus is the sampler's draw)
    assert all(torch.equal(r[::2], runs[0][::2]) for r in runs)  # the seeded requests repeat
    assert any(not torch.equal(r[1::2], runs[0][1::2]) for r in runs)  # the others are random


@pytest.mark.parametrize("method", ["fly", "synthetic"])
def test_vllm_lossy_methods_are_refused_by_name(method):
    with pytest.raises(ValueError, match=f"^spec_config: rejection_sample_method '{method}'"):
        vllm.RejectionSampler(_BonusSampler(), SimpleNamespace(rejection_sample_method=method))
    vllm.RejectionSampler(_BonusSampler(), SimpleNamespace(rejection_sample_method="standard"))


def test_vllm_draft_ids_other_than_the_placeholder_are_refused():
    metadata, logits, greedy = _vllm_inputs([[1, -2]], [[1, 2]], [3])
    with pytest.raises(ValueError, match=r"^draft_token_ids: must be in \[0, 20\) or the placeholder -1"):
        vllm.RejectionSampler(_BonusSampler()).forward(metadata, None, logits, greedy)
    metadata.draft_token_ids = torch.tensor([1, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="^draft_token_ids: "):
        vllm.rejection_sample(metadata.draft_token_ids, [2], 2, metadata.cu_num_draft_tokens, None,
                              logits[:2], torch.tensor([[3]]), greedy)


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


# SGLang's chain verifier (chain_speculative_sampling_triton): a root and two drafts, the target's law after the
# first draft depends on it, the drafts are drawn from the drafter's law
def sglang_chain_case(gen, n, V=4):
    """n requests of a 3-node chain with context-dependent laws: p0 (V,) and P1[x1] (V,) the target's law for the
    first and second token, q0 and Q1[x1] the drafter's; x1 ~ q0, x2 ~ Q1[x1]. Returns (laws, SGLang's arguments
    as a dict, the outputs' factory)."""
    def law(*shape):
        w = torch.rand(*shape, V, generator=gen, dtype=torch.float64) ** 2 + 0.02
        return w / w.sum(-1, keepdim=True)
    p0, P1, q0, Q1 = law(), law(V), law(), law(V)
    x1 = torch.multinomial(q0, n, replacement=True, generator=gen)
    x2 = torch.multinomial(Q1[x1], 1, generator=gen)[:, 0]
    N = 3
    args = dict(candidates=torch.stack((torch.zeros_like(x1), x1, x2), 1),
                retrive_index=torch.arange(n * N).view(n, N),
                retrive_next_token=torch.tensor([1, 2, -1]).expand(n, N).contiguous(),
                retrive_next_sibling=torch.full((n, N), -1),
                uniform_samples=torch.rand(n, N, generator=gen),
                uniform_samples_for_final_sampling=torch.rand(n, generator=gen),
                target_probs=torch.stack((p0.expand(n, V), P1[x1], torch.full_like(P1[x1], 1.0 / V)), 1).float(),
                draft_probs=torch.stack((q0.expand(n, V), Q1[x1]), 1).float())

    def outputs():
        return (torch.full((n * N,), -1, dtype=torch.int32), torch.full((n, N), -1, dtype=torch.int32),
                torch.zeros(n, dtype=torch.int32))
    return SimpleNamespace(p0=p0, P1=P1, q0=q0, Q1=Q1), args, outputs


def sglang_chain_two_tokens(gen, laws, predicts, accept_num):
    """(n,) the first two emitted tokens as one cell y1 * V + y2; a request that emitted one token continues with a
    draw from the target's law after it (what the next step gives)."""
    n, V = accept_num.shape[0], laws.p0.numel()
    rows = predicts.view(n, -1).long()
    second = torch.where(accept_num > 0, rows[:, 1], torch.multinomial(laws.P1[rows[:, 0]], 1, generator=gen)[:, 0])
    return rows[:, 0] * V + second


def sglang_chain_expected_accepted(laws):
    """The token-wise verifier's expected accepted drafts: P(x1 accepted) + P(x1 and x2 accepted)."""
    first = torch.minimum(laws.p0, laws.q0)
    return float(first.sum() + (first * torch.minimum(laws.P1, laws.Q1).sum(1)).sum())


def _sglang_chain(args, outputs, block, **changes):
    predicts, accept_index, accept_num = outputs()
    call = dict(args, threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    call.update(changes)
    sglang.chain_speculative_sampling_triton(predicts, accept_index, accept_num, **call, block_verification=block)
    return predicts, accept_index, accept_num


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_sglang_chain_follows_the_target_law(block):
    """The first two emitted tokens follow p0(y1) P1[y1](y2) (chi-square over the V^2 pairs); the token-wise
    verifier accepts as expected, block verification at least as much. Negative control: draft_probs claiming
    the target's law (every draft accepted) emits the drafter's law."""
    gen = torch.Generator().manual_seed(21)
    n = 4000
    laws, args, outputs = sglang_chain_case(gen, n)
    exact = (laws.p0[:, None] * laws.P1).flatten()
    predicts, _, accept_num = _sglang_chain(args, outputs, block)
    assert_law(sglang_chain_two_tokens(gen, laws, predicts, accept_num), exact, f"sglang chain, block={block}")
    expected, spread = sglang_chain_expected_accepted(laws), 4 * float(accept_num.float().std()) / n ** 0.5
    mean = float(accept_num.float().mean())
    assert (mean >= expected - spread) if block else (abs(mean - expected) < spread)
    predicts, _, accept_num = _sglang_chain(args, outputs, block, draft_probs=args["target_probs"][:, :2])
    assert chi_square_pvalue(sglang_chain_two_tokens(gen, laws, predicts, accept_num), exact) < 1e-6


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_sglang_chain_one_hot_target_layout(block):
    """One-hot target rows (greedy-like, decided whatever the coins): request 0 accepts both drafts and takes the
    bonus, request 1 rejects its second draft; outputs at SGLang's flat indices, later accept_index untouched."""
    V = 6
    target = torch.nn.functional.one_hot(torch.tensor([[1, 2, 5], [3, 4, 0]]), V).float()
    args = dict(candidates=torch.tensor([[0, 1, 2], [9, 3, 5]]), retrive_index=torch.tensor([[3, 4, 5], [0, 1, 2]]),
                retrive_next_token=torch.tensor([[1, 2, -1]] * 2), retrive_next_sibling=torch.full((2, 3), -1),
                uniform_samples=torch.rand(2, 3), uniform_samples_for_final_sampling=torch.rand(2),
                target_probs=target, draft_probs=torch.softmax(torch.randn(2, 2, V), -1))
    outputs = lambda: (torch.full((6,), -1, dtype=torch.int32), torch.full((2, 4), -7, dtype=torch.int32),  # noqa: E731
                       torch.zeros(2, dtype=torch.int32))
    predicts, accept_index, accept_num = _sglang_chain(args, outputs, block)
    assert predicts.tolist() == [3, 4, -1, 1, 2, 5]
    assert accept_index.tolist() == [[3, 4, 5, -7], [0, 1, -7, -7]] and accept_num.tolist() == [2, 1]


SGLANG_CHAIN_BAD = [  # (message, changes to sglang_chain_case's arguments)
    ("^threshold_single, threshold_acc: only 1.0", dict(threshold_single=0.5)),
    ("^threshold_single, threshold_acc: only 1.0", dict(threshold_acc=0.9)),
    (r"^draft_probs: expected shape \(5, S, 4\) with S >= 2", dict(draft_probs=torch.zeros(5, 1, 4))),
    (r"^target_probs: expected shape \(5, 3, V\)", dict(target_probs=torch.zeros(5, 2, 4))),
    (r"^retrive_index: flat indices must be in \[0, 15\)", dict(retrive_index=torch.arange(1, 16).view(5, 3))),
    (r"^candidates: draft tokens must be in \[0, 4\)", dict(candidates=torch.full((5, 3), 4))),
    ("^uniform_samples_for_final_sampling: expected 5 values", dict(uniform_samples_for_final_sampling=torch.rand(4))),
]


@pytest.mark.parametrize("message,changes", SGLANG_CHAIN_BAD, ids=[str(i) for i in range(len(SGLANG_CHAIN_BAD))])
def test_sglang_chain_checks_its_arguments(message, changes):
    """SGLang's relaxed thresholds stay refused (its chain kernel ignores them and its server refuses them with
    rejection sampling); bad shapes and values name the argument; outputs untouched."""
    _, args, outputs = sglang_chain_case(torch.Generator().manual_seed(0), 5)
    fresh = outputs()
    with pytest.raises(ValueError, match=message):
        _sglang_chain(args, lambda: fresh, False, **changes)
    assert all(torch.equal(x, y) for x, y in zip(fresh, outputs()))
