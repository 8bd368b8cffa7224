"""Property-based fuzzing of the peers' entry points (specdec/integrations): valid input gets what calling
specdec.accept directly on the same backend gives (the entry point's documented mapping of its layout and its
randomness), bad input a ValueError / TypeError naming an argument with every input and in-place output untouched."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from specdec.integrations import flashinfer, sglang, vllm
from tests.fuzz.strategies import (BACKENDS, assert_untouched, assert_well_formed_error, first_word, fuzz, run_on,
                                   some_layout, trees)
from tests.fuzz.test_fuzz_ops import describe


def names_of(fn) -> tuple:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def accept_direct(backend, **args):
    result, error, _ = run_on("accept", args, backend)
    assert error is None, f"accept refused the entry point's mapping: {error}"
    return result


def emitted(result, tokens):
    """vLLM's / FlashInfer's layout: the accepted draft tokens, the next token, -1 after (an independent oracle)."""
    accepted, num, nxt = result
    B, T = accepted.shape
    out = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        n = int(num[b])
        out[b, :n] = tokens[b, accepted[b, 1:n + 1].long()]
        out[b, n] = nxt[b]
    return out


# ----------------------------------------------------------------------------------------------
# valid input: the entry point is accept
# ----------------------------------------------------------------------------------------------
@st.composite
def flashinfer_cases(draw):
    B, S, V = draw(st.integers(1, 3)), draw(st.integers(0, 3)), draw(st.integers(1, 16))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    draft = torch.rand(B, S, V, generator=gen) ** 2
    target = torch.rand(B, S + 1, V, generator=gen) ** 2
    target[..., 0] += 1e-3  # a positive entry in every row
    draft[..., draw(st.integers(0, V - 1))] += 1e-3
    ids = torch.randint(0, V, (B, S), generator=gen).to(draw(st.sampled_from([torch.int32, torch.int64])))
    return dict(draft_probs=some_layout(draw, draft), draft_token_ids=some_layout(draw, ids),
                target_probs=some_layout(draw, target), seed=draw(st.integers(0, 2**40)),
                offset=draw(st.integers(0, 2**20)))


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_flashinfer_chain_sampling_is_accept(backend, data):
    args = data.draw(flashinfer_cases())
    note(describe(args))
    got, error, _ = run_on("flashinfer.chain_speculative_sampling", args, backend)
    assert error is None, error
    B, S = args["draft_token_ids"].shape
    tokens = torch.cat((torch.zeros(B, 1, dtype=torch.int64), args["draft_token_ids"].long()), 1)
    seeds = (torch.arange(B, dtype=torch.int64) * flashinfer._GOLDEN + args["seed"]) & (2**63 - 1)
    result = accept_direct(backend, tokens=tokens, parents=torch.arange(-1, S).expand(B, S + 1),
                           target_probs=args["target_probs"],
                           draft_probs=torch.cat((args["draft_probs"], args["target_probs"][:, S:]), 1),
                           temperature=1.0, seeds=seeds, offset=args["offset"])
    assert got[0].tolist() == emitted(result, tokens).tolist()
    assert got[2].tolist() == result[1].tolist()


def sglang_links(parents, num_nodes, N):
    """SGLang's links of a batch of trees (children listed in node order): retrive_next_token, retrive_next_sibling."""
    bs = parents.shape[0]
    first = torch.full((bs, N), -1, dtype=torch.int64)
    sibling = torch.full((bs, N), -1, dtype=torch.int64)
    for b in range(bs):
        last_child = {}
        for i in range(1, int(num_nodes[b])):
            p = int(parents[b, i])
            if p in last_child:
                sibling[b, last_child[p]] = i
            else:
                first[b, p] = i
            last_child[p] = i
    return first, sibling


@st.composite
def sglang_cases(draw):
    parents, num_nodes = draw(trees(max_T=6, ragged=False))  # (SGLang's N nodes are all the tree's)
    bs, N = parents.shape
    V = draw(st.integers(1, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    candidates = torch.randint(0, V, (bs, N), generator=gen)
    predict = torch.randint(0, V, (bs, N), generator=gen)
    for b in range(bs):  # children often match, so that paths get long
        for i in range(1, int(num_nodes[b])):
            if draw(st.booleans()):
                candidates[b, i] = predict[b, int(parents[b, i])]
    first, sibling = sglang_links(parents, num_nodes, N)
    K = N + draw(st.integers(0, 1))
    return dict(predicts=torch.full((bs * N,), -1, dtype=torch.int32), accept_index=torch.full((bs, K), -1, dtype=torch.int32),
                accept_token_num=torch.full((bs,), -7, dtype=torch.int32), candidates=candidates,
                retrive_index=torch.arange(bs * N).view(bs, N), retrive_next_token=first, retrive_next_sibling=sibling,
                target_predict=predict), parents, num_nodes, V


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_sglang_greedy_is_accept(backend, data):
    args, parents, num_nodes, V = data.draw(sglang_cases())
    note(describe(args))
    _, error, after = run_on("sglang.verify_tree_greedy", args, backend)
    assert error is None, error
    bs, N = parents.shape
    onehot = torch.nn.functional.one_hot(args["target_predict"], V).float()
    accepted, num, nxt = accept_direct(backend, target_logits=onehot, tokens=args["candidates"], parents=parents,
                                       num_nodes=num_nodes)
    predicts = args["predicts"].clone()
    accept_index = args["accept_index"].clone()
    for b in range(bs):
        path = accepted[b, :int(num[b]) + 1].tolist()
        accept_index[b, :len(path)] = torch.tensor([int(args["retrive_index"][b, i]) for i in path], dtype=torch.int32)
        following = [int(args["candidates"][b, c]) for c in path[1:]] + [int(nxt[b])]
        for node, token in zip(path, following):
            predicts[int(args["retrive_index"][b, node])] = token
    assert after["accept_token_num"].tolist() == num.tolist()
    assert after["accept_index"].tolist() == accept_index.tolist()
    assert after["predicts"].tolist() == predicts.tolist()


@st.composite
def vllm_cases(draw):
    B, V = draw(st.integers(1, 3)), draw(st.integers(1, 12))
    num = [draw(st.integers(0, 3)) for _ in range(B)]
    max_spec_len = max(num) if any(num) else draw(st.integers(0, 1))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    n = sum(num)
    target = torch.randn(n, V, generator=gen)
    draft_ids = torch.randint(0, V, (n,), generator=gen)
    for j in range(n):
        if draw(st.booleans()):
            draft_ids[j] = int(torch.argmax(target[j]))
    return dict(draft_token_ids=draft_ids.to(draw(st.sampled_from([torch.int32, torch.int64]))), num_draft_tokens=num,
                max_spec_len=max_spec_len, cu_num_draft_tokens=torch.tensor(num, dtype=torch.int64).cumsum(0).int(),
                draft_probs=None, target_logits=target,
                bonus_token_ids=torch.randint(0, V, (B, 1), generator=gen),
                sampling_metadata=SimpleNamespace(temperature=None, all_greedy=True, all_random=False, top_k=None,
                                                  top_p=None, generators={}))


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_vllm_greedy_rejection_sample_is_accept(backend, data):
    args = data.draw(vllm_cases())
    note(describe(args))
    got, error, _ = run_on("vllm.rejection_sample", args, backend)
    assert error is None, error
    num, T = args["num_draft_tokens"], args["max_spec_len"] + 1
    B = len(num)
    starts = [sum(num[:b]) for b in range(B)]
    V = args["target_logits"].shape[1]
    expected = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        n = num[b]
        if n == 0:
            expected[b, 0] = args["bonus_token_ids"][b, 0]
            continue
        rows = torch.softmax(args["target_logits"][starts[b]:starts[b] + n], -1)
        tokens = torch.cat((torch.zeros(1, dtype=torch.int64), args["draft_token_ids"][starts[b]:starts[b] + n].long()))
        res = accept_direct(backend, target_probs=torch.cat((rows, torch.full((1, V), 1.0 / V))).unsqueeze(0),
                            tokens=tokens.unsqueeze(0), parents=torch.arange(-1, n).unsqueeze(0))
        row = emitted(res, tokens.unsqueeze(0))[0]
        if int(res[1][0]) == n:
            row[n] = args["bonus_token_ids"][b, 0]
        expected[b, :n + 1] = row[:n + 1]
    assert got.tolist() == expected.tolist()


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
def mutate_tensor(draw, args, names):
    """(args with tensor argument `name` broken, name, whether it must be refused)."""
    name = draw(st.sampled_from([n for n in names if isinstance(args.get(n), torch.Tensor)]))
    x = args[name]
    kind = draw(st.sampled_from(["list", "0-dim", "extra dim", "dtype", "out of range"]))
    if kind == "list":
        return dict(args, **{name: x.tolist()}), name, True
    if kind == "0-dim":
        return dict(args, **{name: x.reshape(-1)[:1].reshape(()).clone() if x.numel() else x.new_zeros(())}), name, True
    if kind == "extra dim":
        return dict(args, **{name: x.unsqueeze(0)}), name, True
    if kind == "dtype":
        return dict(args, **{name: x.to(torch.float32 if not x.is_floating_point() else torch.int32)}), name, True
    y = x.clone(memory_format=torch.contiguous_format)  # (y.view(-1) below)
    if y.numel() == 0:
        return dict(args, **{name: y.unsqueeze(0)}), name, True
    value = draw(st.sampled_from([-5, 2**31, 2**32 + 1, 10**6] if not y.is_floating_point()
                                 else [float("nan"), float("inf")] + ([-1.0] if "probs" in name else [])))
    if not y.is_floating_point() and not -(2**31) <= value < 2**31:
        y = y.long()  # (an int64 index tensor: what an int32 one cannot hold)
    y.view(-1)[draw(st.integers(0, y.numel() - 1))] = value
    # (SGLang's tokens and argmaxes have no vocabulary to be out of: any id >= 0 is one)
    return dict(args, **{name: y}), name, not (name in ("candidates", "target_predict") and value >= 0)


SGLANG_INPUTS = ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling", "target_predict")


@st.composite
def bad_entry_point_calls(draw):
    """(entry point, arguments with one broken, the broken argument's name, whether it must be refused)."""
    which = draw(st.sampled_from(["flashinfer", "sglang", "vllm"]))
    if which == "flashinfer":
        args = draw(flashinfer_cases())
        args, name, must = mutate_tensor(draw, args, ("draft_probs", "draft_token_ids", "target_probs"))
        return "flashinfer.chain_speculative_sampling", args, name, must
    if which == "sglang":
        args = draw(sglang_cases())[0]
        args, name, must = mutate_tensor(draw, args, SGLANG_INPUTS)
        return "sglang.verify_tree_greedy", args, name, must
    args = draw(vllm_cases())
    args, name, must = mutate_tensor(draw, args, ("draft_token_ids", "target_logits", "bonus_token_ids",
                                                  "cu_num_draft_tokens"))
    return "vllm.rejection_sample", args, name, must


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz
@given(data=st.data())
def test_entry_points_refuse_bad_input_naming_it(backend, data):
    entry, args, name, must_refuse = data.draw(bad_entry_point_calls())
    note(describe(args))
    module, function = entry.split(".")
    names = names_of(getattr({"flashinfer": flashinfer, "sglang": sglang, "vllm": vllm}[module], function))
    result, error, after = run_on(entry, args, backend)
    if error is None:
        assert not must_refuse, f"{entry} on {backend}: served with {name} broken"
        return
    assert_well_formed_error(error, names, f"{entry} on {backend}")
    assert first_word(error).split(",")[0] == name, f"{entry} on {backend}: {name} was broken: {error}"
    assert_untouched(args, after, f"{entry} on {backend}")
