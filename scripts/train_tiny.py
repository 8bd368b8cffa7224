"""Train the shipped byte-level model pair (specdec/loop/assets/{target,draft}) on the Python standard library.

The corpus is every .py file under the running interpreter's stdlib (site-packages excluded), so any
machine can rerun this offline. Files whose path hashes to 0 mod 50 are held out; the log reports the
held-out bits per byte. Training stops on a wall-clock budget with a cosine learning-rate decay over
that budget, checkpointing (HF-format folder, fp16 safetensors) every few minutes, so a usable model
exists at any time. Matmuls run in bf16 autocast (fp32 master weights); evaluation runs in fp32.

    python scripts/train_tiny.py --which draft --minutes 12
    python scripts/train_tiny.py --which target --deadline 05:20      # UTC
    python scripts/train_tiny.py --which draft --resume --lr 1e-3 --deadline 05:18
"""
from __future__ import annotations

import argparse
import datetime as dt
import glob
import math
import os
import sys
import sysconfig
import time
import zlib

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from specdec.loop.models.hf import load_model, save_model  # noqa: E402
from specdec.loop.models.llama import Llama, LlamaConfig  # noqa: E402
from specdec.loop.models.tokenizer import BOS, EOS, VOCAB_SIZE  # noqa: E402

CONFIGS = {
    # ~9.6M parameters: the target's fp32 weights (38 MB) do not fit in the CPU's caches
    "target": LlamaConfig(vocab_size=VOCAB_SIZE, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, intermediate_size=1024,
                          tie_embeddings=False, bos_token_id=BOS, eos_token_id=EOS),
    # ~0.85M parameters, about a tenth of the target
    "draft": LlamaConfig(vocab_size=VOCAB_SIZE, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=384,
                         tie_embeddings=True, bos_token_id=BOS, eos_token_id=EOS),
}
LR = {"target": 2e-3, "draft": 3e-3}
HOLDOUT_MOD = 50


def corpus() -> tuple[np.ndarray, np.ndarray, int, int]:
    """(train, held-out) token streams: BOS + file bytes + EOS per file, in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and "dist-packages" not in p)
    train, held = [], []
    for p in paths:
        rel = os.path.relpath(p, root)
        with open(p, "rb") as f:
            data = f.read()
        toks = np.concatenate([[BOS], np.frombuffer(data, dtype=np.uint8), [EOS]]).astype(np.int16)
        (held if zlib.crc32(rel.encode()) % HOLDOUT_MOD == 0 else train).append(toks)
    return np.concatenate(train), np.concatenate(held), len(paths), root


def init_weights(model: Llama) -> None:
    std = 0.02
    for name, p in model.named_parameters():
        if p.dim() == 1:
            continue  # norms keep 1
        scale = std / math.sqrt(2 * model.cfg.n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        torch.nn.init.normal_(p, 0.0, scale)


@torch.no_grad()
def held_out_bpb(model: Llama, held: np.ndarray, seq_len: int, windows: int = 32) -> float:
    """Bits per byte on `windows` evenly spaced held-out windows (deterministic)."""
    model.eval()
    starts = np.linspace(0, len(held) - seq_len - 2, windows).astype(np.int64)
    total = 0.0
    for s in starts:
        x = torch.from_numpy(held[s: s + seq_len + 1].astype(np.int64)).unsqueeze(0)
        total += F.cross_entropy(model(x[:, :-1])[0], x[0, 1:], reduction="sum").item()
    model.train()
    return total / (windows * seq_len) / math.log(2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--which", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--minutes", type=float, help="training budget in minutes")
    ap.add_argument("--deadline", help="UTC HH:MM to stop at (instead of --minutes)")
    ap.add_argument("--out", help="checkpoint folder (default specdec/loop/assets/<which>)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint-minutes", type=float, default=6.0)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (timing runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out (fresh optimizer)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default per model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = args.out or os.path.join(os.path.dirname(__file__), "..", "specdec", "loop", "assets", args.which)

    now = time.time()
    if args.deadline:
        hh, mm = map(int, args.deadline.split(":"))
        utc = dt.datetime.now(dt.timezone.utc)
        end = utc.replace(hour=hh, minute=mm, second=0, microsecond=0)
        budget = (end - utc).total_seconds()
    else:
        budget = 60 * (args.minutes or 10)
    if budget <= 0:
        raise SystemExit(f"deadline {args.deadline} UTC already passed")

    train, held, n_files, root = corpus()
    cfg = CONFIGS[args.which]
    if args.resume:
        model = load_model(out).train()
        assert model.cfg.to_dict() == cfg.to_dict(), "checkpoint config differs from CONFIGS"
    else:
        model = Llama(cfg)
        init_weights(model)
    print(f"# train_tiny {args.which}: {model.num_params() / 1e6:.2f}M params, config {cfg.to_dict()}"
          f"{', resumed from ' + out if args.resume else ''}", flush=True)
    print(f"# corpus {root}: {n_files} files, train {len(train) / 1e6:.2f}M bytes, held-out {len(held) / 1e6:.2f}M "
          f"bytes (crc32(path) % {HOLDOUT_MOD} == 0); budget {budget / 60:.1f} min, batch {args.batch} x "
          f"{args.seq_len}, torch {torch.__version__}, {args.threads} thread(s)", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr or LR[args.which], betas=(0.9, 0.95), eps=1e-8)
    warmup, base_lr = 100, args.lr or LR[args.which]
    print(f"# step  minutes  lr  train_loss(nats/byte, mean of last 50)  tokens/s", flush=True)
    step, losses, t0, last_ckpt = 0, [], time.time(), time.time()
    tokens_per_step = args.batch * args.seq_len

    def checkpoint(final=False):
        bpb = held_out_bpb(model, held, args.seq_len)
        save_model(model, out)
        tag = "final" if final else "checkpoint"
        print(f"# {tag} step {step} at {(time.time() - t0) / 60:.1f} min ({step * tokens_per_step / 1e6:.1f}M tokens): "
              f"held-out {bpb:.4f} bits/byte -> {out}", flush=True)

    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0 or (args.max_steps is not None and step >= args.max_steps):
            break
        lr = base_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train) - args.seq_len - 1, args.batch)
        batch = torch.from_numpy(np.stack([train[s: s + args.seq_len + 1] for s in starts]).astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16):  # AMX/AVX512-bf16 matmuls: ~2.5x faster than fp32
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0 or step == 1:
            el = time.time() - t0
            print(f"{step:6d} {el / 60:7.2f} {lr:.2e} {np.mean(losses[-50:]):.4f} {step * tokens_per_step / el:7.0f}",
                  flush=True)
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes:
            checkpoint()
            last_ckpt = time.time()
    checkpoint(final=True)


if __name__ == "__main__":
    main()
