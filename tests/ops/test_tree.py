"""build_tree: hand-made trees, random trees against a naive ancestor walk, every backend."""
import pytest
import torch

import specdec
from specdec._layout import pack_bits, unpack_bits
from tests.helpers import random_trees

TREE_BACKENDS = ["torch", "triton"] + (["cpp"] if specdec.ops.HAS_CPP else [])


def naive_ancestors(parents: list[int], n: int, T: int):
    """depth list and (T, T) ancestor-or-self matrix by walking up from every node."""
    depth, anc = [0] * T, torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        anc[i, i] = True
        if i >= n:
            continue
        j = i
        while parents[j] != -1:
            j = parents[j]
            anc[i, j] = True
            depth[i] += 1
    return depth, anc


@pytest.mark.parametrize("backend", TREE_BACKENDS)
def test_hand_made_tree(backend):
    #      0
    #    /   \
    #   1     2
    #  / \     \
    # 3   4     5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]])
    info = specdec.build_tree(parents, backend=backend)
    assert info.depth.tolist() == [[0, 1, 1, 2, 2, 2]]
    expected = [0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101]
    assert info.mask.squeeze(-1).squeeze(0).tolist() == expected
    assert info.num_nodes.tolist() == [6]
    assert info.mask.dtype == torch.int32 and info.depth.dtype == torch.int32


@pytest.mark.parametrize("backend", TREE_BACKENDS)
@pytest.mark.parametrize("T", [1, 7, 32, 33, 70])
def test_random_trees_match_naive_walk(backend, T):
    gen = torch.Generator().manual_seed(T)
    parents, num_nodes = random_trees(6, T, gen)
    info = specdec.build_tree(parents, num_nodes, backend=backend)
    assert info.mask.shape == (6, T, (T + 31) // 32)
    for b in range(6):
        depth, anc = naive_ancestors(parents[b].tolist(), int(num_nodes[b]), T)
        assert info.depth[b].tolist() == depth
        assert torch.equal(unpack_bits(info.mask[b], T), anc)


def test_bit_31_is_the_sign_bit():
    # a chain of 33 nodes: node 31's mask has all 32 bits of word 0 set, i.e. -1 as int32
    info = specdec.build_tree(torch.tensor([[-1] + list(range(32))]))
    assert info.mask[0, 31].tolist() == [-1, 0]
    assert info.mask[0, 32].tolist() == [-1, 1]


def test_pack_unpack_roundtrip():
    bits = torch.rand(3, 5, 64, generator=torch.Generator().manual_seed(1)) < 0.5
    assert torch.equal(unpack_bits(pack_bits(bits), 64), bits)


def test_padding_nodes_get_only_their_own_bit():
    parents = torch.tensor([[-1, 0, 1, -1, -1]])
    info = specdec.build_tree(parents, torch.tensor([3], dtype=torch.int32))
    assert info.depth.tolist() == [[0, 1, 2, 0, 0]]
    assert info.mask[0, :, 0].tolist() == [1, 3, 7, 8, 16]
