"""The C++ CPU ops (csrc/, specdec._C) called directly as torch.ops.specdec.*, without the Python wrappers.

Complements the backend-parametrized op tests (which reach the C++ kernels through the public API):
schemas, that the CPU kernels are the C++ ones, the C++ input checks (same error types and messages as
specdec/_validation.py, nothing written on failure), OpenMP really used, stacked multi-layer rollback in
one call, and shapes that exercise the kernels' tiling (padded head dims, several key blocks, strided views).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import specdec
import specdec.ops
from specdec import _validation as val
from specdec import reference
from specdec.loop.models.llama import chain_tree
from tests.helpers import FLOAT_DTYPES, assert_close, random_cache, random_trees, to_paged

pytestmark = pytest.mark.skipif(not specdec.ops.HAS_CPP, reason="C++ extension specdec._C not built")
ops = torch.ops.specdec


def test_schemas_match_python():
    for name, schema in specdec.ops.SCHEMAS.items():
        assert str(getattr(ops, name).default._schema) == str(torch._C.parse_schema(f"specdec::{schema}"))


@pytest.mark.parametrize("name", list(specdec.ops.SCHEMAS))
def test_cpu_kernel_is_registered_by_cpp(name):
    dump = torch._C._dispatch_dump(f"specdec::{name}")
    cpu = next(line for line in dump.splitlines() if line.startswith("CPU:"))
    assert f"csrc/{name}.cpp" in cpu, cpu


def test_openmp_is_used():
    if (os.cpu_count() or 1) < 2 or torch.get_num_threads() < 2:
        pytest.skip("a single thread: nothing to check")
    assert ops._parallel_threads() > 1, "csrc/ was compiled without OpenMP: at::parallel_for runs on one thread"


# ----------------------------------------------------------------------------------------------
# direct calls vs the reference
# ----------------------------------------------------------------------------------------------
def test_build_tree_direct():
    gen = torch.Generator().manual_seed(1)
    for T in (1, 5, 33, 70):  # one, two and three mask words
        parents, num_nodes = random_trees(4, T, gen)
        depth, mask = ops.build_tree(parents, num_nodes)
        ref_depth, ref_mask = reference.build_tree(parents.int(), num_nodes)
        assert torch.equal(depth, ref_depth) and torch.equal(mask, ref_mask)


def attention_case(gen, *, B, T, Hkv, group, D, lens, dtype, paged, block_size=16):
    parents, num_nodes = random_trees(B, T, gen)
    cache_lens = torch.tensor(lens, dtype=torch.int32)
    cap = math.ceil((max(lens) + T) / block_size) * block_size
    k = random_cache(B, cap, Hkv, D, dtype, gen)
    v = random_cache(B, cap, Hkv, D, dtype, gen)
    table = None
    if paged:
        k, table = to_paged(k, block_size, gen)
        v = page_like(v, table, k.shape[0])
    q = torch.randn(B, T, Hkv * group, D, generator=gen).to(dtype)
    mask = specdec.build_tree(parents, num_nodes).mask
    return q, k, v, cache_lens, mask, table, num_nodes


def page_like(logical, table, num_blocks):
    """Page `logical` with an existing block table (spare blocks NaN)."""
    block_size = logical.shape[1] // table.shape[1]
    paged = torch.full((num_blocks, block_size, *logical.shape[2:]), float("nan"), dtype=logical.dtype)
    paged[table.view(-1).long()] = logical.reshape(-1, block_size, *logical.shape[2:])
    return paged


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("D,group,T", [(128, 4, 16), (40, 3, 5), (66, 1, 9), (64, 2, 3), (32, 8, 1), (32, 2, 150)])
def test_tree_attention_direct(dtype, paged, D, group, T):
    """M = T * group query rows of 64 (full register tiles), 15 and 9 (tails); D = 66 is padded to the
    tile's rows; prefixes of several 64-key blocks. Requests with M <= 8 rows (ragged trees: some in every case;
    all of them with D = 64 and 32) take the row layout, fp32 K/V read in place when D fills whole vectors."""
    gen = torch.Generator().manual_seed(D + group)
    args = attention_case(gen, B=3, T=T, Hkv=2, group=group, D=D, lens=(0, 150, 61), dtype=dtype, paged=paged)
    out, lse = ops.tree_attention(*args, D ** -0.5)
    ref_out, ref_lse = reference.tree_attention(*args, D ** -0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, torch.float32)
    padding = torch.arange(T).unsqueeze(0) >= args[-1].unsqueeze(1)
    assert (out[padding] == 0).all() and (lse[padding] == -math.inf).all()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
def test_tree_attention_long_causal_chunk(kv_dtype):
    """A prefill-shaped chunk of 200 nodes (a chain: the tile layout runs it in node groups, each over the keys up
    to its last node) after ragged prefixes, with a window, a soft cap and a float8 cache: the reference's result."""
    gen = torch.Generator().manual_seed(11)
    B, T, Hkv, G, D = 2, 200, 2, 3, 32
    lens = torch.tensor([0, 70], dtype=torch.int32)
    k, v = (torch.randn(B, 70 + T, Hkv, D, generator=gen).to(kv_dtype) for _ in range(2))
    q = torch.randn(B, T, Hkv * G, D, generator=gen)
    tree = chain_tree(B, T, torch.tensor([T, 131], dtype=torch.int32))
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype != torch.float32 else {}
    for kw in ({}, {"window_left": T + 20, "logits_soft_cap": 5.0}):
        args = (q, k, v, lens, tree.mask, None, tree.num_nodes, D ** -0.5)
        out, lse = ops.tree_attention(*args, **scales, **kw)
        ref_out, ref_lse = reference.tree_attention(*args, **scales, **kw)
        assert_close(out, ref_out, torch.float32)
        assert_close(lse, ref_lse, torch.float32)


def test_tree_attention_strided_views():
    """q, K and V as non-contiguous views (heads interleaved, last dim strided) give the same result."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, lens, mask, table, nn = attention_case(gen, B=2, T=6, Hkv=2, group=2, D=32, lens=(5, 70),
                                                    dtype=torch.float32, paged=False)
    q_view = q.transpose(2, 3).contiguous().transpose(2, 3)
    k_view = k.transpose(2, 3).contiguous().transpose(2, 3)  # stride(-1) != 1
    v_view = torch.stack([v, torch.full_like(v, float("nan"))], dim=3).flatten(2, 3)[:, :, ::2]  # heads 2 apart
    assert not (q_view.is_contiguous() or k_view.is_contiguous() or v_view.is_contiguous())
    expected = ops.tree_attention(q, k, v, lens, mask, None, nn, 0.3)
    actual = ops.tree_attention(q_view, k_view, v_view, lens, mask, None, nn, 0.3)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_accept_direct_greedy_matches_reference(dtype):
    """Greedy is deterministic: exactly the reference's path and token, ties broken at the first index."""
    gen = torch.Generator().manual_seed(4)
    B, T, V = 6, 9, 37
    parents, num_nodes = random_trees(B, T, gen)
    logits = torch.randint(-2, 3, (B, T, V), generator=gen).to(dtype)  # many ties
    argmax = logits.float().argmax(-1)
    tokens = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32)
    for b in range(B):  # most children carry their parent's argmax, so paths go deep
        for i in range(1, T):
            if torch.rand((), generator=gen) < 0.7:
                tokens[b, i] = argmax[b, max(int(parents[b, i]), 0)]
    args = (logits, tokens, parents.int(), None, torch.zeros(B), torch.arange(B), num_nodes, 0)
    for a, e in zip(ops.accept(*args), reference.accept(*args)):
        assert torch.equal(a, e)


def test_accept_direct_seeded_and_batch_independent():
    gen = torch.Generator().manual_seed(5)
    B, T, V = 5, 7, 64
    parents, num_nodes = random_trees(B, T, gen)
    target, draft = torch.randn(B, T, V, generator=gen), torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32)
    temperature, seeds = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.5]), torch.tensor([11, 12, 13, 14, 15])
    full = ops.accept(target, tokens, parents, draft, temperature, seeds, num_nodes, 3)
    again = ops.accept(target, tokens, parents, draft, temperature, seeds, num_nodes, 3)
    assert all(torch.equal(a, b) for a, b in zip(full, again))
    for b in range(B):
        one = ops.accept(target[b:b + 1], tokens[b:b + 1], parents[b:b + 1], draft[b:b + 1], temperature[b:b + 1],
                         seeds[b:b + 1], num_nodes[b:b + 1], 3)
        assert torch.equal(one[0], full[0][b:b + 1]) and torch.equal(one[2], full[2][b:b + 1])
    for b in range(B):  # a valid path in the tree, padded with -1
        path = full[0][b, : int(full[1][b]) + 1].tolist()
        assert path[0] == 0 and all(int(parents[b, c]) == p for p, c in zip(path, path[1:]))
        assert (full[0][b, len(path):] == -1).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.float64], ids=str)
def test_accept_direct_filters(dtype):
    """The filters through the schema: greedy with a bitmask equals the reference; a sampling row whose
    processed law is a point mass (top_k 1, tiny top_p, min_p near 1, one allowed token) gives its token;
    V = 100 is several vectors and a tail."""
    from specdec.sampling import pack_bitmask
    gen = torch.Generator().manual_seed(10)
    B, T, V = 8, 5, 100
    parents, num_nodes = random_trees(B, T, gen)
    logits = torch.randint(-3, 4, (B, T, V), generator=gen).to(dtype)  # ties
    allowed = torch.rand(B, T, V, generator=gen) < 0.5
    allowed[..., 0] = True
    bitmask = pack_bitmask(allowed)
    best = logits.double().masked_fill(~allowed, -math.inf).argmax(-1)
    tokens = torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32)
    for b in range(B):
        for i in range(1, T):
            if torch.rand((), generator=gen) < 0.7:
                tokens[b, i] = best[b, max(int(parents[b, i]), 0)]
    args = (logits, tokens, parents.int(), None, torch.zeros(B), torch.arange(B), num_nodes, 0, None)
    for a, e in zip(ops.accept(*args, None, None, None, bitmask), reference.accept(*args, None, None, None, bitmask)):
        assert torch.equal(a, e)
    unique = torch.randn(B, 1, V, generator=gen).to(dtype)
    unique[:, 0, 77] = 9.0
    only = torch.zeros(B, 1, V, dtype=torch.bool)
    only[:, 0, 13] = True
    one = (torch.zeros(B, 1, dtype=torch.int32), torch.full((B, 1), -1, dtype=torch.int32), None, torch.ones(B),
           torch.arange(B), torch.ones(B, dtype=torch.int32), 0, None)
    for filters, token in ((dict(top_k=torch.ones(B, dtype=torch.int32)), 77), (dict(top_p=torch.full((B,), 1e-3)), 77),
                           (dict(min_p=torch.full((B,), 0.9999)), 77), (dict(token_bitmask=pack_bitmask(only)), 13)):
        f = [filters.get(k) for k in ("top_k", "top_p", "min_p", "token_bitmask")]
        assert ops.accept(unique, *one, *f)[2].tolist() == [token] * B, filters


def test_kv_append_direct_strided_cache():
    """Caches that are strided views are written in place: K's heads interleaved with V's, and a V whose
    head dim is not the innermost one (element stride != 1)."""
    gen = torch.Generator().manual_seed(6)
    B, T, H, D, cap = 3, 4, 2, 8, 12
    kv = torch.randn(B, cap, 2 * H, D, generator=gen)
    k = kv[:, :, :H]
    v_storage = torch.randn(B, cap, D, H, generator=gen)
    v = v_storage.transpose(2, 3)
    assert v.stride(-1) != 1
    k_new, v_new = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    lens = torch.tensor([0, 3, 8], dtype=torch.int32)
    expected_k, expected_v, neighbour = k.clone(), v.clone(), kv[:, :, H:].clone()
    reference.kv_append(expected_k, expected_v, k_new, v_new, lens, None)
    ops.kv_append(k, v, k_new, v_new, lens, None)
    assert torch.equal(k, expected_k) and torch.equal(v, expected_v)
    assert torch.equal(kv[:, :, H:], neighbour)  # the heads interleaved with K's are not written


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kv_rollback_stacked_layers_in_one_call(dtype, paged):
    """A 5-D stack of 3 layers plus a single 4-D layer, K and V, moved in one call like the reference,
    with overlapping moves (path [0, 2, 3]: 2 -> 1 then 3 -> 2) and an untouched request (path [0])."""
    gen = torch.Generator().manual_seed(7)
    B, H, D, cap, block = 4, 2, 8, 32, 8
    lens = torch.tensor([3, 0, 17, 9], dtype=torch.int32)
    path = torch.tensor([[0, 2, 3, -1, -1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 4, 5, -1, -1],
                         [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    num_accepted = torch.tensor([2, 0, 3, 5], dtype=torch.int32)

    def layer():
        logical = random_cache(B, cap, H, D, dtype, gen)
        return to_paged(logical, block, torch.Generator().manual_seed(8)) if paged else (logical, None)

    stack_k, table = zip(*[layer() for _ in range(3)])
    stack_k, table = torch.stack(stack_k), table[0]
    stack_v = torch.stack([layer()[0] for _ in range(3)])
    single_k, single_v = layer()[0], layer()[0]
    ks, vs = [stack_k, single_k], [stack_v, single_v]
    expected = [t.clone() for t in ks + vs]
    ref_lens = lens.clone()
    reference.kv_rollback(expected[:2], expected[2:], ref_lens, path, num_accepted, table)
    ops.kv_rollback(ks, vs, lens, path, num_accepted, table)
    assert torch.equal(lens, ref_lens) and lens.tolist() == [6, 1, 21, 15]
    for actual, exp in zip(ks + vs, expected):  # (paged: the spare blocks are NaN)
        torch.testing.assert_close(actual, exp, atol=0, rtol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------------
# C++ input checks: the same type and message as _validation.py, nothing written on failure
# ----------------------------------------------------------------------------------------------
def base_inputs():
    gen = torch.Generator().manual_seed(9)
    B, T, Hq, Hkv, D, cap, V = 2, 4, 4, 2, 8, 16, 10
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]], dtype=torch.int32)
    num_nodes = torch.tensor([4, 3], dtype=torch.int32)
    return dict(
        parents=parents, num_nodes=num_nodes, mask=reference.build_tree(parents, num_nodes)[1],
        q=torch.randn(B, T, Hq, D, generator=gen), k=torch.randn(B, cap, Hkv, D, generator=gen),
        v=torch.randn(B, cap, Hkv, D, generator=gen), lens=torch.tensor([2, 5], dtype=torch.int32),
        k_new=torch.randn(B, T, Hkv, D, generator=gen), v_new=torch.randn(B, T, Hkv, D, generator=gen),
        logits=torch.randn(B, T, V, generator=gen), draft=torch.randn(B, T, V, generator=gen),
        tokens=torch.randint(0, V, (B, T), generator=gen, dtype=torch.int32),
        temperature=torch.tensor([0.0, 0.9]), seeds=torch.tensor([3, 4]),
        path=torch.tensor([[0, 1, 3, -1], [0, 2, -1, -1]], dtype=torch.int32),
        num_accepted=torch.tensor([2, 1], dtype=torch.int32),
        table=torch.tensor([[3, 0], [1, 2]], dtype=torch.int32), paged_k=torch.randn(4, 8, Hkv, D, generator=gen),
        paged_v=torch.randn(4, 8, Hkv, D, generator=gen))


def with_(x, index, value):
    x = x.clone()
    x[index] = value
    return x


def bad_cases():
    """(op, python check, schema args) with one thing wrong each."""
    x = base_inputs()

    def tree(parents=x["parents"], num_nodes=x["num_nodes"]):
        return "build_tree", val.check_build_tree, (parents, num_nodes)

    def attention(q=x["q"], k=x["k"], v=x["v"], lens=x["lens"], mask=x["mask"], table=None, nn=x["num_nodes"],
                  scales=(1.0, 1.0), window_left=-1, cap=0.0, scale=0.5):
        return ("tree_attention", val.check_tree_attention,
                (q, k, v, lens, mask, table, nn, scale, *scales, window_left, cap))

    def accept(logits=x["logits"], tokens=x["tokens"], parents=x["parents"], draft=x["draft"],
               temperature=x["temperature"], seeds=x["seeds"], nn=x["num_nodes"], offset=0, offsets=None,
               top_k=None, top_p=None, min_p=None, bitmask=None, method="token", probs=False):
        # the schema takes (int offset, Tensor? offsets); the public op one `offset`, an int or a tensor
        def python_check(*a):
            return val.check_accept(*a[:7], a[7] if a[8] is None else a[8], *a[9:])
        return "accept", python_check, (logits, tokens, parents, draft, temperature, seeds, nn, offset, offsets,
                                        top_k, top_p, min_p, bitmask, method, probs)

    W = (x["logits"].shape[-1] + 31) // 32
    probs, probs_d = torch.softmax(x["logits"], -1), torch.softmax(x["draft"], -1)
    everything = torch.full((2, 4, W), -1, dtype=torch.int32)

    def append(k=x["k"], v=x["v"], k_new=x["k_new"], v_new=x["v_new"], lens=x["lens"], table=None, scales=(1.0, 1.0)):
        return "kv_append", val.check_kv_append, (k, v, k_new, v_new, lens, table, *scales)

    k8, v8 = x["k"].to(torch.float8_e4m3fn), x["v"].to(torch.float8_e5m2)

    def rollback(ks=(x["k"],), vs=(x["v"],), lens=x["lens"], path=x["path"], na=x["num_accepted"], table=None):
        return "kv_rollback", val.check_kv_rollback, (list(ks), list(vs), lens, path, na, table)

    # a paged cache of blocks of 2**16 positions whose table addresses 2**31 + 2**16 positions (8 MB in all): a
    # request can reach positions past int32
    Hkv, D = x["k"].shape[-2:]
    huge_k, huge_v = torch.zeros(1, 2**16, Hkv, D), torch.zeros(1, 2**16, Hkv, D)
    huge_table = torch.zeros(2, 2**15 + 1, dtype=torch.int32)
    near_int32_max = torch.tensor([2**31 - 2, 0], dtype=torch.int32)
    kv = torch.randn(2, 17, Hkv, D)  # rows 0..15 and 1..16 of one buffer: K and V overlap

    return {
        "tree/dtype": tree(parents=x["parents"].float()),
        "tree/dim": tree(parents=x["parents"].view(-1)),
        "tree/num_nodes_shape": tree(num_nodes=x["num_nodes"][:1]),
        "tree/num_nodes_range": tree(num_nodes=torch.tensor([0, 3], dtype=torch.int32)),
        "tree/root": tree(parents=with_(x["parents"], (1, 0), 0)),
        "tree/parent_after_child": tree(parents=with_(x["parents"], (0, 2), 2)),
        "tree/parents_int64": tree(parents=with_(x["parents"].long(), (0, 1), 2**32)),
        "tree/num_nodes_int64": tree(num_nodes=torch.tensor([2**32 + 2, 3])),
        "attn/q_dtype": attention(q=x["q"].int()),
        "attn/k_dtype": attention(k=x["k"].half(), v=x["v"].half()),
        "attn/v_dtype": attention(v=x["v"].double()),
        "attn/v_shape": attention(v=x["v"][:, :8]),
        "attn/k_dims": attention(k=x["k"][0], v=x["v"][0]),
        "attn/head_dim": attention(k=x["k"][..., :4], v=x["v"][..., :4]),
        "attn/gqa": attention(q=x["q"][:, :, :3]),
        "attn/contiguous_rows": attention(k=x["k"][:1], v=x["v"][:1]),
        "attn/lens_dtype": attention(lens=x["lens"].long()),
        "attn/mask_shape": attention(mask=x["mask"][:, :3]),
        "attn/table_rows": attention(k=x["paged_k"], v=x["paged_v"], table=x["table"][:1]),
        "attn/table_dtype": attention(k=x["paged_k"], v=x["paged_v"], table=x["table"].long()),
        "attn/nn_range": attention(nn=torch.tensor([5, 1], dtype=torch.int32)),
        "attn/negative_len": attention(lens=torch.tensor([-1, 0], dtype=torch.int32)),
        "attn/no_room": attention(lens=torch.tensor([2, 13], dtype=torch.int32)),
        "attn/block_id": attention(k=x["paged_k"], v=x["paged_v"], table=with_(x["table"], (1, 0), 4)),
        "attn/no_self_bit": attention(mask=with_(x["mask"], (0, 2, 0), 1)),
        "attn/future_bit": attention(mask=with_(x["mask"], (0, 1, 0), 0b1011)),
        "attn/q_float8": attention(q=x["q"].to(torch.float8_e4m3fn)),
        "attn/v_float8_other_format": attention(k=k8, v=v8),
        "attn/scale_not_float8": attention(scales=(2.0, 1.0)),
        "attn/k_scale_negative": attention(k=k8, v=k8, scales=(-1.0, 1.0)),
        "attn/v_scale_nan": attention(k=k8, v=k8, scales=(1.0, float("nan"))),
        "attn/v_scale_inf": attention(k=k8, v=k8, scales=(1.0, float("inf"))),
        "attn/window_too_small": attention(window_left=2),
        "attn/window_negative": attention(window_left=-5),
        "attn/cap_negative": attention(cap=-0.5),
        "attn/cap_nan": attention(cap=float("nan")),
        "attn/no_kv_heads": attention(k=x["k"][:, :, :0], v=x["v"][:, :, :0]),
        "attn/no_head_dim": attention(q=x["q"][..., :0], k=x["k"][..., :0], v=x["v"][..., :0]),
        "attn/num_nodes_int64": attention(nn=torch.tensor([2**32 + 2, 3])),
        "attn/scale_nan": attention(scale=float("nan")),
        "attn/scale_inf": attention(scale=float("-inf")),
        "attn/positions_past_int32": attention(k=huge_k, v=huge_v, table=huge_table, lens=near_int32_max),
        "accept/logits_dim": accept(logits=x["logits"][0]),
        "accept/method_name": accept(method="blocks"),
        "accept/method_block_without_draft": accept(draft=None, method="block"),
        "accept/method_traversal_without_draft": accept(draft=None, method="traversal"),
        "accept/method_block_on_a_tree": accept(parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]]),
                                                nn=torch.tensor([4, 4], dtype=torch.int32), method="block"),
        "accept/tokens_shape": accept(tokens=x["tokens"][:, :3]),
        "accept/tokens_dtype": accept(tokens=x["tokens"].float()),
        "accept/parents_shape": accept(parents=x["parents"][:1]),
        "accept/draft_shape": accept(draft=x["draft"][..., :4]),
        "accept/temperature_shape": accept(temperature=torch.ones(3)),
        "accept/seeds_dtype": accept(seeds=x["seeds"].float()),
        "accept/offset": accept(offset=-1),
        "accept/offset_range": accept(offset=2**60),
        "accept/offsets_dtype": accept(offsets=torch.zeros(2)),
        "accept/offsets_shape": accept(offsets=torch.zeros(3, dtype=torch.int64)),
        "accept/offsets_negative": accept(offsets=torch.tensor([0, -1])),
        "accept/offsets_range": accept(offsets=torch.tensor([2**60, 0])),
        "accept/parents_values": accept(parents=with_(x["parents"], (0, 3), 3)),
        "accept/parents_int64": accept(parents=with_(x["parents"].long(), (1, 2), 2**32)),
        "accept/tokens_int64": accept(tokens=with_(x["tokens"].long(), (0, 1), 2**32 + 5)),
        "accept/tokens_int64_real_node": accept(tokens=with_(with_(x["tokens"].long(), (1, 3), 2**40), (1, 2), -2**40)),
        "accept/num_nodes_int64": accept(nn=torch.tensor([2**32 + 2, 3])),
        "accept/no_vocabulary": accept(logits=x["logits"][..., :0], draft=x["draft"][..., :0]),
        "accept/temperature_past_float32": accept(temperature=torch.tensor([0.0, 1e39], dtype=torch.float64)),
        "accept/top_p_rounds_to_one": accept(top_p=torch.tensor([1 + 1e-12, 0.5], dtype=torch.float64)),
        "accept/token_range": accept(tokens=with_(x["tokens"], (1, 2), 10)),
        "accept/temperature_negative": accept(temperature=torch.tensor([0.0, -1.0])),
        "accept/temperature_nan": accept(temperature=torch.tensor([float("nan"), 1.0])),
        "accept/target_nan": accept(logits=with_(x["logits"], (1, 3, 2), float("nan"))),  # a padding row too
        "accept/target_posinf": accept(logits=with_(x["logits"], (0, 1, 9), float("inf"))),
        "accept/target_row_neginf": accept(logits=with_(x["logits"], (0, 2), float("-inf"))),
        "accept/draft_nan": accept(draft=with_(x["draft"], (0, 0, 0), float("nan"))),
        "accept/draft_row_neginf": accept(draft=with_(x["draft"], (1, 1), float("-inf"))),
        "accept/top_k_dtype": accept(top_k=torch.tensor([1.0, 2.0])),
        "accept/top_k_shape": accept(top_k=torch.tensor([1, 2, 3], dtype=torch.int32)),
        "accept/top_k_negative": accept(top_k=torch.tensor([3, -1])),
        "accept/top_p_dtype": accept(top_p=torch.tensor([1, 1])),
        "accept/top_p_shape": accept(top_p=torch.ones(2, 1)),
        "accept/top_p_zero": accept(top_p=torch.tensor([0.5, 0.0])),
        "accept/top_p_above_one": accept(top_p=torch.tensor([1.5, 0.5])),
        "accept/top_p_nan": accept(top_p=torch.tensor([float("nan"), 0.5])),
        "accept/min_p_one": accept(min_p=torch.tensor([0.0, 1.0])),
        "accept/min_p_negative": accept(min_p=torch.tensor([-0.5, 0.0], dtype=torch.float64)),
        "accept/min_p_device_shape": accept(min_p=torch.zeros(3)),
        "accept/bitmask_dtype": accept(bitmask=everything.long()),
        "accept/bitmask_dims": accept(bitmask=everything[0]),
        "accept/bitmask_shape": accept(bitmask=torch.full((2, 4, W + 1), -1, dtype=torch.int32)),
        "accept/bitmask_empty_row": accept(bitmask=with_(everything, (1, 2), 0)),
        "accept/bitmask_past_vocab": accept(bitmask=with_(everything, (0, 3), ~((1 << 10) - 1))),  # V = 10
        "accept/bitmask_allowed_neginf": accept(logits=with_(x["logits"], (0, 1, 4), float("-inf")),
                                                bitmask=with_(everything, (0, 1), 1 << 4)),
        "accept/bitmask_draft_neginf": accept(draft=with_(x["draft"], (1, 0, 0), float("-inf")),
                                              bitmask=with_(everything, (1, 0), 1)),
        "accept/probs_dim": accept(logits=probs[0], draft=probs_d, probs=True),
        "accept/probs_draft_shape": accept(logits=probs, draft=probs_d[..., :4], probs=True),
        "accept/probs_traversal_without_draft": accept(logits=probs, draft=None, method="traversal", probs=True),
        "accept/probs_negative": accept(logits=with_(probs, (0, 1, 3), -0.5), draft=probs_d, probs=True),
        "accept/probs_draft_negative": accept(logits=probs, draft=with_(probs_d, (1, 0, 2), -1e-9), probs=True),
        "accept/probs_nan": accept(logits=with_(probs, (1, 2, 2), float("nan")), draft=probs_d, probs=True),
        "accept/probs_posinf": accept(logits=probs, draft=with_(probs_d, (0, 0, 1), float("inf")), probs=True),
        "accept/probs_zero_row": accept(logits=with_(probs, (1, 1), 0.0), draft=probs_d, probs=True),
        "accept/probs_draft_zero_row": accept(logits=probs, draft=with_(probs_d, (0, 2), 0.0), probs=True),
        "accept/probs_bitmask_allowed_zero": accept(logits=with_(probs, (0, 1, 4), 0.0), draft=probs_d, probs=True,
                                                    bitmask=with_(everything, (0, 1), 1 << 4)),
        "append/k_new_dtype": append(k_new=x["k_new"].half()),
        "append/v_new_dtype": append(v_new=x["v_new"].double()),
        "append/v_new_shape": append(v_new=x["v_new"][:, :3]),
        "append/head_dim": append(k_new=x["k_new"][..., :4], v_new=x["v_new"][..., :4]),
        "append/cache_dtype": append(k=x["k"].half(), v=x["v"].half()),
        "append/no_room": append(lens=torch.tensor([12, 13], dtype=torch.int32)),
        "append/block_id": append(k=x["paged_k"], v=x["paged_v"], table=with_(x["table"], (0, 0), -1)),
        "append/k_new_float8": append(k_new=x["k_new"].to(torch.float8_e4m3fn)),
        "append/v_new_int_float8_cache": append(k=k8, v=k8, v_new=x["v_new"].int()),
        "append/v_scale_not_float8": append(scales=(1.0, 0.5)),
        "append/k_scale_zero": append(k=k8, v=k8, k_new=x["k_new"].half(), scales=(0.0, 1.0)),
        "rollback/empty": rollback(ks=(), vs=()),
        "rollback/count": rollback(vs=(x["v"], x["v"])),
        "rollback/lens_dtype": rollback(lens=x["lens"].long()),
        "rollback/layer_shape": rollback(ks=(x["k"], x["k"][:, :8]), vs=(x["v"], x["v"][:, :8])),
        "rollback/layer_dtype": rollback(ks=(x["k"], x["k"].half()), vs=(x["v"], x["v"].half())),
        "rollback/path_rows": rollback(path=x["path"][:1]),
        "rollback/path_dtype": rollback(path=x["path"].float()),
        "rollback/na_shape": rollback(na=x["num_accepted"][:1]),
        "rollback/na_range": rollback(na=torch.tensor([4, 0], dtype=torch.int32)),
        "rollback/root": rollback(path=with_(x["path"], (1, 0), 1)),
        "rollback/increasing": rollback(path=with_(x["path"], (0, 2), 1)),
        "rollback/capacity": rollback(lens=torch.tensor([2, 14], dtype=torch.int32)),
        "rollback/block_id": rollback(ks=(x["paged_k"],), vs=(x["paged_v"],), table=with_(x["table"], (1, 0), 9)),
        "rollback/path_int64": rollback(path=with_(x["path"].long(), (0, 1), 2**32 + 1)),
        "rollback/num_accepted_int64": rollback(na=torch.tensor([2**32 + 1, 1])),
        "rollback/k_is_v": rollback(vs=(x["k"],)),
        "rollback/overlapping_views": rollback(ks=(kv[:, :16],), vs=(kv[:, 1:],)),
        "rollback/layer_twice": rollback(ks=(x["k"], x["k"]), vs=(x["v"], x["v"].clone())),
        "rollback/expanded": rollback(ks=(x["k"][:1].expand(2, -1, -1, -1),)),
        "rollback/positions_past_int32": rollback(ks=(huge_k,), vs=(huge_v,), table=huge_table, lens=near_int32_max),
    }


@pytest.mark.parametrize("case", list(bad_cases()))
def test_cpp_checks_match_python(case):
    name, python_check, args = bad_cases()[case]
    with pytest.raises((ValueError, TypeError)) as py_err:
        python_check(*args)
    mutable = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in mutable]
    with pytest.raises((ValueError, TypeError)) as cpp_err:
        getattr(ops, name)(*args)
    assert type(cpp_err.value) is type(py_err.value)
    assert str(cpp_err.value) == str(py_err.value)
    for t, b in zip(mutable, before):  # nothing written
        torch.testing.assert_close(t, b, atol=0, rtol=0, equal_nan=True)
