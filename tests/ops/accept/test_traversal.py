"""Traversal verification (accept(..., method="traversal"); Weng et al., arXiv 2505.12398): exactly lossless on
trees whose children are drawn i.i.d. from q, never fewer accepted tokens than token-wise tree verification, and
block verification itself on a chain.

Exact checks enumerate every draft tree of small Markov targets and drafters with the reference's own steps
(traversal_child_weight / traversal_residual, tests/ops/accept/markov.py): the law of the first generated tokens
is the target's, and the expected accepted length is >= token-wise's (equal on stars, where both are the same
algorithm). The properties every verifier has (sampled laws, mean accepted length, negative controls, greedy
requests, bad arguments): test_verifier_properties.py; on the Triton kernel: test_traversal_triton.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.ops.accept.markov import (BINARY, EXACT_TREES, block, chain, exact_chain, exact_tree, first_k_law,
                                     path_tokens, random_pair, target_k_law, token_wise_tree, traversal)


@pytest.mark.parametrize("name", EXACT_TREES)
def test_traversal_is_exactly_lossless_and_never_worse(name):
    """Random Markov pairs (V = 4, zeros on either side): the first depth + 1 tokens follow the target exactly
    (to rounding); traversal accepts >= token-wise on every pair, and > on most when the tree is deeper than a
    star (on a star both are the same algorithm)."""
    parents = EXACT_TREES[name]
    depth = max(len(path_tokens(v, parents, list(range(len(parents))))) for v in range(len(parents)))
    gen = torch.Generator().manual_seed(len(name))
    better = 0
    for _ in range(15):
        p, q = random_pair(gen)
        law, joint = exact_tree(traversal, p, q, parents)
        _, token = exact_tree(token_wise_tree, p, q, parents)
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)
        torch.testing.assert_close(first_k_law(law, p, depth + 1), target_k_law(p, depth + 1), rtol=0, atol=1e-12)
        assert joint >= token - 1e-12
        better += joint > token + 1e-9
    assert better == 0 if name == "star" else better >= 12


def test_traversal_of_a_chain_is_block_verification():
    """On a chain, traversal's weights are block verification's p_i and its decisions h_i: the same law of
    emitted tuples and the same expected accepted length, exactly."""
    gen = torch.Generator().manual_seed(3)
    for gamma in (1, 2, 3):
        p, q = random_pair(gen)
        law, joint = exact_tree(traversal, p, q, chain(gamma))
        block_law, block_mean = exact_chain(block, p, q, gamma)
        assert joint == pytest.approx(block_mean, abs=1e-12)
        for emitted in set(law) | set(block_law):
            assert law.get(emitted, 0.0) == pytest.approx(block_law.get(emitted, 0.0), abs=1e-12), emitted


def test_the_harness_sees_the_token_wise_law_too():
    """The enumeration's token-wise tree verifier is itself lossless (a check of the harness, not of a claim)."""
    gen = torch.Generator().manual_seed(9)
    p, q = random_pair(gen)
    law, _ = exact_tree(token_wise_tree, p, q, BINARY)
    torch.testing.assert_close(first_k_law(law, p, 3), target_k_law(p, 3), rtol=0, atol=1e-12)
