# Triton kernels run on CPU tensors through the interpreter: this must be set before triton is imported.
import os

# SPECDEC_TEST_DEVICE=cuda (bench/gpu.sh) runs the backend tests on a GPU with compiled kernels instead.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("SPECDEC_TEST_DEVICE", "cpu") == "cuda" else "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _exact_float8_casts_in_interpreter():
    """Triton's interpreter converts to and from float8 with its own bit arithmetic, which is wrong where the
    GPU's cvt instructions are exact: the rounding carry is dropped (31.9 -> 16 in e4m3, not 32), ties do
    not go to even, NaN and inf patterns decode as numbers, some e5m2 subnormals decode to 0. Route every
    cast that involves float8e4nv / float8e5 through torch's conversion (round to nearest even), as the
    kernels compiled for a GPU do; other casts keep the interpreter's code."""
    import numpy as np
    from triton.runtime import interpreter
    to_torch = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2, "fp16": torch.float16,
                "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    interpreter_convert = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        src, dst = to_torch.get(input_dtype.name), to_torch.get(output_dtype.name)
        fp8 = {input_dtype.name, output_dtype.name} & {"fp8e4nv", "fp8e5"}
        if not fp8 or src is None or dst is None or rounding_mode not in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            return interpreter_convert(input, input_dtype, output_dtype, rounding_mode)
        x = torch.frombuffer(bytearray(np.ascontiguousarray(input).tobytes()), dtype=src)
        bits = getattr(torch, f"uint{output_dtype.primitive_bitwidth}")
        return x.to(dst).view(bits).numpy().reshape(input.shape)

    interpreter._convert_float = convert


if os.environ["TRITON_INTERPRET"] == "1":
    _exact_float8_casts_in_interpreter()


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
