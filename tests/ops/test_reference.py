"""The reference backend against independent naive computations (the spec checks itself)."""
import math

import pytest
import torch
import torch.nn.functional as F

import specdec
from specdec._layout import unpack_bits
from tests.helpers import from_paged, random_cache, random_root_paths, random_trees, to_paged


# ----------------------------------------------------------------------------------------------
# tree attention
# ----------------------------------------------------------------------------------------------
def sdpa_tree_attention(q, k_logical, v_logical, cache_lens, tree_mask, num_nodes, scale):
    """Per request: gather [0, L+T) of the logical cache, expand GQA, dense bool mask, SDPA in float64."""
    B, T, Hq, D = q.shape
    group = Hq // k_logical.shape[2]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    bits = unpack_bits(tree_mask, T)
    for b in range(B):
        L, n = int(cache_lens[b]), int(num_nodes[b])
        k = k_logical[b, : L + T].double().repeat_interleave(group, 1).transpose(0, 1)  # (Hq, L+T, D)
        v = v_logical[b, : L + T].double().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.cat([torch.ones(n, L, dtype=torch.bool), bits[b, :n]], 1)
        o = F.scaled_dot_product_attention(q[b, :n].double().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[b, :n] = o.transpose(0, 1)
    return out


def test_zero_queries_average_the_visible_values():
    # q = 0 gives uniform weights: out = mean of the visible V rows, lse = log(#visible)
    parents = torch.tensor([[-1, 0, 0, 1]])
    info = specdec.build_tree(parents)
    L, T = 3, 4
    v = torch.arange(8, dtype=torch.float64).view(1, 8, 1, 1).expand(1, 8, 1, 2).contiguous()
    k = torch.randn(1, 8, 1, 2, dtype=torch.float64)
    q = torch.zeros(1, T, 1, 2, dtype=torch.float64)
    out, lse = specdec.tree_attention(q, k, v, torch.tensor([L], dtype=torch.int32), info.mask, return_lse=True,
                                      backend="torch")
    # visible rows: prefix 0,1,2 plus tree rows 3+j for j in ancestors-or-self
    visible = {0: [0, 1, 2, 3], 1: [0, 1, 2, 3, 4], 2: [0, 1, 2, 3, 5], 3: [0, 1, 2, 3, 4, 6]}
    for i, rows in visible.items():
        assert out[0, i, 0].tolist() == pytest.approx([sum(rows) / len(rows)] * 2)
        assert float(lse[0, i, 0]) == pytest.approx(math.log(len(rows)))


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (8, 2)])
def test_matches_sdpa_with_explicit_mask(Hq, Hkv):
    gen = torch.Generator().manual_seed(Hq * 10 + Hkv)
    B, T, D = 4, 9, 16
    parents, num_nodes = random_trees(B, T, gen)
    info = specdec.build_tree(parents, num_nodes)
    cache_lens = torch.tensor([0, 5, 17, 31], dtype=torch.int32)
    k, v = random_cache(B, 48, Hkv, D, torch.float64, gen), random_cache(B, 48, Hkv, D, torch.float64, gen)
    q = torch.randn(B, T, Hq, D, generator=gen, dtype=torch.float64)
    out, lse = specdec.tree_attention(q, k, v, cache_lens, info.mask, num_nodes=num_nodes, scale=0.3,
                                      return_lse=True, backend="torch")
    expected = sdpa_tree_attention(q, k, v, cache_lens, info.mask, num_nodes, 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for b in range(B):
        n = int(num_nodes[b])
        assert torch.all(out[b, n:] == 0) and torch.all(lse[b, n:] == -math.inf)
        assert torch.isfinite(lse[b, :n]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_paged_equals_contiguous(dtype):
    gen = torch.Generator().manual_seed(3)
    B, T, Hq, Hkv, D, cap, bs = 3, 5, 4, 2, 8, 40, 8
    parents, num_nodes = random_trees(B, T, gen)
    info = specdec.build_tree(parents, num_nodes)
    cache_lens = torch.tensor([35, 0, 13], dtype=torch.int32)
    k, v = random_cache(B, cap, Hkv, D, dtype, gen), random_cache(B, cap, Hkv, D, dtype, gen)
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    kp, table = to_paged(k, bs, torch.Generator().manual_seed(9))
    vp, table_v = to_paged(v, bs, torch.Generator().manual_seed(9))
    assert torch.equal(table, table_v) and torch.equal(from_paged(kp, table), k)
    args = dict(num_nodes=num_nodes, return_lse=True, backend="torch")
    out_c, lse_c = specdec.tree_attention(q, k, v, cache_lens, info.mask, **args)
    out_p, lse_p = specdec.tree_attention(q, kp, vp, cache_lens, info.mask, block_table=table, **args)
    assert out_c.dtype == dtype and lse_c.dtype == torch.float32
    assert torch.equal(out_c, out_p) and torch.equal(lse_c, lse_p)


# ----------------------------------------------------------------------------------------------
# KV cache ops
# ----------------------------------------------------------------------------------------------
def test_kv_append_paged_matches_index_put():
    gen = torch.Generator().manual_seed(4)
    B, T, H, D, cap, bs = 3, 6, 2, 4, 24, 4
    logical_k, logical_v = random_cache(B, cap, H, D, torch.float32, gen), random_cache(B, cap, H, D, torch.float32, gen)
    kp, table = to_paged(logical_k, bs, torch.Generator().manual_seed(5))
    vp, _ = to_paged(logical_v, bs, torch.Generator().manual_seed(5))
    cache_lens = torch.tensor([0, 7, cap - T], dtype=torch.int32)
    k_new, v_new = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    specdec.kv_append(kp, vp, k_new, v_new, cache_lens, block_table=table, backend="torch")
    rows = cache_lens.long().unsqueeze(1) + torch.arange(T)
    batch = torch.arange(B).unsqueeze(1).expand(B, T)
    logical_k[batch, rows], logical_v[batch, rows] = k_new, v_new
    assert torch.equal(from_paged(kp, table), logical_k) and torch.equal(from_paged(vp, table), logical_v)
    assert cache_lens.tolist() == [0, 7, cap - T]  # append does not commit


def test_kv_rollback_overlapping_path_by_hand():
    # path [0, 2, 3]: row L+2 -> L+1 must be read before L+3 -> L+2 overwrites it
    L = 2
    k = torch.arange(8, dtype=torch.float32).view(1, 8, 1, 1)
    v = -k.clone()
    cache_lens = torch.tensor([L], dtype=torch.int32)
    path = torch.tensor([[0, 2, 3, -1]], dtype=torch.int32)
    specdec.kv_rollback(k, v, cache_lens, path, torch.tensor([2], dtype=torch.int32), backend="torch")
    assert k.flatten().tolist() == [0, 1, 2, 4, 5, 5, 6, 7]
    assert v.flatten().tolist() == [-0.0, -1, -2, -4, -5, -5, -6, -7]
    assert cache_lens.tolist() == [L + 3]


@pytest.mark.parametrize("form", ["layer", "stacked", "list"])
def test_kv_rollback_matches_gather_then_write(form):
    gen = torch.Generator().manual_seed(6)
    B, T, H, D, cap, layers = 4, 8, 2, 3, 32, 3
    parents, num_nodes = random_trees(B, T, gen, ragged=False)
    cache_lens = torch.tensor([0, 3, 10, 20], dtype=torch.int32)
    paths, num_accepted = random_root_paths(parents, gen)
    ks = torch.randn(layers, B, cap, H, D, generator=gen)
    vs = torch.randn(layers, B, cap, H, D, generator=gen)
    expected_k, expected_v = ks.clone(), vs.clone()
    for b in range(B):
        L, n = int(cache_lens[b]), int(num_accepted[b]) + 1
        src = L + paths[b, :n].long()
        expected_k[:, b, L: L + n] = ks[:, b, src]
        expected_v[:, b, L: L + n] = vs[:, b, src]
    if form == "layer":
        ks, vs, expected_k, expected_v = ks[0], vs[0], expected_k[0], expected_v[0]
        k_arg, v_arg = ks, vs
    elif form == "stacked":
        k_arg, v_arg = ks, vs
    else:
        k_arg, v_arg = list(ks.unbind(0)), list(vs.unbind(0))
    lens = cache_lens.clone()
    specdec.kv_rollback(k_arg, v_arg, lens, paths, num_accepted, backend="torch")
    assert torch.equal(ks, expected_k) and torch.equal(vs, expected_v)
    assert torch.equal(lens, cache_lens + num_accepted + 1)


# ----------------------------------------------------------------------------------------------
# acceptance (losslessness is proven statistically in tests/ops/accept/test_lossless.py)
# ----------------------------------------------------------------------------------------------
def test_greedy_tree_by_hand():
    # tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}; argmax after root = 7, after node 2 = 5, after node 4 = 1
    V = 8
    logits = torch.zeros(1, 5, V)
    logits[0, 0, 7] = logits[0, 2, 5] = logits[0, 4, 1] = 3.0
    tokens = torch.tensor([[0, 6, 7, 1, 5]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    res = specdec.accept(logits, tokens, parents, backend="torch")
    assert res.accepted_nodes.tolist() == [[0, 2, 4, -1, -1]]
    assert res.num_accepted.tolist() == [2] and res.next_tokens.tolist() == [1]


def test_greedy_ties_take_the_first_index_and_first_matching_child():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 1] = logits[0, 0, 2] = 1.0  # tie: argmax is 1
    tokens = torch.tensor([[0, 1, 1]])  # two children with the argmax token: node 1 wins
    res = specdec.accept(logits, tokens, torch.tensor([[-1, 0, 0]]), backend="torch")
    assert res.accepted_nodes.tolist() == [[0, 1, -1]] and res.next_tokens.tolist() == [0]


def test_greedy_chain_is_the_longest_matching_prefix():
    gen = torch.Generator().manual_seed(7)
    B, T, V = 16, 6, 5
    logits = torch.randn(B, T, V, generator=gen)
    argmax = logits.argmax(-1)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[:, 1:] = torch.where(torch.rand(B, T - 1, generator=gen) < 0.7, argmax[:, :-1], tokens[:, 1:])
    parents = torch.arange(-1, T - 1).expand(B, T)
    res = specdec.accept(logits, tokens, parents, backend="torch")
    for b in range(B):
        n = 0
        while n + 1 < T and tokens[b, n + 1] == argmax[b, n]:
            n += 1
        assert int(res.num_accepted[b]) == n
        assert res.accepted_nodes[b, : n + 1].tolist() == list(range(n + 1))
        assert int(res.next_tokens[b]) == int(argmax[b, n])


def test_same_seed_same_result_whatever_the_batch():
    gen = torch.Generator().manual_seed(8)
    B, T, V = 6, 5, 7
    logits, draft = torch.randn(B, T, V, generator=gen), torch.randn(B, T, V, generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents, num_nodes = random_trees(B, T, gen)
    seeds = torch.arange(100, 100 + B)
    full = specdec.accept(logits, tokens, parents, draft_logits=draft, temperature=0.8, seeds=seeds,
                          num_nodes=num_nodes, backend="torch")
    perm = torch.tensor([3, 1, 5])
    part = specdec.accept(logits[perm], tokens[perm], parents[perm], draft_logits=draft[perm], temperature=0.8,
                          seeds=seeds[perm], num_nodes=num_nodes[perm], backend="torch")
    for field_full, field_part in zip(full, part):
        assert torch.equal(field_full[perm], field_part)


# ----------------------------------------------------------------------------------------------
# the processed law (mask, temperature, top-k, top-p, min-p) on hand-made rows
# ----------------------------------------------------------------------------------------------
from specdec import reference as ref  # noqa: E402

INF = math.inf


def kept(row, t=1.0, top_k=0, top_p=1.0, min_p=0.0, allowed=None):
    """The kept token indices of processed_keep on a hand-made row."""
    row = torch.tensor(row, dtype=torch.float64)
    allowed = None if allowed is None else torch.tensor(allowed)
    mask = ref.processed_keep(row, t, top_k, top_p, min_p, allowed)
    return torch.nonzero(mask).flatten().tolist()


def by_definition(row, t, top_k, top_p, min_p, allowed):
    """The processed law's definition (specdec/sampling.py), one token at a time (O(V^2), exact rationals aside)."""
    V = len(row)
    l = [(row[x] if allowed is None or allowed[x] else -INF) / t for x in range(V)]
    keep = [v > -INF for v in l]
    if 0 < top_k < V:
        keep = [keep[x] and sum(keep[y] and l[y] > l[x] for y in range(V)) < top_k for x in range(V)]

    def probs(keep):
        z = sum(math.exp(l[y] - max(l)) for y in range(V) if keep[y])
        return [math.exp(l[y] - max(l)) / z if keep[y] else 0.0 for y in range(V)]

    if top_p < 1:
        p = probs(keep)
        keep = [keep[x] and sum(p[y] for y in range(V) if keep[y] and l[y] > l[x]) < top_p for x in range(V)]
    if min_p > 0:
        p = probs(keep)
        keep = [keep[x] and p[x] >= min_p * max(p) for x in range(V)]
    return [x for x in range(V) if keep[x]]


def test_top_k_keeps_every_tie_at_the_kth_value():
    row = [3.0, 2.0, 2.0, 2.0, 1.0, 0.0]
    assert kept(row, top_k=1) == [0]
    assert kept(row, top_k=2) == kept(row, top_k=4) == [0, 1, 2, 3]
    assert kept(row, top_k=5) == [0, 1, 2, 3, 4]
    assert kept(row, top_k=0) == kept(row, top_k=6) == kept(row, top_k=100) == list(range(6))  # off


def test_all_equal_row_keeps_everything():
    row = [0.5] * 7
    for kw in (dict(top_k=1), dict(top_p=1e-9), dict(min_p=0.999), dict(top_k=1, top_p=1e-9, min_p=0.999)):
        assert kept(row, **kw) == list(range(7)), kw
    torch.testing.assert_close(ref.processed_probs(torch.tensor(row), 0.7, top_k=1), torch.full((7,), 1 / 7,
                               dtype=torch.float64))


def test_neg_inf_entries_are_never_kept():
    row = [0.0, -INF, 1.0, -INF, -INF]
    assert kept(row) == [0, 2]
    assert kept(row, top_k=3) == [0, 2]  # fewer finite entries than k: all finite ones
    assert kept(row, top_k=1) == [2]
    assert kept(row, top_p=0.999999, min_p=1e-9) == [0, 2]
    assert kept([-INF, -INF], top_k=1) == [] and ref.processed_probs(torch.tensor([-INF, -INF]), 1.0).sum() == 0


def test_top_k_one_is_the_argmax():
    row = torch.tensor([0.1, 2.5, -1.0, 2.4999])
    assert torch.equal(ref.processed_probs(row, 1.3, top_k=1), torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))


def test_tiny_top_p_keeps_the_top_group_only():
    assert kept([1.0, 3.0, 2.9, -2.0], top_p=1e-6) == [1]
    assert kept([1.0, 3.0, 3.0, -2.0], top_p=1e-6) == [1, 2]  # ties with the top token


def test_top_p_boundary_is_strict_and_keeps_ties():
    p = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    row = p.log().tolist()  # the mass above the two 0.125 tokens is 0.75
    assert kept(row, top_p=0.75 + 1e-9) == [0, 1, 2, 3]  # both ties at the boundary stay
    assert kept(row, top_p=0.75 - 1e-9) == [0, 1]  # both go
    assert kept(row, top_p=0.5 + 1e-9) == [0, 1] and kept(row, top_p=0.5 - 1e-9) == [0]


def test_min_p_close_to_one():
    row = [2.0, 2.0 - 1e-4, 1.0, 2.0]  # p(x) / max p = exp(-1e-4) = 0.99990000499...
    assert kept(row, min_p=0.9999) == [0, 1, 3]
    assert kept(row, min_p=0.99991) == [0, 3]  # ties with the max always stay
    assert kept(row, t=2.0, min_p=0.99995) == [0, 1, 3]  # temperature first: the ratio is exp(-5e-5)


def test_steps_apply_in_order():
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64).log().tolist()
    assert kept(p, top_p=0.5) == [0, 1]  # the mass above 0.3 is 0.4
    assert kept(p, top_k=2, top_p=0.5) == [0]  # top-k first: renormalized, the mass above it is 4/7
    assert kept(p, min_p=0.55) == [0, 1] and kept(p, min_p=0.45) == [0, 1, 2]  # against 0.55 * 0.4, 0.45 * 0.4
    assert kept(p, min_p=0.2) == [0, 1, 2, 3] and kept(p, top_k=3, min_p=0.2) == [0, 1, 2]
    assert kept([1.0, 0.0, -1.0], t=1.0, top_p=0.7) == [0, 1]  # p = [0.665, 0.245, 0.090]
    assert kept([1.0, 0.0, -1.0], t=0.5, top_p=0.7) == [0]  # temperature first: p = [0.867, 0.117, 0.016]
    law = ref.processed_probs(torch.tensor(p), 1.0, top_k=3)
    torch.testing.assert_close(law, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0], dtype=torch.float64))


def test_mask_comes_first():
    row, allowed = [5.0, 1.0, 0.0, 0.5], [False, True, True, True]
    assert kept(row, top_k=1, allowed=allowed) == [1]  # the disallowed max is not counted
    assert kept(row, min_p=0.6, allowed=allowed) == [1, 3]  # max p among the allowed: exp(-0.5) >= 0.6
    assert ref.greedy_token(torch.tensor(row), torch.tensor(allowed)) == 1
    assert ref.greedy_token(torch.tensor(row), torch.tensor([False] * 4)) is None
    assert ref.greedy_token(torch.tensor([-INF, 2.0]), torch.tensor([True, False])) is None


def test_processed_keep_matches_the_definition_word_for_word():
    gen = torch.Generator().manual_seed(12)
    for trial in range(400):
        V = int(torch.randint(1, 12, (1,), generator=gen))
        # integer logits: many ties; a few -inf
        row = torch.randint(-3, 4, (V,), generator=gen).double() * 0.75
        row[torch.rand(V, generator=gen) < 0.15] = -INF
        allowed = (torch.rand(V, generator=gen) < 0.8).tolist() if trial % 2 else None
        t = [0.5, 1.0, 1.7][trial % 3]
        top_k = int(torch.randint(0, V + 2, (1,), generator=gen))
        top_p = [1.0, 0.3, 0.6, 0.9, 1e-9][trial % 5]
        min_p = [0.0, 0.2, 0.6][trial % 3 if trial % 7 else 0]
        expected = by_definition(row.tolist(), t, top_k, top_p, min_p, allowed)
        assert kept(row.tolist(), t, top_k, top_p, min_p, allowed) == expected, (row, t, top_k, top_p, min_p, allowed)


def test_accept_with_filters_by_hand():
    """Greedy takes the masked argmax; top_k=1 sampling is greedy on the processed row; a row the mask
    empties stops the walk with token 0 (checks off)."""
    from specdec.sampling import pack_bitmask
    V = 6
    logits = torch.zeros(1, 3, V)
    logits[0, 0] = torch.tensor([0.0, 5.0, 4.0, 1.0, 0.0, 0.0])  # masked: token 1 banned after the root
    logits[0, 1] = torch.tensor([0.0, 0.0, 0.0, 3.0, 2.0, 0.0])
    allowed = torch.ones(1, 3, V, dtype=torch.bool)
    allowed[0, 0, 1] = False
    bitmask = pack_bitmask(allowed)
    tokens, parents = torch.tensor([[0, 2, 3]]), torch.tensor([[-1, 0, 1]])
    res = specdec.accept(logits, tokens, parents, token_bitmask=bitmask, backend="torch")
    assert res.accepted_nodes.tolist() == [[0, 1, 2]] and res.next_tokens.tolist() == [0]
    sampled = specdec.accept(logits, tokens, parents, temperature=1.0, top_k=1, token_bitmask=bitmask,
                             seeds=torch.tensor([5]), backend="torch")
    assert sampled.accepted_nodes.tolist() == [[0, 1, 2]]
    allowed[0, 1] = False  # nothing allowed after node 1
    with specdec.value_checks(False):
        for t in (0.0, 1.0):
            res = specdec.accept(logits, tokens, parents, temperature=t, token_bitmask=pack_bitmask(allowed),
                                 seeds=torch.tensor([5]), backend="torch")
            assert res.accepted_nodes.tolist() == [[0, 1, -1]] and res.next_tokens.tolist() == [0]


def test_huge_finite_logits_keep_their_law():
    """The law depends on differences of logits only: rows near float64's max at t = 0.5 and 1e-5 (row / t
    overflowed to inf, and the softmax to NaN), kept sets included; below GREEDY_BELOW (t = 1e-30) accept is greedy,
    the first of the tied maxima."""
    row = torch.tensor([1e300, 1e300, 0.0, -1e300, 1.7e308, 1.7e308], dtype=torch.float64)
    for t in (0.5, 1e-5):
        assert ref.processed_probs(row, t).tolist() == [0.0] * 4 + [0.5] * 2
        assert ref.processed_probs(row[:4], t).tolist() == [0.5, 0.5, 0.0, 0.0]
        assert kept(row.tolist(), t, top_k=1) == kept(row.tolist(), t, top_p=0.3) == [4, 5]
    args = dict(tokens=torch.zeros(1, 1, dtype=torch.long), parents=torch.full((1, 1), -1), draft_logits=None,
                seeds=torch.tensor([3]), num_nodes=torch.tensor([1]), offset=0)
    assert int(ref.accept(row[:4].view(1, 1, 4), temperature=torch.tensor([1e-30]), **args)[2]) == 0
