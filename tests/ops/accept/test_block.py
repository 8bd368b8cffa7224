"""Block verification (accept(..., method="block"); Sun et al., arXiv 2403.10444, Algorithm 2): exactly
lossless, and never fewer accepted tokens than token-wise verification of the same drafts.

Exact checks enumerate every draft chain of small Markov targets and drafters with the reference's own
block_weights / block_residual (the paper's steps, tests/ops/accept/markov.py): the law of the first emitted tokens
is the target's, and the expected accepted length is >= token-wise's, with equality only where the paper's argument
allows it (gamma = 1). Chains only; the Triton walk's schedules and the rows it reads. The properties every
verifier has (sampled laws, mean accepted length, negative controls, greedy requests, bad arguments):
test_verifier_properties.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import MemorySpy, accept_on, element_addresses
from tests.ops.accept.markov import (METHOD_BACKENDS, V_BATCH, block, chain_batch, exact_chain, first_k_law,
                                     random_pair, target_k_law, token_wise)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ----------------------------------------------------------------------------------------------
# exact: every draft chain enumerated
# ----------------------------------------------------------------------------------------------
def test_block_weights_on_the_papers_example():
    """Sun et al.'s motivating example: two context-independent models over {a, b}, target (1/3, 2/3),
    drafter (2/3, 1/3), blocks of 2: token-wise accepts 10/9 tokens on average, block verification 11/9."""
    p = torch.tensor([[1 / 3, 2 / 3]] * 2, dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    assert exact_chain(token_wise, p, q, 2)[1] == pytest.approx(10 / 9, abs=1e-12)
    assert exact_chain(block, p, q, 2)[1] == pytest.approx(11 / 9, abs=1e-12)


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_block_is_exactly_lossless_and_never_worse(gamma):
    """Random Markov pairs (V = 4, some zeros on either side): the first two tokens follow the target exactly
    (to rounding); block verification accepts >= token-wise on every pair and > on most (gamma >= 2; at
    gamma = 1 the two are the same algorithm)."""
    gen = torch.Generator().manual_seed(gamma)
    better = 0
    for _ in range(25):
        p, q = random_pair(gen)
        law, joint = exact_chain(block, p, q, gamma)
        _, token = exact_chain(token_wise, p, q, gamma)
        torch.testing.assert_close(first_k_law(law, p, 2), target_k_law(p, 2), rtol=0, atol=1e-12)
        assert joint >= token - 1e-12
        better += joint > token + 1e-9
    assert better == 0 if gamma == 1 else better >= 20


# ----------------------------------------------------------------------------------------------
# the op: chains only, the Triton walk
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", METHOD_BACKENDS["block"])
def test_block_verifies_chains_only(backend):
    batch = chain_batch(3, 4, torch.Generator().manual_seed(0), torch.tensor([1.0, 0.0, 0.7]))
    tree = dict(batch, parents=torch.tensor([[-1, 0, 0, 1]] * 3), num_nodes=torch.full((3,), 4))
    with pytest.raises(ValueError, match="method: 'block' verifies chains only"):
        accept_on(backend, **tree, method="block")


def test_triton_block_schedules_agree_and_read_every_chain_row(monkeypatch):
    """The Triton walk of block verification gives the same results under the split launches as in the
    walker alone, with filters too; it reads every row of each sampled chain (each test needs its node's
    residual mass), not only the rows up to a first rejection, never a row past the chain, and never the
    last node's draft row (h_gamma = p_gamma needs none)."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(4)
    B, T = 6, 5
    temps = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 0.7])
    batch = chain_batch(B, T, gen, temps)
    target, draft = batch["target_logits"], batch["draft_logits"]
    args = (target, batch["tokens"].int(), batch["parents"].int(), draft, temps, batch["seeds"],
            batch["num_nodes"].int(), 0)
    spy = MemorySpy(monkeypatch)
    base = triton_accept(*args, method="block")
    reads = {name: spy.counts([x]) for name, x in (("target", target), ("draft", draft))}
    for b in range(B):
        n = int(batch["num_nodes"][b])
        for i in range(T):
            rows = {name: element_addresses(x)[b, i].tolist() for name, x in (("target", target), ("draft", draft))}
            target_read = all(reads["target"].get(a, 0) >= 1 for a in rows["target"])
            if temps[b] > 0:
                assert target_read == (i < n), (b, i)
                draft_read = sum(reads["draft"].get(a, 0) > 0 for a in rows["draft"])
                assert (draft_read == V_BATCH) == (i < n - 1), (b, i, draft_read)
    for schedule in (dict(num_splits=3, split_steps=2 * T + 3), dict(num_splits=2, split_steps=3)):
        assert all(torch.equal(x, y) for x, y in zip(base, triton_accept(*args, method="block", **schedule)))
    filters = (torch.tensor([3, 0, 5, 2, 0, 4], dtype=torch.int32), torch.tensor([0.9, 0.8, 1.0, 1.0, 0.95, 0.7]),
               torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0]), None)
    filtered = triton_accept(*args, None, *filters, "block")
    assert all(torch.equal(x, y) for x, y in zip(filtered, triton_accept(*args, None, *filters, "block",
                                                                         num_splits=3, split_steps=20)))
