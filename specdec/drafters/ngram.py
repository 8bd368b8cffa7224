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

    def propose(self, tokens, seq_lens, temperature, depth=None):
        B, k = tokens.shape[0], self.num_tokens if depth is None else min(depth, self.num_tokens)
        out = torch.zeros(B, k + 1, dtype=torch.long)
        num_nodes = torch.ones(B, dtype=torch.int32)
        for b, n_seq in enumerate(seq_lens.tolist()):
            seq = tokens[b, :n_seq].cpu()
            cont = self.lookup(seq)[:k]
            out[b, 0] = seq[-1]
            out[b, 1:1 + cont.shape[0]] = cont
            num_nodes[b] = 1 + cont.shape[0]
        # only as wide as the longest continuation: a step without matches costs what a plain decoding step does
        T = int(num_nodes.max())
        parents = torch.arange(-1, T - 1, dtype=torch.int32).expand(B, T)
        dev = tokens.device
        return Proposal(out[:, :T].to(dev), parents.to(dev), num_nodes.to(dev))
