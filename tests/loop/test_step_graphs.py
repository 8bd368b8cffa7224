"""The loop's step as a replayed graph (SpeculativeDecoder(cuda_graphs=...)), emulated on the CPU by
helpers.ReplayGraph (CUDA-graph semantics: one recording, replays with no Python): the step has no host read, and
every state it carries across steps lives in buffers written in place, for every drafter and kind of step. On a GPU,
bench/gpu.sh runs tests/backends/test_cuda.py's real CUDA-graph test."""
from __future__ import annotations

import pytest
import torch

from specdec.loop import decoding
from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import DraftModelDrafter, MTPDrafter, NgramDrafter

from helpers import ReplayGraph
from test_adaptive import PROMPTS4, scripted
from test_loop import PROMPTS, pair, tiny  # noqa: F401
from test_mtp import target_and_mtp  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingGraph(ReplayGraph):
    made = replays = 0

    def __init__(self, fn, pool=None):
        CountingGraph.made += 1
        super().__init__(fn, pool)

    def replay(self):
        CountingGraph.replays += 1
        super().replay()


def drafter_of(kind, pair, target_and_mtp):
    """The draft model is the target itself: a perfect draft, so any stale drafter state shows as rejections."""
    target = target_and_mtp[0] if kind.startswith("mtp") else pair[0]
    name, _, tree = kind.partition(" ")
    if name == "ngram":
        return target, NgramDrafter(4)
    if name == "mtp":
        return target, MTPDrafter(target, target_and_mtp[1], tree)
    return target, DraftModelDrafter(target, tree)


@pytest.mark.parametrize("kind", ["draft chain:3", "draft tree:2,2,1", "draft dynamic:7,3,2", "mtp chain:3", "ngram"])
def test_replayed_steps_equal_eager_steps_with_every_kind_of_step(pair, target_and_mtp, kind):
    """Replayed steps (skipped, shallow and full ones, a one-token prompt) give AR's greedy output and, what a
    stale drafter state would change, the eager loop's steps and acceptance; each key's first step ran eagerly,
    its second was recorded, later ones replayed."""
    target, drafter = drafter_of(kind, pair, target_and_mtp)
    script = (0, 2, 0, 0, 9, 1, 0, 3)
    eager = SpeculativeDecoder(target, drafter, adaptive=scripted(script)).generate(PROMPTS4, 24)
    CountingGraph.made = CountingGraph.replays = 0
    out = SpeculativeDecoder(target, drafter, cuda_graphs=CountingGraph, adaptive=scripted(script)).generate(PROMPTS4, 24)
    assert out.tokens == eager.tokens == generate_ar(target, PROMPTS4, 24).tokens
    assert [(s["acceptance_by_depth"], s["judged_by_depth"]) for s in out.stats] == \
        [(s["acceptance_by_depth"], s["judged_by_depth"]) for s in eager.stats]
    assert out.summary["steps"] == eager.summary["steps"]
    assert CountingGraph.made >= 2 and CountingGraph.replays >= 3


OTHER_PROMPTS4 = [[9, 8, 7, 6, 5, 4], [2, 7, 1, 8], [3, 3, 3], [6, 1]]  # (PROMPTS4's batch and cache buckets)


@pytest.mark.parametrize("kind", ["draft chain:3", "mtp chain:3", "ngram"])
def test_graphs_are_kept_for_later_calls_of_the_same_shape(pair, target_and_mtp, kind):
    """A later generate call of the same batch shape replays the graphs an earlier one captured (none is made), on
    the buffers they read, which take its own prompts and drafter state: its output and acceptance are a fresh
    eager loop's (a stale drafter state would change the acceptance, a stale batch the tokens). Another shape
    (max_new_tokens) gets graphs of its own, and the first shape's are still there after it and a sampled call."""
    target, drafter = drafter_of(kind, pair, target_and_mtp)
    script = (0, 2, 0, 0, 9, 1, 0, 3)

    def eager(prompts, n, **kw):
        return SpeculativeDecoder(target, drafter, adaptive=scripted(script)).generate(prompts, n, **kw)

    decoder = SpeculativeDecoder(target, drafter, cuda_graphs=CountingGraph, adaptive=scripted(script))
    # (a key's first step runs eagerly and its second is captured, maybe in a later call: prompt lookup's keys are
    # its proposals' widths, which each prompt's matches set)
    first = [decoder.generate(prompts, 24) for prompts in (PROMPTS4, OTHER_PROMPTS4) * 2][0]
    made = CountingGraph.made
    for prompts in (PROMPTS4, OTHER_PROMPTS4):
        CountingGraph.replays = 0
        out = decoder.generate(prompts, 24)
        expected = eager(prompts, 24)
        assert out.tokens == expected.tokens == generate_ar(target, prompts, 24).tokens
        assert [(s["acceptance_by_depth"], s["judged_by_depth"]) for s in out.stats] == \
            [(s["acceptance_by_depth"], s["judged_by_depth"]) for s in expected.stats]
        assert CountingGraph.made == made and CountingGraph.replays == out.summary["steps"]
        if prompts is PROMPTS4:
            assert out.tokens == first.tokens
    out = decoder.generate(OTHER_PROMPTS4[:3], 20)  # (3 requests: the same batch bucket, another max_new)
    assert out.tokens == generate_ar(target, OTHER_PROMPTS4[:3], 20).tokens and CountingGraph.made > made
    made = CountingGraph.made
    sampled = dict(temperature=[0.8, 0.0, 1.0, 0.7], seed=5)  # (the model drafters' steps branch on it)
    assert decoder.generate(PROMPTS4, 24, **sampled).tokens == eager(PROMPTS4, 24, **sampled).tokens
    made = CountingGraph.made
    assert decoder.generate(OTHER_PROMPTS4, 24).tokens == eager(OTHER_PROMPTS4, 24).tokens
    assert CountingGraph.made == made


@pytest.mark.parametrize("kind", ["draft tree:2,2,1", "draft dynamic:7,3,2", "mtp chain:3", "mtp dynamic:7,3,2"])
def test_the_second_call_of_a_shape_replays_the_first_calls_graphs(pair, target_and_mtp, kind):
    """A model drafter's state signs alike at the start of every call, whether a call ran before or not: the second
    call of a shape finds the first's graph set (the MTP drafter's step values, set as a step goes, made a second
    set and its captures, inside the run that a benchmark's warm-up was to warm). Its cache is the first call's,
    emptied (KVCache.reused: not a new one that the kept graphs' would be overwritten with)."""
    target, drafter = drafter_of(kind, pair, target_and_mtp)
    decoder = SpeculativeDecoder(target, drafter, cuda_graphs=CountingGraph, adaptive=scripted((2, 0, 3)))
    decoder.generate(PROMPTS4, 16)
    made, cache = CountingGraph.made, drafter.cache
    assert decoder.generate(OTHER_PROMPTS4, 16).tokens == generate_ar(target, OTHER_PROMPTS4, 16).tokens
    assert len(decoder.steps.graph_sets) == 1 and CountingGraph.made == made and drafter.cache is cache


def test_a_later_calls_allowed_tokens_reach_the_kept_graphs(pair):
    """allowed_token_ids is per call: a later call of the same shape with other allowed tokens decodes with them (its
    bitmask was an expanded view, which a kept set's buffers take as a constant, and the first call's mask stayed)."""
    target, drafter = drafter_of("draft chain:3", pair, None)
    decoder = SpeculativeDecoder(target, drafter, cuda_graphs=CountingGraph)
    for allowed in (range(0, 24, 2), range(1, 24, 3)):  # (the tiny pair's vocabulary: 24)
        out = decoder.generate(PROMPTS4, 12, allowed_token_ids=allowed)
        assert out.tokens == generate_ar(target, PROMPTS4, 12, allowed_token_ids=allowed).tokens
        assert all(t in allowed for seq in out.tokens for t in seq)
    assert len(decoder.steps.graph_sets) == 1


def test_a_rollback_plan_signs_as_its_caches_do():
    """A RollbackPlan's device table holds its caches' addresses (Triton's: an anchor and offsets from it): not state
    to sign or copy. Two caches of one shape at other distances sign alike, and only their own tensors are listed (a
    kept set's graphs run its own plan on its own caches, which take the new values)."""
    import specdec
    states, lists = [], []
    for gap in (0, 37):
        memory = torch.zeros(2 * 256 + gap)
        k = memory[:256].view(2, 2, 8, 2, 4)
        v = memory[256 + gap:].view(2, 2, 8, 2, 4)
        plan = specdec.RollbackPlan(k, v, backend="triton")  # (its table built on the CPU; nothing launched)
        assert plan._tables is not None
        lists.append([])
        states.append(decoding._state_signature({"k": k, "v": v, "plan": plan}, lists[-1]))
    assert states[0] == states[1] and [len(t) for t in lists] == [2, 2]


def test_only_the_most_recent_graph_sets_are_kept(pair, target_and_mtp, monkeypatch):
    """With room for one batch shape, a call of another shape drops the first's graphs (and its cache): the first
    shape's next call captures again, and its output is still AR's."""
    monkeypatch.setattr(decoding, "KEPT_GRAPH_SETS", 1)
    target, drafter = drafter_of("mtp chain:3", pair, target_and_mtp)
    decoder = SpeculativeDecoder(target, drafter, cuda_graphs=CountingGraph)
    for n in (12, 12, 10):
        decoder.generate(PROMPTS4, n)
    assert len(decoder.steps.graph_sets) == 1
    made = CountingGraph.made
    assert decoder.generate(PROMPTS4, 12).tokens == generate_ar(target, PROMPTS4, 12).tokens
    assert CountingGraph.made > made


def test_state_signature_sees_shapes_python_values_and_sharing():
    """Two states of the same structure, shapes and Python values sign alike and list their tensors in the same
    order (whatever the values); another shape, another Python value (a flag a step branches on), or an object
    shared where the other state has two, signs differently. Modules sign by identity."""
    from types import SimpleNamespace
    module = torch.nn.Linear(2, 2)

    def state(n=3, flag=True, shared=True, width=4):
        cache = SimpleNamespace(k=torch.randn(2, width), lens=torch.zeros(2, dtype=torch.int32))
        return ({"cache": cache, "again": cache if shared else SimpleNamespace(**vars(cache)), "flag": flag,
                 "model": module}, [torch.arange(n), (1, 2.5, "token", None)])

    a_tensors, b_tensors = [], []
    a, b = state(), state()
    assert decoding._state_signature(a, a_tensors) == decoding._state_signature(b, b_tensors)
    assert [t.shape for t in a_tensors] == [t.shape for t in b_tensors] == [(2, 4), (2,), (3,)]
    assert a_tensors[0] is a[0]["cache"].k and b_tensors[2] is b[1][0]
    for other in (state(n=4), state(flag=False), state(shared=False), state(width=5)):
        assert decoding._state_signature(other) != decoding._state_signature(a)
    with_other_module = state()
    with_other_module[0]["model"] = torch.nn.Linear(2, 2)
    assert decoding._state_signature(with_other_module) != decoding._state_signature(a)


def test_a_host_drafters_verification_graphs_are_per_width_whatever_the_depth(pair, monkeypatch):
    """Prompt lookup's proposal is as wide as its longest match, so proposals asked for different depths often have
    the same width: they share one graph (and a fixed loop's graphs serve an adaptive one), so that an adaptive loop
    may choose any depth without a graph per (depth, width). Plain steps have a graph of their own."""
    target = pair[0]
    widths = set()
    propose = NgramDrafter.propose

    def recording(self, tokens, seq_lens, temperature, depth=None):
        prop = propose(self, tokens, seq_lens, temperature, depth)
        widths.add((depth, prop.tokens.shape[1]))
        return prop

    keys = set()
    run = decoding._StepGraphs.run

    def recording_keys(self, key, step):
        keys.add(key)
        return run(self, key, step)

    monkeypatch.setattr(NgramDrafter, "propose", recording)
    monkeypatch.setattr(decoding._StepGraphs, "run", recording_keys)
    prompts = [[1, 2, 3, 4, 5, 6] * 3, [7, 8, 9] * 5, [3, 1, 4, 1, 5, 9, 2, 6]]
    CountingGraph.made = CountingGraph.replays = 0
    out = SpeculativeDecoder(target, NgramDrafter(6), cuda_graphs=CountingGraph,
                             adaptive=scripted((0, 6, 2, 5, 3, 6, 1, 4))).generate(prompts, 40)
    assert out.tokens == generate_ar(target, prompts, 40).tokens
    by_width = {w for _, w in widths}
    assert len(widths) > len(by_width)  # (the case: depths that proposed the same width)
    assert len(keys) == len(by_width) + 1  # (+ the plain steps')
    assert CountingGraph.made > 0 and CountingGraph.replays > 0


def test_replayed_sampling_draws_what_eager_sampling_draws(pair):
    """The draft streams and accept's are keyed by tensors (seeds, counters): a replayed sampled run, paged,
    equals the eager one token for token."""
    target, draft = pair
    kw = dict(temperature=[1.0, 0.0, 0.8], seed=[1, 2, 3], top_k=8)
    eager = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1"), block_size=4).generate(PROMPTS, 16, **kw)
    replayed = SpeculativeDecoder(target, DraftModelDrafter(draft, "tree:2,1"), block_size=4,
                                  cuda_graphs=ReplayGraph).generate(PROMPTS, 16, **kw)
    assert replayed.tokens == eager.tokens


def test_replay_catches_state_replaced_instead_of_written(target_and_mtp, monkeypatch):
    """Negative control of the emulation: an MTP commit that replaces its pending entries (a new tensor) instead
    of writing them into the buffer is right eagerly, but replayed steps read stale entries: the drafts, and so
    the acceptance, change (greedy output never depends on the drafts)."""
    target, mtp = target_and_mtp
    drafter = MTPDrafter(target, mtp, "chain:3")
    good = SpeculativeDecoder(target, drafter, cuda_graphs=ReplayGraph).generate(PROMPTS, 24).summary
    original = MTPDrafter.commit

    def replacing_commit(self, proposal, accepted_nodes, num_accepted, *, target_hidden):
        self.pending = self.pending.clone()
        original(self, proposal, accepted_nodes, num_accepted, target_hidden=target_hidden)

    monkeypatch.setattr(MTPDrafter, "commit", replacing_commit)
    assert SpeculativeDecoder(target, drafter).generate(PROMPTS, 24).summary["acceptance_by_depth"] == \
        good["acceptance_by_depth"]
    bad = SpeculativeDecoder(target, drafter, cuda_graphs=ReplayGraph).generate(PROMPTS, 24).summary
    assert bad["acceptance_by_depth"] != good["acceptance_by_depth"]


def test_a_host_read_inside_a_captured_step_raises():
    x = torch.ones(3)
    with pytest.raises(RuntimeError, match="host read"):
        ReplayGraph(lambda: x.sum().item())
    graph = ReplayGraph(lambda: x.mul_(2))
    graph.replay()
    assert x.tolist() == [4.0, 4.0, 4.0]


def test_cuda_graphs_need_a_cuda_target(pair):
    with pytest.raises(ValueError, match="cuda_graphs"):
        SpeculativeDecoder(pair[0], cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        SpeculativeDecoder(pair[0], cuda_graphs=ReplayGraph, compile=True)


@pytest.mark.parametrize("kind", ["draft chain:3", "draft dynamic:7,3,2", "mtp chain:3"])
def test_state_dict_names_what_start_sets_and_loads_it_back(pair, target_and_mtp, kind):
    """A model drafter's state_dict names every attribute that start replaces (one left out would stay the first
    call's in a later call that replays a kept set's graphs), the same names after every start; load_state puts a
    state_dict's objects back."""
    target, drafter = drafter_of(kind, pair, target_and_mtp)
    decoder = SpeculativeDecoder(target, drafter, cuda_graphs=CountingGraph)
    filters = dict(top_k=0, top_p=1.0, min_p=0.0, allowed_token_ids=None)
    decoder._start(PROMPTS4, 8, 0.0, 0, **filters)
    first, before = drafter.state_dict(), dict(vars(drafter))
    decoder._start(OTHER_PROMPTS4, 8, 0.5, 1, **filters)
    replaced = {name for name, value in vars(drafter).items() if before.get(name) is not value}
    assert "rng" in replaced and replaced <= set(drafter.state_dict()) == set(first)
    drafter.load_state(first)
    assert all(getattr(drafter, name) is value for name, value in first.items())
