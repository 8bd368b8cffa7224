"""Step 0 of accept's law in the loop (penalties, logit bias, min-tokens), filter orders and logprobs: greedy
speculative output equals an independent penalized greedy decoding for every drafter, the loop's logprobs are
the law's, sampling with penalties stays lossless (the drafter draws from the law at its own path's counts), and
bad arguments are refused by name. The loop runs on the reference backend (SPECDEC_BACKEND=torch), which has
every step-0 argument."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from specdec import reference as ref
from specdec.loop.cli import ASSETS
from specdec.loop.decoding import SpeculativeDecoder, generate_ar
from specdec.loop.drafters import DraftModelDrafter, NgramDrafter
from specdec.loop.drafters.mtp import MTPDrafter
from specdec.loop.drafters.suffix import SuffixDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.tokenizer import ByteTokenizer

from helpers import ReplayGraph
from test_loop import PROMPTS, byte_pair, chi_square_two_tokens, run_cli, tiny  # noqa: F401 (byte_pair: a fixture)
from test_mtp import target_and_mtp  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 3
# per request: a repetition penalty, frequency and presence penalties, a bias, min-tokens holding the EOS back
STEP0 = dict(repetition_penalty=[1.6, 1.0, 1.3], frequency_penalty=[0.4, 0.9, 0.0], presence_penalty=[0.0, 0.7, 1.2],
             logit_bias=[{5: 2.5, 9: -1.0}, None, {EOS: 1.5}], min_tokens=[0, 6, 9])


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")


@pytest.fixture(scope="module")
def pair():
    return tiny(0, eos=EOS), tiny(1, dim=16, layers=1)


def per_request(args: dict, b: int) -> dict:
    return {name: x[b] if isinstance(x, list) else x for name, x in args.items()}


def step0_row(row, prompt, output, V, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
              logit_bias=None, min_tokens=0, stop_token_ids=(EOS,)):
    """reference.penalized_row of a row that follows prompt + output (one request's generate arguments)."""
    counts = torch.zeros(V, dtype=torch.long)
    for x in output:
        counts[x] += 1
    in_prompt = torch.zeros(V, dtype=torch.bool)
    in_prompt[list(prompt)] = True
    stop = None
    if len(output) < min_tokens:
        stop = torch.zeros(V, dtype=torch.bool)
        stop[list(stop_token_ids)] = True
    pen = ref.NodePenalties(counts, in_prompt, repetition_penalty, frequency_penalty, presence_penalty,
                            tuple((logit_bias or {}).items()), stop)
    return ref.penalized_row(row, pen)


def penalized_greedy_ar(target, prompts, n, args, eos=EOS):
    """Greedy decoding that shares nothing with the loop: the full forward of the whole sequence at every step (no
    cache, no specdec op), the argmax of the penalized row; cut at the EOS, as the loop's output."""
    outs = []
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            seq, out = list(prompt), []
            for _ in range(n):
                row = step0_row(target(torch.tensor([seq]))[0, -1], prompt, out, target.cfg.vocab_size,
                                **per_request(args, b))
                x = int(row.argmax())
                if x == eos:
                    break
                seq.append(x)
                out.append(x)
            outs.append(out)
    return outs


DRAFTERS = ["chain:4", "tree:2,2,1", "dynamic:7,3,2", "ngram", "suffix"]


def make_drafter(name, draft):
    if name == "ngram":
        return NgramDrafter(num_tokens=4)
    if name == "suffix":
        return SuffixDrafter(max_depth=4, max_tokens=8)
    return DraftModelDrafter(draft, name)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_with_penalties_equals_penalized_ar(pair, drafter):
    """Penalties, biases and min-tokens per request: greedy speculative output equals the independent penalized
    greedy decoding and generate_ar's, token for token; the parameters matter (the plain output differs, and
    min-tokens keeps the requests from stopping early)."""
    target, draft = pair
    expected = penalized_greedy_ar(target, PROMPTS, 12, STEP0)
    assert generate_ar(target, PROMPTS, 12, **STEP0).tokens == expected
    out = SpeculativeDecoder(target, make_drafter(drafter, draft)).generate(PROMPTS, 12, **STEP0)
    assert out.tokens == expected
    assert generate_ar(target, PROMPTS, 12).tokens != expected
    assert all(len(seq) >= m for seq, m in zip(expected, STEP0["min_tokens"]))


def test_adaptive_loop_with_penalties(pair):
    """Adaptive depths (plain steps included: their tokens count too): greedy output equals the penalized greedy
    decoding; a sampled adaptive chain judges its levels with the laws at their paths' counts and runs."""
    target, draft = pair
    expected = penalized_greedy_ar(target, PROMPTS, 12, STEP0)
    decoder = SpeculativeDecoder(target, make_drafter("chain:4", draft), adaptive=True)
    assert decoder.generate(PROMPTS, 12, **STEP0).tokens == expected
    sampled = decoder.generate(PROMPTS, 12, 0.8, seed=3, **STEP0)
    assert all(len(seq) >= m for seq, m in zip(sampled.tokens, STEP0["min_tokens"]))


def test_padded_batch_with_per_request_penalties(pair):
    """A batch padded to its bucket (finished rows riding along): the per-request values reach their requests."""
    target, draft = pair
    expected = penalized_greedy_ar(target, PROMPTS, 10, STEP0)
    decoder = SpeculativeDecoder(target, make_drafter("chain:4", draft), batch_buckets=(8,))
    out = decoder.generate(PROMPTS, 10, logprobs=1, **STEP0)
    assert out.tokens == expected and [len(x) for x in out.logprobs] == [len(x) for x in expected]


def test_greedy_mtp_with_penalties_equals_penalized_ar(target_and_mtp):  # noqa: F811
    target, mtp = target_and_mtp
    args = dict(STEP0, min_tokens=0)  # (this target has no EOS)
    expected = penalized_greedy_ar(target, PROMPTS, 12, args, eos=None)
    for tree in ("chain:4", "tree:2,2,1"):
        out = SpeculativeDecoder(target, MTPDrafter(target, mtp, tree)).generate(PROMPTS, 12, **args)
        assert out.tokens == expected


def test_min_tokens_with_stop_token_ids(pair):
    """stop_token_ids given: those tokens (not the EOS) are held back until min_tokens are generated."""
    target, draft = pair
    args = dict(min_tokens=5, stop_token_ids=[[8, 10], [8], [12]])
    expected = penalized_greedy_ar(target, PROMPTS, 8, args)
    assert SpeculativeDecoder(target, make_drafter("chain:4", draft)).generate(PROMPTS, 8, **args).tokens == expected
    assert generate_ar(target, PROMPTS, 8).tokens != expected


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("drafter", ["chain:4", "tree:2,2,1", "ngram"])
def test_greedy_logprobs_equal_ar_logprobs(pair, drafter, mode):
    """The logprob of each generated token and the top 3 of its position: the same from a speculative run as from
    the AR run of the same tokens (1e-5), and the law's: log_softmax of the raw row, or of the penalized row
    (greedy requests' processed law is at temperature 1, unfiltered)."""
    target, draft = pair
    ar = generate_ar(target, PROMPTS, 10, logprobs=3, logprobs_mode=mode, **STEP0)
    out = SpeculativeDecoder(target, make_drafter(drafter, draft)).generate(PROMPTS, 10, logprobs=3,
                                                                            logprobs_mode=mode, **STEP0)
    assert out.tokens == ar.tokens
    for b, seq in enumerate(out.tokens):
        assert len(out.logprobs[b]) == len(seq) == len(out.top_logprobs[b])
        torch.testing.assert_close(torch.tensor(out.logprobs[b]), torch.tensor(ar.logprobs[b]), atol=1e-5, rtol=0)
        for got, want in zip(out.top_logprobs[b], ar.top_logprobs[b]):
            assert [x for x, _ in got] == [x for x, _ in want]
            torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                                       atol=1e-5, rtol=0)
    with torch.no_grad():  # the law itself, from full forwards
        for b, (prompt, seq) in enumerate(zip(PROMPTS, out.tokens)):
            rows = target(torch.tensor([prompt + seq]))[0, len(prompt) - 1:-1]
            for j, x in enumerate(seq):
                row = rows[j].double() if mode == "raw" else step0_row(rows[j], prompt, seq[:j],
                                                                       target.cfg.vocab_size, **per_request(STEP0, b))
                log_p = torch.log_softmax(row, 0)
                assert abs(out.logprobs[b][j] - float(log_p[x])) < 1e-4
                best = int(row.argmax())  # (the generated token itself for "processed": greedy)
                assert out.top_logprobs[b][j][0] == (best, pytest.approx(float(log_p[best]), abs=1e-4))
                assert mode == "raw" or best == x


def test_sampled_processed_logprobs_are_the_law_the_tokens_came_from(pair):
    """Sampling with penalties and filters (vLLM's order): each generated token's processed logprob is the log of
    the reference's processed law at its position (from a full forward), and finite (the token was in the law's
    support); the top ids are that law's best, and a dropped token's logprob is -inf."""
    target, draft = pair
    args = dict(STEP0, min_tokens=[0, 3, 4], top_k=8, top_p=0.9, filter_order="vllm")
    t = 0.9
    out = SpeculativeDecoder(target, make_drafter("tree:2,2,1", draft)).generate(
        PROMPTS, 8, t, seed=5, logprobs=20, logprobs_mode="processed", **args)
    V = target.cfg.vocab_size
    step0 = {k: v for k, v in args.items() if k not in ("top_k", "top_p", "filter_order")}
    with torch.no_grad():
        for b, (prompt, seq) in enumerate(zip(PROMPTS, out.tokens)):
            rows = target(torch.tensor([prompt + seq]))[0, len(prompt) - 1:-1]
            for j, x in enumerate(seq):
                row = step0_row(rows[j], prompt, seq[:j], V, **per_request(step0, b))
                law = ref.processed_probs(row, t, 8, 0.9, 0.0, None, "vllm")
                assert math.isfinite(out.logprobs[b][j])
                assert abs(out.logprobs[b][j] - float(law[x].log())) < 1e-4
                kept = int((law > 0).sum())
                top = out.top_logprobs[b][j]
                assert {x for x, _ in top[:kept]} == set((law > 0).nonzero().flatten().tolist())
                assert all(lp == -math.inf for _, lp in top[kept:])


def exact_penalized_two_token_law(target, prompt, temperature, args, filter_order="hf"):
    """{(x1, x2): p} of the first two tokens under the processed law with step 0 (reference.penalized_row with the
    output so far: none, then x1), over its whole support."""
    V = target.cfg.vocab_size
    filters = dict(top_k=args.get("top_k", 0), top_p=args.get("top_p", 1.0), min_p=args.get("min_p", 0.0))
    step0 = {k: v for k, v in args.items() if k not in filters}
    with torch.no_grad():
        row = step0_row(target(torch.tensor([prompt]))[0, -1], prompt, [], V, **step0)
        p1 = ref.processed_probs(row, temperature, *filters.values(), None, filter_order)
        firsts = (p1 > 0).nonzero().flatten().tolist()
        rows = target(torch.tensor([prompt + [x] for x in firsts]))[:, -1]
    law = {}
    for i, x1 in enumerate(firsts):
        p2 = ref.processed_probs(step0_row(rows[i], prompt, [x1], V, **step0), temperature, *filters.values(), None,
                                 filter_order)
        law.update({(x1, x2): float(p1[x1] * p2[x2]) for x2 in p2.nonzero().flatten().tolist()})
    return law


SHIPPED_STEP0 = dict(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=1.5,
                     logit_bias={ord("y"): 1.5, ord("t"): -2.0})


# a negative presence penalty draws the first token again at the second position: a drafter that ignored its path's
# counts would draft it far less often than the law emits it
REPEATING = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=-8.0)


@pytest.mark.parametrize("tree, method, extra", [
    ("chain:3", "token", REPEATING),
    ("tree:3,1", "token", dict(top_k=8, top_p=0.9)),
    ("chain:3", "block", dict(min_p=0.05)),
    ("tree:2,2,1", "traversal", {}),
])
def test_penalized_sampling_is_lossless_on_shipped_pair(tree, method, extra):
    """Sampling with penalties on the shipped pair: the drafter draws each level from the law at its path's counts
    (a node's children see the draft tokens above it), accept verifies against the same; the first two tokens
    follow the exact penalized law of the target (chi-square), and never leave its support. The penalties are
    strong enough that the two-token law differs from the unpenalized one."""
    target = load_model(os.path.join(ASSETS, "target"))
    draft = load_model(os.path.join(ASSETS, "draft"))
    prompt = ByteTokenizer().encode("import os\nimport s")
    temperature, n = 1.0, 400
    args = dict(SHIPPED_STEP0, **extra)
    out = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), method=method).generate(
        [prompt] * n, 2, temperature, seed=list(range(3000, 3000 + n)), **args)
    law = exact_penalized_two_token_law(target, prompt, temperature, args)
    stat, threshold, cells = chi_square_two_tokens(out.tokens, law, n)
    assert len(cells) >= 3
    assert all(tuple(t[:2]) in law for t in out.tokens)
    assert stat < threshold, stat
    filters = {k: v for k, v in extra.items() if k in ("top_k", "top_p", "min_p")}
    plain = exact_penalized_two_token_law(target, prompt, temperature, filters)
    assert chi_square_two_tokens(out.tokens, plain, n)[0] > threshold


def drafted_two_token_statistic(draft, prompt, tree, args, n=3000, temperature=1.0):
    """(chi-square statistic, threshold at 0.999) of the draft tokens of node 1 and its first child that a
    DraftModelDrafter draws for n copies of a prompt (one propose, no target) against the drafter's exact law
    there: q(x1) at the output's counts times q(x2 | x1) at the path's counts (x1 counted), the processed law of
    the draft's rows (reference)."""
    from specdec.sampling import Penalties, SamplingParams
    V = draft.cfg.vocab_size
    prompts = [prompt] * n
    params = SamplingParams(penalties=Penalties.for_batch(prompts, V, "cpu", **args))
    drafter = DraftModelDrafter(draft, tree)
    tokens = torch.tensor(prompts)
    seq_lens = torch.full((n,), len(prompt), dtype=torch.int32)
    temp = torch.full((n,), temperature)
    with torch.inference_mode():
        drafter.start(tokens, seq_lens, len(prompt) + 8, temp, list(range(n)), params)
        drafter.catch_up(tokens, seq_lens)
        prop = drafter.propose(tokens, seq_lens, temp)
        row = step0_row(draft(torch.tensor([prompt]))[0, -1], prompt, [], V, **args)
        q1 = ref.processed_probs(row, temperature)
        firsts = (q1 > 0).nonzero().flatten().tolist()
        rows = draft(torch.tensor([prompt + [x] for x in firsts]))[:, -1]
    law = {}
    for i, x1 in enumerate(firsts):
        q2 = ref.processed_probs(step0_row(rows[i], prompt, [x1], V, **args), temperature)
        law.update({(x1, x2): float(q1[x1] * q2[x2]) for x2 in q2.nonzero().flatten().tolist()})
    child = prop.parents[0].tolist().index(1)  # node 1's first child: the path root -> 1 -> child
    stat, threshold, cells = chi_square_two_tokens(prop.tokens[:, [1, child]].tolist(), law, n)
    assert len(cells) >= 3
    return stat, threshold


@pytest.mark.parametrize("tree", ["chain:3", "tree:2,1"])
def test_the_drafter_draws_from_the_law_at_its_paths_counts(tree, monkeypatch):
    """A drafted node's children come from the processed law at the node's counts, the output's plus the draft
    tokens above it (accept's q there): the first two levels' draws against the drafter's exact two-token law. A
    drafter that drew every level at the output's counts alone fails the same test."""
    from specdec.loop.drafters import draft_model
    monkeypatch.delenv("SPECDEC_BACKEND")  # (the draft model's ops alone: the default backend has them)
    draft = load_model(os.path.join(ASSETS, "draft"))
    prompt = ByteTokenizer().encode("import os\nimport s")
    args = dict(SHIPPED_STEP0, **REPEATING)
    stat, threshold = drafted_two_token_statistic(draft, prompt, tree, args)
    assert stat < threshold, stat
    monkeypatch.setattr(draft_model, "child_counts", lambda counts, parent, children: counts.expand(
        -1, children.shape[1], -1))
    stat, threshold = drafted_two_token_statistic(draft, prompt, tree, args)
    assert stat > threshold, stat


@pytest.mark.parametrize("kwargs, name", [
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=[0.1, 0.2]), "frequency_penalty"),
    (dict(presence_penalty=math.inf), "presence_penalty"),
    (dict(logit_bias={99: 1.0}), "logit_bias"),
    (dict(logit_bias=[{1: 1.0}]), "logit_bias"),
    (dict(min_tokens=-2), "min_tokens"),
    (dict(min_tokens=2, stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(logprobs=1, logprobs_mode="sampled"), "logprobs_mode"),
    (dict(filter_order="tgi"), "filter_order"),
])
def test_bad_arguments_are_refused_by_name(pair, kwargs, name):
    target, draft = pair
    with pytest.raises(ValueError, match=name):
        SpeculativeDecoder(target, make_drafter("chain:4", draft)).generate(PROMPTS, 4, **kwargs)


@pytest.mark.parametrize("kwargs, name", [(dict(presence_penalty=0.5), "presence_penalty"),
                                          (dict(min_tokens=3), "min_tokens"), (dict(logprobs=0), "logprobs")])
def test_compiled_and_replayed_loops_refuse_step0_and_logprobs(pair, kwargs, name):
    target, draft = pair
    for decoder, mode in ((SpeculativeDecoder(target, make_drafter("chain:4", draft), compile=True), "compile"),
                          (SpeculativeDecoder(target, make_drafter("chain:4", draft), cuda_graphs=ReplayGraph),
                           "cuda_graphs")):
        with pytest.raises(ValueError, match=f"{name}: .*{mode}"):
            decoder.generate(PROMPTS, 4, **kwargs)


def test_cli_penalties_and_logprobs(capsys, byte_pair):  # noqa: F811
    """The flags reach the loop: the output equals generate_ar's with the same arguments, and the JSON holds each
    token's logprob and its position's top 2."""
    from specdec.loop.models.hf import load_model as load
    target = load(str(byte_pair / "target"))
    prompt = "def f(x):"
    base = ["--prompt", prompt, "--target", str(byte_pair / "target"), "--draft", str(byte_pair / "draft"),
            "--max-new-tokens", "8", "--json", "--compare-ar"]
    rc, out, err = run_cli(capsys, *base, "--repetition-penalty", "1.5", "--frequency-penalty", "0.5",
                           "--presence-penalty", "0.3", "--logit-bias", "101=40", "--logit-bias", "32=-2",
                           "--min-tokens", "4", "--stop-token-ids", "10,41", "--filter-order", "vllm",
                           "--logprobs", "2", "--logprobs-mode", "processed")
    assert rc == 0, err
    r = json.loads(out)
    tokens = ByteTokenizer().encode(prompt)
    want = generate_ar(target, [tokens], 8, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3,
                       logit_bias={101: 40.0, 32: -2.0}, min_tokens=4, stop_token_ids=[10, 41], logprobs=2,
                       logprobs_mode="processed")
    assert r["tokens"] == r["ar_tokens"] == want.tokens
    assert r["tokens"] != generate_ar(target, [tokens], 8).tokens
    torch.testing.assert_close(torch.tensor(r["token_logprobs"]), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    ids = [[[x for x, _ in pos] for pos in seq] for seq in (r["top_logprobs"][0], want.top_logprobs[0])]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("args, message", [
    (["--logit-bias", "101"], "--logit-bias 101"),
    (["--logit-bias", "a=1"], "--logit-bias a=1"),
    (["--stop-token-ids", "1,x", "--min-tokens", "2"], "--stop-token-ids"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--logprobs", "30"], "logprobs"),
    (["--presence-penalty", "1", "--compile"], "presence_penalty: runs with eager steps only, not with compile"),
])
def test_cli_bad_step0_flags(capsys, byte_pair, args, message):  # noqa: F811
    base = ["--target", str(byte_pair / "target"), "--draft", str(byte_pair / "draft")]
    rc, out, err = run_cli(capsys, "--prompt", "x", *base, *args)
    assert rc == 2 and message in err and out == ""
