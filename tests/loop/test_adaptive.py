"""Adaptive speculation (specdec.loop.adaptive): the policy's arithmetic and choices, the drafters' depth limits and
skipped steps (a scripted policy makes every kind of step happen), and that no choice changes an output."""
from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch

from specdec.loop.adaptive import (SHIPPED_ACCEPTANCE, AcceptanceStats, AdaptiveDepth, _expected_tokens, compiled_depths,
                                   drafter_prior, measure_target_costs)
from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import DraftModelDrafter, MTPDrafter, NgramDrafter, SuffixDrafter

from test_loop import PROMPTS, byte_pair, chi_square_two_tokens, exact_filtered_two_token_law, pair, run_cli, tiny  # noqa: F401
from test_mtp import assert_heads_cache_matches_a_fresh_run, target_and_mtp  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


class Scripted:
    """A policy that cycles through fixed depths (capped at the drafter's): skips, shallow and full drafts."""

    def __init__(self, batch_size, max_depth, device, script=(0, 2, 0, 0, 9, 1, 0, 3)):
        self.script, self.max_depth, self.i = script, max_depth, 0
        self.chosen = [0] * (max_depth + 1)

    def choose(self, live, remaining=None, available=None, lagging=False):
        k = min(self.script[self.i % len(self.script)], self.max_depth)
        self.i += 1
        self.chosen[k] += 1
        return k

    def drafted(self, depth, seconds):
        assert 1 <= depth <= self.max_depth and seconds >= 0

    def caught_up(self, depth, seconds):
        assert 1 <= depth <= self.max_depth and seconds >= 0

    def update(self, num_accepted, depth, live, seconds, drafting_timed=True, acceptance=None):
        assert all(n <= depth for n, alive in zip(num_accepted, live) if alive)
        if acceptance is not None:
            assert np.all(np.isnan(acceptance) | ((acceptance >= 0) & (acceptance <= 1)))

    def judged(self, accepted, proposed, since):
        assert all(0 <= s <= a <= p <= self.max_depth and p <= a + 1
                   for a, p, s in zip(accepted, proposed, since) if p > s)
        self.judgments = getattr(self, "judgments", 0) + sum(p > s for p, s in zip(proposed, since))


def scripted(script):
    return lambda B, K, dev: Scripted(B, K, dev, script)


PROMPTS4 = PROMPTS + [[5]]  # with a one-token prompt


# ----------------------------------------------------------------------------------------------
# the policy
# ----------------------------------------------------------------------------------------------
def test_acceptance_stats_update_only_the_judged_depths():
    stats = AcceptanceStats(3, 4, prior=[0.5, 0.8, 0.4, 0.4], decay=0.5, prior_weight=[6, 2, 2, 0])
    stats.update([0, 2, 4], depth=3, live=[True, True, False])
    # request 0: depth 1 judged and rejected; request 1: depths 1, 2 accepted, 3 rejected; request 2 finished. A
    # request's own rate is its judgments' alone (the prior where it has none)
    alpha = np.array([[0, 0.8, 0.4, 0.4], [1, 1, 0, 0.4], [0.5, 0.8, 0.4, 0.4]])
    weight = np.array([[1.0, 0, 0, 0], [1, 1, 1, 0], [0] * 4])
    np.testing.assert_allclose(stats.alpha, alpha)
    np.testing.assert_allclose(stats.weight, weight)
    stats.update([1, 1, 1], depth=0, live=[True] * 3)  # a step without drafts teaches nothing
    np.testing.assert_allclose(stats.alpha, alpha)
    # prediction: a depth judged w times trusts its own rate by w / (w + 4), scaled to 1 at the most weight there can
    # be (1 / (1 - decay) = 2 here), for the rest the prediction one level shallower times the prior's ratio between
    # the two depths (at depth 1: the prior), trusted as far as the prior's weights at both go (none at depth 4)
    prior = [0.5, 0.8, 0.4, 0.4]
    shape = [0.5, 0.5, 0.0]  # min(2, 6) / (2 + 2), min(2, 2) / 4, min(0, 2) / 2
    pred = []
    for b in range(3):
        row, below = [], prior[0]
        for d in range(4):
            trust = weight[b, d] / (weight[b, d] + 4) * (2 + 4) / 2
            row.append(trust * alpha[b, d] + (1 - trust) * below)
            if d < 3:
                below = min(row[-1] * (1 + shape[d] * (prior[d + 1] / prior[d] - 1)), 1.0)
        pred.append(row)
    np.testing.assert_allclose(stats.predicted(), np.array(pred))
    # expected tokens per step of depth k, per request: 1 + sum_d prod_{i <= d} alpha
    want = []
    for b in range(3):
        row, prod, total = [], 1.0, 1.0
        for k in range(5):
            row.append(total)
            if k < 4:
                prod *= pred[b][k]
                total += prod
        want.append(row)
    np.testing.assert_allclose(stats.expected_tokens(), np.array(want))
    # the next judgments: a rate weighs each by decay^age (0.5 here), over the weights of those judgments
    stats.update([1, 0, 0], depth=2, live=[True, True, False])
    np.testing.assert_allclose(stats.alpha[:2, :2], [[1 / 1.5, 0], [0.5 / 1.5, 1]])
    np.testing.assert_allclose(stats.weight[:2, :2], [[1.5, 1], [1.5, 1]])
    assert stats.expected_tokens()[0, 1] == pytest.approx(1 + stats.predicted()[0, 0])  # (not the kept one)


def test_the_population_rate_counts_the_prior_as_a_few_judgments():
    """The rate a batch passes on is its judgments' with the prior counted as PRIOR_JUDGMENTS (4) more than stand
    behind it: three rejections take a prior of 0.9 to 0.54, not to 0 (a rate of three judgments is not known to be 0:
    a short call's one rejection made the next call start at 0 and decode plainly), and a batch of 16 requests
    rejected at every step for 30 steps to under 0.03 (an average started at the prior kept 0.9^3 of it after three
    judgments whatever the batch, so an optimistic prior outlived the batch that refuted it)."""
    stats = AcceptanceStats(2, 2, prior=0.9)
    for _ in range(3):
        stats.update([0, 0], depth=2, live=[True, False])
    rates, weights = stats.population()
    judged = 1 + 0.9 + 0.81  # (their recent weight)
    assert rates[0] == pytest.approx(4 * 0.9 / (4 + judged)) and rates[1] == pytest.approx(0.9)
    assert weights[0] == pytest.approx(judged) and weights[1] == 0  # (the judgments only)
    many = AcceptanceStats(16, 2, prior=0.9)
    for _ in range(30):
        many.update([0] * 16, depth=2, live=[True] * 16)
    assert many.population()[0][0] < 0.03


def test_shallow_drafting_learns_that_deeper_drafts_would_pay():
    """Drafting 2 levels that are always accepted raises the prediction for the depths never drafted."""
    stats = AcceptanceStats(1, 6, prior=0.3)
    for _ in range(30):
        stats.update([2], depth=2, live=[True])
    assert stats.predicted()[0, 5] > 0.9


def test_a_request_whose_first_level_is_often_rejected_is_still_expected_to_accept_deep_drafts():
    """Prompt lookup's shape: 70% of the steps reject the first draft (a wrong match), the others accept all 4 levels
    drafted (the text repeats). The depths never drafted (5..8) are predicted from the deepest ones drafted, not from
    the request's rate over all depths (about 0.3, dragged down by depth 1), so a step costing 5% more per level
    drafts all 8 rather than 4."""
    policy = AdaptiveDepth(1, 8, [1.0 + 0.05 * k for k in range(9)], depths=[0, 1, 2, 4, 8])
    outcomes = [0, 0, 4, 0, 0, 4, 0, 4, 0, 0] * 4
    for n in outcomes:
        policy.update([n], 4, [True], 1.2)
    policy.update([0], 0, [True], 1.0)
    pred = policy.stats.predicted()[0]
    assert pred[0] < 0.45 and pred[1:4].min() > 0.75 and pred[3] > 0.85
    np.testing.assert_allclose(pred[4:], pred[3])  # (a flat prior: the ratio between depths is 1)
    assert policy.choose([True]) == 8


def test_policy_drafts_deep_when_drafts_are_accepted_and_verification_is_cheap():
    policy = AdaptiveDepth(1, 6, [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3])
    policy.drafted(2, 0.1)  # 0.05 s per draft level
    for _ in range(20):
        k = policy.choose([True])
        policy.update([k], k, [True], 1.0 + 0.05 * k)  # every draft accepted
    assert k == 6


def test_policy_stops_drafting_when_nothing_is_accepted_and_probes_now_and_then():
    policy = AdaptiveDepth(1, 4, [1.0, 1.1, 1.2, 1.3, 1.4], probe_every=8)
    policy.drafted(1, 0.05)
    ks = []
    for _ in range(64):
        k = policy.choose([True])
        policy.update([0], k, [True], 1.0 + 0.1 * k)  # every draft rejected (prompt lookup on text without repeats)
        ks.append(k)
    assert ks[-40:].count(0) >= 35 and 0 < sum(k > 0 for k in ks[-40:]) <= 5


def test_policy_learns_the_drafting_cost_from_steps_run_as_one_graph():
    """A compiled step cannot time its drafting apart: plain-decoding steps teach the overhead (their time beyond
    the target's forward), drafted steps the drafting (their time beyond that and the overhead, per level)."""
    policy = AdaptiveDepth(1, 4, [1.0, 1.1, 1.2, 1.3, 1.4])
    for _ in range(60):
        policy.update([1], 0, [True], 1.0 + 0.2, drafting_timed=False)  # overhead 0.2
        policy.update([3], 3, [True], 1.3 + 0.2 + 3 * 0.05, drafting_timed=False)  # 0.05 per level
    assert abs(policy.overhead_s - 0.2) < 1e-6 and abs(policy.draft_level_s - 0.05) < 1e-3


def test_policy_trusts_measured_step_costs_over_its_model():
    """The model (isolated target forwards, a cheap draft timed apart) says drafting pays; the steps as run say a
    drafted step costs 3 + k and a plain one 1 (the verification costs more in the loop than alone). Learnt from
    drafted steps only, that extra lands in the overhead, which the model charges plain steps too: the policy
    tries a plain step, then decodes plainly, without probes (drafting would not pay even at the usual acceptance:
    a probe could not change the choice)."""
    policy = AdaptiveDepth(1, 4, [1.0, 1.05, 1.1, 1.15, 1.2], probe_every=8)
    ks = []
    for _ in range(80):
        k = policy.choose([True])
        if k:
            policy.drafted(k, 0.01 * k)
        policy.update([k], k, [True], 1.0 if k == 0 else 3.0 + k)  # every draft accepted
        ks.append(k)
    assert 0 in ks[:10] and ks[-60:] == [0] * 60


def test_a_lagging_drafter_drafts_only_where_its_catch_up_pays():
    """The draft model's cache is filled lazily: the first drafted step runs all it has not seen (at a large batch, a
    prefill of every prompt). That time beyond the step's own cost (caught_up) is charged once to every drafting depth
    while the drafter lags: with 30 steps' worth of tokens left drafting pays for it, with 5 it does not. Once caught
    up, drafting pays again; a batch of another size starts without the cost."""
    def trained():
        policy = AdaptiveDepth(1, 2, [1.0, 1.2, 1.4])
        for _ in range(20):
            policy.update([2], 2, [True], 1.4)
            policy.update([0], 0, [True], 1.0)
        policy.caught_up(2, 1.4 + 5.0)
        return policy

    assert trained().catch_up_s == pytest.approx(5.0)
    assert trained().choose([True], [30], lagging=True) == 2  # 30 plain steps, or 11 drafted + 5 s
    assert trained().choose([True], [5], lagging=True) == 0  # 5 plain steps, or 2 drafted + 5 s
    assert trained().choose([True], [5], lagging=False) == 2
    later = AdaptiveDepth(1, 2, [1.0, 1.2, 1.4], previous=trained())
    assert later.catch_up_s == pytest.approx(5.0) and later.choose([True], [5], lagging=True) == 0
    assert AdaptiveDepth(2, 2, [1.0, 1.2, 1.4], previous=trained()).catch_up_s == 0


def test_step_costs_follow_every_cost_learnt_between_choices():
    """step_s is kept between choices (the policy's host work is a few percent of a cheap step): whatever a step
    teaches, a drafting level's time (drafted, or a compiled step's residual), the overhead or a depth's measured
    time, the next choice's costs are the model's and the measurements as they stand now."""
    def expected(policy):
        model = policy.target_s + np.arange(5) * (policy.draft_level_s or 0.0) + policy.overhead_s
        return np.where(np.isnan(policy.measured_s), model, policy.measured_s)

    rng = np.random.default_rng(0)
    policy = AdaptiveDepth(1, 4, [1.0, 1.1, 1.2, 1.3, 1.4])
    for step in range(40):
        k = policy.choose([True], [100])
        np.testing.assert_allclose(policy.step_s(), expected(policy))
        if k and step % 3:
            policy.drafted(k, 0.05 * k * rng.uniform(0.5, 2))
            np.testing.assert_allclose(policy.step_s(), expected(policy))
        k = int(rng.integers(0, 5))  # (the loop may run another depth than chosen)
        policy.update([k], k, [True], 1.0 + 0.2 * k * rng.uniform(0.5, 2), drafting_timed=bool(step % 2))
        np.testing.assert_allclose(policy.step_s(), expected(policy))
    assert not np.isnan(policy.measured_s).any() and policy.draft_level_s > 0


def test_one_slow_step_moves_a_measured_cost_by_at_most_a_fifth():
    """A step 60 times slower than usual (the machine paused) counts as at most twice the cost measured so far: an
    inflated plain-step cost would make drafting look cheap, and a policy that then drafts never measures it again."""
    policy = AdaptiveDepth(1, 2, [1.0, 1.1, 1.2])
    for _ in range(10):
        policy.update([0], 0, [True], 1.0)
    policy.update([0], 0, [True], 60.0)
    assert policy.measured_s[0] == pytest.approx(1.2)
    for _ in range(30):  # a real change of cost is followed within a few steps
        policy.update([0], 0, [True], 3.0)
    assert policy.measured_s[0] == pytest.approx(3.0, rel=0.01)


def test_policy_stops_drafting_at_a_batch_that_saturates_compute():
    """Verification cost proportional to the tokens verified (compute-bound), drafts accepted at 0.7:
    speculation does not pay, whatever the depth."""
    B = 16
    policy = AdaptiveDepth(B, 4, [1.0 * (k + 1) for k in range(5)])
    policy.drafted(1, 0.1)
    for _ in range(10):
        k = policy.choose([True] * B)
        policy.update([int(torch.rand(()) < 0.7) for _ in range(B)], k, [True] * B, 1.0 * (k + 1))
    assert k == 0


def test_policy_drafts_where_it_speeds_up_the_request_that_bounds_the_batch():
    """Request 0's drafts are always accepted, request 1's never, and a drafted level costs 30% of a plain step.
    Drafting raises the batch's tokens per second (request 0 emits k + 1 tokens a step), but the batch lasts as long
    as request 1, which drafting only slows: plain decoding. Once request 1 is nearly done and request 0 has far to
    go, drafting pays again."""
    costs = [1.0 + 0.3 * k for k in range(5)]

    def trained():
        policy = AdaptiveDepth(2, 4, costs)
        for _ in range(40):
            policy.update([4, 0], 4, [True, True], costs[4])
        policy.update([0, 0], 0, [True, True], costs[0])
        return policy

    assert trained().choose([True, True], remaining=[50, 50]) == 0
    assert trained().choose([True, True]) == 4  # tokens per second
    assert trained().choose([True, True], remaining=[50, 1]) == 4
    assert trained().choose([True, False], remaining=[50, 50]) == 4  # request 1 finished: it bounds nothing


def test_policy_expects_nothing_of_a_request_without_a_proposal_now():
    """Prompt lookup knows before the step which requests have a match (available levels): request 1's drafts have
    always been accepted but it has no match now, so drafting would not speed it up and it bounds the batch: plain
    decoding (without `available`, the negative control, the policy drafts). The batch's tokens per second still
    gain from request 0's match. A depth past the longest match costs and yields what the longest match does, and
    is run, counted and timed as that width; with no match anywhere there is nothing to probe."""
    costs = [1.0 + 0.1 * k for k in range(9)]

    def trained():
        policy = AdaptiveDepth(2, 8, costs)
        for _ in range(40):
            policy.update([8, 8], 8, [True, True], None)
        policy.update([0, 0], 0, [True, True], costs[0])
        return policy

    assert trained().choose([True, True], [50, 50]) > 0
    assert trained().choose([True, True], [50, 50], available=[8, 0]) == 0
    assert trained().choose([True, True], available=[8, 0]) == 8
    policy = trained()
    assert policy.choose([True, True], available=[3, 2]) == 3
    policy.update([3, 2], 8, [True, True], 1.25)  # (the loop passes the depth it asked for)
    assert policy.chosen[3] == 1 and policy.measured_s[3] == 1.25 and np.isnan(policy.measured_s[8])
    idle = AdaptiveDepth(1, 8, costs, probe_every=2)
    for _ in range(20):
        assert idle.choose([True], [50], available=[0]) == 0
        idle.update([0], 0, [True], 1.0)


def test_proposals_are_looked_up_only_where_the_choice_depends_on_them():
    """`available` may be a function (prompt lookup's lookups cost 1-2% of a plain step at a batch of 16): called
    only where plain decoding does not beat every depth without it, or a probe is due, and the choice is the one the
    looked-up list gives (where it was not called, plain decoding would win even if every request could be
    proposed K levels). Random policies (rates, costs, ladders, probe timing, finished requests) and proposals."""
    rng = np.random.default_rng(0)
    skipped = 0
    for trial in range(300):
        B, K = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        costs = np.cumsum(rng.uniform(0.02, 0.6, K + 1))
        depths = compiled_depths(K) if trial % 2 else None
        policy = AdaptiveDepth(B, K, costs, probe_every=int(rng.integers(1, 6)), depths=depths)
        for _ in range(int(rng.integers(0, 12))):
            k = int(rng.integers(0, K + 1))
            policy.update(rng.integers(0, k + 1, B), k, rng.random(B) < 0.9, float(costs[k] * rng.uniform(0.8, 1.5)))
        live, remaining = rng.random(B) < 0.8, rng.integers(1, 60, B)
        live[0] = True
        proposals = rng.integers(0, K + 1, B)
        calls = []
        looked_up, best_case = copy.deepcopy(policy), copy.deepcopy(policy)
        k = policy.choose(live, remaining, lambda: calls.append(1) or proposals)
        assert k == looked_up.choose(live, remaining, proposals), trial
        assert len(calls) <= 1 and (policy.probed, policy.probe_wait) == (looked_up.probed, looked_up.probe_wait)
        if not calls:
            skipped += 1
            assert k == 0 and best_case.choose(live, remaining, np.full(B, K)) == 0  # (every request proposing K)
    assert 30 < skipped < 270  # both paths taken
    # a depth not offered counts: on the ladder 0, 1, 2, 4, 8 with depth 3 the only one that pays (half the first
    # levels rejected, the rest accepted; a width-4 forward costs twice a width-3 one), depth 4 of proposals that
    # have 3 levels is that depth-3 step
    policy = AdaptiveDepth(1, 8, [1, 1.6, 2.2, 2.3, 5, 5, 5, 5, 6], depths=compiled_depths(8))
    policy.stats.weight[:] = 10  # (judged at every recent step: the own rates, trusted fully)
    policy.stats.hits[:] = 10 * np.array([0.5, 1, 1, 1, 1, 1, 1, 1])
    assert policy.choose([True], [100], lambda: [8]) == 0 and policy.choose([True], [100], lambda: [3]) == 4


def test_prompt_lookup_judges_the_proposals_nobody_drafted():
    """NgramDrafter.shadow, called on plain steps while the sequences grow (by one token, or by several: steps that
    drafted in between), judges each recorded proposal level by level as the sequence grows: the levels whose token
    is in, up to the first wrong one, each reported once, with the count of leading tokens that were right, as a
    drafted step of that proposal would have accepted them. Against a reference that records the scan's proposal
    (`lookup`) whenever a request has none pending and drops it once a wrong token or all its tokens are in. Small
    vocabulary: proposals at every depth, right and wrong."""
    gen = torch.Generator().manual_seed(1)
    B, L, K = 4, 200, 5
    tokens = torch.randint(0, 3, (B, L), generator=gen)
    seq_lens = torch.randint(2, 20, (B,), generator=gen)
    drafter = NgramDrafter(num_tokens=K)
    drafter.start(tokens, seq_lens)
    pending, counts, partial = [None] * B, np.zeros((K + 1, K + 1), dtype=int), 0  # (proposed, accepted) judged
    for _ in range(60):
        want = [(0, 0, 0)] * B
        for b, n in enumerate(seq_lens.tolist()):
            if pending[b] is not None:
                pos, cont, reported = pending[b]
                seen = tokens[b, pos:min(n, pos + len(cont))].tolist()
                right = 0
                while right < len(seen) and seen[right] == cont[right]:
                    right += 1
                known = right + 1 if right < len(seen) else right
                if known > reported:
                    want[b] = (right, known, reported)
                    partial += known < len(cont) and right == known
                pending[b] = None if right < len(seen) or right == len(cont) else (pos, cont, known)
            if pending[b] is None:
                cont = drafter.lookup(tokens[b, :n]).tolist()
                pending[b] = (n, cont, 0) if cont else None
        accepted, proposed, since = drafter.shadow(tokens, seq_lens)
        assert list(zip(accepted, proposed, since)) == want
        for a, p, _ in want:
            counts[p, a] += p > 0
        seq_lens = (seq_lens + torch.where(torch.rand(B, generator=gen) < 0.7, 1, 4)).clamp(max=L)
    assert counts[:, 0].sum() > 10 and counts[1:, 1:].sum() > 10 and np.trace(counts[1:, 1:]) > 0 and partial > 5
    # a batch of 8 judges on every second call (about 4 requests' judgments per step: the cost stays a small part of
    # the step as the batch grows), the first call included
    wide = NgramDrafter(num_tokens=K)
    wide.start(tokens.repeat(2, 1), seq_lens.repeat(2))
    assert [wide.shadow(tokens.repeat(2, 1), seq_lens.repeat(2)) is not None for _ in range(6)] == [True, False] * 3


def test_judgments_level_by_level_add_up_to_the_whole_proposals():
    """A proposal judged in parts (AdaptiveDepth.judged with `since`) teaches the rates what one judgment of it all
    teaches: levels 1-2 right, then level 3 right and 4 wrong, equal levels 1-3 right and 4 wrong at once (with no
    decay between: the same counts); a part already judged is not counted again."""
    costs = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    whole, parts = AdaptiveDepth(2, 5, costs), AdaptiveDepth(2, 5, costs)
    whole.stats.decay = parts.stats.decay = 1.0
    whole.judged([3, 5], [4, 5])
    parts.judged([2, 1], [2, 1], [0, 0])
    parts.judged([3, 3], [4, 3], [2, 1])
    parts.judged([3, 5], [4, 5], [4, 3])
    parts.judged([3, 5], [4, 5], [4, 5])  # (nothing new)
    np.testing.assert_allclose(parts.stats.hits, whole.stats.hits)
    np.testing.assert_allclose(parts.stats.weight, whole.stats.weight)
    np.testing.assert_allclose(whole.stats.weight[0], [1, 1, 1, 1, 0])


def test_judgments_of_undrafted_proposals_teach_the_rates_and_replace_probes():
    """AdaptiveDepth.judged: a request's judged levels update its rates as a drafted step's would, and while
    judgments come the policy probes not (negative control: the same plain steps without them probe)."""
    costs = [1.0, 1.1, 1.2, 1.3]
    drafted, shadowed = AdaptiveDepth(2, 3, costs), AdaptiveDepth(2, 3, costs)
    drafted.update([1, 0], 3, [True, False], None)
    shadowed.judged([1, 0], [3, 0])
    np.testing.assert_allclose(shadowed.stats.hits, drafted.stats.hits)
    np.testing.assert_allclose(shadowed.stats.weight, drafted.stats.weight)
    assert shadowed.chosen == [0] * 4  # (no step drafted)
    for judgments in (True, False):
        policy = AdaptiveDepth(1, 3, costs, probe_every=2)
        ks = []
        for _ in range(30):
            ks.append(policy.choose([True], [1000]))
            if judgments and ks[-1] == 0:
                policy.judged([0], [3])
            policy.update([0], ks[-1], [True], costs[ks[-1]])
        assert (max(ks[10:]) == 0) == judgments, ks  # (before: drafting until the rates fall)


def test_a_larger_batch_starts_from_the_rate_of_its_slowest_request():
    """A batch lasts as long as its slowest request: a new batch of B > 1 starts each request at the 1 / (B + 1)
    quantile of the previous requests' own rates (a depth judged for one request only: the mean), a batch of 1 at
    their mean (negative control: the mean, which a batch of 16 took before, is 25% higher here)."""
    stats = AcceptanceStats(4, 2, prior=0.6)
    for step in range(10):  # request b accepts its first level on 2, 4, 8, 10 of 10 steps
        stats.update([int(step < n) for n in (2, 4, 8, 10)], 1, [True] * 4)
    stats.update([0, 0, 0, 1], 2, [True] * 4)  # only request 3 has its second level judged
    own = stats.total_hits[:, 0] / stats.total_weight[:, 0]  # (all their judgments: 2, 4, 8 and 11 of 11 accepted)
    assert own[0] < own[1] < own[2] < own[3] == 1
    mean, _ = stats.population(1)
    w = stats.weight[:, 0].sum()
    assert mean[0] == pytest.approx((w * 25 / 44 + 4 * 0.6) / (w + 4))
    low, _ = stats.population(16)
    assert low[0] == pytest.approx(np.quantile(own, 1 / 17)) and low[0] < 0.8 * mean[0]
    assert low[1] == mean[1]  # (one request judged at depth 2)
    policy = AdaptiveDepth(16, 2, [1.0, 1.1, 1.2], previous=AdaptiveDepth(4, 2, [1.0, 1.1, 1.2]))
    policy.stats = stats
    np.testing.assert_allclose(AdaptiveDepth(16, 2, [1.0, 1.1, 1.2], previous=policy).stats.prior, low)


def test_drafting_must_be_expected_to_pay_by_the_margin():
    """A drafting depth predicted 3% faster than plain decoding is not chosen (margin 5%: within the prediction's
    error), one predicted 8% faster is; without a margin (the negative control) the 3% one is."""
    def policy(gain, margin=0.05):
        p = AdaptiveDepth(1, 1, [1.0, 1.5 / gain], margin=margin)
        p.stats.weight[:], p.stats.hits[:] = 10, 5  # (a rate of 0.5, fully trusted: 1.5 tokens per drafted step)
        return p
    assert policy(1.03).choose([True], [100]) == 0 and policy(1.08).choose([True], [100]) == 1
    assert policy(1.03, margin=0).choose([True], [100]) == 1


def test_acceptance_stats_judge_only_the_levels_proposed():
    stats = AcceptanceStats(2, 3, prior=0.5, decay=0.5)
    stats.update([1, 0], depth=3, live=[True, True], proposed=np.array([2, 0]))
    # request 0: levels 1 and 2 proposed, 1 accepted and 2 rejected; request 1: nothing proposed, nothing judged
    np.testing.assert_allclose(stats.alpha, [[1, 0, 0.5], [0.5, 0.5, 0.5]])
    np.testing.assert_allclose(stats.weight, [[1, 1, 0], [0, 0, 0]])


def test_probes_that_change_nothing_come_less_often_and_repeats_are_still_noticed():
    """Nothing accepted: after each probe that leaves plain decoding the best choice, the wait doubles, up to
    4 * probe_every. Once drafts are accepted (the text starts repeating), the next probe brings drafting back."""
    policy = AdaptiveDepth(1, 4, [1.0, 1.1, 1.2, 1.3, 1.4], probe_every=4)
    ks = []
    for _ in range(90):
        k = policy.choose([True], [1000])
        policy.update([0], k, [True], 1.0 + 0.1 * k)
        ks.append(k)
    probes = [i for i, k in enumerate(ks) if k]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    doubling = gaps.index(4)  # (before it: drafting while the prior's optimism lasts, then probes)
    assert gaps[doubling:] == [4, 8] + [16] * (len(gaps) - doubling - 2) and len(gaps) - doubling >= 5, ks
    for _ in range(17):  # drafts now accepted
        k = policy.choose([True], [1000])
        policy.update([k], k, [True], 1.0 + 0.1 * k)
    assert policy.choose([True], [1000]) > 0
    # no probe while the drafter lags (its catch-up, a prefill of all it has not seen, is worth no probe)
    for lagging in (True, False):
        policy = AdaptiveDepth(1, 4, [1.0, 1.1, 1.2, 1.3, 1.4], probe_every=4)
        for _ in range(40):
            policy.update([0], 1, [True], 1.1)
            policy.update([0], 0, [True], 1.0)
        ks = []
        for _ in range(8):
            ks.append(policy.choose([True], [1000], lagging=lagging))
            policy.update([0], ks[-1], [True], 1.0 + 0.1 * ks[-1])
        assert (max(ks) == 0) == lagging, ks


# the shipped pair's costs at batch 1 (ms): the target's forward over 1..9 tokens; a draft level costs 1.6
PAIR_COSTS = [6.4, 8.5, 9.1, 10.5, 11.2, 11.8, 12.0, 12.0, 12.0]


def test_a_call_after_a_short_one_that_rejected_a_draft_still_learns_that_drafting_pays():
    """The CLI's case: a warm-up of 4 tokens whose one drafted step had its first level rejected, then a call whose
    drafts are all accepted, where drafting 8 levels is 2.5x faster. The prior (that rejection, the initial guess as 4
    judgments: 0.48) says plain decoding. A probe tests for the best case where few judgments stand behind the prior
    (every draft accepted): the first step probes, a probe whose drafts were all accepted is repeated at once, and
    the call drafts 8 levels within a few steps. Negative control: probes testing for the prior's rates (as before)
    never come, and the call decodes plainly throughout (on the real pair, 108 steps of 133 in one CLI run)."""
    def call(usual_is_prior):
        warm_up = AdaptiveDepth(1, 8, PAIR_COSTS)
        warm_up.drafted(1, 2.4)
        warm_up.update([0], 1, [True], PAIR_COSTS[1] + 2.4)
        policy = AdaptiveDepth(1, 8, PAIR_COSTS, previous=warm_up)
        if usual_is_prior:
            policy._usual_tokens = _expected_tokens(policy.stats.prior[None])
        ks, left = [], 256
        while left > 0:
            k = policy.choose([True], [left])
            if k:
                policy.drafted(k, 1.6 * k)
            policy.update([k], k, [True], PAIR_COSTS[k] + 1.6 * k)
            ks.append(k)
            left -= k + 1
        return ks
    ks = call(False)
    # (one plain step among the drafted ones: a plain step's cost is measured after probe_every drafted steps)
    assert min(ks[:5]) > 0 and ks[5:].count(8) >= len(ks[5:]) - 2 and len(ks) < 45, ks
    assert max(call(True)) == 0


def test_a_call_after_one_that_ended_on_a_hard_passage_drafts_from_its_first_steps():
    """A request whose drafts were all accepted for 36 steps, then rejected at the first level for its last 20 (a hard
    passage: sampled at T=0.8, the real pair's first level was accepted 0.6 of the time over a request's last ten
    judgments where it was 0.82 over the call). The next call's prior is the mean of all the judgments, 36 / 56 (the
    initial guess weighing as 4 judgments more than their recent weight, 10), so it drafts from its first steps.
    Negative control: the prior from the recent judgments (the decayed counts, as before) says 0.25 at depth 1, where
    drafting does not pay even in a probe's eyes, and the next call decodes plainly throughout (on the real pair:
    whole 128-token calls, in one of six runs of 4 prompts)."""
    def next_call(prior_from_recent):
        first = AdaptiveDepth(1, 8, PAIR_COSTS)
        first.drafted(8, 1.6 * 8)
        for n in [8] * 36 + [0] * 20:
            first.update([n], 8, [True], PAIR_COSTS[8] + 1.6 * 8)
        if prior_from_recent:
            first.stats.total_hits, first.stats.total_weight = first.stats.hits, first.stats.weight
        policy = AdaptiveDepth(1, 8, PAIR_COSTS, previous=first)
        ks = []
        for _ in range(40):
            k = policy.choose([True], [1000])
            if k:
                policy.drafted(k, 1.6 * k)
            policy.update([min(k, 6)], k, [True], PAIR_COSTS[k] + 1.6 * k)  # (acceptance as the first call's)
            ks.append(k)
        return policy.stats.prior, ks
    prior, ks = next_call(False)
    assert 0.62 < prior[0] < 36 / 56 and prior[1] > 0.85  # (the initial guess, 0.6, as 4 judgments)
    assert min(ks[:3]) > 0 and ks.count(0) <= 2, ks
    prior, ks = next_call(True)
    assert prior[0] < 0.3 and max(ks) == 0, ks


def test_target_costs_are_measured_once_and_grow_with_tokens(pair):
    target, _ = pair
    costs = measure_target_costs(target, 2, 4, context=16, repeats=1)
    assert len(costs) == 4 and all(c > 0 for c in costs) and costs == sorted(costs)
    assert measure_target_costs(target, 2, 4, context=16, repeats=1) is costs


def test_a_pause_of_the_machine_raises_no_target_cost(pair, monkeypatch):
    """A pause as long as `repeats` forwards, wherever it falls among the timed runs, raises no cost: the runs go
    round the token counts, so that it slows one run of each of a few counts, not every run of one (counts are kept
    non-decreasing, so that raised every larger count too: [5.5, 9.8, 9.8, ...] ms at one CLI start-up)."""
    import time
    from specdec.loop import adaptive
    target, _ = pair
    forward, calls, pause = target._forward_cached, [], 0.03

    def paused(*args):
        calls.append(1)
        if start <= len(calls) < start + 3:
            time.sleep(pause)
        return forward(*args)
    monkeypatch.setattr(target, "_forward_cached", paused)
    for start in range(1, 4 * 4 + 1):  # (4 token counts, a warm-up run and 3 timed runs each)
        monkeypatch.setattr(adaptive, "_TARGET_COSTS", {})
        calls.clear()
        costs = measure_target_costs(target, 1, 4, context=16, repeats=3)
        assert len(calls) == 16 and max(costs) < pause, (start, costs)


def test_compiled_depth_ladder():
    assert compiled_depths(8) == [0, 1, 2, 4, 8] and compiled_depths(6) == [0, 1, 2, 4, 6]
    assert compiled_depths(1) == [0, 1] and compiled_depths(2) == [0, 1, 2]


def test_policy_chooses_only_its_depths():
    """Drafts always accepted, verification cheap: the best depth would be 6, the deepest offered is 4; at a batch
    that saturates compute it is still 0. The probe after idle steps drafts an offered depth too."""
    costs = [1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3]
    policy = AdaptiveDepth(1, 6, costs, depths=[0, 1, 4])
    policy.drafted(2, 0.1)
    for _ in range(20):
        k = policy.choose([True])
        assert k in (0, 1, 4)
        policy.update([k], k, [True], 1.0 + 0.05 * k)
    assert k == 4 and policy.chosen[6] == policy.chosen[5] == 0
    idle = AdaptiveDepth(1, 6, costs, depths=[0, 2, 5], probe_every=4)
    idle.drafted(1, 0.05)
    ks = []
    for _ in range(64):
        ks.append(idle.choose([True]))
        idle.update([0], ks[-1], [True], 1.0 + 0.1 * ks[-1])  # nothing accepted: plain decoding, probing
    assert set(ks) <= {0, 2, 5} and ks[-40:].count(0) >= 30 and any(k > 0 for k in ks[-40:])
    for bad in ([1, 2], [0], [0, 7]):
        with pytest.raises(ValueError, match="depths"):
            AdaptiveDepth(1, 6, costs, depths=bad)


def test_target_costs_compiled_and_for_some_token_counts(pair):
    """compiled: the forward is timed through torch.compile, as a compiled loop runs it; token counts not timed
    get a cost interpolated between the timed ones (a host drafter's verification may have any width)."""
    from torch._dynamo.utils import counters
    target, _ = pair
    counters.clear()
    costs = measure_target_costs(target, 3, 5, context=16, repeats=1, compiled=True, tokens=[1, 3])
    assert counters["stats"]["unique_graphs"] == 3  # t = 1, 3 and 5 (max_tokens)
    assert len(costs) == 5 and all(c > 0 for c in costs) and costs == sorted(costs)
    np.testing.assert_allclose([costs[1], costs[3]], [(costs[0] + costs[2]) / 2, (costs[2] + costs[4]) / 2])
    assert measure_target_costs(target, 3, 5, context=16, repeats=1, compiled=True, tokens=[3, 1]) is costs


def test_target_costs_of_a_replayed_loop_are_graph_replays(pair, monkeypatch):
    """A loop that replays its steps as graphs gets the target's costs timed as graph replays: an eager forward's
    host work (here a sleep, as a launch-bound forward of a small model on a GPU) is not in them, and each count's
    graph is captured once, after an eager warm-up. The decoder asks for them so."""
    import time
    from helpers import ReplayGraph
    from specdec.loop import adaptive
    target, draft = pair
    forward, calls, captured = target._forward_cached, [], []

    def slow(*args):
        calls.append(1)
        time.sleep(0.02)
        return forward(*args)

    class Counted(ReplayGraph):
        def __init__(self, fn, pool=None):
            captured.append(1)
            super().__init__(fn, pool)
    monkeypatch.setattr(target, "_forward_cached", slow)
    monkeypatch.setattr(adaptive, "_TARGET_COSTS", {})
    replayed = measure_target_costs(target, 2, 3, context=16, repeats=2, graph_class=Counted)
    assert len(captured) == 3 and len(calls) == 3 + 3  # (t = 1, 2, 3: a warm-up and the capture each)
    assert len(replayed) == 3 and max(replayed) < 0.02
    assert min(measure_target_costs(target, 2, 3, context=16, repeats=2)) >= 0.02  # eager: the host work counts
    monkeypatch.setattr(target, "_forward_cached", forward)
    SpeculativeDecoder(target, DraftModelDrafter(draft, "chain:2"), adaptive=True,
                       cuda_graphs=ReplayGraph).generate(PROMPTS, 4)
    assert [key[-1] for key in adaptive._TARGET_COSTS][-1] is ReplayGraph


# ----------------------------------------------------------------------------------------------
# the loop with every kind of step: outputs, caches, laws
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1", "dynamic:7,3,2"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_greedy_with_skipped_and_shallow_steps_equals_ar(pair, tree, block_size):
    target, draft = pair
    ar = generate_ar(target, PROMPTS4, 20)
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), block_size=block_size,
                             adaptive=scripted((0, 2, 0, 0, 9, 1, 0, 3))).generate(PROMPTS4, 20)
    assert out.tokens == ar.tokens
    chosen = out.summary["depth_chosen"]
    assert chosen[0] > 0 and chosen[1] > 0 and chosen[-1] > 0


@pytest.mark.parametrize("tree", ["chain:4", "tree:2,2,1", "dynamic:7,3,2"])
def test_greedy_mtp_with_skipped_steps_equals_ar(target_and_mtp, tree):
    target, mtp = target_and_mtp
    ar = generate_ar(target, PROMPTS4, 20)
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, tree),
                             adaptive=scripted((0, 0, 0, 2, 0, 9, 1))).generate(PROMPTS4, 20)
    assert out.tokens == ar.tokens


def test_greedy_ngram_adaptive_equals_ar(pair):
    target, _ = pair
    ar = generate_ar(target, PROMPTS4, 24)
    for adaptive in (scripted((0, 3, 0, 8, 1)), True):
        assert SpeculativeDecoder(target, NgramDrafter(8), adaptive=adaptive).generate(PROMPTS4, 24).tokens == ar.tokens


def test_pending_width_after_skips_takes_two_values(pair, target_and_mtp):
    """A depth's graphs: one without skipped steps before it, one after any run of them (1 to MAX_SKIPS), so that
    an adaptive compiled loop does not meet a new graph for each run length."""
    from specdec.loop.drafters.base import MAX_SKIPS
    for target, drafter in ((pair[0], DraftModelDrafter(pair[1], "chain:3")),
                            (target_and_mtp[0], MTPDrafter(*target_and_mtp, "chain:3"))):
        SpeculativeDecoder(target, drafter).generate(PROMPTS[:1], 2)  # (a started drafter)
        drafter.few_shapes = True  # (as a compiled or captured loop sets it)
        keys = []
        for run in (0, 1, 3, MAX_SKIPS, 0):
            for _ in range(run):
                drafter.advance(0)
            drafter.advance(2)
            keys.append(drafter.graph_key())
        wide = (drafter.min_pending + MAX_SKIPS,)
        assert keys == [(drafter.min_pending,), wide, wide, wide, (drafter.min_pending,)]
        if isinstance(drafter, MTPDrafter):  # (its loop drafts after MAX_SKIPS plain steps)
            with pytest.raises(ValueError, match="depth"):
                for _ in range(MAX_SKIPS + 1):
                    drafter.advance(0)
        else:  # the draft model's cache lags: caught up before the next proposal, whose graph is the narrow one
            for _ in range(MAX_SKIPS + 1):
                drafter.advance(0)
            assert drafter.lagging and not drafter.catching_up
            drafter.advance(2)
            assert drafter.graph_key() == (drafter.min_pending,) and drafter.catching_up


def test_eager_mtp_runs_only_the_pending_entries_its_last_depth_left(target_and_mtp, monkeypatch):
    """MTP's pending entries are the last drafted step's accepted path and bonus token: an eager loop runs as many as
    that step's depth + 1 (plus the padding of the skipped steps' after a run of them), not the deepest step's
    always; output AR's (the heads' cache after such steps is checked in test_mtp_cache_after_skipped_steps...)."""
    from specdec.loop.drafters.base import MAX_SKIPS
    target, mtp = target_and_mtp
    drafter = MTPDrafter(target, mtp, "chain:3")
    widths = []
    root_logits = MTPDrafter._root_logits

    def recording(self, tokens, seq_lens):
        widths.append(self.pending_width)
        return root_logits(self, tokens, seq_lens)

    monkeypatch.setattr(MTPDrafter, "_root_logits", recording)
    out = SpeculativeDecoder(target, drafter, adaptive=scripted((3, 1, 0, 0, 2, 3, 3))).generate(PROMPTS[:1], 24)
    assert out.tokens == generate_ar(target, PROMPTS[:1], 24).tokens
    assert widths[:6] == [1, 4, 2 + MAX_SKIPS, 3, 4, 4]


@pytest.mark.parametrize("kind", ["draft", "mtp", "ngram"])
def test_compiled_steps_of_every_depth_equal_ar(pair, target_and_mtp, kind):
    """compile=True with skipped and shallow steps: one graph per depth and drafter state (the draft model's
    pending width after skips, MTP's pending entries; prompt lookup's verification alone), greedy == AR."""
    from torch._dynamo.utils import counters
    target = pair[0] if kind != "mtp" else target_and_mtp[0]
    drafter = {"draft": lambda: DraftModelDrafter(pair[1], "chain:3"), "ngram": lambda: NgramDrafter(3),
               "mtp": lambda: MTPDrafter(target, target_and_mtp[1], "chain:3")}[kind]()
    counters.clear()
    out = SpeculativeDecoder(target, drafter, compile=True, adaptive=scripted((0, 2, 0, 0, 1))).generate(PROMPTS4, 12)
    assert out.tokens == generate_ar(target, PROMPTS4, 12).tokens
    assert min(out.summary["depth_chosen"][:3]) > 0
    assert counters["stats"]["unique_graphs"] >= 3


def test_steps_that_compile_or_capture_are_not_timed(pair):
    """The policy learns no cost from a step that compiled its graph (or warmed up / captured a CUDA graph):
    compile time would poison the cost model. Later steps of the same depth are timed."""
    from helpers import ReplayGraph
    for kw in ({"compile": True}, {"cuda_graphs": ReplayGraph}):
        seen = []

        class Recording(Scripted):
            def update(self, num_accepted, depth, live, seconds, drafting_timed=True):
                seen.append(seconds)

        # (a batch size and tree no other test compiles: the graphs are shared by every decoder in the process)
        SpeculativeDecoder(pair[0], DraftModelDrafter(pair[1], "parents:-1,0,1,1"), **kw,
                           adaptive=lambda B, K, dev: Recording(B, K, dev, (2,))).generate(PROMPTS + [[4, 4], [9]], 10)
        untimed = 1 if "compile" in kw else 2  # (graphs: the eager warm-up and the capture)
        assert seen[:untimed] == [None] * untimed and all(s is not None for s in seen[untimed:]) and len(seen) > 3


def test_a_step_that_catches_up_on_skipped_ones_is_not_timed(pair):
    """The draft model's first proposal after plain steps (or the prompts) runs their tokens through the draft first:
    a one-off cost, not what its depth costs, so the policy learns no time from it (prompt lookup has nothing to
    catch up on). The
    policy is told each request's tokens still to emit, and the depths it ran are counted."""
    target, draft = pair
    script = (2, 0, 0, 2, 2, 1, 0, 3)
    for drafter, catches_up in ((DraftModelDrafter(draft, "chain:3"), True), (NgramDrafter(3), False)):
        seen, told, caught = [], [], []

        class Recording(Scripted):
            def caught_up(self, depth, seconds):
                caught.append((len(seen), depth, seconds))

            def choose(self, live, remaining=None, available=None, lagging=False):
                told.append([r for r, alive in zip(remaining, live) if alive])
                return super().choose(live)

            def update(self, num_accepted, depth, live, seconds, drafting_timed=True):
                seen.append((depth, seconds))

        out = SpeculativeDecoder(target, drafter, adaptive=lambda B, K, dev: Recording(B, K, dev, script)).generate(
            PROMPTS, 16)
        untimed = [prev == 0 and depth > 0 and catches_up for (prev, _), (depth, _) in zip(seen, seen[1:])]
        # (the first step: the draft model's catch-up on the prompts, its cache filled lazily)
        assert [s is None for _, s in seen] == [catches_up] + untimed and any(untimed) == catches_up
        # (the prompts' catch-up: the first step, drafted, told its time; steps after skips only run pending entries)
        assert [(i, d) for i, d, _ in caught] == ([(0, 2)] if catches_up else []) and all(t > 0 for *_, t in caught)
        assert told[0] == [16] * len(PROMPTS) and all(r > 0 for rem in told for r in rem)
        assert sum(told[-1]) <= len(told[-1]) * 4  # (the last step emits at most depth + 1 = 4 tokens each)
        assert out.tokens == generate_ar(target, PROMPTS, 16).tokens


def test_only_mtp_is_made_to_draft_after_max_skips(pair, target_and_mtp):
    """MTP's entries of skipped steps are the target's hidden states then, kept for MAX_SKIPS steps: the loop drafts
    one level after that many plain steps in a row. The draft model catches up on any number (catch_up) and prompt
    lookup keeps nothing in sync: they decode plainly as long as the policy says."""
    from specdec.loop.drafters.base import MAX_SKIPS
    for target, drafter, ran in ((pair[0], NgramDrafter(3), [0] * (MAX_SKIPS + 1)),
                                 (pair[0], DraftModelDrafter(pair[1], "chain:3"), [0] * (MAX_SKIPS + 1)),
                                 (target_and_mtp[0], MTPDrafter(*target_and_mtp, "chain:3"), [0] * MAX_SKIPS + [1])):
        seen = []

        class Recording(Scripted):
            def update(self, num_accepted, depth, live, seconds, drafting_timed=True):
                seen.append(depth)

        out = SpeculativeDecoder(target, drafter, adaptive=lambda B, K, dev: Recording(B, K, dev, (0,))).generate(
            PROMPTS, MAX_SKIPS + 4)
        assert seen[:MAX_SKIPS + 1] == ran
        assert out.tokens == generate_ar(target, PROMPTS, MAX_SKIPS + 4).tokens


def test_depth_chosen_counts_the_steps_run():
    """The loop may run another depth than the policy chose (a plain step after MAX_SKIPS of them drafts one level):
    depth_chosen counts the depths run."""
    policy = AdaptiveDepth(1, 2, [1.0, 1.1, 1.2])
    policy.update([0], 0, [True], 1.0)
    policy.update([1], 1, [True], 1.1)
    assert policy.chosen == [1, 1, 0]


@pytest.mark.parametrize("script", [(0, 0, 3, 0, 0, 0, 1), (0,) * 20 + (3, 0, 0, 1)])
def test_draft_cache_after_skipped_steps_equals_a_fresh_prefill(pair, script):
    """Skipped steps' tokens reach the draft's cache with the next proposal (3 skips: 6 pending entries for 5, one
    of them padding), or after more than MAX_SKIPS of them (and the prompts, in an adaptive loop) with catch_up
    before it: after a run whose last steps were skipped and drafted in turn, the draft's committed K/V equal a
    prefill of the committed tokens."""
    target, draft = pair
    drafter = DraftModelDrafter(draft, "chain:3")
    out = SpeculativeDecoder(target, drafter, adaptive=scripted(script)).generate(PROMPTS, 17 + script.count(0))
    assert out.tokens == generate_ar(target, PROMPTS, 17 + script.count(0)).tokens
    for b, prompt in enumerate(PROMPTS):
        n = int(drafter.cache.lens[b])
        seq = torch.tensor([(prompt + out.tokens[b])[:n]])
        fresh = draft.new_cache(1, n + 1)
        draft.prefill(fresh, seq, torch.tensor([n], dtype=torch.int32))
        assert n >= len(prompt)
        torch.testing.assert_close(drafter.cache.k[:, b, :n], fresh.k[:, 0, :n], atol=1e-5, rtol=1e-5)


def test_an_adaptive_loop_that_never_drafts_never_runs_the_draft(pair):
    """The draft model's cache is filled lazily: with every step plain (a batch that saturates compute), the draft
    never sees a token, so plain decoding costs what AR does (no draft prefill); a fixed-depth loop prefills it with
    the prompts, before the first step (prompt_s)."""
    target, draft = pair
    drafter = DraftModelDrafter(draft, "chain:3")
    out = SpeculativeDecoder(target, drafter, adaptive=scripted((0,))).generate(PROMPTS, 20)
    assert out.summary["depth_chosen"][0] == out.summary["steps"] and int(drafter.cache.lens.max()) == 0
    assert out.tokens == generate_ar(target, PROMPTS, 20).tokens
    fixed = DraftModelDrafter(draft, "chain:3")
    decoder = SpeculativeDecoder(target, fixed)
    decoder._start(PROMPTS, 4, 0.0, 0, top_k=0, top_p=1.0, min_p=0.0, allowed_token_ids=None)
    assert not fixed.lagging and fixed.cache.lens.tolist() == [len(p) - 1 for p in PROMPTS]


def test_mtp_cache_after_skipped_steps_equals_a_fresh_run(target_and_mtp):
    target, mtp = target_and_mtp
    drafter = MTPDrafter(target, mtp, "chain:3")
    out = SpeculativeDecoder(target, drafter, adaptive=scripted((0, 0, 3, 0, 1, 0, 0, 0, 2))).generate(PROMPTS, 20)
    assert_heads_cache_matches_a_fresh_run(target, mtp, drafter, "chain:3", PROMPTS, out.tokens)


def test_sampling_with_skipped_and_shallow_steps_is_lossless(target_and_mtp):
    """The first two tokens at T=1 follow the target's law when steps draft 2, 0, 1, ... levels."""
    target, mtp = target_and_mtp
    prompt, n = [3, 9, 4, 1], 800
    out = SpeculativeDecoder(target, MTPDrafter(target, mtp, "chain:3"), adaptive=scripted((2, 0, 1))).generate(
        [prompt] * n, 3, 1.0, seed=list(range(300, 300 + n)))
    law = exact_filtered_two_token_law(target, prompt, 1.0)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 5 and stat < threshold, stat


def test_sampled_levels_are_judged_by_their_acceptance_probabilities():
    """The judged levels (up to the first rejected one) count their acceptance probabilities where given (sampled
    requests) and their accept/reject outcomes where NaN (greedy ones); the levels after a rejection are not judged."""
    stats = AcceptanceStats(3, 3, decay=0.5)
    probs = np.array([[0.9, 0.3, 0.8], [np.nan] * 3, [0.6, 0.2, 0.7]])
    stats.update([1, 1, 3], depth=3, live=[True, True, False], acceptance=probs)
    np.testing.assert_allclose(stats.hits, [[0.9, 0.3, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(stats.weight, [[1, 1, 0], [1, 1, 0], [0, 0, 0]])


class Recording(Scripted):
    """A scripted policy that keeps the acceptance probabilities the loop reports."""

    def update(self, num_accepted, depth, live, seconds, drafting_timed=True, acceptance=None):
        super().update(num_accepted, depth, live, seconds, drafting_timed, acceptance)
        if acceptance is not None:
            assert depth > 0
            self.reports = getattr(self, "reports", []) + [(list(num_accepted), depth, acceptance.copy())]


@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
def test_a_sampled_adaptive_loop_judges_chain_levels_by_their_acceptance_probabilities(pair, replayed):
    """The draft model is the target itself and samples from the same law: p = q, so every level's acceptance
    probability is 1, for the sampled requests; greedy ones (and a padding row) report NaN (their outcomes count),
    and a batch without sampled requests or a drafter of trees reports none. Replayed (CUDA-graph semantics,
    emulated), the probabilities come out of the recorded step. (compile=True traces the same step.)"""
    from helpers import ReplayGraph
    target = pair[0]
    policies = []

    def decoder(drafter_tree, script=(2, 0, 3, 1)):
        def make(B, K, dev):
            policies.append(Recording(B, K, dev, script))
            return policies[-1]
        return SpeculativeDecoder(target, DraftModelDrafter(target, drafter_tree), adaptive=make,
                                  cuda_graphs=ReplayGraph if replayed else None)

    decoder("chain:3").generate(PROMPTS, 16, temperature=[0.9, 0.0, 1.2], seed=7)
    reports = policies[-1].reports
    assert len(reports) >= 5 and {depth for _, depth, _ in reports} == {1, 2, 3}
    for _, depth, acceptance in reports:
        assert acceptance.shape == (4 if replayed else 3, 3)  # (replayed: a batch bucket of 4)
        np.testing.assert_allclose(acceptance[[0, 2], :depth], 1.0, rtol=1e-5)  # (up to rounding: two forwards)
        assert np.isnan(acceptance[1]).all() and np.isnan(acceptance[3:]).all()
    decoder("chain:3").generate(PROMPTS, 10)
    decoder("tree:2,1").generate(PROMPTS, 10, temperature=1.0)
    assert not hasattr(policies[-2], "reports") and not hasattr(policies[-1], "reports")


def test_ngram_proposals_are_as_wide_as_their_longest_match():
    drafter = NgramDrafter(num_tokens=6)
    lens = torch.tensor([8, 6], dtype=torch.int32)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 9, 1, 2, 0, 0, 0]])
    prop = drafter.propose(tokens[:1], lens[:1], torch.zeros(1))
    assert prop.tokens.tolist() == [[8]] and prop.num_nodes.tolist() == [1]  # no match: the root alone
    for before in (False, True):  # (what depths_available found before the step, propose uses)
        if before:
            assert drafter.depths_available(tokens, lens) == [0, 4]
        prop = drafter.propose(tokens, lens, torch.zeros(2))  # request 1's "1 2" was followed by 3 9 1 2
        assert prop.tokens.tolist() == [[8, 0, 0, 0, 0], [2, 3, 9, 1, 2]] and prop.num_nodes.tolist() == [1, 5]
    prop = drafter.propose(tokens, lens, torch.zeros(2), depth=1)
    assert prop.tokens.tolist() == [[8, 0], [2, 3]] and prop.parents.shape == (2, 2)


@pytest.mark.parametrize("num_tokens,max_ngram,min_ngram", [(8, 3, 1), (3, 2, 2), (1, 4, 1)])
def test_started_prompt_lookup_finds_what_the_scan_finds(num_tokens, max_ngram, min_ngram):
    """A started batch's lookups come from per-request n-gram indexes extended as the sequences grow: the same
    continuations as NgramDrafter.lookup's scan of the whole sequence, on text with many repeats (4 symbols)."""
    gen = torch.Generator().manual_seed(num_tokens)
    B, L = 3, 90
    tokens = torch.randint(0, 4, (B, L), generator=gen)
    lens = torch.tensor([1, 5, 12], dtype=torch.int32)
    drafter = NgramDrafter(num_tokens, max_ngram, min_ngram)
    drafter.start(tokens, lens, L, torch.zeros(B), [0] * B)
    while int(lens.max()) < L:
        if int(lens.sum()) % 2:
            assert drafter.depths_available(tokens, lens) == [
                len(drafter.lookup(tokens[b, :n])) for b, n in enumerate(lens.tolist())]
        prop = drafter.propose(tokens, lens, torch.zeros(B))
        for b, n in enumerate(lens.tolist()):
            want = drafter.lookup(tokens[b, :n]).tolist()
            assert prop.tokens[b, 1:int(prop.num_nodes[b])].tolist() == want and prop.tokens[b, 0] == tokens[b, n - 1]
        lens = (lens + torch.randint(1, 6, (B,), generator=gen, dtype=torch.int32)).clamp(max=L)


def test_adaptive_prompt_lookup_on_text_without_repeats_decodes_plainly():
    """A sampled random model seldom repeats itself: prompt lookup's drafts are rarely accepted and, with
    verification costing 30% more per drafted token (a memory-bound model's, not this tiny one's, whose forward
    is all overhead; the steps' measured times, which would replace those costs, are withheld), the policy spends
    most steps decoding plainly."""
    target = tiny(2, vocab=250)  # nearly uniform over 250 tokens
    prompts = [[int(x) for x in torch.randint(0, target.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(b))]
               for b in range(2)]
    class GivenCosts(AdaptiveDepth):
        def update(self, num_accepted, depth, live, seconds, drafting_timed=True):
            super().update(num_accepted, depth, live, None, drafting_timed)

    costs = lambda B, K, dev: GivenCosts(B, K, [1.0 + 0.3 * k for k in range(K + 1)])  # noqa: E731
    out = SpeculativeDecoder(target, NgramDrafter(8), adaptive=costs).generate(prompts, 60, 1.0, seed=1)
    chosen = out.summary["depth_chosen"]
    assert chosen[0] >= 0.6 * sum(chosen), chosen


def test_cli_tree_auto(capsys, byte_pair):  # noqa: F811
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--target", str(byte_pair / "target"), "--draft",
                         str(byte_pair / "draft"), "--tree", "auto", "--max-new-tokens", "8", "--compare-ar", "--json")
    r = json.loads(out)
    assert rc == 0 and r["adaptive"] and r["identical"] and sum(r["depth_chosen"]) >= 1
    assert len(r["depth_chosen"]) == 9  # auto: chain:8
    rc, out, _ = run_cli(capsys, "--prompt", "def f(x):", "--target", str(byte_pair / "target"), "--draft",
                         str(byte_pair / "draft"), "--tree", "auto", "--max-new-tokens", "8")
    chosen = out.splitlines()[-1]  # (the steps of each depth chosen, as printed)
    assert rc == 0 and chosen.startswith("steps per draft depth chosen")
    steps = int(re.search(r"over (\d+) steps", out).group(1))
    assert sum(int(n) for n in chosen.split("): ")[1].replace(",", "").split()[1::2]) == steps


def test_a_policy_starts_from_what_the_previous_batch_learned():
    first = AdaptiveDepth(2, 3, [1.0, 1.1, 1.2, 1.3])
    first.drafted(2, 0.4)
    for _ in range(20):
        first.update([3, 0], 3, [True, True], 2.0)
    second = AdaptiveDepth(1, 3, [1.0, 1.1, 1.2, 1.3], previous=first)
    assert second.draft_level_s == first.draft_level_s and second.overhead_s == first.overhead_s > 0
    # its prior is the first batch's rates per depth, its judgments weighted (the initial guess as 4 judgments): depth
    # 1 was accepted by one request of two, depths 2 and 3 whenever they were reached
    # (the mean of all 20 steps' judgments, weighed as their recent weight)
    w, mean = first.stats.weight, first.stats.total_hits.sum(0) / first.stats.total_weight.sum(0)
    population = (w.sum(0) * mean + 4 * 0.6) / (w.sum(0) + 4)
    np.testing.assert_allclose(mean, [0.5, 1, 1])
    np.testing.assert_allclose(second.stats.prior, population)
    np.testing.assert_allclose(second.stats.prior_weight, np.minimum(w.sum(0), 20))
    # (a new request: at depth 1 the prior, deeper the prior's ratios, trusted by min(weights) / (min(weights) + 2))
    pw = second.stats.prior_weight
    c = np.minimum(pw[1:], pw[:-1]) / (np.minimum(pw[1:], pw[:-1]) + 2)
    p1 = population[0] * (1 + c[0] * (population[1] / population[0] - 1))
    np.testing.assert_allclose(second.stats.predicted()[0], [population[0], p1, p1])
    assert population[0] < 0.6 < 0.85 < population[1] and population[2] == population[1]
    # a depth no request reached keeps the old prior, with no weight: its ratio to the depth above is not trusted, so
    # it is predicted as the depth above, not as a drop from it to the initial guess
    shallow = AdaptiveDepth(1, 3, [1.0, 1.1, 1.2, 1.3])
    for _ in range(20):
        shallow.update([1], 1, [True], 1.1)
    after = AdaptiveDepth(1, 3, [1.0, 1.1, 1.2, 1.3], previous=shallow)
    np.testing.assert_allclose(after.stats.prior_weight[1:], 0)
    pred = after.stats.predicted()[0]
    judged = shallow.stats.weight[0, 0]
    assert pred[0] == pytest.approx((judged + 4 * 0.6) / (judged + 4)) and pred[0] > 0.85
    assert pred[2] == pred[1] == pytest.approx(pred[0])
    # the step times measured per depth are the batch size's: they carry over to a batch of the same size only
    assert np.isnan(second.measured_s).all() and first.measured_s[3] == 2.0
    third = AdaptiveDepth(2, 3, [1.0, 1.1, 1.2, 1.3], previous=first)
    np.testing.assert_array_equal(third.measured_s, first.measured_s)
    assert third.measured_s is not first.measured_s


def test_a_cold_policy_first_drafts_as_deep_as_its_drafters_prior_says(pair):
    """Without a previous batch, the first choices follow the drafter's prior: the draft model's measured rates
    (0.94 per level) make the deepest chain pay where the guess (0.6) makes a shallow one look best, and prompt
    lookup's (its first level often wrong) lie between."""
    costs = [1.0 + 0.1 * k for k in range(9)]

    def first_choices(prior):
        policy = AdaptiveDepth(1, 8, costs, prior=prior)
        policy.drafted(1, 0.05)
        return [policy.choose([True], [96]) for _ in range(3)]

    draft_model = first_choices(drafter_prior(DraftModelDrafter(pair[1], "chain:8"), 8))
    guess = first_choices(None)
    prompt_lookup = first_choices(drafter_prior(NgramDrafter(8), 8))
    assert draft_model == [8] * 3 and guess == [2] * 3 and all(2 < k < 8 for k in prompt_lookup)


def test_drafter_prior_by_kind_and_depth(pair):
    rates, weight = drafter_prior(NgramDrafter(8), 10)  # deeper than measured: the deepest measured rate
    np.testing.assert_allclose(rates, list(SHIPPED_ACCEPTANCE["NgramDrafter"]) + [0.95] * 7)
    assert (weight > 0).all()
    np.testing.assert_allclose(drafter_prior(SuffixDrafter(4), 2)[0], SHIPPED_ACCEPTANCE["SuffixDrafter"][:2])

    class OtherModel(DraftModelDrafter):  # (another drafter's rates are not the shipped draft model's)
        pass
    rates, weight = drafter_prior(OtherModel(pair[1], "chain:3"), 3)
    assert (rates == 0.6).all() and (weight == 0).all()


def _drafters(pair, target_and_mtp):
    return {"model": lambda: (pair[0], DraftModelDrafter(pair[1], "chain:6")),
            "mtp": lambda: (target_and_mtp[0], MTPDrafter(target_and_mtp[0], target_and_mtp[1], "chain:6")),
            "ngram": lambda: (pair[0], NgramDrafter(6)), "suffix": lambda: (pair[0], SuffixDrafter(6, 10))}


@pytest.mark.parametrize("kind", ["model", "mtp", "ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("block_size", [None, 4])
def test_greedy_adaptive_from_the_drafters_prior_equals_ar(pair, target_and_mtp, kind, batch, block_size):
    """The default policy of a fresh decoder starts from its drafter's prior, and its outputs are AR's."""
    target, drafter = _drafters(pair, target_and_mtp)[kind]()
    prompts = PROMPTS4[:batch]
    decoder = SpeculativeDecoder(target, drafter, adaptive=True, block_size=block_size)
    out = decoder.generate(prompts, 24)
    assert out.tokens == generate_ar(target, prompts, 24).tokens
    cold = SpeculativeDecoder(target, drafter, adaptive=True)._default_policy(batch, 6, target.device)
    np.testing.assert_allclose(cold.stats.prior, drafter_prior(drafter, 6)[0])
    assert sum(out.summary["depth_chosen"][1:]) > 0


@pytest.mark.parametrize("drafter", ["chain:4", "dynamic:7,3,2", "ngram"])
def test_acceptance_rate_by_depth_counts_the_drafts_judged_at_each_depth(pair, drafter, monkeypatch):
    """Of the steps that judged a draft at depth d (their path accepted d - 1 drafts and its last node had a child),
    the fraction that accepted one: recounted from every step's proposal and accepted path, per request and over
    the batch, with plain, shallow and deep steps mixed, chains shorter than the depth asked for (prompt lookup),
    trees with shallow leaves, and requests finishing at different steps."""
    target, _ = pair
    draft = tiny(0)
    with torch.no_grad():  # the target, perturbed: drafts accepted at every depth, not always
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    decoder = SpeculativeDecoder(target, NgramDrafter(4) if drafter == "ngram" else DraftModelDrafter(draft, drafter),
                                 adaptive=scripted((0, 2, 0, 0, 9, 1, 0, 3)))
    steps, accept = [], decoder._accept

    def recording_accept(logits, prop, **kwargs):
        res = accept(logits, prop, **kwargs)
        steps.append((prop.parents.tolist(), prop.num_nodes.tolist(), res.accepted_nodes.tolist(),
                      res.num_accepted.tolist()))
        return res

    monkeypatch.setattr(decoder, "_accept", recording_accept)
    out = decoder.generate(PROMPTS4, 20)
    K = len(out.summary["acceptance_by_depth"])
    accepted_total, judged_total = np.zeros(K + 1, int), np.zeros(K + 1, int)
    for b, stats in enumerate(out.stats):
        accepted, judged = np.zeros(K + 1, int), np.zeros(K + 1, int)
        for parents, num_nodes, path, num_accepted in steps[:stats["steps"]]:  # (a finished request's steps end)
            n = num_accepted[b]
            children = [i for i in range(1, num_nodes[b]) if parents[b][i] == path[b][n]]
            accepted[1:n + 1] += 1
            judged[1:n + 1 + bool(children)] += 1
        assert stats["judged_by_depth"] == judged[1:].tolist()
        assert stats["acceptance_rate_by_depth"] == [round(a / j, 4) if j else None
                                                     for a, j in zip(accepted[1:], judged[1:])]
        accepted_total += accepted
        judged_total += judged
    assert out.summary["judged_by_depth"] == judged_total[1:].tolist()
    assert out.summary["acceptance_rate_by_depth"] == [round(a / j, 4) if j else None
                                                       for a, j in zip(accepted_total[1:], judged_total[1:])]
    # drafts were judged at every depth, the deepest on fewer steps (plain and shallow steps judge nothing there)
    assert 0 < judged_total[K] < judged_total[1] < sum(s["steps"] for s in out.stats)


def test_one_forward_proposals_cost_the_same_at_every_depth():
    """A parallel drafter (one forward drafts every level): its proposals' measured cost is one unit for any depth,
    so a deep draft costs no more than a shallow one, and with the same acceptance and a costly draft forward the
    policy drafts deeper than for a drafter paying per level. Both learn the same seconds per proposal here."""
    target_s = [1.0, 1.02, 1.04, 1.06, 1.08, 1.10, 1.12, 1.14, 1.16]
    per_level = AdaptiveDepth(1, 8, target_s, prior=(np.full(8, 0.8), np.full(8, 8.0)))
    one_forward = AdaptiveDepth(1, 8, target_s, prior=(np.full(8, 0.8), np.full(8, 8.0)), one_forward_proposals=True)
    for policy in (per_level, one_forward):
        policy.drafted(4, 0.4)  # a depth-4 proposal took 0.4 s
    np.testing.assert_allclose(one_forward.step_s()[1:] - np.asarray(target_s[1:]), 0.4)
    np.testing.assert_allclose(per_level.step_s()[1:] - np.asarray(target_s[1:]), 0.1 * np.arange(1, 9))
    assert one_forward.choose([True]) == 8 > per_level.choose([True])
