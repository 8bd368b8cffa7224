"""Adaptive speculation: each step's draft depth, 0 (plain decoding) included, from what a step costs on this
device and how deep each request's drafts have been accepted lately.

A step that drafts k levels costs `target_s[k]` (the target's forward over k + 1 tokens per request, measured
at start-up for this batch size, `measure_target_costs`), plus k draft levels (measured as the loop runs:
`AdaptiveDepth.drafted`; one proposal's cost for any k > 0 for a drafter whose one forward drafts every level,
`Drafter.one_forward_proposals`: deep drafts cost it no more than shallow ones), plus the rest of the step
(measured as what the step took beyond those), and is expected to emit, per live request b,
1 + sum_{d <= k} prod_{i <= d} alpha[b, i] tokens, alpha[b, d] being the running rate at which request b's
depth-d draft was accepted when its depth-(d-1) draft was (`AcceptanceStats`).
Once a depth's steps have been timed, their measured time replaces the model's estimate.

The policy picks, among the depths it may choose (all of 0..K by default; a compiled loop compiles a graph per
depth, so it offers a ladder, `compiled_depths`), the k that would finish the batch soonest if every step drafted
k: step_s[k] * max_b max(remaining[b] / tokens[b, k], 1), remaining[b] being what request b has still to emit.
A batch lasts as long as its slowest request (finished requests ride along at full cost), so drafting pays only
where it speeds up the requests that bound the batch, not where it makes the fast ones finish sooner. (Without
`remaining`, as for a server whose finished requests are replaced at once, it maximizes the batch's tokens per
second.) A drafting depth must be expected to go `margin` (5%) faster than plain decoding, as a guard against the
error of its prediction. When the choice is 0 for a while it drafts once anyway (a probe: the best k > 0), so
that text which starts repeating itself is noticed; a probe whose drafts were all accepted is repeated at the next
step, any other that changes nothing doubles the wait for the next one (probe_every steps, up to 4 times that).
A drafter whose proposals are cheap and deterministic (prompt lookup) needs no probe: while the loop decodes
plainly, what it would have proposed is judged against the tokens that follow (`DepthControl.shadow`,
`AdaptiveDepth.judged`), exactly as a drafted step would have judged it.
Any k is lossless: a greedy output never depends on the choices.

A cold policy (a decoder's first call) starts from its drafter's prior (`drafter_prior`): the acceptance rate by
depth that the shipped pair measured with a drafter of its kind, weighed as a few judgments, so that a request's own
judgments replace it within a few steps, and a later call starts from what the earlier ones measured (`previous`).
Measured rates rather than an optimistic start that backs off: backing off costs the steps that drafted too deep
before it, and a flat guess errs the other way for a drafter whose rates are high (a guess of 0.6 per level makes
depth 1 or 2 look best where the draft model's 0.94 makes 8 pay). Not a cache on disk of earlier runs' rates: what
they measured depends on the prompts, the sampling and the load of the machine, each of which a later run may
change, and a cache would need keys for all of them; the rates a drafter reaches on code are a property of the
pair, which ships with them.
The target's costs are measured when a policy is made for a new batch size (`measure_target_costs`, outside the
call's timed decoding), since they depend on the device and its load, not on the pair alone.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

from .drafters.base import DepthControl, Drafter
from .models.llama import Llama, chain_tree, compile_static

PROB_SCALE = 1 << 24  # acceptance probabilities travel in the step's int64 flags as multiples of 1 / PROB_SCALE


# The shipped pair's acceptance rate by depth d = 1, 2, 3.. per drafter kind (of the steps that judged a depth-d draft,
# the fraction accepting it; greedy, 128 new tokens on 8 held-out stdlib files, chain:8; deeper levels as the last
# one): a cold policy's prior. Prompt lookup's and suffix decoding's first level is a guess of which match continues,
# their deeper ones follow the text once it does. Sampled at T=0.8 every rate is 0.1-0.3 lower: the sampled requests'
# acceptance probabilities (`AcceptanceStats.update`) replace the prior within a few steps.
SHIPPED_ACCEPTANCE = {"DraftModelDrafter": (0.94,), "MTPDrafter": (0.91, 0.93), "NgramDrafter": (0.46, 0.87, 0.95),
                      "SuffixDrafter": (0.60, 0.91, 0.94), "ParallelDrafter": (0.88, 0.70, 0.65, 0.57)}
# the judgments a shipped rate counts as at each depth: its shape between depths is trusted (a weight of 8 against 2,
# `AcceptanceStats`), and a request's own few judgments outweigh it (4, PRIOR_JUDGMENTS, for half)
SHIPPED_WEIGHT = 8.0
GUESS = 0.6  # the prior of a drafter of another kind, with no weight


def drafter_prior(drafter, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """(prior, prior_weight), (K,) each: a cold policy's acceptance rates by depth 1..K for this drafter
    (`SHIPPED_ACCEPTANCE`, by its class's exact name: a subclass drafts from another model, or differently), and the
    judgments behind them; GUESS with no weight for a drafter of another kind."""
    rates = SHIPPED_ACCEPTANCE.get(type(drafter).__name__)
    if rates is None:
        return np.full(max_depth, GUESS), np.zeros(max_depth)
    rates = np.asarray(rates + rates[-1:] * max(max_depth - len(rates), 0), dtype=np.float64)[:max_depth]
    return rates, np.full(max_depth, SHIPPED_WEIGHT)


class AcceptanceStats:
    """Per request: alpha (B, K), the exponentially weighted rate of accepting the depth-d draft given that the
    depth-(d-1) one was (d = 1..K), with weight (B, K), the weighted count of such judgments. A depth judged
    seldom (one the policy stopped drafting to) is predicted from the request's prediction one level shallower,
    times the prior's ratio between the two depths, blended in by its weight: rates vary smoothly with depth, so
    a policy that drafts shallow still learns from the depths it does draft whether deeper drafts would pay.
    The prior is per depth (the population's rates: the previous batch's, `population`) because drafters differ
    in the shape of their rates: prompt lookup's first level is often rejected (the match was wrong) and its deeper
    levels almost never once the first is accepted (the text repeats), so a request's rate at depth 1, or its rate
    over all depths, would make its deep drafts look worse than they are. The prior's shape counts only as far as
    judgments stand behind it (prior_weight): a depth no earlier request reached says nothing of how rates change
    there, and reading the initial flat prior as a drop would keep a policy from ever drafting that deep. (NumPy
    arrays: host arithmetic on a few numbers per request each step, where torch's per-op overhead would cost a few
    percent of a large batch's plain-decoding step.)"""

    # what the prior weighs against a request's own judgments, in judgments: enough that a chance run of rejections
    # of sampled drafts that are usually accepted does not read as a low rate (and plain decoding until the next probe)
    PRIOR_JUDGMENTS = 4.0

    def __init__(self, batch_size: int, max_depth: int, prior=0.6, decay: float = 0.9, prior_weight=0.0):
        """prior: the acceptance rate at each depth 1..K before anything is judged (a float, or (K,) per depth);
        prior_weight: the judgments behind it at each depth (0: a guess)."""
        self.prior = np.broadcast_to(np.asarray(prior, dtype=np.float64), (max_depth,)).copy()
        self.prior_weight = np.broadcast_to(np.asarray(prior_weight, dtype=np.float64), (max_depth,)).copy()
        # exponentially weighted counts of acceptances and of judgments: their ratio is the request's own rate,
        # free of the prior (an average started at the prior would keep half of it after 7 judgments, and pass it on
        # to the next batch through `population`)
        self.hits = np.zeros((batch_size, max_depth))
        self.weight = np.zeros((batch_size, max_depth))
        # the same counts undecayed, for the next batch's prior (`population`)
        self.total_hits = np.zeros((batch_size, max_depth))
        self.total_weight = np.zeros((batch_size, max_depth))
        self.decay = decay
        self._expected: Optional[np.ndarray] = None  # expected_tokens, until the next judgment
        # (K - 1,): the prior's ratio between depths d + 1 and d, trusted as its weights at both allow (predicted)
        shape = np.minimum(self.prior_weight[1:], self.prior_weight[:-1])
        shape = shape / (shape + 2)
        self._prior_ratio = 1 + shape * (self.prior[1:] / np.maximum(self.prior[:-1], 1e-6) - 1)

    @property
    def alpha(self) -> np.ndarray:
        """(B, K): each request's own acceptance rate per depth (the prior where it has no judgment)."""
        return np.where(self.weight > 0, self.hits / np.maximum(self.weight, 1e-12), self.prior)

    def update(self, num_accepted: Sequence[int], depth: int, live: Sequence[bool],
               proposed: Optional[np.ndarray] = None, acceptance: Optional[np.ndarray] = None,
               since: Optional[np.ndarray] = None) -> None:
        """A step that drafted `depth` levels accepted num_accepted[b] draft tokens of live request b.
        proposed (B,): the levels each request's proposal had (None: depth each; prompt lookup proposes nothing
        for a request without a match, which says nothing of its drafts' acceptance). acceptance (B, >= depth):
        where not NaN, the probability that level d's draft was to be accepted (`chain_acceptance_probs`: sampled
        requests), each judged level's judgment instead of its accept/reject outcome: the same mean, with less
        chance in it (a level accepted 75% of the time is rejected twice in a row once in 16 pairs of steps).
        since (B,): the levels judged before, skipped (a proposal judged level by level as its tokens come,
        `AdaptiveDepth.judged`; None: none)."""
        if depth == 0:
            return
        self._expected = None
        n = np.asarray(num_accepted)[:, None]
        d = np.arange(1, depth + 1)
        reached = (n >= d - 1) & np.asarray(live, dtype=bool)[:, None]  # the depth-d draft was judged
        if proposed is not None:
            reached &= d <= proposed[:, None]
        if since is not None:
            reached &= d > since[:, None]
        outcome = (n >= d).astype(np.float64)
        if acceptance is not None:
            probs = np.asarray(acceptance, dtype=np.float64)[:, :depth]
            outcome = np.where(np.isnan(probs), outcome, probs)
        h, w = self.hits[:, :depth], self.weight[:, :depth]  # (views: written in place)
        h[:] = np.where(reached, self.decay * h + outcome, h)
        w[:] = np.where(reached, self.decay * w + 1, w)
        self.total_hits[:, :depth] += np.where(reached, outcome, 0.0)
        self.total_weight[:, :depth] += reached

    def predicted(self) -> np.ndarray:
        """(B, K): the acceptance rates used for prediction: at depth d, the request's own rate trusted by
        w / (w + c) (w its weight there, c = PRIOR_JUDGMENTS) scaled to reach 1 at the most weight there can be,
        W = 1 / (1 - decay) (a depth judged at every recent step), the rest from its prediction at depth d - 1 times
        prior[d] / prior[d - 1] (at depth 1: the prior), that ratio trusted as the prior's weights at both depths
        allow (1 where either is a guess)."""
        most = 1 / (1 - self.decay)
        c = self.PRIOR_JUDGMENTS
        trust = (self.weight / (self.weight + c) * ((most + c) / most)).T  # (K, B): a row per depth
        own = trust * self.alpha.T
        rest = 1 - trust
        ratio = self._prior_ratio
        out = np.empty_like(own)
        below = self.prior[0]
        for d in range(len(out)):
            out[d] = own[d] + rest[d] * below
            if d + 1 < len(out):  # (never below 0: trust, alpha and the ratio are not negative)
                below = np.minimum(out[d] * ratio[d], 1.0)
        return out.T

    def expected_tokens(self) -> np.ndarray:
        """(B, K + 1): request b's expected emitted tokens of a step drafting k = 0..K levels,
        1 + sum_{d <= k} prod_{i <= d} alpha[b, i]. (Kept between judgments: a batch that decodes plainly asks
        every step, and nothing it depends on changes then.)"""
        if self._expected is None:
            self._expected = _expected_tokens(self.predicted())
        return self._expected

    def population(self, batch_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """The prior and prior_weight of a next batch of batch_size requests, (K,) each. Per depth: the mean rate of
        all of these requests' judgments, not only their recent ones, and the prior's, weighted by the judgments'
        recent weight and the prior's (the prior where neither has any); for a batch of several, the rate of the
        request it would be bound by, the 1 / (batch_size + 1) quantile of these requests' own mean rates where 2 or
        more were judged (a batch lasts as long as its slowest request: the mean would promise every new request a
        typical request's acceptance, and make drafting look a gain where the slowest request's rate says it costs).
        The weight: the judgments', at most two requests' worth (rates drift: a new batch should soon outweigh it).
        The prior counts as PRIOR_JUDGMENTS judgments more than stand behind it: a rate of a few judgments is not
        known to be 0 or 1 (a short warm-up call's one rejection must not pass on a rate of 0). Not the recent rates
        that the requests' own predictions use: a request that met a hard passage decodes plainly until a probe finds
        it easier again, so its last judgments are its hardest, and as the next request's prior they would keep
        whole calls from drafting."""
        # the judgments' rate over all of them, weighed against the prior as their recent weight (at most
        # 1 / (1 - decay) per request): the prior still averages over earlier batches
        weight = self.weight.sum(0)
        mean = self.total_hits.sum(0) / np.maximum(self.total_weight.sum(0), 1e-12)
        pseudo = self.prior_weight + self.PRIOR_JUDGMENTS
        rates = (weight * mean + pseudo * self.prior) / (weight + pseudo)
        if batch_size > 1:
            judged = self.total_weight > 0
            own = np.where(judged, self.total_hits / np.maximum(self.total_weight, 1e-12), np.nan)
            several = judged.sum(0) >= 2
            if several.any():
                low = np.nanquantile(own[:, several], 1 / (batch_size + 1), axis=0)
                rates[several] = low
        return rates, np.minimum(weight + self.prior_weight, 2 / (1 - self.decay))


def _expected_tokens(rates: np.ndarray) -> np.ndarray:
    """(B, K + 1): 1 + sum_{d <= k} prod_{i <= d} rates[b, i - 1] for k = 0..K."""
    reach = np.cumprod(rates, axis=1)  # P(accept >= d)
    return 1 + np.concatenate((np.zeros((reach.shape[0], 1)), np.cumsum(reach, axis=1)), axis=1)


class AdaptiveDepth:
    """The loop's per-step choice of draft depth (see the module doc). target_s (K + 1,): seconds of the
    target's forward over 1..K+1 tokens per request at this batch size (only those of `depths` are used).

    Besides the best depth by prediction, choose probes and update learns from the probes; per step:

        state      event                                               next state
        plain      plain steps reach probe_wait, nothing lags, and     probe: the best k > 0, once
                   drafting would pay at the usual acceptance
        plain      shadow judgments come (judged)                      plain, the wait restarts (no probe due)
        probe      all its drafts accepted (update)                    probe again at the next step
        probe      the next choice drafts                              drafting, probe_wait = probe_every
        probe      the next choice is plain, not after a repeated      plain, probe_wait doubles (at most
                   probe                                               4 * probe_every)
        drafting   probe_every drafted steps in a row, plain steps     one plain step (its time is what a
                   not yet timed                                       drafted step's is compared with)
        any        drafting is (is not) predicted `margin` faster      drafting (plain)
    """

    def __init__(self, batch_size: int, max_depth: int, target_s: Sequence[float], probe_every: int = 16,
                 previous: Optional["AdaptiveDepth"] = None, depths: Optional[Sequence[int]] = None,
                 margin: float = 0.05, prior: Optional[tuple] = None, one_forward_proposals: bool = False):
        """previous: a policy of an earlier batch of the same drafter, whose measured costs carry over and whose
        requests' acceptance rates per depth (`AcceptanceStats.population`) are the new requests' prior. prior: the
        (rates, weight) per depth of a policy without a previous one (`drafter_prior`; None: GUESS, no weight).
        depths: the
        depths it may choose (None: 0..max_depth); 0 and at least one other among them. margin: how much faster
        than plain decoding a drafting depth must be expected to go to be chosen (a gain predicted at a few percent
        is within the error of the rates and costs behind it, while where drafting pays, the gain is tens of
        percent)."""
        if len(target_s) != max_depth + 1:
            raise ValueError(f"target_s: {len(target_s)} costs for depths 0..{max_depth}")
        depths = range(max_depth + 1) if depths is None else sorted(set(depths))
        if 0 not in depths or len(depths) < 2 or not all(0 <= k <= max_depth for k in depths):
            raise ValueError(f"depths: {list(depths)} must hold 0 and another depth in 1..{max_depth}")
        self.allowed = np.zeros(max_depth + 1, dtype=bool)
        self.allowed[list(depths)] = True
        same_drafter = previous is not None and previous.stats.prior.shape == (max_depth,)
        prior, prior_weight = previous.stats.population(batch_size) if same_drafter else prior or (GUESS, 0.0)
        self.stats = AcceptanceStats(batch_size, max_depth, prior=prior, prior_weight=prior_weight)
        self.target_s = np.asarray(target_s, dtype=np.float64)
        # unknown until the first drafted step; the rest of a step (bookkeeping, accept, rollbacks) is the
        # measured residual
        self.draft_level_s: Optional[float] = None if previous is None else previous.draft_level_s
        # the draft levels a depth-k proposal costs (draft_level_s each): k, or 1 for any k > 0 where one forward
        # drafts every level (draft_level_s is then a proposal's cost)
        self._draft_units = np.minimum(np.arange(max_depth + 1), 1 if one_forward_proposals else max_depth)
        self.overhead_s = 0.0 if previous is None else previous.overhead_s
        self.probe_every, self.probe_wait, self.probed = probe_every, probe_every, False
        self._reprobe = False  # the last step was a probe whose drafts were all accepted
        # the tokens a step would emit at the usual acceptance, what a probe tests for (1, K + 1): the prior's rates as
        # far as judgments stand behind them (prior_weight), else the best case, every draft accepted. A prior of a
        # few judgments that says drafting does not pay (a short warm-up call's one rejection) would otherwise keep
        # the policy from ever drafting to learn that it does
        c = AcceptanceStats.PRIOR_JUDGMENTS
        trusted = self.stats.prior_weight / (self.stats.prior_weight + c)
        self._usual_tokens = _expected_tokens((trusted * self.stats.prior + (1 - trusted))[None])
        self.margin = margin
        self.idle, self.drafting_run = 0, 0  # plain steps in a row, drafted steps in a row
        # the measured seconds of a step per depth (NaN: none timed yet), which replace the model's estimate: the
        # target's costs are isolated forwards', and a drafted step in the loop can cost more than they add up to
        # (at a large batch, enough to make drafting one level slower than plain decoding)
        self.measured_s = np.full(max_depth + 1, np.nan)
        same_size = previous is not None and previous.stats.weight.shape == self.stats.weight.shape
        if same_size:
            self.measured_s = previous.measured_s.copy()
        # the seconds the drafter's last catch-up took beyond its step (caught_up; the batch size's, as measured_s)
        self.catch_up_s = previous.catch_up_s if same_size else 0.0
        self.available: Optional[np.ndarray] = None  # (B,) the levels each request can be proposed (choose)
        self._deepest: Optional[int] = None  # available's maximum (None: any)
        self._step_s: Optional[np.ndarray] = None  # step_s, until the costs behind it change
        self._drafting = np.arange(max_depth + 1) > 0
        self.chosen = [0] * (max_depth + 1)  # steps per depth (the summary's "depth_chosen")

    def step_s(self) -> np.ndarray:
        """(K + 1,): the expected seconds of a step drafting k levels: as measured, or from the model. (Kept
        until a step's time is learnt: it is a few dozen small NumPy calls, a share of a cheap step.)"""
        if self._step_s is None:
            model = self.target_s + self._draft_units * (self.draft_level_s or 0.0) + self.overhead_s
            self._step_s = np.where(np.isnan(self.measured_s), model, self.measured_s)
        return self._step_s

    def choose(self, live: Sequence[bool], remaining: Optional[Sequence[int]] = None,
               available: Union[None, Sequence[int], Callable[[], Sequence[int]]] = None,
               lagging: bool = False) -> int:
        """The next step's depth. live[b]: request b is unfinished; remaining[b]: the tokens it has still to emit
        at most (None: maximize tokens per second instead of finishing the batch soonest); available[b]: the most
        levels request b's proposal can have now (`DepthControl.depths_available`, or a function returning them,
        called only where the choice depends on them; None: any), so that a depth k drafts min(k, available[b])
        levels of request b and costs a step as deep as the deepest of those; lagging: the drafter must first catch
        up on all it has not seen (`DepthControl.lagging`: a prefill, which no probe is worth, and which a drafting
        depth pays once: the last catch-up's measured cost, `caught_up`, is added to the time it would take to
        finish the batch)."""
        alive = np.asarray(live, dtype=bool)
        K = len(self.target_s) - 1
        tokens, switch_s = self.stats.expected_tokens(), self.catch_up_s if lagging else 0.0
        # what each request can be proposed only lowers what drafting gains (depth k of a batch whose longest
        # proposal has m < k levels is depth m with some requests' tokens cut), so where plain decoding beats every
        # depth, offered or not, with any proposals, it is the choice without asking (asking costs prompt lookup a
        # lookup per request, and a batch that saturates compute decodes plainly almost every step)
        self.available, self._deepest = None, None
        speed = self._speed(tokens, alive, remaining, switch_s)
        # (a probe also follows a probe whose drafts were all accepted, and a new batch's first step may probe while its
        # requests have no judgments of their own)
        reprobe, self._reprobe = self._reprobe, False
        probe_due = (self.idle + 1 >= self.probe_wait or reprobe
                     or not any(self.chosen) and not self.stats.weight.any()) and not lagging
        if available is not None and (self._pays(speed) or probe_due):
            available = available() if callable(available) else available
            if available is not None:
                self.available = np.minimum(np.asarray(available), K)
                self._deepest = int(self.available.max(initial=0))
                speed = self._speed(tokens, alive, remaining, switch_s)
        speed = np.where(self.allowed, speed, -1.0)  # the depths offered
        k = int(speed[1:].argmax()) + 1 if self._pays(speed) else 0
        if self.probed:  # the step after a probe: did what it measured make drafting worth it?
            if k:
                self.probe_wait = self.probe_every
            elif not reprobe:
                self.probe_wait = min(2 * self.probe_wait, 4 * self.probe_every)
            self.probed = False
        # a probe tests whether acceptance is back to its usual level (`_usual_tokens`): pointless where drafting would
        # not pay even then (a batch that saturates compute) or where no request has a proposal
        if k == 0 and probe_due and self._width(K) > 0:
            usual = np.broadcast_to(self._usual_tokens, (len(alive), K + 1))
            usual_speed = np.where(self.allowed, self._speed(usual, alive, remaining), -1.0)
            if self._pays(usual_speed):
                k, self.probed = int(speed[1:].argmax()) + 1, True
        # a plain step after probe_every drafted ones while plain steps are unmeasured: what a drafted step's
        # measured cost is compared with
        if k and self.drafting_run >= self.probe_every and np.isnan(self.measured_s[0]):
            k = 0
        return k

    def _pays(self, speed: np.ndarray) -> bool:
        """Some drafting depth is expected to go `margin` faster than plain decoding (speed: `_speed`'s)."""
        return speed[1:].max() > speed[0] * (1 + self.margin)

    def _speed(self, tokens: np.ndarray, alive: np.ndarray, remaining: Optional[Sequence[int]],
               switch_s: float = 0.0) -> np.ndarray:
        """(K + 1,): how fast a step of depth k goes if request b emits tokens[b, k] (its expected tokens at
        min(k, available[b])): tokens per second of the live requests, or with `remaining`, 1 / the time to finish
        the batch (every request needs at least one more step; a drafting depth also pays switch_s once, the
        drafter's catch-up)."""
        step = self.step_s()
        if self.available is not None:
            levels = np.minimum(np.arange(len(step)), self.available[:, None])  # (B, K + 1)
            tokens = np.take_along_axis(tokens, levels, axis=1)
            step = step[levels.max(0)]
        tokens = tokens[alive]
        if remaining is None:
            return tokens.sum(0) / step
        left = np.asarray(remaining, dtype=np.float64)[alive][:, None]
        return 1 / (step * np.maximum(left / tokens, 1).max(0) + switch_s * self._drafting)

    def _width(self, depth: int) -> int:
        """The levels a proposal asked for `depth` levels has (the deepest request's)."""
        return depth if self._deepest is None else min(depth, self._deepest)

    def caught_up(self, depth: int, seconds: float) -> None:
        """A step of `depth` levels whose drafter first caught up on what it lagged behind (`DepthControl.catch_up`)
        took `seconds` in all: beyond the step's usual cost, what the next switch from plain decoding will cost."""
        self.catch_up_s = max(seconds - float(self.step_s()[self._width(depth)]), 0.0)

    def drafted(self, depth: int, seconds: float) -> None:
        """A proposal asked for `depth` levels took `seconds` (the drafter's part of the step)."""
        depth = self._width(depth)
        if depth == 0:
            return
        unit = seconds / self._draft_units[depth]
        self.draft_level_s = unit if self.draft_level_s is None else 0.8 * self.draft_level_s + 0.2 * unit
        self._step_s = None

    def judged(self, accepted: Sequence[int], proposed: Sequence[int], since: Optional[Sequence[int]] = None) -> None:
        """Judgments of proposals nobody drafted (`DepthControl.shadow`): levels since[b] + 1 .. proposed[b] of
        request b's (since None: from the first), of which the first accepted[b] were right. The rates learn from
        them as from drafted steps, and while they come no probe is due (a probe drafts to learn what they tell for
        free)."""
        proposed = np.asarray(proposed)
        since = np.zeros_like(proposed) if since is None else np.asarray(since)
        new = proposed > since
        if new.any():
            self.stats.update(accepted, int(proposed.max()), new, proposed, since=since)
            self.idle = 0

    def update(self, num_accepted: Sequence[int], depth: int, live: Sequence[bool], seconds: Optional[float],
               drafting_timed: bool = True, acceptance: Optional[np.ndarray] = None) -> None:
        """The step of `depth` levels (the loop's, which may differ from the choice) took `seconds` in all (None:
        not a steady step's time) and accepted num_accepted[b] drafts of request b. drafting_timed: its drafting
        was timed apart (`drafted`), and the rest of the step is the overhead; a step run as one graph
        (compile=True) cannot be, and then a drafted step's residual over the target's cost and the overhead
        (learnt from plain-decoding steps) is its drafting. acceptance: AcceptanceStats.update's (None: none)."""
        depth = self._width(depth)
        self.stats.update(num_accepted, depth, live,
                          None if self.available is None else np.minimum(depth, self.available), acceptance)
        if self.probed:  # a probe whose drafts were all accepted is repeated at the next step: the rates still rise
            # (from a prior that says drafting does not pay, one accepted probe per probe_every steps would take
            # most of a call to lift them)
            self._reprobe = bool(np.all((np.asarray(num_accepted) >= depth) | ~np.asarray(live, dtype=bool)))
        self.chosen[depth] += 1
        self.idle, self.drafting_run = (self.idle + 1, 0) if depth == 0 else (0, self.drafting_run + 1)
        if seconds is None:  # a step that compiled or captured its graph: its time says nothing of the next ones
            return
        self._step_s = None
        last = float(self.measured_s[depth])
        # a pause of the machine (a garbage collection, another process) is not the depth's cost
        if not math.isnan(last):
            seconds = min(seconds, 2 * last)
        self.measured_s[depth] = seconds if math.isnan(last) else 0.8 * last + 0.2 * seconds
        residual = seconds - float(self.target_s[depth])
        if drafting_timed or depth == 0:
            drafting = self._draft_units[depth] * (self.draft_level_s or 0.0)
            self.overhead_s = 0.8 * self.overhead_s + 0.2 * max(residual - drafting, 0.0)
        else:
            self.drafted(depth, max(residual - self.overhead_s, 0.0))


class StepSchedule:
    """The depth of each step of one generate call, and the host bookkeeping around the step (outside any graph):

        k = schedule.before_step()                          # None: the drafter's whole tree; 0: the root alone
        ... the step runs, and its flags are read ...
        live = schedule.after_step(k, flags, ran, proposed_at)

    Without a policy every step drafts the whole tree. With one (an AdaptiveDepth, or any object with its methods
    choose, judged, drafted, caught_up, update) the policy chooses each step's depth and learns from the step; the
    drafter's `DepthControl` hooks (none for a core-only drafter) say how deep each request can draft, judge what a
    plain step would have proposed (shadow), keep the drafter's host state (advance) and catch it up where it lags.
    batch: the loop's `_Batch` (its tokens, seq_lens, requests, max_new, temp, judge_probs are read).
    drafting_timed: the runner times a step's proposal apart (`after_step`'s proposed_at)."""

    def __init__(self, policy, drafter: Drafter, batch, drafting_timed: bool):
        self.policy, self.batch, self.drafting_timed = policy, batch, drafting_timed
        self.hooks = drafter if isinstance(drafter, DepthControl) else DepthControl()
        B = batch.tokens.shape[0]
        self.live = [b < batch.requests for b in range(B)]  # (the padding rows are finished from the start)
        self.remaining = [batch.max_new if live else 0 for live in self.live]  # tokens each request may still emit
        self.skips = 0  # plain-decoding steps in a row
        self.sampled = (batch.temp > 0).cpu().numpy() if batch.judge_probs else None
        self.t_step = 0.0
        self.caught_up = False  # the step's drafter first catches up on what it lagged behind
        self.steady = True  # the step's time is what a step of its depth costs

    def before_step(self) -> Optional[int]:
        """The next step's depth, with the drafter told (advance) and caught up where it lags."""
        self.t_step = time.perf_counter()
        s, hooks, k = self.batch, self.hooks, None
        if self.policy is not None:
            k = self.policy.choose(self.live, self.remaining, lambda: hooks.depths_available(s.tokens, s.seq_lens),
                                   hooks.lagging)
            if k == 0:  # what the drafter would have proposed, judged as the tokens come (host drafters)
                judged = hooks.shadow(s.tokens, s.seq_lens)
                if judged is not None:
                    self.policy.judged(*judged)
        self.skips = self.skips + 1 if k == 0 else 0
        if hooks.max_skips is not None and self.skips > hooks.max_skips:
            k, self.skips = 1, 0
        hooks.advance(k)
        self.caught_up = k != 0 and hooks.lagging
        if self.caught_up:
            hooks.catch_up(s.tokens, s.seq_lens)
        # a step whose drafter first catches up on skipped steps is not what a step of its depth costs
        self.steady = not hooks.catching_up
        return k

    def after_step(self, k: Optional[int], flags: list, ran: bool, proposed_at: Optional[float]) -> bool:
        """After the step of depth k: flags, the step's `_Batch.flags` as a list; ran: it compiled, warmed up or
        captured no graph (else its time says nothing of the next ones); proposed_at: when its proposal was ready,
        where the runner times it apart (None: not). Returns whether any request is still live."""
        B = len(self.live)
        policy = self.policy
        if policy is not None:
            if proposed_at is not None and k and self.steady:
                policy.drafted(k, proposed_at - self.t_step)
            seconds = time.perf_counter() - self.t_step
            if self.caught_up and ran:  # what the next switch from plain decoding will cost
                policy.caught_up(k, seconds)
            judged = {}  # (passed only when there are some: a policy of greedy loops needs no such argument)
            if self.batch.judge_probs and k:  # (sampled requests' levels judged by their acceptance probabilities)
                probs = np.array(flags[2 * B:], dtype=np.float64).reshape(B, -1) / PROB_SCALE
                judged["acceptance"] = np.where(self.sampled[:, None], probs, np.nan)
            policy.update(flags[:B], k, self.live, seconds if ran and self.steady else None,
                          drafting_timed=self.drafting_timed, **judged)
            self.remaining = [r - n - 1 if live else r for r, n, live in zip(self.remaining, flags, self.live)]
        self.live = [not f for f in flags[B:2 * B]]
        return any(self.live)


_TARGET_COSTS: dict = {}  # (model, batch size, timed token counts, context, dtype, device, compiled) -> costs


def compiled_depths(max_depth: int) -> list[int]:
    """The depths an adaptive compiled loop may choose: 0, the powers of two below max_depth, and max_depth (each
    depth and drafter state is a graph to compile: a ladder keeps them few; chain:8 -> 0, 1, 2, 4, 8)."""
    return [0] + [1 << i for i in range(max_depth.bit_length()) if 1 << i < max_depth] + [max_depth]


def measure_target_costs(target: Llama, batch_size: int, max_tokens: int, context: int = 256,
                         repeats: int = 3, compiled: bool = False,
                         tokens: Optional[Sequence[int]] = None, graph_class=None) -> list[float]:
    """Seconds of the target's cached forward over t = 1..max_tokens new tokens per request (chains) after
    `context` cached ones, at this batch size: the best of `repeats` timed runs after a warm-up (in rounds over the
    counts). Cached per model, shape and device for the process (the cache holds garbage K/V: only the time is used).
    compiled: time it through torch.compile (`compile_static`), as a compiled loop runs it. graph_class: time the
    replay of a graph of it (decoding.CudaStepGraph), as a loop that replays its steps runs it: an eager forward of
    a small model is launch-bound, and timed so it would make the target look dear beside a replayed step's
    drafting. tokens: time only these counts (and max_tokens, and 1); another count gets the time interpolated
    linearly between its timed neighbours."""
    timed = sorted(set(range(1, max_tokens + 1) if tokens is None else tokens) | {1, max_tokens})
    key = (id(target), batch_size, tuple(timed), context, target.dtype, str(target.device), compiled, graph_class)
    if key not in _TARGET_COSTS:
        dev = target.device
        cache = target.new_cache(batch_size, context + max_tokens + 1)
        cache.lens.fill_(context)
        forward = compile_static(target._forward_cached, dev) if compiled else target._forward_cached
        runs = [_chain_forward(forward, cache, batch_size, t) for t in timed]
        best = [float("inf")] * len(timed)
        pool = None if graph_class is None else graph_class.new_pool(dev)
        with torch.inference_mode():
            # round after round over the token counts (a pause of the machine slows one run of a few counts, not
            # every run of one); the first round warms up (and compiles), a graphed one then captures
            for rep in range(repeats + 1):
                if rep == 1 and graph_class is not None:
                    runs = [graph_class(run, pool).replay for run in runs]  # (captured after the eager warm-up)
                for i, run in enumerate(runs):
                    _sync(dev)
                    t0 = time.perf_counter()
                    run()
                    _sync(dev)
                    if rep:
                        best[i] = min(best[i], time.perf_counter() - t0)
        measured = np.maximum.accumulate(best)  # never cheaper for more tokens (timing noise)
        _TARGET_COSTS[key] = np.interp(np.arange(1, max_tokens + 1), timed, measured).tolist()
    return _TARGET_COSTS[key]


def _chain_forward(forward, cache, batch_size: int, t: int):
    """A run of the target's cached forward over a t-token chain per request (inputs made once, so that a graph of
    it replays on them)."""
    tokens = torch.zeros(batch_size, t, dtype=torch.long, device=cache.lens.device)
    tree = chain_tree(batch_size, t, device=cache.lens.device)
    return lambda: forward(tokens, cache, tree.depth, tree.mask, None, 0, None, False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
