"""The verifiers' shared test harness: a Markov-chain target and drafter over a small vocabulary.

Sampled: `markov_step` builds one verification step's batch for requests whose last token is a state,
`generated_tokens` runs steps of accept until each request has k tokens, and `k_token_law` / `two_token_law`
are the exact laws those tokens must follow (chi-square, tests/stats.py). Exact: `exact_chain` and `exact_tree`
enumerate every draft chain / tree of a Markov pair and give a verifier's law of emitted tuples and its expected
accepted length, for the verifiers written out step by step from the reference's own functions (`token_wise`,
`block`, `token_wise_tree`, `traversal`). Random op batches (`chain_batch`, `tree_batch`) for the checks of the
op's bookkeeping, and the backends each joint verifier's tests run on (METHOD_BACKENDS).
"""
from __future__ import annotations

import itertools
import math

import torch

import specdec
from specdec import reference
from specdec.sampling import pack_bitmask
from tests.stats import emitted_tokens

M = 4  # states
P_TARGET = torch.tensor([[0.50, 0.30, 0.15, 0.05],
                         [0.10, 0.20, 0.30, 0.40],
                         [0.25, 0.25, 0.00, 0.50],  # the target never goes 2 -> 2
                         [0.60, 0.05, 0.25, 0.10]], dtype=torch.float64)
Q_DRAFT = torch.tensor([[0.10, 0.20, 0.30, 0.40],
                        [0.40, 0.30, 0.20, 0.10],
                        [0.30, 0.10, 0.50, 0.10],
                        [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)

# the backends each joint verifier runs on in these tests (traversal on the Triton kernel: test_traversal_triton.py)
METHOD_BACKENDS = {"block": ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else []) + ["triton"],
                   "traversal": ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else [])}

CHAIN = [-1, 0, 1, 2]
MARKOV_TREE = [-1, 0, 0, 1, 1, 2]
STAR = [-1, 0, 0, 0]
BINARY = [-1, 0, 0, 1, 1]  # two children, the first with two of its own
MIXED = [-1, 0, 1, 0, 3]  # two chains of two under the root
UNEVEN = [-1, 0, 0, 1, 2]
EXACT_TREES = {"star": STAR, "binary": BINARY, "chain": CHAIN, "mixed": MIXED, "uneven": UNEVEN}


def chain(gamma: int) -> list[int]:
    """parents of a chain of gamma drafts under the root."""
    return [-1] + list(range(gamma))


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    """parents of a random tree of n nodes in node order (each node's parent is an earlier node)."""
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]


SAMPLED_TREES = {
    "random7": random_tree(7, torch.Generator().manual_seed(1)),
    "random9": random_tree(9, torch.Generator().manual_seed(2)),
    "star": [-1, 0, 0, 0, 0],
    "chain": [-1, 0, 1, 2, 3],
    "binary": [-1, 0, 0, 1, 1, 2, 2],
}

# ----------------------------------------------------------------------------------------------
# the processed law: top-k, top-p, min-p and a grammar mask that changes along the path
# ----------------------------------------------------------------------------------------------
# Each chosen (by exact computation of the processed laws) so that no kept set changes when top_p or
# min_p moves by 1e-3, and each changes the two-token law a lot; top_k = 2 meets a tie (0.25, 0.25) in
# P_TARGET's row 2, which keeps both. The mask: the grammar bans token (s + 1) % M right after token s, so
# node i's bitmask row depends on node i's own token, i.e. on the path.
FILTERS = {"top_k": dict(top_k=2), "top_p": dict(top_p=0.75), "min_p": dict(min_p=0.35), "mask": dict(mask=True),
           "all": dict(top_k=3, top_p=0.9, min_p=0.1, mask=True)}
INTERPRETED_FILTERED_SAMPLES = 400  # requests of a filtered chi-square test on the Triton interpreter


def allowed_after(states: torch.Tensor) -> torch.Tensor:
    """(n,) states -> (n, M) bool: the tokens the grammar allows after each."""
    allowed = torch.ones(states.numel(), M, dtype=torch.bool)
    allowed[torch.arange(states.numel()), (states.flatten() + 1) % M] = False
    return allowed


def processed_transition(log_transitions: torch.Tensor, state: int, t: float, filters: dict) -> torch.Tensor:
    """The processed law (reference.processed_probs) of the transition out of `state`."""
    allowed = allowed_after(torch.tensor([state]))[0] if filters.get("mask") else None
    return reference.processed_probs(log_transitions[state], t, filters.get("top_k", 0), filters.get("top_p", 1.0),
                                     filters.get("min_p", 0.0), allowed)


# ----------------------------------------------------------------------------------------------
# sampled: steps of accept
# ----------------------------------------------------------------------------------------------
def markov_step(roots: torch.Tensor, parents: list[int], t: float, with_draft: bool, gen: torch.Generator,
                filters=None, ignore=()):
    """One verification step for every request whose last emitted token is roots[b].

    With draft logits the tree's children are drawn i.i.d. from the drafter's transition at their parent;
    without, each node's children are the drafter's best tokens (its argmax for the first child: a greedy
    draft chain; the next best for the next siblings: a top-k tree). With `filters` (FILTERS), the drafter
    draws from its processed transition and accept gets the filters (those in `ignore` left out: a sampler
    that ignores them).
    """
    n, T = roots.numel(), len(parents)
    log_p, log_q = P_TARGET.log(), Q_DRAFT.log()
    q_law = (torch.softmax(log_q / t, -1) if filters is None
             else torch.stack([processed_transition(log_q, s, t, filters) for s in range(M)]))
    tokens = torch.zeros(n, T, dtype=torch.int64)
    tokens[:, 0] = roots
    for i in range(1, T):
        prev = tokens[:, parents[i]]
        rank = sum(parents[j] == parents[i] for j in range(1, i))  # earlier siblings
        if with_draft:
            tokens[:, i] = torch.multinomial(q_law[prev], 1, generator=gen)[:, 0]
        elif rank == 0:
            tokens[:, i] = log_q[prev].argmax(-1)
        else:
            tokens[:, i] = torch.sort(log_q[prev], stable=True, dim=-1, descending=True).indices[:, rank]
    batch = dict(target_logits=log_p[tokens].float(), tokens=tokens, parents=torch.tensor(parents).expand(n, T),
                 draft_logits=log_q[tokens].float() if with_draft else None, temperature=t)
    if filters is not None:
        batch.update({k: v for k, v in filters.items() if k != "mask" and k not in ignore})
        if filters.get("mask") and "mask" not in ignore:  # node i's row: what may follow its own token
            batch["token_bitmask"] = pack_bitmask(allowed_after(tokens.flatten()).view(n, T, M))
    return batch


def generated_tokens(verify, parents: list[int], t: float, n: int, seed: int, k: int, *, with_draft: bool = True,
                     filters=None, ignore=(), method: str = "token", prepare=None) -> torch.Tensor:
    """(n, k) the first k tokens generated from state 0 by steps of verify(**batch, seeds, offset, method) (e.g.
    accept_on with a backend) on trees of the given shape (markov_step's), each request's next step from its
    last emitted token, at the next offset. prepare(batch, gen): the batch as verify takes it (e.g. with
    probabilities for logits), drawing from the same generator right after the step's drafts."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + 7919 * seed
    out = [[] for _ in range(n)]
    last = torch.zeros(n, dtype=torch.int64)
    for step in range(k):
        todo = torch.tensor([len(o) < k for o in out])
        if not todo.any():
            break
        batch = markov_step(last[todo], parents, t, with_draft, gen, filters, ignore)
        if prepare is not None:
            batch = prepare(batch, gen)
        res = verify(**batch, seeds=seeds[todo], offset=step, method=method)
        for b, emitted in zip(torch.nonzero(todo).flatten().tolist(), emitted_tokens(res, batch["tokens"])):
            out[b] += emitted
            last[b] = emitted[-1]
    return torch.tensor([o[:k] for o in out])


def k_token_law(t: float, k: int) -> torch.Tensor:
    """(M^k,) the law of the first k tokens from state 0 under softmax(log P / t)."""
    p = torch.softmax(P_TARGET.log() / t, -1)
    law = p[0]
    for _ in range(k - 1):
        law = (law.view(-1, 1) * p[torch.arange(M).repeat(law.numel() // M)]).flatten()
    return law


def two_token_law(t: float, filters=None) -> torch.Tensor:
    """(M * M,) law of (y1, y2) from state 0: P_t(0, y1) P_t(y1, y2), P_t = softmax(log P / t), or with
    `filters` the processed transitions (the mask after y1 is the one of state y1)."""
    if filters is None:
        p = torch.softmax(P_TARGET.log() / t, -1)
    else:
        p = torch.stack([processed_transition(P_TARGET.log(), s, t, filters) for s in range(M)])
    return (p[0][:, None] * p).flatten()


def index(tokens: torch.Tensor) -> torch.Tensor:
    """(n, k) tokens -> (n,) their index among the M^k tuples (k_token_law's order)."""
    return sum(tokens[:, j] * M ** (tokens.shape[1] - 1 - j) for j in range(tokens.shape[1]))


# ----------------------------------------------------------------------------------------------
# exact: every draft chain or tree enumerated
# ----------------------------------------------------------------------------------------------
def token_wise(P, Q, drafted):
    """Token-wise verification of one chain, exactly: [(probability, emitted tokens)]."""
    out, keep = [], 1.0
    for i in range(len(drafted) + 1):
        if i == len(drafted):
            out += [(keep * float(P[i][y]), tuple(drafted[:i]) + (y,)) for y in range(len(P[i]))]
            break
        x = drafted[i]
        a = min(1.0, float(P[i][x] / Q[i][x]))
        r = torch.clamp(P[i] - Q[i], min=0.0)
        r = r / r.sum() if r.sum() > 0 else P[i]
        out += [(keep * (1 - a) * float(r[y]), tuple(drafted[:i]) + (y,)) for y in range(len(P[i]))]
        keep *= a
    return out


def block(P, Q, drafted):
    """Block verification of one chain, exactly, from the reference's steps: [(probability, emitted)]."""
    weights, h = reference.block_weights(P, Q, drafted)
    gamma, out = len(drafted), []
    for tau in range(gamma + 1):  # tau is the last i with eta_i < h_i
        chance = (h[tau - 1] if tau else 1.0) * math.prod(1 - h[j] for j in range(tau, gamma))
        r = P[tau] if tau == gamma else reference.block_residual(P[tau], Q[tau], weights[tau])
        r = r / r.sum() if r.sum() > 0 else P[tau]
        out += [(chance * float(r[y]), tuple(drafted[:tau]) + (y,)) for y in range(len(P[tau]))]
    return out


def exact_chain(verify, p, q, gamma):
    """Markov target p and drafter q (M x M, from state 0), chains of gamma drafts: (law of the emitted tuples,
    E[accepted])."""
    law, accepted = {}, 0.0
    for drafted in itertools.product(range(p.shape[0]), repeat=gamma):
        states = (0,) + drafted
        chance = math.prod(float(q[states[i], drafted[i]]) for i in range(gamma))
        for pr, emitted in verify([p[s] for s in states], [q[s] for s in states], list(drafted)):
            law[emitted] = law.get(emitted, 0.0) + chance * pr
            accepted += chance * pr * (len(emitted) - 1)
    return law, accepted


def path_tokens(v, parents, tokens):
    """The tokens on the path from the root (excluded) to node v."""
    out = []
    while v > 0:
        out.append(tokens[v])
        v = parents[v]
    return tuple(reversed(out))


def traversal(P, Q, tokens, parents):
    """Traversal verification of one drafted tree, exactly, from the reference's steps: [(probability, emitted)].
    visit(v, w, reach) adds v's emissions (reach: the chance the walk gets to v's decision) and returns the
    chance that v's subtree fails given that the walk entered v."""
    kids, out = reference.children_of(parents, len(parents)), []

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
        out.extend((reach * fails * w * float(law[y]), path_tokens(v, parents, tokens) + (y,))
                   for y in range(len(law)))
        return fails * (1.0 - w)

    visit(0, 1.0, 1.0)
    return out


def token_wise_tree(P, Q, tokens, parents):
    """Token-wise verification of one drafted tree (the reference's walk with draft logits), exactly."""
    kids, out = reference.children_of(parents, len(parents)), []

    def visit(v, reach):
        r = P[v]
        for c in kids[v]:
            x = tokens[c]
            a = min(1.0, float(r[x] / Q[v][x])) if Q[v][x] > 0 else 1.0
            visit(c, reach * a)
            reach *= 1.0 - a
            r = torch.clamp(r - Q[v], min=0.0)
            r = r / r.sum() if r.sum() > 0 else r
        out.extend((reach * float(r[y]), path_tokens(v, parents, tokens) + (y,)) for y in range(len(r)))

    visit(0, 1.0)
    return out


def exact_tree(verify, p, q, parents):
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


def first_k_law(law, p, k):
    """(M,) * k: the law of the first k generated tokens, from a law of emitted tuples (a shorter emission
    continues from its last token with the target p's own steps)."""
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


def target_k_law(p, k):
    """(M,) * k: the target p's law of the first k tokens from state 0."""
    law = p[0]
    for _ in range(k - 1):
        law = law.unsqueeze(-1) * p
    return law


def exact_accepted(method, p, q, parents):
    """E[accepted drafts] of one step of `method` ("token", "block": chains only, "traversal") from state 0, the
    drafts of the tree `parents` drawn i.i.d. from q; a chain is enumerated as a chain."""
    gamma = len(parents) - 1
    if method == "traversal":
        return exact_tree(traversal, p, q, parents)[1]
    if parents == chain(gamma):
        return exact_chain(block if method == "block" else token_wise, p, q, gamma)[1]
    assert method == "token", f"{method!r} verifies chains only"
    return exact_tree(token_wise_tree, p, q, parents)[1]


def random_pair(gen, size=4):
    """A random Markov target and drafter (size x size, rows normalized), with zeros on either side."""
    while True:
        p = torch.rand(size, size, generator=gen, dtype=torch.float64) ** 2
        q = torch.rand(size, size, generator=gen, dtype=torch.float64) ** 2
        p[torch.rand(size, size, generator=gen) < 0.1] = 0.0  # impossible tokens for the target ...
        q[torch.rand(size, size, generator=gen) < 0.1] = 0.0  # ... and ones the drafter never proposes
        if (p.sum(-1) > 0).all() and (q.sum(-1) > 0).all():
            return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------------------------
# random op batches: drafts that often match the target's argmax, so that paths get deep
# ----------------------------------------------------------------------------------------------
V_BATCH = 11


def chain_batch(B, T, gen, temperature):
    """B chains of T nodes (ragged num_nodes), every draft token the argmax of its parent's target row."""
    target = torch.randn(B, T, V_BATCH, generator=gen) * 2
    draft = target + torch.randn(B, T, V_BATCH, generator=gen)
    tokens = torch.randint(0, V_BATCH, (B, T), generator=gen)
    tokens[:, 1:] = target[:, :-1].argmax(-1)  # long greedy paths, often accepted when sampling too
    return dict(target_logits=target, tokens=tokens, parents=torch.arange(-1, T - 1).expand(B, T),
                draft_logits=draft, temperature=temperature, seeds=torch.arange(B) + 3,
                num_nodes=torch.randint(1, T + 1, (B,), generator=gen))


def tree_batch(B, T, gen, temperature):
    """B random trees of T nodes (ragged num_nodes), 60% of the draft tokens their parent's target argmax."""
    target = torch.randn(B, T, V_BATCH, generator=gen) * 2
    draft = target + torch.randn(B, T, V_BATCH, generator=gen)
    parents = torch.tensor([random_tree(T, gen) for _ in range(B)])
    tokens = torch.randint(0, V_BATCH, (B, T), generator=gen)
    for b in range(B):
        for i in range(1, T):
            if torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = target[b, parents[b, i]].argmax()
    return dict(target_logits=target, tokens=tokens, parents=parents, draft_logits=draft, temperature=temperature,
                seeds=torch.arange(B) + 3, num_nodes=torch.randint(1, T + 1, (B,), generator=gen))
