"""Verifiers end to end: token-wise against block verification (accept(method=...)) on the shipped pair.

    python -m bench.verifiers [--prompts 8] [--seeds 2] [--max-new-tokens 64] [--out DIR]

For each chain (chain:4, chain:6) and temperature (0.6, 0.8, 1.0), the same held-out prompts and seeds (one
batch of prompts x seeds), verified token-wise and by block verification. Reports per method the tokens per
target step (tau) and the batch's tokens/s, the acceptance rate by depth, and the gain of block over token in
tau: the mean over the (prompt, seed) requests of the per-request difference, with a 95% confidence interval
(t distribution). The two methods sample different texts from the same law, so a request's two runs are
paired by prompt and seed only. Writes verifiers.json and verifiers.md under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from scipy import stats

from specdec.decoding import SpeculativeDecoder
from specdec.drafters import DraftModelDrafter
from specdec.models.hf import load_model
from specdec.models.tokenizer import ByteTokenizer

from .e2e import ASSETS, RESULTS, held_out_prompts, machine

TREES = ("chain:4", "chain:6")
TEMPERATURES = (0.6, 0.8, 1.0)
METHODS = ("token", "block")


def mean_ci(x: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval."""
    n = len(x)
    m = sum(x) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    return m, float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--draft", default=os.path.join(ASSETS, "draft"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--prompt-bytes", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_model(args.target), load_model(args.draft)
    tok = ByteTokenizer()
    texts = held_out_prompts(args.prompts, args.prompt_bytes)
    prompts = [tok.encode(p) for p in texts for _ in range(args.seeds)]
    seeds = [1000 * i + s for i in range(len(texts)) for s in range(args.seeds)]
    rows = []
    for tree in TREES:
        for t in TEMPERATURES:
            runs = {}
            for method in METHODS:
                decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), method=method)
                decoder.generate(prompts[:1], 4, t, seed=0)  # warm-up
                start = time.perf_counter()
                out = decoder.generate(prompts, args.max_new_tokens, t, seed=seeds)
                runs[method] = dict(wall_s=time.perf_counter() - start, summary=out.summary,
                                    tau=[s["tokens_per_step"] for s in out.stats])
            gain, half = mean_ci([b - a for a, b in zip(runs["token"]["tau"], runs["block"]["tau"])])
            row = dict(tree=tree, temperature=t, requests=len(prompts), gain_tau=gain, gain_tau_ci95=half)
            for method, run in runs.items():
                row[method] = dict(tau=run["summary"]["tokens_per_step"], tokens_per_s=run["summary"]["tokens_per_s"],
                                   acceptance_by_depth=run["summary"]["acceptance_by_depth"])
            rows.append(row)
            print(f"{tree} T={t}: tau token {row['token']['tau']:.3f} block {row['block']['tau']:.3f}, "
                  f"gain {gain:+.3f} +- {half:.3f}", flush=True)
    res = dict(machine=machine(), date=time.strftime("%Y-%m-%d %H:%M:%S"), prompts=args.prompts, seeds=args.seeds,
               max_new_tokens=args.max_new_tokens, threads=args.threads, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verifiers.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "verifiers.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# Verifiers: token-wise vs block verification ({res['date']})", "",
             f"Shipped pair, {res['prompts']} held-out prompts x {res['seeds']} seeds in one batch, "
             f"{res['max_new_tokens']} new tokens, {res['threads']} thread(s). Machine: {json.dumps(m)}", "",
             "tau = tokens per target step; tokens/s = the batch's; gain = mean per-request tau(block) - tau(token) "
             "with its 95% CI.", "",
             "| tree | T | tau token | tau block | gain (95% CI) | tokens/s token | tokens/s block | "
             "acceptance by depth, token | acceptance by depth, block |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        depth = {k: " ".join(f"{a:.2f}" for a in r[k]["acceptance_by_depth"]) for k in METHODS}
        lines.append(f"| {r['tree']} | {r['temperature']} | {r['token']['tau']:.3f} | {r['block']['tau']:.3f} | "
                     f"{r['gain_tau']:+.3f} +- {r['gain_tau_ci95']:.3f} | {r['token']['tokens_per_s']:.1f} | "
                     f"{r['block']['tokens_per_s']:.1f} | {depth['token']} | {depth['block']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
