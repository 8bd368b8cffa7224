"""Statistical helpers for the lossless-sampling tests: emitted tokens and chi-square goodness of fit.

Every statistical test draws many independent requests in one batch (one seed each) with fixed
generator seeds, so a run is deterministic. A test fails when the chi-square p-value of the emitted
tokens against the exact target law is below ALPHA; sample sizes are chosen so that a correct sampler
passes with probability 1 - ALPHA per test while the known-wrong samplers of the negative controls are
rejected with p-values many orders of magnitude below ALPHA.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats

ALPHA = 1e-4
MIN_EXPECTED = 5.0  # chi-square needs about 5 expected counts per cell: rarer cells are pooled


def emitted_tokens(result, tokens: torch.Tensor) -> list[list[int]]:
    """Per request: the tokens of the accepted draft nodes (root excluded), then the next token. (Plain Python on
    purpose: the tests' own oracle, independent of AcceptResult.emitted_tokens.)"""
    acc, num, nxt = (x.cpu() for x in result)
    toks = tokens.cpu()
    return [[int(toks[b, int(acc[b, i])]) for i in range(1, int(num[b]) + 1)] + [int(nxt[b])]
            for b in range(acc.shape[0])]


def first_tokens(result, tokens: torch.Tensor) -> torch.Tensor:
    """(B,) the first token each request emits: its first accepted draft token, else its next token."""
    acc, num, nxt = (x.cpu() for x in result)
    first_node = acc[:, 1].clamp(min=0).long()
    drafted = tokens.cpu().long().gather(1, first_node[:, None])[:, 0]
    return torch.where(num > 0, drafted, nxt.long())


def target_law(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / t) in float64 along the last dimension."""
    return torch.softmax(logits.double().cpu() / temperature, dim=-1)


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of `samples` (ints in [0, K)) against the law `probs` (K,), pooling rare cells.

    A sample in a cell of probability 0 is impossible under the law: the p-value is then 0.
    """
    probs = probs.double().cpu().flatten()
    counts = torch.bincount(samples.long().cpu().flatten(), minlength=probs.numel()).double()
    if counts.numel() > probs.numel() or bool((counts[probs == 0] > 0).any()):
        return 0.0
    n = float(counts.sum())
    expected = (probs * n).numpy()
    observed = counts.numpy()
    keep = expected > 0
    expected, observed = expected[keep], observed[keep]
    small = expected < MIN_EXPECTED  # pooled into one cell, merged into the smallest other one if still rare
    if small.any() and not small.all():
        pool_e, pool_o = expected[small].sum(), observed[small].sum()
        expected, observed = expected[~small], observed[~small]
        if pool_e < MIN_EXPECTED:
            i = int(np.argmin(expected))
            expected[i] += pool_e
            observed[i] += pool_o
        else:
            expected, observed = np.append(expected, pool_e), np.append(observed, pool_o)
    if len(expected) < 2:
        return 1.0
    return float(stats.chisquare(observed, expected * (observed.sum() / expected.sum())).pvalue)


def assert_law(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Fail unless `samples` are plausibly distributed as `probs` (p-value >= ALPHA)."""
    p = chi_square_pvalue(samples, probs)
    if p < ALPHA:
        counts = torch.bincount(samples.long().cpu().flatten(), minlength=probs.numel())
        expected = probs.double().cpu().flatten() * samples.numel()
        expected = [round(e, 1) for e in expected.tolist()]
        raise AssertionError(f"{what}: emitted tokens do not follow the target law (chi-square p = {p:.3g} < "
                             f"{ALPHA}); observed {counts.tolist()}, expected {expected}")
