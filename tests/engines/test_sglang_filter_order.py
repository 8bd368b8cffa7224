"""venv: sglang-0.5.23 (.venv-engines/sglang-0.5.23). accept's filter_order="sglang" against SGLang 0.5.23's own
sampler (sglang/srt/layers/sampler.py: top_k_top_p_min_p_sampling_from_probs_torch, its PyTorch path): top-k and
top-p on the sorted probabilities, top-p's mass not renormalized after top-k, then min-p against the top
probability. Its filtered weights give the kept set, which must be specdec's reference set
(reference.processed_keep with filter_order="sglang") on random rows (no ties: SGLang's sort-based top-k keeps
exactly k tokens where specdec keeps the ties at the k-th value)."""
from __future__ import annotations

import pytest
import torch

sglang_sampler = pytest.importorskip("sglang.srt.layers.sampler")

from specdec import reference as ref  # noqa: E402

V = 40


@pytest.mark.parametrize("seed", range(3))
def test_filter_order_sglang_keeps_sglangs_set(seed):
    gen = torch.Generator().manual_seed(seed)
    N = 64
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 2
    t = torch.rand(N, generator=gen, dtype=torch.float64) + 0.5
    top_k = torch.randint(1, V + 1, (N,), generator=gen)
    top_p = torch.rand(N, generator=gen, dtype=torch.float64) * 0.6 + 0.4
    min_p = torch.rand(N, generator=gen, dtype=torch.float64) * 0.3
    probs = torch.softmax(logits / t[:, None], -1)
    _, weights, ids, _ = sglang_sampler.top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(), top_k.int(), top_p, min_p, True, None, torch.zeros(N, dtype=torch.int64),
        return_filtered_probs=True)
    kept = torch.zeros(N, V, dtype=torch.bool)
    kept.scatter_(1, ids.long(), weights > 0)
    for i in range(N):
        want = ref.processed_keep(logits[i], float(t[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]), None,
                                  "sglang")
        assert torch.equal(kept[i], want), f"row {i}"
    orders = {o: torch.stack([ref.processed_keep(logits[i], float(t[i]), int(top_k[i]), float(top_p[i]),
                                                 float(min_p[i]), None, o) for i in range(N)])
              for o in ("hf", "vllm")}
    assert all(not torch.equal(kept, keep) for keep in orders.values())  # (the rows tell the orders apart)
