"""specdec.ops.LayerCalls, the model runner's per-forward plan of kv_append + tree_attention: the same results
as the public ops at every layer, checks run once per argument signature, and bad input still fails."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import specdec
from specdec.ops import OPS, LayerCalls


def _inputs(B=2, T=3, H=2, D=8, L=12, gen=None, dtype=torch.float32):
    gen = gen or torch.Generator().manual_seed(0)
    lens = torch.tensor([2, 5], dtype=torch.int32)[:B]
    tree = specdec.build_tree(torch.tensor([[-1, 0, 0]] * B, dtype=torch.int32))
    layers = [(torch.randn(B, L, H, D, generator=gen).to(dtype), torch.randn(B, L, H, D, generator=gen).to(dtype))
              for _ in range(3)]
    new = [tuple(torch.randn(B, T, H, D, generator=gen).to(dtype) for _ in range(3)) for _ in layers]
    return lens, tree, layers, new


def test_layer_calls_equal_the_public_ops_at_every_layer():
    """(Paged caches and float8 scales go through the runner's tests: its cached forward against the causal.)"""
    lens, tree, layers, new = _inputs()
    ours = [(k.clone(), v.clone()) for k, v in layers]
    calls = LayerCalls(lens, tree.mask)
    for (k_cache, v_cache), (kc, vc), (q, k, v) in zip(layers, ours, new):
        specdec.kv_append(k_cache, v_cache, k, v, lens)
        expected = specdec.tree_attention(q, k_cache, v_cache, lens, tree.mask)
        calls.kv_append(kc, vc, k, v)
        torch.testing.assert_close(calls.tree_attention(q, kc, vc), expected, atol=0, rtol=0)
        assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


def test_layer_calls_check_once_per_signature(monkeypatch):
    lens, tree, layers, new = _inputs()
    counts = {"kv_append": 0, "tree_attention": 0}
    for name in counts:
        check = OPS[name].check

        def counted(*args, _name=name, _check=check):
            counts[_name] += 1
            return _check(*args)

        monkeypatch.setitem(OPS, name, dataclasses.replace(OPS[name], check=counted))
    calls = LayerCalls(lens, tree.mask)
    for (k_cache, v_cache), (q, k, v) in zip(layers, new):
        calls.kv_append(k_cache, v_cache, k, v)
        calls.tree_attention(q, k_cache, v_cache)
    assert counts == {"kv_append": 1, "tree_attention": 1}
    calls.tree_attention(new[0][0], *layers[0], window_left=4)  # another signature: checked again
    assert counts["tree_attention"] == 2


def test_layer_calls_reject_bad_input_at_any_layer():
    lens, tree, layers, new = _inputs()
    calls = LayerCalls(lens, tree.mask)
    (k_cache, v_cache), (q, k, v) = layers[0], new[0]
    calls.kv_append(k_cache, v_cache, k, v)
    calls.tree_attention(q, k_cache, v_cache)
    with pytest.raises(ValueError, match="window_left"):
        calls.tree_attention(q, k_cache, v_cache, window_left=1)  # < T - 1
    with pytest.raises(TypeError, match="k_cache"):
        calls.tree_attention(q, k_cache.double(), v_cache.double())
    with pytest.raises((ValueError, TypeError), match="v_new|k_new"):
        calls.kv_append(k_cache, v_cache, k[:, :, :1], v)
    bad = LayerCalls(torch.tensor([11, 0], dtype=torch.int32), tree.mask)  # 11 + 3 nodes > 12 slots
    with specdec.value_checks(True), pytest.raises(ValueError, match="cache_lens"):
        bad.kv_append(k_cache, v_cache, k, v)
