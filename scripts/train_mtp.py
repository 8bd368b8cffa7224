"""Train the shipped MTP module (specdec/loop/assets/mtp) on the frozen shipped target (specdec/loop/assets/target).

DeepSeek-V3's MTP objective: the module sees the target's hidden state at position j (after its final norm)
and the embedding of token j+1, and is trained with cross-entropy on token j+2; the target (embedding, LM
head, layers) is frozen. With --depth D > 1 the loss also covers the module reused on its own output for
D - 1 more steps (token j+3, j+4, ...), which is how the drafter runs it past depth 1 (EAGLE-3's
training-time test in spirit: attention there sees the recycled steps' own keys, not the target-conditioned
cache). The corpus and the held-out split are train_tiny.py's (the stdlib .py files). Checkpoints are written
in DeepSeek-V3's layout (save_mtp). The log reports, on held-out windows, each step's cross-entropy and how
often its argmax equals the target's own argmax at that position (what greedy drafting needs).

    python scripts/train_mtp.py --minutes 25 --depth 3 > scripts/train_mtp.log
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from specdec.loop.models.hf import load_model  # noqa: E402
from specdec.loop.models.mtp import MTP, save_mtp  # noqa: E402
from train_tiny import corpus  # noqa: E402

ASSETS = os.path.join(os.path.dirname(__file__), "..", "specdec", "loop", "assets")


def init_weights(head: torch.nn.Module) -> None:
    for name, p in head.named_parameters():
        if p.dim() > 1:  # norms keep 1; residual projections start small (one layer: / sqrt(2))
            torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2) if name.endswith(("o_proj.weight", "down_proj.weight"))
                                  else 0.02)


def step_losses(target, head, batch, depth, return_hidden=True):
    """Each step's logits and labels over a batch of windows (B, T + 1): step k predicts tokens[j + k + 2]. head: a
    module called as head(target, target_hidden, tokens, depth) (MTP, EAGLE-3), on the target's hidden states of
    return_hidden (`Llama.forward`)."""
    with torch.no_grad():
        target_logits, hidden = target(batch, return_hidden=return_hidden)
    out = []
    for k, logits in enumerate(head(target, hidden, batch, depth)):
        out.append((logits[:, :-1].float(), batch[:, k + 2:], target_logits[:, k + 1:-1].argmax(-1)))
    return out


@torch.no_grad()
def evaluate(target, head, held, seq_len, depth, return_hidden=True, windows=32):
    """Per step: held-out cross-entropy (nats/byte) and agreement of its argmax with the target's."""
    head.eval()
    starts = np.linspace(0, len(held) - seq_len - 2, windows).astype(np.int64)
    batch = torch.from_numpy(np.stack([held[s: s + seq_len + 1] for s in starts]).astype(np.int64))
    res = []
    for chunk in batch.split(8):
        res.append([(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1)).item(),
                     (lg.argmax(-1) == t).float().mean().item())
                    for lg, y, t in step_losses(target, head, chunk, depth, return_hidden)])
    head.train()
    return np.mean(res, axis=0)  # (depth, 2)


def parser(what: str, out: str) -> argparse.ArgumentParser:
    """The options of a head's training run (what: its name in the help; out: the default output folder)."""
    ap = argparse.ArgumentParser(description=f"Train {what} on the frozen shipped target.")
    ap.add_argument("--minutes", type=float, default=25.0, help="training budget in minutes")
    ap.add_argument("--depth", type=int, default=3, help="unrolled steps in the loss (1: the head's first step only)")
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--out", default=out)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (timing runs)")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def setup(args):
    """Threads and seeds from args; returns (target frozen, train bytes, held-out bytes, numpy rng)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train, held, n_files, root = corpus()
    target = load_model(args.target).requires_grad_(False)
    args.corpus_note = (f"# corpus {root}: {n_files} files, train {len(train) / 1e6:.2f}M bytes, held-out "
                        f"{len(held) / 1e6:.2f}M bytes; budget {args.minutes:.1f} min, batch {args.batch} x "
                        f"{args.seq_len}, torch {torch.__version__}, {args.threads} thread(s)")
    return target, train, held, np.random.default_rng(args.seed)


def train(args, target, head, train_bytes, held, rng, save, return_hidden=True):
    """The training loop shared by the heads (initialized by the caller, `init_weights`): AdamW (no decay on norms),
    warmup then cosine to 10%, bf16 autocast, the mean of the steps' cross-entropies; held-out checkpoints every
    args.checkpoint_minutes written by save(head, folder)."""
    print(args.corpus_note, flush=True)
    budget = 60 * args.minutes
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = 50
    print("# step  minutes  lr  train_loss per step (nats/byte, mean of last 50)  tokens/s", flush=True)
    step, losses, t0, last_ckpt = 0, [], time.time(), time.time()
    tokens_per_step = args.batch * args.seq_len

    def checkpoint(final=False):
        ev = evaluate(target, head, held, args.seq_len, args.depth, return_hidden)
        save(head, args.out)
        per_step = "  ".join(f"step {k + 1}: ce {ce:.3f} agree {ag:.3f}" for k, (ce, ag) in enumerate(ev))
        print(f"# {'final' if final else 'checkpoint'} step {step} at {(time.time() - t0) / 60:.1f} min "
              f"({step * tokens_per_step / 1e6:.1f}M tokens): held-out {per_step} -> {args.out}", flush=True)

    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0 or (args.max_steps is not None and step >= args.max_steps):
            break
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train_bytes) - args.seq_len - 1, args.batch)
        batch = torch.from_numpy(np.stack([train_bytes[s: s + args.seq_len + 1] for s in starts]).astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            per = [F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1))
                   for lg, y, _ in step_losses(target, head, batch, args.depth, return_hidden)]
        loss = torch.stack(per).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append([x.item() for x in per])
        step += 1
        if step % 50 == 0 or step == 1:
            el = time.time() - t0
            mean = " ".join(f"{x:.4f}" for x in np.mean(losses[-50:], axis=0))
            print(f"{step:6d} {el / 60:7.2f} {lr:.2e} {mean} {step * tokens_per_step / el:7.0f}", flush=True)
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes:
            checkpoint()
            last_ckpt = time.time()
    checkpoint(final=True)


def main():
    args = parser("the MTP module", os.path.join(ASSETS, "mtp")).parse_args()
    target, train_bytes, held, rng = setup(args)
    mtp = MTP(target.cfg, 1)
    init_weights(mtp)
    n_params = sum(p.numel() for p in mtp.parameters())
    print(f"# train_mtp: 1 module, {n_params / 1e6:.2f}M params (target {args.target} frozen, "
          f"{target.num_params() / 1e6:.2f}M), loss over {args.depth} step(s)", flush=True)
    train(args, target, mtp, train_bytes, held, rng, save_mtp)


if __name__ == "__main__":
    main()
