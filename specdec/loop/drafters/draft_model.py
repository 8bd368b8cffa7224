"""A smaller model with the target's vocabulary drafts a chain or a tree, level by level.

Tree shapes (`parse_tree`):
  chain:K          K tokens in a row
  tree:b1,b2,...   every node at depth d-1 gets b_d children (the draft's top-b_d tokens, or b_d i.i.d.
                   draws when sampling)
  parents:-1,0,0,1 an explicit topology in breadth-first order (parents non-decreasing)
  dynamic:N,D,k    EAGLE-2: D levels; at each level the k best nodes by cumulative draft log-probability
                   are expanded into their top-k children; the N-1 best nodes of all those candidates
                   (plus the root) form the tree.

The draft keeps its own KV cache. Node i's K/V is written at slot lens + cache_slots[i] while drafting
(the root at slot 0; a node never run through the draft has slot num_fed); the proposal carries
cache_slots to commit, where `kv_rollback` keeps the accepted path. Only expanded nodes are run through
the draft, so the path's last node may still be missing from the cache: it is run, together with the
next root, at the start of the next proposal ("pending" tokens, never more than two).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import specdec
from ..models.llama import Llama, chain_tree
from ...reference import GREEDY_BELOW
from ...sampling import SamplingParams
from .base import (MAX_SKIPS, DepthControl, DraftRandom, Drafter, Proposal, StepState, child_counts, grammar_masked,
                   sample)


@dataclass(frozen=True)
class TreeSpec:
    parents: Optional[tuple] = None  # static topology (BFS order), or None for dynamic
    nodes: int = 0  # dynamic: total nodes incl. the root
    depth: int = 0
    topk: int = 0

    @property
    def max_nodes(self) -> int:
        return len(self.parents) if self.parents is not None else self.nodes


def parse_tree(spec: str) -> TreeSpec:
    """A TreeSpec from 'chain:K', 'tree:b1,b2,..', 'parents:-1,0,..' or 'dynamic:N,D,k' (see module doc)."""
    kind, _, args = spec.partition(":")
    try:
        nums = [int(a) for a in args.split(",")] if args else []
    except ValueError:
        raise ValueError(f"tree spec {spec!r}: arguments must be integers") from None
    if kind == "chain" and len(nums) == 1 and nums[0] >= 1:
        return TreeSpec(parents=tuple(range(-1, nums[0])))
    if kind == "tree" and nums and min(nums) >= 1:
        parents, level = [-1], [0]
        for b in nums:
            nxt = []
            for p in level:
                for _ in range(b):
                    nxt.append(len(parents))
                    parents.append(p)
            level = nxt
        return TreeSpec(parents=tuple(parents))
    if kind == "parents" and nums:
        ok = nums[0] == -1 and all(0 <= p < i for i, p in enumerate(nums) if i) and nums[1:] == sorted(nums[1:])
        if not ok:
            raise ValueError(f"tree spec {spec!r}: parents must start with -1, have 0 <= parents[i] < i and be "
                             "non-decreasing (breadth-first numbering)")
        return TreeSpec(parents=tuple(nums))
    if kind == "dynamic" and len(nums) == 3 and all(n >= 1 for n in nums):
        n, d, k = nums
        candidates = k + (d - 1) * k * k
        if not 2 <= n <= 1 + candidates:
            raise ValueError(f"tree spec {spec!r}: N must be in [2, {1 + candidates}] for D={d}, k={k}")
        return TreeSpec(nodes=n, depth=d, topk=k)
    raise ValueError(f"tree spec {spec!r}: expected chain:K, tree:b1,b2,..., parents:-1,0,... or dynamic:N,D,k")


def _levels(parents: list[int]) -> list[tuple[int, int]]:
    """[(start, end)) node ranges of each depth of a BFS-ordered tree."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return [(depth.index(d), len(depth) - depth[::-1].index(d)) for d in range(max(depth) + 1)]


class DraftModelDrafter(Drafter, DepthControl, StepState):
    def __init__(self, model: Llama, tree: TreeSpec | str = "chain:4", *, kv_dtype: Optional[torch.dtype] = None):
        """kv_dtype: the draft's KV cache dtype, the model's (default) or float8."""
        self.model, self.kv_dtype = model, kv_dtype
        self.tree = parse_tree(tree) if isinstance(tree, str) else tree
        self.max_nodes = self.tree.max_nodes
        self.max_depth = self.tree.depth if self.tree.parents is None else len(_levels(list(self.tree.parents))) - 1
        self.vocab_size = model.cfg.vocab_size
        self.samples_children = self.tree.parents is not None  # (dynamic trees are given proposals)
        if self.tree.parents is not None:
            self._init_static(list(self.tree.parents))
        else:
            self.num_fed = 1 + (self.tree.depth - 1) * self.tree.topk

    def _init_static(self, parents: list[int]):
        T = len(parents)
        self.levels = _levels(parents)
        rank = [0] * T  # index among siblings: node i is its parent's rank-th best (or rank-th drawn) child
        kids = [0] * T
        for i in range(1, T):
            rank[i] = kids[parents[i]]
            kids[parents[i]] += 1
        self.branching = [max(kids[s:e]) for s, e in self.levels[:-1]]  # children drawn per node of a level
        self.num_fed = self.levels[-1][0]  # every node above the deepest level is run through the draft
        self.parents = torch.tensor(parents, dtype=torch.int32)
        level_start = [s for s, e in self.levels for _ in range(s, e)]
        self.local_parent = torch.tensor([p - level_start[p] if p >= 0 else 0 for p in parents])  # within its level
        self.rank = torch.tensor(rank)
        # (1, T_d) per depth limit d (a prefix of the tree): the slots of nodes run through the draft, num_fed for
        # those of the last level kept (never run)
        self.cache_slots = [torch.where(torch.arange(e) >= s, self.num_fed, torch.arange(e)).unsqueeze(0)
                            for s, e in self.levels]
        self.tree_info = specdec.build_tree(self.parents.unsqueeze(0))  # depth (1, T), mask (1, T, W)

    # -------------------------------------------------------------------------------------------
    def start(self, tokens, seq_lens, max_len, temperature, seeds, params=SamplingParams()):
        B = tokens.shape[0]
        self._start_sampling(temperature, seeds, params, tokens.device)
        # (+ MAX_SKIPS: the padding of the pending entries after skipped steps)
        self.cache = self.model.new_cache(B, max_len + self.num_fed + 2 + MAX_SKIPS, kv_dtype=self.kv_dtype,
                                          reuse=getattr(self, "cache", None))
        self.lagging = True  # the prompts go through the draft with the first proposal's catch_up
        self.chain2 = specdec.build_tree(torch.tensor([[-1, 0]], dtype=torch.int32, device=tokens.device).expand(B, 2))

    def _start_sampling(self, temperature, seeds, params, dev):
        """The per-request random streams and sampling law, and the static tree's tensors on the batch's device:
        the tree of each depth limit d (a BFS prefix of the whole tree), built once."""
        self.rng, self.temperature, self.params = DraftRandom(seeds, dev), temperature, params
        self.all_greedy = bool((temperature < GREEDY_BELOW).all())
        if self.tree.parents is not None:
            for name in ("parents", "local_parent", "rank"):
                setattr(self, name, getattr(self, name).to(dev))
            self.cache_slots = [slots.to(dev) for slots in self.cache_slots]
            full = self.tree_info
            self.depth, self.mask = full.depth.to(dev), full.mask.to(dev)
            B = temperature.shape[0]
            self.prefix_trees = [specdec.TreeInfo(self.parents[:e].expand(B, e), self.depth[:, :e].expand(B, e),
                                                  self.mask[:, :e, :(e + 31) // 32].expand(B, e, -1),
                                                  torch.full((B,), e, dtype=torch.int32, device=dev))
                                 for _, e in self.levels]
        self.skipped = 0  # steps without a proposal since the last one (advance)
        self.pending_width = self.min_pending  # the entries the next proposal runs first (_root_logits)
        self.lagging = self.catching_up = False

    # the pending entries of a proposal after a drafted step: the previous path's unexpanded last node and the root
    min_pending = 2

    def advance(self, depth):
        """A step of depth 0 leaves its entry to the next proposal, which runs it with the others: pending_width
        entries, part of the graph key. After any run of skipped steps it is the widest, min_pending + MAX_SKIPS
        (the extra entries are padding), so that a depth has two graphs, not one per run length: an adaptive
        compiled loop's choices then rarely meet a graph it has not compiled, and the padding costs only the
        first draft forward after a run of skips (a few more rows through the small drafter). After more than
        MAX_SKIPS of them the cache lags (catch_up runs them first; MTP's loop never lets it come to that)."""
        if depth == 0:
            if self.skipped == MAX_SKIPS and self.max_skips is not None:
                raise ValueError(f"depth: more than {MAX_SKIPS} steps in a row without a proposal")
            self.skipped += 1
            self.lagging |= self.skipped > MAX_SKIPS
            self.catching_up = False
        else:
            self.pending_width = self.min_pending + (MAX_SKIPS if self.skipped and not self.lagging else 0)
            self.catching_up = self.lagging or self.pending_width > self.min_pending
            self.skipped = 0

    def catch_up(self, tokens, seq_lens):
        cache = self.cache
        behind = (seq_lens - 1 - cache.lens).to(torch.int32)  # (B,) committed tokens not in the cache, roots aside
        n = int(behind.max())
        if n > 0:
            idx = cache.lens.long().unsqueeze(1) + torch.arange(n, device=tokens.device)
            self.model.prefill(cache, tokens.gather(1, idx.clamp(max=tokens.shape[1] - 1)), behind)
        self.lagging = False

    def graph_key(self):
        return (self.pending_width,)

    def state_dict(self):
        state = {name: getattr(self, name) for name in self._state_names}
        if self.tree.parents is not None:  # (its tensors moved to the batch's device, and its trees per batch size)
            state.update(cache_slots=self.cache_slots, prefix_trees=self.prefix_trees)
        return state

    # what start sets (a static tree's tensors aside: moved to the device, they are the same after every start)
    _state_names = ("cache", "chain2", "rng", "temperature", "params", "all_greedy", "skipped", "pending_width",
                    "lagging", "catching_up", "few_shapes")

    def _root_logits(self, tokens, seq_lens):
        """Run the pending tokens (the previous path's unexpanded last node, if any, the tokens of skipped steps,
        then the root); commit all but the root, which stays at slot cache.lens + 0. Returns the root's logits
        (B, V)."""
        cache, W = self.cache, self.pending_width
        n_pend = (seq_lens - cache.lens).to(torch.int32)  # 1 .. W
        idx = cache.lens.long().unsqueeze(1) + torch.arange(W, device=tokens.device)
        pend = tokens.gather(1, idx.clamp(max=tokens.shape[1] - 1))
        chain = self.chain2 if W == 2 else chain_tree(tokens.shape[0], W, device=tokens.device)
        logits = self.model.forward_cached(pend, cache, chain.depth, chain.mask, n_pend, at=n_pend - 1)
        cache.commit(n_pend - 1)
        return logits

    def propose(self, tokens, seq_lens, temperature, depth=None):
        depth = self.max_depth if depth is None else depth
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"depth: {depth} outside 1 .. {self.max_depth} (the drafter's tree)")
        root_logits = self._root_logits(tokens, seq_lens)
        root = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1))
        if self.tree.parents is not None:
            return self._propose_static(root, root_logits, depth)
        return self._propose_dynamic(root, root_logits, depth)

    def _expand(self, tokens, parent, depth, mask, start):
        """Run the new nodes tokens (B, F) of the tree (nodes start .. start + F - 1) through the draft; their
        logits (B, F, V). parent (B, F): each node's parent among the previous call's nodes (the root's for
        the first level), for drafters that condition on their own hidden states (MTPDrafter)."""
        return self.model.forward_cached(tokens, self.cache, depth, mask, start=start)

    def _root_counts(self):
        """(B, 1, V) the token counts at the roots (the output so far), or None without penalties."""
        pen = self.params.penalties
        return None if pen is None else pen.output_token_counts.unsqueeze(1)

    def _grammar_rows(self, tokens, ids, parent_ids):
        """The grammar's rows (B, F, W) of the nodes about to be expanded (`grammar.TreeMasks.rows`: tokens (B, F),
        ids and parent_ids (F,) or (B, F) in this proposal's numbering), or None without a constrained request."""
        if self.grammar is None or not self.grammar.constrained:
            return None
        return self.grammar.rows(tokens, ids, parent_ids)

    def _propose_static(self, root, root_logits, depth):
        """The tree's first depth + 1 levels (a prefix in BFS order)."""
        levels = self.levels[:depth + 1]
        B, T, V = root.shape[0], levels[-1][1], root_logits.shape[-1]
        out = root.new_zeros(B, T)
        out[:, 0] = root[:, 0]
        draft_logits = None if self.all_greedy else root_logits.new_zeros(B, T, V)
        level_logits = root_logits.unsqueeze(1)
        level_counts = self._root_counts()
        for d in range(1, len(levels)):
            (ps, pe), (s, e) = levels[d - 1], levels[d]
            if draft_logits is not None:  # (unmasked: accept masks them with the same rows)
                draft_logits[:, ps:pe] = level_logits
            rows = self._grammar_rows(out[:, ps:pe], torch.arange(ps, pe, device=out.device), self.parents[ps:pe])
            children = sample(grammar_masked(level_logits, rows), self.temperature, self.branching[d - 1], self.rng,
                              self.all_greedy, self.params, level_counts)
            out[:, s:e] = children[:, self.local_parent[s:e], self.rank[s:e]]
            if d + 1 < len(levels):  # expand this level: its children come next, from the law at its paths' counts
                level_counts = child_counts(level_counts, self.local_parent[s:e], out[:, s:e])
                level_logits = self._expand(out[:, s:e], self.local_parent[s:e].expand(B, -1),
                                            self.depth[:, s:e].expand(B, -1),
                                            self.mask[:, :e].expand(B, -1, -1)[..., :(e + 31) // 32], start=s)
        tree = self.prefix_trees[depth]
        return Proposal(out, tree.parents, tree.num_nodes, draft_logits, self.cache_slots[depth].expand(B, T), tree)

    def _propose_dynamic(self, root, root_logits, D):
        """EAGLE-2 style growth over D levels (given proposals: no draft_logits)."""
        B, dev = root.shape[0], root.device
        k = self.tree.topk
        N = min(self.tree.nodes, 1 + k + (D - 1) * k * k)  # the root and at most the candidates of D levels
        # candidates, in creation order (a parent is always created before its children)
        cand_tok = [root]  # (B, n) per level
        cand_score = [torch.zeros(B, 1, device=dev)]
        cand_parent = [torch.full((B, 1), -1, dtype=torch.long, device=dev)]  # candidate ids
        cand_slot = [torch.zeros(B, 1, dtype=torch.long, device=dev)]  # cache slot, num_fed if never run
        fed_parents = torch.full((B, self.num_fed), -1, dtype=torch.int32, device=dev)  # slot-numbered tree
        frontier_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        frontier_slots = torch.zeros(B, 1, dtype=torch.long, device=dev)
        frontier_score = cand_score[0]
        frontier_parents, frontier_tokens = cand_parent[0], root  # (the grammar's walk names nodes by candidate id)
        logits = root_logits.unsqueeze(1)
        frontier_counts = self._root_counts()
        next_id, next_slot = 1, 1
        for d in range(1, D + 1):
            rows = self._grammar_rows(frontier_tokens, frontier_ids, frontier_parents)
            logp = torch.log_softmax(self.params.process(grammar_masked(logits, rows), self.temperature,
                                                         frontier_counts).float(), dim=-1)  # allowed only
            top = logp.topk(k, dim=-1)  # (B, F, k)
            F_ = logits.shape[1]
            score = (frontier_score.unsqueeze(-1) + top.values).reshape(B, F_ * k)
            cand_tok.append(top.indices.reshape(B, F_ * k))
            cand_score.append(score)
            cand_parent.append(frontier_ids.repeat_interleave(k, dim=1))
            slots = torch.full((B, F_ * k), self.num_fed, dtype=torch.long, device=dev)
            ids = torch.arange(next_id, next_id + F_ * k, device=dev).expand(B, -1)
            next_id += F_ * k
            if d < D:  # expand the k best candidates of this level
                best = score.topk(k, dim=-1).indices.sort(dim=-1).values  # keep creation order
                new_slots = torch.arange(next_slot, next_slot + k, device=dev).expand(B, k)
                slots.scatter_(1, best, new_slots)
                parent_slot = frontier_slots.gather(1, best // k)
                fed_parents[:, next_slot:next_slot + k] = parent_slot.to(torch.int32)
                e = next_slot + k
                info = specdec.build_tree(fed_parents[:, :e])
                toks = cand_tok[-1].gather(1, best)
                logits = self._expand(toks, best // k, info.depth[:, next_slot:e], info.mask, start=next_slot)
                frontier_counts = child_counts(frontier_counts, best // k, toks)
                frontier_parents, frontier_tokens = cand_parent[-1].gather(1, best), toks
                frontier_ids, frontier_slots = ids.gather(1, best), new_slots
                frontier_score = score.gather(1, best)
                next_slot = e
            cand_slot.append(slots)
        tok, score, parent, slot = (torch.cat(x, dim=1) for x in (cand_tok, cand_score, cand_parent, cand_slot))
        # the N-1 best candidates; a stable sort keeps a parent (score >= child's) ahead of its children
        order = torch.sort(score[:, 1:], dim=-1, descending=True, stable=True).indices[:, :N - 1] + 1
        chosen = torch.cat((torch.zeros(B, 1, dtype=torch.long, device=dev), order.sort(dim=-1).values), dim=1)
        node_of = torch.full_like(tok, -1).scatter_(1, chosen, torch.arange(N, device=dev).expand(B, N))
        par = parent.gather(1, chosen)
        parents = torch.where(par >= 0, node_of.gather(1, par.clamp(min=0)), par).to(torch.int32)
        num_nodes = torch.full((B,), N, dtype=torch.int32, device=dev)
        return Proposal(tok.gather(1, chosen), parents, num_nodes, None, slot.gather(1, chosen))

    def commit(self, proposal, accepted_nodes, num_accepted):
        on_path = accepted_nodes >= 0
        nodes = accepted_nodes.long().clamp(min=0)
        path_slots = torch.where(on_path, proposal.cache_slots.gather(1, nodes), -1)
        self.cache.rollback(path_slots, num_accepted)
        last_slot = path_slots.gather(1, num_accepted.long().unsqueeze(1)).squeeze(1)
        self.cache.lens -= (last_slot >= self.num_fed).to(torch.int32)  # never run: re-run it next time
