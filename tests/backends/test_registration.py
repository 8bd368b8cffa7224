"""torch.library registration: schemas, fake impls (opcheck), torch.compile(fullgraph=True), dispatch."""
import dataclasses

import pytest
import torch

import specdec
import specdec.ops
from tests.helpers import random_trees

B, T, Hq, Hkv, D, CAP, V = 2, 4, 4, 2, 8, 16, 12


def sample_inputs():
    gen = torch.Generator().manual_seed(0)
    parents, num_nodes = random_trees(B, T, gen)
    info = specdec.build_tree(parents, num_nodes)
    return dict(
        parents=info.parents, num_nodes=info.num_nodes, mask=info.mask,
        q=torch.randn(B, T, Hq, D, generator=gen), k=torch.randn(B, CAP, Hkv, D, generator=gen),
        v=torch.randn(B, CAP, Hkv, D, generator=gen), lens=torch.tensor([0, 5], dtype=torch.int32),
        logits=torch.randn(B, T, V, generator=gen), tokens=torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32),
        temperature=torch.tensor([0.0, 0.9]), seeds=torch.tensor([3, 4]),
        path=torch.tensor([[0, 1, -1, -1], [0, -1, -1, -1]], dtype=torch.int32),
        num_accepted=torch.tensor([1, 0], dtype=torch.int32))


def op_samples():
    x = sample_inputs()
    return {
        "build_tree": (x["parents"], x["num_nodes"]),
        "tree_attention": (x["q"], x["k"], x["v"], x["lens"], x["mask"], None, x["num_nodes"], D ** -0.5),
        "accept": (x["logits"], x["tokens"], x["parents"], None, x["temperature"], x["seeds"], x["num_nodes"], 0),
        "kv_append": (x["k"], x["v"], torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D), x["lens"], None),
        "kv_rollback": ([x["k"]], [x["v"]], x["lens"], x["path"], x["num_accepted"], None),
    }


def test_every_schema_is_registered():
    for name, schema in specdec.ops.SCHEMAS.items():
        op = getattr(torch.ops.specdec, name).default
        assert str(op._schema) == str(torch._C.parse_schema(f"specdec::{schema}"))  # as torch prints it


@pytest.mark.parametrize("name", list(specdec.ops.OPS))
def test_every_op_record_resolves(name):
    """OPS[name] drives registration: a CUDA kernel and a fake for every op, and its Triton implementation
    (a lazily imported (module, attribute)) exists."""
    spec = specdec.ops.OPS[name]
    registered = {line.split(":")[0] for line in torch._C._dispatch_dump(f"specdec::{name}").splitlines()}
    assert {"CUDA", "Meta"} <= registered
    assert callable(spec.triton_impl())


@pytest.mark.parametrize("name", list(specdec.ops.SCHEMAS))
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.specdec, name).default, op_samples()[name])


def test_opcheck_float8_caches():
    """The scale arguments through the dispatcher, fake tensors and AOT dispatch. (opcheck's test_schema step
    cannot run on float8 inputs: it multiplies the inputs, which torch does not implement for float8 on CPU.)"""
    x = sample_inputs()
    k8, v8 = x["k"].to(torch.float8_e4m3fn), x["v"].to(torch.float8_e4m3fn)
    steps = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.specdec.tree_attention.default,
                          (x["q"], k8, v8, x["lens"], x["mask"], None, x["num_nodes"], D ** -0.5, 0.5, 2.0),
                          test_utils=steps)
    torch.library.opcheck(torch.ops.specdec.kv_append.default,
                          (k8, v8, torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D), x["lens"], None, 0.5, 2.0),
                          test_utils=steps)


def test_opcheck_accept_with_per_request_offsets():
    args = op_samples()["accept"]
    torch.library.opcheck(torch.ops.specdec.accept.default, (*args[:7], 2, torch.tensor([7, 0])))


def test_opcheck_accept_with_filters():
    args = op_samples()["accept"]
    bitmask = torch.full((B, T, (V + 31) // 32), -1, dtype=torch.int32)
    bitmask[0, 0] = 0b1011
    filters = (torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0.8, 1.0]), torch.tensor([0.1, 0.0]), bitmask)
    torch.library.opcheck(torch.ops.specdec.accept.default, (*args[:4], torch.tensor([0.7, 0.9]), *args[5:8], None,
                                                             *filters))


def accept_with_sampling_params(method):
    """accept's schema arguments with every step-0 argument, the filters and logprobs given (processed, in vLLM's
    filter order). Chains whose every draft token dominates its parent's row (also after the penalties and the
    bias), greedy / top-k 1: every request accepts its whole chain, so no output holds NaN padding (opcheck
    compares outputs with NaN unequal)."""
    gen = torch.Generator().manual_seed(2)
    parents = torch.arange(-1, T - 1).expand(B, T).contiguous()
    num_nodes = torch.full((B,), T, dtype=torch.int32)
    best = torch.stack([torch.randperm(V - 3, generator=gen)[:T] + 3 for _ in range(B)])  # (0-2: stop tokens)
    logits = torch.randn(B, T, V, generator=gen) * 0.1
    logits.scatter_(2, best.unsqueeze(-1), 10.0)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), best[:, :-1]], 1).int()
    draft = logits.clone() if method == "traversal" else None
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[:, 1] = 1
    counts[0, best[0, 1]] = 2
    bias_ids = torch.tensor([[2, 2, -1], [0, 5, 11]], dtype=torch.int32)
    step0 = (torch.tensor([1.3, 1.0]), torch.tensor([0.5, -0.2]), torch.tensor([0.0, 0.4]), counts,
             torch.tensor([[0b1010], [0b0110]], dtype=torch.int32), bias_ids,
             torch.tensor([[1.5, 0.5, 0.0], [-1.0, 2.0, 0.25]]), counts.sum(-1, dtype=torch.int32) + 2,
             torch.tensor([[0, -1], [1, 2]], dtype=torch.int32))
    filters = (torch.tensor([5, 1], dtype=torch.int32), torch.tensor([0.9, 0.8]), torch.tensor([0.05, 0.0]), None)
    return (logits, tokens, parents, draft, torch.tensor([0.0, 0.9]), torch.tensor([3, 4]), num_nodes, 0, None,
            *filters, method, False, None, *step0, "vllm", 3, "processed")


ACCEPT_DEVICES = [pytest.param("cpu", id="cpp", marks=pytest.mark.skipif(not specdec.ops.HAS_CPP,
                                                                         reason="the C++ op is not built")),
                  pytest.param("cuda", id="triton", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="the Triton op runs on CUDA"))]


@pytest.mark.parametrize("device", ACCEPT_DEVICES)
@pytest.mark.parametrize("method", ["token", "traversal"])
def test_opcheck_accept_with_sampling_params(device, method):
    """The seven outputs (logprobs (B, T), top logprobs and ids (B, T, N), ranks (B, T)) through the dispatcher, the fake
    implementation and AOT dispatch; inputs unchanged (opcheck's schema test)."""
    inputs = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in accept_with_sampling_params(method))
    torch.library.opcheck(torch.ops.specdec.accept.default, inputs)
    out = torch.ops.specdec.accept.default(*inputs)
    assert [o.dtype for o in out] == [torch.int32, torch.int32, torch.int64, torch.float32, torch.float32, torch.int64,
                                      torch.int64]
    assert [tuple(o.shape) for o in out[3:]] == [(B, T), (B, T, 3), (B, T, 3), (B, T)]
    assert out[1].tolist() == [T - 1] * B  # (every position emitted: no padding)


@pytest.mark.parametrize("device", ACCEPT_DEVICES)
def test_accept_without_logprobs_returns_empty_logprob_outputs(device):
    args = tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in op_samples()["accept"])
    out = torch.ops.specdec.accept.default(*args)
    assert len(out) == 7
    assert [tuple(o.shape) for o in out[3:]] == [(B, 0), (B, 0, 0), (B, 0, 0), (B, 0)]


def test_torch_compile_fullgraph_with_filters():
    """The Python scalars and tensors of the filters trace (the normalization makes no host read)."""
    x = sample_inputs()
    bitmask = torch.full((B, T, (V + 31) // 32), -1, dtype=torch.int32)

    def step(logits, top_p):
        return specdec.accept(logits, x["tokens"], x["parents"], temperature=x["temperature"], seeds=x["seeds"],
                              num_nodes=x["num_nodes"], top_k=3, top_p=top_p, min_p=0.05, token_bitmask=bitmask)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    top_p = torch.tensor([0.9, 0.5])
    for a, b in zip(compiled(x["logits"], top_p), step(x["logits"], top_p)):
        assert torch.equal(a, b)


def test_torch_compile_fullgraph_with_sampling_params():
    """The step-0 arguments, the filter order and logprobs trace too: the six outputs equal eager's."""
    x = sample_inputs()
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts[:, 1] = 1

    def step(logits, frequency_penalty):
        return specdec.accept(logits, x["tokens"], x["parents"], temperature=x["temperature"], seeds=x["seeds"],
                              num_nodes=x["num_nodes"], top_k=3, top_p=0.9, repetition_penalty=1.2,
                              frequency_penalty=frequency_penalty, output_token_counts=counts,
                              logit_bias=(torch.tensor([[2], [5]]), torch.tensor([[1.0], [-1.0]])), min_tokens=2,
                              stop_token_ids=torch.tensor([[0], [3]]), filter_order="sglang", return_logprobs=2,
                              logprobs_mode="processed")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    frequency_penalty = torch.tensor([0.5, 0.0])
    got, want = compiled(x["logits"], frequency_penalty), step(x["logits"], frequency_penalty)
    for a, b in zip((*got[:3], *got.logprobs), (*want[:3], *want.logprobs)):
        assert torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)  # (NaN padding)


def speculative_step(q, k, v, lens, parents, num_nodes, k_new, v_new, logits, tokens, temperature, seeds, steps):
    info = specdec.build_tree(parents, num_nodes)
    specdec.kv_append(k, v, k_new, v_new, lens)
    out = specdec.tree_attention(q, k, v, lens, info.mask, num_nodes=num_nodes)
    res = specdec.accept(logits + out.sum(), tokens, parents, temperature=temperature, seeds=seeds,
                         num_nodes=num_nodes, offset=steps)
    specdec.kv_rollback(k, v, lens, res.accepted_nodes, res.num_accepted)
    return out, res


def test_torch_compile_fullgraph_matches_eager():
    x = sample_inputs()
    k_new, v_new = torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D)
    args = lambda: (x["q"], x["k"].clone(), x["v"].clone(), x["lens"].clone(), x["parents"], x["num_nodes"],  # noqa: E731
                    k_new, v_new, x["logits"], x["tokens"], x["temperature"], x["seeds"], torch.tensor([3, 2**33]))
    eager_args, compiled_args = args(), args()
    torch._dynamo.reset()
    compiled = torch.compile(speculative_step, fullgraph=True)
    out_e, res_e = speculative_step(*eager_args)
    out_c, res_c = compiled(*compiled_args)
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(res_c, res_e):
        assert torch.equal(a, b)
    for i in (1, 2, 3):  # caches and lengths mutated identically
        assert torch.equal(eager_args[i], compiled_args[i])


def test_env_overrides_default_backend(monkeypatch):
    calls = []
    spec = specdec.ops.OPS["build_tree"]
    monkeypatch.setitem(specdec.ops.OPS, "build_tree",
                        dataclasses.replace(spec, reference=lambda *a: calls.append(1) or spec.reference(*a)))
    specdec.build_tree(torch.tensor([[-1, 0]]))
    assert calls == [] or not specdec.ops.HAS_CPP  # default: the registered op
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
    n = len(calls)
    specdec.build_tree(torch.tensor([[-1, 0]]))
    assert len(calls) == n + 1
    monkeypatch.setenv("SPECDEC_BACKEND", "bogus")
    with pytest.raises(ValueError, match="^backend"):
        specdec.build_tree(torch.tensor([[-1, 0]]))


def test_cpp_backend_availability():
    if specdec.ops.HAS_CPP:
        specdec.build_tree(torch.tensor([[-1, 0]]), backend="cpp")
    else:
        with pytest.raises(ValueError, match="^backend: 'cpp' requested but"):
            specdec.build_tree(torch.tensor([[-1, 0]]), backend="cpp")
