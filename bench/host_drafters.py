"""What the model-free drafters cost on the host: the time of each `propose` call (suffix decoding against
prompt lookup), and the tokens each step gets, on the shipped target.

    python -m bench.host_drafters [--prompt TEXT] [--max-new-tokens 256] [--calls 2] [--out DIR]

One request, one thread, greedy, eager. Each drafter decodes the prompt `--calls` times in a row with the same
drafter object: suffix decoding's global index holds the earlier calls' outputs from the second call on (the
same prompt again: its best case, so read the first call for a new request). Writes host_drafters.json / .md
under --out (bench/results by default).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

import specdec
from specdec.loop.decoding import SpeculativeDecoder
from specdec.loop.drafters import NgramDrafter, SuffixDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.tokenizer import load_tokenizer

from .timing import machine_info

ASSETS = os.path.join(os.path.dirname(specdec.__file__), "loop", "assets")
DEMO_PROMPT = "import unittest\n\n\nclass TestStack(unittest.TestCase):\n"


def measure(drafter, target, prompt_ids: list, max_new_tokens: int, calls: int) -> list[dict]:
    """One row per generate call: the propose calls' host time (mean, p90, max, in ms) and tokens per step."""
    times = []
    propose = drafter.propose

    def timed_propose(*args, **kwargs):
        start = time.perf_counter()
        proposal = propose(*args, **kwargs)
        times.append(time.perf_counter() - start)
        return proposal

    drafter.propose = timed_propose
    decoder = SpeculativeDecoder(target, drafter)
    rows = []
    for call in range(calls):
        times.clear()
        out = decoder.generate([prompt_ids], max_new_tokens)
        ms = np.array(times) * 1e3
        rows.append({"call": call + 1, "proposals": len(ms), "propose_ms_mean": float(ms.mean()),
                     "propose_ms_p90": float(np.percentile(ms, 90)), "propose_ms_max": float(ms.max()),
                     "tokens_per_step": out.summary["tokens_per_step"]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt (default: make demo's)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = load_model(os.path.join(ASSETS, "target"))
    prompt_ids = load_tokenizer(os.path.join(ASSETS, "target"), target.cfg.vocab_size).encode(args.prompt)
    drafters = {"suffix decoding (16 nodes, depth 8)": SuffixDrafter(max_depth=8, max_tokens=16),
                "prompt lookup (8 tokens)": NgramDrafter(num_tokens=8)}
    result = {"meta": machine_info(torch.device("cpu")), "args": vars(args),
              "rows": {name: measure(d, target, prompt_ids, args.max_new_tokens, args.calls)
                       for name, d in drafters.items()}}
    lines = ["# Host cost of the model-free drafters: time per propose call, tokens per step", "",
             f"- {result['meta']['date']}, {result['meta']['cpu']}, torch {result['meta']['torch']}, one thread; "
             f"shipped target, one request, greedy, eager, {args.max_new_tokens} new tokens, "
             f"`python -m bench.host_drafters`", "",
             "| drafter | call | proposals | propose ms mean | p90 | max | tokens/step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in result["rows"].items():
        for r in rows:
            lines.append(f"| {name} | {r['call']} | {r['proposals']} | {r['propose_ms_mean']:.3f} | "
                         f"{r['propose_ms_p90']:.3f} | {r['propose_ms_max']:.3f} | {r['tokens_per_step']:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_drafters.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "host_drafters.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
