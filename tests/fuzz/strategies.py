"""Hypothesis strategies, profiles and the sandbox of the property-based fuzz suite (tests/fuzz/test_fuzz_*.py).

The contract the properties check, for every op, backend and entry point (docs/ops.md, "Input contract"):
  * bad input: a ValueError / TypeError whose message starts with an argument's name, raised before anything is
    written (every input, cache and output byte-identical afterwards, gaps of strided views included);
  * valid input: the reference's result (specdec.reference, backend "torch");
  * nothing crashes, hangs or reads out of bounds: every non-reference backend runs in a sandbox process
    (`Sandbox`), one per test worker, which runs many examples; a crash fails the example that caused it.

Profiles (SPECDEC_FUZZ_PROFILE): "ci" (default: a few examples per property, `make test`) and "fuzz" (`make fuzz`,
main() below: each property gets as many examples as its share of FUZZ_MINUTES allows). The seed is
SPECDEC_FUZZ_SEED (tests/conftest.py draws one per session and prints it; set it to repeat a run).
"""
from __future__ import annotations

import copy
import io
import math
import os
import pickle
import struct
import subprocess
import sys
from typing import Optional

import torch
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st

import specdec
import specdec.ops
from specdec import reference

# ----------------------------------------------------------------------------------------------
# profiles, seed, known defects
# ----------------------------------------------------------------------------------------------
settings.register_profile("ci", max_examples=12, deadline=None, derandomize=False, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much, HealthCheck.large_base_example],
                          phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink])
# (make fuzz's runner, main() below, sizes each property's examples to its share of the time budget)
settings.register_profile("fuzz", parent=settings.get_profile("ci"),
                          max_examples=int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", 10**6)))
PROFILE = os.environ.get("SPECDEC_FUZZ_PROFILE", "ci")
settings.load_profile(PROFILE)
SEED = int(os.environ.get("SPECDEC_FUZZ_SEED", "0"))  # conftest sets it per session before the workers start



def fuzz(test):
    """A property under the session's seed (SPECDEC_FUZZ_SEED) and profile."""
    return seed(SEED)(test)


BACKENDS = ["torch", "cpp", "triton"] if specdec.ops.HAS_CPP else ["torch", "triton"]
GREEDY_BELOW = specdec.reference.GREEDY_BELOW  # a temperature below this (1e-5 as a float32) is greedy everywhere

# ----------------------------------------------------------------------------------------------
# the sandbox: the backends under test in a process of their own
# ----------------------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALL_TIMEOUT = 300  # seconds one op call may take in the sandbox (interpreted Triton on tiny shapes: < 10)


class Crash(AssertionError):
    """The sandbox process died (segfault, abort) or hung while running an op."""


def call_op(name: str, kwargs: dict, backend: Optional[str]):
    """Op `name` of specdec (or an entry point "module.function" of specdec.integrations) on `kwargs`.
    RollbackPlan is "rollback_plan" (kwargs: the constructor's, then cache_lens, accepted_nodes, num_accepted).
    Entry points take no backend: SPECDEC_BACKEND picks it for the accept call inside them."""
    kwargs = dict(kwargs)
    if "." in name:
        import importlib
        module, function = name.split(".")
        fn = getattr(importlib.import_module(f"specdec.integrations.{module}"), function)
        if function == "RejectionSampler":
            fn = fn().forward
        before = os.environ.get("SPECDEC_BACKEND")
        os.environ["SPECDEC_BACKEND"] = backend or ""
        try:
            if function == "RejectionSampler":
                return fn(**kwargs).sampled_token_ids
            return fn(**kwargs)
        finally:
            if before is None:
                del os.environ["SPECDEC_BACKEND"]
            else:
                os.environ["SPECDEC_BACKEND"] = before
    if name == "rollback_plan":
        step = {k: kwargs.pop(k) for k in ("cache_lens", "accepted_nodes", "num_accepted")}
        return specdec.RollbackPlan(**kwargs, backend=backend).run(**step)
    positional = {"tree_attention": ("q", "k_cache", "v_cache", "cache_lens", "tree_mask")}.get(name, ())
    args = [kwargs.pop(p) for p in positional]
    return getattr(specdec, name)(*args, **kwargs, backend=backend)


def outcome(name: str, kwargs: dict, backend: Optional[str]):
    """(result, error, kwargs after the call) of call_op on a deep copy of kwargs (views and aliasing kept).
    error: None, or (exception type name, message)."""
    kwargs = copy.deepcopy(kwargs)
    try:
        result = call_op(name, kwargs, backend)
    except Exception as exc:  # what was raised is the property's to judge
        return None, (type(exc).__name__, str(exc)), kwargs
    if isinstance(result, specdec.AcceptResult) and result.logprobs is not None:
        result = tuple(result) + tuple(result.logprobs)
    elif isinstance(result, tuple):
        result = tuple(result)
    return result, None, kwargs


def _send(stream, obj) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", header)
    return torch.load(io.BytesIO(stream.read(size)), weights_only=False)


def serve() -> None:
    """The sandbox's loop: requests (name, kwargs, backend) on stdin, outcomes on stdout."""
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints of the ops must not corrupt the channel
    import warnings
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    while True:
        try:
            name, kwargs, backend = _receive(stdin)
        except EOFError:
            return
        _send(stdout, outcome(name, kwargs, backend))


class Sandbox:
    """One long-lived process with TRITON_INTERPRET=1 (and the test session's interpreter patches, from
    tests/conftest.py) that runs op calls; restarted after a crash, which fails the example that caused it."""

    def __init__(self):
        self.process = None

    def _start(self):
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import tests.conftest; from tests.fuzz.strategies import serve; serve()"],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, name: str, kwargs: dict, backend: str):
        if self.process is None or self.process.poll() is not None:
            self._start()
        import threading
        reply = {}

        def receive():
            try:
                reply["value"] = _receive(self.process.stdout)
            except (EOFError, pickle.UnpicklingError, RuntimeError) as exc:
                reply["error"] = exc

        _send(self.process.stdin, (name, kwargs, backend))
        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        reader.join(CALL_TIMEOUT)
        if "value" in reply:
            return reply["value"]
        hung = reader.is_alive()
        self.process.kill()
        code = self.process.wait()
        self.process = None
        raise Crash(f"{name} on backend {backend!r} {'hung' if hung else f'crashed (exit status {code})'}")

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)
            self.process = None


SANDBOX = Sandbox()


def run_on(name: str, kwargs: dict, backend: Optional[str]):
    """outcome() on `backend`: the reference in this process, every other backend in the sandbox."""
    if backend == "torch":
        return outcome(name, kwargs, backend)
    return SANDBOX.run(name, kwargs, backend)


# ----------------------------------------------------------------------------------------------
# what a call may leave behind
# ----------------------------------------------------------------------------------------------
def tensors_of(kwargs: dict) -> dict:
    """{argument name (a list's items as name[i]): tensor} of the tensor arguments (SimpleNamespace fields too)."""
    out = {}
    for name, x in kwargs.items():
        if isinstance(x, torch.Tensor):
            out[name] = x
        elif isinstance(x, (list, tuple)):
            out.update({f"{name}[{i}]": t for i, t in enumerate(x) if isinstance(t, torch.Tensor)})
        elif hasattr(x, "__dict__"):
            out.update({f"{name}.{k}": t for k, t in vars(x).items() if isinstance(t, torch.Tensor)})
    return out


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t` (a view's gaps and neighbours too) as uint8."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def assert_untouched(before: dict, after: dict, what: str) -> None:
    """Every tensor argument's storage byte-identical after a call that raised."""
    for name, t in tensors_of(before).items():
        assert torch.equal(storage_bytes(t), storage_bytes(tensors_of(after)[name])), \
            f"{what}: {name} was written by a call that raised"


def assert_storages_equal(expected: dict, actual: dict, what: str) -> None:
    """Every tensor argument's storage byte-identical to the reference's after both wrote (in-place ops)."""
    for name, t in tensors_of(expected).items():
        got = tensors_of(actual)[name]
        a, b = storage_bytes(t), storage_bytes(got)
        if not torch.equal(a, b):
            if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                full_t = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
                full_g = torch.empty(0, dtype=t.dtype).set_(got.untyped_storage())
                torch.testing.assert_close(full_g, full_t, atol=0, rtol=0, equal_nan=True,
                                           msg=lambda m: f"{what}: {name} differs from the reference's: {m}")
            raise AssertionError(f"{what}: {name}'s bytes differ from the reference's "
                                 f"({int((a != b).sum())} of {a.numel()} bytes)")


def assert_well_formed_error(error, argument_names, what: str) -> None:
    """A ValueError / TypeError whose message starts with one of `argument_names` (an entry 'name' also covers
    'name[i]', 'name.field' and a list 'a, b: ...' of names)."""
    kind, message = error
    assert kind in ("ValueError", "TypeError"), f"{what}: raised {kind}: {message}"
    head = message.split(":")[0]
    names = [n.strip() for n in head.split(",")]
    ok = all(any(n == a or n.startswith(a + "[") or n.startswith(a + ".") for a in argument_names) for n in names)
    assert ok and names, f"{what}: {kind} does not start with an argument's name: {message!r}"


def first_word(error) -> str:
    return error[1].split(":")[0]


# ----------------------------------------------------------------------------------------------
# numbers
# ----------------------------------------------------------------------------------------------
INT_DTYPES = [torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
BIG_INTS = [2**31 - 1, 2**31, 2**32, 2**32 + 2, 2**32 + 5, 2**40, 2**62, -(2**31), -(2**32) + 3, -1]
SPECIAL_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1e-40, 1e-30, 1e-12, 6e-8, 1.0, -1.0, 65504.0, 3e38, -3e38, 3.4e38,
                  1e300, -1e300, 1.7e308, math.inf, -math.inf, math.nan]
TEMPERATURES = [0.0, 5e-324, 1e-45, 1e-30, 1e-8, 1e-6, 9.99e-6, 1e-5, 1.1e-5, 1e-3, 0.1, 0.5, 0.7, 1.0, 2.0, 1e5, 1e30,
                3.4e38, 1e39]


def float_tensor(draw, shape, dtype, *, scale=None, specials=()):
    """N(0, scale) values in `dtype` (scale drawn when None) with some entries set to `specials`."""
    scale = draw(st.sampled_from([1e-3, 1.0, 4.0, 30.0, 1e4])) if scale is None else scale
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale)
    if specials and x.numel() and draw(st.booleans()):
        flat = x.view(-1)
        for _ in range(draw(st.integers(1, min(4, flat.numel())))):
            flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from(specials))
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------
# views: the same values in another layout
# ----------------------------------------------------------------------------------------------
def poison_value(dtype):
    if dtype.is_floating_point:
        return math.nan
    return -(2**31) + 7 if dtype == torch.int32 else 2**40 + 7


def gapped(t: torch.Tensor, draw) -> torch.Tensor:
    """`t`'s values as a strided slice of a bigger buffer (an offset, a step per dimension) whose other elements
    are poison (NaN, or an index no op accepts)."""
    steps = [draw(st.integers(1, 3)) for _ in range(t.dim())]
    lead = draw(st.integers(0, 5))
    shape = [max(1, n * s) for n, s in zip(t.shape, steps)]
    flat = torch.full((lead + math.prod(shape) + draw(st.integers(0, 3)),), 0, dtype=t.dtype)
    if t.dtype in FP8:
        flat.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn, NaN in e5m2
    else:
        flat.fill_(poison_value(t.dtype))
    big = flat[lead:lead + math.prod(shape)].view(shape)
    view = big[tuple(slice(None, None, s) for s in steps)]
    view.copy_(t)
    return view


def transposed_storage(t: torch.Tensor, draw, keep_last: bool) -> torch.Tensor:
    """`t`'s values in a storage whose dimension order is a permutation of t's (the last kept if `keep_last`)."""
    dims = list(range(t.dim() - 1 if keep_last else t.dim()))
    order = draw(st.permutations(dims)) + ([t.dim() - 1] if keep_last else [])
    stored = torch.empty([t.shape[d] for d in order], dtype=t.dtype)
    inverse = [order.index(d) for d in range(t.dim())]
    view = stored.permute(inverse)
    view.copy_(t)
    return view


def expanded(t: torch.Tensor) -> Optional[torch.Tensor]:
    """`t` as a stride-0 expand along every dimension it is constant along (bit for bit), None if there is none."""
    bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    out = t
    for d in range(t.dim()):
        if t.shape[d] > 1 and torch.equal(bits.narrow(d, 0, 1).expand_as(bits), bits):
            out = out.narrow(d, 0, 1).expand_as(t)
    return None if out.stride() == t.stride() else out


def some_layout(draw, t, *, keep_last=False, written=False):
    """`t` (a tensor argument) as the caller may pass it: contiguous, a gapped slice, a permuted storage, or (read
    only) a stride-0 expand where its values allow. keep_last: unit stride along the last dimension."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    kinds = ["contiguous", "gapped", "permuted"] + ([] if written else ["expanded"])
    kind = draw(st.sampled_from(kinds))
    if kind == "gapped":
        view = gapped(t, draw)
        if keep_last and view.dim() and view.stride(-1) != 1 and view.shape[-1] > 1:
            return t.contiguous()
        return view
    if kind == "permuted" and t.dim() > 1:
        return transposed_storage(t, draw, keep_last)
    if kind == "expanded":
        e = expanded(t)
        if e is not None and not (keep_last and e.stride(-1) == 0 and e.shape[-1] > 1):
            return e
    return t.contiguous()


# ----------------------------------------------------------------------------------------------
# trees
# ----------------------------------------------------------------------------------------------
@st.composite
def trees(draw, B=None, T=None, min_T=1, max_T=6, kinds=("chain", "star", "random"), ragged=True):
    """(parents (B, T) int64 with -1 in padding, num_nodes (B,) int64): every request a chain, a star or a random
    tree of num_nodes[b] <= T nodes."""
    B = draw(st.integers(1, 3)) if B is None else B
    T = draw(st.integers(min_T, max_T)) if T is None else T
    parents = torch.full((B, T), -1, dtype=torch.int64)
    num_nodes = torch.full((B,), T, dtype=torch.int64)
    for b in range(B):
        n = draw(st.integers(1, T)) if ragged else T
        kind = draw(st.sampled_from(kinds))
        for i in range(1, n):
            parents[b, i] = i - 1 if kind == "chain" else 0 if kind == "star" else draw(st.integers(0, i - 1))
        num_nodes[b] = n
        if n < T:  # padding: anything (unread)
            parents[b, n:] = torch.tensor(draw(st.lists(st.sampled_from([-1, 0, 5, 2**31 - 1, -(2**31)]),
                                                        min_size=T - n, max_size=T - n)))
    return parents, num_nodes


def index_tensor(draw, values: torch.Tensor, *, big_ok=True):
    """`values` as int32 or int64 (int64 whenever a value needs it)."""
    fits32 = bool(((values >= -(2**31)) & (values < 2**31)).all()) if values.numel() else True
    dtype = draw(st.sampled_from(INT_DTYPES)) if fits32 else torch.int64
    return values.to(dtype)


def root_path(parents_row, node):
    path = []
    while node != -1:
        path.append(node)
        node = int(parents_row[node])
    return path[::-1]


def is_root_path(parents_row, path) -> bool:
    """path[0] = 0 and each node's parent is the node before it."""
    return bool(path) and path[0] == 0 and all(int(parents_row[c]) == p for p, c in zip(path, path[1:]))


def to_packed(rows: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) -> (N, ...) the real nodes' rows, request by request."""
    return torch.cat([rows[b, :int(num_nodes[b])] for b in range(rows.shape[0])]) if rows.shape[0] else rows[:, 0]


def cu_of(num_nodes: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), num_nodes.long().cumsum(0)])


# ----------------------------------------------------------------------------------------------
# caches
# ----------------------------------------------------------------------------------------------
@st.composite
def cache_layout(draw, B, cap, Hkv, D, dtype, *, layers=None):
    """(k, v, block_table): a logical (B, cap, Hkv, D) cache pair (a (layers, ...) stack when layers) as contiguous
    rows or pages with a shuffled block table (spare blocks poisoned), NHD or HND (a transposed view), K and V
    apart or interleaved in one buffer. Returns the logical contents too: (k, v, table, logical_k, logical_v)."""
    L = 1 if layers is None else layers
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logical = torch.randn(2, L, B, cap, Hkv, D, generator=gen).to(dtype)
    paged = draw(st.booleans()) and cap > 0
    hnd = draw(st.booleans())
    interleaved = draw(st.booleans())
    if paged:
        block_size = draw(st.sampled_from([b for b in (1, 2, 4, 8) if cap % b == 0]))
        per = cap // block_size
        spare = draw(st.integers(0, 3))
        num_blocks = B * per + spare
        order = torch.randperm(num_blocks, generator=gen)[:B * per]
        table = order.view(B, per).to(torch.int32)
        rows_shape = (num_blocks, block_size)
        content = logical.reshape(2, L, B * per, block_size, Hkv, D)
    else:
        table = None
        rows_shape = (B, cap)
        content = logical
    # storage order: (K|V, layer, rows..., Hkv, D) or interleaved (layer, rows0, K|V, ...), HND swaps rows1 and Hkv
    inner = (Hkv, rows_shape[1], D) if hnd else (rows_shape[1], Hkv, D)
    shape = (L, rows_shape[0], 2, *inner) if interleaved else (2, L, rows_shape[0], *inner)
    buf = torch.empty(shape, dtype=dtype)
    if dtype in FP8:
        buf.view(torch.uint8).fill_(0x7F)
    else:
        buf.fill_(math.nan)
    kv = buf.permute(2, 0, 1, *range(3, 6)) if interleaved else buf  # (2, L, rows0, inner...)
    if hnd:
        kv = kv.transpose(3, 4)  # (2, L, rows0, rows1, Hkv, D)
    if paged:
        kv[:, :, table.view(-1).long()] = content
    else:
        kv.copy_(content)
    k, v = kv[0], kv[1]
    if layers is None:
        k, v = k[0], v[0]
    return k, v, table, logical[0], logical[1]


# ----------------------------------------------------------------------------------------------
# accept inputs
# ----------------------------------------------------------------------------------------------
def allowed_rows(draw, B, T, V, num_nodes, logits=None):
    """(B, T, V) bool: each real node allows at least one token (one with a finite logit where logits are given)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    density = draw(st.sampled_from([0.05, 0.3, 0.7, 1.0]))
    allowed = torch.rand(B, T, V, generator=gen) < density
    for b in range(B):
        for i in range(T):
            if not bool(allowed[b, i].any()):
                finite = [] if logits is None else torch.nonzero(logits[b, i].double() > -math.inf).flatten().tolist()
                allowed[b, i, (finite or [0])[draw(st.integers(0, max(len(finite), 1) - 1))]] = True
    return allowed


def near_tie_row(draw, V, dtype, probs):
    """A row with two values one ulp (or a few) apart at random places: greedy must take the larger."""
    base = draw(st.sampled_from([0.3, 0.49, 1.0, 0.1, 7.0] if probs else [1.0, 3.0, -2.0, 20.0]))
    row = torch.full((V,), base * (0.5 if probs else 1.0), dtype=torch.float64)
    row -= torch.rand(V, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31)))) * abs(base) * 0.5
    row = row.to(dtype).double()
    if V > 1:
        i, j = draw(st.lists(st.integers(0, V - 1), min_size=2, max_size=2, unique=True))
        top = torch.tensor(base, dtype=dtype)
        ulps = draw(st.integers(1, 3))
        lower = top
        for _ in range(ulps):
            lower = torch.nextafter(lower, torch.tensor(-math.inf, dtype=dtype))
        row[i], row[j] = float(lower), float(top)
    return row.to(dtype)


@st.composite
def accept_cases(draw, *, backend="torch", packed=None, probs=None, sampled=None, extremes=True, max_V=64):
    """Keyword arguments of specdec.accept, valid except where a drawn extreme makes a real row invalid (the
    consistency property tells): trees of every kind, padded or packed, logits or probabilities in every float
    dtype, greedy, tiny and ordinary temperatures, filters as numbers and tensors, token bitmasks, every method,
    int32 / int64 indices (padding garbage included), every tensor as a contiguous, strided or expanded view."""
    triton = backend == "triton"
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 4 if triton else 6))
    V = draw(st.integers(1, min(max_V, 40 if triton else 64)))
    parents, num_nodes = draw(trees(B=B, T=T))
    probs = draw(st.booleans()) if probs is None else probs
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rows = torch.stack([torch.stack([near_tie_row(draw, V, dtype, probs) if draw(st.integers(0, 3)) == 0
                                     else float_tensor(draw, (V,), dtype, specials=([-math.inf, 0.0, 1e-40, 3e38, 1e300]
                                                                                    if extremes else ()))
                                     for _ in range(T)]) for _ in range(B)])
    if probs:
        rows = rows.abs() if dtype != torch.float64 else rows.abs()
        rows = torch.where(torch.isinf(rows), torch.zeros_like(rows), rows)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    tokens = torch.randint(0, V, (B, T), generator=gen)
    for b in range(B):  # padding tokens: anything
        tokens[b, int(num_nodes[b]):] = draw(st.sampled_from([0, V, 2**31 - 1, 2**40]))
    # children often draw the target's argmax, so that greedy paths get long
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            if draw(st.integers(0, 2)) == 0:
                tokens[b, i] = int(torch.argmax(rows[b, int(parents[b, i])].double()))
    draft = None
    method = "token"
    if draw(st.booleans()):
        draft = float_tensor(draw, (B, T, V), dtype, specials=[-math.inf, 0.0] if extremes else ())
        if probs:
            draft = draft.abs()
        method = draw(st.sampled_from(["token", "traversal"] + (["block"] if all(
            is_root_path(parents[b], list(range(int(num_nodes[b])))) for b in range(B)) else [])))
    sampled = draw(st.booleans()) if sampled is None else sampled
    if sampled:
        values = [draw(st.sampled_from(TEMPERATURES[1:-1])) for _ in range(B)]
        if draw(st.booleans()):
            values[0] = 0.0  # a greedy request in a sampled batch
        tdtype = draw(st.sampled_from(FLOAT_DTYPES[2:]))
        temperature = (values[0] if B == 1 and draw(st.booleans())
                       else torch.tensor(values, dtype=torch.float64).to(tdtype))
    else:
        temperature = draw(st.sampled_from([None, 0.0, torch.zeros(B, dtype=torch.float32)]))
    args = dict(tokens=index_tensor(draw, tokens), parents=index_tensor(draw, parents), temperature=temperature,
                seeds=torch.tensor([draw(st.integers(0, 2**62)) for _ in range(B)], dtype=torch.int64),
                offset=draw(st.sampled_from([0, 1, 12345, 2**40])), method=method)
    if draw(st.booleans()):
        args["top_k"] = draw(st.sampled_from([0, 1, 2, V, torch.tensor([1, 3, 0][:B] + [2] * (B - 3), dtype=torch.int64)]))
    if draw(st.booleans()):
        args["top_p"] = draw(st.sampled_from([1.0, 0.9, 0.5, 1e-3, torch.tensor([0.8] * B, dtype=torch.float64)]))
    if draw(st.booleans()):
        args["min_p"] = draw(st.sampled_from([0.0, 0.1, 0.5, torch.tensor([0.2] * B, dtype=torch.float32)]))
    if draw(st.booleans()):
        allowed = allowed_rows(draw, B, T, V, num_nodes, None if probs else rows)
        if probs:  # a real row needs a positive probability on an allowed token
            for b in range(B):
                for i in range(T):
                    if not bool((rows[b, i].double() * allowed[b, i]).amax() > 0):
                        rows[b, i, int(torch.nonzero(allowed[b, i])[0])] = 0.5
        args["token_bitmask"] = specdec.sampling.pack_bitmask(allowed)
    law, draft_law = ("target_probs", "draft_probs") if probs else ("target_logits", "draft_logits")
    args[law] = rows
    if draft is not None:
        args[draft_law] = draft
    packed = draw(st.booleans()) if packed is None else packed
    if packed:
        args["cu_num_nodes"] = index_tensor(draw, cu_of(num_nodes))
        args["max_nodes"] = T if draw(st.booleans()) else T + draw(st.integers(1, 2))
        for name in (law, draft_law, "token_bitmask", "tokens", "parents"):
            if name in args:
                args[name] = to_packed(args[name], num_nodes)
    else:
        args["num_nodes"] = None if bool((num_nodes == T).all()) and draw(st.booleans()) \
            else index_tensor(draw, num_nodes)
    for name in list(args):
        args[name] = some_layout(draw, args[name])
    return args


@st.composite
def sampling_params(draw, B, V):
    """accept's step-0 and logprob arguments: penalties as numbers or (B,) tensors (neutral ones included), the
    counts and prompt mask they read, a logit bias with padding and repeated ids, min-tokens reached at some
    depth or not at all, a filter order, logprobs off, 0 or a few, raw or processed."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    counts = torch.randint(0, 3, (B, V), generator=gen) * (torch.rand(B, V, generator=gen) < 0.3)
    out = {}

    def penalty(off, values):
        if draw(st.booleans()):
            return draw(st.sampled_from([off] + values))
        return torch.tensor([draw(st.sampled_from([off] + values)) for _ in range(B)],
                            dtype=draw(st.sampled_from(FLOAT_DTYPES)))

    if draw(st.booleans()):
        out["repetition_penalty"] = penalty(1.0, [0.5, 1.3, 2.0])
        if draw(st.booleans()):
            out["prompt_token_mask"] = specdec.sampling.pack_bitmask(torch.rand(B, V, generator=gen) < 0.3)
    for name in ("frequency_penalty", "presence_penalty"):
        if draw(st.booleans()):
            out[name] = penalty(0.0, [-1.5, 0.25, 2.0])
    if draw(st.booleans()):
        K = draw(st.integers(1, 4))
        ids = torch.randint(-1, V, (B, K), generator=gen)
        ids[:, -1] = draw(st.sampled_from([-1, V - 1]))
        out["logit_bias"] = (index_tensor(draw, ids, big_ok=False),
                             torch.tensor([[draw(st.sampled_from([-50.0, -1.0, 0.0, 0.5, 3.0, 1e4])) for _ in range(K)]
                                           for _ in range(B)]))
    if draw(st.booleans()):
        out["min_tokens"] = draw(st.sampled_from([0, 1, 3, torch.tensor([int(counts[b].sum()) + draw(
            st.integers(0, 3)) for b in range(B)])]))
        S = draw(st.integers(1, 3))
        out["stop_token_ids"] = index_tensor(draw, torch.randint(-1, V, (B, S), generator=gen), big_ok=False)
    if any(k.endswith("penalty") or k == "min_tokens" for k in out):
        out["output_token_counts"] = index_tensor(draw, counts, big_ok=False)
    out["filter_order"] = draw(st.sampled_from(["hf", "vllm", "sglang"]))
    out["return_logprobs"] = draw(st.sampled_from([None, 0, 1, 3]))
    out["logprobs_mode"] = draw(st.sampled_from(["raw", "processed"]))
    return {k: some_layout(draw, v) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


@st.composite
def attention_cases(draw, *, backend="torch", packed=None):
    """Keyword arguments of specdec.tree_attention (valid): ragged trees, GQA, fp16/bf16/fp32/fp64 q with caches in
    q's dtype or float8 with scales, contiguous or paged caches (NHD / HND / interleaved K|V), windows, soft caps,
    attention sinks, scale, the packed form, MLA's absorbed form (one KV head, V the leading channels of K's rows,
    a view); every tensor as a contiguous, strided, permuted or expanded view (caches: unit stride along D)."""
    triton = backend == "triton"
    B = draw(st.integers(1, 2 if triton else 3))
    T = draw(st.integers(1, 4 if triton else 6))
    mla = draw(st.booleans())
    Hkv = 1 if mla else draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 2))
    # (the Triton kernel takes head dims 16 .. 256 and no float64: it refuses the others with a ValueError)
    D = 16 if triton else draw(st.sampled_from([1, 2, 4, 8, 16]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES[:3] if triton else FLOAT_DTYPES))
    cache_dtype = draw(st.sampled_from([dtype, dtype] + FP8))
    cap = draw(st.sampled_from([8, 16]))
    parents, num_nodes = draw(trees(B=B, T=T))
    info = reference.build_tree(parents.to(torch.int32), num_nodes.to(torch.int32))
    lens = torch.tensor([draw(st.integers(0, cap - T)) for _ in range(B)], dtype=torch.int32)
    k, v, table, _, _ = draw(cache_layout(B, cap, Hkv, D, cache_dtype))
    if mla:  # V: the first Dv channels of the latent rows K holds
        v = k[..., :draw(st.integers(1, D))]
    args = dict(q=float_tensor(draw, (B, T, Hq, D), dtype, scale=draw(st.sampled_from([0.1, 1.0, 3.0]))),
                k_cache=k, v_cache=v, cache_lens=lens, tree_mask=info[1], block_table=table)
    if cache_dtype in FP8:
        args["k_scale"] = draw(st.sampled_from([None, 0.02, 1.0, 3.0]))
        args["v_scale"] = args["k_scale"] if mla else draw(st.sampled_from([None, 0.05, 1.0]))
    if draw(st.booleans()):
        args["window_left"] = draw(st.sampled_from([-1, max(T - 1, 0), T + 1, 2**31 - 1, 2**31 + 5]))
    if draw(st.booleans()):
        args["logits_soft_cap"] = draw(st.sampled_from([0.0, 0.5, 30.0]))
    if draw(st.booleans()):
        args["scale"] = draw(st.sampled_from([0.0, 1e-3, 0.25, 2.0]))
    if draw(st.booleans()):  # attention sinks: none (-inf), below, among and far above the scores
        args["sinks"] = torch.tensor([draw(st.sampled_from([-math.inf, -30.0, -1.0, 0.0, 2.5, 40.0, 1e30]))
                                      for _ in range(Hq)], dtype=torch.float32)
    packed = draw(st.booleans()) if packed is None else packed
    if packed:
        args["cu_num_nodes"] = index_tensor(draw, cu_of(num_nodes))
        args["max_nodes"] = T
        args["q"] = to_packed(args["q"], num_nodes)
        args["tree_mask"] = to_packed(args["tree_mask"], num_nodes)
    else:
        args["num_nodes"] = index_tensor(draw, num_nodes)
    for name in ("q", "cache_lens", "tree_mask", "block_table", "num_nodes", "cu_num_nodes", "sinks"):
        if name in args:
            args[name] = some_layout(draw, args[name], keep_last=name == "q")
    return args


@st.composite
def append_cases(draw, *, backend="torch"):
    """Keyword arguments of specdec.kv_append (valid): every cache layout, float8 caches with scales and new K/V
    in any float dtype, strided views of the new K/V and of cache_lens, single-cache layers (no V)."""
    triton = backend == "triton"
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 4 if triton else 6))
    Hkv, D = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4, 8, 16]))
    cache_dtype = draw(st.sampled_from(FLOAT_DTYPES + FP8))
    cap = draw(st.sampled_from([8, 16]))
    k, v, table, _, _ = draw(cache_layout(B, cap, Hkv, D, cache_dtype))
    new_dtype = draw(st.sampled_from(FLOAT_DTYPES)) if cache_dtype in FP8 else cache_dtype
    specials = [0.0, -0.0, 1e-40, 65504.0, 1e5, 3e38, -math.inf, math.inf, math.nan]
    args = dict(k_cache=k, v_cache=v, cache_lens=torch.tensor([draw(st.integers(0, cap - T)) for _ in range(B)],
                                                              dtype=torch.int32),
                k_new=float_tensor(draw, (B, T, Hkv, D), new_dtype, specials=specials),
                v_new=float_tensor(draw, (B, T, Hkv, D), new_dtype, specials=specials), block_table=table)
    if cache_dtype in FP8:
        args["k_scale"] = draw(st.sampled_from([None, 0.02, 1.0, 1e-30]))
        args["v_scale"] = draw(st.sampled_from([None, 0.5, 1e30]))
    if draw(st.booleans()):  # a single-cache layer (MLA's latent cache)
        args.update(v_cache=None, v_new=None)
    for name in ("k_new", "v_new", "cache_lens", "block_table"):
        if args[name] is not None:
            args[name] = some_layout(draw, args[name], keep_last=name in ("k_new", "v_new"))
    return args


@st.composite
def rollback_cases(draw, *, backend="torch"):
    """Keyword arguments of specdec.kv_rollback (valid): one layer, a stack, a list of layers or of stacks, every
    cache layout, single-cache layers (v_cache None), paths of random trees as int32 / int64, strided views of the
    step's tensors."""
    triton = backend == "triton"
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 4 if triton else 6))
    Hkv, D = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4, 16]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES + FP8))
    cap = draw(st.sampled_from([8, 16]))
    form = draw(st.sampled_from(["layer", "stacked", "list", "list-of-stacks"]))
    layers = None if form == "layer" else draw(st.integers(1, 2)) if form != "list-of-stacks" else 2
    k, v, table, _, _ = draw(cache_layout(B, cap, Hkv, D, dtype, layers=layers))
    if form == "list":
        k, v = list(k.unbind(0)), list(v.unbind(0))
    elif form == "list-of-stacks":
        k, v = [k[:1], k[1:]], [v[:1], v[1:]]
    if draw(st.booleans()):  # single-cache layers (MLA's latent caches)
        v = None
    parents, num_nodes = draw(trees(B=B, T=T, ragged=False))
    paths = torch.full((B, T), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        path = root_path(parents[b], draw(st.integers(0, T - 1)))
        paths[b, :len(path)] = torch.tensor(path)
        paths[b, len(path):] = draw(st.sampled_from([-1, 0, 2**31 - 1]))  # past the path: unread
        num[b] = len(path) - 1
    args = dict(k_cache=k, v_cache=v, cache_lens=torch.tensor([draw(st.integers(0, cap - T)) for _ in range(B)],
                                                              dtype=torch.int32),
                accepted_nodes=index_tensor(draw, paths), num_accepted=index_tensor(draw, num), block_table=table)
    for name in ("accepted_nodes", "num_accepted", "block_table"):
        if args[name] is not None:
            args[name] = some_layout(draw, args[name])
    args["cache_lens"] = some_layout(draw, args["cache_lens"], written=True)
    return args


@st.composite
def build_tree_cases(draw):
    parents, num_nodes = draw(trees(max_T=40))
    args = dict(parents=index_tensor(draw, parents),
                num_nodes=draw(st.sampled_from([None, index_tensor(draw, num_nodes)]))
                if bool((num_nodes == parents.shape[1]).all()) else index_tensor(draw, num_nodes))
    return {name: some_layout(draw, x) for name, x in args.items()}


def op_argument_names(name: str) -> tuple:
    """Every argument name a message of op `name` may start with."""
    import inspect
    fn = {"rollback_plan": specdec.RollbackPlan.__init__, "build_tree": specdec.build_tree,
          "tree_attention": specdec.tree_attention, "accept": specdec.accept, "kv_append": specdec.kv_append,
          "kv_rollback": specdec.kv_rollback}[name]
    names = list(inspect.signature(fn).parameters)
    if name == "rollback_plan":
        names += list(inspect.signature(specdec.RollbackPlan.run).parameters)
    if name == "accept":
        names.append("row_offsets")  # the packed offsets as the op's checks see them (internal, documented)
    return tuple(n for n in names if n != "self")


# ----------------------------------------------------------------------------------------------
# make fuzz: every property long, within a time budget
# ----------------------------------------------------------------------------------------------
def main() -> int:
    """`make fuzz`: each property of tests/fuzz/test_fuzz_*.py in a pytest process of its own, with as many examples as
    its share of FUZZ_MINUTES (default 20) allows (measured from a "ci" run of it), under `timeout` at twice the
    share; prints each one's outcome and the falsifying examples (logs under FUZZ_LOGS, default build/fuzz)."""
    import glob
    import time
    budget = float(os.environ.get("FUZZ_MINUTES", "20")) * 60
    logs = os.environ.get("FUZZ_LOGS", os.path.join(ROOT, "build", "fuzz"))
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="1", SPECDEC_FUZZ_SEED=os.environ.get(
        "SPECDEC_FUZZ_SEED", str(int.from_bytes(os.urandom(4), "little"))))
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                  "-o", "addopts="]
    files = sorted(glob.glob(os.path.join(ROOT, "tests", "fuzz", "test_fuzz_*.py")))
    listed = subprocess.run(pytest_cmd + ["--collect-only"] + files, cwd=ROOT, env=env, capture_output=True,
                            text=True).stdout.splitlines()
    tests = [line for line in listed if "::" in line]
    share = budget / max(len(tests), 1)
    print(f"fuzz: {len(tests)} properties, {share:.0f} s each, SPECDEC_FUZZ_SEED={env['SPECDEC_FUZZ_SEED']}")
    found = []
    for test in tests:
        start = time.time()
        ci = subprocess.run(pytest_cmd + [test], cwd=ROOT, env=dict(env, SPECDEC_FUZZ_PROFILE="ci"),
                            capture_output=True, text=True)
        per_example = max(time.time() - start - 5.0, 0.05) / settings.get_profile("ci").max_examples
        examples = max(settings.get_profile("ci").max_examples, int(share / per_example))
        log = os.path.join(logs, test.replace("/", "_").replace("::", "__") + ".log")
        if ci.returncode not in (0, 5):
            outcome_line, text = "FAILED (ci run)", ci.stdout + ci.stderr
        else:
            try:
                run = subprocess.run(pytest_cmd + [test], cwd=ROOT, env=dict(
                    env, SPECDEC_FUZZ_PROFILE="fuzz", SPECDEC_FUZZ_EXAMPLES=str(examples)),
                    capture_output=True, text=True, timeout=2 * share + 60)
                text = run.stdout + run.stderr
                outcome_line = f"passed {examples} examples" if run.returncode == 0 else "FAILED"
            except subprocess.TimeoutExpired as exc:
                text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                outcome_line = f"no failure within {2 * share + 60:.0f} s (timed out)"
        with open(log, "w") as f:
            f.write(text)
        print(f"  {outcome_line:<40} {test}  ({time.time() - start:.0f} s, log {os.path.relpath(log, ROOT)})",
              flush=True)
        if outcome_line.startswith("FAILED"):
            found.append((test, text))
    for test, text in found:
        print(f"\n===== {test}")
        lines = [line for line in text.splitlines() if line.startswith("E ") or "Falsifying" in line
                 or "Draw " in line or "reproduce_failure" in line]
        print("\n".join(lines[-60:]))
    print(f"\nfuzz: {len(found)} of {len(tests)} properties failed (SPECDEC_FUZZ_SEED={env['SPECDEC_FUZZ_SEED']})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
