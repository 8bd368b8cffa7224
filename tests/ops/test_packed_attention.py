"""tree_attention's packed form: q (N, Hq, D) and tree_mask (N, W) rows with cu_num_nodes (B + 1,), as engines
flatten a batch. On every backend (Triton through the interpreter), the packed outputs equal the padded form's
rows on the same data exactly (same backend: the kernels only address rows differently), with a paged cache, a
window and soft-capping, and split-KV on Triton (the merge writes packed rows); every packed row is written
(outputs are poisoned first); bad offsets are errors.
"""
from __future__ import annotations

import pytest
import torch

import specdec
from tests.helpers import BACKENDS, on_backend
from tests.ops.test_tree_attention import make_case


def _packed(case):
    nn = case["num_nodes"]
    B = nn.shape[0]
    rows = [(b, i) for b in range(B) for i in range(int(nn[b]))]
    take = lambda x: torch.stack([x[b, i] for b, i in rows])  # noqa: E731
    packed = dict(case, q=take(case["q"]), tree_mask=take(case["tree_mask"]), num_nodes=None,
                  cu_num_nodes=torch.cat([torch.zeros(1, dtype=torch.int32), nn.cumsum(0).int()]),
                  max_nodes=case["q"].shape[1])
    return packed, rows


def _run(case, backend, **kw):
    return tuple(x.cpu() for x in specdec.tree_attention(**on_backend(backend, case), return_lse=True,
                                                         backend=backend, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["plain", "paged_window_cap", "mla_paged_window_cap"])
def test_packed_equals_padded(backend, variant):
    """(mla: MLA's absorbed form, one latent KV head of D 40 whose first 32 channels are V, a view)"""
    gen = torch.Generator().manual_seed(7)
    kw = dict(paged=True, window_left=12) if variant != "plain" else {}
    mla = variant.startswith("mla")
    case = make_case(gen, B=3, T=7, Hkv=1 if mla else 2, group=4 if mla else 2, D=40 if mla else 32, lens=(5, 0, 23),
                     **kw)
    if mla:
        case["v_cache"] = case["k_cache"][..., :32]
    extra = dict(window_left=12, logits_soft_cap=20.0) if variant != "plain" else {}
    packed, rows = _packed(case)
    out, lse = _run(case, backend, **extra)
    p_out, p_lse = _run(packed, backend, **extra)
    assert p_out.shape == (len(rows), *out.shape[2:]) and p_lse.shape == (len(rows), case["q"].shape[2])
    for r, (b, i) in enumerate(rows):
        assert torch.equal(p_out[r], out[b, i]) and torch.equal(p_lse[r], lse[b, i]), (b, i)


def test_triton_packed_split_kv_and_preallocated_outputs_are_fully_written():
    """Split-KV (the merge kernel writes the packed rows), into poisoned preallocated outputs."""
    from specdec.kernels.tree_attention import tree_attention as triton_attention

    gen = torch.Generator().manual_seed(8)
    case = make_case(gen, B=3, T=5, Hkv=1, group=2, D=16, lens=(40, 3, 17))
    packed, rows = _packed(case)
    nn = case["num_nodes"]
    row_offsets = packed["cu_num_nodes"][:-1].long()
    N, Hq, D = packed["q"].shape
    args = (case["k_cache"], case["v_cache"], case["cache_lens"])
    scale = D ** -0.5
    out_pad, lse_pad = triton_attention(case["q"], *args, case["tree_mask"], None, nn, scale, num_splits=3)
    for splits in (1, 3):
        out = torch.full((N, Hq, D), float("nan"))
        lse = torch.full((N, Hq), float("nan"))
        triton_attention(packed["q"], *args, packed["tree_mask"], None, nn, scale, row_offsets=row_offsets,
                         max_nodes=5, num_splits=splits, out=out, lse=lse)
        for r, (b, i) in enumerate(rows):
            torch.testing.assert_close(out[r], out_pad[b, i], atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(lse[r], lse_pad[b, i], atol=2e-6, rtol=1e-5)


def test_triton_packed_rows_past_max_nodes_are_left_alone():
    """Unchecked input (value checks off, as in a captured step) whose request has more packed rows than max_nodes:
    the kernel attends its first max_nodes nodes and writes nothing else (a node past them went into the next KV
    split's partial rows, and on a GPU past the end of the buffer), so every other row is still right."""
    from specdec.kernels.tree_attention import tree_attention as triton_attention

    gen = torch.Generator().manual_seed(10)
    case = make_case(gen, B=3, T=5, Hkv=1, group=2, D=16, lens=(40, 3, 17))
    case["num_nodes"] = torch.tensor([5, 3, 2], dtype=torch.int32)  # (request 0 has 5 rows; max_nodes says 3)
    packed, rows = _packed(case)
    nn = case["num_nodes"]
    args = (case["k_cache"], case["v_cache"], case["cache_lens"])
    scale = 16 ** -0.5
    out_pad, lse_pad = triton_attention(case["q"][:, :3].contiguous(), *args, case["tree_mask"][:, :3].contiguous(),
                                        None, nn.clamp(max=3), scale)
    for splits in (1, 3):
        out = torch.full(packed["q"].shape, float("nan"))
        lse = torch.full(packed["q"].shape[:2], float("nan"))
        triton_attention(packed["q"], *args, packed["tree_mask"], None, nn, scale,
                         row_offsets=packed["cu_num_nodes"][:-1].long(), max_nodes=3, num_splits=splits, out=out,
                         lse=lse)
        for r, (b, i) in enumerate(rows):
            if i < 3:
                torch.testing.assert_close(out[r], out_pad[b, i], atol=2e-6, rtol=1e-5)
                torch.testing.assert_close(lse[r], lse_pad[b, i], atol=2e-6, rtol=1e-5)
            else:
                assert out[r].isnan().all() and lse[r].isnan().all(), (splits, b, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_packed_attention_inputs(backend):
    gen = torch.Generator().manual_seed(9)
    case = make_case(gen, B=2, T=4, Hkv=1, group=1, D=16, lens=(3, 4))
    packed, _ = _packed(case)
    with pytest.raises(TypeError, match="max_nodes: with cu_num_nodes"):
        _run(dict(packed, max_nodes=None), backend)
    with pytest.raises(ValueError, match="cu_num_nodes: cu_num_nodes\\[-1\\] must be the number of packed rows"):
        _run(dict(packed, cu_num_nodes=packed["cu_num_nodes"] - torch.tensor([0, 0, 1], dtype=torch.int32)), backend)
    with pytest.raises(ValueError, match="tree_mask: expected shape"):
        _run(dict(packed, tree_mask=packed["tree_mask"][:-1]), backend)
    with pytest.raises(TypeError, match="num_nodes: with cu_num_nodes"):
        _run(dict(packed, num_nodes=case["num_nodes"]), backend)
