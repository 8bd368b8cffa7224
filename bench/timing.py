"""Timers, the copy-bandwidth ceiling, and the facts about the machine a result was measured on.

GPU: triton.testing.do_bench (CUDA events; it clears the L2 cache before every call, so the inputs
come from HBM as in a real decode step; median), twice per implementation: called eagerly (Python and
launch overhead included: what a plain script sees) and as the replay of a CUDA graph captured from one
call (`time_graph`: how engines run a decode or verification step; launch gaps shrink to the GPU's own). CPU: time.perf_counter around each call after a
warmup, median; the CPU timer does not flush caches (this machine's 480 MiB L3 can hold a benchmark's
inputs), so a CPU kernel may exceed 100% of the copy ceiling: compare CPU backends with their peers.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def time_fn(fn: Callable, device: torch.device, *, budget_s: float = 0.4, max_reps: int = 50) -> dict:
    """{"time_s": median seconds per call, "time_min_s": fastest call, "reps", "timer"}. On a shared CPU
    the gap between median and min shows how much other work disturbed the measurement."""
    if device.type == "cuda":
        import triton.testing
        warmup_ms, rep_ms = max(5, int(budget_s * 250)), max(20, int(budget_s * 1000))
        try:
            times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
        except AssertionError:  # a triton without return_mode="all"
            times = [triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")]
        return {"time_s": statistics.median(times) * 1e-3, "time_min_s": min(times) * 1e-3, "reps": len(times),
                "timer": "triton.do_bench"}
    fn()  # warmup: first-call costs (allocations, lazy init) out of the measurement
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"time_s": statistics.median(times), "time_min_s": min(times), "reps": len(times), "timer": "perf_counter"}


def time_graph(fn: Callable, device: torch.device, *, budget_s: float = 0.4) -> dict:
    """time_fn of the replay of a CUDA graph captured from one call of `fn` (after warmup calls on a side
    stream, as torch.cuda.graphs requires). Raises when `fn` cannot be captured (a host sync, say)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # first-call work (allocations, compilation) stays out of the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize(device)
    timing = time_fn(graph.replay, device, budget_s=budget_s)
    timing["timer"] += " on CUDA-graph replay"
    del graph
    return timing


def copy_ceiling(device: torch.device, sizes_mib=None, budget_s: float = 0.4) -> dict:
    """The copy-bandwidth ceiling: the best (read + write) GB/s of dst.copy_(src) over large buffers
    (preallocated and touched, so page faults stay out of the measurement); `sweep` lists every size."""
    if sizes_mib is None:
        sizes_mib = (1024, 4096) if device.type == "cuda" else (1024,)
    best, sweep = None, []
    for mib in sizes_mib:
        src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
        dst = torch.zeros_like(src)
        timing = time_fn(lambda: dst.copy_(src), device, budget_s=budget_s, max_reps=10)
        seconds, timer = timing["time_s"], timing["timer"]
        gbps = 2 * src.numel() * 4 / seconds / 1e9
        sweep.append({"mib": mib, "gbps": round(gbps, 1)})
        if best is None or gbps > best["gbps"]:
            best = {"gbps": gbps, "bytes": 2 * src.numel() * 4, "seconds": seconds, "timer": timer,
                    "method": f"dst.copy_(src), {mib} MiB {device.type} buffers, read + write bytes"}
        del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(best, sweep=sweep)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info(device: torch.device) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        # outside a git checkout (a copied tree), the caller may name the commit in SPECDEC_GIT_COMMIT
        "git_commit": _git("rev-parse", "HEAD") or os.environ.get("SPECDEC_GIT_COMMIT", "unknown"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "load_average": [round(v, 2) for v in os.getloadavg()],  # other work sharing the CPUs at the start
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["sm_count"] = props.multi_processor_count
        info["cuda"] = torch.version.cuda
    return info
