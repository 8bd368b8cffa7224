"""Acceptance in the benchmark: inputs, minimal bytes moved, and the PyTorch peers.

params: B requests, T nodes, V vocab, dtype of the logits, tree ("chain" or "tree"), draft ("iid": the
children were sampled i.i.d. from the draft logits, which are passed; "topk": each node's children are its
top-k draft tokens, given proposals, no draft logits passed), temp (0 = greedy, else the temperature), and
optionally top_k / top_p (accept's filters for every request; absent, 0 or 1.0: off; the iid drafter then
samples from the processed draft law, specdec.sampling.processed_logits), and penalties (True: every request
has repetition, frequency and presence penalties over an output of 64 tokens and a prompt of 256, a 16-entry
logit bias, and accept returns 5 top logprobs per emitted token, raw; the drafts are drawn unpenalized, which
changes the path lengths a little and the work per row not at all).

The draft is a noisy copy of the target (draft = target + NOISE * N(0, 1)), so paths are as long as a
decent drafter makes them; every run's path length is reported (mean_accepted).

Minimal bytes, from the path the run produced: one target row per node on the path, plus (sampling with
draft logits) one draft row per path node that has children; rows read once, in their dtype.

Peers (chains only; the same inputs, timed whole):
  torch-sampler  the vectorized PyTorch rejection sampler: softmax every target and draft row, gather
                 p(x) and q(x), accept while u < p(x)/q(x) (cumprod), sample the next token with
                 torch.multinomial from max(p - q, 0) at the first rejection or from p after the chain.
                 With top_k / top_p, every target and draft row is first divided by t and masked the usual
                 sort-based way (vLLM's apply_top_k_top_p: sort, k-th value, cumsum of the sorted softmax).
  torch-greedy   argmax every row, compare with the draft tokens, cumprod, next = argmax at the stop.
  torch-penalized-sampler  (penalties) the PyTorch way: every target and draft row penalized by torch ops
                 (each node's counts: the output's plus the chain's drafts above it, by a cumulative one-hot),
                 then torch-sampler on the penalized rows, then log_softmax and topk(5) of the emitted rows.
  <backend>-unfiltered  the same call without the filters / sampling parameters: their cost is the ratio to it.

Minimal bytes with penalties: also each request's output counts (V int32) and prompt mask (V / 8 bytes) once.
"""
from __future__ import annotations

import torch

import specdec
from specdec._layout import pack_bitmask, unpack_bitmask

from .common import DTYPES, random_parents

OP = "accept"
LOGIT_SCALE = 3.0  # target logits ~ LOGIT_SCALE * N(0, 1): a few tokens carry most of the mass
NOISE = 0.5  # draft = target + NOISE * N(0, 1)


class Inputs:
    def __init__(self, p: dict, device: torch.device, gen: torch.Generator):
        B, T, V = p["B"], p["T"], p["V"]
        self.dtype = DTYPES[p["dtype"]]
        self.tree, self.draft_kind, self.temp = p["tree"], p["draft"], float(p["temp"])
        target = LOGIT_SCALE * torch.randn(B, T, V, device=device)
        draft = target + NOISE * torch.randn(B, T, V, device=device)
        parents = random_parents(B, T, self.tree, gen).to(device)
        self.top_k, self.top_p = int(p.get("top_k", 0)), float(p.get("top_p", 1.0))
        self.filters = dict(top_k=self.top_k or None, top_p=self.top_p if self.top_p < 1 else None)
        sampled_from = draft
        if any(v is not None for v in self.filters.values()) and self.temp > 0:  # the drafter samples from q
            from specdec.sampling import processed_logits
            sampled_from = processed_logits(draft.view(B * T, V), self.temp, **self.filters).view(B, T, V)
        self.tokens = _draft_tokens(sampled_from, parents, self.draft_kind, self.temp, gen)
        self.penalties = bool(p.get("penalties"))
        if self.penalties:
            self.filters.update(_sampling_params(B, V, device, gen))
        self.target_logits = target.to(self.dtype)
        self.draft_logits = draft.to(self.dtype) if self.draft_kind == "iid" else None
        self.parents = parents
        self.temperature = torch.full((B,), self.temp, dtype=torch.float32, device=device)
        self.seeds = torch.arange(B, dtype=torch.int64, device=device) + 1234
        self.num_nodes = torch.full((B,), T, dtype=torch.int32, device=device)
        idx = torch.arange(T, device=device)
        self.has_children = (parents.long().unsqueeze(1) == idx.view(1, T, 1)).any(-1)  # (B, T)

    def reset(self):
        """Nothing to restore: the op is pure."""


NUM_BIAS, NUM_LOGPROBS = 16, 5


def _sampling_params(B, V, device, gen) -> dict:
    """accept's step-0 and logprob arguments for every request: an output of 64 tokens, a prompt of 256."""
    counts = torch.zeros(B, V, dtype=torch.int32)
    counts.scatter_add_(1, torch.randint(0, V, (B, 64), generator=gen), torch.ones(B, 64, dtype=torch.int32))
    in_prompt = torch.zeros(B, V, dtype=torch.bool).scatter_(1, torch.randint(0, V, (B, 256), generator=gen), True)
    return dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                output_token_counts=counts.to(device), prompt_token_mask=pack_bitmask(in_prompt).to(device),
                logit_bias=(torch.randint(0, V, (B, NUM_BIAS), generator=gen).to(device),
                            torch.randn(B, NUM_BIAS, generator=gen).to(device)),
                return_logprobs=NUM_LOGPROBS)


def _penalized(rows: torch.Tensor, x, parents_chain_tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V) float32 rows after the logit bias and the penalties, by torch ops, node i's counts being the
    output's plus the chain's drafts 1..i (the PyTorch way an engine would write it)."""
    B, T, V = rows.shape
    f = x.filters
    ids, values = f["logit_bias"]
    rows = rows.float().clone()
    rows.view(B, T, V).scatter_add_(2, ids.long().unsqueeze(1).expand(B, T, -1),
                                    values.float().unsqueeze(1).expand(B, T, -1))
    drafted = torch.zeros(B, T, V, device=rows.device, dtype=torch.int32)
    drafted[:, 1:].scatter_(2, parents_chain_tokens[:, 1:].long().unsqueeze(-1), 1)
    counts = f["output_token_counts"].unsqueeze(1) + drafted.cumsum(1)  # (B, T, V)
    present = counts > 0
    seen = present | unpack_bitmask(f["prompt_token_mask"], V).unsqueeze(1)
    rep = f["repetition_penalty"]
    rows = torch.where(seen, rows * torch.where(rows > 0, 1.0 / rep, rep), rows)
    return rows - f["frequency_penalty"] * counts - f["presence_penalty"] * present


def _draft_tokens(draft, parents, kind, temp, gen) -> torch.Tensor:
    """(B, T) int32 draft tokens. Node i > 0 holds a child of node parents[i]: sampled from (or, greedy,
    the argmax of) that node's draft law when kind == "iid"; its sibling-rank-th top token when "topk"."""
    B, T, V = draft.shape
    par = parents.long().clamp(min=0)
    if kind == "topk":
        idx = torch.arange(T, device=draft.device)
        same_parent_before = (par.unsqueeze(2) == par.unsqueeze(1)) & (idx.view(1, 1, T) < idx.view(1, T, 1))
        rank = same_parent_before.sum(-1)  # (B, T): children before node i under the same parent
        top = draft.topk(T, dim=-1).indices  # (B, T, T)
        tokens = top.gather(1, par.unsqueeze(-1).expand(B, T, T)).gather(2, rank.unsqueeze(-1)).squeeze(-1)
    elif temp == 0:
        tokens = draft.argmax(-1).gather(1, par)
    else:
        draw_gen = torch.Generator(device=draft.device).manual_seed(int(torch.randint(2**31, (1,), generator=gen)))
        probs = torch.softmax(draft / temp, dim=-1).view(B * T, V)
        samples = torch.multinomial(probs, T, replacement=True, generator=draw_gen).view(B, T, T)
        # node i takes sample number i of its parent's law: siblings get independent draws
        tokens = samples.gather(1, par.unsqueeze(-1).expand(B, T, T)).diagonal(dim1=1, dim2=2)
    tokens = tokens.to(torch.int32).clone()
    tokens[:, 0] = 0
    return tokens


def specdec_fn(x: Inputs, backend: str):
    def run():
        return specdec.accept(x.target_logits, x.tokens, x.parents, draft_logits=x.draft_logits,
                              temperature=x.temperature, seeds=x.seeds, num_nodes=x.num_nodes, backend=backend,
                              **x.filters)
    return run


def apply_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """(N, V) logits with the entries outside the top-k / top-p set at -inf, the way PyTorch engines write it
    (vLLM's apply_top_k_top_p): one ascending sort per row, the k-th value, the cumsum of the sorted softmax."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k:
        kth = logits_sort.gather(1, torch.full((logits.shape[0], 1), logits.shape[1] - k, device=logits.device))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    if p < 1:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        top_p_mask = probs_sum <= 1 - p
        top_p_mask[:, -1] = False  # at least one
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter(dim=-1, index=logits_idx, src=logits_sort)


def torch_rejection_sampler(x: Inputs, target_logits=None, draft_logits=None):
    """The vectorized PyTorch chain sampler (see the module docstring), on x's rows or the given ones."""
    B, T, V = x.target_logits.shape
    t = x.temperature.view(B, 1, 1)
    target = (x.target_logits if target_logits is None else target_logits).float() / t
    draft = (x.draft_logits if draft_logits is None else draft_logits).float() / t
    if x.top_k or x.top_p < 1:
        target = apply_top_k_top_p(target.view(B * T, V), x.top_k, x.top_p).view(B, T, V)
        draft = apply_top_k_top_p(draft.view(B * T, V), x.top_k, x.top_p).view(B, T, V)
    p = torch.softmax(target, dim=-1)
    q = torch.softmax(draft, dim=-1)
    drafted = x.tokens[:, 1:].long().unsqueeze(-1)  # node i + 1 was drawn from q at node i
    px = p[:, :-1].gather(-1, drafted).squeeze(-1)
    qx = q[:, :-1].gather(-1, drafted).squeeze(-1)
    u = torch.rand(B, T - 1, device=p.device)
    num_acc = (u * qx < px).int().cumprod(dim=1).sum(dim=1)  # (B,)
    rows = torch.arange(B, device=p.device)
    p_stop, q_stop = p[rows, num_acc], q[rows, num_acc]
    residual = torch.where((num_acc < T - 1).unsqueeze(1), (p_stop - q_stop).clamp(min=0), p_stop)
    next_tokens = torch.multinomial(residual, 1).squeeze(1)
    return _chain_result(num_acc, next_tokens, T)


def torch_penalized_sampler(x: Inputs):
    """The PyTorch way with penalties, bias and logprobs (see the module docstring)."""
    B, T, V = x.target_logits.shape
    target, draft = _penalized(x.target_logits, x, x.tokens), _penalized(x.draft_logits, x, x.tokens)
    res = torch_rejection_sampler(x, target, draft)
    emitted_rows = target.gather(1, res.accepted_nodes.long().clamp(min=0).unsqueeze(-1).expand(B, T, V))
    res.logprobs = torch.log_softmax(emitted_rows, -1).topk(NUM_LOGPROBS, -1)
    return res


def torch_greedy(x: Inputs):
    """Greedy chain verification in plain PyTorch."""
    B, T, V = x.target_logits.shape
    best = x.target_logits.argmax(-1)  # (B, T)
    num_acc = (best[:, :-1] == x.tokens[:, 1:].long()).int().cumprod(dim=1).sum(dim=1)
    next_tokens = best.gather(1, num_acc.long().unsqueeze(1)).squeeze(1)
    return _chain_result(num_acc, next_tokens, T)


def _chain_result(num_acc, next_tokens, T):
    idx = torch.arange(T, device=num_acc.device)
    accepted = torch.where(idx.unsqueeze(0) <= num_acc.unsqueeze(1), idx, -1).to(torch.int32)
    return specdec.AcceptResult(accepted, num_acc.to(torch.int32), next_tokens.to(torch.int64))


def unfiltered_fn(x: Inputs, backend: str):
    """The same call without the filters: what the filters cost is the ratio to it."""
    def run():
        return specdec.accept(x.target_logits, x.tokens, x.parents, draft_logits=x.draft_logits,
                              temperature=x.temperature, seeds=x.seeds, num_nodes=x.num_nodes, backend=backend)
    return run


def peers(x: Inputs, case) -> dict:
    filtered = bool(x.top_k or x.top_p < 1 or x.penalties)
    if filtered and x.temp > 0:  # the default backend of the device without the filters (not a valid result:
        backend = "cpp" if x.target_logits.device.type == "cpu" else "triton"  # another law; only its time)
        unfiltered = {f"{backend}-unfiltered": lambda: unfiltered_fn(x, backend)}
    else:
        unfiltered = {}
    if x.tree != "chain":
        return unfiltered
    if x.temp == 0 and filtered:
        return {}  # greedy: the filters change nothing
    if x.temp == 0:
        return {"torch-greedy": lambda: (lambda: torch_greedy(x))}
    if x.draft_logits is not None and x.penalties:
        return {"torch-penalized-sampler": lambda: (lambda: torch_penalized_sampler(x)), **unfiltered}
    if x.draft_logits is not None:
        return {"torch-sampler": lambda: (lambda: torch_rejection_sampler(x)), **unfiltered}
    return unfiltered


def min_bytes(x: Inputs, res) -> int:
    V = x.target_logits.shape[-1]
    on_path = res.accepted_nodes >= 0
    rows = int(on_path.sum()) * V * x.target_logits.element_size()
    if x.draft_logits is not None and x.temp > 0:
        node = res.accepted_nodes.long().clamp(min=0)
        needs_draft = on_path & x.has_children.gather(1, node)
        rows += int(needs_draft.sum()) * V * x.draft_logits.element_size()
    if x.penalties:
        rows += x.target_logits.shape[0] * (V * 4 + V // 8)
    return rows


def reference_value(x: Inputs):
    """Greedy chains: the plain-PyTorch greedy result (exact). Sampling: none (other random streams)."""
    return torch_greedy(x) if x.temp == 0 and x.tree == "chain" else None


def check(x: Inputs, res, expected) -> str:
    """Greedy: equal to the expected result. Sampling: a valid path (parent links, ascending, -1 padded,
    num_accepted consistent) and next tokens in [0, V)."""
    B, T, V = x.target_logits.shape
    acc, na, nxt = (t.cpu().long() for t in res)
    if expected is not None:
        same = all(torch.equal(a.cpu().long(), e.cpu().long()) for a, e in zip(res, expected))
        return "ok (= greedy peer)" if same else "MISMATCH (differs from the greedy peer)"
    parents = x.parents.cpu().long()
    idx = torch.arange(T)
    on_path = idx.unsqueeze(0) <= na.unsqueeze(1)
    node = acc.clamp(min=0)
    links = parents.gather(1, node[:, 1:]) == acc[:, :-1]
    problems = []
    if not bool(((acc >= 0) == on_path).all()):
        problems.append("padding/num_accepted")
    elif not bool((acc[:, 0] == 0).all() and (links | ~on_path[:, 1:]).all()):
        problems.append("path does not follow parent links")
    if not bool(((nxt >= 0) & (nxt < V)).all()):
        problems.append("next token out of range")
    return "ok (valid paths)" if not problems else "MISMATCH (" + ", ".join(problems) + ")"


def summary(x: Inputs, res) -> dict:
    return {"mean_accepted": round(float(res.num_accepted.float().mean()), 3)}


def describe(p: dict) -> str:
    mode = "greedy" if float(p["temp"]) == 0 else f"t{p['temp']:g}"
    draft = "draft-logits" if p["draft"] == "iid" else "topk-proposals"
    filters = (f" top_k{p['top_k']}" if p.get("top_k") else "") + (f" top_p{p['top_p']:g}" if p.get("top_p", 1) < 1 else "")
    penalties = f" penalties+bias{NUM_BIAS}+logprobs{NUM_LOGPROBS}" if p.get("penalties") else ""
    return f"B{p['B']} T{p['T']} V{p['V']} {p['dtype']} {p['tree']} {draft} {mode}{filters}{penalties}"
