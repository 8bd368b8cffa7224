"""The Triton kernels compiled for a real GPU (no interpreter), against the reference on the CPU.

Skipped without CUDA. bench/gpu.sh runs this file with TRITON_INTERPRET=0 on the GPU machine; the same
checks at interpreter-sized shapes run everywhere in the backend test files. Shapes here are engine-like:
long prefixes (split-KV), D up to 256, T up to 128, large vocabularies.
"""
import math
import os

import pytest
import torch

import specdec
from tests.helpers import TOL, random_cache, random_root_paths, random_trees, to_paged

DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,T,Hq,Hkv,D,max_len,paged", [
    (2, 16, 32, 8, 128, 4000, True),     # GQA 4, long prefix: split-KV
    (1, 64, 8, 1, 64, 9000, False),      # MQA, B=1
    (3, 128, 4, 4, 256, 700, True),      # T = 128 nodes, D = 256
    (4, 1, 16, 2, 128, 300, False),      # plain decode
])
def test_tree_attention(dtype, B, T, Hq, Hkv, D, max_len, paged):
    gen = torch.Generator().manual_seed(B * T + D)
    parents, num_nodes = random_trees(B, T, gen)
    info = specdec.build_tree(parents, num_nodes)
    cache_lens = torch.randint(0, max_len, (B,), generator=gen, dtype=torch.int32)
    cache_lens[0] = max_len - 1
    cap = -(-(max_len + T) // 64) * 64
    k, v = random_cache(B, cap, Hkv, D, dtype, gen), random_cache(B, cap, Hkv, D, dtype, gen)
    q = torch.randn(B, T, Hq, D, generator=gen).to(dtype)
    table = None
    if paged:
        k, table = to_paged(k, 64, torch.Generator().manual_seed(1))
        v, _ = to_paged(v, 64, torch.Generator().manual_seed(1))
    ref_out, ref_lse = specdec.tree_attention(q, k, v, cache_lens, info.mask, block_table=table, num_nodes=num_nodes,
                                              return_lse=True, backend="torch")
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    out, lse = specdec.tree_attention(dev(q), dev(k), dev(v), dev(cache_lens), dev(info.mask), block_table=dev(table),
                                      num_nodes=dev(num_nodes), return_lse=True, backend="triton")
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("num_splits", [None, 1], ids=["split-heuristic", "one-split"])
def test_mla_tree_attention_at_deepseek_v3_shape(kv_dtype, num_splits):
    """MLA's absorbed form at DeepSeek-V3's shape (Hq 128 on one latent head, Dqk 576, V the first 512 channels of
    the same rows, a view): the compiled MLA variant against the reference, paged, bf16 q, a bf16 or float8 latent
    cache; split-KV as the heuristic picks it and forced off."""
    from specdec.kernels import tree_attention as ta
    gen = torch.Generator().manual_seed(576)
    B, T, Hq, max_len = 2, 16, 128, 1000
    parents, num_nodes = random_trees(B, T, gen)
    info = specdec.build_tree(parents, num_nodes)
    cache_lens = torch.tensor([max_len - 1, 37], dtype=torch.int32)
    cap = -(-(max_len + T) // 64) * 64
    latent = random_cache(B, cap, 1, 576, torch.float32, gen)
    k_scale = 0.05 if kv_dtype != torch.bfloat16 else None
    latent = specdec.reference.quantize(latent, k_scale or 1.0, kv_dtype)
    latent, table = to_paged(latent, 64, gen)
    q = torch.randn(B, T, Hq, 576, generator=gen).to(torch.bfloat16)
    scale = 192 ** -0.5
    ref_out, ref_lse = specdec.tree_attention(q, latent, latent[..., :512], cache_lens, info.mask, block_table=table,
                                              num_nodes=num_nodes, scale=scale, k_scale=k_scale, return_lse=True,
                                              backend="torch")
    on = latent.to(DEVICE)  # (V: a view of the device copy's rows)
    args = (q.to(DEVICE), on, on[..., :512], cache_lens.to(DEVICE), info.mask.to(DEVICE), table.to(DEVICE),
            num_nodes.to(DEVICE), scale, k_scale or 1.0, k_scale or 1.0)
    out, lse = ta.tree_attention(*args, num_splits=num_splits)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_tree_attention_float8_window_at_131k(kv_dtype):
    """vLLM's fp8 cache under a 4K sliding window at position ~131K, with every block older than the window
    freed (-1) and only the window's blocks allocated: the kernel reads the window alone."""
    gen = torch.Generator().manual_seed(3)
    B, T, Hq, Hkv, D, page, window_left = 2, 16, 32, 8, 128, 16, 4095
    lens = torch.tensor([131_000, 5_000], dtype=torch.int32)
    parents, num_nodes = random_trees(B, T, gen)
    info = specdec.build_tree(parents, num_nodes)
    first = [(int(L) - window_left) // page for L in lens]
    last = [(int(L) + T - 1) // page for L in lens]
    num_blocks = sum(e - f + 1 for f, e in zip(first, last))
    table = torch.full((B, max(last) + 1), -1, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32).split([e - f + 1 for f, e in zip(first, last)])
    for b in range(B):
        table[b, first[b]:last[b] + 1] = ids[b]
    k = specdec.reference.quantize(torch.randn(num_blocks, page, Hkv, D, generator=gen), 0.02, kv_dtype)
    v = specdec.reference.quantize(torch.randn(num_blocks, page, Hkv, D, generator=gen), 0.05, kv_dtype)
    q = torch.randn(B, T, Hq, D, generator=gen).to(torch.bfloat16)
    kw = dict(block_table=table, num_nodes=num_nodes, k_scale=0.02, v_scale=0.05, window_left=window_left,
              return_lse=True)
    ref_out, ref_lse = specdec.tree_attention(q, k, v, lens, info.mask, backend="torch", **kw)
    dev = {name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    out, lse = specdec.tree_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), lens.to(DEVICE), info.mask.to(DEVICE),
                                      backend="triton", **dev)
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out.cpu().float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,V", [(8, 8, 128_256), (4, 16, 32_003)])
def test_accept_greedy(dtype, B, T, V):
    gen = torch.Generator().manual_seed(V)
    parents, num_nodes = random_trees(B, T, gen)
    logits = torch.randn(B, T, V, generator=gen).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    # make most draft tokens the target's argmax at their parent so paths get long
    best = logits.float().argmax(-1)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            if i % 3:
                tokens[b, i] = best[b, parents[b, i]]
    ref = specdec.accept(logits, tokens, parents, num_nodes=num_nodes, backend="torch")
    got = specdec.accept(logits.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE), num_nodes=num_nodes.to(DEVICE),
                         backend="triton")
    for a, b in zip(got, ref):
        assert torch.equal(a.cpu(), b)


def test_accept_sampling_is_lossless_on_gpu():
    """Star tree of given proposals, 20k requests with distinct seeds: the emitted first token's law is p."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(0)
    N, V, K = 20_000, 50, 4
    row = torch.randn(V, generator=gen) * 2
    row[7] = -math.inf
    logits = row.expand(N, K + 1, V).contiguous()
    draft = torch.randn(V, generator=gen)
    tokens = torch.multinomial(torch.softmax(draft, 0), N * (K + 1), replacement=True, generator=gen).view(N, K + 1)
    parents = torch.tensor([-1] + [0] * K).expand(N, K + 1)
    res = specdec.accept(logits.to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE), temperature=1.0,
                         seeds=torch.arange(N, device=DEVICE), backend="triton")
    node = res.accepted_nodes[:, 1].cpu()
    first = torch.where(node > 0, tokens.gather(1, node.clamp(min=0).long().unsqueeze(1)).squeeze(1), res.next_tokens.cpu())
    counts = torch.bincount(first, minlength=V).double()
    p = torch.softmax(row.double(), 0)
    assert counts[7] == 0
    keep = p > 0
    assert chisquare(counts[keep].numpy(), (p[keep] * N).numpy()).pvalue > 1e-4


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_accept_sampling_is_lossless_with_split_launches(draft_dtype):
    """A vocabulary of several chunks (split launches, the draw's chunk pick and scan): a one-child chain
    with draft logits, 20k requests; the first emitted token (the accepted child or the correction drawn
    from max(p - q, 0)) follows p, the mass spread over tokens in different chunks and the vocab tail."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(1)
    N, V = 20_000, 6_000
    special = torch.tensor([7, 2_100, 4_500, V - 1])
    p_row, q_row = torch.full((V,), -4.0), torch.full((V,), -4.0)
    p_row[special] = torch.tensor([3.0, 2.5, 2.8, 2.0])
    q_row[special] = torch.tensor([1.0, 3.0, 0.0, 2.5])
    q_row[100] = float("-inf")
    tokens = torch.zeros(N, 2, dtype=torch.int64)
    tokens[:, 1] = torch.multinomial(torch.softmax(q_row.to(draft_dtype).double(), 0), N, replacement=True,
                                     generator=gen)
    parents = torch.tensor([-1, 0]).expand(N, 2)
    res = specdec.accept(p_row.expand(N, 2, V).to(DEVICE), tokens.to(DEVICE), parents.to(DEVICE),
                         draft_logits=q_row.to(draft_dtype).expand(N, 2, V).to(DEVICE), temperature=1.0,
                         seeds=torch.arange(N, device=DEVICE) + 11, backend="triton")
    first = torch.where(res.num_accepted.cpu() > 0, tokens[:, 1], res.next_tokens.cpu())
    p = torch.softmax(p_row.double(), 0)
    cells = [torch.tensor([int(t)]) for t in special] + [torch.tensor([i for i in range(V) if i not in special])]
    observed = [float(torch.isin(first, c).sum()) for c in cells]
    expected = [float(p[c].sum()) * N for c in cells]
    assert chisquare(observed, expected).pvalue > 1e-4
    assert 0.05 < float(res.num_accepted.float().mean()) < 0.95  # both the test and the draw were exercised


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_append_and_rollback(dtype):
    gen = torch.Generator().manual_seed(5)
    layers, B, T, Hkv, D, cap = 4, 16, 32, 8, 128, 512
    parents, _ = random_trees(B, T, gen, ragged=False)
    k = torch.randn(layers, B, cap, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(layers, B, cap, Hkv, D, generator=gen).to(dtype)
    lens = torch.randint(0, cap - T, (B,), generator=gen, dtype=torch.int32)
    paths, num_accepted = random_root_paths(parents, gen)
    k_new = torch.randn(B, T, Hkv, D, generator=gen).to(dtype)
    v_new = torch.randn(B, T, Hkv, D, generator=gen).to(dtype)
    ref_k, ref_v, ref_lens = k.clone(), v.clone(), lens.clone()
    specdec.kv_append(ref_k[0], ref_v[0], k_new, v_new, ref_lens, backend="torch")
    specdec.kv_rollback(ref_k, ref_v, ref_lens, paths, num_accepted, backend="torch")
    gk, gv, glens = k.to(DEVICE), v.to(DEVICE), lens.to(DEVICE)
    specdec.kv_append(gk[0], gv[0], k_new.to(DEVICE), v_new.to(DEVICE), glens, backend="triton")
    specdec.kv_rollback(gk, gv, glens, paths.to(DEVICE), num_accepted.to(DEVICE), backend="triton")
    assert torch.equal(gk.cpu(), ref_k) and torch.equal(gv.cpu(), ref_v) and torch.equal(glens.cpu(), ref_lens)


def test_cuda_graph_capture_of_a_verification_step():
    """attention + accept + rollback captured once and replayed: no host sync inside the ops."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    with specdec.value_checks(False):
        gen = torch.Generator().manual_seed(2)
        B, T, Hq, Hkv, D, cap, V = 4, 8, 8, 2, 64, 1024, 1000
        parents, num_nodes = random_trees(B, T, gen, ragged=False)
        info = specdec.build_tree(parents.cuda(), num_nodes.cuda())
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, cap, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((B,), 500, dtype=torch.int32, device="cuda")
        logits = torch.randn(B, T, V, device="cuda")
        tokens = torch.randint(0, V, (B, T), device="cuda")
        seeds = torch.arange(B, device="cuda")

        def step():
            out = specdec.tree_attention(q, k, v, lens, info.mask, num_nodes=info.num_nodes)
            res = specdec.accept(logits, tokens, info.parents, temperature=1.0, seeds=seeds)
            specdec.kv_rollback(k, v, lens, res.accepted_nodes, res.num_accepted)
            return out, res

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up: compile kernels outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        lens.fill_(500)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, res = step()
        lens.fill_(500)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(lens.cpu(), torch.full((B,), 500, dtype=torch.int32) + res.num_accepted.cpu() + 1)


def test_loop_with_cuda_graphs_equals_eager_and_has_no_host_sync(monkeypatch):
    """SpeculativeDecoder(cuda_graphs=True) (the default on CUDA): the greedy output and acceptance of replayed
    steps equal the eager loop's and AR's, also in a later call on the graphs kept from the first; every step
    (eager warm-up, capture, replay) runs with torch.cuda.set_sync_debug_mode("error") and the value checks off: no
    host sync inside a step."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specdec.loop.decoding import SpeculativeDecoder, _StepGraphs, generate_ar
    from specdec.loop.drafters import DraftModelDrafter
    from specdec.loop.models.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    target = Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                               intermediate_size=256)).cuda().eval()
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7], [3, 9, 1, 2, 9, 1, 2, 9, 1]]
    run = _StepGraphs.run

    def no_sync(self, key, step):
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(self, key, step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    with specdec.value_checks(False):
        eager = SpeculativeDecoder(target, DraftModelDrafter(target, "tree:2,2,1"), cuda_graphs=False).generate(prompts, 32)
        other = [[5, 4, 3], [8, 1, 8, 1, 8], [2]]
        eager_other = SpeculativeDecoder(target, DraftModelDrafter(target, "tree:2,2,1"), cuda_graphs=False).generate(
            other, 32)
        monkeypatch.setattr(_StepGraphs, "run", no_sync)
        decoder = SpeculativeDecoder(target, DraftModelDrafter(target, "tree:2,2,1"))
        graphed = decoder.generate(prompts, 32)
        again = decoder.generate(other, 32)  # (replays the first call's graphs, on its buffers)
        sampled = dict(temperature=0.8, seed=[1, 2, 3])
        eager_sampled = SpeculativeDecoder(target, DraftModelDrafter(target, "chain:3"), cuda_graphs=False).generate(
            prompts, 32, **sampled)
        graphed_sampled = SpeculativeDecoder(target, DraftModelDrafter(target, "chain:3")).generate(prompts, 32, **sampled)
    assert graphed.tokens == eager.tokens == generate_ar(target, prompts, 32).tokens
    assert graphed.summary["acceptance_by_depth"] == eager.summary["acceptance_by_depth"]
    assert graphed_sampled.tokens == eager_sampled.tokens
    assert again.tokens == eager_other.tokens == generate_ar(target, other, 32).tokens
    assert again.summary["acceptance_by_depth"] == eager_other.summary["acceptance_by_depth"]


def test_adaptive_loop_with_cuda_graphs_equals_ar_and_times_the_target_as_graph_replays():
    """adaptive=True with CUDA graphs (the default on CUDA): the policy's target costs are graph replays (each token
    count captured after an eager warm-up: adaptive.measure_target_costs), each depth it chooses (0 included) is a
    graph key of its own, and the greedy output equals AR's, in a first call and in a later one on its graphs."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specdec.loop import adaptive
    from specdec.loop.decoding import CudaStepGraph, SpeculativeDecoder, generate_ar
    from specdec.loop.drafters import DraftModelDrafter
    from specdec.loop.models.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    target = Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                               intermediate_size=256)).cuda().eval()
    draft = Llama(LlamaConfig(vocab_size=512, dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                              intermediate_size=128)).cuda().eval()  # (unrelated: rejections, plain steps, probes)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7], [3, 9, 1, 2, 9, 1, 2, 9, 1]]
    with specdec.value_checks(False):
        for drafter_model in (target, draft):  # (the target itself: every draft accepted, the deepest depth)
            decoder = SpeculativeDecoder(target, DraftModelDrafter(drafter_model, "chain:4"), adaptive=True)
            for call in range(2):
                out = decoder.generate(prompts, 40)
                assert out.tokens == generate_ar(target, prompts, 40).tokens, (drafter_model is target, call)
            assert sum(out.summary["depth_chosen"]) == out.summary["steps"]
    replayed = [costs for key, costs in adaptive._TARGET_COSTS.items() if key[-1] is CudaStepGraph]
    assert replayed and all(0 < c < 1 for costs in replayed for c in costs)


def test_cuda_graph_accept_draws_fresh_numbers_from_a_device_offset():
    """accept captured with `offset` a device tensor: updating it in place between replays gives what eager
    calls with those offsets give (an int offset would be frozen into the graph)."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    with specdec.value_checks(False):
        gen = torch.Generator().manual_seed(3)
        B, T, V = 16, 6, 5000
        parents, num_nodes = random_trees(B, T, gen, ragged=False)
        parents = parents.cuda()
        logits = torch.randn(B, T, V, device="cuda")
        draft = logits + 0.5 * torch.randn_like(logits)
        tokens = torch.randint(0, V, (B, T), device="cuda")
        seeds = torch.arange(B, device="cuda") + 17
        offsets = torch.zeros(B, dtype=torch.int64, device="cuda")

        def call(offset):
            return specdec.accept(logits, tokens, parents, draft_logits=draft, temperature=1.0, seeds=seeds,
                                  offset=offset)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call(offsets)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = call(offsets)
        seen = []
        for step in range(3):
            offsets.copy_(torch.arange(B, device="cuda") * 1000 + step)
            graph.replay()
            eager = call(offsets.clone())
            assert all(torch.equal(x, y) for x, y in zip(res, eager)), f"step {step}"
            seen.append(res.next_tokens.clone())
        assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


def test_cuda_graph_capture_with_value_checks_on_and_a_cold_rollback_table():
    """Capturing works with the value checks left on (skipped while capturing), and a rollback whose entry
    table is first built inside the capture replays correctly (the captured copy's host table stays alive)."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    gen = torch.Generator().manual_seed(6)
    layers, B, T, Hkv, D, cap = 3, 8, 16, 4, 64, 256
    parents, _ = random_trees(B, T, gen, ragged=False)
    paths, num_accepted = random_root_paths(parents, gen)
    lens0 = torch.randint(0, cap - T, (B,), generator=gen, dtype=torch.int32)
    ks = [torch.randn(B, cap, Hkv, D, generator=gen) for _ in range(layers)]
    vs = [torch.randn(B, cap, Hkv, D, generator=gen) for _ in range(layers)]
    ref_k, ref_v, ref_lens = [k.clone() for k in ks], [v.clone() for v in vs], lens0.clone()
    specdec.kv_rollback(ref_k, ref_v, ref_lens, paths, num_accepted, backend="torch")
    gk, gv = [k.cuda() for k in ks], [v.cuda() for v in vs]
    glens, gpaths, gnum = lens0.cuda(), paths.cuda(), num_accepted.cuda()
    # compile the kernel on other caches of the same shapes: the table of gk/gv stays cold until the capture
    warm_k, warm_v = [k.clone() for k in gk], [v.clone() for v in gv]
    specdec.kv_rollback(warm_k, warm_v, glens.clone(), gpaths, gnum)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        specdec.kv_rollback(gk, gv, glens, gpaths, gnum)
    del warm_k, warm_v
    torch.cuda.empty_cache()
    for _ in range(2):  # the caches and lengths restored before each replay
        for dst, src in zip(gk + gv, ks + vs):
            dst.copy_(src)
        glens.copy_(lens0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(glens.cpu(), ref_lens)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(gk + gv, ref_k + ref_v))


# ----------------------------------------------------------------------------------------------
# caches past 2**31 elements (int64 offsets everywhere) and a 128K-token prefix; each checked on the
# request / rows it touches at the far end, against the reference on CPU copies of just those rows
# ----------------------------------------------------------------------------------------------
def _big_randn(shape, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(shape, dtype=dtype, device=DEVICE, generator=gen)


@pytest.mark.parametrize("B,L", [(1, 131_072), (36, 60_000)], ids=["prefix-128K", "cache-past-2^31-elements"])
def test_tree_attention_long_prefix_and_huge_cache(B, L):
    """The last request of a contiguous bf16 cache (36 x 60016 x 8 x 128 elements > 2**31), and one 128K
    prefix: the Triton result equals the reference computed on that request's own rows."""
    T, Hq, Hkv, D = 16, 32, 8, 128
    gen = torch.Generator().manual_seed(B)
    parents, num_nodes = random_trees(1, T, gen, ragged=False)
    info = specdec.build_tree(parents, num_nodes)
    k, v = _big_randn((B, L + T, Hkv, D), torch.bfloat16, 1), _big_randn((B, L + T, Hkv, D), torch.bfloat16, 2)
    q = _big_randn((B, T, Hq, D), torch.bfloat16, 3)
    lens = torch.full((B,), L, dtype=torch.int32, device=DEVICE)
    mask, nn = info.mask.expand(B, -1, -1).to(DEVICE), num_nodes.expand(B).to(DEVICE)
    out, lse = specdec.tree_attention(q, k, v, lens, mask, num_nodes=nn, return_lse=True, backend="triton")
    last = B - 1
    ref_out, ref_lse = specdec.tree_attention(q[last:].cpu(), k[last:].cpu(), v[last:].cpu(), lens[last:].cpu(),
                                              info.mask, num_nodes=num_nodes, return_lse=True, backend="torch")
    atol, rtol = TOL[torch.bfloat16]
    torch.testing.assert_close(out[last:].cpu().float(), ref_out.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse[last:].cpu(), ref_lse, atol=1e-3, rtol=1e-4)


def test_kv_append_and_rollback_past_2_31_elements():
    """A stacked bf16 cache of 32 layers x 64 requests x 1088 rows x 8 x 128 (2.3e9 elements per K or V):
    append into the last layer and roll every layer back; the last requests' tree rows of the first and
    last layers equal the reference on CPU copies of those rows."""
    layers, B, T, Hkv, D, L = 32, 64, 64, 8, 128, 1024
    gen = torch.Generator().manual_seed(9)
    k = _big_randn((layers, B, L + T, Hkv, D), torch.bfloat16, 4)
    v = _big_randn((layers, B, L + T, Hkv, D), torch.bfloat16, 5)
    lens0 = torch.full((B,), L, dtype=torch.int32)
    parents, _ = random_trees(B, T, gen, ragged=False)
    paths, num_accepted = random_root_paths(parents, gen)
    k_new, v_new = _big_randn((B, T, Hkv, D), torch.bfloat16, 6), _big_randn((B, T, Hkv, D), torch.bfloat16, 7)
    watched = [(layer, b) for layer in (0, layers - 1) for b in (B - 2, B - 1)]
    rows = {key: (k[key][L:].cpu(), v[key][L:].cpu()) for key in watched}  # the tree rows, before
    lens = lens0.clone().to(DEVICE)
    specdec.kv_append(k[layers - 1], v[layers - 1], k_new, v_new, lens, backend="triton")
    specdec.kv_rollback(k, v, lens, paths.to(DEVICE), num_accepted.to(DEVICE), backend="triton")
    assert torch.equal(lens.cpu(), lens0 + num_accepted + 1)
    for (layer, b), (k_rows, v_rows) in rows.items():
        if layer == layers - 1:  # appended first
            k_rows, v_rows = k_new[b].cpu(), v_new[b].cpu()
        n = int(num_accepted[b]) + 1
        idx = paths[b, :n].long()
        for cache, before in ((k, k_rows), (v, v_rows)):
            after = cache[layer, b, L:L + T].cpu()
            assert torch.equal(after[:n], before[idx]), (layer, b)
            assert torch.equal(after[n:], before[n:]), (layer, b)  # rows past the path: untouched
