"""The drafter interface shared by every way of proposing draft trees (draft model, prompt lookup, and
later MTP/Medusa heads).

A drafter sees the decoder's token buffer `tokens` (B, L) int64 whose first seq_lens[b] entries are
request b's committed sequence; the last one is the root (node 0) of the next draft tree. Per step:

    proposal = drafter.propose(tokens, seq_lens, temperature)   # a tree per request
    ... the target verifies, specdec.accept picks the path ...
    drafter.commit(accepted_nodes, num_accepted)               # keep own state in sync (rollback)
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Proposal(NamedTuple):
    """tokens (B, T) int64 (tokens[:, 0] is the root); parents (B, T) int32 (BFS order, parents[:, 0] = -1);
    num_nodes (B,) int32; draft_logits (B, T, V) or None: when given, node i's children were drawn i.i.d.
    from softmax(draft_logits[:, i] / temperature) (sampling requests); None means given proposals."""
    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    draft_logits: Optional[torch.Tensor] = None


class Drafter:
    """Base class. `max_nodes` bounds T of every proposal (the decoder sizes caches with it), `max_depth`
    the depth of its trees (the longest path the target can accept)."""

    max_nodes: int = 1
    max_depth: int = 0
    vocab_size: Optional[int] = None  # None: any vocabulary (no model)

    def start(self, tokens: torch.Tensor, seq_lens: torch.Tensor, max_len: int, temperature: torch.Tensor,
              generator: torch.Generator) -> None:
        """A new batch: `tokens`/`seq_lens` hold the prompts; sequences will not exceed max_len tokens;
        temperature (B,) is fixed for the batch; `generator` drives the drafter's own sampling."""

    def propose(self, tokens: torch.Tensor, seq_lens: torch.Tensor, temperature: torch.Tensor) -> Proposal:
        raise NotImplementedError

    def commit(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """The target accepted path accepted_nodes[b, :num_accepted[b] + 1] of the last proposal."""


class NoDrafter(Drafter):
    """Plain autoregressive decoding: the tree is the root alone."""

    def propose(self, tokens, seq_lens, temperature):
        B = tokens.shape[0]
        root = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1))
        return Proposal(root, torch.full((B, 1), -1, dtype=torch.int32, device=tokens.device),
                        torch.ones(B, dtype=torch.int32, device=tokens.device))


def sample(logits: torch.Tensor, temperature: torch.Tensor, k: int, generator: torch.Generator,
           all_greedy: bool) -> torch.Tensor:
    """k children per row of logits (B, N, V): the top-k tokens for greedy requests (temperature 0),
    k i.i.d. draws from softmax(logits / temperature) for the others. Returns (B, N, k) int64.
    all_greedy (known when the batch starts) skips the softmax and the draws."""
    B, N, V = logits.shape
    top = logits.topk(k, dim=-1).indices
    if all_greedy:
        return top
    greedy = (temperature == 0).view(B, 1, 1)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).view(B, 1, 1)
    probs = torch.softmax(logits.float() / t, dim=-1).view(B * N, V)
    drawn = torch.multinomial(probs, k, replacement=True, generator=generator).view(B, N, k)
    return torch.where(greedy, top, drawn)
