"""Property-based fuzzing of every op on every backend: valid input gets the reference's result (exact for integer
outputs and greedy accept, helpers.TOL for attention, the sampling law's invariants for sampled accept); any input
a backend refuses, the reference refuses the same way, with a ValueError / TypeError naming an argument and
nothing written. Strategies, the sandbox (a crash or hang fails one example) and the profiles:
tests/fuzz/strategies.py."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from specdec import reference
from tests.fuzz.strategies import (BACKENDS, GREEDY_BELOW, accept_cases, append_cases, assert_storages_equal,
                                   assert_untouched, assert_well_formed_error, attention_cases, build_tree_cases,
                                   first_word, fuzz, is_root_path, op_argument_names, rollback_cases, run_on,
                                   sampling_params)
from tests.helpers import TOL

NON_REFERENCE = [b for b in BACKENDS if b != "torch"]


def describe(args: dict) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            return f"Tensor{tuple(x.shape)} {str(x.dtype)[6:]} stride {x.stride()} offset {x.storage_offset()}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(one(t) for t in x) + "]"
        return repr(x)
    return "; ".join(f"{k}={one(v)}" for k, v in args.items())


def same_outcome(name: str, args: dict, backend: str, compare) -> None:
    """The call on `backend` against the reference's: both refuse (the same exception type naming the same
    argument, nothing written) or both succeed and `compare(expected, actual, expected_after, actual_after)`."""
    note(describe(args))
    names = op_argument_names(name)
    expected, expected_error, expected_after = run_on(name, args, "torch")
    actual, error, after = run_on(name, args, backend)
    for who, err, left in (("reference", expected_error, expected_after), (backend, error, after)):
        if err is not None:
            assert_well_formed_error(err, names, f"{name} on {who}")
            assert_untouched(args, left, f"{name} on {who}")
    if expected_error is not None or error is not None:
        assert expected_error is not None and error is not None and expected_error[0] == error[0] \
            and first_word(expected_error) == first_word(error), \
            f"{name}: reference -> {expected_error}, {backend} -> {error}"
        return
    compare(expected, actual, expected_after, after)


# ----------------------------------------------------------------------------------------------
# build_tree
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", NON_REFERENCE)
@fuzz
@given(data=st.data())
def test_build_tree_is_the_reference(backend, data):
    def compare(expected, actual, *_):
        for e, a in zip(expected, actual):
            assert torch.equal(e, a)
    same_outcome("build_tree", data.draw(build_tree_cases()), backend, compare)


# ----------------------------------------------------------------------------------------------
# tree_attention
# ----------------------------------------------------------------------------------------------
def compare_attention(expected, actual, *_):
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("backend", NON_REFERENCE)
@fuzz
@given(data=st.data())
def test_tree_attention_is_the_reference(backend, data):
    args = data.draw(attention_cases(backend=backend))
    same_outcome("tree_attention", dict(args, return_lse=True), backend,
                 lambda e, a, *_: [compare_attention(e[0], a[0]), torch.testing.assert_close(
                     a[1], e[1], atol=TOL[torch.float32][0] * 10, rtol=TOL[torch.float32][1], equal_nan=True)])


# ----------------------------------------------------------------------------------------------
# kv_append, kv_rollback, RollbackPlan: every byte of every buffer (a view's gaps too) as the reference leaves it
# ----------------------------------------------------------------------------------------------
def compare_buffers(name):
    return lambda expected, actual, expected_after, after: assert_storages_equal(expected_after, after, name)


@pytest.mark.parametrize("backend", NON_REFERENCE)
@fuzz
@given(data=st.data())
def test_kv_append_is_the_reference(backend, data):
    same_outcome("kv_append", data.draw(append_cases(backend=backend)), backend, compare_buffers("kv_append"))


@pytest.mark.parametrize("op", ["kv_rollback", "rollback_plan"])
@pytest.mark.parametrize("backend", NON_REFERENCE)
@fuzz
@given(data=st.data())
def test_kv_rollback_is_the_reference(backend, op, data):
    same_outcome(op, data.draw(rollback_cases(backend=backend)), backend, compare_buffers(op))


# ----------------------------------------------------------------------------------------------
# accept
# ----------------------------------------------------------------------------------------------
def request_parameters(args: dict, B: int):
    """Per request (temperature, top_k, top_p, min_p) as floats, from accept's arguments (numbers or tensors)."""
    def per(x, off):
        if x is None:
            return [off] * B
        if isinstance(x, torch.Tensor):
            return [float(v) for v in x.double()]
        return [float(x)] * B
    return list(zip(per(args.get("temperature"), 0.0), per(args.get("top_k"), 0), per(args.get("top_p"), 1.0),
                    per(args.get("min_p"), 0.0)))


def padded(args: dict, name: str, b: int):
    """Request b's (T, ...) rows of argument `name`, in the padded or the packed form."""
    x = args.get(name)
    if x is None:
        return None
    if "cu_num_nodes" not in args:
        return x[b]
    cu = args["cu_num_nodes"].long()
    return x[int(cu[b]):int(cu[b + 1])]


def kept(row, t, k, top_p, min_p, allowed, probs, y) -> bool:
    """Whether token y may be emitted at a node of target row `row`: allowed by the mask, a finite logit (a
    positive probability), and kept by the filters, with the rounding of an fp32 kernel forgiven at their
    boundaries (ties that x / t creates in fp32, 1e-4 of probability mass)."""
    x = row.double()
    x = x.log() if probs else x
    if allowed is not None:
        x = x.masked_fill(~allowed, -math.inf)
    finite = x > -math.inf
    if not bool(finite[y]):
        return False
    l64 = (x - x[finite].max()) / t
    l32 = (row.double().log() if probs else row.double()).float() / torch.tensor(t, dtype=torch.float32)
    l32 = l32.double().masked_fill(~finite, -math.inf)
    keep = finite.clone()
    if 0 < k < x.numel():
        larger = torch.minimum((l64 > l64[y]).sum(), (l32 > l32[y]).sum())
        if larger >= k:
            return False
        keep &= torch.minimum((l64.unsqueeze(1) > l64).sum(0), (l32.unsqueeze(1) > l32).sum(0)) < k
    p = torch.softmax(l64.masked_fill(~keep, -math.inf), 0)
    if top_p < 1.0 and float(p[(l64 > l64[y]) & keep].sum()) >= top_p + 1e-4 and float(l64[y]) < float(l64[keep].max()):
        return False
    if min_p > 0.0 and float(p[y]) < min_p * float(p.max()) * (1 - 1e-4):
        return False
    return True


def check_sampled_request(args, result, b, params, probs):
    """The invariants of a sampled request's result: its accepted nodes are a root path of its tree, each accepted
    draft token may be emitted at its parent, so may the next token at the last accepted node."""
    accepted, num_accepted, next_tokens = result
    t, k, top_p, min_p = params
    parents, tokens = padded(args, "parents", b), padded(args, "tokens", b)
    n = int(num_accepted[b])
    path = accepted[b, :n + 1].tolist()
    assert is_root_path(parents, path), f"request {b}: accepted {path} is not a root path of parents {parents.tolist()}"
    assert (accepted[b, n + 1:] == -1).all(), f"request {b}: accepted_nodes past the path: {accepted[b].tolist()}"
    law = "target_probs" if probs else "target_logits"
    rows = padded(args, law, b)
    mask = padded(args, "token_bitmask", b)
    V = rows.shape[-1]
    for parent, child in zip(path, path[1:]):
        allowed = None if mask is None else reference.unpack_bits(mask[parent], V)
        assert kept(rows[parent], t, k, top_p, min_p, allowed, probs, int(tokens[child])), \
            f"request {b}: accepted node {child}'s token {int(tokens[child])}, which node {parent}'s law excludes"
    last = path[-1]
    allowed = None if mask is None else reference.unpack_bits(mask[last], V)
    y = int(next_tokens[b])
    assert 0 <= y < V and kept(rows[last], t, k, top_p, min_p, allowed, probs, y), \
        f"request {b}: next token {y}, which node {last}'s law (t = {t:g}) excludes"


def greedy_version(args: dict) -> dict:
    """args with every temperature below GREEDY_BELOW made 0 (greedy)."""
    t = args.get("temperature")
    if isinstance(t, torch.Tensor):
        return dict(args, temperature=torch.where(t.double() < GREEDY_BELOW, 0.0, t.double()).to(t.dtype))
    if isinstance(t, float) and t < GREEDY_BELOW:
        return dict(args, temperature=0.0)
    return args


def check_accept(args: dict, backend: str) -> None:
    """accept on `backend`: the reference's errors, greedy requests (t < GREEDY_BELOW) exactly the reference's greedy
    result, sampled requests the invariants of their law."""
    note(describe(args))
    names = op_argument_names("accept")
    expected, expected_error, expected_after = run_on("accept", greedy_version(args), "torch")
    actual, error, after = run_on("accept", args, backend)
    for who, err, left in (("reference", expected_error, expected_after), (backend, error, after)):
        if err is not None:
            assert_well_formed_error(err, names, f"accept on {who}")
            assert_untouched(greedy_version(args) if who == "reference" else args, left, f"accept on {who}")
    if expected_error is not None or error is not None:
        assert expected_error is not None and error is not None and expected_error[0] == error[0] \
            and first_word(expected_error) == first_word(error), \
            f"accept: reference -> {expected_error}, {backend} -> {error}"
        return
    B = expected[0].shape[0]
    probs = "target_probs" in args
    assert len(actual) == len(expected), f"accept on {backend}: {len(actual)} outputs, the reference {len(expected)}"
    for b, params in enumerate(request_parameters(args, B)):
        if params[0] < GREEDY_BELOW:
            got = [x[b].tolist() for x in actual if not x.is_floating_point()]
            want = [x[b].tolist() for x in expected if not x.is_floating_point()]
            assert got == want, f"greedy request {b} (t = {params[0]:g}): {backend} {got}, reference {want}"
            for x, y in zip(actual, expected):  # the logprobs (float32 kernels, a float64 reference)
                if x.is_floating_point():
                    torch.testing.assert_close(x[b], y[b], atol=1e-5, rtol=0, equal_nan=True,
                                               msg=lambda m: f"greedy request {b}'s logprobs on {backend}: {m}")
        else:
            check_sampled_request(args, actual, b, params, probs)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_greedy_accept_is_the_reference(backend, data):
    check_accept(data.draw(accept_cases(backend=backend, sampled=False)), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_greedy_accept_with_sampling_parameters_is_the_reference(backend, data):
    """Penalties, logit bias, min-tokens, a filter order and logprobs on greedy requests: the reference's paths,
    next tokens and logprobs (the rows' extremes left out: the Triton kernels rank top logprobs in float32, and
    tie by id the entries whose logprobs only float64 tells apart, beside a logit near 3e38 or a float64 row's
    range; step 0's saturation is tested in tests/ops/accept/test_sampling_params.py)."""
    args = data.draw(accept_cases(backend=backend, sampled=False, extremes=False))
    law = args.get("target_logits", args.get("target_probs"))
    args.update(data.draw(sampling_params(args["seeds"].shape[0], law.shape[-1])))
    check_accept(args, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_sampled_accept_keeps_the_invariants_of_its_law(backend, data):
    check_accept(data.draw(accept_cases(backend=backend, sampled=True)), backend)
