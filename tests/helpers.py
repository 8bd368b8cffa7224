"""Shared test utilities: random trees, caches in both layouts, poisoning, tolerances, backend lists."""
from __future__ import annotations

import os

import numpy as np
import torch

import specdec.ops

# Device of the backend tests: "cpu" (default: Triton through the interpreter, C++ when built) or "cuda"
# (bench/gpu.sh sets SPECDEC_TEST_DEVICE=cuda: compiled Triton on the GPU, TRITON_INTERPRET=0).
DEVICE = torch.device(os.environ.get("SPECDEC_TEST_DEVICE", "cpu"))

# Backends tested against the reference: Triton always, C++ when it is built (CPU only).
BACKENDS = ["triton"] + (["cpp"] if specdec.ops.HAS_CPP and DEVICE.type == "cpu" else [])
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]  # KV caches only

# (atol, rtol) for results computed in fp32 and rounded to the dtype, compared with a float64 reference.
TOL = {torch.float64: (1e-9, 1e-9), torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
       torch.bfloat16: (1.6e-2, 1.6e-2)}


def transformers_or_skip():
    """transformers (imported so that Hugging Face's `kernels` package, not the checkout's `kernels/` folder, is what
    it finds: bench.e2e.import_transformers), or the test skips where it is not installed."""
    import pytest
    from bench.e2e import import_transformers
    try:
        return import_transformers()
    except ImportError as exc:
        pytest.skip(f"transformers not available ({exc})")


def to_device(*tensors):
    """Inputs built on the CPU (seeded generators) as copies on DEVICE with the same strides (Tensor.to would
    make a view with gaps contiguous, e.g. K sliced from K|V); a tensor already there, None or a non-tensor
    is returned as is. One argument gives one result, several a tuple."""
    def move(t):
        if not isinstance(t, torch.Tensor) or t.device == DEVICE:
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=DEVICE).copy_(t)

    moved = tuple(move(t) for t in tensors)
    return moved[0] if len(moved) == 1 else moved


def on_backend(backend: str, args: dict) -> dict:
    """An op's keyword arguments as `backend` gets them: the reference gets the CPU tensors themselves, any
    other backend copies on DEVICE with the same strides (non-tensors pass through)."""
    return args if backend == "torch" else {name: to_device(x) for name, x in args.items()}


def accept_on(backend: str, **args):
    """specdec.accept on `backend` (inputs as on_backend gives them); the result on the CPU."""
    return specdec.ops.AcceptResult(*(x.cpu() for x in specdec.accept(**on_backend(backend, args), backend=backend)))


def assert_close(actual, expected, dtype=None):
    atol, rtol = TOL[dtype or actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def random_parents(T: int, kind: str, gen: torch.Generator) -> list[int]:
    """One tree of T nodes: 'chain', 'star' (all children of the root) or 'random'."""
    if kind == "chain":
        return [-1] + list(range(T - 1))
    if kind == "star":
        return [-1] + [0] * (T - 1)
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def random_trees(B: int, T: int, gen: torch.Generator, kinds=("chain", "star", "random"), ragged=True):
    """parents (B, T) int64 and num_nodes (B,) int32; padding nodes' parents are -1."""
    parents = torch.full((B, T), -1, dtype=torch.int64)
    num_nodes = torch.full((B,), T, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(1, T + 1, (1,), generator=gen)) if ragged and b % 2 == 1 else T
        kind = kinds[b % len(kinds)]
        parents[b, :n] = torch.tensor(random_parents(n, kind, gen))
        num_nodes[b] = n
    return parents, num_nodes


def root_path(parents_row, node: int) -> list[int]:
    """Node indices from the root down to `node`, for one tree given by its parents row."""
    path = []
    while node != -1:
        path.append(node)
        node = int(parents_row[node])
    return path[::-1]


def random_root_paths(parents: torch.Tensor, gen: torch.Generator):
    """A path from the root to a random node of each tree: (B, T) int32 padded with -1, and (B,) num_accepted."""
    B, T = parents.shape
    paths = torch.full((B, T), -1, dtype=torch.int32)
    num_accepted = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        path = root_path(parents[b], int(torch.randint(0, T, (1,), generator=gen)))
        paths[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted[b] = len(path) - 1
    return paths, num_accepted


def to_paged(logical: torch.Tensor, block_size: int, gen: torch.Generator, spare_blocks: int = 3):
    """(B, cap, H, D) logical cache -> (num_blocks, block_size, H, D) paged cache with a shuffled block
    table (B, cap // block_size) int32; spare blocks nobody owns are filled with NaN."""
    B, cap, H, D = logical.shape
    assert cap % block_size == 0
    per = cap // block_size
    num_blocks = B * per + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)[: B * per]
    table = order.view(B, per).to(torch.int32)
    paged = torch.full((num_blocks, block_size, H, D), float("nan"), dtype=logical.dtype)
    paged[table.view(-1).long()] = logical.reshape(B * per, block_size, H, D)
    return paged, table


def as_form(stack: torch.Tensor, form: str):
    """A (layers, ...) cache stack as kv_rollback's callers pass it: "layer" (one 4-D layer), "stacked", "list" (of
    layers) or "list-of-stacks"."""
    if form == "layer":
        return stack[0]
    if form == "stacked":
        return stack
    if form == "list":
        return list(stack.unbind(0))
    return [stack[:1], stack[1:]]


def from_paged(paged: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_paged`: the (B, cap, H, D) logical view."""
    B, per = table.shape
    return paged[table.view(-1).long()].reshape(B, per * paged.shape[1], *paged.shape[2:])


def random_cache(B: int, cap: int, H: int, D: int, dtype, gen: torch.Generator):
    """A logical (B, cap, H, D) cache of N(0, 1) values."""
    return torch.randn(B, cap, H, D, generator=gen).to(dtype)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with values no correct kernel writes (NaN / a sentinel), in place."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-12345)


def compile_for_hopper(fn, types: dict, constexprs: dict, divisible=None, num_warps: int = 4, num_stages: int = 3):
    """triton.compile of a @triton.jit `fn` for sm_90 (no GPU needed), specialized as a launch on engine shapes
    would be: arguments not in `types` are int32, `constexprs` are baked in, and the arguments for which
    `divisible(name)` holds (default: every non-constexpr one) are marked 16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    divisible = divisible or (lambda name: True)
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}
    attrs = {(j,): [["tt.divisibility", 16]] for j, name in enumerate(fn.arg_names)
             if name not in constexprs and divisible(name)}
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(kernel) -> tuple:
    """(registers, spilled bytes) per thread of a kernel compiled by compile_for_hopper, from Triton's cuobjdump;
    (None, None) without the tool."""
    import re
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def needs_the_compiler(test):
    """An offline compile check (compile_for_hopper): skipped without Triton's CUDA backend, and on a GPU machine,
    which runs the compiled kernels for real."""
    import pytest
    import triton
    test = pytest.mark.skipif("nvidia" not in getattr(triton.backends, "backends", {}),
                              reason="no Triton CUDA backend")(test)
    return pytest.mark.skipif(DEVICE.type == "cuda",
                              reason="an offline compile check; on a GPU the kernels run for real")(test)


def report_from_fresh_process(call: str, timeout: int = 600):
    """Runs `call` (e.g. "from tests.test_x import report; report(...)", which prints one JSON line) in a new
    Python process without TRITON_INTERPRET, and returns the parsed last line of its output.

    Compiling for a GPU needs a process of its own: a test session runs with TRITON_INTERPRET=1, whose patches
    of Triton's language module (made by whichever interpreted kernel ran first) break the compiler."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", call], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


class MemorySpy:
    """Records every element address the Triton interpreter loads from or stores to (masked-off lanes
    excluded): what a kernel really reads and writes, element by element."""

    def __init__(self, monkeypatch):
        from triton.runtime import interpreter
        self.loads, self.stores = [], []
        builder = interpreter.InterpreterBuilder
        load, store = builder.create_masked_load, builder.create_masked_store

        def spy_load(b, ptrs, mask, *args):
            self.loads.append(ptrs.data[mask.data].copy())
            return load(b, ptrs, mask, *args)

        def spy_store(b, ptrs, value, mask, *args):
            self.stores.append(ptrs.data[mask.data].copy())
            return store(b, ptrs, value, mask, *args)

        monkeypatch.setattr(builder, "create_masked_load", spy_load)
        monkeypatch.setattr(builder, "create_masked_store", spy_store)

    @staticmethod
    def inside(addresses, tensors):
        addresses = np.concatenate(addresses).astype(np.int64)
        keep = np.zeros(addresses.shape, dtype=bool)
        for t in tensors:  # the whole storage: a view's neighbours (V beside K in one buffer) count too
            start = t.untyped_storage().data_ptr()
            keep |= (addresses >= start) & (addresses < start + t.untyped_storage().nbytes())
        return addresses[keep]

    def counts(self, tensors):
        """{element address: times loaded} inside `tensors` (their whole storage)."""
        addresses = self.inside(self.loads or [np.zeros(0, dtype=np.int64)], tensors)
        values, counts = np.unique(addresses, return_counts=True)
        return dict(zip(values.tolist(), counts.tolist()))


def element_addresses(t: torch.Tensor) -> torch.Tensor:
    """int64 tensor shaped like `t`: the byte address of each of its elements."""
    index = torch.as_strided(torch.arange(t.untyped_storage().nbytes() // t.element_size()), t.shape, t.stride(),
                             t.storage_offset())
    return t.untyped_storage().data_ptr() + index * t.element_size()


class ReplayGraph:
    """CUDA-graph semantics on the CPU, with decoding.CudaStepGraph's interface: constructing it runs fn once,
    recording every dispatched op with its tensor arguments and results; replay() runs the recorded ops again
    on those same tensors, writing each fresh result into the recorded one, with no Python in between. So a
    step that keeps state in Python (a number, or a tensor attribute replaced instead of written into) goes
    stale on replay as it would under a CUDA graph, and a host read inside fn (.item(), .tolist(), bool())
    raises, as a sync inside a capture does."""

    HOST_READS = {torch.ops.aten._local_scalar_dense.default}

    def __init__(self, fn, pool=None):
        from torch.utils._python_dispatch import TorchDispatchMode
        ops = self.ops = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in ReplayGraph.HOST_READS:
                    raise RuntimeError(f"host read inside a captured step ({func})")
                out = func(*args, **(kwargs or {}))
                ops.append((func, args, kwargs or {}, out))
                return out

        with Record():
            fn()

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            returns = func._schema.returns
            outs = out if isinstance(out, (tuple, list)) else (out,)
            fresh_outs = [r.alias_info is None or (not r.alias_info.is_write and not _aliases_an_input(o, args))
                          for r, o in zip(returns, outs)]  # (reshape may alias its input, or copy it)
            writes = any(r.alias_info is not None and r.alias_info.is_write for r in returns)
            if returns and not writes and not any(fresh_outs):
                continue  # views: the recorded ones still alias the recorded (refreshed) tensors
            fresh = func(*args, **kwargs)
            news = fresh if isinstance(out, (tuple, list)) else (fresh,)
            for is_fresh, o, n in zip(fresh_outs, outs, news):
                if is_fresh and isinstance(o, torch.Tensor):
                    o.copy_(n)

    @staticmethod
    def new_pool(device):
        return None


def _aliases_an_input(t, args) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    ptr = t.untyped_storage().data_ptr()
    flat = [a for arg in args for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
    return any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr for a in flat)
