"""Suffix decoding (Oliaro et al., arXiv 2411.04975): a model-free drafter that matches the longest suffix of a
request's tokens against two indexes, one over its own prompt and output and one GLOBAL over earlier requests'
outputs (kept across generate calls, bounded by a token cap that evicts the oldest outputs first), and grows a
speculation tree from the matched context's continuations, the most frequent first. No model; runs on the host.

The tree: from the matched node, greedily the candidate with the highest estimated path probability (the product
of the conditional frequencies count(context + x) / count(context followed by any token) along its path), while
that probability is at least MIN_PROB, up to a node budget of ALPHA * match length tokens (capped by max_tokens and
the depth asked for). Of the two indexes' trees the one with the higher score (the sum of its nodes' path
probabilities: the tokens it is expected to get accepted) is proposed. Proposals carry no draft logits: the
verifier's token-wise check of given proposals is lossless for any tree, and greedy output equals AR's."""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Optional

import torch

from .base import Drafter, Proposal
from .host import ShadowJudging, new_committed_tokens

# budget = ALPHA * match length (the paper's MAX_SPEC = alpha * p): a context matched over p tokens has predicted
# the text that long, and a short match is weak evidence, not worth a wide tree's verification. 4, not vLLM's
# default 1 (max_spec_factor): where a step of a few more nodes costs the target about what a narrower one does (small
# batches), 1 leaves short matches' likely continuations unproposed, and 4 gets more tokens per step and per second
ALPHA = 4.0
# the least path probability a node is proposed with (vLLM's default min_token_prob): rarer continuations
# widen the target's step more than they are expected to add accepted tokens
MIN_PROB = 0.1


class _Node:
    """A trie node: the occurrences of the string from the root to it, and its one-token extensions."""
    __slots__ = ("children", "count")

    def __init__(self):
        self.children: dict = {}  # token -> _Node
        self.count = 0


class SuffixIndex:
    """Every substring of at most `depth` tokens of a set of documents, in a trie with its occurrence counts (a
    depth-bounded suffix tree, uncompressed): the node of string s counts s's occurrences, each child x of it those
    of s + x. Documents are added whole (`add`) or grow at the end (`extend` appends to the latest one); no
    substring crosses two documents. `evict(cap)` removes the oldest documents until at most cap tokens remain.

    Costs: appending a token touches `depth` nodes (O(depth) time and at most `depth` new nodes, so memory is
    O(stored tokens * depth)); removing a document of n tokens is O(n * depth); following a text one token at
    a time (`follow`) is O(max match) per token; a match and its tree cost O(max match + nodes * log nodes)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.documents: deque = deque()  # token lists, the oldest first
        self.num_tokens = 0
        # the nodes of the latest document's suffixes of length 0 .. min(its length, depth), by length
        self.suffixes = [self.root]

    def add(self, document: list) -> None:
        """A new document (the suffixes of the previous one are no longer extended)."""
        self.documents.append([])
        self.suffixes = [self.root]
        self.extend(document)

    def extend(self, new: list) -> None:
        """Append tokens to the latest document."""
        if not self.documents:
            self.documents.append([])
        self.documents[-1].extend(new)
        self.num_tokens += len(new)
        for token in new:
            grown = [self.root]
            for node in self.suffixes[:self.depth]:  # (a suffix `depth` long grows past the trie's depth)
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self.suffixes = grown

    def evict(self, cap: int) -> None:
        """Remove the oldest documents until at most cap tokens remain (the latest one too, if it alone is over)."""
        while self.num_tokens > cap:
            document = self.documents.popleft()
            self.num_tokens -= len(document)
            for start in range(len(document)):
                node = self.root
                for token in document[start:start + self.depth]:
                    child = node.children[token]
                    child.count -= 1
                    if child.count == 0:  # (its descendants on this path counted this occurrence alone)
                        del node.children[token]
                        break
                    node = child
            if not self.documents:
                self.suffixes = [self.root]

    def follow(self, suffixes: list, token: int, longest: int) -> list:
        """The nodes of a text's suffixes that this index holds (by length, from the root, at most `longest` long),
        after the text grew by `token`, from those before (the index unchanged in between)."""
        return [self.root] + [node.children[token] for node in suffixes[:longest] if token in node.children]

    @staticmethod
    def longest_match(suffixes: list, longest: int) -> tuple[int, Optional[_Node]]:
        """(length, node) of the longest of the suffixes, at most `longest` long, that occurs followed by a token
        (its node has children); (0, None) where none does, not even the empty one."""
        for length in range(min(longest, len(suffixes) - 1), -1, -1):
            if suffixes[length].children:
                return length, suffixes[length]
        return 0, None

    @staticmethod
    def grow_tree(node: _Node, budget: int, depth: int) -> tuple[list, list, float]:
        """The speculation tree after context `node`: (tokens, parents, score) of its nodes but the root, in BFS
        order (parents index these nodes, the root being 0), at most budget of them and depth levels deep, added
        greedily by path probability (at least MIN_PROB); score: the sum of their path probabilities."""
        chosen = []  # (level, token, parent's index in chosen order, 0 = the root)
        candidates: list = []  # heap of (-path probability, token, parent, level, node)

        def offer(parent_node, parent, level, prob):
            total = sum(child.count for child in parent_node.children.values())
            for token, child in parent_node.children.items():
                heapq.heappush(candidates, (-prob * child.count / total, token, parent, level, child))

        offer(node, 0, 1, 1.0)
        score = 0.0
        while candidates and len(chosen) < budget:
            neg_prob, token, parent, level, child = heapq.heappop(candidates)
            if -neg_prob < MIN_PROB:
                break
            chosen.append((level, token, parent))
            score -= neg_prob
            if level < depth and child.children:
                offer(child, len(chosen), level + 1, -neg_prob)
        # BFS order: by level, stably (a parent was chosen before its children, so it keeps a smaller index)
        order = sorted(range(len(chosen)), key=lambda i: chosen[i][0])
        position = {i + 1: n + 1 for n, i in enumerate(order)}
        position[0] = 0
        return [chosen[i][1] for i in order], [position[chosen[i][2]] for i in order], score


class SuffixDrafter(Drafter, ShadowJudging):
    """Suffix decoding (module doc). max_depth: the deepest tree (the levels the target can accept); max_tokens: the
    most draft tokens per tree (max_nodes = max_tokens + 1); max_match: the longest context matched; max_global_tokens:
    the global index's cap (earlier requests' outputs, the oldest evicted first).

    Each request's own index is extended from the committed tokens before each proposal (like NgramDrafter's), so a
    rejected path never enters it and there is nothing to roll back in commit. The global index takes the previous
    batch's outputs as far as its last proposal saw them (a request that finished earlier than others grew on by the
    target's tokens: its continuation all the same) when the next batch starts; within a batch it is fixed, so each
    request follows it incrementally (`SuffixIndex.follow`)."""
    proposes_on_host = True

    def __init__(self, max_depth: int = 8, max_tokens: int = 16, max_match: int = 32, max_global_tokens: int = 4096):
        if min(max_depth, max_tokens, max_match) < 1 or max_global_tokens < 0:
            raise ValueError("SuffixDrafter: need max_depth, max_tokens, max_match >= 1 and max_global_tokens >= 0")
        self.max_depth, self.max_tokens, self.max_match = max_depth, max_tokens, max_match
        self.max_nodes = max_tokens + 1
        self.max_global_tokens = max_global_tokens
        # a match of max_match tokens and a tree max_depth deep below it
        self.global_index = SuffixIndex(max_match + max_depth)
        self._local = None  # per request: SuffixIndex of its prompt and committed output, from start
        self._global_suffixes = None  # per request: its suffixes' nodes in global_index
        self._prompt_lens = None

    def forget(self) -> None:
        """Drop what earlier requests' outputs taught it: an empty global index, and the last batch's outputs (which
        the next `start` would add) dropped too; as a fresh drafter, for a run that must not draw on earlier ones
        (a benchmark's repeated passes over the same prompts)."""
        self.global_index = SuffixIndex(self.max_match + self.max_depth)
        self._local = None

    def start(self, tokens, seq_lens, *args, **kwargs):
        if self._local is not None:  # the previous batch's outputs, before this batch follows the global index
            for index, prompt_len in zip(self._local, self._prompt_lens):
                output = index.documents[-1][prompt_len:]  # (a prompt has a token at least)
                if output and self.max_global_tokens:
                    self.global_index.add(output[-self.max_global_tokens:])
            self.global_index.evict(self.max_global_tokens)
        B = tokens.shape[0]
        self._local = [SuffixIndex(self.max_match + self.max_depth) for _ in range(B)]
        self._global_suffixes = [[self.global_index.root] for _ in range(B)]
        self._prompt_lens = seq_lens.tolist()
        self._start_shadows(B)
        # the prompts are indexed with the prompts' prefill, not in the first step (an adaptive policy times steps)
        self._extend(tokens, seq_lens)

    def _extend(self, tokens, seq_lens) -> None:
        """Each request's indexes brought up to its committed tokens."""
        new = new_committed_tokens(tokens, seq_lens, [index.num_tokens for index in self._local])
        for b, new_tokens in enumerate(new):
            self._local[b].extend(new_tokens)
            for token in new_tokens:
                self._global_suffixes[b] = self.global_index.follow(self._global_suffixes[b], token, self.max_match)

    def trees(self, tokens, seq_lens, depth: Optional[int] = None) -> list:
        """Each request's tree (tokens, parents) below its root (`SuffixIndex.grow_tree`), at most depth levels
        (None: max_depth): the better-scoring of its own index's and the global index's."""
        self._extend(tokens, seq_lens)
        return [self._tree(b, depth) for b in range(len(self._local))]

    def _tree(self, b: int, depth: Optional[int]) -> tuple[list, list]:
        """Request b's tree (`trees`), from its indexes as they stand."""
        depth = self.max_depth if depth is None else min(depth, self.max_depth)
        best = ([], [], 0.0)
        for suffixes in (self._local[b].suffixes, self._global_suffixes[b]):
            length, node = SuffixIndex.longest_match(suffixes, self.max_match)
            budget = min(self.max_tokens, math.ceil(ALPHA * length))
            if node is not None and budget > 0:
                tree = SuffixIndex.grow_tree(node, budget, depth)
                if tree[2] > best[2]:
                    best = tree
        return best[:2]

    def _committed(self, b: int) -> list:
        return self._local[b].documents[-1]

    def _shadow_proposal(self, b: int) -> tuple[list, list]:
        return self._tree(b, None)

    def depths_available(self, tokens, seq_lens):
        return [_depth(parents) for _, parents in self.trees(tokens, seq_lens)]

    def propose(self, tokens, seq_lens, temperature, depth=None):
        trees = self.trees(tokens, seq_lens, depth)
        B = tokens.shape[0]
        # only as wide as the widest tree: a step without matches costs what a plain decoding step does
        T = 1 + max(len(draft) for draft, _ in trees)
        out = torch.zeros(B, T, dtype=torch.long)
        parents = torch.zeros(B, T, dtype=torch.int32)  # (padding nodes' parents are never read)
        parents[:, 0] = -1
        num_nodes = torch.ones(B, dtype=torch.int32)
        out[:, 0] = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1)).cpu()[:, 0]
        for b, (draft, draft_parents) in enumerate(trees):
            out[b, 1:1 + len(draft)] = torch.tensor(draft, dtype=torch.long)
            parents[b, 1:1 + len(draft)] = torch.tensor(draft_parents, dtype=torch.int32)
            num_nodes[b] = 1 + len(draft)
        dev = tokens.device
        return Proposal(out.to(dev), parents.to(dev), num_nodes.to(dev))


def _depth(parents: list) -> int:
    """The levels of a tree given by its non-root nodes' parents (BFS order, the root 0)."""
    levels = [0]
    for parent in parents:
        levels.append(levels[parent] + 1)
    return max(levels)
