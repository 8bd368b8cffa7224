# Triton kernels run on CPU tensors through the interpreter: this must be set before triton is imported.
import os

# SPECDEC_TEST_DEVICE=cuda (bench/gpu.sh) runs the backend tests on a GPU with compiled kernels instead.
os.environ.setdefault("TRITON_INTERPRET", "0" if os.environ.get("SPECDEC_TEST_DEVICE", "cpu") == "cuda" else "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine: more threads only wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
