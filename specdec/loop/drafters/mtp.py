"""Multi-token-prediction heads as a drafter (DeepSeek-V3 MTP, one module reused autoregressively past
depth 1, as engines do).

The module's cache entry at position j is computed from (the target's hidden state h_j, token x_{j+1}) and
predicts x_{j+2}. For a committed sequence x_0 .. x_{n-1} (the root is x_{n-1}) the cache holds positions
0 .. n-3; the root's entry (position n-2: h_{n-2} and the root) is node 0 of the draft tree at slot
cache.lens, and a node at depth d sits at position cache.lens + d, the draft model's layout, so the tree
growth of DraftModelDrafter is reused; a level's nodes condition on their parents' outputs (`_expand`).
After verification only the root's entry is exact (the target's hidden state and a real token): it is kept,
and the accepted path's entries are recomputed from the target's hidden states at the next proposal (the
"pending" entries, at most depth + 1), so the cache always equals a fresh run over the accepted tokens.

`FeatureHeadDrafter` holds that machinery; a head supplies `condition` (the target's hidden states -> an entry's
hidden input), `_layer` (its decoder layer over new nodes on its cache), `_step` (their CachedStep), `head_logits`
and `recycled` (its output -> the next level's hidden input). MTPDrafter and the EAGLE-3 drafter (eagle3.py) are
two such heads.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..models.llama import KVCache, Llama, chain_tree
from ..models.mtp import MTP
from ...sampling import SamplingParams
from .base import MAX_SKIPS
from .draft_model import DraftModelDrafter, TreeSpec

PREFILL_CHUNK = 256  # prompt positions per chain-shaped chunk of the heads' prefill


class FeatureHeadDrafter(DraftModelDrafter):
    """A one-layer head conditioned on the target's hidden states, with its own KV cache (see the module's
    docstring); self.model is the target. head_cfg: the head layer's config (its cache's rows), head_dtype its
    dtype. `uses_target_hidden` is what the loop asks the target's forwards for (their return_hidden)."""
    uses_target_hidden = True

    def __init__(self, target: Llama, head_cfg, head_dtype: torch.dtype, tree: TreeSpec | str = "chain:4", *,
                 kv_dtype: Optional[torch.dtype] = None):
        super().__init__(target, tree, kv_dtype=kv_dtype)
        self.head_cfg, self.head_dtype = head_cfg, head_dtype
        self.max_pending = self.max_depth + 1  # the accepted path's entries, recomputed at the next proposal

    # what a head supplies
    def condition(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states (..., target width) -> an entry's hidden input (..., head dim)."""
        raise NotImplementedError

    def _layer(self, tokens, hidden, k_cache, v_cache, step):
        """The head's layer over new nodes tokens (B, F) with hidden inputs (B, F, dim) -> its output (B, F, dim)."""
        raise NotImplementedError

    def _step(self, depth, mask, num_nodes, start):
        """The CachedStep of new nodes on self.cache (the head's rotary)."""
        raise NotImplementedError

    def head_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output (..., dim) -> logits over the target's vocabulary (..., V)."""
        raise NotImplementedError

    def recycled(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output (..., dim) -> the hidden input of the nodes below it."""
        raise NotImplementedError

    max_skips = MAX_SKIPS  # (a skipped step's entry is the target's hidden state then: only MAX_SKIPS are kept)

    def reserve_chain(self, depth: int) -> None:
        """Room (before start) for the entries of a verified chain of `depth` drafts that the loop proposed instead
        of this drafter's tree (jump-forward's forced tokens): its accepted path is committed as any other."""
        self.max_pending = max(self.max_pending, depth + 1)

    def follow_chain(self, depth: int) -> None:
        """The step verified a chain of `depth` accepted drafts (`reserve_chain`): the next proposal runs that
        many pending entries at least."""
        self._last_depth = max(self._last_depth, depth)

    def start(self, tokens, seq_lens, max_len, temperature, seeds, params=SamplingParams(), *, target_hidden):
        B, dev = tokens.shape[0], tokens.device
        self._last_depth = 0  # (the prompt leaves the root's entry alone)
        self._start_sampling(temperature, seeds, params, dev)
        cfg = dataclasses.replace(self.head_cfg, n_layers=1)
        self.cache = KVCache.reused(getattr(self, "cache", None), cfg, B,
                                    max_len + max(self.num_fed, self.max_pending) + 2 + MAX_SKIPS,
                                    dtype=self.kv_dtype or self.head_dtype, device=dev)
        # width -> its chain (_root_logits); a compiled or captured step's widths built here, outside any graph
        self.pending_trees = {w: chain_tree(B, w, device=dev) for w in (self.max_pending, self.max_pending + MAX_SKIPS)}
        h = self.condition(target_hidden)  # (B, n_max - 1, dim): positions 0 .. seq_lens - 2
        lengths = (seq_lens - 2).clamp(min=0).to(torch.int32)  # positions 0 .. n-3 are committed now
        for c0, T, n, tree in self.model.prefill_chunks(lengths, PREFILL_CHUNK):
            self._run(tokens[:, c0 + 1:c0 + 1 + T], h[:, c0:c0 + T], tree.depth, tree.mask, tree.num_nodes)
            self.cache.commit(n)
        self.pending = h.new_zeros(B, self.max_pending + MAX_SKIPS, h.shape[-1])  # and those of skipped steps
        last = (seq_lens.long() - 2).clamp(min=0).view(B, 1, 1).expand(B, 1, h.shape[-1])
        if h.shape[1]:
            self.pending[:, :1] = h.gather(1, last)
        self.num_pending = (seq_lens >= 2).to(torch.int32)

    # what start sets (a step's own values, has_root and level_hidden, are set as it goes: no state across steps)
    _state_names = ("cache", "pending", "num_pending", "pending_trees", "_last_depth", "rng", "temperature", "params",
                    "all_greedy", "skipped", "pending_width", "lagging", "catching_up", "few_shapes")

    @property
    def min_pending(self):
        """The entries a drafted step leaves: its accepted path and the bonus token's, as many as its depth + 1.
        Loops whose steps are compiled or captured (`few_shapes`) take the deepest step's always (the width is part
        of the graph key); an eager adaptive loop's shallow steps run no padding (rows that would cost every
        shallow step a share of its time)."""
        return self.max_pending if self.few_shapes else self._last_depth + 1

    def advance(self, depth):
        super().advance(depth)  # (the width from the depth of the last drafted step)
        if depth != 0:
            self._last_depth = self.max_depth if depth is None else depth

    def _run(self, tokens, hidden, depth, mask, num_nodes=None, start=0):
        """The head over new tree nodes tokens (B, F) conditioned on hidden (B, F, dim) (`condition`, `recycled`)."""
        v_cache = None if self.cache.v is None else self.cache.v[0]  # (an MLA module: the latents alone)
        return self._layer(tokens, hidden, self.cache.k[0], v_cache, self._step(depth, mask, num_nodes, start))

    def _root_logits(self, tokens, seq_lens):
        """Run the pending entries (positions cache.lens .. n-2, tokens x_{j+1}), commit all but the root's."""
        B, P, c = tokens.shape[0], self.pending_width, self.num_pending  # (wider after skipped steps)
        idx = (self.cache.lens.long().unsqueeze(1) + 1 + torch.arange(P, device=tokens.device))
        pend = tokens.gather(1, idx.clamp(max=tokens.shape[1] - 1))
        chain = self.pending_trees.get(P)
        if chain is None:  # (an eager loop's)
            chain = self.pending_trees[P] = chain_tree(B, P, device=tokens.device)
        out = self._run(pend, self.pending[:, :P], chain.depth, chain.mask, c.clamp(min=1))
        at = (c.long() - 1).clamp(min=0).view(B, 1, 1).expand(B, 1, out.shape[-1])
        root_out = out.gather(1, at)
        self.cache.commit((c - 1).clamp(min=0))
        self.has_root = c >= 1
        self.level_hidden = self.recycled(root_out)
        return self.head_logits(root_out[:, 0])

    def _expand(self, tokens, parent, depth, mask, start):
        hidden = self.level_hidden.gather(1, parent.long().unsqueeze(-1).expand(-1, -1, self.level_hidden.shape[-1]))
        out = self._run(tokens, hidden, depth, mask, start=start)
        self.level_hidden = self.recycled(out)
        return self.head_logits(out)

    def propose(self, tokens, seq_lens, temperature, depth=None):
        prop = super().propose(tokens, seq_lens, temperature, depth)
        # a request without a root entry yet (a one-token prompt) proposes its root alone
        return prop._replace(num_nodes=torch.where(self.has_root, prop.num_nodes, 1))

    def commit(self, proposal, accepted_nodes, num_accepted, *, target_hidden):
        self.cache.lens += self.has_root.to(torch.int32)  # the root's entry is exact: keep it
        nodes = accepted_nodes[:, :self.max_pending].long().clamp(min=0)
        path = target_hidden.gather(1, nodes.unsqueeze(-1).expand(-1, -1, target_hidden.shape[-1]))
        # in place (state across steps); a shallow proposal's path is narrower: entries past num_pending are padding
        self.pending[:, :path.shape[1]].copy_(self.condition(path))
        self.num_pending.copy_(num_accepted + 1)

    def skip(self, *, target_hidden):
        """A step that verified the root alone: its entry (the root's hidden state, the token emitted) is
        pending too."""
        B, dim = self.pending.shape[0], self.pending.shape[-1]
        at = self.num_pending.long().view(B, 1, 1).expand(B, 1, dim)
        self.pending.scatter_(1, at, self.condition(target_hidden[:, :1]))
        self.num_pending += 1


class MTPDrafter(FeatureHeadDrafter):
    """DeepSeek-V3's MTP module (its first; reused past depth 1) on the target's last hidden state, through the
    target's final norm, embedding and LM head; recycled through the module's own final norm."""

    def __init__(self, target: Llama, mtp: MTP, tree: TreeSpec | str = "chain:4", *,
                 kv_dtype: Optional[torch.dtype] = None):
        if mtp.num_modules != 1:
            raise ValueError(f"mtp: {mtp.num_modules} modules; the drafter runs one module (reused past depth 1)")
        super().__init__(target, target.cfg, target.dtype, tree, kv_dtype=kv_dtype)
        self.mtp, self.layer = mtp, mtp.layers[0]

    def condition(self, target_hidden):
        return self.model.model.norm(target_hidden)

    def _layer(self, tokens, hidden, k_cache, v_cache, step):
        return self.layer.forward_cached(self.model.model.embed_tokens(tokens), hidden, k_cache, v_cache, step)

    def _step(self, depth, mask, num_nodes, start):
        return self.model.cached_step(self.cache, depth, mask, num_nodes, start)

    def head_logits(self, out):
        return self.mtp.logits(self.model, 0, out)

    def recycled(self, out):
        return self.layer.shared_head.norm(out)
