"""A/B of adaptive-speculation policies against fixed chains and our AR, in one process, on this machine.

    python scripts/ab_policy.py --drafter mtp --temperature 0.8 --passes 6 fixed4 auto old=/tmp/adaptive_old.py

Variants: `fixedK` (a fixed chain of K), `auto` (the checkout's policy), `NAME=FILE` (the AdaptiveDepth of another
version of specdec/loop/adaptive.py, e.g. `git show REV:specdec/loop/adaptive.py > FILE`, run inside this checkout's loop:
its calls must fit this checkout's, e.g. prompt lookup's `judged` takes three lists since ef3763e).
Our AR always runs. Each pass runs every variant once, in a new shuffled order, over the same prompts (at batch 1,
one request at a time); the report gives each variant's best pass against AR's best, and the median over the passes
of its ratio to AR's pass of the same round. This machine's speed drifts by 5-20% over minutes: policy changes
worth a few percent need 16 prompts and 6-8 passes, and a second run, before they are believed.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import specdec  # noqa: E402
from bench.e2e import ASSETS, held_out_prompts  # noqa: E402
from specdec.loop.decoding import SpeculativeDecoder  # noqa: E402
from specdec.loop.drafters import DraftModelDrafter, MTPDrafter, NgramDrafter  # noqa: E402
from specdec.loop.models.hf import load_model  # noqa: E402
from specdec.loop.models.mtp import load_mtp  # noqa: E402
from specdec.loop.models.tokenizer import ByteTokenizer  # noqa: E402


def policy_module(name: str, path: str):
    """Another version of specdec/loop/adaptive.py, imported as a module of the specdec.loop package (its relative
    imports resolve to this checkout's)."""
    spec = importlib.util.spec_from_file_location(f"specdec.loop.adaptive_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--drafter", choices=["draft", "mtp", "lookup"], default="draft")
    ap.add_argument("--prompts", choices=["stdlib", "random"], default="stdlib")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=16, help="prompts per pass at batch 1")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-depth", type=int, default=8, help="the adaptive variants' deepest chain")
    args = ap.parse_args()
    torch.set_num_threads(1)
    specdec.set_value_checks(False)

    target = load_model(os.path.join(ASSETS, "target"))
    draft = load_model(os.path.join(ASSETS, "draft")) if args.drafter == "draft" else None
    mtp = load_mtp(os.path.join(ASSETS, "mtp"), target.cfg) if args.drafter == "mtp" else None
    rng = random.Random(0)
    texts = held_out_prompts(16, 300) if args.prompts == "stdlib" else \
        ["".join(chr(rng.randrange(33, 127)) for _ in range(300)) for _ in range(16)]
    prompts = [ByteTokenizer().encode(t) for t in texts]
    batches = [prompts[i:i + 1] for i in range(args.requests)] if args.batch == 1 else \
        [(prompts * args.batch)[:args.batch]]

    def drafter(depth):
        if args.drafter == "draft":
            return DraftModelDrafter(draft, f"chain:{depth}")
        if args.drafter == "mtp":
            return MTPDrafter(target, mtp, f"chain:{depth}")
        return NgramDrafter(depth)

    decoders = {"AR": SpeculativeDecoder(target)}
    for variant in args.variants:
        if variant.startswith("fixed"):
            decoders[variant] = SpeculativeDecoder(target, drafter(int(variant[5:])))
            continue
        decoder = SpeculativeDecoder(target, drafter(args.max_depth), adaptive=True)
        if variant != "auto":
            name, path = variant.split("=", 1)
            module = policy_module(name, path)

            def policy(batch_size, max_depth, device, decoder=decoder, module=module):
                costs = module.measure_target_costs(target, batch_size, max_depth + 1)
                decoder._policy = module.AdaptiveDepth(batch_size, max_depth, costs,
                                                       previous=getattr(decoder, "_policy", None))
                return decoder._policy

            decoder.adaptive, variant = policy, name
        decoders[variant] = decoder
    for decoder in decoders.values():  # warm-up
        decoder.generate(batches[0], 8, temperature=args.temperature)

    rates = {name: [] for name in decoders}
    steps = {name: [] for name in decoders}
    order = list(decoders)
    for rep in range(args.passes):
        random.Random(rep).shuffle(order)
        for name in order:
            tokens = wall = n_steps = 0
            for i, batch in enumerate(batches):
                out = decoders[name].generate(batch, args.max_new_tokens, temperature=args.temperature,
                                              seed=100 * rep + i)
                tokens += out.summary["new_tokens"]
                wall += out.summary["wall_s"]
                n_steps += out.summary["steps"]
            rates[name].append(tokens / wall)
            steps[name].append(n_steps)
    ar = np.array(rates["AR"])
    print(f"batch {args.batch}, {args.prompts}, {args.drafter}, T={args.temperature}, {args.passes} passes")
    for name, r in rates.items():
        r = np.array(r)
        print(f"{name:>10}  best {r.max():7.1f} tokens/s  {r.max() / ar.max():.3f}x AR  "
              f"paired median {np.median(r / ar):.3f}x  steps {int(np.median(steps[name]))}")


if __name__ == "__main__":
    main()
