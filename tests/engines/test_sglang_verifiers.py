"""venv: sglang-0.5.23 (.venv-engines/sglang-0.5.23). specdec.integrations.sglang against SGLang 0.5.23's own code.

Signatures equal SGLang's; the chain verifier is compared with SGLang's Triton chain kernel
(sglang.kernels.ops.speculative.reject_sampling) run under TRITON_INTERPRET=1 (tests/conftest.py sets it before
anything imports triton): equal outputs where the target rows are one-hot (the kernel has no greedy path; one-hot
rows decide every test whatever the coins), both sampled laws equal the exact law (chi-square), and our mean
accepted length is at least SGLang's, token-wise against token-wise and block against block. verify_tree_greedy_cpu
is compared with SGLang's Triton greedy tree verifier (spec_tree.verify_tree_greedy_triton, the same walk as its CUDA
and CPU ops; sgl_kernel's CPU op too where this sgl_kernel build has it: the CUDA wheel does not) on random links and
on trees SGLang's own EAGLE code builds.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import typing

import pytest
import torch

reject_sampling = pytest.importorskip("sglang.kernels.ops.speculative.reject_sampling")

from specdec.integrations import sglang  # noqa: E402
from tests.stats import assert_law  # noqa: E402
from tests.integrations.test_integrations import (sglang_chain_case, sglang_chain_expected_accepted,  # noqa: E402
                                     sglang_chain_two_tokens)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")


def _signature(f):
    """inspect.signature with string annotations evaluated (SGLang's modules import torch only for type checking)."""
    names = {"torch": torch, **{n: getattr(typing, n) for n in ("Optional", "Union", "Tuple", "List")}}
    return inspect.signature(f, eval_str=True, globals={**getattr(f, "__globals__", {}), **names})


def _sgl_kernel_speculative():
    """sgl_kernel/speculative.py, loaded on its own: the package's __init__ loads CUDA libraries."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None:
        pytest.skip("sgl_kernel is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "speculative.py")
    module_spec = importlib.util.spec_from_file_location("_sgl_kernel_speculative", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_signatures_equal_sglangs():
    from sglang.kernels.ops.speculative import sampling, tree
    kernel = _sgl_kernel_speculative()
    pairs = [(sglang.chain_speculative_sampling_triton, reject_sampling.chain_speculative_sampling_triton),
             (sglang.verify_tree_greedy, tree.verify_tree_greedy),
             (sglang.verify_tree_greedy, kernel.verify_tree_greedy),
             (sglang.verify_tree_greedy_cpu, kernel.verify_tree_greedy_cpu),
             (sglang.tree_speculative_sampling_target_only, sampling.tree_speculative_sampling_target_only),
             (sglang.tree_speculative_sampling_target_only, kernel.tree_speculative_sampling_target_only)]
    for ours, theirs in pairs:
        assert _signature(ours) == _signature(theirs), theirs.__module__ + "." + theirs.__name__


def _run(verify, args, outputs, block):
    predicts, accept_index, accept_num = outputs()
    verify(predicts, accept_index, accept_num, args["candidates"], args["retrive_index"], args["retrive_next_token"],
           args["retrive_next_sibling"], args["uniform_samples"], args["uniform_samples_for_final_sampling"],
           args["target_probs"], args["draft_probs"], 1.0, 1.0, True, block_verification=block)
    return predicts, accept_index, accept_num


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_chain_equals_sglangs_kernel_on_one_hot_targets(block):
    """Random one-hot target rows, drafts that match the target's token 60% of the time, real (softmax) draft
    laws: every output equal to SGLang's kernel's, in place, untouched entries included."""
    gen = torch.Generator().manual_seed(5)
    bs, N, V = 24, 4, 6
    best = torch.randint(0, V, (bs, N), generator=gen)
    drafts = torch.where(torch.rand(bs, N, generator=gen) < 0.6, best.roll(1, 1),
                         torch.randint(0, V, (bs, N), generator=gen))
    drafts[:, 0] = 0
    args = dict(candidates=drafts, retrive_index=torch.randperm(bs * N, generator=gen).view(bs, N),
                retrive_next_token=torch.tensor([1, 2, 3, -1]).expand(bs, N).contiguous(),
                retrive_next_sibling=torch.full((bs, N), -1), uniform_samples=torch.rand(bs, N, generator=gen),
                uniform_samples_for_final_sampling=torch.rand(bs, generator=gen),
                target_probs=torch.nn.functional.one_hot(best, V).float(),
                draft_probs=torch.softmax(torch.randn(bs, N - 1, V, generator=gen), -1))

    def outputs():
        return (torch.full((bs * N,), -3, dtype=torch.int32), torch.full((bs, N), -3, dtype=torch.int32),
                torch.full((bs,), -3, dtype=torch.int32))
    ours = _run(sglang.chain_speculative_sampling_triton, args, outputs, block)
    theirs = _run(reject_sampling.chain_speculative_sampling_triton, args, outputs, block)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert len(set(ours[2].tolist())) >= 3  # (the case exercises several accepted lengths)


@pytest.mark.parametrize("block", [False, True], ids=["token", "block"])
def test_chain_laws_and_accepted_length_against_sglangs_kernel(block):
    """The same requests through both: the first two emitted tokens follow p0(y1) P1[y1](y2) (chi-square) for
    both; our mean accepted length is at least SGLang's (up to 4 standard errors of the difference), and
    token-wise both match the exact expectation."""
    gen = torch.Generator().manual_seed(13)
    n = 1200  # SGLang's kernel takes about 30 ms a request in the interpreter
    laws, args, outputs = sglang_chain_case(gen, n)
    exact = (laws.p0[:, None] * laws.P1).flatten()
    means = {}
    for name, verify in (("specdec", sglang.chain_speculative_sampling_triton),
                         ("sglang", reject_sampling.chain_speculative_sampling_triton)):
        predicts, _, accept_num = _run(verify, args, outputs, block)
        assert_law(sglang_chain_two_tokens(gen, laws, predicts, accept_num), exact, f"{name}, block={block}")
        num = accept_num.double()
        means[name] = (float(num.mean()), float(num.var()) / n)
    (ours, var_ours), (theirs, var_theirs) = means["specdec"], means["sglang"]
    assert ours >= theirs - 4 * (var_ours + var_theirs) ** 0.5, means
    if not block:
        expected = sglang_chain_expected_accepted(laws)
        assert all(abs(m - expected) < 4 * v ** 0.5 for m, v in means.values()), (means, expected)


def _random_links(gen, bs, N, K):
    """SGLang-linked trees of N nodes and depth <= K - 1 (node i's parent among the earlier nodes, sibling lists in
    a random order), flat indices b * N + i."""
    next_token = torch.full((bs, N), -1)
    next_sibling = torch.full((bs, N), -1)
    for b in range(bs):
        depth, kids = [0], [[] for _ in range(N)]
        for i in range(1, N):
            shallow = [v for v in range(i) if depth[v] < K - 1]
            parent = shallow[int(torch.randint(len(shallow), (1,), generator=gen))]
            depth.append(depth[parent] + 1)
            kids[parent].append(i)
        for v, children in enumerate(kids):
            order = [children[j] for j in torch.randperm(len(children), generator=gen).tolist()]
            if order:
                next_token[b, v] = order[0]
            for a, c in zip(order, order[1:]):
                next_sibling[b, a] = c
    return torch.randint(0, 8, (bs, N), generator=gen), torch.arange(bs * N).view(bs, N), next_token, next_sibling


def _eagle_links(gen, bs, N, K, monkeypatch):
    """Trees as SGLang's EAGLE worker builds them: select_top_k_tokens over K - 1 draft steps of top-3 proposals
    from random draft laws, organize_draft_results, then build_tree_kernel_efficient (routed to SGLang's Triton
    tree builder, its XPU path: the CUDA and CPU builders cannot run here)."""
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative import eagle_utils
    from sglang.srt.speculative.spec_utils import select_top_k_tokens
    monkeypatch.setattr(spec_tree, "_is_xpu", True)
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # (its top-k selection is torch.compile'd)
    V, topk, steps = 8, 3, K - 1
    lists = ([], [], [])  # scores, tokens, parents per step
    topk_p, topk_index = torch.softmax(torch.randn(bs, V, generator=gen) * 2, -1).topk(topk, -1)
    hidden, scores = None, None
    for i in range(steps):
        _, hidden, scores, tree_info = select_top_k_tokens(i, topk_p, topk_index, hidden, scores, topk)
        for collected, x in zip(lists, tree_info):
            collected.append(x)
        topk_p, topk_index = torch.softmax(torch.randn(bs * topk, V, generator=gen) * 2, -1).topk(topk, -1)
    parent_list, top_scores_index, draft_tokens = eagle_utils.organize_draft_results(*lists, N)
    seq_lens = torch.full((bs,), 5)
    _, _, retrive_index, next_token, next_sibling, candidates = eagle_utils.build_tree_kernel_efficient(
        torch.randint(0, V, (bs,), generator=gen), parent_list, top_scores_index, draft_tokens, seq_lens,
        int(seq_lens.sum()), topk, steps, N)
    return candidates.view(bs, N), retrive_index, next_token, next_sibling


def _target_predict(gen, candidates, next_token, next_sibling):
    """The target's argmax after each node: often the token of its first or second child (long accepted paths),
    else a random token."""
    bs, N = candidates.shape
    target = torch.randint(0, 8, (bs, N), generator=gen)
    for b in range(bs):
        for i in range(N):
            child, coin = int(next_token[b, i]), float(torch.rand(1, generator=gen))
            if child >= 0 and coin < 0.7:
                second = int(next_sibling[b, child])
                target[b, i] = candidates[b, second if second >= 0 and coin > 0.45 else child]
    return target


@pytest.mark.parametrize("trees", ["random links", "EAGLE-built"])
def test_verify_tree_greedy_cpu_equals_sglangs(trees, monkeypatch):
    """Our verify_tree_greedy_cpu against SGLang's Triton greedy tree verifier (spec_tree.verify_tree_greedy_triton,
    the walk of its CUDA and CPU ops) and sgl_kernel's CPU op where this build has it: every output equal."""
    from sglang.kernels.ops.speculative import spec_tree
    gen = torch.Generator().manual_seed(17)
    bs, N, K = 40, 8, 5
    make = _random_links if trees == "random links" else lambda *a: _eagle_links(*a, monkeypatch)
    candidates, retrive_index, next_token, next_sibling = make(gen, bs, N, K)
    target_predict = _target_predict(gen, candidates, next_token, next_sibling)
    theirs = [("spec_tree.verify_tree_greedy_triton", spec_tree.verify_tree_greedy_triton)]
    if hasattr(torch.ops.sgl_kernel, "verify_tree_greedy_cpu"):
        theirs.append(("sgl_kernel.verify_tree_greedy_cpu", _sgl_kernel_speculative().verify_tree_greedy_cpu))

    def run(verify):
        outputs = (torch.full((bs * N,), -2, dtype=torch.int32), torch.full((bs, K), -2, dtype=torch.int32),
                   torch.full((bs,), -2, dtype=torch.int32))
        verify(*outputs, candidates, retrive_index, next_token, next_sibling, target_predict)
        return outputs

    ours = run(sglang.verify_tree_greedy_cpu)
    assert int(ours[2].max()) >= 2  # (paths of several levels)
    for name, verify in theirs:
        assert all(torch.equal(a, b) for a, b in zip(ours, run(verify))), name
