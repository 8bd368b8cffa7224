"""Prompt lookup decoding: propose the tokens that followed an earlier occurrence of the sequence's last
n tokens (n from max_ngram down to min_ngram): the latest occurrence followed by num_tokens tokens,
else the earliest one (the longest continuation there is). No model; runs on the host."""
from __future__ import annotations

import torch

from .base import Drafter, Proposal


class NgramDrafter(Drafter):
    proposes_on_host = True
    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram or num_tokens < 1:
            raise ValueError("NgramDrafter: need num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_nodes, self.max_depth = num_tokens + 1, num_tokens
        self._found = None  # (seq_lens, continuations) of depths_available, for the propose that follows it

    def start(self, *args, **kwargs):
        self._found = None

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

    def _continuations(self, tokens, seq_lens) -> list:
        lens = seq_lens.tolist()
        found, self._found = self._found, None
        if found is not None and found[0] == lens:  # (the committed tokens of a step do not change within it)
            return found[1]
        return [self.lookup(tokens[b, :n].cpu()) for b, n in enumerate(lens)]

    def depths_available(self, tokens, seq_lens):
        conts = self._continuations(tokens, seq_lens)
        self._found = (seq_lens.tolist(), conts)
        return [c.shape[0] for c in conts]

    def propose(self, tokens, seq_lens, temperature, depth=None):
        B, k = tokens.shape[0], self.num_tokens if depth is None else min(depth, self.num_tokens)
        out = torch.zeros(B, k + 1, dtype=torch.long)
        num_nodes = torch.ones(B, dtype=torch.int32)
        roots = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1)).cpu()
        for b, cont in enumerate(self._continuations(tokens, seq_lens)):
            cont = cont[:k]
            out[b, 0] = roots[b, 0]
            out[b, 1:1 + cont.shape[0]] = cont
            num_nodes[b] = 1 + cont.shape[0]
        # only as wide as the longest continuation: a step without matches costs what a plain decoding step does
        T = int(num_nodes.max())
        parents = torch.arange(-1, T - 1, dtype=torch.int32).expand(B, T)
        dev = tokens.device
        return Proposal(out[:, :T].to(dev), parents.to(dev), num_nodes.to(dev))
