"""MLA tree attention (DeepSeek-V2/V3, Kimi-K2): specdec.tree_attention in the absorbed form against SDPA on the
unabsorbed and on the absorbed form, with the bytes moved against the copy ceiling.

    python -m bench.op_mla [--device cpu|cuda] [--quick] [--out DIR]

writes DIR/mla-<device>.md and .json (default bench/results/). Every case is one layer's verification step:
B requests, T tree nodes (random trees), a committed prefix of L positions, Hq query heads, the latent cache
[c_kv ; k_rope] (kv_lora_rank R + rope P = Dqk channels a position, one KV head), qk_nope N, v_head_dim Dh.

Implementations, each from the same inputs, each producing the layer's attention output (B, T, Hq, Dh):
  ours          absorb the queries (q_nope W_UK per head), specdec.tree_attention on the latent cache with
                v_cache = latent[..., :R] (a view), then out W_UV per head: the whole absorbed path.
  ours-op       the op alone (its output in latent space), what the bytes are counted for.
  sdpa-absorbed the peers' absorbed form in plain PyTorch: the same absorbed queries, the latent rows gathered and
                expanded to Hq heads, the (B, Hq, T, L+T) tree mask, F.scaled_dot_product_attention, W_UV.
  sdpa-unabsorbed  the obvious form: per-head K = [W_UK c ; k_rope] and V = W_UV c already materialized (an engine
                caching decompressed K/V: Hq * (N + P + Dh) channels a position), the tree mask, SDPA. The
                decompression itself is not timed (it favours the peer).

A peer that would materialize more than PEER_MEMORY_LIMIT (GPU shapes at L = 32K) is skipped; the check value
is the unabsorbed SDPA where it runs, else the absorbed one (tests/ops/test_mla_attention.py checks the op).

Bytes (the copy ceiling's unit): the absorbed op reads each position's Dqk latent channels once for all Hq heads
(B * (L + T) * Dqk * cache element size) plus q, out and lse; the unabsorbed form reads
B * (L + T) * Hq * (N + P + Dh) elements. The CPU timer does not flush caches (bench/timing.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F

import specdec
from specdec._layout import unpack_bits
from specdec.reference import quantize
from specdec.tree import build_tree_vectorized

from .common import DTYPES, cache_layout, random_parents
from .timing import REPO, copy_ceiling, machine_info, time_fn

DEEPSEEK_V3 = dict(R=512, P=64, N=128, Dh=128)
FP8_SCALE = 0.02  # k_scale of a float8 latent cache: N(0, 1) latents stored around +-50


def mla(B, T, L, Hq, dtype, kv=None, page=0):
    return dict(B=B, T=T, L=L, Hq=Hq, dtype=dtype, page=page, **({"kv": kv} if kv else {}), **DEEPSEEK_V3)


# the issue's CPU shape; the GPU rows: DeepSeek-V3's 128 heads, T up to 16, L up to 32K, float8 caches
CPU_CASES = [mla(4, 16, 2048, 16, "fp32"), mla(4, 16, 2048, 16, "bf16")]
GPU_CASES = [mla(8, 16, 32768, 128, "bf16", kv="fp8", page=64), mla(8, 16, 32768, 128, "bf16", page=64),
             mla(1, 16, 32768, 128, "bf16", kv="fp8", page=64), mla(32, 4, 8192, 128, "bf16", kv="fp8", page=64),
             mla(64, 1, 4096, 128, "bf16", kv="fp8", page=64), mla(8, 16, 4096, 128, "bf16")]
QUICK_CASES = [mla(2, 4, 64, 4, "fp32", page=16), mla(2, 4, 64, 4, "bf16", kv="fp8")]


class Inputs:
    def __init__(self, p: dict, device: torch.device, gen: torch.Generator):
        B, T, L, Hq, R, P, N, Dh = (p[k] for k in ("B", "T", "L", "Hq", "R", "P", "N", "Dh"))
        self.dtype = DTYPES[p["dtype"]]
        self.L, self.R, self.page = L, R, p["page"]
        shape, self.block_table = cache_layout(B, L + T, 1, R + P, p["page"], gen, device)
        latent = torch.randn(shape, generator=gen).to(device)
        self.k_scale = FP8_SCALE if p.get("kv") == "fp8" else None
        self.latent = quantize(latent, FP8_SCALE, torch.float8_e4m3fn) if self.k_scale else latent.to(self.dtype)
        self.w_uk = (torch.randn(Hq, N, R, generator=gen) / math.sqrt(N)).to(self.dtype).to(device)
        self.w_uv = (torch.randn(Hq, Dh, R, generator=gen) / math.sqrt(R)).to(self.dtype).to(device)
        self.q_nope = torch.randn(B, T, Hq, N, generator=gen).to(self.dtype).to(device)
        self.q_rope = torch.randn(B, T, Hq, P, generator=gen).to(self.dtype).to(device)
        self.cache_lens = torch.full((B,), L, dtype=torch.int32, device=device)
        parents = random_parents(B, T, "tree", gen).to(device)
        self.num_nodes = torch.full((B,), T, dtype=torch.int32, device=device)
        _, self.tree_mask = build_tree_vectorized(parents, self.num_nodes)
        self.scale = (N + P) ** -0.5
        self.q_abs = self.absorb()
        self.allowed = self.mask()
        self.peer_bytes = {  # what each SDPA peer materializes: per-head K and V, or the latent expanded to Hq heads
            "sdpa-unabsorbed": B * Hq * (L + T) * (N + P + Dh) * self.q_nope.element_size(),
            "sdpa-absorbed": B * Hq * (L + T) * (R + P) * self.q_nope.element_size()}
        self.k_heads = self.v_heads = None

    def materialize_heads(self):
        """The unabsorbed peer's per-head caches (B, Hq, L+T, N+P) and (B, Hq, L+T, Dh), as an engine caching
        decompressed K/V holds them (built once, outside the timed calls)."""
        Hq, R = self.q_nope.shape[2], self.R
        rows = self.logical_rows().to(self.dtype)  # (B, L+T, R+P), dequantized
        c, k_rope = rows[..., :R], rows[..., R:]
        self.k_heads = torch.cat([torch.einsum("bpr,hnr->bhpn", c, self.w_uk),
                                  k_rope.unsqueeze(1).expand(-1, Hq, -1, -1)], -1).contiguous()
        self.v_heads = torch.einsum("bpr,hdr->bhpd", c, self.w_uv).contiguous()

    def absorb(self):
        """(B, T, Hq, R + P): [q_nope W_UK ; q_rope] per head."""
        return torch.cat([torch.einsum("bthn,hnr->bthr", self.q_nope, self.w_uk), self.q_rope], -1)

    def logical_rows(self):
        """(B, L+T, R+P) latent rows by logical position, dequantized to q's dtype for a float8 cache."""
        n = self.L + self.q_nope.shape[1]
        if self.block_table is None:
            rows = self.latent[:, :n]
        else:
            rows = self.latent[self.block_table.long()].flatten(1, 2)[:, :n]
        rows = rows[:, :, 0]
        return rows if self.k_scale is None else rows.to(self.dtype) * self.k_scale

    def mask(self):
        """(B, 1, T, L+T) bool: the committed prefix and each node's ancestors-or-self."""
        B, T = self.tree_mask.shape[:2]
        tree = unpack_bits(self.tree_mask, T)
        return torch.cat([tree.new_ones(B, T, self.L), tree], -1).unsqueeze(1)


def ours_op(x: Inputs):
    return specdec.tree_attention(x.q_abs, x.latent, x.latent[..., :x.R], x.cache_lens, x.tree_mask,
                                  block_table=x.block_table, num_nodes=x.num_nodes, scale=x.scale, k_scale=x.k_scale)


def ours(x: Inputs):
    x.q_abs = x.absorb()
    return torch.einsum("bthr,hdr->bthd", ours_op(x), x.w_uv)


def sdpa_absorbed(x: Inputs):
    B, T, Hq, _ = x.q_nope.shape
    rows = x.logical_rows().unsqueeze(1).expand(B, Hq, -1, -1)  # (B, Hq, L+T, R+P)
    out = F.scaled_dot_product_attention(x.absorb().transpose(1, 2), rows, rows[..., :x.R],
                                         attn_mask=x.allowed.expand(B, Hq, T, -1), scale=x.scale)
    return torch.einsum("bhtr,hdr->bthd", out, x.w_uv)


def sdpa_unabsorbed(x: Inputs):
    B, T, Hq, _ = x.q_nope.shape
    q = torch.cat([x.q_nope, x.q_rope], -1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, x.k_heads, x.v_heads, attn_mask=x.allowed.expand(B, Hq, T, -1),
                                         scale=x.scale)
    return out.transpose(1, 2)


def op_bytes(x: Inputs) -> int:
    B, T, Hq, _ = x.q_nope.shape
    e = x.q_abs.element_size()
    return (B * (x.L + T) * x.latent.shape[-1] * x.latent.element_size() + B * T * Hq * x.q_abs.shape[-1] * e
            + B * T * Hq * x.R * e + B * T * Hq * 4)


def unabsorbed_bytes(x: Inputs) -> int:
    """Per-head K and V of every position read once, q read and out written."""
    B, T, Hq, N = x.q_nope.shape
    P, Dh = x.q_rope.shape[-1], x.w_uv.shape[1]
    return (B * (x.L + T) * Hq + B * T * Hq) * (N + P + Dh) * x.q_nope.element_size()


def describe(p: dict) -> str:
    kv = f" kv-{p['kv']}" if p.get("kv") else ""
    layout = f"paged{p['page']}" if p["page"] else "contig"
    return (f"B{p['B']} T{p['T']} L{p['L']} Hq{p['Hq']} Dqk{p['R'] + p['P']} Dv{p['R']} {p['dtype']}{kv} "
            f"{layout}")


ROUNDS = 3
PEER_MEMORY_LIMIT = 16 * 2**30  # bytes a peer may materialize; larger cases time the op against the ceiling only


def run_case(p: dict, device: torch.device, ceiling: dict, budget_s: float) -> list[dict]:
    x = Inputs(p, device, torch.Generator().manual_seed(0))
    impls = {"ours": (lambda: ours(x), op_bytes(x)), "ours-op": (lambda: ours_op(x), op_bytes(x)),
             "sdpa-absorbed": (lambda: sdpa_absorbed(x), op_bytes(x)),
             "sdpa-unabsorbed": (lambda: sdpa_unabsorbed(x), unabsorbed_bytes(x))}
    skipped = [name for name, nbytes in x.peer_bytes.items() if nbytes > PEER_MEMORY_LIMIT]
    for name in skipped:
        print(f"{describe(p):52s} {name:16s} skipped: would materialize {x.peer_bytes[name] / 2**30:.0f} GiB")
        del impls[name]
    if "sdpa-unabsorbed" in impls:
        x.materialize_heads()
    # the check value: the unabsorbed form where it fits, else the absorbed SDPA, else none (tests/ cover the op)
    check = next((impls[name][0] for name in ("sdpa-unabsorbed", "sdpa-absorbed") if name in impls), None)
    expected = check().float() if check else None
    errors = {}
    for name, (fn, _) in impls.items():
        errors[name] = (float((fn().float() - expected).abs().max()) if expected is not None and name != "ours-op"
                        else math.nan)
    # ROUNDS rounds, each timing every implementation in turn: load from other processes on a shared machine then
    # falls on all of them alike; the median of the rounds' medians, the fastest call of all
    medians, fastest = {name: [] for name in impls}, {name: math.inf for name in impls}
    for _ in range(ROUNDS):
        for name, (fn, _) in impls.items():
            timing = time_fn(fn, device, budget_s=budget_s / ROUNDS)
            medians[name].append(timing["time_s"])
            fastest[name] = min(fastest[name], timing["time_min_s"])
    rows = []
    for name, (_, nbytes) in impls.items():
        seconds = statistics.median(medians[name])
        gbps = nbytes / seconds / 1e9
        rows.append({"case": describe(p), "impl": name, "time_ms": seconds * 1e3, "time_min_ms": fastest[name] * 1e3,
                     "bytes": nbytes, "gbps": gbps, "pct_copy": 100 * gbps / ceiling["gbps"],
                     "max_err_vs_peer": errors[name]})
        print(f"{rows[-1]['case']:52s} {name:16s} {rows[-1]['time_ms']:9.3f} ms {gbps:8.1f} GB/s "
              f"{rows[-1]['pct_copy']:6.1f}% copy  err {errors[name]:.2e}", flush=True)
    by_name = {r["impl"]: r for r in rows}
    for r in rows:
        for peer in ("sdpa-absorbed", "sdpa-unabsorbed"):
            r[f"speedup_vs_{peer.replace('-', '_')}"] = (by_name[peer]["time_ms"] / r["time_ms"] if peer in by_name
                                                         else math.nan)
    return rows


def markdown(rows: list[dict], ceiling: dict, machine: dict) -> str:
    lines = ["# MLA tree attention: absorbed op vs SDPA (bench/op_mla.py)", "",
             f"{machine.get('date', '')}, {machine.get('device')}: {machine.get('cpu', '')} "
             f"({machine.get('torch_threads')} threads), torch {torch.__version__}; copy ceiling "
             f"{ceiling['gbps']:.1f} GB/s ({ceiling['method']}); load average at the end "
             f"{os.getloadavg()[0]:.1f} (other processes share the cores: compare rows of one case, timed in "
             f"{ROUNDS} interleaved rounds).", "",
             "| case | impl | ms (median) | ms (min) | MB moved | GB/s | % copy | x sdpa-absorbed | x sdpa-unabsorbed "
             "| max err vs SDPA |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['impl']} | {r['time_ms']:.3f} | {r['time_min_ms']:.3f} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['gbps']:.1f} | {r['pct_copy']:.1f} | "
                     f"{r['speedup_vs_sdpa_absorbed']:.2f} | {r['speedup_vs_sdpa_unabsorbed']:.2f} | "
                     f"{r['max_err_vs_peer']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a dry run of the mechanics)")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per implementation")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases = QUICK_CASES if args.quick else (GPU_CASES if device.type == "cuda" else CPU_CASES)
    ceiling = copy_ceiling(device)
    rows = []
    machine = machine_info(device)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"mla-{device.type}{'-quick' if args.quick else ''}")
    for p in cases:  # the tables rewritten after every case: a step cut by its timeout keeps the cases done
        rows += run_case(p, device, ceiling, args.budget)
        with open(stem + ".json", "w") as f:
            json.dump({"machine": machine, "ceiling": ceiling, "rows": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(rows, ceiling, machine))
    print("wrote", stem + ".md")


if __name__ == "__main__":
    main()
