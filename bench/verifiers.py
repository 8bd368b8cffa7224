"""Verifiers end to end: token-wise against block and traversal verification (accept(method=...)) on the
shipped pair.

    python -m bench.verifiers [--prompts 8] [--seeds 2] [--max-new-tokens 64] [--out DIR]

For each draft shape (chain:4, chain:6: token, block, traversal; tree:2,2,1: token, traversal; a dynamic tree
has given proposals, which neither verifier takes) and temperature (0.6, 0.8, 1.0), the same held-out prompts
and seeds (one batch of prompts x seeds). Reports per method the tokens per target step (tau), the batch's
tokens/s, the acceptance rate by depth, and the gain of each method over token in tau: the mean over the
(prompt, seed) requests of the per-request difference, with a 95% confidence interval (t distribution). The
methods sample different texts from the same law, so a request's runs are paired by prompt and seed only.
Writes verifiers.json and verifiers.md under bench/results/, and the same table as the "Verifiers" section
of e2e.md there.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from scipy import stats

from specdec.loop.decoding import SpeculativeDecoder
from specdec.loop.drafters import DraftModelDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.tokenizer import ByteTokenizer

from .e2e import ASSETS, RESULTS, held_out_prompts, machine

TREES = {"chain:4": ("token", "block", "traversal"), "chain:6": ("token", "block", "traversal"),
         "tree:2,2,1": ("token", "traversal")}
TEMPERATURES = (0.6, 0.8, 1.0)
SECTION = "## Verifiers (bench.verifiers)"


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
    for tree, methods in TREES.items():
        for t in TEMPERATURES:
            runs = {}
            for method in methods:
                decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), method=method)
                decoder.generate(prompts[:1], 4, t, seed=0)  # warm-up
                start = time.perf_counter()
                out = decoder.generate(prompts, args.max_new_tokens, t, seed=seeds)
                runs[method] = dict(wall_s=time.perf_counter() - start, summary=out.summary,
                                    tau=[s["tokens_per_step"] for s in out.stats])
            for method, run in runs.items():
                gain, half = mean_ci([b - a for a, b in zip(runs["token"]["tau"], run["tau"])])
                rows.append(dict(tree=tree, temperature=t, method=method, requests=len(prompts),
                                 tau=run["summary"]["tokens_per_step"], tokens_per_s=run["summary"]["tokens_per_s"],
                                 acceptance_by_depth=run["summary"]["acceptance_by_depth"],
                                 acceptance_rate_by_depth=run["summary"]["acceptance_rate_by_depth"],
                                 gain_tau=None if method == "token" else gain,
                                 gain_tau_ci95=None if method == "token" else half))
                print(f"{tree} T={t} {method}: tau {rows[-1]['tau']:.3f}, gain {gain:+.3f} +- {half:.3f}", flush=True)
    res = dict(machine=machine(), date=time.strftime("%Y-%m-%d %H:%M:%S"), prompts=args.prompts, seeds=args.seeds,
               max_new_tokens=args.max_new_tokens, threads=args.threads, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "verifiers.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "verifiers.md"), "w") as f:
        f.write(markdown(res))
    replace_section(os.path.join(args.out, "e2e.md"), SECTION, markdown(res, heading=SECTION))
    print(markdown(res))


def replace_section(path: str, heading: str, text: str) -> None:
    """Put `text` (starting with `heading`) in the markdown file at path, in place of the section of that heading
    (up to the next "## " heading), or at its end."""
    old = open(path).read() if os.path.exists(path) else ""
    start = old.find(heading)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text if old else text
    else:
        end = old.find("\n## ", start + len(heading))
        new = old[:start] + text + ("" if end < 0 else "\n" + old[end + 1:])
    with open(path, "w") as f:
        f.write(new)


def markdown(res: dict, heading: str = "# Verifiers: token-wise, block and traversal verification") -> str:
    m = res["machine"]
    lines = [f"{heading} ({res['date']})", "",
             f"Shipped pair, {res['prompts']} held-out prompts x {res['seeds']} seeds in one batch, "
             f"{res['max_new_tokens']} new tokens, {res['threads']} thread(s). Machine: {json.dumps(m)}", "",
             "tau = tokens per target step; tokens/s = the batch's (one run each: noisy); gain = mean per-request "
             "tau(method) - tau(token) with its 95% CI; acceptance rate by depth d = of the steps that judged a "
             "draft token at depth d, the fraction accepting one (a tree judges several candidates there); "
             "acceptance by depth d = the fraction of steps accepting >= d draft tokens.", "",
             "| tree | T | method | tau | gain over token (95% CI) | tokens/s | acceptance rate by depth | "
             "acceptance by depth |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        gain = "-" if r["gain_tau"] is None else f"{r['gain_tau']:+.3f} +- {r['gain_tau_ci95']:.3f}"
        depth = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"])
        rate = " ".join("-" if a is None else f"{a:.2f}" for a in r.get("acceptance_rate_by_depth") or []) or "-"
        lines.append(f"| {r['tree']} | {r['temperature']} | {r['method']} | {r['tau']:.3f} | {gain} | "
                     f"{r['tokens_per_s']:.1f} | {rate} | {depth} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
