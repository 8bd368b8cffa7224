"""Where one speculative step's time goes, and what compiling the whole step (not each forward) buys.

    python -m bench.step [--tree chain:4] [--context 300] [--steps 40] [--out DIR]

On the shipped pair, one request, one thread, greedy, value checks off: the median time of
  * the target's cached forward over 1 token (an AR step's model work) and over the tree's T tokens, eager and
    compiled;
  * one step of the loop (SpeculativeDecoder._step: propose, the target's forward, accept, both rollbacks, the
    token bookkeeping), eager and compiled as ONE torch.compile(fullgraph=True) graph (compile=True): that it
    compiles at all shows the step has no host sync (a host read breaks a fullgraph trace).
Writes step.json / step.md under --out (bench/results by default).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import specdec
from specdec.loop.decoding import SpeculativeDecoder
from specdec.loop.drafters import DraftModelDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.llama import chain_tree

from .timing import machine_info

ASSETS = os.path.join(os.path.dirname(specdec.__file__), "loop", "assets")
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


def forward_ms(target, cache, t: int, n: int, batch: int = 1) -> float:
    """Median ms of the target's cached forward over a t-token chain per request."""
    info = chain_tree(batch, t)
    toks = torch.zeros(batch, t, dtype=torch.long)
    return median_ms(lambda: target.forward_cached(toks, cache, info.depth, info.mask), n)


def make_step(target, draft, tree: str, context: int, steps: int, compiled: bool):
    """A fresh decoding state (random prompt of `context` tokens) and a function running one step of the loop
    (SpeculativeDecoder._step, or with compiled its one-graph form, _CompiledSteps.whole_step)."""
    decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), compile=compiled)
    prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    s = decoder._start([prompt], (steps + 5) * decoder.drafter.max_nodes, 0.0, 0, top_k=0, top_p=1.0, min_p=0.0,
                       allowed_token_ids=None)
    run = decoder.steps.whole_step if compiled else decoder._step

    def step():
        decoder.drafter.advance(None)
        run(s, None)
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
        rows["step, eager"] = median_ms(make_step(target, draft, args.tree, args.context, args.steps, False), args.steps)
        target.compile_cached()
        for t in (1, T):
            rows[f"target forward, {t} token(s), compiled"] = forward_ms(target, cache, t, args.steps)
        target.compile_cached(False)
        whole = make_step(target, draft, args.tree, args.context, args.steps, True)
        t0 = time.perf_counter()
        whole()
        compile_s = time.perf_counter() - t0
        rows["step, compiled as one graph (compile=True)"] = median_ms(whole, args.steps)
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
