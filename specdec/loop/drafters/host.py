"""What the drafters that propose on the host from indexes of the committed tokens (NgramDrafter, SuffixDrafter)
share: the committed tokens their indexes have not seen (`new_committed_tokens`) and the shadow judging of
proposals nobody drafted (`ShadowJudging`)."""
from __future__ import annotations

import torch

from .base import DepthControl


def new_committed_tokens(tokens: torch.Tensor, seq_lens: torch.Tensor, indexed: list) -> list:
    """Each request's committed tokens past the indexed[b] it has indexed (tokens [B, L], seq_lens [B]; a list per
    request, empty where none is new), those of every request gathered in one host copy (not a read per request)."""
    ends = seq_lens.tolist()
    most = max(end - start for start, end in zip(indexed, ends))
    if most <= 0:
        return [[] for _ in ends]
    cols = (torch.tensor(indexed).unsqueeze(1) + torch.arange(most)).clamp(max=tokens.shape[1] - 1)
    rows = tokens.gather(1, cols.to(tokens.device)).tolist()
    return [row[:max(end - start, 0)] for row, start, end in zip(rows, indexed, ends)]


class ShadowJudging(DepthControl):
    """DepthControl.shadow for a host drafter: one recorded proposal per request at a time, judged level by level as
    its tokens come, along the path they take through it (`judge`; a proposal that the text repeats is known right
    after its first level, not once all its levels are in), and replaced by the next once its fate is known (a wrong
    token below a node with children, or a leaf reached). It works on one call in B // 4 (about 4 requests'
    judgments per step): each call costs the index's extension, a judgment per request and the policy's predictions
    anew, a share of a plain step not worth paying at every one.

    The drafter supplies `_extend` (its indexes brought up to the committed tokens), `_committed` (a request's
    committed tokens as indexed) and `_shadow_proposal` (a request's proposal from its indexes as they stand), and
    calls `_start_shadows` from start."""

    def _extend(self, tokens, seq_lens) -> None:
        raise NotImplementedError

    def _committed(self, b: int) -> list:
        raise NotImplementedError

    def _shadow_proposal(self, b: int) -> tuple[list, list]:
        """Request b's proposal below its root: (tokens, parents) of its nodes but the root, BFS order, the root 0."""
        raise NotImplementedError

    def _start_shadows(self, batch_size: int) -> None:
        self._shadows = [None] * batch_size  # per request: (position, draft, parents, levels judged)
        self._shadow_calls = -1  # (the first call works)

    def shadow(self, tokens, seq_lens):
        """(DepthControl.shadow) See the class doc."""
        self._shadow_calls += 1
        B = len(self._shadows)
        if self._shadow_calls % max(B // 4, 1):
            return None
        self._extend(tokens, seq_lens)
        accepted, proposed, since = [0] * B, [0] * B, [0] * B
        for b in range(B):
            text = self._committed(b)
            if self._shadows[b] is not None:
                position, draft, parents, reported = self._shadows[b]
                right, known, done = judge(draft, parents, text[position:])
                if known > reported:
                    accepted[b], proposed[b], since[b] = right, known, reported
                self._shadows[b] = None if done else (position, draft, parents, known)
            if self._shadows[b] is None:
                draft, parents = self._shadow_proposal(b)
                self._shadows[b] = (len(text), draft, parents, 0) if draft else None
        return accepted, proposed, since


def judge(draft: list, parents: list, emitted: list) -> tuple[int, int, bool]:
    """A tree (its non-root nodes' tokens and parents, BFS order, the root 0) against the tokens emitted after its
    root: (right, known, done): right, the levels the emitted tokens follow down the tree; known, the levels whose
    fate is known (right, and one more where a wrong token came below a node with children); done, whether the
    tree's fate is all known (a wrong token, or a leaf reached: nothing deeper was proposed on that path)."""
    children: dict = {}  # node -> {token: child node}
    for node, (token, parent) in enumerate(zip(draft, parents), 1):
        children.setdefault(parent, {})[token] = node
    node, right = 0, 0
    for token in emitted:
        node_next = children.get(node, {}).get(token)
        if node_next is None:
            break
        node, right = node_next, right + 1
    if node not in children:
        return right, right, True
    if right < len(emitted):
        return right, right + 1, True
    return right, right, False
