"""The benchmark runner: every case of the grid, every backend and peer, one row each.

For each case: build the inputs once; compute the check value; for each implementation run it once with
the value checks on and check its output, then time it with the value checks off (the GPU hot path
setting; the peers validate nothing either). A backend or op that is missing (ImportError,
NotImplementedError) is skipped with a note; any other failure is recorded as an error row; neither
stops the run. Results are written after every row, so a run cut short still leaves them.

Each op module (op_attention, op_accept, op_rollback, op_append) provides: OP (its name); Inputs(params,
device, gen) with .reset() (restore what a call mutates); specdec_fn(x, backend) and peers(x, case)
({name: factory of a callable}); reference_value(x) and check(x, out, expected) -> "ok ..." or
"MISMATCH ..."; min_bytes(x, out); summary(x, out) (extra facts for the row); describe(params) (the case
name); optionally bytes_for_check(x) (memory the check value needs; too large -> not checked).
"""
from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import specdec
import specdec.ops

from . import cases as grids
from . import op_accept, op_append, op_attention, op_rollback, report
from .timing import copy_ceiling, machine_info, time_fn, time_graph

OPS = {m.OP: m for m in (op_attention, op_accept, op_rollback, op_append)}
SPECDEC_BACKENDS = ("torch", "cpp", "triton")
CHECK_MEMORY_LIMIT = {"cpu": 2 * 2**30, "cuda": 40 * 2**30}  # bytes a float32 check value may take
_UNCHECKED = object()  # the check value was too large to compute


def plan_backends(case, device: torch.device, backends) -> list[tuple[str, str, str]]:
    """[(row name, backend, note)]: note is "" to run, "smoke" for the interpreter, else why it is skipped."""
    plan = []
    for backend in backends:
        if backend == "torch":
            if case.toy:  # the reference loops in Python: toy shapes only
                plan.append(("torch", "torch", ""))
        elif backend == "cpp":
            if device.type == "cpu":
                plan.append(("cpp", "cpp", "" if specdec.ops.HAS_CPP else "C++ extension not built"))
        elif device.type == "cuda":
            plan.append(("triton", "triton", ""))
        elif case.toy:
            interpreting = os.environ.get("TRITON_INTERPRET") == "1"
            plan.append(("triton-interp", "triton",
                         "smoke" if interpreting else "set TRITON_INTERPRET=1 for the interpreter smoke run"))
    return plan


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _failure(exc: BaseException) -> tuple[str, str]:
    """(status, note) of an implementation that raised."""
    first_line = _first_line(exc)[:160]
    if isinstance(exc, (ImportError, NotImplementedError)):
        return "skipped", f"not implemented yet ({type(exc).__name__}: {first_line})"
    if isinstance(exc, torch.OutOfMemoryError):
        return "skipped", "out of memory"
    return "error", f"{type(exc).__name__}: {first_line}"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(mod, x, case_name, name, kind, make_fn, expected, device, ceiling, budget_s, smoke=False) -> dict:
    row = {"op": mod.OP, "case": case_name, "impl": name, "kind": kind, "status": "ok", "note": "",
           "time_s": None, "time_min_s": None, "reps": None, "timer": None, "bytes": None, "gbps": None, "pct_copy": None,
           "check": "n/a", "extra": {}}
    try:
        x.reset()
        fn = make_fn()
        out = fn()
        _sync(device)
        row["check"] = mod.check(x, out, expected) if expected is not _UNCHECKED else "not checked (too large)"
        row["extra"] = mod.summary(x, out)
        row["bytes"] = mod.min_bytes(x, out)
        del out
        if smoke:
            row["note"] = "interpreter smoke run: correctness only, no speed claim"
            return row
        with specdec.value_checks(False):  # the GPU hot path setting, for the eager and the graph timing
            timing = time_fn(fn, device, budget_s=budget_s)
            row.update(timing, **_bandwidth(row["bytes"], timing["time_s"], ceiling))
            if device.type == "cuda":
                row["graph"] = measure_graph(fn, device, row["bytes"], ceiling, budget_s)
    except Exception as exc:  # noqa: BLE001 - a broken implementation must not stop the run
        row["status"], row["note"] = _failure(exc)
    return row


def _bandwidth(nbytes, seconds, ceiling) -> dict:
    if not nbytes:
        return {}
    gbps = nbytes / seconds / 1e9
    return {"gbps": gbps, "pct_copy": 100.0 * gbps / ceiling["gbps"]}


def measure_graph(fn, device, nbytes, ceiling, budget_s) -> dict:
    """The CUDA-graph replay timing of `fn` ({"time_s", "time_min_s", "reps", "timer", "gbps", "pct_copy"}),
    or {"note": why not} when it cannot be captured (the PyTorch peers with boolean-mask indexing sync)."""
    try:
        timing = time_graph(fn, device, budget_s=budget_s)
    except Exception as exc:  # noqa: BLE001 - an uncapturable peer is a fact to report, not a failure
        torch.cuda.synchronize(device)
        return {"note": f"not capturable ({type(exc).__name__}: {_first_line(exc)[:100]})"}
    return dict(timing, **_bandwidth(nbytes, timing["time_s"], ceiling))


def case_row(op, case_name, status, note) -> dict:
    """The one row of a case that produced no measurement (its inputs failed, or it was not started)."""
    return {"op": op, "case": case_name, "impl": "-", "kind": "-", "status": status, "note": note, "check": "n/a",
            "extra": {}}


def run_cases(cases, rows_of, result, out, stem, start, time_budget=None, entry=lambda case: {}):
    """Every case into `result` (its entry in result["cases"] extended by `entry(case)`; its rows from
    `rows_of(case)`), saved after each row so a run cut short keeps them; no case starts after
    `time_budget` seconds."""
    for case in cases:
        name = OPS[case.op].describe(case.params)
        result["cases"].append({"op": case.op, "name": name, "params": case.params, **entry(case)})
        if time_budget is not None and time.monotonic() - start > time_budget:
            result["rows"].append(case_row(case.op, name, "skipped", "time budget spent"))
            continue
        print(f"{case.op}: {name}", flush=True)
        for row in rows_of(case):
            result["rows"].append(row)
            result["wall_s"] = round(time.monotonic() - start, 1)
            report.write(result, out, stem)


def run_case(case, device, backends, peer_names, ceiling, budget_s):
    """Yield the case's rows one by one (the caller saves after each: a step killed mid-case keeps them)."""
    mod = OPS[case.op]
    case_name = mod.describe(case.params)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    try:
        x = mod.Inputs(case.params, device, gen)
        big = getattr(mod, "bytes_for_check", lambda _x: 0)(x) > CHECK_MEMORY_LIMIT[device.type]
        expected = _UNCHECKED if big else mod.reference_value(x)
    except Exception as exc:  # noqa: BLE001
        status, note = _failure(exc)
        yield case_row(case.op, case_name, status, f"inputs: {note}")
        return
    for name, backend, note in plan_backends(case, device, backends):
        if note and note != "smoke":
            row = {"op": case.op, "case": case_name, "impl": name, "kind": "specdec", "status": "skipped",
                   "note": note, "check": "n/a", "extra": {}}
        else:
            row = measure(mod, x, case_name, name, "specdec", lambda b=backend: mod.specdec_fn(x, b), expected,
                          device, ceiling, budget_s, smoke=(note == "smoke"))
        _print_row(row)
        yield row
    for name, factory in mod.peers(x, case).items():
        if peer_names is None or name in peer_names:
            row = measure(mod, x, case_name, name, "peer", factory, expected, device, ceiling, budget_s)
            _print_row(row)
            yield row
    del x, expected
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _print_row(row):
    print("  " + report.row_line(row), flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="toy shapes and the targets only (< 1 minute on CPU)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(OPS)}")
    ap.add_argument("--backends", default=",".join(SPECDEC_BACKENDS),
                    help="comma list of specdec backends (torch runs on toy shapes only; triton on CPU only as "
                         "an interpreter smoke run with TRITON_INTERPRET=1)")
    ap.add_argument("--peers", default=None, help="comma list of peers to time (default: all present)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"), help="results folder")
    ap.add_argument("--name", default=None, help="results file stem (default: bench-<date>-<device>[-quick])")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds after which no new case starts (the rest are listed as skipped)")
    ap.add_argument("--rep-budget", type=float, default=None,
                    help="seconds of timed calls per measurement (default 0.1 GPU, 0.4 CPU, 0.15 quick CPU)")
    ap.add_argument("--ceiling-only", action="store_true", help="measure the copy-bandwidth ceiling only")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    start = time.monotonic()
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        raise SystemExit(f"--ops: unknown {sorted(unknown)}; choose from {list(OPS)}")
    backends = [b for b in args.backends.split(",") if b]
    peer_names = None if args.peers is None else set(args.peers.split(","))
    budget_s = args.rep_budget or (0.1 if device.type == "cuda" else 0.15 if args.quick else 0.4)

    meta = machine_info(device)
    meta["args"] = vars(args)
    sizes = (256, 1024, 4096, 16384) if args.ceiling_only and device.type == "cuda" else \
        (512,) if args.quick and device.type == "cpu" else None
    ceiling = copy_ceiling(device, sizes_mib=sizes)
    print(f"specdec bench on {meta.get('gpu', meta['cpu'])}: torch {meta['torch']}, triton {meta['triton']}; "
          f"copy ceiling {ceiling['gbps']:.1f} GB/s ({ceiling['method']}; sweep {ceiling['sweep']})", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = args.name or f"bench-{stamp}-{device.type}{'-quick' if args.quick else ''}"
    result = {"meta": meta, "ceiling": ceiling, "cases": [], "rows": []}
    if args.ceiling_only:
        ops = []
    run_cases([c for c in grids.GRIDS[(device.type, args.quick)] if c.op in ops],
              lambda case: run_case(case, device, backends, peer_names, ceiling, budget_s), result, args.out, stem,
              start, args.time_budget, entry=lambda case: {"targets": [t.__dict__ for t in case.targets]})
    result["wall_s"] = round(time.monotonic() - start, 1)
    meta["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    paths = report.write(result, args.out, stem)
    print()
    print(report.summary_text(result))
    print(f"results: {' '.join(paths)} ({result['wall_s']} s)")
    return 0
