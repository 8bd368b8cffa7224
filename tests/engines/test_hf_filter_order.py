"""accept's filter_order="hf" against Hugging Face transformers' own sampling warpers (venv: vllm-0.34.0, which
holds transformers 5.22 as a vLLM dependency): the list `GenerationMixin._get_logits_processor` builds for a
sampling GenerationConfig (temperature, top-k, top-p over what top-k kept, min-p), applied to random rows, keeps
the tokens specdec's reference keeps (reference.processed_keep with filter_order="hf")."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.generation.utils import GenerationMixin  # noqa: E402

from specdec import reference as ref  # noqa: E402

V = 40


class _Generator(GenerationMixin):
    """Just the mixin: building the logits processors reads the GenerationConfig only."""


def _hf_warpers(t, top_k, top_p, min_p):
    """The processors transformers' generate builds for these parameters, in its order."""
    model = _Generator.__new__(_Generator)
    config = transformers.GenerationConfig(do_sample=True, temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    return model._get_logits_processor(generation_config=config, input_ids_seq_length=1)


@pytest.mark.parametrize("seed", range(3))
def test_filter_order_hf_keeps_transformers_set(seed):
    gen = torch.Generator().manual_seed(seed)
    orders_differ = False
    for _ in range(12):
        N = 16
        logits = torch.randn(N, V, generator=gen) * 2
        t = float(torch.rand((), generator=gen)) + 0.5
        top_k = int(torch.randint(1, V, (), generator=gen))
        top_p = float(torch.rand((), generator=gen)) * 0.6 + 0.4
        min_p = float(torch.rand((), generator=gen)) * 0.3
        processors = _hf_warpers(t, top_k, top_p, min_p)
        assert [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                          "TopPLogitsWarper", "MinPLogitsWarper"]
        kept = torch.isfinite(processors(torch.zeros(N, 1, dtype=torch.long), logits.clone()))
        for i in range(N):
            want = ref.processed_keep(logits[i], t, top_k, top_p, min_p, None, "hf")
            assert torch.equal(kept[i], want), f"row {i} (t={t:.3f}, k={top_k}, p={top_p:.3f}, min_p={min_p:.3f})"
            orders_differ |= not torch.equal(want, ref.processed_keep(logits[i], t, top_k, top_p, min_p, None,
                                                                      "vllm"))
    assert orders_differ  # (the rows tell "hf" from "vllm")
