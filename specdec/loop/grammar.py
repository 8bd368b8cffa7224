"""Structured outputs: a grammar per request, and its token masks at every node of the draft trees.

A grammar spec is a dict with one key, the names engines and the OpenAI API use:
    {"json_schema": schema}   a JSON schema, a dict or its JSON text
    {"regex": pattern}        the output matches the regular expression
    {"ebnf": grammar}         an EBNF grammar (GBNF / xgrammar dialect, rule `root`)
`SpeculativeDecoder.generate(..., grammar=spec)` constrains every request, grammar=[spec or None, ...] one per
request (None: free). A constrained request ends when its grammar accepts the stop token (the decoder's EOS): the
grammar only allows the EOS once its output is complete, and allows it as soon as the output could end.

Three layers, so that another engine (llguidance) needs only the first two:
  `GrammarBackend`: compiles specs for one vocabulary into `Matcher`s (`XGrammarBackend`: xgrammar, the optional
                    extra `structured`, imported when a backend is made);
  `Matcher`:        one request's parser state: accept a token, roll back, fill a bitmask row, terminated;
  `TreeMasks`:      a batch's matchers walked through each step's draft tree: the bitmask (B, T, W) of accept's
                    `token_bitmask` (bit v % 32 of word v // 32 set: token v allowed at the node's children and
                    as the token after it), node by node, for the loop and for the drafters that sample or rank
                    under the masks.
"""
from __future__ import annotations

import json
import time
from typing import Optional, Sequence

import torch

from .._layout import unpack_bitmask
from .drafters.base import Proposal

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
# all 32 bits set: every token allowed (a free request's row, and the row of a node accept never reaches)
ALL_ALLOWED = -1


def parse_spec(spec) -> tuple[str, str]:
    """(kind, source text) of a grammar spec (see the module doc); ValueError naming `grammar` otherwise."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in GRAMMAR_KINDS:
        raise ValueError(f"grammar: expected a dict with one key of {GRAMMAR_KINDS} (or None), got {spec!r:.200}")
    kind, source = next(iter(spec.items()))
    if kind == "json_schema" and isinstance(source, (dict, bool)):
        source = json.dumps(source)
    if not isinstance(source, str):
        raise ValueError(f"grammar: {kind} must be a string{' or a dict' if kind == 'json_schema' else ''}, got "
                         f"{type(source).__name__}")
    return kind, source


class Matcher:
    """One request's grammar state over its output so far (and, while a tree is walked, a draft path past it)."""

    def accept(self, token: int) -> bool:
        """Advance by token; False (state unchanged) where the grammar forbids it or has terminated."""
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        raise NotImplementedError

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] ((N, W) int32 on the CPU). Not after termination."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """Whether the stop token was accepted (nothing may follow)."""
        raise NotImplementedError


class GrammarBackend:
    """Compiles grammar specs for one vocabulary."""

    vocab_size: int
    stop_token_ids: tuple

    def compile(self, kind: str, source: str) -> object:
        """The compiled grammar; ValueError naming `grammar` when the source is not a valid `kind`."""
        raise NotImplementedError

    def matcher(self, compiled: object) -> Matcher:
        """A fresh matcher (empty output) of a compiled grammar."""
        raise NotImplementedError

    def matchers(self, grammar, batch_size: int) -> list[Optional[Matcher]]:
        """generate's `grammar` (None, one spec for every request, or a sequence of specs or None, one per request)
        as a matcher per request (None: free). Every spec is compiled before any matcher is made, so a bad one
        raises before generation starts."""
        if grammar is None:
            return [None] * batch_size
        if not isinstance(grammar, (dict, list, tuple)):
            raise ValueError(f"grammar: expected a spec dict or a list of them, got {type(grammar).__name__}")
        specs = [grammar] * batch_size if isinstance(grammar, dict) else list(grammar)
        if len(specs) != batch_size:
            raise ValueError(f"grammar: give one spec or one per request ({batch_size}), got {len(specs)}")
        compiled = {}  # (kind, source) -> compiled: a batch repeating one schema compiles it once
        for spec in specs:
            if spec is not None:
                key = parse_spec(spec)
                if key not in compiled:
                    compiled[key] = self.compile(*key)
        return [None if spec is None else self.matcher(compiled[parse_spec(spec)]) for spec in specs]


class XGrammarMatcher(Matcher):
    """An xgrammar.GrammarMatcher (its bitmask is accept's layout)."""

    def __init__(self, matcher):
        self.xgrammar_matcher = matcher

    def accept(self, token):
        return bool(self.xgrammar_matcher.accept_token(int(token)))

    def rollback(self, n):
        if n:
            self.xgrammar_matcher.rollback(n)

    def fill(self, bitmask, row):
        self.xgrammar_matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self):
        return bool(self.xgrammar_matcher.is_terminated())


class XGrammarBackend(GrammarBackend):
    """xgrammar (the engine vLLM and SGLang use) over a vocabulary of byte strings, token id = index."""

    def __init__(self, vocab: Sequence[bytes], stop_token_ids: Sequence[int], vocab_type: str = "raw", *,
                 any_whitespace: bool = False):
        """vocab: each token's bytes (vocab_type "raw"; "byte_fallback" / "byte_level": the tokenizer's own
        strings, as xgrammar.VocabType names them); stop_token_ids: the tokens that end an output (the decoder's
        EOS). any_whitespace: JSON schemas allow any whitespace between tokens (xgrammar's default, vLLM's); off
        (the default here), JSON is written with the separators ", " and ": " alone, so that a model cannot
        spend its tokens on blank space (small models otherwise often do, to max_new_tokens)."""
        xgrammar = _import_xgrammar()
        self.any_whitespace = any_whitespace
        self.vocab_size, self.stop_token_ids = len(vocab), tuple(int(t) for t in stop_token_ids)
        info = xgrammar.TokenizerInfo(list(vocab), vocab_type=getattr(xgrammar.VocabType, vocab_type.upper()),
                                      vocab_size=len(vocab), stop_token_ids=list(self.stop_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info)
        self._matcher_class = xgrammar.GrammarMatcher

    @classmethod
    def byte_vocabulary(cls, vocab_size: int, eos_token_id: int) -> "XGrammarBackend":
        """The shipped models' vocabulary (specdec.loop.models.tokenizer): token b < 256 is byte b; the ids past
        the bytes (BOS, EOS, reserved) are special tokens no grammar emits, the EOS its stop token. (xgrammar takes
        a token whose bytes are empty for a special one; given their names as bytes, a JSON string or a regex's
        `.` would allow "<bos>" as text.)"""
        return cls([bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256), [eos_token_id])

    def compile(self, kind, source):
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(source, any_whitespace=self.any_whitespace)
            return (self.compiler.compile_regex if kind == "regex" else self.compiler.compile_grammar)(source)
        except (RuntimeError, ValueError) as e:  # (xgrammar raises RuntimeError on a parse error)
            raise ValueError(f"grammar: invalid {kind}: {str(e).strip()[:300]}") from None

    def matcher(self, compiled):
        return XGrammarMatcher(self._matcher_class(compiled))


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("grammar: structured outputs need xgrammar: pip install 'specdec[structured]'") from None
    return xgrammar


class _Cursor:
    """A matcher walked along draft paths: `path` is the draft tokens it has accepted past the committed output.
    Moving to another path rolls back to the common prefix and accepts the rest."""

    def __init__(self, matcher: Matcher):
        self.matcher, self.path = matcher, []

    def goto(self, path: tuple) -> bool:
        """Move to path; False where a token of it is forbidden (the cursor then stands on its longest allowed
        prefix)."""
        common = 0
        for a, b in zip(self.path, path):
            if a != b:
                break
            common += 1
        self.matcher.rollback(len(self.path) - common)
        del self.path[common:]
        for token in path[common:]:
            if self.matcher.is_terminated() or not self.matcher.accept(token):
                return False
            self.path.append(token)
        return True

    def home(self) -> None:
        """Back to the committed output."""
        self.goto(())


class TreeMasks:
    """The per-node token masks of one batch: request b's matcher (None: free) walked through each step's draft
    tree. A node's row is what the grammar allows after its path (the committed output, then the draft tokens from
    the root's child down to the node): its children's tokens and the token emitted after it.

    Per step: `begin_step` (which requests are live), then the drafter may ask `rows` for the nodes it expands (by
    its own ids: static trees' node indices, dynamic trees' candidate ids), then `tree_bitmask` gives accept the
    whole proposal's (B, T, W) (the rows found by paths the drafter already asked for are reused), then `advance`
    feeds each live constrained request's emitted tokens to its matcher. With jump-forward, `with_forced_chains`
    replaces a request's proposal by the tokens its grammar forces, before the walk.

    host_s: the host time spent in these calls (the matchers' walks), over the batch's steps; forced_emitted: the
    emitted tokens that came from forced chains.

    A draft token the grammar forbids makes its node and its subtree unreachable: accept rejects the token at its
    parent (whose row forbids it) before it could descend there, greedy or sampling. The walk does not descend
    into it (its path is not accepted, so no deeper state exists) and its rows, and its subtree's, are all-ones:
    never read. A node after the stop token (the path ended the output) allows the stop tokens alone: only the
    request's end can follow.

    min-tokens under a grammar (`hold_back`) is applied here, not by accept: while a node's output is shorter
    than min_tokens its row drops the held-back stop tokens, unless the grammar allows nothing else there (the
    output is complete: the grammar wins, as in vLLM, which restores the stop tokens when its grammar masks
    every other token; accept's own min-tokens would leave that row empty and refuse it)."""

    def __init__(self, matchers: Sequence[Optional[Matcher]], vocab_size: int, stop_token_ids: Sequence[int],
                 device):
        self.cursors = [None if m is None else _Cursor(m) for m in matchers]
        self.V, self.W, self.device = vocab_size, (vocab_size + 31) // 32, device
        self.stop_row = torch.zeros(self.W, dtype=torch.int32)
        for t in stop_token_ids:
            self.stop_row[t // 32] |= _bit(t % 32)
        self.live = [c is not None for c in self.cursors]  # constrained and unfinished
        self._rows: list = [{} for _ in self.cursors]  # per request: path -> its row (None: forbidden) this step
        self._paths: list = [{} for _ in self.cursors]  # per request: drafter id -> path this step
        self._forced = [0] * len(self.cursors)  # per request: the forced chain proposed this step
        self.replaced = [False] * len(self.cursors)  # per request: a forced chain replaced its tree this step
        self.host_s, self.forced_emitted = 0.0, 0
        self.min_left = [0] * len(self.cursors)  # per request: tokens to generate before its held-back stops
        self.held: list = [None] * len(self.cursors)  # per request: (W,) int32 those stop tokens, or None

    def hold_back(self, b: int, min_tokens: int, stop_token_ids: Sequence[int]) -> None:
        """Request b (constrained, no output yet) may not emit stop_token_ids before min_tokens tokens, where its
        grammar allows another token (class doc)."""
        row = torch.zeros(self.W, dtype=torch.int32)
        for t in stop_token_ids:
            row[t // 32] |= _bit(t % 32)
        self.min_left[b], self.held[b] = min_tokens, row

    @property
    def constrained(self) -> bool:
        """Whether some request of the batch is constrained and unfinished."""
        return any(self.live)

    def begin_step(self, done: Sequence[bool]) -> None:
        """A new step; done[b]: request b finished (its rows are all-ones from now on)."""
        self.live = [c is not None and not d for c, d in zip(self.cursors, done)]
        for rows, paths in zip(self._rows, self._paths):
            rows.clear()
            paths.clear()
        self._forced = [0] * len(self.cursors)
        self.replaced = [False] * len(self.cursors)

    def _row(self, b: int, path: tuple) -> Optional[torch.Tensor]:
        """(W,) int32 the tokens allowed after path, None where the path leaves the grammar."""
        rows = self._rows[b]
        if path in rows:
            return rows[path]
        cursor = self.cursors[b]
        row = None
        if cursor.goto(path):
            if cursor.matcher.is_terminated():
                row = self.stop_row
            else:
                out = torch.empty(1, self.W, dtype=torch.int32)
                cursor.matcher.fill(out, 0)
                row = out[0]
                if len(path) < self.min_left[b]:
                    without_stops = row & ~self.held[b]
                    row = without_stops if bool(without_stops.any()) else row
        rows[path] = row
        return row

    def rows(self, tokens: torch.Tensor, ids: torch.Tensor, parent_ids: torch.Tensor) -> torch.Tensor:
        """For a drafter: the rows (B, F, W) int32 on the batch's device of F new nodes, which it names by ids
        (B, F) or (F,) (its own numbering within the step), each the child of the node parent_ids names (-1: the
        node is the root; tokens then unused), tokens (B, F) their tokens. Free, finished and unreachable nodes'
        rows are all-ones."""
        t0 = time.perf_counter()
        B, F = tokens.shape
        out = torch.full((B, F, self.W), ALL_ALLOWED, dtype=torch.int32)
        if not self.constrained:
            return out.to(self.device)
        toks, ids, par = (x.expand(B, F).tolist() for x in (tokens, ids, parent_ids))
        for b in range(B):
            if not self.live[b]:
                continue
            paths = self._paths[b]
            for j in range(F):
                if par[b][j] < 0:
                    path = ()
                else:  # (a parent that is unreachable, or unknown, has None: so has its child)
                    parent = paths.get(par[b][j])
                    path = None if parent is None else parent + (toks[b][j],)
                row = None if path is None else self._row(b, path)
                paths[ids[b][j]] = None if row is None else path
                if row is not None:
                    out[b, j] = row
        self.host_s += time.perf_counter() - t0
        return out.to(self.device)

    def tree_bitmask(self, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
        """accept's token_bitmask (B, T, W) int32 of a proposal (tokens, parents (B, T) in BFS order, num_nodes
        (B,)), on the batch's device; every matcher is back at its committed output afterwards."""
        t0 = time.perf_counter()
        B, T = tokens.shape
        out = torch.full((B, T, self.W), ALL_ALLOWED, dtype=torch.int32)
        toks, par, n = tokens.tolist(), parents.tolist(), num_nodes.tolist()
        for b in range(B):
            if not self.live[b]:
                continue
            paths = [()] + [None] * (T - 1)
            for i in range(n[b]):
                if i:
                    parent = paths[par[b][i]]
                    paths[i] = None if parent is None else parent + (toks[b][i],)
                row = None if paths[i] is None else self._row(b, paths[i])
                if row is None:
                    paths[i] = None  # (unreachable, with its subtree: see the class doc)
                else:
                    out[b, i] = row
            self.cursors[b].home()
        self.host_s += time.perf_counter() - t0
        return out.to(self.device)

    def advance(self, b: int, tokens: Sequence[int]) -> None:
        """Request b emitted tokens (its accepted draft tokens and the next token): feed them to its matcher, up to
        the stop token. Each was allowed by its parent node's row, so the matcher takes it."""
        t0 = time.perf_counter()
        cursor = self.cursors[b]
        cursor.home()
        self.min_left[b] = max(self.min_left[b] - len(tokens), 0)
        for t in tokens:
            if cursor.matcher.is_terminated():
                break
            if not cursor.matcher.accept(t):
                raise RuntimeError(f"grammar: request {b}'s emitted token {t} is outside its grammar (a mask "
                                   "was not applied)")
        self.forced_emitted += min(self._forced[b], len(tokens) - 1)
        self.host_s += time.perf_counter() - t0

    def forced(self, b: int, limit: int) -> list:
        """The tokens request b's grammar forces after its committed output, at most limit: while the mask allows
        exactly one token (the stop token included, which ends the chain)."""
        cursor, row = self.cursors[b], torch.empty(1, self.W, dtype=torch.int32)
        cursor.home()
        chain = []
        while len(chain) < limit and not cursor.matcher.is_terminated():
            cursor.matcher.fill(row, 0)
            allowed = unpack_bitmask(row[0], self.V).nonzero().flatten().tolist()
            if len(allowed) != 1 or not cursor.goto(tuple(chain) + (allowed[0],)):
                break
            chain.append(allowed[0])
        cursor.home()
        return chain

    def with_forced_chains(self, prop: Proposal, limit: int, at_least: int = 1) -> Proposal:
        """prop with each live constrained request whose grammar forces at least at_least (>= 1) of its next tokens
        proposing the chain of them (at most limit) instead of its tree; `replaced` says which. A forced token is
        the only one its mask allows, so its processed probability is 1, whatever the target's and the drafter's
        rows hold (the chain's draft_logits rows are zeros): accept takes it, greedy or sampling, and the law is
        unchanged. The other requests keep their trees (and the proposal its drafter bookkeeping, cache_slots, for
        those)."""
        t0 = time.perf_counter()
        B, T0 = prop.tokens.shape
        chains = [self.forced(b, limit) if self.live[b] else [] for b in range(B)]
        chains = [c if len(c) >= max(at_least, 1) else [] for c in chains]
        self.host_s += time.perf_counter() - t0
        if not any(chains):
            return prop
        T = max(T0, 1 + max(len(c) for c in chains))
        grow = lambda x, value: torch.cat((x, x.new_full((B, T - T0) + x.shape[2:], value)), 1)  # noqa: E731
        tokens, parents = grow(prop.tokens.cpu(), 0), grow(prop.parents.cpu(), 0)  # (padding parents: never read)
        num_nodes = prop.num_nodes.cpu().clone()
        for b, chain in enumerate(chains):
            if chain:
                m = len(chain)
                tokens[b, 1:1 + m] = torch.tensor(chain)
                parents[b, 1:] = 0
                parents[b, 1:1 + m] = torch.arange(m, dtype=torch.int32)
                num_nodes[b] = 1 + m
                self._forced[b] = m
                self.replaced[b] = True
        dev = prop.tokens.device
        draft_logits = None if prop.draft_logits is None else grow(prop.draft_logits, 0.0)
        cache_slots = None if prop.cache_slots is None else grow(prop.cache_slots.expand(B, T0), 0)
        return Proposal(tokens.to(dev), parents.to(dev), num_nodes.to(dev), draft_logits, cache_slots)


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a signed int32 value."""
    return (1 << k) - (1 << 32 if k == 31 else 0)
