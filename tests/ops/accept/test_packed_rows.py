"""accept's packed (ragged) form: rows (N, V) with cu_num_nodes (B + 1,), as vLLM and SGLang flatten a batch.

The packed form of a batch must give exactly the padded form's results on the same data (same backend, same
seeds: the kernels only address rows differently), for greedy and sampled requests, with draft logits or given
proposals, filters and a bitmask, every method, logits and probabilities; and its own bad inputs are errors.
The padded form itself is tested against the reference elsewhere; here the reference runs the packed form too.
The Triton kernel (PACKED: request b's rows start at row row_offsets[b]) on smaller batches, in the walker and in
split launches, its greedy requests also equal to the reference's.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import specdec
from tests.helpers import DEVICE, accept_on, random_trees

# the interpreted kernel computes log(0) = -inf on purpose (probabilities 0); numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CPU_BACKENDS = ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else [])
ALL_BACKENDS = CPU_BACKENDS + ["triton"]
CASES = ["draft", "given", "filters", "mask", "traversal", "block", "probs"]


def _batch(gen, B=7, T=6, V=29, chains=False):
    """A padded batch with ragged trees (or chains) and mixed temperatures, and its packed twin."""
    if chains:
        parents = torch.arange(-1, T - 1).expand(B, T).contiguous()
        num_nodes = torch.randint(1, T + 1, (B,), generator=gen).int()
    else:
        parents, num_nodes = random_trees(B, T, gen)
        parents[0, T - 1] = -1  # (a padding node's)
    # request 0 (a chain either way) one node short: every later request's rows start off the padded form's b * T
    num_nodes[0] = T - 1
    target = torch.randn(B, T, V, generator=gen) * 2
    draft = target + torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    deep = torch.rand(B, T, generator=gen) < 0.5  # many drafts equal to the target's argmax: deep paths
    tokens = torch.where(deep, target.gather(1, parents.clamp(min=0).unsqueeze(-1).expand(B, T, V)).argmax(-1), tokens)
    bitmask = torch.randint(-2**31, 2**31 - 1, (B, T, (V + 31) // 32), generator=gen, dtype=torch.int64).int()
    bitmask[..., 0] |= 1  # token 0 always allowed
    padded = dict(target_logits=target, draft_logits=draft, tokens=tokens, parents=parents, num_nodes=num_nodes,
                  temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0, 0.9])[:B], seeds=torch.arange(B) + 11,
                  token_bitmask=bitmask)
    rows = [(b, i) for b in range(B) for i in range(int(num_nodes[b]))]
    take = lambda x: torch.stack([x[b, i] for b, i in rows])  # noqa: E731
    packed = dict(padded, target_logits=take(target), draft_logits=take(draft), tokens=take(tokens),
                  parents=take(parents), token_bitmask=take(bitmask), num_nodes=None,
                  cu_num_nodes=torch.cat([torch.zeros(1, dtype=torch.int32), num_nodes.cumsum(0).int()]), max_nodes=T)
    return padded, packed


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b)), (a, b)


def _forms(case, B=7, T=6):
    """(padded, packed, extra accept arguments) of a case of test_packed_equals_padded."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))  # (hash(str) varies between processes)
    padded, packed = _batch(gen, B=B, T=T, chains=case == "block")
    extra = {}
    if case == "given":
        padded["draft_logits"] = packed["draft_logits"] = None
    if case != "mask":
        padded.pop("token_bitmask"), packed.pop("token_bitmask")
    if case == "filters":
        extra = dict(top_k=torch.tensor([3, 0, 5, 2, 0, 4, 1])[:B], top_p=0.9, min_p=torch.full((B,), 0.05))
    if case in ("traversal", "block"):
        extra = dict(method=case)
    if case == "probs":
        for form in (padded, packed):
            form["target_probs"] = torch.softmax(form.pop("target_logits"), -1) * 3.0
            form["draft_probs"] = torch.softmax(form.pop("draft_logits"), -1)
    return padded, packed, extra


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_packed_equals_padded(backend, case):
    # (the interpreter: 4 requests of up to 5 nodes, one of them greedy)
    padded, packed, extra = _forms(case, **(dict(B=4, T=5) if backend == "triton" and DEVICE.type == "cpu" else {}))
    a = accept_on(backend, **padded, **extra)
    b = accept_on(backend, **packed, **extra)
    _same(a, b)
    assert int(a.num_accepted.max()) >= 1
    if backend == "triton":  # both forms wrote real results: the greedy requests' are the reference's
        ref = accept_on("torch", **packed, **extra)
        greedy = padded["temperature"] == 0
        _same([x[greedy] for x in b], [x[greedy] for x in ref])


@pytest.mark.parametrize("case", ["mask", "probs", "traversal"])
def test_triton_packed_equals_padded_in_split_launches(monkeypatch, case):
    """The split launches address the packed rows as the walker does (each launch's `_request`)."""
    from specdec.kernels import accept as kernel
    config = kernel._config
    split = dict(block_v=16, num_splits=2, split_steps=5)  # (2 chunks at V 29)
    monkeypatch.setattr(kernel, "_config", lambda *a, **k: {**config(*a, **k), **split})
    padded, packed, extra = _forms(case, B=4, T=5)
    if case == "mask":  # with filters too: the threshold searches' passes over packed rows
        extra = dict(top_k=torch.tensor([3, 0, 5, 2]), top_p=0.9)
    a = accept_on("triton", **padded, **extra)
    _same(a, accept_on("triton", **packed, **extra))
    assert int(a.num_accepted.max()) >= 1


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_packed_reference_equals_the_kernels_on_greedy_requests(backend):
    """The backends agree exactly where no randomness is involved (greedy), packed."""
    if backend == "cpp" and not specdec.ops.HAS_CPP:
        pytest.skip("no C++ extension")
    gen = torch.Generator().manual_seed(3)
    _, packed = _batch(gen)
    packed["temperature"] = 0.0
    res = accept_on(backend, **packed)
    _same(accept_on("torch", **packed), res)
    assert int(res.num_accepted.max()) >= 2


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_bad_packed_inputs(backend):
    gen = torch.Generator().manual_seed(4)
    _, packed = _batch(gen, B=3)
    cu = packed["cu_num_nodes"]
    with pytest.raises(TypeError, match="max_nodes: with cu_num_nodes"):
        accept_on(backend, **dict(packed, max_nodes=None))
    with pytest.raises(TypeError, match="num_nodes: with cu_num_nodes"):
        accept_on(backend, **dict(packed, num_nodes=torch.ones(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="cu_num_nodes: cu_num_nodes\\[0\\] must be 0"):
        accept_on(backend, **dict(packed, cu_num_nodes=cu + 1))
    short = cu.clone()
    short[-1] -= 1
    with pytest.raises(ValueError, match="cu_num_nodes: cu_num_nodes\\[-1\\] must be the number of packed rows"):
        accept_on(backend, **dict(packed, cu_num_nodes=short))
    with pytest.raises(ValueError, match="cu_num_nodes: every request needs 1 to max_nodes"):
        accept_on(backend, **dict(packed, max_nodes=int((cu[1:] - cu[:-1]).max()) - 1))
    with pytest.raises(ValueError, match="tokens: expected shape"):
        accept_on(backend, **dict(packed, tokens=packed["tokens"][:-1]))
    with pytest.raises(ValueError, match="draft_logits: expected shape"):
        accept_on(backend, **dict(packed, draft_logits=packed["draft_logits"][:-1]))
    bad_root = packed["parents"].clone()
    bad_root[int(cu[1])] = 0  # request 1's root
    with pytest.raises(ValueError, match="parents"):
        accept_on(backend, **dict(packed, parents=bad_root))
