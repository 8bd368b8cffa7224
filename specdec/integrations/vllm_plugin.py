"""A vLLM general plugin (entry-point group `vllm.general_plugins`) that makes vLLM 0.34's model runner (MRv2)
verify drafts with specdec.integrations.vllm_mrv2.RejectionSampler.

vLLM calls `register()` in every process it starts. It does nothing unless the environment variable
SPECDEC_VLLM_REJECTION_SAMPLER is "1": installing specdec alone leaves vLLM's behaviour unchanged. With it on,
`register()` rebinds the name `RejectionSampler` in `vllm.v1.worker.gpu.model_runner`, the name the runner's
`load_model` looks up when it builds its rejection sampler, to specdec's class (a model state's
`custom_sampler` still wins, as in vLLM). Loading it twice is harmless.

    SPECDEC_VLLM_REJECTION_SAMPLER=1 vllm serve ... --speculative-config '{...}'
"""
from __future__ import annotations

import os

ENV_SETTING = "SPECDEC_VLLM_REJECTION_SAMPLER"


def enabled() -> bool:
    """Whether the environment asks for specdec's rejection sampler."""
    return os.environ.get(ENV_SETTING, "0") == "1"


def register() -> None:
    """vLLM's plugin hook: with SPECDEC_VLLM_REJECTION_SAMPLER=1, the model runner builds specdec's sampler."""
    if not enabled():
        return
    from vllm.v1.worker.gpu import model_runner

    from .vllm_mrv2 import RejectionSampler

    model_runner.RejectionSampler = RejectionSampler
