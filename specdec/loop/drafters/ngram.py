"""Prompt lookup decoding: propose the tokens that followed an earlier occurrence of the sequence's last
n tokens (n from max_ngram down to min_ngram): the latest occurrence followed by num_tokens tokens,
else the earliest one (the longest continuation there is). No model; runs on the host."""
from __future__ import annotations

from bisect import bisect_right

import torch

from .base import Drafter, Proposal
from .host import ShadowJudging, new_committed_tokens


class _NgramIndex:
    """One request's n-gram start positions (n = min_ngram..max_ngram), extended as its committed tokens grow (they
    never shrink within a batch), so that a step's lookup is a few dictionary reads, not a scan of the sequence
    (which an adaptive loop would pay at every step, plain ones included)."""

    def __init__(self, ns: range):
        self.seq: list = []
        self.starts = {n: {} for n in ns}  # n -> {n-gram: its start positions, increasing}

    def extend(self, new: list) -> None:
        old = len(self.seq)
        self.seq.extend(new)
        for n, table in self.starts.items():
            for p in range(max(old - n + 1, 0), len(self.seq) - n + 1):  # the windows holding a new token
                table.setdefault(tuple(self.seq[p:p + n]), []).append(p)

    def continuation(self, max_ngram: int, min_ngram: int, num_tokens: int) -> list:
        """NgramDrafter.lookup of the sequence (the same rule, from the index)."""
        seq, n_seq = self.seq, len(self.seq)
        for n in range(min(max_ngram, n_seq - 1), min_ngram - 1, -1):
            starts = self.starts[n].get(tuple(seq[-n:]), ())
            hits = bisect_right(starts, n_seq - n - 1)  # windows ending before the last token
            if hits:
                full = bisect_right(starts, n_seq - n - num_tokens, 0, hits)  # followed by num_tokens tokens
                start = (starts[full - 1] if full else starts[0]) + n
                return seq[start:start + num_tokens]
        return []


class NgramDrafter(Drafter, ShadowJudging):
    proposes_on_host = True

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError("NgramDrafter: need num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_nodes, self.max_depth = num_tokens + 1, num_tokens
        self._index = None  # per request, from start (a proposal without a started batch scans: lookup)

    def start(self, tokens, seq_lens, *args, **kwargs):
        self._index = [_NgramIndex(range(self.min_ngram, self.max_ngram + 1)) for _ in range(tokens.shape[0])]
        self._start_shadows(tokens.shape[0])
        # the prompts are indexed here, with the prompts' prefill, not in the first step: an adaptive policy times the
        # steps, and the prompts' indexing is no step's cost
        self._extend(tokens, seq_lens)

    def lookup(self, seq: torch.Tensor) -> torch.Tensor:
        """The continuation (<= num_tokens tokens) of an earlier match of seq's suffix (see module doc)."""
        n_seq = seq.shape[0]
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # windows ending before the last token: a match has a successor
            hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                full = hits[hits + n + self.num_tokens <= n_seq]
                start = int(full[-1] if full.numel() else hits[0]) + n
                return seq[start:start + self.num_tokens]
        return seq[:0]

    def _extend(self, tokens, seq_lens) -> None:
        """Each request's index extended to its committed tokens."""
        for index, new in zip(self._index, new_committed_tokens(tokens, seq_lens, [len(i.seq) for i in self._index])):
            index.extend(new)

    def _continuations(self, tokens, seq_lens) -> list:
        if self._index is None:
            return [self.lookup(tokens[b, :n].cpu()).tolist() for b, n in enumerate(seq_lens.tolist())]
        self._extend(tokens, seq_lens)
        return [index.continuation(self.max_ngram, self.min_ngram, self.num_tokens) for index in self._index]

    def _committed(self, b: int) -> list:
        return self._index[b].seq

    def _shadow_proposal(self, b: int) -> tuple[list, list]:
        """Request b's continuation, a chain."""
        cont = self._index[b].continuation(self.max_ngram, self.min_ngram, self.num_tokens)
        return cont, list(range(len(cont)))

    def depths_available(self, tokens, seq_lens):
        return [len(c) for c in self._continuations(tokens, seq_lens)]

    def propose(self, tokens, seq_lens, temperature, depth=None):
        B, k = tokens.shape[0], self.num_tokens if depth is None else min(depth, self.num_tokens)
        out = torch.zeros(B, k + 1, dtype=torch.long)
        num_nodes = torch.ones(B, dtype=torch.int32)
        roots = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1)).cpu()
        for b, cont in enumerate(self._continuations(tokens, seq_lens)):
            cont = cont[:k]
            out[b, 0] = roots[b, 0]
            out[b, 1:1 + len(cont)] = torch.tensor(cont, dtype=torch.long)
            num_nodes[b] = 1 + len(cont)
        # only as wide as the longest continuation: a step without matches costs what a plain decoding step does
        T = int(num_nodes.max())
        parents = torch.arange(-1, T - 1, dtype=torch.int32).expand(B, T)
        dev = tokens.device
        return Proposal(out[:, :T].to(dev), parents.to(dev), num_nodes.to(dev))
