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
    batched = ["ours AR", "ours spec chain:4", "ours spec chain:8", "ours parallel chain:6", "ours parallel chain:8",
               "ours parallel chain:12"]
    sampled = ["ours AR", "ours spec chain:4", "ours spec chain:6", "ours parallel chain:3", "ours parallel chain:4",
               "ours parallel tree:2,1,1", "ours parallel tree:2,2,1,1"]
    return ours, batched, sampled


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallel", default=os.path.join(e2e.ASSETS, "parallel"))
    ap.add_argument("--out", default=e2e.RESULTS)
    args, rest = ap.parse_known_args(argv)
    e2e.OURS, e2e.BATCHED, e2e.SAMPLED = rows(args.parallel)
    e2e.MTP_ROWS, e2e.FILTERED, e2e.EAGER = [], [], []
    e2e.PLOTTED = ["ours spec chain:8", "ours parallel chain:4", "ours parallel chain:8"]
    with tempfile.TemporaryDirectory() as tmp:
        e2e.main(rest + ["--no-transformers", "--mtp", "", "--out", tmp])
        for name in os.listdir(tmp):
            path = os.path.join(args.out, name.replace("e2e", "parallel", 1))
            shutil.copy(os.path.join(tmp, name), path)
            if name.endswith(".md"):  # (its plot's new name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace("(e2e-acceptance.png)", "(parallel-acceptance.png)"))


if __name__ == "__main__":
    main()
