"""venv: vllm-0.34.0 (.venv-engines/vllm-0.34.0, which holds flashinfer-python 0.7.4).
specdec.integrations.flashinfer against FlashInfer 0.7.4's own code.

FlashInfer's chain kernel is CUDA-only (JIT); on a CPU machine its signature, its docstring example and its
Python-side checks of seed / offset are what can be run: the signature equals ours, the docstring example gives
its documented outputs through ours, and ours accepts exactly the seed / offset forms FlashInfer's validator
accepts. The counters (FlashInfer's sampling.cuh, ChainSpeculativeSampling) are pinned in tests/integrations/test_integrations.py.
"""
from __future__ import annotations

import doctest
import inspect
import typing

import pytest
import torch

if pytest.importorskip("flashinfer").__version__ != "0.7.4":  # (SGLang's venv holds 0.7.2, another signature)
    pytest.skip("written against FlashInfer 0.7.4 (venv vllm-0.34.0)", allow_module_level=True)
fi_sampling = pytest.importorskip("flashinfer.sampling")

from specdec.integrations import flashinfer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")


def _signature(f):
    names = {"torch": torch, **{n: getattr(typing, n) for n in ("Optional", "Union", "Tuple")}}
    return inspect.signature(f, eval_str=True, globals={**getattr(f, "__globals__", {}), **names})


def test_signature_equals_flashinfers():
    assert _signature(flashinfer.chain_speculative_sampling) == _signature(fi_sampling.chain_speculative_sampling)


def test_flashinfers_docstring_example_through_ours():
    """The example in FlashInfer's docstring, run with our function on the CPU (its `.to(0)` dropped): the
    documented outputs (drafts 2 accepted surely, 1 rejected surely, the correction 0, counters 1 and 1)."""
    examples = doctest.DocTestParser().get_examples(fi_sampling.chain_speculative_sampling.__doc__)
    scope = {"torch": torch, "flashinfer": type("flashinfer", (), {"sampling": flashinfer})}
    checked = 0
    for example in examples:
        source = example.source.replace(".to(0)", "")
        if example.want.strip():
            want = eval(example.want.replace("device='cuda:0', ", "").replace(", device='cuda:0'", ""),
                        {"tensor": torch.tensor, "torch": torch})
            assert eval(source, scope).tolist() == want.tolist(), source
            checked += 1
        elif "import" not in source:
            exec(source, scope)
    assert checked == 3


SEED_OFFSET_FORMS = {
    "ints": (5, 7),
    "per-row tensors": (torch.arange(4), torch.arange(4) * 2),
    "length-1 tensors": (torch.tensor([5]), torch.tensor([7])),
    "uint64 tensors": (torch.arange(4).to(torch.uint64), torch.zeros(4, dtype=torch.uint64)),
    "tensor and int": (torch.arange(4), 7),
    "int and tensor": (5, torch.arange(4)),
    "int32 seed": (torch.arange(4, dtype=torch.int32), torch.arange(4)),
    "2-D offset": (torch.arange(4), torch.zeros(4, 1, dtype=torch.int64)),
    "wrong length": (torch.arange(3), torch.arange(3)),
}


@pytest.mark.parametrize("form", list(SEED_OFFSET_FORMS))
def test_seed_and_offset_forms_as_flashinfers_validator(form):
    """Ours raises (naming seed / offset) exactly where FlashInfer's _validate_and_convert_seed_offset does."""
    B, S, V = 4, 2, 5
    seed, offset = SEED_OFFSET_FORMS[form]
    try:
        fi_sampling._validate_and_convert_seed_offset(seed, offset, torch.device("cpu"), B)
        theirs_raise = False
    except ValueError:
        theirs_raise = True
    gen = torch.Generator().manual_seed(0)
    draft = torch.softmax(torch.randn(B, S, V, generator=gen), -1)
    target = torch.softmax(torch.randn(B, S + 1, V, generator=gen), -1)
    ids = torch.randint(0, V, (B, S), generator=gen)
    if theirs_raise:
        with pytest.raises((ValueError, TypeError), match="^(seed|offset|seed, offset): "):
            flashinfer.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    else:
        out, accepted, emitted = flashinfer.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
        assert out.shape == (B, S + 1) and (accepted >= emitted).all()
