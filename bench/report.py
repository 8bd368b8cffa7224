"""Results: ratios to peers, PASS/FAIL against the targets, JSON + markdown files, the stdout summary.

Also a command that merges result files (the GPU script times each op in its own process) and prints
their summary:  python -m bench.report FILE.json [FILE.json ...] [--out DIR --name STEM]
"""
from __future__ import annotations

import argparse
import json
import os

PEER_KIND = "peer"


def _fmt_time(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _fmt(v, spec) -> str:
    """v formatted by spec, or a dash as wide as the spec's width."""
    if v is None:
        width = spec.split(".")[0]
        return format("-", f">{width}") if width else "-"
    return format(v, spec)


def _timed(row) -> bool:
    return row.get("status") == "ok" and row.get("time_s")


def _graph(row) -> dict:
    """The row's CUDA-graph replay timing (GPU runs), or {} when it has none."""
    g = row.get("graph") or {}
    return g if g.get("time_s") else {}


def ratios(result) -> list[dict]:
    """Speedup of every timed specdec backend over every timed peer of the same case: eager time over
    eager time, and graph replay over graph replay where both were captured (else None)."""
    out = []
    by_case: dict = {}
    for row in result["rows"]:
        by_case.setdefault((row["op"], row["case"]), []).append(row)
    for (op, case), rows in by_case.items():
        for impl in (r for r in rows if r["kind"] == "specdec" and _timed(r) and r["impl"] != "torch"):
            for peer in (r for r in rows if r["kind"] == PEER_KIND and _timed(r)):
                gi, gp = _graph(impl), _graph(peer)
                out.append({"op": op, "case": case, "impl": impl["impl"], "vs": peer["impl"],
                            "speedup": peer["time_s"] / impl["time_s"],
                            "graph_speedup": gp["time_s"] / gi["time_s"] if gi and gp else None})
    return out


def _ratio_text(r) -> str:
    graph = f", graph {r['graph_speedup']:.2f}x" if r.get("graph_speedup") else ""
    return f"{r['speedup']:.2f}x{graph}"


def targets(result) -> list[dict]:
    """Every target of the run's cases with its measured value and PASS / FAIL (n/a when not measured).

    On a GPU the value is the CUDA-graph replay measurement (how engines run a verification step) when
    there is one (for a speedup: when both sides were captured), else the eager one; `timing` says which,
    and `eager_value` keeps the eager measurement beside it."""
    rows = {(r["op"], r["case"], r["impl"]): r for r in result["rows"]}
    speedups = {(r["op"], r["case"], r["impl"], r["vs"]): r for r in ratios(result)}
    out = []
    for case in result["cases"]:
        for t in case["targets"]:
            row = rows.get((case["op"], case["name"], t["impl"]))
            if t["vs"] == "copy":
                eager = row.get("pct_copy") if row and _timed(row) else None
                graph = _graph(row).get("pct_copy") if row and eager is not None else None
                metric, unit = "% of copy BW", "%"
            else:
                r = speedups.get((case["op"], case["name"], t["impl"], t["vs"])) or {}
                eager, graph = r.get("speedup"), r.get("graph_speedup")
                metric, unit = f"speedup vs {t['vs']}", "x"
            value, timing = (graph, "graph") if graph is not None else (eager, "eager")
            if value is None:
                why = (row or {}).get("note") or (row or {}).get("status") or "not run"
                verdict = f"n/a ({why})"
            else:
                checked_ok = row is not None and not row.get("check", "").startswith("MISMATCH")
                verdict = ("PASS" if value >= t["threshold"] else "FAIL") + ("" if checked_ok else " (output MISMATCH)")
            out.append({"source": t["source"], "op": case["op"], "case": case["name"], "impl": t["impl"],
                         "metric": metric, "threshold": t["threshold"], "unit": unit, "value": value,
                         "timing": timing, "eager_value": eager, "verdict": verdict})
    return out


def _target_value(t) -> str:
    """The measured value of a target, which timing it comes from, and the eager one beside a graph one."""
    if t["value"] is None:
        return "-"
    text = f"{t['value']:.2f}{t['unit']}"
    if t.get("timing") == "graph":
        eager = "-" if t.get("eager_value") is None else f"{t['eager_value']:.2f}{t['unit']}"
        text += f" (graph replay; eager {eager})"
    return text


def row_line(row) -> str:
    """One result row as a fixed-width line (the progress output)."""
    perf = (f"{_fmt_time(row.get('time_s')):>10}  {_fmt(row.get('gbps'), '8.1f')} GB/s  "
            f"{_fmt(row.get('pct_copy'), '6.1f')}% copy")
    if row.get("status") != "ok" or row.get("time_s") is None:
        perf = f"{'-':>10}  {'':>8}       {'':>6}      "
    extra = " ".join(f"{k}={v}" for k, v in (row.get("extra") or {}).items())
    note = row.get("note") or ""
    g = row.get("graph") or {}
    if g:
        note = (note + " " if note else "") + (f"graph {_fmt_time(g['time_s'])} {_fmt(g.get('pct_copy'), '.1f')}% copy"
                                               if g.get("time_s") else f"graph: {g.get('note')}")
    status = "" if row.get("status") == "ok" else f"[{row.get('status')}] "
    return f"{row['impl']:<20} {perf}  {row.get('check', 'n/a')} {extra} {status}{note}".rstrip()


def _meta_lines(result) -> list[str]:
    m, c = result["meta"], result["ceiling"]
    gpu = f"{m['gpu']} ({m['gpu_memory_gib']} GiB, {m['sm_count']} SMs), " if m.get("gpu") else ""
    return [
        f"- date: {m['date']}; device: {m['device']}; machine: {gpu}{m['cpu_count']} CPUs ({m['cpu']}), "
        f"torch threads {m['torch_threads']}, load average at start {m.get('load_average')}, "
        f"at end {m.get('load_average_end')}",
        f"- python {m['python']}, torch {m['torch']}, triton {m['triton']}"
        + (f", CUDA {m['cuda']}" if m.get("cuda") else "") + f"; TRITON_INTERPRET={m['triton_interpret'] or 'unset'}",
        f"- git commit {m['git_commit']}{' (tracked files modified)' if m['git_dirty'] else ''}",
        f"- copy-bandwidth ceiling: {c['gbps']:.1f} GB/s ({c['method']}; {c['timer']})",
        f"- timers: {_timer_text(m['device'])}; value checks off while timing; wall {result.get('wall_s', '-')} s",
    ]


def _timer_text(device) -> str:
    if device == "cuda":
        return ("triton.testing.do_bench, median (fastest also listed), L2 cleared before each call; each "
                "implementation called eagerly and as the replay of a CUDA graph of one call (targets use the "
                "graph replay where captured, the eager time otherwise)")
    return ("time.perf_counter, 2 warmup calls, median (fastest call also listed), caches not flushed "
            "(% of copy can exceed 100)")


def markdown(result) -> str:
    lines = [f"# specdec benchmark: {result['meta']['device']}", ""] + _meta_lines(result) + [""]
    tg = targets(result)
    if tg:
        lines += ["## Targets", "", "| source | op | case | impl | metric | target | measured | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in tg:
            lines.append(f"| {t['source']} | {t['op']} | {t['case']} | {t['impl']} | {t['metric']} | "
                         f">= {t['threshold']:g}{t['unit']} | {_target_value(t)} | {t['verdict']} |")
        lines.append("")
    rt = ratios(result)
    if rt:
        lines += ["## Ratios to peers (same run, same inputs)", "", "| op | case | ratio |", "|---|---|---|"]
        lines += [f"| {r['op']} | {r['case']} | {r['impl']} vs {r['vs']}: {_ratio_text(r)} |" for r in rt]
        lines.append("")
    graphs = any("graph" in r for r in result["rows"])
    graph_head, graph_rule = (" graph replay | % copy (graph) |", "---|---|") if graphs else ("", "")
    for op in dict.fromkeys(r["op"] for r in result["rows"]):
        lines += [f"## {op}", "", "| case | impl | time (median) | fastest | min bytes | GB/s | % copy |"
                  + graph_head + " check | notes |", "|---|---|---|---|---|---|---|" + graph_rule + "---|---|"]
        for r in (r for r in result["rows"] if r["op"] == op):
            extra = " ".join(f"{k}={v}" for k, v in (r.get("extra") or {}).items())
            graph_note = (r.get("graph") or {}).get("note", "")
            notes = " ".join(s for s in (r["status"] if r["status"] != "ok" else "", r.get("note") or "", extra,
                                         f"graph: {graph_note}" if graph_note else "") if s)
            mb = "-" if r.get("bytes") is None else f"{r['bytes'] / 1e6:.3g} MB"
            g = _graph(r)
            graph_cells = f" {_fmt_time(g.get('time_s'))} | {_fmt(g.get('pct_copy'), '.1f')} |" if graphs else ""
            lines.append(f"| {r['case']} | {r['impl']} | {_fmt_time(r.get('time_s'))} | {_fmt_time(r.get('time_min_s'))} | {mb} | "
                         f"{_fmt(r.get('gbps'), '.1f')} | {_fmt(r.get('pct_copy'), '.1f')} |{graph_cells} "
                         f"{r.get('check', 'n/a')} | {notes} |")
        lines.append("")
    return "\n".join(lines)


def summary_text(result) -> str:
    """The short stdout summary: one line per case (fastest specdec backend, its speed, its ratios to the
    peers, its check), then the targets."""
    c = result["ceiling"]
    lines = [f"Summary ({result['meta']['device']}, copy ceiling {c['gbps']:.1f} GB/s)",
             f"{'op':<10} {'case':<58} {'impl':<14} {'time':>10} {'GB/s':>8} {'%copy':>6}  vs peers / check"]
    rt = ratios(result)
    seen = dict.fromkeys((r["op"], r["case"]) for r in result["rows"])
    for op, case in seen:
        rows = [r for r in result["rows"] if r["op"] == op and r["case"] == case]
        timed = [r for r in rows if r["kind"] == "specdec" and _timed(r) and r["impl"] != "torch"]
        best = min(timed, key=lambda r: r["time_s"]) if timed else None
        if best is None:
            why = "; ".join(f"{r['impl']}: " + (r["check"] if r["status"] == "ok" else f"{r['status']}, {r.get('note')}")[:40]
                            for r in rows if r["kind"] != PEER_KIND)
            peers = ", ".join(f"{r['impl']} {_fmt_time(r.get('time_s'))}" for r in rows if r["kind"] == PEER_KIND)
            lines.append(f"{op:<10} {case:<58} {'-':<14} {'':>10} {'':>8} {'':>6}  {why[:90]}"
                         + (f" | peers: {peers}" if peers else ""))
            continue
        vs = ", ".join(f"{r['vs']} {_ratio_text(r)}" for r in rt if (r["op"], r["case"], r["impl"]) == (op, case, best["impl"]))
        g = _graph(best)
        graph = f" | graph {_fmt_time(g['time_s'])} {_fmt(g.get('pct_copy'), '.1f')}%" if g else ""
        lines.append(f"{op:<10} {case:<58} {best['impl']:<14} {_fmt_time(best['time_s']):>10} "
                     f"{_fmt(best.get('gbps'), '8.1f')} {_fmt(best.get('pct_copy'), '6.1f')}  "
                     f"{vs or '-'}{graph} | {best['check']}")
    tg = targets(result)
    if tg:
        lines += ["", "Targets"]
        for t in tg:
            lines.append(f"  [{t['verdict']}] {t['source']}: {t['op']} {t['case']}: {t['impl']} {t['metric']} "
                         f"{_target_value(t)} (target >= {t['threshold']:g}{t['unit']})")
    return "\n".join(lines)


def write(result, out_dir: str, stem: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    full = dict(result, ratios=ratios(result), targets=targets(result))
    paths = [os.path.join(out_dir, f"{stem}.json"), os.path.join(out_dir, f"{stem}.md")]
    texts = [json.dumps(full, indent=1, default=str), markdown(result) + "\n"]
    for path, text in zip(paths, texts):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)  # a run killed mid-write leaves the previous complete file
    return paths


def merge(results: list[dict]) -> dict:
    """One result from several runs on one machine (the first run's meta and ceiling; every row keeps the
    % of copy computed against its own run's ceiling)."""
    merged = {"meta": results[0]["meta"], "ceiling": results[0]["ceiling"], "cases": [], "rows": [],
              "ceilings": [r["ceiling"] for r in results], "wall_s": round(sum(r.get("wall_s", 0) for r in results), 1)}
    for r in results:
        merged["cases"] += r["cases"]
        merged["rows"] += r["rows"]
    return merged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description="merge and summarize result files")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default=None, help="write the merged JSON + markdown into this folder")
    ap.add_argument("--name", default="bench-merged", help="file stem of the merged result")
    args = ap.parse_args(argv)
    results = []
    for path in args.files:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"skipping {path}: {exc}")
    if not results:
        print("no results to summarize")
        return 1
    result = merge(results)
    if args.out:
        print("wrote " + " ".join(write(result, args.out, args.name)))
    print(summary_text(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
