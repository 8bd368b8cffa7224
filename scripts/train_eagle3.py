"""Train an EAGLE-3 head (specdec/loop/models/eagle3.py) on the frozen shipped target, with train_mtp.py's loop.

The head sees the target's residual streams entering layers --aux-layers (vLLM's default (2, L // 2, L - 3) names
the same layer twice for the shipped 6-layer target: the default here is low, middle and the last layer's output)
at position j, fused by fc, and the embedding of token j+1, and is trained with cross-entropy on token j+2; with
--depth D > 1 the loss also covers D - 1 more steps on its own output (EAGLE-3's training-time test, each step
causal over its own inputs as train_mtp.py's). The draft vocabulary is the whole byte vocabulary (d2t = 0), the
embedding the target's; lm_head and the final norm start as the target's LM head and final norm (its rows of the
draft vocabulary), the rest as train_mtp.py's module (--no-target-head: lm_head from random too). Checkpoints are written in the EAGLE authors' layout (save_eagle3); the log reports, on
held-out windows, each step's cross-entropy and how often its argmax equals the target's own argmax.

    nice -n 5 python scripts/train_eagle3.py --minutes 25 --depth 3 > scripts/train_eagle3.log
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from specdec.loop.models.eagle3 import Eagle3, save_eagle3  # noqa: E402
from train_mtp import ASSETS, init_weights, parser, setup, train  # noqa: E402


def main():
    ap = parser("an EAGLE-3 head", os.path.join(ASSETS, "eagle3"))
    ap.add_argument("--aux-layers", default="1,3,6", help="target layers whose entering streams fc reads")
    ap.add_argument("--no-target-head", action="store_true", help="lm_head and norm from random, not the target's")
    args = ap.parse_args()
    target, train_bytes, held, rng = setup(args)
    aux = tuple(int(i) for i in args.aux_layers.split(","))
    head = Eagle3(dataclasses.replace(target.cfg, n_layers=1), target_dim=target.cfg.dim, aux_layers=aux)
    init_weights(head)
    if not args.no_target_head:
        with torch.no_grad():
            head.lm_head.weight.copy_(target.output_weight[head.target_ids()])
            head.norm.weight.copy_(target.model.norm.weight)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"# train_eagle3: {n_params / 1e6:.2f}M params, aux layers {aux} (target {args.target} frozen, "
          f"{target.num_params() / 1e6:.2f}M), loss over {args.depth} step(s)", flush=True)
    train(args, target, head, train_bytes, held, rng, save_eagle3, return_hidden=aux)


if __name__ == "__main__":
    main()
