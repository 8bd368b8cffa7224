"""Adaptive speculation's cold start: a first `--tree auto` call against the same decoder's warm calls, and both
against plain decoding, as a CLI user or a fresh server meets them.

    python -m bench.cold_start [--drafters ngram,model,mtp,suffix] [--batches 1,3,4] [--trials 3] [--out DIR]

Each trial is what `python -m specdec generate --tree auto --compare-ar --passes 3` does in a fresh process: fresh
decoders (a fresh drafter, no earlier policy, the target's costs unmeasured), the CLI's warm-up (4 tokens of the
first prompt through each decoder), then passes that alternate plain decoding and speculation, AR first:
AR, cold, AR, warm, AR, warm, AR. The cold pass is the first speculative pass, whose policy starts from its
drafter's prior (specdec.loop.adaptive.drafter_prior); a warm pass starts from what the passes before it learnt.
A pass's speedup is its tokens/s over the geometric mean of the AR passes on either side of it (this machine's
speed drifts, and other work on it slows single passes). Short code prompts that no other benchmark uses
(PROMPTS), greedy, 96 new tokens, batches of the first B prompts, one thread. A row: the median over trials of
the cold pass's speedup, its lowest, the median of the warm passes' best, and cold over warm. Goal: cold never
below 0.97x AR and at least 90% of warm. Writes cold_start.md / cold_start.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

import specdec
from specdec.loop import adaptive
from specdec.loop.cli import AUTO_TREE
from specdec.loop.decoding import SpeculativeDecoder
from specdec.loop.drafters import DraftModelDrafter, MTPDrafter, NgramDrafter, SuffixDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.mtp import load_mtp
from specdec.loop.models.tokenizer import load_tokenizer

from .e2e import ASSETS, RESULTS, forgetting, machine

# short code prompts, as a user would type them (the held-out stdlib files of the other benchmarks are 300 bytes)
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "def parse_args(argv):\n    parser = argparse.ArgumentParser("]
# drafter name -> a fresh drafter of the CLI's --tree auto over the loaded models m (a new kind: one more entry)
DRAFTERS = {
    "ngram": lambda m: NgramDrafter(num_tokens=AUTO_DEPTH),
    "model": lambda m: DraftModelDrafter(m["draft"], AUTO_TREE),
    "mtp": lambda m: MTPDrafter(m["target"], m["mtp"], AUTO_TREE),
    "suffix": lambda m: SuffixDrafter(max_depth=AUTO_DEPTH),
}
AUTO_DEPTH = int(AUTO_TREE.split(":")[1])


def timed(decoder, prompts: list, max_new: int, startup: list):
    """(output, tokens per wall second as the loop reports them, tokens per CPU second of the call): the CPU time
    without the adaptive policy's start-up (startup[0], added to by the decoder's policy factory), which the loop's
    clock does not count either."""
    before, cpu = startup[0], time.process_time()
    out = decoder.generate(prompts, max_new)
    cpu = time.process_time() - cpu - (startup[0] - before)
    return out, out.summary["new_tokens"] / out.summary["wall_s"], out.summary["new_tokens"] / cpu


def trial(m: dict, drafter_name: str, prompts: list, max_new: int, warm_passes: int) -> dict:
    """One fresh process's worth: the cold pass's and the warm passes' speedups over the AR passes around them, by
    wall time (as the loop reports) and by CPU time (this process's work alone: on a shared machine the wall time
    of a single pass also measures the other processes)."""
    adaptive._TARGET_COSTS.clear()  # (a fresh process has measured nothing)
    spec = SpeculativeDecoder(m["target"], DRAFTERS[drafter_name](m), adaptive=True)
    ar = SpeculativeDecoder(m["target"])
    startup, factory = [0.0], spec.adaptive

    def measured_factory(*args):
        t0 = time.process_time()
        policy = factory(*args)
        startup[0] += time.process_time() - t0
        return policy
    spec.adaptive = measured_factory
    for decoder in (spec, ar):  # the CLI's warm-up
        decoder.generate(prompts[:1], 4)
    ar_runs, spec_runs = [timed(ar, prompts, max_new, startup)], []
    for _ in range(1 + warm_passes):  # (suffix decoding: no memory of the same prompts' earlier outputs)
        spec_runs.append(timed(forgetting(spec), prompts, max_new, startup))
        ar_runs.append(timed(ar, prompts, max_new, startup))
    speedups = {clock: [s[i] / math.sqrt(a[i] * b[i]) for s, a, b in zip(spec_runs, ar_runs, ar_runs[1:])]
                for i, clock in ((1, "wall"), (2, "cpu"))}
    ar_tokens = ar_runs[0][0].tokens
    cold = spec_runs[0][0].summary
    return {**{f"{clock}_cold": x[0] for clock, x in speedups.items()},
            **{f"{clock}_warm": max(x[1:]) for clock, x in speedups.items()},
            "ar_tokens_per_s": statistics.median(r[1] for r in ar_runs), "cold_tau": cold["tokens_per_step"],
            "startup_s": startup[0], "cold_depth_chosen": cold["depth_chosen"],
            "warm_depth_chosen": spec_runs[-1][0].summary["depth_chosen"],
            "identical": all(s[0].tokens == ar_tokens for s in spec_runs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", default=",".join(DRAFTERS))
    ap.add_argument("--batches", default="1,3,4")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--warm-passes", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    specdec.set_value_checks(False)
    target = load_model(os.path.join(ASSETS, "target"))
    m = {"target": target, "draft": load_model(os.path.join(ASSETS, "draft")),
         "mtp": load_mtp(os.path.join(ASSETS, "mtp"), target.cfg)}
    tok = load_tokenizer(os.path.join(ASSETS, "target"), target.cfg.vocab_size)
    rows = []
    for name in args.drafters.split(","):
        for B in (int(b) for b in args.batches.split(",")):
            prompts = [tok.encode(p) for p in PROMPTS[:B]]
            trials = [trial(m, name, prompts, args.max_new_tokens, args.warm_passes) for _ in range(args.trials)]
            row = {"drafter": name, "batch": B}
            for clock in ("wall", "cpu"):
                cold = statistics.median(t[f"{clock}_cold"] for t in trials)
                warm = statistics.median(t[f"{clock}_warm"] for t in trials)
                row.update({f"{clock}_cold": cold, f"{clock}_cold_lowest": min(t[f"{clock}_cold"] for t in trials),
                            f"{clock}_warm": warm, f"{clock}_cold_over_warm": cold / warm})
            row.update(identical=all(t["identical"] for t in trials), trials=trials)
            rows.append(row)
            print(f"{name:7s} B={B}  " + "  ".join(
                f"{c}: cold {row[f'{c}_cold']:.2f}x (lowest {row[f'{c}_cold_lowest']:.2f}x) warm "
                f"{row[f'{c}_warm']:.2f}x cold/warm {row[f'{c}_cold_over_warm']:.2f}" for c in ("wall", "cpu"))
                + f"  {trials[0]['cold_depth_chosen']}", flush=True)
    res = {"machine": machine(), "config": vars(args), "prompts": PROMPTS, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cold_start.json"), "w") as f:
        json.dump(res, f, indent=2)
    mc = res["machine"]
    lines = ["# Adaptive speculation's cold start: the first --tree auto call against warm ones", "",
             f"{mc['date']}, commit {mc['git_commit'][:7]}, {mc['cpu']} ({mc['cpu_count']} cores, torch threads 1), "
             f"load average {mc['load_average'][0]:.2f}, torch {mc['torch']}. `python -m bench.cold_start "
             f"--drafters {args.drafters} --batches {args.batches} --trials {args.trials}`: per trial fresh "
             f"decoders, the CLI's warm-up, then AR, cold, AR, {', AR, '.join(['warm'] * args.warm_passes)}, AR "
             f"passes; greedy, {args.max_new_tokens} new tokens, {AUTO_TREE} adaptive (suffix decoding: its memory "
             "of earlier passes emptied before each, so that warm means the policy's learning alone). A pass's "
             "speedup: over the geometric mean of the AR passes beside it, by wall time (the loop's tokens/s) and by "
             "this process's CPU time (the machine is shared: a single pass's wall time also measures the other "
             "processes; the policy's start-up is left out of both). Cold: the median over trials (lowest in "
             "brackets); warm: the median of each trial's best warm pass. Goal: cold >= 0.97x and >= 90% of warm.",
             "",
             "Prompts (the first B of them): " + ", ".join(f"`{json.dumps(p)}`" for p in PROMPTS), "",
             "| drafter | batch | cold (CPU) | warm (CPU) | cold / warm (CPU) | cold (wall) | warm (wall) | "
             "cold / warm (wall) | cold tau | start-up s | AR tokens/s | identical | depth chosen, a cold pass "
             "(0..8) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        t = r["trials"][0]
        cells = [f"{r[f'{c}_cold']:.2f}x ({r[f'{c}_cold_lowest']:.2f}x) | {r[f'{c}_warm']:.2f}x | "
                 f"{r[f'{c}_cold_over_warm']:.2f}" for c in ("cpu", "wall")]
        median = {key: statistics.median(x[key] for x in r["trials"])
                  for key in ("cold_tau", "startup_s", "ar_tokens_per_s")}
        lines.append(f"| {r['drafter']} | {r['batch']} | {cells[0]} | {cells[1]} | {median['cold_tau']:.2f} | "
                     f"{median['startup_s']:.2f} | {median['ar_tokens_per_s']:.0f} | "
                     f"{'yes' if r['identical'] else 'NO'} | {t['cold_depth_chosen']} |")
    with open(os.path.join(args.out, "cold_start.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
