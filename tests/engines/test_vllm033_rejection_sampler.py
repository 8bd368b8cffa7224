"""specdec.integrations.vllm against vLLM 0.33.0's own v1 rejection sampler (vllm.v1.sample.rejection_sampler):
the same signatures, and the same results on vLLM's real objects, vLLM's Triton kernels running under
TRITON_INTERPRET=1.

venv: vllm-0.33.0

Greedy requests: equal outputs. Sampled requests: both outputs follow the exact law (chi-square, with a negative
control), and specdec's mean accepted length is at least vLLM's (token-wise against token-wise: equal in
expectation, so "at least" allows 4 standard errors of sampling noise).
"""
import inspect
import importlib.util
import os
from unittest.mock import Mock

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("vllm") is None:  # (before touching triton's drivers)
    pytest.skip("vllm is not installed (venv: vllm-0.33.0)", allow_module_level=True)
triton_backends = pytest.importorskip("triton.backends")
# vLLM switches Triton off unless exactly one GPU driver is active: mark NVIDIA's active (the interpreter runs it)
triton_backends.backends["nvidia"].driver.is_active = staticmethod(lambda: True)
vllm_rs = pytest.importorskip("vllm.v1.sample.rejection_sampler")

from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from specdec.integrations import vllm as ours  # noqa: E402
from tests.stats import assert_law, chi_square_pvalue  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _no_pinned_memory(monkeypatch):
    """vLLM's penalties pin host buffers when its platform says it may; pinning needs a GPU driver."""
    for module in ("vllm.utils.torch_utils", "vllm.v1.sample.ops.penalties"):
        monkeypatch.setattr(f"{module}.PIN_MEMORY", False)


@pytest.mark.parametrize("name", ["RejectionSampler", "RejectionSampler.forward", "RejectionSampler.parse_output",
                                  "rejection_sample"])
def test_signatures_equal_vllms(name):
    def resolve(module):
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    assert inspect.signature(resolve(ours)) == inspect.signature(resolve(vllm_rs))


def test_constants_equal_vllms():
    assert (ours.PLACEHOLDER_TOKEN_ID, ours.GREEDY_TEMPERATURE, ours.MAX_SPEC_LEN) == (
        vllm_rs.PLACEHOLDER_TOKEN_ID, vllm_rs.GREEDY_TEMPERATURE, vllm_rs.MAX_SPEC_LEN)


def _sampling_metadata(B, temperature=None, **fields):
    """vLLM's SamplingMetadata as its InputBatch fills it (temperature None: all greedy)."""
    values = dict(temperature=temperature, all_greedy=temperature is None, all_random=temperature is not None,
                  top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
                  prompt_token_ids=None, frequency_penalties=torch.tensor([]), presence_penalties=torch.tensor([]),
                  repetition_penalties=torch.tensor([]), output_token_ids=[[] for _ in range(B)],
                  allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
                  spec_token_ids=None)
    values.update(fields)
    return SamplingMetadata(**values)


def _mock_sampler(bonus):
    """vLLM's own tests' sampler: a Mock(spec=Sampler) that supplies the bonus tokens."""
    sampler = Mock(spec=Sampler)
    sampler.logprobs_mode = "raw_logprobs"
    sampler.return_value = SamplerOutput(sampled_token_ids=bonus, logprobs_tensors=None)
    return sampler


def _greedy_batch(gen, B=24, V=16, k=4):
    """Drafts that follow the target's argmax for a while, then stray; some placeholders; some requests without
    drafts. Returns (spec_tokens, target logits [num_tokens, V], bonus [B, 1])."""
    spec, rows = [], []
    for b in range(B):
        n = int(torch.randint(0, k + 1, (), generator=gen))
        logits = torch.randn(n, V, generator=gen)
        argmax = logits.argmax(-1).tolist()
        stray = int(torch.randint(0, n + 1, (), generator=gen))
        tokens = [a if i < stray else int(torch.randint(0, V, (), generator=gen)) for i, a in enumerate(argmax)]
        if n and b % 5 == 0:
            tokens[int(torch.randint(0, n, (), generator=gen))] = vllm_rs.PLACEHOLDER_TOKEN_ID
        spec.append(tokens)
        rows.append(logits)
    return spec, torch.cat(rows), torch.randint(0, V, (B, 1), generator=gen)


def test_greedy_equals_vllm():
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        spec, target_logits, bonus = _greedy_batch(gen)
        metadata = SpecDecodeMetadata.make_dummy(spec, device=target_logits.device)
        sampling = _sampling_metadata(len(spec))
        args = (metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                metadata.cu_num_draft_tokens, None, target_logits, bonus, sampling)
        expected = vllm_rs.rejection_sample(*args)
        assert torch.equal(ours.rejection_sample(*args), expected)
        # forward, on the logits as the model runner lays them out (the bonus from the sampler)
        metadata.target_logits_indices = torch.arange(target_logits.shape[0])
        metadata.bonus_logits_indices = torch.empty(0, dtype=torch.int32)
        got = ours.RejectionSampler(_mock_sampler(bonus)).forward(metadata, None, target_logits.clone(), sampling)
        want = vllm_rs.RejectionSampler(_mock_sampler(bonus)).forward(metadata, None, target_logits.clone(), sampling)
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)


def test_greedy_with_logits_processors_equals_vllm():
    """Penalties, an allowed-token mask and bad words, applied inside forward as vLLM applies them."""
    gen = torch.Generator().manual_seed(1)
    spec, target_logits, bonus = _greedy_batch(gen, B=6, V=16, k=3)
    spec = [[max(t, 0) for t in s] or [1] for s in spec]  # (every request drafts: the penalties' bookkeeping)
    target_logits = torch.randn(sum(map(len, spec)), 16, generator=gen) * 0.3
    target_logits[:, 1] += 1.0  # (token 1, an output token of every request and masked in some: the argmax)
    B = len(spec)
    allowed = torch.zeros(B, 16, dtype=torch.bool)
    allowed[::2, :4] = True  # (True: masked out)
    sampling = _sampling_metadata(
        B, no_penalties=False, prompt_token_ids=torch.randint(0, 16, (B, 5), generator=gen),
        frequency_penalties=torch.full((B,), 2.0), presence_penalties=torch.full((B,), 0.5),
        repetition_penalties=torch.full((B,), 1.3), output_token_ids=[[1, 2, 3]] * B, spec_token_ids=spec,
        allowed_token_ids_mask=allowed, bad_words_token_ids={1: [[spec[1][0]]]})
    metadata = SpecDecodeMetadata.make_dummy(spec, device=target_logits.device)
    metadata.target_logits_indices = torch.arange(target_logits.shape[0])
    metadata.bonus_logits_indices = torch.empty(0, dtype=torch.int32)
    got = ours.RejectionSampler(_mock_sampler(bonus)).forward(metadata, None, target_logits.clone(), sampling)
    want = vllm_rs.RejectionSampler(_mock_sampler(bonus)).forward(metadata, None, target_logits.clone(), sampling)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    plain = ours.RejectionSampler(_mock_sampler(bonus)).forward(metadata, None, target_logits.clone(),
                                                                _sampling_metadata(B))
    assert not torch.equal(got.sampled_token_ids, plain.sampled_token_ids)  # (the processors changed the result)


def _laws(gen, V):
    p = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    q = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_sampled_laws_and_accepted_length_against_vllm(with_draft_probs):
    """k = 2 drafts from q per request; the first two emitted tokens follow p (x) p for both samplers (a
    request that emitted one token continues with the first token of a fresh call); specdec accepts at least as
    many drafts on average."""
    gen = torch.Generator().manual_seed(2)
    B, k, V = 1000, 2, 6
    p, q = _laws(gen, V)
    target_logits = p.float().log().expand(B * k, V).contiguous()
    draft_probs = q.float().expand(B * k, V).contiguous() if with_draft_probs else None
    cu = torch.arange(1, B + 1, dtype=torch.int32) * k
    sampling = _sampling_metadata(B, torch.ones(B))

    def call(rejection_sample):
        draft = torch.multinomial(q.float(), B * k, replacement=True, generator=gen).int()
        bonus = torch.multinomial(p.float(), B, replacement=True, generator=gen).view(B, 1)
        return rejection_sample(draft, [k] * B, k, cu, draft_probs, target_logits.clone(), bonus, sampling)

    accepted = {}
    for name, rejection_sample in (("vllm", vllm_rs.rejection_sample), ("specdec", ours.rejection_sample)):
        first, again = call(rejection_sample), call(rejection_sample)
        pairs = torch.stack([first[:, 0], torch.where(first[:, 1] >= 0, first[:, 1], again[:, 0])], 1).long()
        assert_law(pairs[:, 0] * V + pairs[:, 1], (p[:, None] * p).flatten(), f"{name}, two tokens")
        assert chi_square_pvalue(pairs[:, 0], q) < 1e-6  # negative control: the drafter's law is told apart
        accepted[name] = ((first >= 0).sum(1) - 1).double()
    se = (accepted["vllm"].var() / B + accepted["specdec"].var() / B).sqrt()
    assert accepted["specdec"].mean() >= accepted["vllm"].mean() - 4 * se, accepted


def test_sampled_law_with_penalties_is_vllms():
    """Penalties fused into accept (forward, proposals without draft_probs): the first token follows vLLM's
    penalized law at the first row (vLLM's apply_all_penalties on the request's output and prompt), the second,
    given the first draft accepted, its law at the second row, where the draft counts too. The drafts repeat an
    output token, so the path changes the law (checked)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties
    B, k, V, t = 2000, 2, 6, 0.9
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(k, V, generator=gen)
    output = [2, 1]
    prompt = torch.tensor([[3, 4, V]]).expand(B, 3)
    rep, freq, pres = torch.full((B,), 1.6), torch.full((B,), 0.7), torch.full((B,), 0.4)

    def laws_given(path):
        penalized = apply_all_penalties(base.clone(), prompt[:k], pres[:k], freq[:k], rep[:k],
                                        [output, output + path])
        return torch.softmax(penalized.double() / t, -1)

    d = int(laws_given([0])[0].argmax())  # (the first row's law does not depend on the path)
    laws, drafts = laws_given([d]), [[d, d]] * B
    assert (laws_given([(d + 1) % V])[1] - laws[1]).abs().max() > 0.05
    sampling = _sampling_metadata(B, torch.full((B,), t), no_penalties=False, prompt_token_ids=prompt,
                                  frequency_penalties=freq, presence_penalties=pres, repetition_penalties=rep,
                                  output_token_ids=[output] * B, spec_token_ids=drafts)
    metadata = SpecDecodeMetadata.make_dummy(drafts, device=base.device)
    metadata.target_logits_indices = torch.arange(B * k)
    metadata.bonus_logits_indices = torch.empty(0, dtype=torch.int32)
    bonus = torch.zeros(B, 1, dtype=torch.long)
    out = ours.RejectionSampler(_mock_sampler(bonus)).forward(metadata, None, base.repeat(B, 1), sampling)
    tokens = out.sampled_token_ids.long()
    assert_law(tokens[:, 0], laws[0], "first token")
    assert_law(tokens[tokens[:, 0] == d, 1], laws[1], "second token, the first draft accepted")


@pytest.mark.parametrize("sampled, processors", [(False, None), (True, None), (False, "penalties"),
                                                  (False, "penalties+mask")])
@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logprobs", "raw_logits"])
def test_logprobs_and_parse_output_equal_vllms(logprobs_mode, sampled, processors, monkeypatch):
    """vLLM's real Sampler supplies the bonus tokens from the bonus rows of the runner's layout (each request's
    draft rows, then its bonus row). accept computes the draft positions' logprobs (our _get_logprobs_tensors,
    vLLM's way, is not called); the bonus position's come from vLLM's functions on the sampler's bonus rows.
    Greedy: the outputs equal vLLM's, and at every emitted position (what parse_output keeps) the token ids and
    ranks equal vLLM's, the scores to 1e-5; parse_output's lists too. Sampled (temperature and top-k; the draws
    differ): the top entries at the positions both emitted, which do not depend on the draw, equal vLLM's. With
    penalties (in accept, the drafts before each row counted) the same; with an allowed-token mask too, the raw
    modes' logprobs (of rows before the mask) are vLLM's way, the processed mode's still accept's."""
    # vLLM's Triton top-k/top-p asks the platform for its SM count, which a machine without a GPU lacks: vLLM's
    # PyTorch top-k/top-p (the same masks) for both samplers
    monkeypatch.setattr("vllm.v1.sample.ops.topk_topp_sampler.HAS_TRITON", False)
    gen = torch.Generator().manual_seed(5)
    spec, target_logits, _ = _greedy_batch(gen, B=8, V=16, k=3)
    B, V = len(spec), 16
    extra = {}
    if processors:  # (every request drafts: the penalties' bookkeeping)
        spec = [[max(t, 0) for t in s] or [1] for s in spec]
        target_logits = torch.randn(sum(map(len, spec)), V, generator=gen)
        extra = dict(no_penalties=False, prompt_token_ids=torch.randint(0, V, (B, 5), generator=gen),
                     frequency_penalties=torch.full((B,), 1.5), presence_penalties=torch.full((B,), 0.5),
                     repetition_penalties=torch.full((B,), 1.3), output_token_ids=[[1, 2, 3]] * B,
                     spec_token_ids=spec)
        if processors == "penalties+mask":
            extra["allowed_token_ids_mask"] = torch.zeros(B, V, dtype=torch.bool).index_fill_(1, torch.tensor([4]),
                                                                                               True)
    metadata = SpecDecodeMetadata.make_dummy(spec, device=target_logits.device)
    logits = torch.randn(target_logits.shape[0] + B, V, generator=gen)
    ends = metadata.cu_num_sampled_tokens.long()
    metadata.bonus_logits_indices = (ends - 1).int()
    metadata.target_logits_indices = torch.tensor(
        [i for b, n in enumerate(metadata.num_draft_tokens) for i in range(int(ends[b]) - 1 - n, int(ends[b]) - 1)],
        dtype=torch.int32)
    logits[metadata.target_logits_indices.long()] = target_logits
    filters = dict(temperature=torch.full((B,), 0.7), top_k=torch.full((B,), 5)) if sampled else {}
    sampling = _sampling_metadata(B, max_num_logprobs=2, **filters, **extra)
    vllms_way = []
    original = ours.RejectionSampler._get_logprobs_tensors
    monkeypatch.setattr(ours.RejectionSampler, "_get_logprobs_tensors",
                        lambda *a, **kw: vllms_way.append(1) or original(*a, **kw))
    got = ours.RejectionSampler(Sampler(logprobs_mode)).forward(metadata, None, logits.clone(), sampling)
    assert len(vllms_way) == (processors == "penalties+mask" and logprobs_mode != "processed_logprobs")
    want = vllm_rs.RejectionSampler(Sampler(logprobs_mode)).forward(metadata, None, logits.clone(), sampling)
    lp, vllm_lp = got.logprobs_tensors, want.logprobs_tensors
    emitted = got.sampled_token_ids.flatten() != -1
    if sampled:
        both = emitted & (want.sampled_token_ids.flatten() != -1)
        assert torch.equal(lp.logprob_token_ids[both, 1:], vllm_lp.logprob_token_ids[both, 1:].long())
        torch.testing.assert_close(lp.logprobs[both, 1:], vllm_lp.logprobs[both, 1:], rtol=0, atol=1e-5)
        return
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(lp.logprob_token_ids[emitted], vllm_lp.logprob_token_ids[emitted].long())
    assert torch.equal(lp.selected_token_ranks[emitted], vllm_lp.selected_token_ranks[emitted].long())
    torch.testing.assert_close(lp.logprobs[emitted], vllm_lp.logprobs[emitted], rtol=0, atol=1e-5)
    discard = [1]
    ours_lists, ours_logprobs = ours.RejectionSampler.parse_output(got.sampled_token_ids, V, discard,
                                                                   got.logprobs_tensors)
    vllm_lists, vllm_logprobs = vllm_rs.RejectionSampler.parse_output(want.sampled_token_ids, V, discard,
                                                                      want.logprobs_tensors)
    assert ours_lists == vllm_lists and type(ours_logprobs) is type(vllm_logprobs)
    for a, b in zip(ours_logprobs, vllm_logprobs):
        if hasattr(a, "dtype") and a.dtype.kind == "f":
            assert np.allclose(a, b, rtol=0, atol=1e-5)
        else:
            assert (a == b).all() if hasattr(a, "all") else a == b
    assert ours.RejectionSampler.parse_output(got.sampled_token_ids, V) == (
        vllm_rs.RejectionSampler.parse_output(want.sampled_token_ids, V))
