"""SGLang's verifiers on specdec, with SGLang 0.5.23's signatures, dtypes and in-place outputs, without importing
SGLang: the tree verifiers `verify_tree_greedy`, `verify_tree_greedy_cpu` (its CPU op) and
`tree_speculative_sampling_target_only` (sgl_kernel / sglang.kernels.ops.speculative), and the chain verifier
`chain_speculative_sampling_triton` (sglang.kernels.ops.speculative.reject_sampling).

Trees come as SGLang links them: node i of request b (i = 0 the root, the last verified token) has its draft
token candidates[b, i], its first child retrive_next_token[b, i] and its next sibling retrive_next_sibling[b, i]
(-1: none), and its flat index retrive_index[b, i] into predicts (normally b * N + i). Outputs, written in place:
accept_token_num[b] = the accepted draft tokens (the root and the final token not counted), accept_index[b, j]
= the flat index of the j-th node of the accepted path for j <= accept_token_num[b] (later entries untouched),
predicts[flat index of each path node] = the token emitted after it (the next path node's token, and the
correction or bonus token after the last one); other entries of predicts are untouched. Trees deeper than
accept_index.shape[1] - 1 levels are SGLang's caller's error, as there.

The links are turned into parents on the device by pointer jumping (log2 N rounds, no host sync).
Inputs are checked as specdec's ops check theirs (ValueError / TypeError naming the argument, before any output is
written; the value checks only while specdec's value checks are on): a link is -1 or another node of the request
(never the root), no node is linked to twice, every node is reachable from the root and comes after its parent
(SGLang's trees are in that order), and every flat index lies in predicts (and in target_predict).
"""
from __future__ import annotations

import math

import torch

import specdec
from specdec import _validation as val


def _jumps(N: int) -> int:
    return max(1, math.ceil(math.log2(max(N, 2)))) + 1


def _links(retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor):
    """(parents (bs, N) int64, -1 at the root and unreachable nodes; rank (bs, N): a node's distance to the end
    of its sibling list, so a larger rank comes earlier in SGLang's sibling order)."""
    first, nxt = retrive_next_token.long(), retrive_next_sibling.long()
    bs, N = first.shape
    node = torch.arange(N, device=first.device).expand(bs, N)
    # owner[c] = v when c is v's first child; prev[s] = c when s is c's next sibling
    owner = torch.full((bs, N + 1), -1, dtype=torch.int64, device=first.device)
    owner.scatter_(1, torch.where(first >= 0, first, N), node)
    prev = torch.full((bs, N + 1), -1, dtype=torch.int64, device=first.device)
    prev.scatter_(1, torch.where(nxt >= 0, nxt, N), node)
    owner, prev = owner[:, :N], prev[:, :N]
    head = torch.where(prev >= 0, prev, node)  # pointer jumping: the head of each node's sibling list ...
    follow = torch.where(nxt >= 0, nxt, node)  # ... and its distance to the list's end (list ranking)
    rank = (nxt >= 0).long()
    for _ in range(_jumps(N)):
        head = head.gather(1, head)
        rank = rank + rank.gather(1, follow)
        follow = follow.gather(1, follow)
    parents = owner.gather(1, head)
    parents[:, 0] = -1
    return parents, rank


def _check_outputs_and_links(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                             retrive_next_sibling):
    """The metadata checks both verifiers share; returns (bs, N)."""
    val._tensor("candidates", candidates, dim=2, dtypes=val.INT_DTYPES)
    bs, N = candidates.shape
    if N < 1:
        raise ValueError(f"candidates: needs at least one node (the root), got shape {tuple(candidates.shape)}")
    dev = candidates.device
    for name, x in (("retrive_index", retrive_index), ("retrive_next_token", retrive_next_token),
                    ("retrive_next_sibling", retrive_next_sibling)):
        val._tensor(name, x, dim=2, dtypes=val.INT_DTYPES, device=dev)
        val._shape(name, x, (bs, N))
    val._tensor("predicts", predicts, dim=1, dtypes=val.INT_DTYPES, device=dev)
    val._tensor("accept_index", accept_index, dim=2, dtypes=val.INT_DTYPES, device=dev)
    if accept_index.shape[0] != bs or accept_index.shape[1] < 1:
        raise ValueError(f"accept_index: expected ({bs}, K) with K >= 1, got shape {tuple(accept_index.shape)}")
    val._tensor("accept_token_num", accept_token_num, dim=1, dtypes=val.INT_DTYPES, device=dev)
    val._shape("accept_token_num", accept_token_num, (bs,))
    return bs, N


def _check_link_values(retrive_index, retrive_next_token, retrive_next_sibling, flat_rows):
    """Value checks of the links and of the flat indices (< flat_rows), before anything follows them."""
    bs, N = retrive_index.shape
    for name, x in (("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling)):
        val._fail_if(name, (x != -1) & ((x < 1) | (x >= N)), f"every link must be -1 or a node in [1, {N})")
    targets = torch.cat((retrive_next_token, retrive_next_sibling), 1).long()
    linked = torch.zeros(bs, N + 1, dtype=torch.int64, device=targets.device)
    linked.scatter_add_(1, torch.where(targets >= 1, targets, N), torch.ones_like(targets))
    val._fail_if("retrive_next_token", linked[:, :N] > 1, "a node is linked to twice (as a first child or a sibling)")
    val._fail_if("retrive_index", (retrive_index < 0) | (retrive_index >= flat_rows),
                 f"flat indices must be in [0, {flat_rows})")


def _check_tree_order(parents):
    """Value check of the tree the links make (_links' parents)."""
    idx = torch.arange(parents.shape[1], device=parents.device)
    val._fail_if("retrive_next_token", (idx > 0) & ((parents < 0) | (parents >= idx)),
                 "every node i > 0 must be reachable from the root and come after its parent")


def _walk_outputs(path, n, predicts, accept_index, accept_token_num, retrive_index, candidates, last_token):
    """Write SGLang's outputs in place from the accepted path (bs, K) (node indices, -1 past n), n (bs,) and the
    token emitted after the last node (bs,)."""
    bs, K = path.shape
    j = torch.arange(K, device=path.device)
    on_path = j <= n.unsqueeze(1)
    nodes = torch.where(on_path, path, path.gather(1, n.unsqueeze(1)))  # past n: the last node again
    flat = retrive_index.long().gather(1, nodes)
    accept_index.copy_(torch.where(on_path, flat, accept_index.long()).to(accept_index.dtype))
    accept_token_num.copy_(n.to(accept_token_num.dtype))
    # the token after each path node: the next node's draft token, the final token after the last one (entries
    # past n repeat the last node's write, the same value, so the scatter stays deterministic)
    following = candidates.long().gather(1, nodes.roll(-1, 1).clamp(min=0))
    after = torch.where(j < n.unsqueeze(1), following, last_token.long().unsqueeze(1))
    predicts.view(-1).scatter_(0, flat.reshape(-1), after.reshape(-1).to(predicts.dtype))


def verify_tree_greedy(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                       candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                       retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy tree verification: descend into the first child, in sibling-list order, whose token is the target's
    argmax at its parent (target_predict, read at the parent's flat index), at most accept_index.shape[1] - 1
    levels; the final token is the argmax at the last accepted node. predicts (>= bs * N,) int32, accept_index
    (bs, K) int32, accept_token_num (bs,) int32: outputs in place; candidates, retrive_* (bs, N) int64;
    target_predict (bs, N) int64. Exactly SGLang's result, sibling order included (it needs no rows)."""
    bs, N = _check_outputs_and_links(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                     retrive_next_token, retrive_next_sibling)
    val._tensor("target_predict", target_predict, dim=2, dtypes=val.INT_DTYPES, device=candidates.device)
    val._shape("target_predict", target_predict, (bs, N))
    K = accept_index.shape[1]
    checks = val.value_checks_enabled()
    if checks:
        _check_link_values(retrive_index, retrive_next_token, retrive_next_sibling, predicts.numel())
    parents, rank = _links(retrive_next_token, retrive_next_sibling)
    if checks:
        _check_tree_order(parents)
        val._fail_if("candidates", candidates < 0, "token ids must be >= 0")
        val._fail_if("target_predict", target_predict < 0, "token ids must be >= 0")
    pred = target_predict.reshape(-1).long()[retrive_index.long()]  # (bs, N): the argmax after each node
    match = (parents >= 0) & (candidates.long() == pred.gather(1, parents.clamp(min=0)))
    key = torch.where(match, rank + 1, 0)  # the matching child that comes first in its list has the largest key
    slot = torch.where(parents >= 0, parents, N)
    best = torch.zeros(bs, N + 1, dtype=torch.int64, device=key.device).scatter_reduce(1, slot, key, "amax")
    chosen = torch.full((bs, N + 1), -1, dtype=torch.int64, device=key.device)
    node = torch.arange(N, device=key.device).expand(bs, N)
    chosen.scatter_(1, torch.where((key > 0) & (key == best.gather(1, slot)), slot, N), node)
    chosen = chosen[:, :N]
    path = torch.full((bs, K), -1, dtype=torch.int64, device=key.device)
    path[:, 0] = 0
    cur = torch.zeros(bs, 1, dtype=torch.int64, device=key.device)
    alive = torch.ones(bs, 1, dtype=torch.bool, device=key.device)
    for j in range(1, K):
        step = chosen.gather(1, cur)
        alive = alive & (step >= 0)
        cur = torch.where(alive, step, cur)
        path[:, j:j + 1] = torch.where(alive, step, -1)
    n = (path[:, 1:] >= 0).sum(1)
    _walk_outputs(path, n, predicts, accept_index, accept_token_num, retrive_index, candidates,
                  pred.gather(1, cur)[:, 0])


def _check_coins(uniform_samples, uniform_samples_for_final_sampling, bs, dev):
    val._tensor("uniform_samples", uniform_samples, dim=2, dtypes=val.FLOAT_DTYPES, device=dev)
    if uniform_samples.shape[0] != bs or uniform_samples.shape[1] < 1:
        raise ValueError(f"uniform_samples: expected ({bs}, N), got shape {tuple(uniform_samples.shape)}")
    val._tensor("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling, dtypes=val.FLOAT_DTYPES,
                device=dev)
    if uniform_samples_for_final_sampling.numel() != bs:
        raise ValueError(f"uniform_samples_for_final_sampling: expected {bs} values, got shape "
                         f"{tuple(uniform_samples_for_final_sampling.shape)}")


def _check_thresholds(threshold_single, threshold_acc):
    if threshold_single != 1.0 or threshold_acc != 1.0:
        raise ValueError("threshold_single, threshold_acc: only 1.0 (exact verification); SGLang's relaxed "
                         "thresholds change the output law and are not implemented")


def _seeds_from_coins(uniform_samples, uniform_samples_for_final_sampling):
    """(bs,) specdec seeds keyed by the bits of uniform_samples[b, 0] and uniform_samples_for_final_sampling[b]:
    the caller's uniforms still decide the result, deterministically."""
    bs = uniform_samples.shape[0]
    bits = lambda u: u.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF  # noqa: E731
    return ((bits(uniform_samples[:, 0]) << 31) ^ bits(uniform_samples_for_final_sampling.reshape(bs))) & (2**62 - 1)


def _check_draft_tokens(candidates, V):
    drafted = torch.arange(candidates.shape[1], device=candidates.device) > 0  # (the root is the last verified token)
    val._fail_if("candidates", candidates < 0, "token ids must be >= 0")
    val._fail_if("candidates", drafted & (candidates >= V), f"draft tokens must be in [0, {V})")


def _write_result(res, predicts, accept_index, accept_token_num, retrive_index, candidates):
    """SGLang's outputs from accept's result (node indices of an N-node tree, K = accept_index.shape[1])."""
    bs, N = candidates.shape
    K = accept_index.shape[1]
    path = torch.cat((res.accepted_nodes.long(), res.accepted_nodes.new_full((bs, max(0, K - N)), -1).long()), 1)
    _walk_outputs(path[:, :K], res.num_accepted.long(), predicts, accept_index, accept_token_num, retrive_index,
                  candidates, res.next_tokens)


def tree_speculative_sampling_target_only(predicts: torch.Tensor, accept_index: torch.Tensor,
                                          accept_token_num: torch.Tensor, candidates: torch.Tensor,
                                          retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                                          retrive_next_sibling: torch.Tensor, uniform_samples: torch.Tensor,
                                          uniform_samples_for_final_sampling: torch.Tensor,
                                          target_probs: torch.Tensor, draft_probs: torch.Tensor,
                                          threshold_single: float = 1.0, threshold_acc: float = 1.0,
                                          deterministic: bool = True) -> None:
    """Sampled tree verification of given proposals (EAGLE's top-k trees): the target's law target_probs (bs, N,
    V) after each node (temperature and filters already applied, as SGLang passes it); children are accepted by
    rejection sampling from the target restricted to what is left (accept x with probability r(x) / sum r, else
    r(x) = 0), and the final token is drawn from what is left at the last accepted node. Outputs in place as in
    verify_tree_greedy. Lossless also when sibling tokens repeat (SGLang's kernel adds a repeated sibling's
    probability twice); siblings are tried in node order, which does not change the output law.

    The draft is treated as one-hot (given proposals): SGLang 0.5.23 passes zeros as draft_probs here (its
    EAGLE verify, without --speculative-use-rejection-sampling), so draft_probs is neither read nor written. That
    keeps the target's law but accepts less than rejection sampling against the drafter's real law would: with
    real draft probabilities, SGLang (and specdec) verify chains with chain_speculative_sampling_triton.

    Randomness: request b's specdec stream is keyed by the bits of uniform_samples[b, 0] and
    uniform_samples_for_final_sampling[b] (so the caller's uniforms still decide the result, deterministically),
    not by those numbers as SGLang's coins. threshold_single / threshold_acc below 1 are SGLang's relaxed, lossy
    acceptance: refused (ValueError naming them)."""
    _check_thresholds(threshold_single, threshold_acc)
    bs, N = _check_outputs_and_links(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                     retrive_next_token, retrive_next_sibling)
    _check_coins(uniform_samples, uniform_samples_for_final_sampling, bs, candidates.device)
    val._tensor("target_probs", target_probs, dim=3, dtypes=val.FLOAT_DTYPES, device=candidates.device)
    checks = val.value_checks_enabled()
    if checks:
        _check_link_values(retrive_index, retrive_next_token, retrive_next_sibling, predicts.numel())
    parents, _ = _links(retrive_next_token, retrive_next_sibling)
    if checks:
        _check_tree_order(parents)
        _check_draft_tokens(candidates, target_probs.shape[-1])
    res = specdec.accept(tokens=candidates, parents=parents, target_probs=target_probs, temperature=1.0,
                         seeds=_seeds_from_coins(uniform_samples, uniform_samples_for_final_sampling))
    _write_result(res, predicts, accept_index, accept_token_num, retrive_index, candidates)


def chain_speculative_sampling_triton(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                      retrive_next_token, retrive_next_sibling, uniform_samples,
                                      uniform_samples_for_final_sampling, target_probs, draft_probs, threshold_single,
                                      threshold_acc, deterministic, *, block_verification: bool = False):
    """SGLang 0.5.23's chain verifier (`sglang.kernels.ops.speculative.reject_sampling`, used with
    --speculative-use-rejection-sampling, and --speculative-use-block-verification for block_verification=True),
    with its signature and in-place outputs.

    Request b's chain: node 0 the root (the last verified token), node i (1 <= i < N) the draft token
    candidates[b, i], drawn from draft_probs[b, i - 1] (bs, >= N - 1, V: the drafter's real law; rows past N - 2
    are not read); target_probs (bs, N, V): the target's law after each node. Node i's parent is i - 1:
    retrive_next_token / retrive_next_sibling are not read (SGLang's kernel does not read them either), only their
    shapes are checked. Outputs as verify_tree_greedy's: accept_token_num[b] = the accepted draft tokens,
    accept_index[b, j] = retrive_index[b, j] for j <= accept_token_num[b] (later entries untouched; K >= N),
    predicts[retrive_index[b, j]] = the token after node j (the next draft, then the correction or bonus token).

    Lossless: block_verification=False is token-wise rejection sampling (accept x with probability
    min(1, p(x) / q(x)); after a rejection the final token is drawn from relu(p - q) normalized, after the last
    node from p); True is block verification (Sun et al., arXiv 2403.10444; specdec.accept(method="block")),
    the same output law with at least as many accepted tokens on average. Both as SGLang's kernel decides them.

    Randomness: as tree_speculative_sampling_target_only (request b's specdec stream keyed by the bits of
    uniform_samples[b, 0] and uniform_samples_for_final_sampling[b]). threshold_single / threshold_acc: only 1.0;
    other values are refused (ValueError naming them). SGLang's kernel ignores them, and SGLang refuses
    --speculative-use-rejection-sampling with thresholds other than 1 at startup, so its relaxed mode is never
    combined with this verifier there. deterministic is accepted and has no effect (specdec is deterministic).
    """
    _check_thresholds(threshold_single, threshold_acc)
    bs, N = _check_outputs_and_links(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                     retrive_next_token, retrive_next_sibling)
    dev = candidates.device
    if accept_index.shape[1] < N:
        raise ValueError(f"accept_index: expected ({bs}, K) with K >= {N} (a chain of {N} nodes), got shape "
                         f"{tuple(accept_index.shape)}")
    _check_coins(uniform_samples, uniform_samples_for_final_sampling, bs, dev)
    val._tensor("target_probs", target_probs, dim=3, dtypes=val.FLOAT_DTYPES, device=dev)
    if target_probs.shape[:2] != (bs, N):
        raise ValueError(f"target_probs: expected shape ({bs}, {N}, V), got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    val._tensor("draft_probs", draft_probs, dim=3, dtypes=val.FLOAT_DTYPES, device=dev)
    if draft_probs.shape[0] != bs or draft_probs.shape[1] < N - 1 or draft_probs.shape[2] != V:
        raise ValueError(f"draft_probs: expected shape ({bs}, S, {V}) with S >= {N - 1}, got "
                         f"{tuple(draft_probs.shape)}")
    if val.value_checks_enabled():
        val._fail_if("retrive_index", (retrive_index < 0) | (retrive_index >= predicts.numel()),
                     f"flat indices must be in [0, {predicts.numel()})")
        _check_draft_tokens(candidates, V)
    # the last node's draft row is never read (nothing is drawn below it); the target's last row stands in for it
    draft = torch.cat((draft_probs[:, :N - 1], target_probs[:, N - 1:]), 1)
    res = specdec.accept(tokens=candidates, parents=torch.arange(-1, N - 1, device=dev).expand(bs, N),
                         target_probs=target_probs, draft_probs=draft.to(target_probs.dtype), temperature=1.0,
                         seeds=_seeds_from_coins(uniform_samples, uniform_samples_for_final_sampling),
                         method="block" if block_verification else "token")
    _write_result(res, predicts, accept_index, accept_token_num, retrive_index, candidates)


# SGLang's name on CPU (sgl_kernel.verify_tree_greedy_cpu, what its EAGLE verify calls there): the same op
verify_tree_greedy_cpu = verify_tree_greedy
