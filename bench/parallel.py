"""The parallel drafter (one forward drafts every level) against the draft model drafter and AR, end to end.

    python -m bench.parallel [--parallel DIR] [--repeats N] [--time-budget S]

bench.e2e's run on its prompts, machine record and table, with these rows: our AR, the draft model's chains (its
best eager rows in bench/results/e2e.md) and adaptive chain, and the parallel drafter's chains, trees and adaptive
chain (specdec/loop/assets/parallel); one request at a time and all prompts in one batch, greedy and sampled.
Writes parallel.json, parallel.md and parallel-acceptance.png under bench/results/.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile

from bench import e2e
from specdec.loop.drafters import DraftModelDrafter, NoDrafter, ParallelDrafter
from specdec.loop.models.hf import load_model

DRAFT_TREES = ("chain:4", "chain:6", "chain:8", "chain:12")
PARALLEL_TREES = ("chain:3", "chain:4", "chain:6", "chain:8", "chain:12", "tree:2,1,1", "tree:2,2,1,1")


def rows(parallel_dir: str):
    """(row name, decoder factory) for bench.e2e, and the row names of its batched and sampled runs."""
    parallel = functools.cache(lambda device: load_model(parallel_dir, device=device))

    def drafter(m, tree):
        return ParallelDrafter(parallel(m["target"].device), tree)
    ours = [("ours AR", e2e._decoder(lambda m: NoDrafter()))]
    ours += [(f"ours spec {t}", e2e._decoder(lambda m, t=t: DraftModelDrafter(m["draft"], t))) for t in DRAFT_TREES]
    ours += [("ours spec auto (chain:8, adaptive)",
              e2e._decoder(lambda m: DraftModelDrafter(m["draft"], "chain:8"), True))]
    ours += [(f"ours parallel {t}", e2e._decoder(lambda m, t=t: drafter(m, t))) for t in PARALLEL_TREES]
    ours += [("ours parallel auto (chain:8, adaptive)", e2e._decoder(lambda m: drafter(m, "chain:8"), True))]
    batched = ["ours AR", "ours spec chain:4", "ours spec chain:8", "ours parallel chain:4", "ours parallel chain:6",
               "ours parallel chain:8"]
    sampled = ["ours AR", "ours spec chain:4", "ours spec chain:6", "ours parallel chain:3", "ours parallel chain:4",
               "ours parallel tree:2,1,1", "ours parallel tree:2,2,1,1"]
    return ours, batched, sampled


def goal_table(rows: list) -> str:
    """Per way of running (one request at a time, the batch, sampled): the best tokens/s of the draft model's rows and
    of the parallel drafter's, and their ratio (the goal: the parallel drafter >= 1.2x the draft model's best)."""
    lines = ["| run | draft model best (tokens/s) | parallel drafter best (tokens/s) | ratio |", "|---|---|---|---:|"]
    for mode in dict.fromkeys(e2e.mode(r["method"]) for r in rows if not r.get("skipped")):
        best = {}
        for kind in ("ours spec", "ours parallel"):
            runs = [r for r in rows if r["method"].startswith(kind + " ") and e2e.mode(r["method"]) == mode]
            best[kind] = max(runs, key=lambda r: r["tokens_per_s"]) if runs else None
        spec, par = best["ours spec"], best["ours parallel"]
        if spec and par:
            lines.append(f"| {mode or 'one request at a time, greedy'} | {spec['tokens_per_s']:.1f} "
                         f"({spec['method']}) | {par['tokens_per_s']:.1f} ({par['method']}) | "
                         f"{par['tokens_per_s'] / spec['tokens_per_s']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallel", default=os.path.join(e2e.ASSETS, "parallel"))
    ap.add_argument("--out", default=e2e.RESULTS)
    args, rest = ap.parse_known_args(argv)
    e2e.OURS, e2e.BATCHED, e2e.SAMPLED = rows(args.parallel)
    e2e.MORE_ROWS, e2e.FILTERED, e2e.EAGER = [], [], []
    e2e.PLOTTED = ["ours spec chain:8", "ours parallel chain:4", "ours parallel chain:8"]
    with tempfile.TemporaryDirectory() as tmp:
        e2e.main(rest + ["--no-transformers", "--mtp", "", "--out", tmp])
        for name in os.listdir(tmp):
            shutil.copy(os.path.join(tmp, name), os.path.join(args.out, name.replace("e2e", "parallel", 1)))
        with open(os.path.join(tmp, "e2e.json")) as f:
            results = json.load(f)["rows"]
        with open(os.path.join(tmp, "e2e.md")) as f:
            text = f.read().replace("(e2e-acceptance.png)", "(parallel-acceptance.png)")
    with open(os.path.join(args.out, "parallel.md"), "w") as f:
        f.write(f"# The parallel drafter against the draft model (bench.parallel)\n\n{goal_table(results)}\n{text}")


if __name__ == "__main__":
    main()
