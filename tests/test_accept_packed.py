"""accept's packed (ragged) form: rows (N, V) with cu_num_nodes (B + 1,), as vLLM and SGLang flatten a batch.

The packed form of a batch must give exactly the padded form's results on the same data (same backend, same
seeds: the kernels only address rows differently), for greedy and sampled requests, with draft logits or given
proposals, filters and a bitmask, every method, logits and probabilities; and its own bad inputs are errors.
The padded form itself is tested against the reference elsewhere; here the reference runs the packed form too.
"""
from __future__ import annotations

import pytest
import torch

import specdec
from tests.helpers import DEVICE, accept_on, random_trees

CPU_BACKENDS = ["torch"] + (["cpp"] if specdec.ops.HAS_CPP else [])


def _batch(gen, B=7, T=6, V=29, chains=False):
    """A padded batch with ragged trees (or chains) and mixed temperatures, and its packed twin."""
    if chains:
        parents = torch.arange(-1, T - 1).expand(B, T).contiguous()
        num_nodes = torch.randint(1, T + 1, (B,), generator=gen).int()
    else:
        parents, num_nodes = random_trees(B, T, gen)
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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["draft", "given", "filters", "mask", "traversal", "block", "probs"])
def test_packed_equals_padded(backend, case):
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    padded, packed = _batch(gen, chains=case == "block")
    extra = {}
    if case == "given":
        padded["draft_logits"] = packed["draft_logits"] = None
    if case != "mask":
        padded.pop("token_bitmask"), packed.pop("token_bitmask")
    if case == "filters":
        extra = dict(top_k=torch.tensor([3, 0, 5, 2, 0, 4, 1]), top_p=0.9, min_p=torch.full((7,), 0.05))
    if case in ("traversal", "block"):
        extra = dict(method=case)
    if case == "probs":
        for form in (padded, packed):
            form["target_probs"] = torch.softmax(form.pop("target_logits"), -1) * 3.0
            form["draft_probs"] = torch.softmax(form.pop("draft_logits"), -1)
    a = accept_on(backend, **padded, **extra)
    b = accept_on(backend, **packed, **extra)
    _same(a, b)
    assert int(a.num_accepted.max()) >= 1


def test_packed_reference_equals_cpp_on_greedy_requests():
    """The two backends agree exactly where no randomness is involved (greedy), packed."""
    if not specdec.ops.HAS_CPP:
        pytest.skip("no C++ extension")
    gen = torch.Generator().manual_seed(3)
    _, packed = _batch(gen)
    packed["temperature"] = 0.0
    _same(accept_on("torch", **packed), accept_on("cpp", **packed))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
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
