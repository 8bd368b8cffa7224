"""Drop-in entry points with the peers' own signatures, argument order, dtypes, in-place outputs and return
layouts: swapping the import is the integration.

  specdec.integrations.flashinfer.chain_speculative_sampling       (flashinfer.sampling, 0.7.4)
  specdec.integrations.sglang.chain_speculative_sampling_triton,
  specdec.integrations.sglang.verify_tree_greedy, verify_tree_greedy_cpu,
  specdec.integrations.sglang.tree_speculative_sampling_target_only (SGLang 0.5.23's speculative ops)
  specdec.integrations.vllm.RejectionSampler, rejection_sample      (vllm.v1.sample.rejection_sampler, 0.33)
  specdec.integrations.vllm_mrv2.RejectionSampler                   (vLLM 0.34's model runner: MRv2), and
  specdec.integrations.vllm_plugin.register                         (the `vllm.general_plugins` entry point)

None of them imports its peer at import time; the vLLM ones call vLLM's own functions (logits processors,
logprobs, its SamplerOutput) inside the calls that run in vLLM. Each maps the peer's layout onto `specdec.accept`
(the same output law); where the peer takes its randomness from outside (uniform samples, a torch.Generator), the
entry point derives specdec's per-request seeds from it, on the device, and says so in its docstring. vLLM's packed
rows are gathered into accept's padded (B, T, V) layout (one gather per call), and FlashInfer's chains get one
row appended. Every backend now reads accept's packed form (cu_num_nodes) and probabilities in place; the copy stays
for now: vLLM's and FlashInfer's draft_probs have no row for a chain's last node (and vLLM's filters are
applied to a copy of the target's rows).
"""
from __future__ import annotations

import torch

_SEED_SPAN = 2**62


def seeds_from(generator, batch: int, device) -> torch.Tensor:
    """(batch,) int64 seeds drawn from `generator` (None: torch's default one for `device`), on the device:
    a fresh, independent stream per call and per request, advancing the generator, with no host sync."""
    return torch.randint(0, _SEED_SPAN, (batch,), generator=generator, device=device, dtype=torch.int64)
