"""The drafter interfaces: where draft trees come from.

A new drafter writes the core (`Drafter`: start, propose, commit, skip). Two optional mixins add what some
loops need, each with defaults that do nothing:
  `DepthControl`: the host bookkeeping of adaptive speculation (depth limits, skipped steps, catch-up, shadow
                  judgments of proposals nobody drafted);
  `StepState`:    what compiled or captured steps need (the graph key of the next step, and the state that kept
                  graphs read, as an explicit `state_dict` / `load_state`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from ..._layout import unpack_bitmask
from ...ops import TreeInfo
from ...reference import GREEDY_BELOW
from ...sampling import SamplingParams


class Proposal(NamedTuple):
    """tokens (B, T) int64 (tokens[:, 0] is the root); parents (B, T) int32 (BFS order, parents[:, 0] = -1);
    num_nodes (B,) int32; draft_logits (B, T, V) or None: when given, node i's children were drawn i.i.d.
    from softmax(draft_logits[:, i] / temperature) (sampling requests); None means given proposals.
    cache_slots (B, T) int64 or None: the drafter's own bookkeeping, handed back to its commit (the loop
    never reads it): the slot, after the committed tokens, of node i's K/V in the drafter's own cache
    (DraftModelDrafter); None for drafters without a cache. tree: the tree's depths and ancestor masks (padding
    nodes' rows may differ from build_tree's: they are never read), so that a static tree is built once, not
    per step."""
    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    draft_logits: Optional[torch.Tensor] = None
    cache_slots: Optional[torch.Tensor] = None
    tree: Optional[TreeInfo] = None  # build_tree of parents when the drafter has it already (static trees)


# the longest run of steps without a proposal whose tokens a drafter's next proposal runs through its model (its
# buffers for the skipped entries are sized by it); after a longer run the draft model catches up eagerly
# (`catch_up`), MTP cannot (it needs the target's hidden states of those steps) and the loop drafts one level
# after that many (its `max_skips`)
MAX_SKIPS = 16


class Drafter:
    """The core every drafter writes. The loop (`SpeculativeDecoder.generate`) owns a token buffer `tokens`
    (B, L) int64 whose first seq_lens[b] (B,) int32 entries are request b's committed sequence; the last one is
    the root (node 0) of the next draft tree. Per batch and step:

        drafter.start(tokens, seq_lens, max_len, temperature, seeds, params)   # once, after the target's prefill
        loop:
            proposal = drafter.propose(tokens, seq_lens, temperature, depth)    # a tree per request
            ... the target verifies it, specdec.accept picks each request's path ...
            drafter.commit(proposal, accepted_nodes, num_accepted)             # keep own state in sync
          or, for a step that verified the root alone (an adaptive loop's plain step, depth 0):
            drafter.skip()                                                      # every sequence grew by one

    propose, commit and skip run inside one graph with the rest of the step where the loop compiles it
    (compile=True) or, for a drafter with `StepState`, captures it: no host reads, and state carried across steps
    lives in tensors written in place. What commit needs to know about a proposal travels in the proposal
    itself (`cache_slots`), so nothing is kept between the two calls. A drafter with `uses_target_hidden` gets the
    target's hidden states as the keyword target_hidden: in start (B, n_max - 1, width) those of the prompts'
    positions 0 .. seq_lens - 2, in commit and skip (B, T, width) those of the verified nodes; width is dim (the
    last layer's output), or dim times the number of layer ids it gives (the residual streams entering them).

    Attributes: `max_nodes` bounds T of every proposal (the loop sizes caches with it), `max_depth` the depth of its
    trees (the longest path the target can accept)."""

    max_nodes: int = 1
    max_depth: int = 0
    vocab_size: Optional[int] = None  # None: any vocabulary (no model)
    # whether sampling requests' proposals carry draft_logits (children drawn i.i.d. from them), as the
    # verifiers "block" and "traversal" need; else they are given proposals
    samples_children: bool = False
    # proposes with host code (prompt lookup): the loop compiles or captures its verification only
    proposes_on_host: bool = False
    # start, commit and skip take the target's hidden states (target_hidden=): True (the last layer's output) or a
    # tuple of layer ids (the residual streams entering them, concatenated: EAGLE-3's aux hidden states)
    uses_target_hidden: Union[bool, tuple] = False
    # a proposal of any depth costs one forward (a parallel drafter), not one per level: the adaptive policy's model
    one_forward_proposals: bool = False
    # set by the loop for each batch: the grammars' per-node masks (grammar.TreeMasks), None when every request is
    # free. A drafter that samples children (draft_logits) draws them from its law masked by the node's row
    # (`grammar_masked`): accept's q at a node is the law masked by that row, so a drafter that ignored it would
    # not be the law accept judges (the output would leave the target's law); ranking drafters skip forbidden
    # tokens with it
    grammar = None

    def start(self, tokens: torch.Tensor, seq_lens: torch.Tensor, max_len: int, temperature: torch.Tensor,
              seeds: Sequence[int], params: SamplingParams = SamplingParams()) -> None:
        """A new batch: `tokens`/`seq_lens` hold the prompts; sequences will not exceed max_len tokens;
        temperature (B,) and the sampling filters `params` are fixed for the batch; request b's own sampling
        (if any) is driven by seeds[b] alone (`DraftRandom`), so its drafts never depend on the rest of
        the batch. A drafter that passes draft_logits samples from the law `params.process` gives them (accept
        processes them the same way), at each node's token counts with penalties on (params.penalties: the output's
        counts, which the loop updates in place after each step, plus the draft tokens on the node's path,
        `child_counts`); given proposals may be anything."""

    def propose(self, tokens: torch.Tensor, seq_lens: torch.Tensor, temperature: torch.Tensor,
                depth: Optional[int] = None) -> Proposal:
        """A tree per request; depth (1 .. max_depth, None = max_depth): at most this many levels."""
        raise NotImplementedError

    def commit(self, proposal: Proposal, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """The target accepted path accepted_nodes[b, :num_accepted[b] + 1] of the last `proposal` (node indices,
        from the root; the next token the target emitted after it is no node): accepted_nodes (B, T) int32 padded
        with -1, num_accepted (B,) int32 (0 for a finished request)."""

    def skip(self) -> None:
        """A step without a proposal: every sequence grew by one token (its root's successor)."""


class DepthControl:
    """What adaptive speculation needs of a drafter beyond the core, called by the loop on the host before each
    step (never inside a graph). The drafter's host state is a small state machine over the steps' depths:

        state       event                            next state
        in sync     advance(k > 0)                   in sync
        in sync     advance(0)                       skipping (the skipped step's token is pending)
        skipping    advance(0), MAX_SKIPS or fewer   skipping
        skipping    advance(0), past MAX_SKIPS       lagging (with max_skips set the loop never asks: it drafts
                                                     one level after max_skips plain steps)
        skipping    advance(k > 0)                   in sync (the proposal first runs the pending tokens;
                                                     catching_up: its time is not its depth's)
        lagging     advance(0)                       lagging
        lagging     advance(k > 0)                   lagging, catching_up (the loop calls catch_up before the step)
        lagging     catch_up                         in sync

    A drafter whose cache is filled lazily starts lagging (start leaves the prompts to catch_up)."""

    # the most steps in a row without a proposal it takes (None: any number)
    max_skips: Optional[int] = None
    # the drafter's own cache is further behind the committed tokens than a proposal catches up on: the loop calls
    # catch_up before the next step that proposes
    lagging: bool = False
    # set by advance: the next step's proposal first runs the tokens of skipped steps through the drafter (a one-off
    # cost of the switch from plain decoding, not what a step of its depth costs: the adaptive policy times it not)
    catching_up: bool = False

    def advance(self, depth: Optional[int]) -> None:
        """Host bookkeeping before each step: the step will call propose(depth=depth) then commit, or skip when
        depth is 0. A drafter whose step depends on host state (Python numbers) updates it here, never inside
        propose / commit / skip, so that those stay graph-safe; that state is then part of the step's graph key
        (`StepState.graph_key`)."""

    def catch_up(self, tokens: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Eagerly, outside any graph: run the committed tokens the drafter has not seen, all but each root, through
        its model (a prefill from where its cache stands)."""

    def depths_available(self, tokens: torch.Tensor, seq_lens: torch.Tensor) -> Optional[list]:
        """The most levels each request's proposal can have now (a drafter that proposes on the host knows: prompt
        lookup has nothing for a request without a match). None: every request gets the depth asked for."""
        return None

    def shadow(self, tokens: torch.Tensor, seq_lens: torch.Tensor) -> Optional[tuple[list, list, list]]:
        """On a plain-decoding step: judge the proposals that earlier calls recorded but nobody drafted against the
        tokens committed since, and record what would be proposed now. Returns (accepted, proposed, since) per
        request: levels since[b] + 1 .. proposed[b] of request b's recorded proposal are judged now (none where
        proposed[b] <= since[b]; the earlier ones were judged by earlier calls), and its first accepted[b] levels
        were what the target emitted: a level is judged once the target's token at it is in or an earlier one was
        wrong, with exactly the outcome a drafted step would have given it (a deterministic draft token x is
        accepted with probability p(x), the chance plain sampling emits it). None: nothing judged now (the
        default: proposals cost a model's forward, and the policy learns from drafted steps alone)."""
        return None


class StepState:
    """What compiled or captured steps need of a drafter beyond the core. The loop replays a batch shape's graphs in
    later generate calls: they read and write the tensors of the state they were captured with, so the loop keeps
    that state (`state_dict`, taken right after start), signs it (shapes and Python values: two states of one
    signature can share graphs), and for a later call of that signature copies the new state's tensor values into
    the kept ones and puts the kept objects back (`load_state`)."""

    # set by the loop before start: its steps are compiled or captured as graphs, so keep the shapes of a step to a
    # few (each is a graph), padding where an eager step would not
    few_shapes: bool = False

    def graph_key(self) -> tuple:
        """The host state the next step's graph depends on (see `DepthControl.advance`)."""
        return ()

    def state_dict(self) -> dict[str, Any]:
        """Every attribute that start sets and a step reads or writes, by name (tensors, the objects holding them,
        and the Python values a step branches on); the same names after every start."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Put back a state_dict's objects."""
        for name, value in state.items():
            setattr(self, name, value)


class NoDrafter(Drafter, StepState):
    """Plain autoregressive decoding: the tree is the root alone."""

    def propose(self, tokens, seq_lens, temperature, depth=None):
        B = tokens.shape[0]
        root = tokens.gather(1, (seq_lens.long() - 1).unsqueeze(1))
        return Proposal(root, torch.full((B, 1), -1, dtype=torch.int32, device=tokens.device),
                        torch.ones(B, dtype=torch.int32, device=tokens.device))


# request b's drafter stream is keyed by a mix of seeds[b], never seeds[b] itself: the acceptance kernels key
# their Philox streams by seeds[b], and a draw must not be correlated with the test that judges it
_DRAFT_SEED_MIX = 0x9E3779B97F4A7C15
_MASK32 = 0xFFFFFFFF


def grammar_masked(logits: torch.Tensor, bitmask: Optional[torch.Tensor]) -> torch.Tensor:
    """logits (B, N, V) with the tokens that bitmask (B, N, W) int32 forbids at -inf (None: unchanged). Step 0 keeps
    -inf at -inf and the filters come after the mask, so `sample` on the result draws from the processed law
    under the mask, the law accept computes for the node."""
    if bitmask is None:
        return logits
    return logits.masked_fill(~unpack_bitmask(bitmask, logits.shape[-1]), float("-inf"))


def child_counts(parent_counts: Optional[torch.Tensor], parent: torch.Tensor,
                 children: torch.Tensor) -> Optional[torch.Tensor]:
    """The token counts at new tree nodes (B, F, V) int32: those of each one's parent, parent_counts (B, P, V) with
    parent (F,) or (B, F) the index among them, plus the node's own token children (B, F). None stays None (no
    penalties)."""
    if parent_counts is None:
        return None
    B, F = children.shape
    counts = parent_counts.gather(1, parent.expand(B, F).unsqueeze(2).expand(-1, -1, parent_counts.shape[2]))
    return counts.scatter_add(2, children.unsqueeze(2), torch.ones_like(counts[..., :1]))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x (int64 in [0, 2**32)) and a 32-bit constant c, in 16-bit halves of c so that no
    product leaves int64 (signed overflow is undefined in the C++ and CUDA that Inductor generates)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with good avalanche (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class DraftRandom:
    """Counter-based random numbers for the drafters' draws, one stream per request: uniform u (B, n) of a draw
    is a hash of (request b's key, its draw counter, the element index), and the counter advances by one per
    draw in place. No generator object and no host state: the draws are graph-safe (torch.compile fullgraph,
    CUDA-graph replay) and request b's stream depends on seeds[b] alone, never on the batch."""

    def __init__(self, seeds: Sequence[int], device: torch.device):
        mixed = [(int(s) * _DRAFT_SEED_MIX + 1) % 2**64 for s in seeds]
        key = torch.tensor([m & _MASK32 for m in mixed], dtype=torch.int64, device=device)
        hi = torch.tensor([m >> 32 for m in mixed], dtype=torch.int64, device=device)
        self.key = _mix32(key ^ _mix32(hi))  # (B,)
        self.counter = torch.zeros(len(seeds), dtype=torch.int64, device=device)

    def uniform(self, n: int) -> torch.Tensor:
        """(B, n) float32 in (0, 1), 24 random bits each; advances the counters."""
        stream = _mix32((self.key + _mix32(self.counter & _MASK32)) & _MASK32).unsqueeze(1)
        idx = torch.arange(n, device=self.key.device)
        bits = _mix32((_mix32(idx ^ stream) + stream) & _MASK32)
        self.counter += 1
        return ((bits >> 8).float() + 0.5) * 2.0 ** -24


def sample(logits: torch.Tensor, temperature: torch.Tensor, k: int, rng: Optional[DraftRandom],
           all_greedy: bool, params: SamplingParams = SamplingParams(),
           counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """k children per row of logits (B, N, V), from the rows processed by `params` (`SamplingParams.process`: step 0
    at the rows' token counts counts (B, N, V), None: the output counts; masked, top-k/top-p/min-p filtered: the
    law accept's q is at those nodes): the top-k tokens for greedy requests (temperature 0), k i.i.d. draws from
    softmax(processed / temperature) for the others, request b's from its stream of `rng` (every request draws
    the same count per call, so its stream never depends on the batch). Returns (B, N, k) int64. all_greedy
    (known when the batch starts) skips the softmax and the draws (rng may then be None).

    A draw is the exponential race argmax_v p_v / E_v with E_v = -log u_v i.i.d. Exp(1): token v wins with
    probability p_v exactly (vLLM's sampler draws the same way)."""
    B, N, V = logits.shape
    logits = params.process(logits, temperature, counts)
    top = logits.topk(k, dim=-1).indices
    if all_greedy:
        return top
    greedy = (temperature < GREEDY_BELOW).view(B, 1, 1)  # (as the verifier: below 1e-5, greedy)
    t = torch.where(greedy.view(B), torch.ones_like(temperature), temperature).view(B, 1, 1)
    x = logits.float()
    probs = torch.softmax((x - x.amax(-1, keepdim=True)) / t, dim=-1)  # (x / t would overflow for huge logits)
    race = -rng.uniform(N * k * V).log().view(B, N, k, V)
    drawn = (probs.unsqueeze(2) / race).argmax(-1)
    return torch.where(greedy, top, drawn)
