"""vLLM 0.33.0's own rejection-sampler tests (tests/v1/sample/test_rejection_sampler.py, vendored unchanged in
tests/engines/vllm033/) run against specdec.integrations.vllm.RejectionSampler: the import swap, tested by the
peer's assertions.

venv: vllm-0.33.0

The shim: vLLM's test module imports RejectionSampler from vllm.v1.sample.rejection_sampler; that attribute is
specdec's class while the module is imported (and vLLM's again after); vLLM's helper module
tests.v1.sample.utils is the vendored copy; and, for a machine without a GPU, the tests' DEVICE_TYPE is "cpu"
where vLLM finds no platform and vLLM's penalties do not pin memory. Everything else in the file is vLLM's:
its Mock(spec=Sampler) that supplies the bonus tokens, SpecDecodeMetadata.make_dummy, SamplingMetadata,
LogitsProcessors, and its Triton kernels (sample_recovered_tokens) under TRITON_INTERPRET=1.

Expected failures (refused, each named at construction): the FLy tests (lossy "fly" verification) and the
synthetic-rate tests (lossy "synthetic" mode).
"""
import importlib.util
import os
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("vllm") is None:  # (before touching triton's drivers)
    pytest.skip("vllm is not installed (venv: vllm-0.33.0)", allow_module_level=True)
triton_backends = pytest.importorskip("triton.backends")
# vLLM switches Triton off unless exactly one GPU driver is active: mark NVIDIA's active (the interpreter runs it)
triton_backends.backends["nvidia"].driver.is_active = staticmethod(lambda: True)
vllm_rejection_sampler = pytest.importorskip("vllm.v1.sample.rejection_sampler")

from specdec.integrations import vllm as specdec_vllm  # noqa: E402
from tests.engines.vllm033 import vllm_tests_v1_sample_utils  # noqa: E402

sys.modules.setdefault("tests.v1.sample.utils", vllm_tests_v1_sample_utils)
_vllm_class = vllm_rejection_sampler.RejectionSampler
vllm_rejection_sampler.RejectionSampler = specdec_vllm.RejectionSampler
try:
    from tests.engines.vllm033.vllm_test_rejection_sampler import *  # noqa: E402,F401,F403
    from tests.engines.vllm033 import vllm_test_rejection_sampler as vllm_tests  # noqa: E402
finally:
    vllm_rejection_sampler.RejectionSampler = _vllm_class
# vLLM's tests put their tensors on current_platform.device_type, '' on a machine without a GPU: the CPU here
vllm_tests.DEVICE_TYPE = vllm_tests.DEVICE_TYPE or "cpu"

REFUSED = ("test_fly_", "test_synthetic_")


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    """vLLM's penalties pin host buffers when its platform says it may; pinning needs a GPU driver."""
    for module in ("vllm.utils.torch_utils", "vllm.v1.sample.ops.penalties"):
        monkeypatch.setattr(f"{module}.PIN_MEMORY", False)


@pytest.fixture(autouse=True)
def _refused_modes_fail_by_name(request):
    """The FLy and synthetic tests construct the lossy modes: specdec refuses them with a ValueError naming
    them, so they are expected to fail with exactly that error (strict: a pass would be news)."""
    if request.node.name.startswith(REFUSED):
        request.node.add_marker(pytest.mark.xfail(raises=ValueError, strict=True,
                                                  reason="specdec refuses lossy 'fly' / 'synthetic' by name"))


def test_the_swap_reached_vllm_tests():
    assert vllm_tests.RejectionSampler is specdec_vllm.RejectionSampler
    assert vllm_rejection_sampler.RejectionSampler is _vllm_class
