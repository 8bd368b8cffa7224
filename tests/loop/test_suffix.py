"""Suffix decoding (SuffixDrafter, SuffixIndex): greedy speculative output == AR output token for token (chains and
trees, batches, paged caches, adaptive depth, the global index across generate calls); the index against a brute-force
matcher, incremental growth and eviction included; the drafter's state after rejected paths; the CLI."""
from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch

from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import SuffixDrafter, SuffixIndex, suffix
from test_adaptive import scripted
from test_loop import PROMPTS, byte_pair, run_cli, tiny  # noqa: F401 (byte_pair: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return tiny(0)


class SpyingSuffixDrafter(SuffixDrafter):
    """Records each proposal's largest number of children of one node and its depth."""
    widest, deepest = 0, 0

    def propose(self, tokens, seq_lens, temperature, depth=None):
        prop = super().propose(tokens, seq_lens, temperature, depth)
        for b, n in enumerate(prop.num_nodes.tolist()):
            parents = prop.parents[b, 1:n].tolist()
            if parents:
                self.widest = max(self.widest, max(Counter(parents).values()))
                self.deepest = max(self.deepest, _levels(parents))
        return prop


def _levels(parents: list) -> int:
    levels = [0]
    for p in parents:
        levels.append(levels[p] + 1)
    return max(levels)


@pytest.mark.parametrize("block_size", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("max_tokens", [1, 12], ids=["one-token", "tree"])
def test_greedy_suffix_equals_ar_across_calls(target, max_tokens, batch, block_size):
    """Two generate calls (the second also matches the first's outputs in the global index): output equals AR's
    token for token, with one-token proposals and with trees of several levels and branches (the first prompt's
    [1, 2] has two continuations)."""
    prompts = ([[1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 4, 1, 2]] + PROMPTS)[:batch]
    ar = generate_ar(target, prompts, 14).tokens
    drafter = SpyingSuffixDrafter(max_depth=4, max_tokens=max_tokens)
    decoder = SpeculativeDecoder(target, drafter, block_size=block_size)
    first = decoder.generate(prompts, 14)
    assert first.tokens == ar
    second = decoder.generate(prompts, 14)
    assert second.tokens == ar
    # the first call's outputs, but its last step's (the drafter sees the committed tokens when it proposes)
    assert drafter.global_index.num_tokens >= (14 - 5) * batch
    assert second.summary["tokens_per_step"] > first.summary["tokens_per_step"] > 1.0
    assert (drafter.deepest > 1) == (drafter.widest > 1) == (max_tokens > 1)


def test_greedy_suffix_with_adaptive_depth_equals_ar(target):
    """Adaptive speculation (the default policy and a scripted one with plain steps): every depth's proposal, and
    the indexes extended over plain steps, keep greedy output equal to AR's."""
    prompts = PROMPTS + [[7, 7, 7, 7]]
    ar = generate_ar(target, prompts, 14).tokens
    for adaptive in (True, scripted((0, 2, 0, 3, 1, 0, 0, 4))):
        drafter = SpyingSuffixDrafter(max_depth=4, max_tokens=8)
        out = SpeculativeDecoder(target, drafter, adaptive=adaptive).generate(prompts, 14)
        assert out.tokens == ar


# the index against brute force
# ----------------------------------------------------------------------------------------------
def trie_counts(index: SuffixIndex) -> dict:
    """{substring: count} of every node of the trie but the root."""
    out, stack = {}, [((), index.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def substring_counts(documents, depth: int) -> dict:
    counts = Counter()
    for doc in documents:
        for i in range(len(doc)):
            for n in range(1, min(depth, len(doc) - i) + 1):
                counts[tuple(doc[i:i + n])] += 1
    return dict(counts)


def brute_match(documents, text, max_match: int) -> tuple[int, dict]:
    """The longest suffix of text (<= max_match, >= 1 token) occurring in documents followed by a token, and the
    counts of the tokens following it; (0, {}) where none."""
    for m in range(min(max_match, len(text)), 0, -1):
        s = text[-m:]
        follow = Counter(doc[i + m] for doc in documents for i in range(len(doc) - m) if doc[i:i + m] == s)
        if follow:
            return m, dict(follow)
    return 0, {}


def index_match(suffixes, max_match: int) -> tuple[int, dict]:
    length, node = SuffixIndex.longest_match(suffixes, max_match)
    if length == 0:
        return 0, {}
    return length, {token: child.count for token, child in node.children.items()}


@pytest.mark.parametrize("seed", range(4))
def test_index_equals_brute_force_while_growing(seed):
    """A request's own index, grown by random chunks, and a global one of several documents followed by a text:
    every substring count, the longest match and its continuation counts equal a brute-force scan's."""
    rng = random.Random(seed)
    depth, max_match = 7, 5
    local, text = SuffixIndex(depth), []
    documents = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    global_index = SuffixIndex(depth)
    for doc in documents:
        global_index.add(doc)
    assert trie_counts(global_index) == substring_counts(documents, depth)
    followed = [global_index.root]
    while len(text) < 80:
        chunk = [rng.randrange(4) for _ in range(rng.randrange(0, 5))]
        local.extend(chunk)
        for token in chunk:
            followed = global_index.follow(followed, token, max_match)
        text += chunk
        assert trie_counts(local) == substring_counts([text], depth)
        assert index_match(local.suffixes, max_match) == brute_match([text], text, max_match)
        assert index_match(followed, max_match) == brute_match(documents, text, max_match)


def test_eviction_keeps_the_cap_and_only_retained_text():
    """Documents past the token cap are evicted oldest first: the stored tokens stay under the cap, the trie equals
    one built from the retained documents alone, and a text found only in an evicted document no longer matches."""
    rng = random.Random(0)
    depth, cap = 6, 40
    index, kept = SuffixIndex(depth), []
    first = [9, 8, 7, 6, 5]  # tokens no later document holds
    for doc in [first] + [[rng.randrange(4) for _ in range(rng.randrange(3, 15))] for _ in range(12)]:
        index.add(doc)
        index.evict(cap)
        kept.append(doc)
        while sum(map(len, kept)) > cap:
            kept.pop(0)
        assert index.num_tokens == sum(map(len, kept)) <= cap
        assert trie_counts(index) == substring_counts(kept, depth)
    assert first not in kept
    followed = [index.root]
    for token in first[:3]:
        followed = index.follow(followed, token, depth)
    assert index_match(followed, depth) == (0, {})


def test_tree_growth_by_path_probability():
    """After context [1, 2]: 3 (3 of 4 continuations), 3 7 (3/4 too), then 4 and 4 9 (1/4): chosen in that order,
    proposed in BFS order with parents by index (the root 0); the budget, the depth, and the score (the sum of path
    probabilities)."""
    index = SuffixIndex(6)
    for doc in ([1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 4, 9]):
        index.add(doc)
    node = index.root.children[1].children[2]
    tokens, parents, score = SuffixIndex.grow_tree(node, 3, 4)
    assert (tokens, parents) == ([3, 4, 7], [0, 0, 1]) and score == pytest.approx(7 / 4)
    assert SuffixIndex.grow_tree(node, 5, 4)[:2] == ([3, 4, 7, 9], [0, 0, 1, 2])
    assert SuffixIndex.grow_tree(node, 2, 4)[:2] == ([3, 7], [0, 1])
    assert SuffixIndex.grow_tree(node, 5, 1)[:2] == ([3, 4], [0, 0])


def test_drafter_budget_grows_with_the_match_length():
    """A match of p tokens earns ceil(ALPHA * p) draft tokens: the text 1..39 then 1..p proposes p + 1, p + 2, ..."""
    drafter = SuffixDrafter(max_depth=32, max_tokens=64)
    counting = list(range(1, 40))
    for p in (1, 2, 3):
        tokens = torch.tensor([counting + counting[:p]])
        drafter.start(tokens, torch.tensor([tokens.shape[1]]))
        draft, parents = drafter.trees(tokens, torch.tensor([tokens.shape[1]]))[0]
        budget = math.ceil(suffix.ALPHA * p)
        assert draft == counting[p:p + budget] and parents == list(range(budget))


def test_state_after_rejected_paths_equals_a_fresh_start():
    """Proposals whose paths are cut short (the committed tokens differ from the proposal after its first level):
    each request's index, its matched suffixes in both indexes and its next proposal equal those of a drafter
    started from scratch on the committed tokens (with the same global index)."""
    rng = random.Random(1)
    drafter = SuffixDrafter(max_depth=4, max_tokens=8, max_match=6)
    earlier = [[rng.randrange(3) for _ in range(20)] for _ in range(2)]
    drafter.start(torch.tensor(earlier), torch.tensor([5, 5]))
    drafter.propose(torch.tensor(earlier), torch.tensor([20, 20]), torch.zeros(2))  # sees outputs of 15 tokens
    B, L = 2, 80
    tokens = torch.zeros(B, L, dtype=torch.long)
    tokens[:, :10] = torch.tensor([[rng.randrange(3) for _ in range(10)] for _ in range(B)])
    seq_lens = torch.tensor([10, 7])
    drafter.start(tokens, seq_lens)  # the earlier batch's outputs enter the global index
    assert drafter.global_index.num_tokens > 0
    for _ in range(10):
        prop = drafter.propose(tokens, seq_lens, torch.zeros(B))
        accepted = torch.full(prop.parents.shape, -1, dtype=torch.int32)
        accepted[:, 0] = 0
        num_acc = torch.zeros(B, dtype=torch.int32)
        for b in range(B):  # accept the first child of the root, if any, then a token no proposal holds
            path = [prop.tokens[b, 1].item()] if prop.num_nodes[b] > 1 else []
            if path:
                accepted[b, 1], num_acc[b] = 1, 1
            new = path + [rng.randrange(3)]
            tokens[b, seq_lens[b]:seq_lens[b] + len(new)] = torch.tensor(new)
            seq_lens[b] += len(new)
        drafter.commit(prop, accepted, num_acc)
        fresh = SuffixDrafter(max_depth=4, max_tokens=8, max_match=6)
        fresh.global_index = drafter.global_index
        fresh.start(tokens, seq_lens)
        want = fresh.propose(tokens, seq_lens, torch.zeros(B))
        got = drafter.propose(tokens, seq_lens, torch.zeros(B))
        for a, b in zip(got[:3], want[:3]):
            assert torch.equal(a, b)
        for ours, theirs in zip(drafter._local, fresh._local):
            assert trie_counts(ours) == trie_counts(theirs) and ours.documents == theirs.documents
            assert [n.count for n in ours.suffixes] == [n.count for n in theirs.suffixes]
        assert all(a == b for x, y in zip(drafter._global_suffixes, fresh._global_suffixes) for a, b in zip(x, y))
        assert list(map(len, drafter._global_suffixes)) == list(map(len, fresh._global_suffixes))


@pytest.mark.parametrize("emitted, judged", [
    ([3, 8], [(1, 1, 0), (1, 2, 1)]),  # right at level 1, wrong at level 2 (below a node with children)
    ([4, 9], [(1, 1, 0), (2, 2, 1)]),  # a leaf at level 2: all judged, both right
    ([5], [(0, 1, 0)]),  # wrong at level 1
])
def test_shadow_judges_a_recorded_tree_along_the_emitted_path(emitted, judged):
    """After [1, 2] (followed by 3 7, 3 7 and 4 9 earlier) the tree is 3, 4 below the root, 7 below 3, 9 below 4: a
    plain step's shadow judges its levels as the tokens come, each level once, then records the next tree."""
    text = [1, 2, 3, 7, 1, 2, 3, 7, 1, 2, 4, 9, 1, 2]
    tokens = torch.tensor([text + emitted + [0]])
    drafter = SuffixDrafter(max_depth=2, max_tokens=8)
    drafter.start(tokens, torch.tensor([len(text)]))
    assert drafter.trees(tokens, torch.tensor([len(text)])) == [([3, 4, 7, 9], [0, 0, 1, 2])]
    assert drafter.shadow(tokens, torch.tensor([len(text)])) == ([0], [0], [0])  # recorded, nothing judged yet
    for n, (accepted, proposed, since) in enumerate(judged, 1):
        assert drafter.shadow(tokens, torch.tensor([len(text) + n])) == ([accepted], [proposed], [since])
    assert drafter._shadows[0] is None or drafter._shadows[0][0] == len(text) + len(judged)


def test_global_index_stays_under_its_cap_across_calls(target):
    """Each generate call adds the previous call's outputs to the global index; the cap evicts the oldest."""
    drafter = SuffixDrafter(max_depth=4, max_tokens=4, max_global_tokens=25)
    decoder = SpeculativeDecoder(target, drafter)
    sizes = []
    for prompt in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 5, 9]):
        decoder.generate([prompt], 12)
        sizes.append(drafter.global_index.num_tokens)
        if len(sizes) == 2:
            oldest = drafter.global_index.documents[0]
    assert sizes[0] == 0 and 0 < sizes[1] and max(sizes) <= 25 and sum(sizes[1:]) > 25
    assert all(doc is not oldest for doc in drafter.global_index.documents)


def test_a_drafter_that_forgot_earlier_outputs_proposes_as_a_fresh_one(target):
    """forget: the next call draws on no earlier call's outputs (the global index, and the last batch's outputs
    that the next start would have added), so its proposals, steps and outputs are a fresh drafter's."""
    prompts = [[1, 2, 3, 7, 1, 2, 3, 8], [4, 5, 6]]
    drafter = SuffixDrafter(max_depth=4, max_tokens=8)
    decoder = SpeculativeDecoder(target, drafter)
    first = decoder.generate(prompts, 14)
    decoder.generate(prompts, 14)  # (its outputs are in the global index from here on)
    drafter.forget()
    again = decoder.generate(prompts, 14)
    assert drafter.global_index.num_tokens == 0
    assert again.tokens == first.tokens and again.summary["steps"] == first.summary["steps"]
    assert again.summary["judged_by_depth"] == first.summary["judged_by_depth"]
    remembered = SpeculativeDecoder(target, SuffixDrafter(max_depth=4, max_tokens=8))
    remembered.generate(prompts, 14)
    assert remembered.generate(prompts, 14).summary["steps"] < first.summary["steps"]  # (what forget undoes)


def test_cli_suffix(capsys, byte_pair):  # noqa: F811
    base = ["--prompt", "abcabcabcab", "--target", str(byte_pair / "target"), "--drafter", "suffix",
            "--max-new-tokens", "8"]
    rc, out, _ = run_cli(capsys, *base, "--tree", "chain:3", "--suffix-tokens", "6", "--compare-ar", "--json")
    r = json.loads(out)
    assert rc == 0 and r["identical"] is True and r["drafter"] == "suffix"
    rc, out, err = run_cli(capsys, *base, "--tree", "tree:2,2")
    assert rc == 2 and "suffix drafter takes chain:K" in err and out == ""
    rc, out, err = run_cli(capsys, *base, "--suffix-max-match", "0")
    assert rc == 2 and "--suffix-max-match" in err


def test_replayed_steps_with_suffix_proposals_equal_ar(target):
    """(Emulated) CUDA graphs: the host proposal's verification replayed per tree width, over a paged cache, in two
    generate calls (the second replays the first's graphs): output equals AR's."""
    from helpers import ReplayGraph
    ar = generate_ar(target, PROMPTS, 12).tokens
    decoder = SpeculativeDecoder(target, SuffixDrafter(max_depth=4, max_tokens=8), block_size=4,
                                 cuda_graphs=ReplayGraph)
    assert decoder.generate(PROMPTS, 12).tokens == ar
    assert decoder.generate(PROMPTS, 12).tokens == ar
