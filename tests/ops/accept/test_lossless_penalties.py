"""Sampling stays lossless when the law depends on the path: penalties, logit bias and min-tokens.

A Markov target and drafter (markov.P_TARGET, markov.Q_DRAFT) whose law at a node is step 0 (repetition,
frequency and presence penalties on the output so far plus the node's path, a logit bias, min-tokens' stop token
until the request has generated enough) then the processed law. Requests start from state 0 with an output that
already holds tokens 0 and 1 and a prompt holding token 3; each step carries the output counts of everything
emitted so far, and the drafter draws from its own law processed the same way along its own path. The first two
(and three) tokens must follow the exact law of autoregressive sampling with the same parameters (chi-square,
tests/stats.py), for chains and trees, with and without draft logits, token-wise, block and traversal verification.
Negative controls that must fail: a verifier whose counts ignore the ancestors' drafts, and one that applies the
penalties after temperature.
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch

from specdec import reference as ref
from specdec._layout import pack_bitmask
from tests.helpers import BACKENDS, DEVICE, on_backend
from tests.ops.accept.markov import CHAIN, MARKOV_TREE, P_TARGET, Q_DRAFT, M, index
from tests.stats import ALPHA, assert_law, chi_square_pvalue, emitted_tokens

import specdec

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SAMPLES = 3000
INTERPRETED_SAMPLES = 500  # the Triton kernel in the interpreter
CONTROL_SAMPLES = 500

START_COUNTS = torch.tensor([1, 1, 0, 0])  # the output so far: tokens 0 (the last, state 0) and 1
IN_PROMPT = torch.tensor([False, False, False, True])
PENALTIES = dict(repetition=1.8, frequency=0.6, presence=0.4, bias=((2, 0.7),), min_tokens=3, stop=3)
FILTERS = dict(top_k=3, top_p=0.95, min_p=0.05)


def node_law(log_rows, state, counts, t, filters=None, filter_order="hf", *, penalties_after_temperature=False):
    """The processed law (M,) at a node in `state` whose output-plus-path counts are `counts` (generated: their
    sum), as the reference defines it; penalties_after_temperature: the wrong order (a negative control)."""
    counts = torch.as_tensor(counts, dtype=torch.long)
    stop = None
    if int(counts.sum()) < PENALTIES["min_tokens"]:
        stop = torch.zeros(M, dtype=torch.bool)
        stop[PENALTIES["stop"]] = True
    pen = ref.NodePenalties(counts, IN_PROMPT, PENALTIES["repetition"], PENALTIES["frequency"],
                            PENALTIES["presence"], PENALTIES["bias"], stop)
    f = filters or {}
    if penalties_after_temperature:
        row, t = ref.penalized_row(log_rows[state] / t, pen), 1.0
    else:
        row = ref.penalized_row(log_rows[state], pen)
    return ref.processed_probs(row, t, f.get("top_k", 0), f.get("top_p", 1.0), f.get("min_p", 0.0), None,
                               filter_order)


def exact_law(k, t, filters=None, filter_order="hf"):
    """(M**k,) the law of the first k tokens of autoregressive sampling from state 0."""
    law = torch.zeros((M,) * k, dtype=torch.float64)
    for ys in itertools.product(range(M), repeat=k):
        pr, state, counts = 1.0, 0, START_COUNTS.clone()
        for y in ys:
            pr *= float(node_law(P_TARGET.log(), state, counts, t, filters, filter_order)[y])
            state, counts[y] = y, counts[y] + 1
        law[ys] = pr
    return law.flatten()


class _Laws:
    """node_law, cached (the harness asks for the same few (state, counts) laws thousands of times)."""

    def __init__(self, log_rows, t, filters, filter_order):
        self.args, self.cache = (log_rows, t, filters, filter_order), {}

    def __call__(self, state, counts):
        key = (state, tuple(counts))
        if key not in self.cache:
            self.cache[key] = node_law(self.args[0], state, counts, *self.args[1:])
        return self.cache[key]


def _step(roots, counts, parents, t, with_draft, gen, filters, filter_order, drafter):
    """One verification step's batch: node i's children drawn i.i.d. from the drafter's processed law at node i
    (with draft logits), else the drafter's argmax chain under its processed law; the step-0 arguments."""
    n, T = roots.numel(), len(parents)
    tokens = torch.zeros(n, T, dtype=torch.int64)
    tokens[:, 0] = roots
    path_counts = torch.zeros(n, T, M, dtype=torch.long)  # node i's output-plus-path counts
    path_counts[:, 0] = counts
    for i in range(1, T):
        p = parents[i]
        laws = torch.stack([drafter(int(tokens[b, p]), path_counts[b, p].tolist()) for b in range(n)])
        tokens[:, i] = (torch.multinomial(laws, 1, generator=gen)[:, 0] if with_draft else laws.argmax(-1))
        path_counts[:, i] = path_counts[:, p]
        path_counts[torch.arange(n), i, tokens[:, i]] += 1
    log_p, log_q = P_TARGET.log().float(), Q_DRAFT.log().float()
    batch = dict(target_logits=log_p[tokens], tokens=tokens, parents=torch.tensor(parents).expand(n, T),
                 draft_logits=log_q[tokens] if with_draft else None, temperature=t, filter_order=filter_order,
                 repetition_penalty=PENALTIES["repetition"], frequency_penalty=PENALTIES["frequency"],
                 presence_penalty=PENALTIES["presence"], output_token_counts=counts.int(),
                 prompt_token_mask=pack_bitmask(IN_PROMPT.expand(n, M)),
                 logit_bias=(torch.tensor([[x for x, _ in PENALTIES["bias"]]]).expand(n, -1),
                             torch.tensor([[v for _, v in PENALTIES["bias"]]]).expand(n, -1)),
                 min_tokens=PENALTIES["min_tokens"], stop_token_ids=torch.tensor([[PENALTIES["stop"]]]).expand(n, 1),
                 **(filters or {}))
    return batch, path_counts


def generated(verify, parents, t, n, seed, k, *, with_draft=True, method="token", filters=None, filter_order="hf"):
    """(n, k) the first k tokens generated from state 0 by steps of verify(**batch, seeds, offset, method)."""
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.arange(n, dtype=torch.int64) + 7919 * seed
    drafter = _Laws(Q_DRAFT.log(), t, filters, filter_order)
    out = [[] for _ in range(n)]
    counts = START_COUNTS.expand(n, M).clone()
    last = torch.zeros(n, dtype=torch.int64)
    for step in range(k):
        todo = torch.tensor([len(o) < k for o in out])
        if not todo.any():
            break
        batch, path_counts = _step(last[todo], counts[todo], parents, t, with_draft, gen, filters, filter_order,
                                   drafter)
        res = verify(batch, path_counts, seeds=seeds[todo], offset=step, method=method)
        for b, emitted in zip(torch.nonzero(todo).flatten().tolist(), emitted_tokens(res, batch["tokens"])):
            for y in emitted:
                if len(out[b]) < k:
                    counts[b, y] += 1
                out[b].append(y)
            last[b] = emitted[-1]
    return index(torch.tensor([o[:k] for o in out]))


def _accept(backend, batch, path_counts, **kw):
    return specdec.accept(**on_backend(backend, dict(batch, **kw)), backend=backend)[:3]


def samples_for(backend):
    return INTERPRETED_SAMPLES if backend == "triton" and DEVICE.type == "cpu" else SAMPLES


CASES = {  # name: (parents, t, with_draft, method, filters, filter_order)
    "chain_draft": (CHAIN, 0.5, True, "token", None, "hf"),
    "tree_draft": (MARKOV_TREE, 1.0, True, "token", None, "hf"),
    "argmax_chain_given": (CHAIN, 0.7, False, "token", None, "hf"),
    "tree_draft_filtered_vllm": (MARKOV_TREE, 1.0, True, "token", FILTERS, "vllm"),
    "chain_block": (CHAIN, 0.9, True, "block", None, "hf"),
    "tree_traversal": (MARKOV_TREE, 1.0, True, "traversal", FILTERS, "sglang"),
}
INTERPRETED = ("tree_draft", "argmax_chain_given")  # the Triton interpreter's share (its time)


def _cases():
    for backend in ["torch"] + BACKENDS:
        for name in CASES:
            if backend == "triton" and DEVICE.type == "cpu" and name not in INTERPRETED:
                continue
            if backend == "triton" and CASES[name][3] == "traversal":
                continue  # (the Triton traversal kernel: test_traversal_triton.py)
            yield backend, name


@pytest.mark.parametrize("backend,name", list(_cases()))
def test_first_two_tokens_follow_the_penalized_law(backend, name):
    parents, t, with_draft, method, filters, order = CASES[name]
    pairs = generated(functools.partial(_accept, backend), parents, t, samples_for(backend), len(name), 2,
                      with_draft=with_draft, method=method, filters=filters, filter_order=order)
    assert_law(pairs, exact_law(2, t, filters, order), f"{name} on {backend}")


@pytest.mark.parametrize("backend", ["torch"] + [b for b in BACKENDS if not (b == "triton" and DEVICE.type == "cpu")])
def test_first_three_tokens_follow_the_penalized_law(backend):
    triples = generated(functools.partial(_accept, backend), CHAIN, 0.8, SAMPLES, 33, 3)
    assert_law(triples, exact_law(3, 0.8), f"three tokens on {backend}")


def _ancestors_ignored(batch, path_counts, **kw):
    """A verifier whose node laws count the output only: each row penalized with the step's output counts."""
    rows = {}
    for key, log_rows in (("target_logits", P_TARGET.log()), ("draft_logits", Q_DRAFT.log())):
        if batch[key] is None:
            continue
        n, T = batch["tokens"].shape
        out = torch.empty(n, T, M, dtype=torch.float64)
        for b in range(n):
            counts = path_counts[b, 0]
            for i in range(T):
                state = int(batch["tokens"][b, i])
                law = node_law(log_rows, state, counts, 1.0)  # (t = 1: its log is the penalized row, shifted)
                out[b, i] = law.log()
        rows[key] = out
    plain = {k: v for k, v in batch.items() if k in ("tokens", "parents", "temperature")}
    return _accept("torch", dict(plain, **rows), None, **kw)


def _penalties_after_temperature(batch, path_counts, **kw):
    t = batch["temperature"]
    scaled = dict(batch, target_logits=batch["target_logits"] / t, temperature=1.0,
                  draft_logits=None if batch["draft_logits"] is None else batch["draft_logits"] / t)
    return _accept("torch", scaled, None, **kw)


@pytest.mark.parametrize("wrong", [_ancestors_ignored, _penalties_after_temperature], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("name", ["chain_draft", "argmax_chain_given"])
def test_negative_controls_are_rejected(wrong, name):
    parents, t, with_draft, method, filters, order = CASES[name]
    pairs = generated(wrong, parents, t, CONTROL_SAMPLES, len(name), 2, with_draft=with_draft, method=method)
    p_value = chi_square_pvalue(pairs, exact_law(2, t))
    assert p_value < ALPHA * 1e-6, f"the chi-square test fails to reject {wrong.__name__} (p = {p_value:.3g})"
