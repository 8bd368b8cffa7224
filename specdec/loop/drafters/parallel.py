"""A parallel drafter (PARD, arXiv 2504.18583): one forward of a small model drafts every level of the tree.

The model is a draft model with one more embedding row, the mask token (`mask_token_id`, the target's vocabulary
size; its logits column is dropped). For a committed sequence x_0 .. x_{n-1} (the root is x_{n-1}) one forward reads
the tokens not yet in its cache, then depth - 1 mask tokens at positions n .. n + depth - 2: the output at the root
is the law of x_n (depth 1), the one at mask i the law of x_{n+i} (depth i + 1). These per-position laws
q_1 .. q_depth see the context alone, never the tokens drafted before them.

Trees (`TreeSpec`, as DraftModelDrafter: chain:K, tree:b1,b2,.., parents:.., dynamic:N,D,k): every node at depth d
takes its children from q_{d+1}, the same law for every node of a level (at each node processed by the sampling
filters at its own path's counts and masked by its own grammar row, as accept processes it). Greedy requests get
the top-b candidates of q_{d+1} under every node of level d, so a tree:b1,b2 is the product of the levels' top
candidates; sampling requests get b i.i.d. draws from q_{d+1} per node, fresh draws for each node; dynamic trees
rank paths by the sum of their levels' log-laws (given proposals).

Losslessness. accept is told, at node i of depth d, the law q_{d+1} (draft_logits[:, i]) and verifies i's children
by speculative sampling (or the block / traversal verifiers). Its guarantee needs only that, given the path to i
and everything drawn so far, i's children are i.i.d. draws from the law it is told, with randomness independent of
the verification's. That law need not be the draft model's conditional given the path: q_{d+1} is fixed before
any token of this proposal is drawn (one forward over the committed tokens), and each node's children are fresh
draws from it (the drafter's own counter-based stream, keyed apart from accept's), so conditionally on any path
they are i.i.d. q_{d+1}, exactly what accept is told. The tree must be built accordingly: children chosen by
something that depends on the drawn tokens (dropping duplicates of the parent's siblings, reusing one level's draws
under a subset of nodes picked by their tokens) would not be i.i.d. q_{d+1} given the path, and the output would
leave the target's law (tests/loop/test_parallel.py checks the law by chi-square, with such a negative control).

The cache holds real tokens only. Its committed entries are those of x_0 .. x_{n-2} (all but the root); a proposal
runs the pending tokens (those committed since, root included: at most max_depth + 2 after a drafted step, and
MAX_SKIPS more after skipped steps) and the masks in one chain-shaped forward, then commits the pending tokens but
the root. The masks' and the root's K/V lie past cache.lens, overwritten by the next forward. Commit therefore has
nothing to do: the accepted tokens reach the cache with the next proposal, computed from the real tokens, so the
cache always equals a fresh prefill of the committed tokens, whatever the target rejected.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..models.llama import Llama, LlamaConfig, chain_tree
from ...sampling import SamplingParams
from .base import MAX_SKIPS
from .draft_model import DraftModelDrafter, TreeSpec


def add_mask_token(draft: Llama) -> Llama:
    """A parallel drafter's model made from a draft model: one more embedding row (the mask token, id = the draft's
    vocabulary size, recorded as config field mask_token_id), initialized to the mean of the others; every other
    weight copied."""
    V = draft.cfg.vocab_size
    cfg = LlamaConfig(**{**draft.cfg.to_dict(), "vocab_size": V + 1, "extra": {**draft.cfg.extra, "mask_token_id": V}})
    model = Llama(cfg).to(device=draft.device, dtype=draft.dtype)
    state = draft.state_dict()
    for name in ("model.embed_tokens.weight",) + (() if cfg.tie_embeddings else ("lm_head.weight",)):
        state[name] = torch.cat((state[name], state[name].mean(0, keepdim=True)))
    model.load_state_dict(state)
    return model


class ParallelDrafter(DraftModelDrafter):
    one_forward_proposals = True

    def __init__(self, model: Llama, tree: TreeSpec | str = "chain:4", *, mask_token_id: Optional[int] = None,
                 kv_dtype: Optional[torch.dtype] = None):
        """model: a draft model whose last embedding row is the mask token; mask_token_id: its id (default: the
        checkpoint's config field mask_token_id), which must be the last row: the drafter's vocabulary is the ids
        below it."""
        if mask_token_id is None:
            mask_token_id = model.cfg.extra.get("mask_token_id")
        if mask_token_id != model.cfg.vocab_size - 1:
            raise ValueError(f"mask_token_id: {mask_token_id!r}; the parallel drafter's mask token is the model's last "
                             f"embedding row ({model.cfg.vocab_size - 1}: config field mask_token_id)")
        super().__init__(model, tree, kv_dtype=kv_dtype)
        self.mask_token_id = mask_token_id
        self.vocab_size = mask_token_id
        # the pending tokens after a drafted step: the previous root, the accepted path and the next root
        self.min_pending = self.max_depth + 2

    def start(self, tokens, seq_lens, max_len, temperature, seeds, params=SamplingParams()):
        B, dev = tokens.shape[0], tokens.device
        self._start_sampling(temperature, seeds, params, dev)
        widest = self.min_pending + MAX_SKIPS + self.max_depth - 1
        self.cache = self.model.new_cache(B, max_len + widest, kv_dtype=self.kv_dtype,
                                          reuse=getattr(self, "cache", None))
        self.lagging = True  # the prompts go through the model with the first proposal's catch_up
        # width -> its chain, for every width a proposal runs (pending entries, then depth - 1 masks)
        self.chains = {p + d - 1: chain_tree(B, p + d - 1, device=dev)
                       for p in (self.min_pending, self.min_pending + MAX_SKIPS) for d in range(1, self.max_depth + 1)}

    _state_names = tuple(n for n in DraftModelDrafter._state_names if n != "chain2") + ("chains",)

    def position_laws(self, tokens: torch.Tensor, seq_lens: torch.Tensor, depth: int) -> torch.Tensor:
        """One forward over the pending tokens then depth - 1 masks; commits the pending tokens but the root.
        Returns the logits (B, depth, V) of depths 1 .. depth below the root (V: the target's vocabulary)."""
        cache, W = self.cache, self.pending_width + depth - 1
        dev = tokens.device
        n_pend = (seq_lens - cache.lens).to(torch.int32)  # 1 .. pending_width
        cols = torch.arange(W, device=dev)
        idx = (cache.lens.long().unsqueeze(1) + cols).clamp(max=tokens.shape[1] - 1)
        feed = torch.where(cols < n_pend.unsqueeze(1), tokens.gather(1, idx), self.mask_token_id)
        chain = self.chains[W]
        logits = self.model.forward_cached(feed, cache, chain.depth, chain.mask)
        rows = (n_pend.long() - 1).unsqueeze(1) + torch.arange(depth, device=dev)  # the root, then the masks
        laws = logits.gather(1, rows.unsqueeze(2).expand(-1, -1, logits.shape[-1]))[..., :self.vocab_size]
        cache.commit(n_pend - 1)
        return laws

    def propose(self, tokens, seq_lens, temperature, depth=None):
        depth = self.max_depth if depth is None else depth
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"depth: {depth} outside 1 .. {self.max_depth} (the drafter's tree)")
        self.laws = self.position_laws(tokens, seq_lens, depth)
        root = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1))
        if self.tree.parents is not None:
            proposal = self._propose_static(root, self.laws[:, 0], depth)
        else:
            proposal = self._propose_dynamic(root, self.laws[:, 0], depth)
        return proposal._replace(cache_slots=None)

    def _expand(self, tokens, parent, depth, mask, start):
        """The law of the children of the nodes at depths depth (B, F): that of the position below them, for any
        node of the level (no forward: the proposal's one forward gave them all)."""
        return self.laws.gather(1, depth.long().unsqueeze(2).expand(-1, -1, self.laws.shape[-1]))

    def commit(self, proposal, accepted_nodes, num_accepted):
        """Nothing to keep: the accepted tokens are pending for the next proposal's forward (module doc)."""
