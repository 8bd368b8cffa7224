# Triton kernels run on CPU tensors through the interpreter: this must be set before triton is imported.
import os

# SPECDEC_TEST_DEVICE=cuda (bench/gpu.sh) runs the backend tests on a GPU with compiled kernels instead.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("SPECDEC_TEST_DEVICE", "cpu") == "cuda" else "1")

# The fuzz suite's hypothesis seed (tests/fuzz/strategies.py): one per session, drawn here so that the xdist
# workers, which inherit the environment, share it; SPECDEC_FUZZ_SEED=N repeats a run.
os.environ.setdefault("SPECDEC_FUZZ_SEED", str(int.from_bytes(os.urandom(4), "little")))

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_report_header(config):
    return (f"fuzz: hypothesis profile {os.environ.get('SPECDEC_FUZZ_PROFILE', 'ci')!r}, "
            f"SPECDEC_FUZZ_SEED={os.environ['SPECDEC_FUZZ_SEED']}")


def _exact_float8_and_bfloat16_casts_in_interpreter():
    """Triton's interpreter converts to and from float8 and bfloat16 with its own bit arithmetic, which is wrong
    where the GPU's cvt instructions are exact: the rounding carry is dropped (31.9 -> 16 in e4m3, not 32), ties
    do not go to even, NaN and inf patterns decode as numbers, some e5m2 subnormals decode to 0, and a bfloat16
    subnormal upcast to float32 loses its value (9.2e-41 read as 0: a greedy row of bfloat16 probabilities
    whose only allowed positive entry is subnormal emitted a banned token). Route every cast that involves
    float8e4nv / float8e5 / bfloat16 through torch's conversion (round to nearest even), as the kernels compiled
    for a GPU do; other casts keep the interpreter's code."""
    import numpy as np
    from triton.runtime import interpreter
    to_torch = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2, "fp16": torch.float16,
                "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    interpreter_convert = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        src, dst = to_torch.get(input_dtype.name), to_torch.get(output_dtype.name)
        exact = {input_dtype.name, output_dtype.name} & {"fp8e4nv", "fp8e5", "bf16"}
        if not exact or src is None or dst is None or rounding_mode not in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            return interpreter_convert(input, input_dtype, output_dtype, rounding_mode)
        x = torch.frombuffer(bytearray(np.ascontiguousarray(input).tobytes()), dtype=src)
        bits = getattr(torch, f"uint{output_dtype.primitive_bitwidth}")
        return x.to(dst).view(bits).numpy().reshape(input.shape)

    interpreter._convert_float = convert


def _device_calls_without_repatching():
    """Speed only, same semantics: the interpreter patches triton.language (hundreds of attributes) at every
    launch, then again at every call of a @triton.jit helper, though the running launch already did (about
    0.3 ms a call; the accept walker makes hundreds per request, so the chi-square tests spent a third of
    their time there). A helper call skips the re-patching only when the running launch already patched
    every language module the helper's globals hold: the launch's own, and those a first call of the
    interpreter's own path patched (e.g. triton.language.core for triton.language.standard's combine
    functions)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter
    if not (hasattr(interpreter, "GridExecutor") and hasattr(interpreter.InterpretedFunction, "rewrite")):
        return  # another interpreter layout: keep it as it is
    languages = {}
    running = []  # per nested launch: the language modules it patched

    def languages_of(fn):
        if fn not in languages:
            languages[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                      if inspect.ismodule(v) and v in (tl, tl.core))
        return languages[fn]

    launch, device_call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    def launch_recording_languages(self, *args, **kwargs):
        running.append(languages_of(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    def device_call_in_patched_launch(self, *args, **kwargs):
        if not running:
            return device_call(self, *args, **kwargs)
        if not languages_of(self.fn) <= running[-1]:
            # the interpreter's own path patches these modules, and leaves them patched (it never restores a
            # helper call's patches): later calls in this launch need not patch them again
            result = device_call(self, *args, **kwargs)
            running[-1] = running[-1] | languages_of(self.fn)
            return result
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch_recording_languages
    interpreter.InterpretedFunction.__call__ = device_call_in_patched_launch


if os.environ["TRITON_INTERPRET"] == "1":
    _exact_float8_and_bfloat16_casts_in_interpreter()
    _device_calls_without_repatching()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: more threads than the work needs only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
