"""Where one speculative step's time goes, and what compiling the whole step (not each forward) buys.

    python -m bench.step [--tree chain:4] [--context 300] [--steps 40] [--out DIR]

On the shipped pair, one request, one thread, greedy, value checks off: the median time of
  * the target's cached forward over 1 token (an AR step's model work) and over the tree's T tokens;
  * one whole step (propose, build_tree, the target's forward, accept, both rollbacks, the token append), run
    eager, with each cached forward compiled (what SpeculativeDecoder(compile=True) does today), and compiled
    as ONE torch.compile(fullgraph=True) graph: that it compiles at all shows the step has no host sync
    (a host read breaks a fullgraph trace), the precondition of the static / CUDA-graph step of issue 17.
The step here is the loop's step body (specdec/decoding.py) without the stopping rule and statistics.
Writes step.json / step.md under --out (bench/results by default).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import specdec
from specdec.drafters import DraftModelDrafter
from specdec.models.hf import load_model
from specdec.models.llama import chain_tree, compile_static
from specdec.sampling import SamplingParams

from .timing import machine_info

ASSETS = os.path.join(os.path.dirname(specdec.__file__), "assets")
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def median_ms(fn, n: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def forward_ms(target, cache, t: int, n: int) -> float:
    """Median ms of the target's cached forward over a t-token chain."""
    info = chain_tree(1, t)
    toks = torch.zeros(1, t, dtype=torch.long)
    return median_ms(lambda: target.forward_cached(toks, cache, info.depth, info.mask), n)


def make_step(target, draft, tree: str, context: int, steps: int):
    """A fresh decoding state (random prompt of `context` tokens) and its step function."""
    drafter = DraftModelDrafter(draft, tree)
    L = context + (steps + 5) * drafter.max_nodes  # the warm-up and timed steps, each <= max_nodes tokens
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, L), generator=gen)
    seq_lens = torch.full((1,), context, dtype=torch.int32)
    temp = torch.zeros(1)
    cache = target.new_cache(1, L)
    target.prefill(cache, tokens, seq_lens - 1)
    drafter.start(tokens, seq_lens, L, temp, [0], SamplingParams())
    cols = torch.arange(drafter.max_nodes)

    def step():
        prop = drafter.propose(tokens, seq_lens, temp)
        info = specdec.build_tree(prop.parents, prop.num_nodes)
        logits = target.forward_cached(prop.tokens, cache, info.depth, info.mask, prop.num_nodes)
        res = specdec.accept(logits, prop.tokens, prop.parents, num_nodes=prop.num_nodes, temperature=temp)
        cache.rollback(res.accepted_nodes, res.num_accepted)
        drafter.commit(prop, res.accepted_nodes, res.num_accepted)
        new = res.emitted_tokens(prop.tokens)
        where = seq_lens.long().unsqueeze(1) + cols
        keep = cols < (res.num_accepted.long() + 1).unsqueeze(1)
        tokens.scatter_(1, where, torch.where(keep, new, tokens.gather(1, where)))
        seq_lens.add_((res.num_accepted + 1).to(torch.int32))
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default="chain:4")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = load_model(os.path.join(ASSETS, "target"), dtype=torch.float32)
    draft = load_model(os.path.join(ASSETS, "draft"), dtype=torch.float32)
    T = DraftModelDrafter(draft, args.tree).max_nodes
    rows = {}
    with torch.inference_mode(), specdec.value_checks(False):
        cache = target.new_cache(1, args.context + 64)
        cache.lens.fill_(args.context)
        for t in (1, T):
            rows[f"target forward, {t} token(s), eager"] = forward_ms(target, cache, t, args.steps)
        rows["step, eager"] = median_ms(make_step(target, draft, args.tree, args.context, args.steps), args.steps)
        target.compile_cached()
        draft.compile_cached()
        rows["step, each cached forward compiled"] = median_ms(
            make_step(target, draft, args.tree, args.context, args.steps), args.steps)
        for t in (1, T):
            rows[f"target forward, {t} token(s), compiled"] = forward_ms(target, cache, t, args.steps)
        target.compile_cached(False)
        draft.compile_cached(False)
        whole = compile_static(make_step(target, draft, args.tree, args.context, args.steps))
        t0 = time.perf_counter()
        whole()
        compile_s = time.perf_counter() - t0
        rows["step, compiled as one graph"] = median_ms(whole, args.steps)
    info = machine_info(torch.device("cpu"))
    result = {"machine": info, "tree": args.tree, "context": args.context, "whole_step_compile_s": compile_s,
              "median_ms": {k: round(v, 3) for k, v in rows.items()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# One speculative step ({args.tree}, context {args.context}, greedy, one request)", "",
             f"{info['date']}, commit {info['git_commit'][:7]}, {info['cpu']} ({info['cpu_count']} cores, torch "
             f"threads 1), torch {info['torch']}; median of {args.steps}; the whole-step graph compiled in "
             f"{compile_s:.1f} s.", "", "| what | ms |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in rows.items()]
    with open(os.path.join(args.out, "step.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
