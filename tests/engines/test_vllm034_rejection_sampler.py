"""specdec.integrations.vllm_mrv2.RejectionSampler against vLLM 0.34's own model-runner-v2 RejectionSampler,
on vLLM's real objects (SpeculativeConfig, Sampler with its states, InputBatch, DraftLogitsCache, SamplerOutput),
vLLM's Triton kernels running under TRITON_INTERPRET=1. venv: vllm-0.34.0.

vLLM's kernels are slow under the interpreter (about 0.1 s per request), so its sampled runs are small; the laws
of both are checked against the exact law, and the mean accepted lengths against each other with a statistical
margin (the two implement the same verifier, so their means are equal in expectation).

On a machine without a GPU: vLLM's Triton kernels run under TRITON_INTERPRET=1 with the NVIDIA driver marked
active before vllm is imported (vLLM switches Triton off otherwise), and vLLM's host-to-device buffers use
their explicit-copy fallback without pinned memory, top-k / top-p masking takes its PyTorch path (vLLM's own on
CPUs), and libdevice.log1p, a stub under the interpreter, is tl.log(1 + x).
"""
import importlib.util
import inspect
import math
import os
import sys

import pytest

# (not importorskip: vllm is imported below, once the NVIDIA driver is marked active)
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (venv: vllm-0.34.0)", allow_module_level=True)

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    from triton.backends import backends

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)

import vllm.v1.worker.gpu.buffer_utils as buffer_utils  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

if not torch.cuda.is_available():
    buffer_utils.is_uva_available = lambda: False
    buffer_utils.is_pin_memory_available = lambda: False
    current_platform.device_type = "cpu"
    import vllm.utils.torch_utils as torch_utils

    torch_utils.PIN_MEMORY = False
    # vLLM's Triton top-k/top-p kernel does not run under the interpreter: its PyTorch path (vLLM's on CPUs)
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False
    # libdevice's functions are stubs under the interpreter; the rejection kernels' one, log1p, from tl.log
    import triton.language as tl
    import triton.language.extra.libdevice as libdevice

    libdevice.log1p = lambda x: tl.log(1.0 + x)

from vllm.config import SpeculativeConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu.sample.sampler import Sampler  # noqa: E402
from vllm.v1.worker.gpu.sample.output import SamplerOutput  # noqa: E402
from vllm.v1.worker.gpu.spec_decode import rejection_sampler as vllm_rs  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.draft_logits import DraftLogitsCache  # noqa: E402
from vllm.v1.worker.gpu.states import RequestState  # noqa: E402

from specdec.integrations import vllm_mrv2, vllm_plugin  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from stats import assert_law, chi_square_pvalue  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PREFILL_LEN = 4


def make_spec_config(num_drafts: int, method: str = "standard") -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=num_drafts, prompt_lookup_max=3,
                             prompt_lookup_min=1, rejection_sample_method=method)


def make_sampler(num_reqs: int, vocab_size: int, num_drafts: int, logprobs_mode: str = "raw_logprobs") -> Sampler:
    """The runner's Sampler (load_model's arguments) over its own RequestState."""
    req_states = RequestState(num_reqs, 64, num_reqs * (num_drafts + 1), num_drafts, vocab_size, DEVICE)
    return Sampler(VllmConfig(), num_reqs, vocab_size, DEVICE, req_states, logprobs_mode=logprobs_mode,
                   num_speculative_tokens=num_drafts + 1)


def admit(sampler: Sampler, params: list) -> None:
    """Admit requests 0.. with these SamplingParams, past their prefill of PREFILL_LEN tokens, as the runner
    does (add_request, then the staged writes)."""
    for i, p in enumerate(params):
        sampler.add_request(i, p)
        sampler.req_states.prefill_len.np[i] = PREFILL_LEN
    sampler.req_states.prefill_len.copy_to_uva()
    sampler.apply_staged_writes()


def decode_batch(last_tokens: torch.Tensor, drafts: torch.Tensor, start: int = PREFILL_LEN) -> InputBatch:
    """A decode step's InputBatch as the runner builds it: request b (request state b) feeds its last sampled
    token then its drafts at positions start, start + 1, ...; every token is a logits row. A start below
    PREFILL_LEN makes the drafts placeholders (the batch then has a prefill)."""
    B, k = drafts.shape
    n = k + 1
    N = B * n
    input_ids = torch.cat([last_tokens.view(B, 1), drafts], 1).reshape(-1).to(torch.int32).to(DEVICE)
    positions = (start + torch.arange(n)).repeat(B).to(torch.int64).to(DEVICE)
    idx_np = np.arange(B, dtype=np.intp)
    cu_np = np.arange(0, N + 1, n, dtype=np.int32)
    seq_lens_np = np.full(B, start + n, dtype=np.int32)
    prefilling = np.full(B, start < PREFILL_LEN)
    query_start_loc = torch.from_numpy(cu_np).to(DEVICE)
    return InputBatch(
        req_ids=[f"req{b}" for b in range(B)], num_reqs=B, num_reqs_after_padding=B,
        idx_mapping=torch.arange(B, device=DEVICE), idx_mapping_np=idx_np,
        expanded_idx_mapping=torch.arange(B, device=DEVICE).repeat_interleave(n),
        expanded_local_pos=torch.arange(n, dtype=torch.int32).repeat(B).to(DEVICE),
        num_scheduled_tokens=np.full(B, n, dtype=np.int32), num_tokens=N, num_tokens_after_padding=N,
        num_draft_tokens=B * k, num_draft_tokens_per_req=np.full(B, k, dtype=np.int32),
        query_start_loc=query_start_loc, query_start_loc_np=cu_np.copy(),
        seq_lens=torch.from_numpy(seq_lens_np).to(DEVICE), seq_lens_cpu_upper_bound=torch.from_numpy(seq_lens_np),
        dcp_local_seq_lens=None, num_computed_tokens_np=np.full(B, start, dtype=np.int32),
        prefill_len_np=np.full(B, PREFILL_LEN, dtype=np.int32),
        num_computed_prefill_tokens_np=np.full(B, min(start, PREFILL_LEN), dtype=np.int32),
        is_prefilling_np=prefilling, has_prefill=bool(prefilling.any()), decode_graph_eligible=True,
        input_ids=input_ids, positions=positions, is_padding=torch.zeros(N, dtype=torch.bool, device=DEVICE),
        logits_indices=torch.arange(N, device=DEVICE), cu_num_logits=torch.from_numpy(cu_np).to(DEVICE),
        cu_num_logits_np=cu_np, has_structured_output_reqs=False, prompt_lens=None)


def draft_cache(draft_logits: torch.Tensor) -> DraftLogitsCache:
    """A replicated DraftLogitsCache holding request b's pre-temperature draft logits of step j at [b, j]."""
    B, k, V = draft_logits.shape
    cache = DraftLogitsCache(B, k, V, dtype=torch.float32, fill=0.0, device=DEVICE)
    cache.values.copy_(draft_logits)
    return cache


def _unannotated(sig: inspect.Signature) -> inspect.Signature:
    """A signature's names, kinds and defaults (vLLM annotates with its own classes, which specdec cannot name
    without importing vllm)."""
    return sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                       return_annotation=inspect.Signature.empty)


@pytest.mark.parametrize("method", ["__init__", "__call__"])
def test_signature_is_vllms(method):
    ours = inspect.signature(getattr(vllm_mrv2.RejectionSampler, method))
    theirs = inspect.signature(getattr(vllm_rs.RejectionSampler, method))
    assert _unannotated(ours) == _unannotated(theirs)


def _pair(num_reqs, vocab_size, num_drafts, params, method="standard", logprobs_mode="raw_logprobs"):
    """(ours, vLLM's) rejection samplers over one real Sampler, built as the runner builds them (before any
    request is admitted), then the requests admitted."""
    sampler = make_sampler(num_reqs, vocab_size, num_drafts, logprobs_mode)
    config = make_spec_config(num_drafts, method)
    ours = vllm_mrv2.RejectionSampler(sampler, config, DEVICE)
    theirs = vllm_rs.RejectionSampler(sampler, config, DEVICE)
    admit(sampler, params)
    return ours, theirs, sampler


def _assert_same_output(ours, theirs):
    """Same num_sampled / num_rejected, and the same tokens up to num_sampled (vLLM leaves the rest unwritten)."""
    assert isinstance(ours, SamplerOutput)
    assert torch.equal(ours.num_sampled, theirs.num_sampled)
    assert torch.equal(ours.num_rejected, theirs.num_rejected)
    valid = torch.arange(ours.sampled_token_ids.shape[1]) < ours.num_sampled.long().unsqueeze(1)
    assert torch.equal(ours.sampled_token_ids[valid], theirs.sampled_token_ids[valid])


def _assert_same_logprobs(ours, theirs):
    """The logprobs vLLM's consumers read (LogprobsLists.slice_request: each request's first num_sampled rows):
    the same token ids and ranks, logprobs to 1e-5 (accept computes raw ones in its own kernel)."""
    lp, vllm_lp = ours.logprobs_tensors, theirs.logprobs_tensors
    cu = vllm_lp.cu_num_generated_tokens or list(range(len(ours.num_sampled) + 1))
    assert lp.cu_num_generated_tokens == vllm_lp.cu_num_generated_tokens
    rows = torch.cat([torch.arange(cu[b], cu[b] + int(n)) for b, n in enumerate(theirs.num_sampled)])
    assert torch.equal(lp.logprob_token_ids[rows], vllm_lp.logprob_token_ids[rows])
    assert torch.equal(lp.selected_token_ranks[rows], vllm_lp.selected_token_ranks[rows])
    torch.testing.assert_close(lp.logprobs[rows], vllm_lp.logprobs[rows], rtol=0, atol=1e-5)


def _greedy_batch(B, k, V, match):
    """Logits and drafts where request b's first match[b] drafts equal the target's argmax."""
    logits = torch.randn(B * (k + 1), V)
    argmax = logits.view(B, k + 1, V).argmax(-1)
    drafts = torch.randint(0, V, (B, k))
    for b, m in enumerate(match):
        drafts[b, :m] = argmax[b, :m]
        if m < k:
            drafts[b, m] = (argmax[b, m] + 1) % V
    return logits, drafts


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_greedy_equals_vllm_with_filters_penalties_and_logprobs(logprobs_mode):
    B, k, V = 4, 3, 16
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, top_k=3, top_p=0.9, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7, logprobs=1),
              SamplingParams(temperature=0.0, logit_bias={5: 4.0, 7: -3.0})]
    ours, theirs, _ = _pair(B, V, k, params, logprobs_mode=logprobs_mode)
    for match in ([0, 1, 2, 3], [3, 3, 1, 0]):
        logits, drafts = _greedy_batch(B, k, V, match)
        batch = decode_batch(torch.randint(0, V, (B,)), drafts)
        mine, vllms = ours(logits, batch), theirs(logits, batch)
        _assert_same_output(mine, vllms)
        _assert_same_logprobs(mine, vllms)


def test_penalties_change_the_greedy_result_as_in_vllm():
    """Negative control of the routing: the bias moves the argmax, so verifying without vLLM's processing
    would differ."""
    B, k, V = 1, 2, 8
    ours, theirs, _ = _pair(B, V, k, [SamplingParams(temperature=0.0, logit_bias={3: 50.0})])
    logits, drafts = _greedy_batch(B, k, V, [2])
    batch = decode_batch(torch.zeros(B, dtype=torch.long), drafts)
    mine = ours(logits, batch)
    _assert_same_output(mine, theirs(logits, batch))
    assert mine.sampled_token_ids[0, 0] == 3


def test_placeholder_drafts_are_rejected_as_in_vllm():
    """A step that starts inside the prefill (P/D's first step): its drafts are placeholders (-1), rejected at
    their position; the request emits the target's token at its first row."""
    B, k, V = 3, 2, 8
    ours, theirs, _ = _pair(B, V, k, [SamplingParams(temperature=0.0)] * B)
    logits, drafts = _greedy_batch(B, k, V, [2, 2, 2])
    batch = decode_batch(torch.zeros(B, dtype=torch.long), drafts, start=PREFILL_LEN - 1)
    mine = ours(logits, batch)
    _assert_same_output(mine, theirs(logits, batch))
    assert mine.num_sampled.tolist() == [1, 1, 1]


PROMPT, OUTPUT = [1, 2], [3, 3]  # (a request's history, PREFILL_LEN tokens: its prompt, then its output so far)


def _admit_with_history(sampler: Sampler, params: list, root: torch.Tensor) -> None:
    """admit(), for requests whose prompt is PROMPT and whose output so far is OUTPUT then `root` (B,), the
    token the runner sampled last: vLLM's bincount counts the output from its prefill (penalty requests),
    post_update the root, as after the prefill's step."""
    rs = sampler.req_states
    for i in range(len(params)):
        rs.prompt_len.np[i] = len(PROMPT)
        rs.all_token_ids.gpu[i, :PREFILL_LEN] = torch.tensor(PROMPT + OUTPUT)
    rs.prompt_len.copy_to_uva()
    admit(sampler, params)
    sampler.penalties_state.output_bin_counts[torch.arange(len(params)), root] += 1


def _processed_rows(sampler: Sampler, logits: torch.Tensor, batch: InputBatch) -> torch.Tensor:
    """vLLM's processed fp32 rows of a decode batch (Sampler.apply_sampling_params, the drafts as input ids)."""
    return sampler.apply_sampling_params(
        logits.clone(), batch.expanded_idx_mapping, batch.idx_mapping, batch.idx_mapping_np, batch.positions,
        batch.input_ids, batch.expanded_local_pos, batch.seq_lens_cpu_upper_bound.numpy())


STEP0_PARAMS = [
    dict(repetition_penalty=2.0, frequency_penalty=0.8, presence_penalty=0.5),
    dict(logit_bias={5: 3.0, 7: -2.0, 3: 1.5}, min_tokens=4, stop_token_ids=[9, 11]),
    dict(repetition_penalty=0.7, presence_penalty=-0.5, logit_bias={2: 2.5}, min_tokens=5, stop_token_ids=[4],
         top_k=6),
    dict(frequency_penalty=-1.0, min_tokens=6, stop_token_ids=[0, 6, 13]),
    dict(allowed_token_ids=[1, 3, 5, 7, 9, 11, 13]),  # (routed to vLLM's processing)
    dict(),
]


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs"])
def test_greedy_with_penalties_bias_and_min_tokens_equals_vllm(logprobs_mode):
    """Penalties, logit bias and min-tokens fused into accept, on vLLM's own state (its output counts from the
    prefill plus the root, its prompt mask, its bias and stop-token buffers): the same tokens, counts and
    logprobs as vLLM's rejection sampler on its processed logits. The drafts are vLLM's processed argmax along
    the chain (so penalties from the drafts before a row decide), each request broken at its own depth; min-tokens
    (the root at position 4 of a 2-token prompt) ends inside the chain. The test fails if the drafts on the path
    were not counted: the chain of argmaxes without them differs."""
    B, k, V = len(STEP0_PARAMS), 4, 16
    params = [SamplingParams(temperature=0.0, logprobs=3, **p) for p in STEP0_PARAMS]
    ours, theirs, sampler = _pair(B, V, k, [], logprobs_mode=logprobs_mode)
    gen = torch.Generator().manual_seed(5)
    root = torch.randint(0, V, (B,), generator=gen)
    _admit_with_history(sampler, params, root)
    for trial in range(3):
        logits = torch.randn(B * (k + 1), V, generator=gen) * 2
        drafts = torch.zeros(B, k, dtype=torch.long)
        for j in range(k):  # (row j's processing reads the drafts before it)
            rows = _processed_rows(sampler, logits, decode_batch(root, drafts)).view(B, k + 1, V)
            drafts[:, j] = rows[:, j].argmax(-1)
        without_path = _processed_rows(sampler, logits, decode_batch(root, torch.zeros_like(drafts)))
        assert not torch.equal(without_path.view(B, k + 1, V)[:, :k].argmax(-1), drafts)
        broken_at = torch.randint(0, k + 1, (B,), generator=gen)
        for b, m in enumerate(broken_at.tolist()):
            if m < k:
                drafts[b, m] = (drafts[b, m] + 1) % V
        batch = decode_batch(root, drafts)
        mine, vllms = ours(logits, batch), theirs(logits, batch)
        _assert_same_output(mine, vllms)
        assert mine.num_sampled.tolist() == (broken_at + 1).tolist()
        _assert_same_logprobs(mine, vllms)


@pytest.mark.parametrize("logprobs_mode", ["processed_logprobs", "raw_logits", "raw_logprobs"])
def test_sampled_logprobs_and_ranks_are_vllms_at_the_emitted_rows(logprobs_mode, monkeypatch):
    """Sampled requests with penalties, bias, min-tokens and filters, their logprobs computed by accept (vLLM's
    _get_logprobs_tensors is not called): at every emitted row, the emitted token's score, its rank and the top
    entries are vLLM's on its own logits for that mode (Sampler.apply_sampling_params' rows for the processed
    mode: the law the token was drawn from, the drafts before the row counted; the model's rows for the raw
    modes). The draws are specdec's, so the rows checked are the ones our sampler emitted."""
    B, k, V, N = 5, 3, 16, 3
    params = [SamplingParams(temperature=t, seed=i, logprobs=N, **p) for i, (t, p) in enumerate(zip(
        (0.9, 1.1, 0.8, 1.0, 0.7),
        (*STEP0_PARAMS[:4], dict(top_p=0.9, min_p=0.02))))]
    ours, _, sampler = _pair(B, V, k, [], logprobs_mode=logprobs_mode)
    gen = torch.Generator().manual_seed(11)
    root = torch.randint(0, V, (B,), generator=gen)
    _admit_with_history(sampler, params, root)
    monkeypatch.setattr(vllm_rs.RejectionSampler, "_get_logprobs_tensors",
                        lambda *a, **kw: pytest.fail("vLLM computed the logprobs"))
    checked = 0
    for trial in range(4):
        logits = torch.randn(B * (k + 1), V, generator=gen) * 2
        drafts = torch.randint(0, V, (B, k), generator=gen)
        drafts[:, 0] = logits.view(B, k + 1, V)[:, 0].argmax(-1)  # (some drafts accepted: deeper rows emitted)
        batch = decode_batch(root, drafts)
        rows = _processed_rows(sampler, logits, batch) if logprobs_mode == "processed_logprobs" else logits
        out = ours(logits, batch)
        lp = out.logprobs_tensors
        for b in range(B):
            for j in range(int(out.num_sampled[b])):
                r, token = b * (k + 1) + j, int(out.sampled_token_ids[b, j])
                row = rows[r].double()
                scores = row.float() if logprobs_mode == "raw_logits" else torch.log_softmax(row, -1).float()
                top = torch.topk(row, N).indices
                assert lp.logprob_token_ids[r].tolist() == [token] + top.tolist(), (b, j)
                torch.testing.assert_close(lp.logprobs[r], scores[[token] + top.tolist()], rtol=0, atol=1e-5)
                assert int(lp.selected_token_ranks[r]) == int((row >= row[token]).sum()), (b, j)
                checked += 1
    assert checked > B * 4  # (rows past the first were emitted too)


def test_step0_requests_are_fused_and_the_others_routed():
    """Which requests reach vLLM's processing: allowed_token_ids, bad words and min-tokens under a structured
    output go there; penalties, bias and min-tokens alone do not (their rows are never processed by vLLM)."""
    B, k, V = len(STEP0_PARAMS), 2, 16
    sampler = make_sampler(B, V, k)
    ours = vllm_mrv2.RejectionSampler(sampler, make_spec_config(k), DEVICE)
    _admit_with_history(sampler, [SamplingParams(temperature=0.0, **p) for p in STEP0_PARAMS], torch.zeros(B).long())
    batch = decode_batch(torch.zeros(B, dtype=torch.long), torch.zeros(B, k, dtype=torch.long))
    processed = []
    apply = sampler.apply_sampling_params
    sampler.apply_sampling_params = lambda logits, *a, **kw: processed.append(a[1].tolist()) or apply(logits, *a, **kw)
    ours(torch.randn(B * (k + 1), V), batch)
    assert processed == [[4]]


def _sampled_run(rejection_sampler, B, base, draft_base, temperature, with_draft_logits, seed):
    """One call over B copies of one request: target logits `base` (k + 1, V) and drafts drawn from
    softmax(draft_base / t) (the drafter's law; draft_base (k, V)). Returns the SamplerOutput and the drafts."""
    k, V = draft_base.shape
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(draft_base / temperature, -1)
    drafts = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=g) for j in range(k)], 1)
    batch = decode_batch(torch.zeros(B, dtype=torch.long), drafts)
    cache = draft_cache(draft_base.expand(B, k, V).contiguous()) if with_draft_logits else None
    return rejection_sampler(base.repeat(B, 1), batch, cache), drafts


def _assert_chain_law(out, drafts, laws, what):
    """The emitted chain follows the target: token 1 ~ laws[0]; token j + 1 ~ laws[j] given the first j
    emitted tokens are the drafts. Returns the p-values."""
    tokens, num = out.sampled_token_ids, out.num_sampled.long()
    pvalues = []
    given = torch.ones(len(num), dtype=torch.bool)
    for j, law in enumerate(laws):
        rows = given & (num > j)
        assert_law(tokens[rows, j], law, f"{what}: token {j + 1}")
        pvalues.append(chi_square_pvalue(tokens[rows, j], law))
        if j < drafts.shape[1]:
            given = rows & (tokens[:, j] == drafts[:, j])
    return pvalues


def _mean_and_se(out):
    n = out.num_sampled.double()
    return n.mean().item(), n.std().item() / math.sqrt(len(n))


@pytest.mark.parametrize("method,with_draft_logits", [("standard", True), ("block", True), ("block", False)])
def test_sampled_laws_and_acceptance_against_vllm(method, with_draft_logits, capsys):
    """Temperature sampling against the cached draft logits (or the proposals alone, one-hot): both laws are the
    exact law, and our mean number of emitted tokens is at least vLLM's (within 4 standard errors: same
    verifier)."""
    k, V, t = 2, 4, 0.8
    base = torch.randn(k + 1, V) * 1.5
    draft_base = base[:k] + torch.randn(k, V) * 0.8  # (a drafter close to the target)
    laws = torch.softmax(base.double() / t, -1)
    B_vllm, B_ours = 240, 4000
    params = [SamplingParams(temperature=t, seed=1000 + i) for i in range(B_ours)]
    ours, _, _ = _pair(B_ours, V, k, params, method)
    _, theirs, _ = _pair(B_vllm, V, k, params[:B_vllm], method)
    mine, my_drafts = _sampled_run(ours, B_ours, base, draft_base, t, with_draft_logits, seed=1)
    vllms, vllm_drafts = _sampled_run(theirs, B_vllm, base, draft_base, t, with_draft_logits, seed=2)
    p_ours = _assert_chain_law(mine, my_drafts, laws, f"specdec {method}")
    p_vllm = _assert_chain_law(vllms, vllm_drafts, laws, f"vLLM {method}")
    (m_ours, se_ours), (m_vllm, se_vllm) = _mean_and_se(mine), _mean_and_se(vllms)
    assert m_ours >= m_vllm - 4 * math.hypot(se_ours, se_vllm)
    if method == "standard" and with_draft_logits:  # the exact mean: 1 + a1 + a1 a2, a_j = sum min(p_j, q_j)
        q = torch.softmax(draft_base.double() / t, -1)
        a = torch.minimum(laws[:k], q).sum(-1)
        exact = 1 + a[0] + a[0] * a[1]
        assert abs(m_ours - exact) < 4 * se_ours
        assert abs(m_vllm - exact) < 4 * se_vllm
    with capsys.disabled():
        print(f"\n{method}, draft logits {with_draft_logits}: mean emitted specdec {m_ours:.3f} +- {se_ours:.3f} "
              f"(B={B_ours}), vLLM {m_vllm:.3f} +- {se_vllm:.3f} (B={B_vllm}); p-values specdec "
              f"{[f'{p:.3g}' for p in p_ours]}, vLLM {[f'{p:.3g}' for p in p_vllm]}")


def _processed_law(sampler, base, params):
    """vLLM's law of each row: softmax of its own processed logits (Sampler.apply_sampling_params) for a
    request with these parameters."""
    k = base.shape[0] - 1
    idx = torch.zeros(1, dtype=torch.long)
    processed = sampler.apply_sampling_params(
        base.clone(), idx.repeat(k + 1), idx, np.zeros(1, dtype=np.intp), torch.arange(k + 1) + PREFILL_LEN,
        torch.zeros(k + 1, dtype=torch.int32), torch.arange(k + 1, dtype=torch.int32),
        np.array([PREFILL_LEN + k + 1], dtype=np.int32))
    return torch.softmax(processed.double(), -1)


@pytest.mark.parametrize("param", [
    dict(repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4, logit_bias={1: 1.0, 3: -0.5},
         min_tokens=5, stop_token_ids=[0, 2]),
    dict(repetition_penalty=0.8, presence_penalty=-0.7, logit_bias={4: 1.2}, min_tokens=4, stop_token_ids=[3],
         top_p=0.85, min_p=0.05),
], ids=["penalties_bias_min_tokens", "with_filters"])
def test_sampled_law_with_penalties_bias_and_min_tokens_is_vllms(param):
    """Sampled requests with penalties, a logit bias and min-tokens, fused into accept (proposals, no draft
    logits): the emitted chain follows vLLM's processed law at each row, the drafts before a row counted (vLLM's
    apply_sampling_params on the same chain and state). The drafts are fixed and repeat tokens of the history
    (tokens 3 and 1), so the penalties change the law along the chain; the stop tokens are masked at the first
    rows only (the root at position 4 of a 2-token prompt)."""
    k, V, t, B = 3, 6, 0.9, 3000
    ours, _, sampler = _pair(B, V, k, [])
    root = torch.full((B,), 3, dtype=torch.long)
    _admit_with_history(sampler, [SamplingParams(temperature=t, seed=i, **param) for i in range(B)], root)
    base = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(2))
    drafts = torch.tensor([[3, 1, 3]]).expand(B, k)
    batch = decode_batch(root, drafts)
    rows = _processed_rows(sampler, base, decode_batch(root[:1], drafts[:1]))  # (request state 0's rows)
    laws = torch.softmax(rows.double(), -1)
    unpenalized = torch.softmax(base.double() / t, -1)
    assert (laws - unpenalized).abs().max() > 0.05  # (the parameters change the law)
    mine = ours(base.repeat(B, 1), batch)
    _assert_chain_law(mine, drafts, laws, "penalties, bias, min-tokens")


@pytest.mark.parametrize("case", ["top_k_top_p_fused", "min_p_top_p_fused", "top_k_with_draft_logits_routed"])
def test_sampled_law_with_filters_is_vllms(case):
    """The filters: fused into accept in vLLM's order (given proposals), or processed by vLLM's sampler where
    accept's law would differ (filters with draft logits: vLLM's drafter draws unfiltered). The emitted chain
    follows vLLM's processed law. The rows are chosen so that another order or processing would give another
    law: min-p 0.5 then top-p 0.6 keeps tokens {0, 1} of (.3, .25, .2, .15, .07, .03), top-p then min-p keeps
    {0, 1, 2}; with top-k 2 and the drafter's (.25, .05, .34, .33, .02, .01), accept filtering the draft too
    would emit token 0 with probability .63, not .3 / .55."""
    k, V = 2, 6
    base = torch.randn(k + 1, V) * 2
    if case == "top_k_top_p_fused":
        t, param, draft_base = 0.9, dict(top_k=4, top_p=0.8), torch.randn(k, V) * 2
    elif case == "min_p_top_p_fused":
        t, param, draft_base = 1.0, dict(min_p=0.5, top_p=0.6), torch.randn(k, V)
        base = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.07, 0.03])).repeat(k + 1, 1)
    else:
        t, param = 1.0, dict(top_k=2)
        base = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.07, 0.03])).repeat(k + 1, 1)
        draft_base = torch.log(torch.tensor([0.25, 0.05, 0.34, 0.33, 0.02, 0.01])).repeat(k, 1)
    B = 3000 if case.endswith("fused") else 600  # (vLLM's processing runs under the interpreter)
    ours, _, sampler = _pair(B, V, k, [SamplingParams(temperature=t, seed=i, **param) for i in range(B)])
    laws = _processed_law(sampler, base, param)
    mine, drafts = _sampled_run(ours, B, base, draft_base, t, case.endswith("draft_logits_routed"), seed=3)
    _assert_chain_law(mine, drafts, laws, case)


def test_min_p_with_top_p_keeps_vllms_set_in_vllms_order_only():
    """Why the entry point passes filter_order="vllm": on this row the orders keep different sets, and accept's
    "vllm" order keeps vLLM's."""
    base = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    param = dict(min_p=0.6, top_p=0.5)
    _, _, sampler = _pair(1, 4, 1, [SamplingParams(temperature=1.0, **param)])
    vllm_kept = _processed_law(sampler, base.repeat(2, 1), param)[0] > 0
    from specdec.reference import processed_keep
    assert vllm_kept.tolist() == [True, False, False, False]
    assert processed_keep(base[0], 1.0, 0, 0.5, 0.6, None, "vllm").tolist() == vllm_kept.tolist()
    assert processed_keep(base[0], 1.0, 0, 0.5, 0.6, None, "hf").tolist() != vllm_kept.tolist()


@pytest.mark.parametrize("method", ["synthetic", "fly"])
def test_lossy_methods_are_refused(method):
    extra = {"synthetic": dict(synthetic_acceptance_rates=[0.8, 0.6]), "fly": dict(fly_window_size=1)}[method]
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
                                     prompt_lookup_min=1, rejection_sample_method=method, **extra)
    with pytest.raises(ValueError, match=r"^spec_config\.rejection_sample_method: .*'synthetic' and 'fly'"):
        vllm_mrv2.RejectionSampler(make_sampler(1, 8, 2), config, DEVICE)


def test_batch_sharded_draft_logits_are_refused():
    ours, _, _ = _pair(1, 8, 2, [SamplingParams(temperature=1.0)])
    cache = draft_cache(torch.zeros(1, 2, 8))
    cache.row_mapping = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^draft_logits: a batch-sharded DraftLogitsCache"):
        ours(torch.zeros(3, 8), decode_batch(torch.zeros(1, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)),
             cache)


def test_watermark_key_is_refused():
    with pytest.raises(ValueError, match="^watermark_key: "):
        vllm_mrv2.RejectionSampler(make_sampler(1, 8, 2), make_spec_config(2), DEVICE, watermark_key=7)


def test_module_imports_without_vllm():
    import subprocess
    code = ("import sys; sys.modules['vllm'] = None; import specdec.integrations.vllm_mrv2, "
            "specdec.integrations.vllm_plugin as p; p.register(); print('ok')")
    env = dict(os.environ, SPECDEC_VLLM_REJECTION_SAMPLER="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "ok", out.stderr


class _Built(Exception):
    """Stops the runner's load_model right after it built its samplers."""


def _rejection_sampler_built_by_load_model(monkeypatch):
    """Run vLLM's own GPUModelRunner.load_model, with a stand-in runner (a given model, no loader, no memory
    profiling, a plain model state), up to the construction of its rejection sampler; returns what it built."""
    from unittest.mock import MagicMock

    from vllm.v1.worker.gpu import model_runner

    class NoProfiler:
        consumed_memory = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def stop(*args, **kwargs):
        raise _Built

    model_state = MagicMock(num_new_sampled_tokens_per_step=1)
    model_state.custom_sampler.return_value = None
    monkeypatch.setattr(model_runner, "DeviceMemoryProfiler", NoProfiler)
    monkeypatch.setattr(model_runner, "get_model_loader", MagicMock())
    monkeypatch.setattr(model_runner, "init_model_state", lambda *args: model_state)
    monkeypatch.setattr(model_runner, "PromptLogprobsWorker", stop)  # (the next thing load_model builds)
    sampler = make_sampler(4, 16, 2)
    runner = MagicMock(lora_config=None, use_aux_hidden_state_outputs=False, speculator=None,
                       num_speculative_steps=2, is_last_pp_rank=True, is_pooling_model=False, max_num_reqs=4,
                       vocab_size=16, device=DEVICE, req_states=sampler.req_states, vllm_config=VllmConfig(),
                       speculative_config=make_spec_config(2))
    runner.parallel_config.enable_batch_sharded_sampling = False
    runner.model_config.logits_processors = None
    runner.model_config.logprobs_mode = "raw_logprobs"
    runner.model_config.use_fp64_gumbel = runner.model_config.enable_trace_replay = False
    runner.model_config.return_sampling_mask = False
    with pytest.raises(_Built):
        model_runner.GPUModelRunner.load_model(runner, model=torch.nn.Module())
    return runner.rejection_sampler


@pytest.mark.parametrize("setting", ["1", "0", None])
def test_plugin_switches_the_runners_sampler(setting, monkeypatch):
    """With SPECDEC_VLLM_REJECTION_SAMPLER=1, vLLM's own load_model builds specdec's rejection sampler; with it
    off or unset, vLLM's."""
    from vllm.v1.worker.gpu import model_runner
    monkeypatch.setattr(model_runner, "RejectionSampler", vllm_rs.RejectionSampler)  # (restored afterwards)
    if setting is None:
        monkeypatch.delenv(vllm_plugin.ENV_SETTING, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.ENV_SETTING, setting)
    vllm_plugin.register()
    built = _rejection_sampler_built_by_load_model(monkeypatch)
    assert type(built) is (vllm_mrv2.RejectionSampler if setting == "1" else vllm_rs.RejectionSampler)


def test_plugin_loads_through_vllms_entry_points(monkeypatch):
    """vLLM's plugin loader, given specdec's entry point (group vllm.general_plugins, as setup.py declares it),
    calls register(), selected by VLLM_PLUGINS=specdec."""
    import importlib.metadata

    import vllm.plugins
    from vllm.v1.worker.gpu import model_runner
    entry_point = importlib.metadata.EntryPoint(name="specdec", value="specdec.integrations.vllm_plugin:register",
                                                group=vllm.plugins.DEFAULT_PLUGINS_GROUP)
    entry_points = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None, **kw: importlib.metadata.EntryPoints(
        [entry_point]) if group == vllm.plugins.DEFAULT_PLUGINS_GROUP else entry_points(group=group, **kw))
    monkeypatch.setattr(model_runner, "RejectionSampler", vllm_rs.RejectionSampler)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("VLLM_PLUGINS", "specdec")
    monkeypatch.setenv(vllm_plugin.ENV_SETTING, "1")
    vllm.plugins.load_general_plugins()
    assert model_runner.RejectionSampler is vllm_mrv2.RejectionSampler
