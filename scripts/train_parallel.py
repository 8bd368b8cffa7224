"""Train the shipped parallel drafter (specdec/loop/assets/parallel): the shipped draft model
(specdec/loop/assets/draft) taught to predict K tokens in one forward, PARD-style (arXiv 2504.18583), on the frozen shipped target.

The drafter reads the context x_0 .. x_j and then K - 1 mask tokens (one extra embedding row, id `mask_token_id` =
the target's vocabulary size) at positions j + 1 .. j + K - 1; the output at x_j predicts x_{j+1} (depth 1, the
draft model's own task), the one at mask i predicts x_{j+i+1} (depth i + 1). A training sequence holds a window's
real tokens and, per depth, a mask segment: one mask per anchor j kept at that depth, which sees the real tokens
x_0 .. x_j and the masks of lower depths of its own anchor (an attention mask over the whole sequence). PARD's
conditional drop-token keeps the cost linear in the window: depth d keeps a random RETAIN ** (d - 1) share of the
anchors, nested (an anchor kept at depth d is kept at every lower depth, whose masks its mask attends to).

The labels are the target's laws: depth d at anchor j learns the target's next-token distribution at position
j + d - 1 over the real window (cross-entropy against it, i.e. distillation; the target is frozen). The corpus and
the held-out split are train_tiny.py's. The log reports, on held-out windows, each depth's cross-entropy against
the target's law and how often its argmax equals the target's argmax at that position (what greedy drafting
needs), and the share of anchors whose depths 1 .. d all agree (a greedy chain accepting d tokens).

    nice -n 5 python scripts/train_parallel.py --minutes 35 > scripts/train_parallel.log
    nice -n 5 python scripts/train_parallel.py --minutes 20 --positions 12 --init specdec/loop/assets/parallel \
        >> scripts/train_parallel.log
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
from specdec.loop.drafters.parallel import add_mask_token  # noqa: E402
from specdec.loop.models.hf import load_model, save_model  # noqa: E402
from specdec.loop.models.llama import Llama  # noqa: E402
from train_tiny import corpus  # noqa: E402

ASSETS = os.path.join(os.path.dirname(__file__), "..", "specdec", "loop", "assets")


def layout(T: int, K: int, retain: float, gen: torch.Generator):
    """The training sequence of a window of T real tokens: anchor (N,) and depth index (N,) per element (depth
    index 0: the real token at the anchor; i >= 1: the anchor's mask i, which predicts depth i + 1), and the
    attention mask (N, N) bool (True: may attend)."""
    order = torch.randperm(T, generator=gen)
    anchors, depths = [torch.arange(T)], [torch.zeros(T, dtype=torch.long)]
    for i in range(1, K):
        kept = order[:max(1, int(round(T * retain ** i)))].sort().values
        kept = kept[kept + i < T]  # its label (the target's law at position anchor + i) lies in the window
        anchors.append(kept)
        depths.append(torch.full_like(kept, i))
    a, d = torch.cat(anchors), torch.cat(depths)
    real_before = (d.unsqueeze(0) == 0) & (a.unsqueeze(0) <= a.unsqueeze(1))
    own_masks = (d.unsqueeze(0) >= 1) & (a.unsqueeze(0) == a.unsqueeze(1)) & (d.unsqueeze(0) <= d.unsqueeze(1))
    return a, d, real_before | own_masks


def parallel_logits(model: Llama, real: torch.Tensor, anchor, depth, visible, mask_id: int, vocab: int):
    """Logits (B, N, vocab) of the layout's elements over windows real (B, T)."""
    B = real.shape[0]
    tokens = torch.where(depth == 0, real[:, anchor], mask_id)
    cos, sin = model.rope((anchor + depth).expand(B, -1))
    x = model.model.embed_tokens(tokens)
    for layer in model.model.layers:
        attn = layer.self_attn
        q, k, v = (t.transpose(1, 2) for t in attn.qkv(layer.input_layernorm(x), cos, sin))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(B, x.shape[1], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.head(x)[..., :vocab]


def depth_losses(target, model, real, lay, K, mask_id):
    """Per depth: (logits (B, n, V), the target's log-law there (B, n, V)) over windows real (B, T)."""
    anchor, depth, visible = lay
    V = target.cfg.vocab_size
    with torch.no_grad():
        teacher = torch.log_softmax(target(real).float(), dim=-1)  # position p: the law of token p + 1
    logits = parallel_logits(model, real, anchor, depth, visible, mask_id, V)
    return [(logits[:, depth == i].float(), teacher[:, anchor[depth == i] + i]) for i in range(K)]


def soft_ce(logits, teacher_logp):
    return -(teacher_logp.exp() * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


@torch.no_grad()
def evaluate(target, model, held, seq_len, K, mask_id, windows=32):
    """Per depth: held-out cross-entropy against the target's law (nats/byte), argmax agreement with the target's
    argmax, and the share of anchors whose depths 1 .. d all agree (every anchor at every depth: no drop)."""
    model.eval()
    starts = np.linspace(0, len(held) - seq_len - 2, windows).astype(np.int64)
    batch = torch.from_numpy(np.stack([held[s: s + seq_len] for s in starts]).astype(np.int64))
    lay = layout(seq_len, K, 1.0, torch.Generator().manual_seed(0))
    anchor, depth = lay[0], lay[1]
    n = seq_len - K + 1  # anchors with every depth
    ce, agree, chain = np.zeros(K), np.zeros(K), np.zeros(K)
    for chunk in batch.split(8):
        all_agree = torch.ones(chunk.shape[0], n, dtype=torch.bool)
        for i, (lg, lp) in enumerate(depth_losses(target, model, chunk, lay, K, mask_id)):
            ok = anchor[depth == i] < n
            lg, lp = lg[:, ok], lp[:, ok]
            ce[i] += soft_ce(lg, lp).item()
            hit = lg.argmax(-1) == lp.argmax(-1)
            agree[i] += hit.float().mean().item()
            all_agree &= hit
            chain[i] += all_agree.float().mean().item()
    model.train()
    chunks = len(batch.split(8))
    return ce / chunks, agree / chunks, chain / chunks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=35.0, help="training budget in minutes")
    ap.add_argument("--positions", type=int, default=8, help="K: the tokens one forward drafts (K - 1 masks)")
    ap.add_argument("--retain", type=float, default=0.7, help="conditional drop: depth d keeps retain**(d-1)")
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--draft", default=os.path.join(ASSETS, "draft"))
    ap.add_argument("--init", help="continue from this parallel drafter's checkpoint (instead of --draft plus a mask "
                    "token), with a new warm-up and decay over --minutes")
    ap.add_argument("--out", default=os.path.join(ASSETS, "parallel"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (timing runs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    budget, K = 60 * args.minutes, args.positions

    train, held, n_files, root = corpus()
    target = load_model(args.target).requires_grad_(False)
    model = load_model(args.init) if args.init else add_mask_token(load_model(args.draft))
    mask_id = model.cfg.extra["mask_token_id"]
    start = f"the checkpoint {args.init}" if args.init else f"{args.draft} plus a mask token"
    print(f"# train_parallel: {model.num_params() / 1e6:.2f}M params from {start} (mask token id "
          f"{mask_id}), {K} positions per forward, conditional drop retain {args.retain} (target {args.target} "
          f"frozen, {target.num_params() / 1e6:.2f}M)", flush=True)
    print(f"# corpus {root}: {n_files} files, train {len(train) / 1e6:.2f}M bytes, held-out {len(held) / 1e6:.2f}M "
          f"bytes; budget {budget / 60:.1f} min, batch {args.batch} x {args.seq_len}, torch {torch.__version__}, "
          f"{args.threads} thread(s)", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = 50
    print("# step  minutes  lr  train loss per depth 1..K (nats/byte vs the target's law, mean of last 50)  "
          "real tokens/s", flush=True)
    step, losses, t0, last_ckpt = 0, [], time.time(), time.time()
    tokens_per_step = args.batch * args.seq_len

    def checkpoint(final=False):
        ce, agree, chain = evaluate(target, model, held, args.seq_len, K, mask_id)
        save_model(model, args.out)
        fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"# {'final' if final else 'checkpoint'} step {step} at {(time.time() - t0) / 60:.1f} min "
              f"({step * tokens_per_step / 1e6:.1f}M tokens): held-out by depth: ce {fmt(ce)} | agree {fmt(agree)}"
              f" | chain {fmt(chain)} -> {args.out}", flush=True)

    checkpoint()
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0 or (args.max_steps is not None and step >= args.max_steps):
            break
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train) - args.seq_len, args.batch)
        real = torch.from_numpy(np.stack([train[s: s + args.seq_len] for s in starts]).astype(np.int64))
        lay = layout(args.seq_len, K, args.retain, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            per = [soft_ce(lg, lp) for lg, lp in depth_losses(target, model, real, lay, K, mask_id)]
        loss = torch.stack(per).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append([x.item() for x in per])
        step += 1
        if step % 50 == 0 or step == 1:
            el = time.time() - t0
            mean = " ".join(f"{x:.3f}" for x in np.mean(losses[-50:], axis=0))
            print(f"{step:6d} {el / 60:7.2f} {lr:.2e} {mean} {step * tokens_per_step / el:7.0f}", flush=True)
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes:
            checkpoint()
            last_ckpt = time.time()
    checkpoint(final=True)


if __name__ == "__main__":
    main()
