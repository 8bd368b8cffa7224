"""Acceptance in the benchmark: inputs, minimal bytes moved, and the PyTorch peers.

params: B requests, T nodes, V vocab, dtype of the logits, tree ("chain" or "tree"), draft ("iid": the
children were sampled i.i.d. from the draft logits, which are passed; "topk": each node's children are its
top-k draft tokens, given proposals, no draft logits passed), temp (0 = greedy, else the temperature).

The draft is a noisy copy of the target (draft = target + NOISE * N(0, 1)), so paths are as long as a
decent drafter makes them; every run's path length is reported (mean_accepted).

Minimal bytes, from the path the run produced: one target row per node on the path, plus (sampling with
draft logits) one draft row per path node that has children; rows read once, in their dtype.

Peers (chains only; the same inputs, timed whole):
  torch-sampler  the vectorized PyTorch rejection sampler: softmax every target and draft row, gather
                 p(x) and q(x), accept while u < p(x)/q(x) (cumprod), sample the next token with
                 torch.multinomial from max(p - q, 0) at the first rejection or from p after the chain.
  torch-greedy   argmax every row, compare with the draft tokens, cumprod, next = argmax at the stop.
"""
from __future__ import annotations

import torch

import specdec

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
        self.tokens = _draft_tokens(draft, parents, self.draft_kind, self.temp, gen)
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
                              temperature=x.temperature, seeds=x.seeds, num_nodes=x.num_nodes, backend=backend)
    return run


def torch_rejection_sampler(x: Inputs):
    """The vectorized PyTorch chain sampler (see the module docstring)."""
    B, T, V = x.target_logits.shape
    t = x.temperature.view(B, 1, 1)
    p = torch.softmax(x.target_logits.float() / t, dim=-1)
    q = torch.softmax(x.draft_logits.float() / t, dim=-1)
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


def peers(x: Inputs, case) -> dict:
    if x.tree != "chain":
        return {}
    if x.temp == 0:
        return {"torch-greedy": lambda: (lambda: torch_greedy(x))}
    if x.draft_logits is not None:
        return {"torch-sampler": lambda: (lambda: torch_rejection_sampler(x))}
    return {}


def min_bytes(x: Inputs, res) -> int:
    V = x.target_logits.shape[-1]
    on_path = res.accepted_nodes >= 0
    rows = int(on_path.sum()) * V * x.target_logits.element_size()
    if x.draft_logits is not None and x.temp > 0:
        node = res.accepted_nodes.long().clamp(min=0)
        needs_draft = on_path & x.has_children.gather(1, node)
        rows += int(needs_draft.sum()) * V * x.draft_logits.element_size()
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
    return f"B{p['B']} T{p['T']} V{p['V']} {p['dtype']} {p['tree']} {draft} {mode}"
