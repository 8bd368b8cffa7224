"""Tuning sweep: the Triton kernels' launch parameters at the target shapes (the GPU script's `sweep`
step), so that one GPU run measures what the heuristics should choose.

    python -m bench.sweep [--device cuda] [--ops attention,accept,rollback] [--out DIR] [--name STEM]
                          [--time-budget S]
    TRITON_INTERPRET=1 python -m bench.sweep --device cpu --toy   # the mechanics on toy shapes, no timing

For every target case of bench/cases.py (GPU_TARGETS; --toy: the toy cases), each variant of its op's
tunables runs the Triton launcher directly, is checked like a benchmark row (accept schedule variants must
also return exactly what the default returns: the schedule may not change a result; a trials variant draws
other, equally exact, samples), and is timed eagerly and as a CUDA-graph replay. "default" is what the heuristics choose now; the others change one tunable each:

  attention  num_splits (x1/2, x2, 1), block_n, num_warps, num_stages, float32 split partials
             (choose_num_splits, choose_config)
  accept     block_v, num_splits, num_warps, prefetch, split_steps=0 (the walker alone: one launch),
             trials (candidates of the draw after a last rejection)       (_config, TRIALS)
  rollback   tile_elements, num_warps                                    (kv_cache.TILE_ELEMENTS)

Results: JSON + markdown like `python -m bench` (rows named "triton <variant>"), and a per-case ranking
(fastest first by graph replay, else eager) on stdout.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import specdec

from . import cases as grids
from . import report
from .run import OPS, _failure, case_row, measure, run_cases
from .timing import copy_ceiling, machine_info


def attention_variants(x) -> list[tuple[str, dict]]:
    from specdec.kernels import tree_attention as ta
    cfg = ta.default_config(x.q, x.k_cache)
    splits = ta.default_num_splits(x.q, x.k_cache, x.block_table, cfg, x.window_left)
    out = [("default", {})]
    out += [(f"num_splits={s}", {"num_splits": s}) for s in sorted({1, max(1, splits // 2), 2 * splits} - {splits})]
    out += [(f"block_n={n}", {"config": cfg._replace(block_n=n)}) for n in (32, 64, 128) if n != cfg.block_n]
    out += [(f"num_warps={w}", {"config": cfg._replace(num_warps=w)}) for w in (4, 8) if w != cfg.num_warps]
    out += [(f"num_stages={s}", {"config": cfg._replace(num_stages=s)}) for s in (2, 3, 4) if s != cfg.num_stages]
    if splits > 1 and x.q.dtype != torch.float32:
        out.append(("partial_dtype=float32", {"partial_dtype": torch.float32}))
    return out


def attention_launch(x, kwargs):
    from specdec.kernels import tree_attention as ta
    scales = (x.k_scale or 1.0, x.v_scale or 1.0)  # None: a cache in q's dtype
    return lambda: ta.tree_attention(x.q, x.k_cache, x.v_cache, x.cache_lens, x.tree_mask, x.block_table,
                                     x.num_nodes, x.scale, *scales, x.window_left, **kwargs)[0]


def accept_variants(x) -> list[tuple[str, dict]]:
    from specdec.kernels import accept as ka
    B, T, V = x.target_logits.shape
    cfg = ka._config(T, V, x.target_logits.element_size(), x.target_logits.device)
    out = [("default", {})]
    out += [(f"block_v={v}", {"block_v": v}) for v in (1024, 4096) if v != cfg["block_v"]]
    out += [(f"num_splits={s}", {"num_splits": s})
            for s in sorted({max(1, cfg["num_splits"] // 2), 2 * cfg["num_splits"]} - {cfg["num_splits"]})]
    out += [(f"num_warps={w}", {"num_warps": w}) for w in (4, 8, 16) if w != cfg["num_warps"]]
    out += [(f"prefetch={n}", {"prefetch": n}) for n in (1, 2) if n != cfg["prefetch"]]
    if cfg["split_steps"]:
        out.append(("split_steps=0", {"split_steps": 0}))
    # candidates of the draw after a last rejection (0: always the Z pass); other draws, equally exact
    out += [(f"trials={n}", {"trials": n}) for n in (0, 2) if n != cfg["trials"]]
    return out


def accept_launch(x, kwargs):
    from specdec.kernels import accept as ka
    return lambda: specdec.AcceptResult.from_op(ka.accept(x.target_logits, x.tokens, x.parents, x.draft_logits,
                                                           x.temperature, x.seeds, x.num_nodes, 0, **kwargs))


def rollback_variants(x) -> list[tuple[str, dict]]:
    from specdec.kernels import kv_cache as kc
    out = [("default", {})]
    out += [(f"tile_elements={n}", {"tile_elements": n}) for n in (1024, 2048, 8192, 16384) if n != kc.TILE_ELEMENTS]
    out += [(f"num_warps={w}", {"num_warps": w}) for w in (2, 8)]
    return out


def rollback_launch(x, kwargs):
    from specdec.kernels import kv_cache as kc

    tables = kc.layer_tables(x.k_caches, x.v_caches)  # once, as a RollbackPlan does

    def run():
        x.cache_lens.copy_(x.lens0)
        kc.rollback(tables, x.cache_lens, x.accepted_nodes, x.num_accepted, x.block_table, **kwargs)
    return run


SWEEPS = {"attention": (attention_variants, attention_launch), "accept": (accept_variants, accept_launch),
          "rollback": (rollback_variants, rollback_launch)}


class _SameAsDefault:
    """An op module whose check also requires the default variant's exact result (accept: the schedule
    must not change which tokens are emitted)."""

    def __init__(self, mod, default_out):
        self.mod, self.default_out = mod, default_out

    def __getattr__(self, name):
        return getattr(self.mod, name)

    def check(self, x, out, expected) -> str:
        text = self.mod.check(x, out, expected)
        same = all(torch.equal(a, b) for a, b in zip(out, self.default_out))
        return text + ("; = default" if same else "; MISMATCH: differs from the default schedule")


def sweep_case(case, device, ceiling, budget_s, smoke):
    """Yield one row per variant of the case (the default first)."""
    mod = OPS[case.op]
    variants, launch = SWEEPS[case.op]
    case_name = mod.describe(case.params)
    torch.manual_seed(0)
    try:
        x = mod.Inputs(case.params, device, torch.Generator().manual_seed(0))
        expected = mod.reference_value(x)
        plan = variants(x)
    except Exception as exc:  # noqa: BLE001 - a case that cannot be set up is reported, not fatal
        status, note = _failure(exc)
        yield case_row(case.op, case_name, status, f"inputs: {note}")
        return
    checker = mod
    for name, kwargs in plan:
        # a schedule must reproduce the default's tokens; another candidate count draws other (exact) samples
        row = measure(mod if "trials" in kwargs else checker, x, case_name, f"triton {name}", "specdec",
                      lambda k=kwargs: launch(x, k), expected, device, ceiling, budget_s, smoke=smoke)
        row["variant"] = kwargs and {k: (v._asdict() if hasattr(v, "_asdict") else v) for k, v in kwargs.items()}
        print("  " + report.row_line(row), flush=True)
        yield row
        if name == "default" and case.op == "accept" and row["status"] == "ok":
            x.reset()
            checker = _SameAsDefault(mod, launch(x, kwargs)())


def ranking(result) -> str:
    """Per case: the variants fastest first (graph replay when measured, else eager), vs the default."""
    lines = []
    for case in result["cases"]:
        rows = [r for r in result["rows"] if r["case"] == case["name"] and r["status"] == "ok" and r.get("time_s")]
        if not rows:
            continue
        key = "graph" if all((r.get("graph") or {}).get("time_s") for r in rows) else "eager"

        def seconds(r):
            return r["graph"]["time_s"] if key == "graph" else r["time_s"]

        default = next((seconds(r) for r in rows if r["impl"] == "triton default"), None)
        goal = case.get("copy_goal")
        lines.append(f"{case['op']} {case['name']} (by {key} time" + (f"; target >= {goal:g}% copy)" if goal else ")"))
        for r in sorted(rows, key=seconds):
            pct = (r["graph"] if key == "graph" else r).get("pct_copy")
            rel = f"{default / seconds(r):5.2f}x default" if default else ""
            verdict = "" if goal is None or pct is None else (" meets the target" if pct >= goal else " below the target")
            lines.append(f"  {r['impl']:<28} {seconds(r) * 1e6:10.1f} us  {pct or 0:6.1f}% copy  {rel}{verdict}  {r['check']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ops", default=",".join(SWEEPS), help=f"comma list of {','.join(SWEEPS)}")
    ap.add_argument("--toy", action="store_true", help="the toy cases (a smoke run of the mechanics)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--name", default=None, help="results file stem (default: sweep-<date>-<device>)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds after which no new case starts")
    ap.add_argument("--rep-budget", type=float, default=0.1, help="seconds of timed calls per measurement")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    ops = [o for o in args.ops.split(",") if o]
    if set(ops) - set(SWEEPS):
        raise SystemExit(f"--ops: choose from {list(SWEEPS)}")
    smoke = device.type == "cpu"  # the interpreter: correctness of every variant only
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("on the CPU the sweep runs the Triton interpreter: set TRITON_INTERPRET=1")
    start = time.monotonic()
    meta = machine_info(device)
    meta["args"] = vars(args)
    ceiling = copy_ceiling(device, sizes_mib=(256,) if smoke else None)
    stem = args.name or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}-{device.type}"
    result = {"meta": meta, "ceiling": ceiling, "cases": [], "rows": []}
    def rows_of(case):
        yield from sweep_case(case, device, ceiling, args.rep_budget, smoke)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def entry(case):  # the case's copy-bandwidth target, for the ranking
        return {"targets": [], "copy_goal": max((t.threshold for t in case.targets if t.vs == "copy"), default=None)}

    run_cases([c for c in (grids.TOY if args.toy else grids.GPU_TARGETS) if c.op in ops], rows_of, result, args.out,
              stem, start, args.time_budget, entry)
    result["wall_s"] = round(time.monotonic() - start, 1)
    paths = report.write(result, args.out, stem)
    print()
    print(ranking(result))
    print(f"results: {' '.join(paths)} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
