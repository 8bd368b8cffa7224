"""Engines' cache layouts through one verification step (append, tree attention, rollback) on every backend
against the reference: the ops take any strides (unit stride along D), so a layout is a view, never a copy.

  NHD pages           (num_blocks, block_size, Hkv, D), the documented layout
  HND pages           FlashInfer's (num_blocks, Hkv, block_size, D), passed as .transpose(1, 2)
  K|V interleaved     vLLM's (num_blocks, 2, block_size, Hkv, D), passed as kv[:, 0] and kv[:, 1]
  HND contiguous      (B, Hkv, L_max, D), passed as .transpose(1, 2)
  stacked HND layers  (layers, num_blocks, Hkv, block_size, D) for a one-call rollback of every layer

each with a float32 cache, and with a float8 one (scales) under a sliding window.
"""
from __future__ import annotations

import pytest
import torch

import specdec
from tests.helpers import BACKENDS, assert_close, on_backend, random_root_paths, random_trees, to_device

B, T, Hq, Hkv, D, BS, BLOCKS, LAYERS = 2, 5, 4, 2, 16, 8, 12, 2


def layout(name: str, gen: torch.Generator, dtype: torch.dtype):
    """(k, v, block_table) views of one freshly drawn buffer in layout `name` (k, v 5-D when stacked)."""
    table = torch.randperm(BLOCKS, generator=gen)[:B * 5].view(B, 5).to(torch.int32)
    shapes = {"NHD pages": (2, BLOCKS, BS, Hkv, D), "HND pages": (2, BLOCKS, Hkv, BS, D),
              "K|V interleaved": (BLOCKS, 2, BS, Hkv, D), "HND contiguous": (2, B, Hkv, 5 * BS, D),
              "stacked HND layers": (2, LAYERS, BLOCKS, Hkv, BS, D)}
    kv = torch.randn(shapes[name], generator=gen).to(dtype)
    if name == "NHD pages":
        return kv[0], kv[1], table
    if name == "HND pages":
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2), table
    if name == "K|V interleaved":
        return kv[:, 0], kv[:, 1], table
    if name == "HND contiguous":
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2), None
    return kv[0].transpose(2, 3), kv[1].transpose(2, 3), table


def step(k, v, table, x, backend, **attention):
    """Append the tree's K/V (layer 0), attend (layer 0), roll every layer back; returns attention's out.
    `attention`: the float8 scales (append and attention) and a window (attention)."""
    scales = {name: attention[name] for name in ("k_scale", "v_scale") if name in attention}
    k0, v0 = (k[0], v[0]) if k.dim() == 5 else (k, v)
    specdec.kv_append(k0, v0, x["k_new"], x["v_new"], x["lens"], block_table=table, backend=backend, **scales)
    out = specdec.tree_attention(x["q"], k0, v0, x["lens"], x["mask"], block_table=table, num_nodes=x["num_nodes"],
                                 backend=backend, **attention)
    specdec.kv_rollback(k, v, x["lens"], x["paths"], x["num_accepted"], block_table=table, backend=backend)
    return out


# a float32 cache; vLLM's fp8 cache with scales, under a sliding window shorter than the prefixes (20, 9)
CACHES = {"fp32": (torch.float32, {}),
          "fp8-window": (torch.float8_e4m3fn, dict(k_scale=0.02, v_scale=0.05, window_left=6))}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["NHD pages", "HND pages", "K|V interleaved", "HND contiguous",
                                  "stacked HND layers"])
def test_engine_layouts_match_the_reference(backend, name, cache):
    dtype, attention = CACHES[cache]
    gen = torch.Generator().manual_seed(len(name))
    parents, num_nodes = random_trees(B, T, gen, ragged=False)
    paths, num_accepted = random_root_paths(parents, gen)
    x = dict(q=torch.randn(B, T, Hq, D, generator=gen), k_new=torch.randn(B, T, Hkv, D, generator=gen),
             v_new=torch.randn(B, T, Hkv, D, generator=gen), lens=torch.tensor([20, 9], dtype=torch.int32),
             mask=specdec.build_tree(parents, num_nodes).mask, num_nodes=num_nodes, paths=paths,
             num_accepted=num_accepted)
    k, v, table = layout(name, gen, dtype)
    ref_k, ref_v, ref_x = k.clone(), v.clone(), dict(x, lens=x["lens"].clone())
    ref_out = step(ref_k, ref_v, table, ref_x, "torch", **attention)
    dk, dv, dtable = to_device(k, v, table)  # same strides on the tested device
    dx = on_backend(backend, x)
    out = step(dk, dv, dtable, dx, backend, **attention)
    assert dk.stride() == k.stride()  # written in place through the views, never copied
    assert_close(out.cpu(), ref_out, torch.float32)
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int32  # bit for bit (float8 has no torch.equal)
    assert torch.equal(dk.cpu().view(bits), ref_k.view(bits)) and torch.equal(dv.cpu().view(bits), ref_v.view(bits))
    assert torch.equal(dx["lens"].cpu(), ref_x["lens"])
