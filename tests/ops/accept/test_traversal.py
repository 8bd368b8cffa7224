"""Traversal verification (accept(..., method="traversal"); Weng et al., arXiv 2505.12398): exactly lossless on
trees whose children are drawn i.i.d. from q, never fewer accepted tokens than token-wise tree verification, and
block verification itself on a chain.

Exact checks enumerate every draft tree of small Markov targets and drafters with the reference's own steps
(traversal_child_weight / traversal_residual): the law of the first generated tokens is the target's, and the
expected accepted length is >= token-wise's (equal on stars, where both are the same algorithm). Sampled checks
run accept itself on every CPU backend: chi-square over the first 2 and 3 generated tokens on random trees, stars
and chains at temperatures 0.5, 1 and 2; every filter; the mean accepted length against its exact value;
negative controls (no residual correction, weights not carried down the path) that the same test rejects.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

import specdec
from specdec import reference
from tests.helpers import DEVICE, accept_on
from tests.stats import ALPHA, assert_law, chi_square_pvalue, emitted_tokens
from tests.ops.accept.test_lossless import FILTERS, M, P_TARGET, Q_DRAFT, _markov_step, _two_token_law
from tests.ops.accept.test_block import _block, _exact, _index, _k_token_law

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TRAVERSAL_BACKENDS = ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else [])
SAMPLES = 3000
INTERPRETED = DEVICE.type == "cpu"


def samples_for(backend: str) -> int:
    return 800 if backend == "triton" and INTERPRETED else SAMPLES


STAR = [-1, 0, 0, 0]
BINARY = [-1, 0, 0, 1, 1]  # two children, the first with two of its own
CHAIN = [-1, 0, 1, 2]
MIXED = [-1, 0, 1, 0, 3]  # two chains of two under the root
UNEVEN = [-1, 0, 0, 1, 2]
EXACT_TREES = {"star": STAR, "binary": BINARY, "chain": CHAIN, "mixed": MIXED, "uneven": UNEVEN}


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    """parents of a random tree of n nodes in node order (each node's parent is an earlier node)."""
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]


# ----------------------------------------------------------------------------------------------
# exact: every draft tree enumerated
# ----------------------------------------------------------------------------------------------
def _kids(parents):
    return reference.children_of(parents, len(parents))


def _path(v, parents, tokens):
    out = []
    while v > 0:
        out.append(tokens[v])
        v = parents[v]
    return tuple(reversed(out))


def _traversal(P, Q, tokens, parents):
    """Traversal verification of one drafted tree, exactly, from the reference's steps: [(probability, emitted)].
    visit(v, w, reach) adds v's emissions (reach: the chance the walk gets to v's decision) and returns the
    chance that v's subtree fails given that the walk entered v."""
    kids, out = _kids(parents), []

    def visit(v, w, reach):
        if w == 0.0:
            return 1.0
        law, fails = P[v], 1.0
        for c in kids[v]:
            fail = visit(c, reference.traversal_child_weight(w, law, Q[v], tokens[c]), reach * fails)
            fails *= fail
            law, w = reference.traversal_residual(w, law, Q[v])
            if w == 0.0:
                return fails
        out.extend((reach * fails * w * float(law[y]), _path(v, parents, tokens) + (y,)) for y in range(len(law)))
        return fails * (1.0 - w)

    visit(0, 1.0, 1.0)
    return out


def _token_wise_tree(P, Q, tokens, parents):
    """Token-wise verification of one drafted tree (the reference's walk with draft logits), exactly."""
    kids, out = _kids(parents), []

    def visit(v, reach):
        r = P[v]
        for c in kids[v]:
            x = tokens[c]
            a = min(1.0, float(r[x] / Q[v][x])) if Q[v][x] > 0 else 1.0
            visit(c, reach * a)
            reach *= 1.0 - a
            r = torch.clamp(r - Q[v], min=0.0)
            r = r / r.sum() if r.sum() > 0 else r
        out.extend((reach * float(r[y]), _path(v, parents, tokens) + (y,)) for y in range(len(r)))

    visit(0, 1.0)
    return out


def _exact_tree(verify, p, q, parents):
    """Markov target p and drafter q (M x M) from state 0, children i.i.d. from q at their parent's state:
    (law of the emitted tuples, E[accepted])."""
    law, accepted = {}, 0.0
    for drafted in itertools.product(range(p.shape[0]), repeat=len(parents) - 1):
        tokens = (0,) + drafted  # node v's state is its token (the root's: 0)
        chance = math.prod(float(q[tokens[parents[i]], tokens[i]]) for i in range(1, len(parents)))
        if chance == 0.0:
            continue
        P, Q = [p[s] for s in tokens], [q[s] for s in tokens]
        for pr, emitted in verify(P, Q, list(tokens), parents):
            law[emitted] = law.get(emitted, 0.0) + chance * pr
            accepted += chance * pr * (len(emitted) - 1)
    return law, accepted


def _first_k(law, p, k):
    """(M,) * k: the law of the first k generated tokens (a shorter emission continues from its last token
    with the target's own steps)."""
    out = torch.zeros((p.shape[0],) * k, dtype=torch.float64)
    for emitted, pr in law.items():
        head = emitted[:k]
        out[head] += _extend(pr, head, p, k) if len(head) < k else pr
    return out


def _extend(pr, head, p, k):
    """(M,) * (k - len(head)): pr times the target's law of the k - len(head) tokens after head."""
    law = pr * p[head[-1]]
    for _ in range(k - len(head) - 1):
        law = law.unsqueeze(-1) * p  # (..., M) x (M, M) over the last token
    return law


def _target_k(p, k):
    law = p[0]
    for _ in range(k - 1):
        law = law.unsqueeze(-1) * p
    return law


def _random_pair(gen, size=4):
    while True:
        p = torch.rand(size, size, generator=gen, dtype=torch.float64) ** 2
        q = torch.rand(size, size, generator=gen, dtype=torch.float64) ** 2
        p[torch.rand(size, size, generator=gen) < 0.1] = 0.0  # impossible tokens for the target ...
        q[torch.rand(size, size, generator=gen) < 0.1] = 0.0  # ... and ones the drafter never proposes
        if (p.sum(-1) > 0).all() and (q.sum(-1) > 0).all():
            return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", EXACT_TREES)
def test_traversal_is_exactly_lossless_and_never_worse(name):
    """Random Markov pairs (V = 4, zeros on either side): the first depth + 1 tokens follow the target exactly
    (to rounding); traversal accepts >= token-wise on every pair, and > on most when the tree is deeper than a
    star (on a star both are the same algorithm)."""
    parents = EXACT_TREES[name]
    depth = max(len(_path(v, parents, list(range(len(parents))))) for v in range(len(parents)))
    gen = torch.Generator().manual_seed(len(name))
    better = 0
    for _ in range(15):
        p, q = _random_pair(gen)
        law, traversal = _exact_tree(_traversal, p, q, parents)
        _, token = _exact_tree(_token_wise_tree, p, q, parents)
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
        torch.testing.assert_close(_first_k(law, p, depth + 1), _target_k(p, depth + 1), rtol=0, atol=1e-12)
        assert traversal >= token - 1e-12
        better += traversal > token + 1e-9
    assert better == 0 if name == "star" else better >= 12


def test_traversal_of_a_chain_is_block_verification():
    """On a chain, traversal's weights are block verification's p_i and its decisions h_i: the same law of
    emitted tuples and the same expected accepted length, exactly."""
    gen = torch.Generator().manual_seed(3)
    for gamma in (1, 2, 3):
        p, q = _random_pair(gen)
        law, traversal = _exact_tree(_traversal, p, q, [-1] + list(range(gamma)))
        block_law, block = _exact(_block, p, q, gamma)
        assert traversal == pytest.approx(block, abs=1e-12)
        for emitted in set(law) | set(block_law):
            assert law.get(emitted, 0.0) == pytest.approx(block_law.get(emitted, 0.0), abs=1e-12), emitted


def test_the_harness_sees_the_token_wise_law_too():
    """The enumeration's token-wise tree verifier is itself lossless (a check of the harness, not of a claim)."""
    gen = torch.Generator().manual_seed(9)
    p, q = _random_pair(gen)
    law, _ = _exact_tree(_token_wise_tree, p, q, BINARY)
    torch.testing.assert_close(_first_k(law, p, 3), _target_k(p, 3), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# sampled: accept itself on every CPU backend
# ----------------------------------------------------------------------------------------------
def _first_tokens(backend, parents, t, n, seed, k, filters=None):
    """(n, k) the first k tokens generated from state 0 by steps of accept(method="traversal") on trees of the
    given shape drafted i.i.d. from q at temperature t, each request's next step from its last emitted token."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + 7919 * seed
    out = [[] for _ in range(n)]
    last = torch.zeros(n, dtype=torch.int64)
    for step in range(k):
        todo = torch.tensor([len(o) < k for o in out])
        if not todo.any():
            break
        batch = _markov_step(last[todo], parents, t, True, gen, filters)
        res = accept_on(backend, **batch, seeds=seeds[todo], offset=step, method="traversal")
        for b, emitted in zip(torch.nonzero(todo).flatten().tolist(), emitted_tokens(res, batch["tokens"])):
            out[b] += emitted
            last[b] = emitted[-1]
    return torch.tensor([o[:k] for o in out])


SAMPLED_TREES = {
    "random7": random_tree(7, torch.Generator().manual_seed(1)),
    "random9": random_tree(9, torch.Generator().manual_seed(2)),
    "star": [-1, 0, 0, 0, 0],
    "chain": [-1, 0, 1, 2, 3],
    "binary": [-1, 0, 0, 1, 1, 2, 2],
}


@pytest.mark.parametrize("backend", TRAVERSAL_BACKENDS)
@pytest.mark.parametrize("name,t", [("random7", 1.0), ("random9", 0.5), ("star", 2.0), ("chain", 1.0),
                                    ("binary", 2.0), ("random7", 0.5), ("binary", 1.0)])
def test_first_tokens_follow_the_markov_target(backend, name, t):
    """Random trees, stars and chains at temperatures 0.5, 1, 2: the first two and the first three generated
    tokens follow the target's Markov law (chi-square)."""
    if backend == "torch" and (name, t) not in (("random7", 1.0), ("binary", 2.0)):
        pytest.skip("the reference loops in Python: two cases")
    if backend == "triton" and INTERPRETED and (name, t) != ("random7", 1.0):
        pytest.skip("the interpreter's time: one case")
    tokens = _first_tokens(backend, SAMPLED_TREES[name], t, samples_for(backend), seed=31 + len(name), k=3)
    assert_law(_index(tokens[:, :2]), _k_token_law(t, 2), f"traversal, first two tokens, {name}, on {backend}")
    assert_law(_index(tokens), _k_token_law(t, 3), f"traversal, first three tokens, {name}, on {backend}")


@pytest.mark.parametrize("backend", TRAVERSAL_BACKENDS)
def test_traversal_with_every_filter_follows_the_processed_target(backend):
    """Top-k, top-p, min-p and a path-dependent grammar mask compose with traversal verification: its P and Q
    are the processed laws; the first two tokens follow the processed target law."""
    f = FILTERS["all"]
    n = 400 if backend == "triton" and INTERPRETED else SAMPLES
    tokens = _first_tokens(backend, BINARY, 0.9, n, seed=23, k=2, filters=f)
    assert_law(_index(tokens), _two_token_law(0.9, f), f"traversal with every filter on {backend}")


@pytest.mark.parametrize("backend", TRAVERSAL_BACKENDS)
@pytest.mark.parametrize("name", ["binary", "mixed"])
def test_mean_accepted_length_is_the_exact_one(backend, name):
    """The mean accepted length of one step from state 0 is the exact expectation (enumerated), within 4
    standard errors, and above token-wise's exact one."""
    if backend == "triton" and INTERPRETED and name != "binary":
        pytest.skip("the interpreter's time: one tree")
    parents, t, n = EXACT_TREES[name], 1.0, samples_for(backend)
    gen = torch.Generator().manual_seed(5 + len(name))
    batch = _markov_step(torch.zeros(n, dtype=torch.int64), parents, t, True, gen)
    res = accept_on(backend, **batch, seeds=torch.arange(n) + 17, offset=0, method="traversal")
    got = res.num_accepted.double()
    p = torch.softmax(P_TARGET.log() / t, -1)
    q = torch.softmax(Q_DRAFT.log() / t, -1)
    exact, token = _exact_tree(_traversal, p, q, parents)[1], _exact_tree(_token_wise_tree, p, q, parents)[1]
    assert abs(float(got.mean()) - exact) < 4 * float(got.std()) / math.sqrt(n), (float(got.mean()), exact)
    assert exact > token + 0.005, (exact, token)


def test_negative_controls_reject_wrong_traversal_samplers(monkeypatch):
    """The chi-square over the first two tokens rejects traversal without its residual correction (a failed
    child leaves the node's law as it was) and with weights not carried down the path (min(L/Q, 1), as
    token-wise), at the interpreter's sample size, by a wide margin."""
    t, n = 1.0, samples_for("triton")
    law = _k_token_law(t, 2)
    real_residual, real_weight = reference.traversal_residual, reference.traversal_child_weight

    def no_correction(w, law_row, q_row):
        return law_row, real_residual(w, law_row, q_row)[1]

    def uncarried(w, law_row, q_row, x):
        return real_weight(1.0 if w > 0 else 0.0, law_row, q_row, x)

    for name, wrong in (("traversal_residual", no_correction), ("traversal_child_weight", uncarried)):
        with monkeypatch.context() as m:
            m.setattr(reference, name, wrong)
            tokens = _first_tokens("torch", BINARY, t, n, seed=3, k=2)
        p_value = chi_square_pvalue(_index(tokens), law)
        assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject {name} = {wrong.__name__} ({p_value:.3g})"


# ----------------------------------------------------------------------------------------------
# the op: arguments, greedy requests, determinism, batch invariance
# ----------------------------------------------------------------------------------------------
V_TREE = 11


def _tree_batch(B, T, gen, temperature):
    """Random trees (ragged sizes), drafts that often match the target's argmax, so paths get deep."""
    target = torch.randn(B, T, V_TREE, generator=gen) * 2
    draft = target + torch.randn(B, T, V_TREE, generator=gen)
    parents = torch.tensor([random_tree(T, gen) for _ in range(B)])
    tokens = torch.randint(0, V_TREE, (B, T), generator=gen)
    for b in range(B):
        for i in range(1, T):
            if torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = target[b, parents[b, i]].argmax()
    return dict(target_logits=target, tokens=tokens, parents=parents, draft_logits=draft, temperature=temperature,
                seeds=torch.arange(B) + 3, num_nodes=torch.randint(1, T + 1, (B,), generator=gen))


@pytest.mark.parametrize("backend", TRAVERSAL_BACKENDS)
def test_bad_traversal_arguments(backend):
    gen = torch.Generator().manual_seed(0)
    batch = _tree_batch(3, 5, gen, torch.tensor([1.0, 0.0, 0.7]))
    with pytest.raises(ValueError, match="method: 'traversal' needs draft_logits"):
        accept_on(backend, **dict(batch, draft_logits=None), method="traversal")
    with pytest.raises(ValueError, match="method: expected one of"):
        accept_on(backend, **batch, method="traverse")


@pytest.mark.parametrize("backend", TRAVERSAL_BACKENDS)
def test_greedy_requests_ignore_the_method_and_results_are_deterministic_and_batch_invariant(backend):
    gen = torch.Generator().manual_seed(1)
    B = 8
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.9])
    batch = _tree_batch(B, 7, gen, temps)
    traversal = accept_on(backend, **batch, method="traversal")
    token = accept_on(backend, **batch, method="token")
    greedy = temps == 0
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(traversal, token))
    assert all(torch.equal(x, y) for x, y in zip(traversal, accept_on(backend, **batch, method="traversal")))
    order = torch.randperm(B, generator=gen)
    shuffled = {k: (v[order] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B else v)
                for k, v in batch.items()}
    again = accept_on(backend, **shuffled, method="traversal")
    assert all(torch.equal(x[order], y) for x, y in zip(traversal, again))
    # the accepted path is a root-to-node path of the tree, padded with -1
    for b in range(B):
        k = int(traversal.num_accepted[b])
        path = traversal.accepted_nodes[b, : k + 1].tolist()
        assert path[0] == 0 and all(int(batch["parents"][b, path[i]]) == path[i - 1] for i in range(1, k + 1))
        assert (traversal.accepted_nodes[b, k + 1:] == -1).all()
        assert 0 <= int(traversal.next_tokens[b]) < V_TREE
