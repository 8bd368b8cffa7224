"""Adaptive speculation against fixed draft lengths and plain decoding, over batch sizes (the goal: never slower
than the better of AR and the best fixed setting).

    python -m bench.adaptive [--batches 1,2,4,8,16] [--max-new-tokens 96] [--out bench/results]

Same run, same prompts (held-out stdlib files), greedy, one thread: at each batch size, the draft model at
chain:2/4/6 and adaptive (chain:8, adaptive=True), prompt lookup at chain:8 and adaptive, and on prompts whose
text does not repeat (random bytes) prompt lookup fixed and adaptive, each against our batched AR. A config's
passes alternate with AR's (AR, config, AR, config, ...: this machine's speed drifts by 5-10% over minutes, and
a ratio of passes minutes apart would measure the drift), and a row is the best of its --repeats passes against
the best of the AR passes between them (other work only slows a pass), and the median of the passes' ratios to
the AR pass before each. Writes adaptive.md / adaptive.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics

import torch

import specdec
from specdec.loop.decoding import SpeculativeDecoder
from specdec.loop.drafters import DraftModelDrafter, NgramDrafter
from specdec.loop.models.hf import load_model
from specdec.loop.models.tokenizer import ByteTokenizer

from .e2e import ASSETS, RESULTS, held_out_prompts, machine

FIXED = ("chain:2", "chain:4", "chain:6")


def timed_against_ar(decoder, ar, prompts, max_new, repeats):
    """(tokens, best tokens/s, depth_chosen, AR's best tokens/s, AR's tokens, the median over passes of a pass's
    tokens/s over the AR pass's before it) of batched generate calls, the decoder's passes alternating with AR's."""
    for d in (ar, decoder):
        d.generate(prompts, 8)  # warm-up (and the adaptive policy's start-up measurement)
    best, ar_best, tokens, chosen, paired = 0.0, 0.0, None, None, []
    for _ in range(repeats):
        ar_out = ar.generate(prompts, max_new)
        ar_rate = ar_out.summary["new_tokens"] / ar_out.summary["wall_s"]
        ar_best = max(ar_best, ar_rate)
        out = decoder.generate(prompts, max_new)
        rate = out.summary["new_tokens"] / out.summary["wall_s"]
        paired.append(rate / ar_rate)
        if rate > best:
            best, tokens, chosen = rate, out.tokens, out.summary.get("depth_chosen")
    return tokens, best, chosen, ar_best, ar_out.tokens, statistics.median(paired)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    specdec.set_value_checks(False)
    target, draft = load_model(os.path.join(ASSETS, "target")), load_model(os.path.join(ASSETS, "draft"))
    tok = ByteTokenizer()
    batches = [int(b) for b in args.batches.split(",")]
    texts = held_out_prompts(max(batches), 300)
    rng = random.Random(0)
    noise = ["".join(chr(rng.randrange(33, 127)) for _ in range(300)) for _ in range(max(batches))]
    rows = []
    for B in batches:
        for kind, pool in (("stdlib", texts), ("random bytes", noise)):
            prompts = [tok.encode(t) for t in (pool * B)[:B]]
            ar_decoder = SpeculativeDecoder(target)
            configs = [("prompt lookup chain:8", NgramDrafter(8), False), ("prompt lookup auto", NgramDrafter(8), True)]
            if kind == "stdlib":
                configs = [(f"draft {t}", DraftModelDrafter(draft, t), False) for t in FIXED] + [
                    ("draft auto", DraftModelDrafter(draft, "chain:8"), True)] + configs
            for name, drafter, adaptive in configs:
                tokens, rate, chosen, ar, ar_tokens, paired = timed_against_ar(
                    SpeculativeDecoder(target, drafter, adaptive=adaptive), ar_decoder, prompts, args.max_new_tokens,
                    args.repeats)
                rows.append({"batch": B, "prompts": kind, "config": name, "tokens_per_s": rate, "ar_tokens_per_s": ar,
                             "speedup": rate / ar, "paired_median": paired, "identical": tokens == ar_tokens,
                             "depth_chosen": chosen})
                print(f"B={B:2d} {kind:12s} {name:22s} {rate:7.1f} tok/s  {rate / ar:.2f}x AR  (paired median "
                      f"{paired:.2f}x)  {chosen or ''}", flush=True)
    res = {"machine": machine(), "config": vars(args), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "adaptive.json"), "w") as f:
        json.dump(res, f, indent=2)
    m = res["machine"]
    lines = ["# Adaptive speculation vs fixed draft lengths, by batch size", "",
             f"{m['date']}, commit {m['git_commit'][:7]}, {m['cpu']} ({m['cpu_count']} cores, torch threads "
             f"{m['torch_threads']}), torch {m['torch']}. Shipped pair, greedy, {args.max_new_tokens} new tokens, "
             f"held-out stdlib prompts (or 300 random printable bytes), batched; best of {args.repeats} passes, "
             "alternating with as many of our batched AR, against the best of those (AR tokens/s); paired median: "
             "the median over the passes of a pass's tokens/s over the AR pass's just before it (less sensitive to "
             "one lucky pass). Depth chosen: steps per draft depth 0..8 in the best pass.", "",
             "| batch | prompts | config | tokens/s | AR tokens/s | speedup vs AR | paired median | identical to AR "
             "| depth chosen |",
             "|---:|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prompts']} | {r['config']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ar_tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['paired_median']:.2f}x | {'yes' if r['identical'] else 'NO'} | "
                     f"{r['depth_chosen'] or '-'} |")
    with open(os.path.join(args.out, "adaptive.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
