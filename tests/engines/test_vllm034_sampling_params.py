"""accept's step 0 and filter order "vllm" against vLLM 0.34's own sampler stages (venv: vllm-0.34.0).

vLLM's model runner v2 processes a request's logits in this order (vllm/v1/worker/gpu/sample/sampler.py:
apply_sampling_params, then _sample_random): the logits processors in list order (logit bias with min-tokens'
stop tokens, then the penalties), temperature, min-p, then top-k / top-p. Its penalties kernel counts, at a
drafted position, the output so far plus the drafts before it; its min-tokens stage compares the position with
prompt_len + min_tokens. Here those stages themselves (their Triton kernels under TRITON_INTERPRET=1, the
PyTorch top-k / top-p vLLM uses on CPUs) process draft chains, and specdec's reference law at each node
(reference.penalized_row with node_penalties, then processed_keep with filter_order="vllm") must keep the same
tokens and give the same log-law; specdec's backends are tested against that reference in tests/ops/accept.
"""
import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (venv: vllm-0.34.0)", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

if not torch.cuda.is_available():  # vLLM switches Triton off unless one driver is active
    from triton.backends import backends

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)

import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler  # noqa: E402

topk_topp_sampler.HAS_TRITON = False  # (its Triton top-k / top-p does not run in the interpreter: the CPU path)

from vllm.v1.worker.gpu.sample.logit_bias import apply_logit_bias  # noqa: E402
from vllm.v1.worker.gpu.sample.min_p import apply_min_p  # noqa: E402
from vllm.v1.worker.gpu.sample.penalties import apply_penalties  # noqa: E402

from specdec import reference as ref  # noqa: E402
from specdec._layout import pack_bitmask  # noqa: E402

V = 50
PROMPT_LEN = 7


def _requests(B, T, gen):
    """Per request: a chain of T nodes (the last committed token, then T - 1 drafts) and its parameters."""
    counts = torch.zeros(B, V, dtype=torch.int32)
    for b in range(B):
        n = int(torch.randint(0, 8, (), generator=gen))
        counts[b].index_add_(0, torch.randint(0, V, (n,), generator=gen), torch.ones(n, dtype=torch.int32))
    K, S = 4, 2
    bias_ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(B)]).int()  # (vLLM: a dict)
    return dict(
        logits=torch.randn(B * T, V, generator=gen) * 2,
        tokens=torch.randint(0, V, (B, T), generator=gen),
        rep=(torch.rand(B, generator=gen) * 1.5 + 0.5), freq=torch.rand(B, generator=gen) * 1.5 - 0.5,
        pres=torch.rand(B, generator=gen) * 1.5 - 0.5, counts=counts,
        prompt=pack_bitmask(torch.rand(B, V, generator=gen) < 0.2),
        bias_ids=bias_ids, bias=torch.randn(B, K, generator=gen) * 2,
        min_tokens=counts.sum(-1) + torch.randint(0, T + 1, (B,), generator=gen).int(),
        stop=torch.stack([torch.randperm(V, generator=gen)[:S] for _ in range(B)]).int(),
        t=torch.rand(B, generator=gen) + 0.5, top_k=torch.randint(1, V + 1, (B,), generator=gen).int(),
        top_p=torch.rand(B, generator=gen) * 0.5 + 0.5, min_p=torch.rand(B, generator=gen) * 0.2)


def _vllm_processed(r, B, T):
    """vLLM's processed logits (B * T, V) of the chains: its stages, in its order, on its kernels."""
    logits = r["logits"].clone()
    req = torch.arange(B, dtype=torch.int32).repeat_interleave(T)  # expanded_idx_mapping: row -> request
    local = torch.arange(T, dtype=torch.int32).repeat(B)  # expanded_local_pos
    generated = r["counts"].sum(-1)
    pos = (PROMPT_LEN + generated - 1).repeat_interleave(T) + local  # the input token's position
    K, S = r["bias_ids"].shape[1], r["stop"].shape[1]
    apply_logit_bias(logits, req, pos, torch.zeros(B, dtype=torch.int32), torch.zeros(B, 1, dtype=torch.int32),
                     torch.full((B,), K, dtype=torch.int32), r["bias_ids"], r["bias"].float(),
                     (PROMPT_LEN + r["min_tokens"]).int(), torch.full((B,), S, dtype=torch.int32),
                     torch.zeros(B, dtype=torch.bool), r["stop"])
    apply_penalties(logits, req, r["tokens"].flatten().int(), local, r["rep"].float(), r["freq"].float(),
                    r["pres"].float(), r["prompt"], r["counts"])
    logits = logits / r["t"].repeat_interleave(T)[:, None]
    apply_min_p(logits, req, r["min_p"].float())
    return topk_topp_sampler.apply_top_k_top_p_pytorch(logits, r["top_k"].repeat_interleave(T).long(),
                                                      r["top_p"].repeat_interleave(T).float(), allow_cpu_sync=True)


def _specdec_law(r, b, i, T):
    """specdec's reference at node i of request b's chain: (kept (V,), log-law (V,))."""
    path = r["tokens"][b, 1: i + 1].tolist()  # node i's path: the drafts up to it (node 0's token excluded)
    pen = ref.node_penalties(b, path, V, r["rep"], r["freq"], r["pres"], r["counts"], r["prompt"], r["bias_ids"],
                             r["bias"], r["min_tokens"], r["stop"])
    row = ref.penalized_row(r["logits"][b * T + i], pen)
    t, k, p, m = float(r["t"][b]), int(r["top_k"][b]), float(r["top_p"][b]), float(r["min_p"][b])
    keep = ref.processed_keep(row, t, k, p, m, None, "vllm")
    return keep, ref.processed_probs(row, t, k, p, m, None, "vllm").log()


@pytest.mark.parametrize("seed", range(4))
def test_step0_and_filter_order_match_vllms_sampler(seed):
    gen = torch.Generator().manual_seed(seed)
    B, T = 6, 4
    r = _requests(B, T, gen)
    got = _vllm_processed(r, B, T)
    for b in range(B):
        for i in range(T):
            keep, law = _specdec_law(r, b, i, T)
            vllm_keep = torch.isfinite(got[b * T + i])
            assert torch.equal(vllm_keep, keep), f"request {b} node {i}: kept sets differ"
            vllm_law = torch.log_softmax(got[b * T + i].double(), 0)
            torch.testing.assert_close(vllm_law[keep], law[keep], atol=1e-5, rtol=0)


def test_min_p_before_top_p_keeps_a_different_set_than_hf_order():
    """The orders differ: logits (1.5, 1, 1, 0.5, the rest -4), top_p 0.8, min_p 0.2: vLLM's min-p drops the tail
    first, so top-p over what is left keeps 3 tokens; Hugging Face's top-p over the whole row keeps 4 -- the
    reason accept takes filter_order. vLLM's own stages keep the "vllm" set."""
    row = torch.tensor([1.5, 1.0, 1.0, 0.5] + [-4.0] * (V - 4))
    top_p, min_p = 0.8, 0.2
    vllm = ref.processed_keep(row, 1.0, 0, top_p, min_p, None, "vllm")
    assert vllm.nonzero().flatten().tolist() == [0, 1, 2]
    assert ref.processed_keep(row, 1.0, 0, top_p, min_p, None, "hf").nonzero().flatten().tolist() == [0, 1, 2, 3]
    logits = row[None].clone()
    apply_min_p(logits, torch.zeros(1, dtype=torch.int32), torch.tensor([min_p]))
    logits = topk_topp_sampler.apply_top_k_top_p_pytorch(logits, None, torch.tensor([top_p]), allow_cpu_sync=True)
    assert torch.equal(torch.isfinite(logits[0]), vllm)
