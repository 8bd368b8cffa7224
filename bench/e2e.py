"""End-to-end decoding benchmark: our AR and speculative loops vs Hugging Face transformers, same weights.

    python -m bench.e2e [--target DIR] [--draft DIR] [--parallel DIR] [--prompts N] [--max-new-tokens N] [--device cuda] [--out DIR]

Side by side on the same checkpoints and prompts (held-out Python standard library files, never seen
in training), one request at a time (transformers' assisted generation is single-request), greedy:
  ours:          AR, speculative with the draft model (chain, static tree, EAGLE-2 dynamic tree), with the
                 target's MTP module (--mtp; chain and dynamic tree), the parallel drafter (--parallel: one
                 forward proposes every level; chain and adaptive), prompt lookup (n-gram), suffix decoding
                 (its memory of earlier passes' outputs emptied before each pass: the passes repeat the prompts)
  transformers:  LlamaForCausalLM.generate plain, with assistant_model= (the draft), and with
                 prompt_lookup_num_tokens= (skipped when transformers is not installed)
More rows run our AR and chain speculation on all prompts as one batch, and sampled (--sample-temperature), also
with top-k 50 and top-p 0.9:
greedy outputs of a small model often repeat themselves, which flatters tau; sampled text does not. With
--device cuda our steps replay CUDA graphs, and a few rows also run eagerly ([eager]).
Reports new tokens/s (best of --repeats passes: other work on the machine only ever slows a pass), tokens per target step
(tau, ours), the acceptance rate by depth, the time outside the target's forward, and whether each greedy output is
identical to our AR output. Each row keeps one decoder across its warm-up and passes, as a server does. Writes
e2e.json and e2e.md (e2e-compile.*, e2e-cuda.* for --compile, --device cuda) under bench/results/ (machine, versions,
commit, date), and e2e-acceptance.png (acceptance against depth, one line per drafter; needs matplotlib).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import sysconfig
import time
import zlib
from typing import NamedTuple, Optional

import torch

import specdec
from specdec.loop.adaptive import measure_target_costs
from specdec.loop.decoding import CudaStepGraph, SpeculativeDecoder
from specdec.loop.drafters import (DraftModelDrafter, MTPDrafter, NgramDrafter, NoDrafter, ParallelDrafter,
                                   SuffixDrafter)
from specdec.loop.models.hf import load_model
from specdec.loop.models.mtp import load_mtp
from specdec.loop.models.tokenizer import ByteTokenizer

from .timing import machine_info

ASSETS = os.path.join(os.path.dirname(specdec.__file__), "loop", "assets")
RESULTS = os.path.join(os.path.dirname(__file__), "results")
# (row name, decoder factory over the loaded models m: target, draft, mtp); "auto": adaptive speculation
def _decoder(drafter, adaptive=False):
    return lambda m, graphs: SpeculativeDecoder(m["target"], drafter(m), adaptive=adaptive, compile=m["compile"],
                                                cuda_graphs=graphs or False)


OURS = [("ours AR", _decoder(lambda m: NoDrafter()))] + [
    (f"ours spec {tree}", _decoder(lambda m, tree=tree: DraftModelDrafter(m["draft"], tree)))
    for tree in ("chain:3", "chain:4", "chain:6", "chain:8", "chain:10", "chain:12", "tree:2,1,1", "dynamic:8,4,2",
                 "dynamic:12,5,2")] + [
    ("ours spec auto (chain:8, adaptive)", _decoder(lambda m: DraftModelDrafter(m["draft"], "chain:8"), True))] + [
    (f"ours prompt lookup chain:{k}", _decoder(lambda m, k=k: NgramDrafter(num_tokens=k))) for k in (4, 8)] + [
    ("ours prompt lookup auto (chain:8, adaptive)", _decoder(lambda m: NgramDrafter(num_tokens=8), True))]
MTP_ROWS = [(f"ours mtp {tree}", _decoder(lambda m, tree=tree: MTPDrafter(m["target"], m["mtp"], tree)))
            for tree in ("chain:2", "chain:3", "chain:4", "chain:6", "dynamic:8,4,2")] + [
    ("ours mtp auto (chain:8, adaptive)", _decoder(lambda m: MTPDrafter(m["target"], m["mtp"], "chain:8"), True))]
# one forward of the parallel drafter proposes every level: its best chains on the shipped pair, and adaptive
PARALLEL_ROWS = [(f"ours parallel {tree}", _decoder(lambda m, tree=tree: ParallelDrafter(m["parallel"], tree)))
                 for tree in ("chain:4", "chain:8")] + [
    ("ours parallel auto (chain:8, adaptive)", _decoder(lambda m: ParallelDrafter(m["parallel"], "chain:8"), True))]
# suffix decoding at the CLI's defaults: trees of up to 16 draft tokens, 8 levels deep
SUFFIX_ROWS = [("ours suffix tree (depth 8, 16 nodes)", _decoder(lambda m: SuffixDrafter(max_depth=8))),
               ("ours suffix auto (depth 8, adaptive)", _decoder(lambda m: SuffixDrafter(max_depth=8), True))]
# the drafters' rows beyond OURS, each with the model it needs loaded (None: nothing beyond the target): a new
# drafter is one more entry here, and its row names in BATCHED and SAMPLED
MORE_ROWS = [("mtp", MTP_ROWS), ("parallel", PARALLEL_ROWS), (None, SUFFIX_ROWS)]
AUTO_ROWS = ["ours spec auto (chain:8, adaptive)", "ours mtp auto (chain:8, adaptive)",
             "ours parallel auto (chain:8, adaptive)",
             "ours prompt lookup auto (chain:8, adaptive)", "ours suffix auto (depth 8, adaptive)"]
BATCHED = ["ours AR", "ours spec chain:3", "ours spec chain:4", "ours prompt lookup chain:8", "ours mtp chain:6",
           "ours parallel chain:4", "ours suffix tree (depth 8, 16 nodes)"] + AUTO_ROWS
SAMPLED = ["ours AR", "ours spec chain:3", "ours spec chain:4", "ours spec chain:6", "ours spec chain:8",
           "ours mtp chain:2", "ours mtp chain:3", "ours mtp chain:4", "ours mtp chain:6",
           "ours parallel chain:4", "ours prompt lookup chain:8", "ours suffix tree (depth 8, 16 nodes)"] + AUTO_ROWS
FILTERED = ["ours AR", "ours spec chain:4"]
# on a GPU every row replays its steps as CUDA graphs (the default there); these also run eagerly, marked [eager]
EAGER = ["ours AR", "ours spec chain:4", "ours spec chain:8", "ours spec auto (chain:8, adaptive)", "ours mtp chain:6",
         "ours prompt lookup chain:8"]
# (and their sampled rows)
PLOTTED = ["ours spec chain:6", "ours mtp chain:6", "ours prompt lookup chain:8", "ours suffix tree (depth 8, 16 nodes)"]


FILTERS = dict(top_k=50, top_p=0.9)  # the sampled rows with filters


def held_out_prompts(n: int, n_bytes: int) -> list[str]:
    """The first ~n_bytes (to a line end) of n held-out stdlib files (the training script's split)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and zlib.crc32(os.path.relpath(p, root).encode()) % 50 == 0)
    prompts = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if len(text) < 4 * n_bytes:
            continue
        cut = text.find("\n", n_bytes)
        prompts.append(text[:cut + 1])
        if len(prompts) == n:
            break
    return prompts


TARGET_TIME = {"forward_cached": 0.0}  # seconds inside the target's cached forwards (timed_target)


def timed_target(target):
    """Wrap the target's forward_cached (this instance only) to add its time to TARGET_TIME (eager, on the CPU: a
    device runs the forward after the call returns)."""
    call = target.forward_cached

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = call(*args, **kwargs)
        TARGET_TIME["forward_cached"] += time.perf_counter() - t0
        return out

    target.forward_cached = timed


def _outside_target(run, forward_s=None):
    """run() -> Run becomes run() -> (Run, outside): the time of the decoding steps (after the prompts) spent outside
    the target's forward, as {"share": of the steps' time, "ms_per_step": per step} (None: not known).
    forward_s(batch, t): where the forward cannot be timed inside the step (a compiled step's graph, a replayed CUDA
    graph, a device's asynchronous launches), the seconds of one forward verifying t tokens per request, timed the way
    the step runs it; the steps' forward is then their count per verified width times that (not known where the
    widths vary per step: prompt lookup)."""
    def measured():
        start = TARGET_TIME["forward_cached"]
        r = run()
        forward = TARGET_TIME["forward_cached"] - start
        if forward_s is not None:
            forward = None if r.widths is None else sum(n * forward_s(batch, t) for (batch, t), n in r.widths.items())
        steps_s = r.wall - r.prompt_s if r.prompt_s is not None else None
        if forward is None or steps_s is None:
            return r, None
        return r, {"share": (steps_s - forward) / max(steps_s, 1e-9), "ms_per_step": 1e3 * (steps_s - forward) / r.steps}
    return measured


def step_graph_class(device: torch.device, compile: bool):
    """The graphs our steps replay as on this device (SpeculativeDecoder's cuda_graphs=): CUDA graphs on a GPU, as
    there by default, unless compiled; None: steps run eagerly or compiled."""
    return CudaStepGraph if device.type == "cuda" and not compile else None


def step_widths(decoder, out, widths):
    """Add a generate output's steps per (batch size, verified tree width) to widths (None: not known)."""
    if widths is None or decoder.drafter.proposes_on_host:
        return None
    B = out.summary["requests"]
    chosen = out.summary.get("depth_chosen") or {decoder.drafter.max_depth: out.summary["steps"]}
    chosen = dict(enumerate(chosen)) if isinstance(chosen, list) else chosen
    for k, n in chosen.items():  # (adaptive chains: depth k verifies k + 1 tokens)
        t = decoder.drafter.max_nodes if k == decoder.drafter.max_depth else k + 1
        widths[(B, t)] = widths.get((B, t), 0) + n
    return widths


def forward_timer(target, context: int, **how):
    """forward_s(batch, t): the best seconds of the target's cached forward over a t-token chain after `context`
    cached tokens, run `how` a loop runs it (adaptive.measure_target_costs: compiled=True, or graph_class= for graph
    replays; on a device, timed to its completion), memoized."""
    memo = {}

    def forward_s(batch, t):
        if (batch, t) not in memo:
            with specdec.value_checks(False):
                memo[(batch, t)] = measure_target_costs(target, batch, t, context, repeats=10, tokens=[t], **how)[-1]
        return memo[(batch, t)]
    return forward_s


def acceptance(stats) -> dict:
    """acceptance_by_depth and acceptance_rate_by_depth of several requests together (from their counts), given
    their `GenerationOutput.stats`."""
    steps = sum(s["steps"] for s in stats)
    accepted = [sum(c) for c in zip(*([round(a * s["steps"]) for a in s["acceptance_by_depth"]] for s in stats))]
    judged = [sum(c) for c in zip(*(s["judged_by_depth"] for s in stats))]
    return {"acceptance_by_depth": [round(a / steps, 4) for a in accepted],
            "acceptance_rate_by_depth": [round(a / j, 4) if j else None for a, j in zip(accepted, judged)]}


class Run(NamedTuple):
    """One pass of a method over the prompts: wall seconds in all, of which prompt_s before the first steps
    (None: not known); tau (tokens per target step), acceptance (by depth, rate by depth), steps and widths (steps
    per (batch size, verified tree width); None: not known) for our loops."""
    tokens: list
    wall: float
    tau: Optional[float] = None
    acceptance: Optional[dict] = None
    prompt_s: Optional[float] = None
    widths: Optional[dict] = None
    steps: int = 0


def forgetting(decoder):
    """The decoder, its drafter's memory of earlier requests' outputs (suffix decoding's global index) emptied: a
    pass repeats the earlier passes' prompts, whose outputs a new request would not find there (within a pass, a
    request still finds the earlier requests' outputs; bench.repetitive measures what that memory is worth)."""
    forget = getattr(decoder.drafter, "forget", None)
    if forget is not None:
        forget()
    return decoder


def run_ours(decoder, prompts, max_new, temperature=0.0, **filters) -> Run:
    """The prompts one at a time (steps-weighted means)."""
    tokens, wall, prompt_s, emitted, steps, stats, widths = [], 0.0, 0.0, 0, 0, [], {}
    for i, p in enumerate(prompts):
        out = decoder.generate([p], max_new, temperature, seed=i, **filters)
        widths = step_widths(decoder, out, widths)
        tokens.append(out.tokens[0])
        wall += out.summary["wall_s"]
        prompt_s += out.summary["prompt_s"]
        n = out.summary["steps"]
        emitted += out.summary["tokens_per_step"] * n
        steps += n
        stats += out.stats
    return Run(tokens, wall, emitted / steps, acceptance(stats), prompt_s, widths, steps)


def run_ours_batch(decoder, prompts, max_new) -> Run:
    out = decoder.generate(prompts, max_new)
    return Run(out.tokens, out.summary["wall_s"], out.summary["tokens_per_step"], acceptance(out.stats),
               out.summary["prompt_s"], step_widths(decoder, out, {}), out.summary["steps"])


def run_hf(model, prompts, max_new, eos, **kwargs) -> Run:
    tokens, wall = [], 0.0
    for p in prompts:
        x = torch.tensor([p], device=model.device)
        t0 = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, **kwargs)
        new = out[0, len(p):].tolist()
        wall += time.perf_counter() - t0
        tokens.append(new[:new.index(eos)] if eos in new else new)
    return Run(tokens, wall)


def import_transformers():
    """transformers, imported with the checkout's root off sys.path (`python -m` and pytest put it first):
    transformers (5.25) imports Hugging Face's `kernels` package where one is installed (it comes with transformers),
    and would find the checkout's `kernels/` folder (specdec's Triton sources, installed as specdec.kernels) and fail
    to import it; once Hugging Face's is imported, later uses find it. ImportError where transformers is missing."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    try:
        import transformers
        try:
            import transformers.integrations.hub_kernels  # noqa: F401 (where it imports `kernels`)
        except ModuleNotFoundError:  # (a transformers without that integration imports no `kernels`)
            pass
        return transformers
    finally:
        sys.path[:] = saved


def compiled_graphs() -> int:
    """The graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def mode(method: str) -> str:
    """A row's way of running: "[batch of 4]", "[T=0.8]", ... or "" (one greedy request at a time); every row is
    compared with our AR run the same way (the transformers rows: with our greedy AR)."""
    return method[method.find("["):] if "[" in method and "ours" in method else ""


def machine(device=torch.device("cpu")) -> dict:
    """bench.timing's machine record (CPU, GPU, versions, commit, date) plus what the end-to-end run depends on."""
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {**machine_info(device), "transformers": tf_version,
            "specdec_cpu_backend": "cpp" if specdec.ops.HAS_CPP else "torch (reference)"}


def markdown(res: dict) -> str:
    m, cfg = res["machine"], res["config"]
    mtp = f", {cfg['mtp_params'] / 1e6:.2f}M MTP module" if cfg.get("mtp_params") else ""
    lines = [f"# End-to-end decoding: {cfg['target_params'] / 1e6:.1f}M target, {cfg['draft_params'] / 1e6:.2f}M draft"
             f"{mtp}",
             "", f"{m['date']}, commit {m['git_commit'][:7]}, "
             + (f"{m['gpu']} (CUDA {m['cuda']}, Triton {m['triton']}), host " if m.get("gpu") else "")
             + f"{m['cpu']} ({m['cpu_count']} cores, torch threads "
             f"{m['torch_threads']}), Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
             f"specdec CPU backend: {m['specdec_cpu_backend']}, value checks {cfg['value_checks']}.", "",
             f"{cfg['prompts']} held-out stdlib prompts (~{cfg['prompt_bytes']} bytes each), greedy, "
             f"{cfg['max_new_tokens']} new tokens max, one request at a time (rows marked [batch]: all prompts in "
             "one batch, speedup against our batched AR; rows marked [T=..]: sampled at that temperature, speedup "
             "against our sampled AR), fp32 weights; each method's best of "
             f"{cfg['repeats']} passes (warm-up before each; one decoder per method, kept across them as a server "
             "keeps one)"
             + (", our decoders compiled (each step one torch.compile graph; graphs compiled in the first pass; the "
                "target's time inside a compiled step is the steps' count per width times a compiled forward's)"
                if cfg.get("compile") else "")
             + (", our steps replayed as CUDA graphs (captured in the warm-up, which decodes as many tokens), the rows "
                "marked [eager] launched eagerly (against our eager AR); the target's time inside the steps is the "
                "steps' count per width times a forward's, replayed or eager, timed to its completion"
                if cfg.get("cuda_graphs") else "") + ".", "",
             "Acceptance rate by depth d: of the steps that judged a draft token at depth d (their path had accepted "
             "d - 1), the fraction that accepted it (-: none did); how fast acceptance drops with depth, also for "
             "an adaptive row, whose steps draft to different depths. Acceptance by depth d: the fraction of all "
             "steps that accepted at least d draft tokens. Outside target: the "
             "share of the decoding steps' time (after the prompts) spent outside the target's forward (drafting, "
             "accept, rollbacks, bookkeeping), and that time per step. Speedup / tau: the loop's efficiency (1 = a step costs one AR step). "
             "Decoding speedup: the same ratio over the steps alone, without the prompts' time (the target's and "
             "the drafter's prefill, the same work in every row: it caps the end-to-end speedup).",
             "",
             "| method | new tokens/s | speedup vs ours AR | decoding speedup | tokens/step (tau) | speedup / tau | "
             "outside target | outside target per step | acceptance rate by depth | acceptance by depth | "
             "identical to ours AR |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in res["rows"]:
        if r.get("skipped"):
            lines.append(f"| {r['method']} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        efficiency = "-" if r["tau"] is None else f"{r['speedup_vs_ours_ar'] / r['tau']:.2f}"
        outside = "-" if r.get("outside_target") is None else f"{100 * r['outside_target']:.0f}%"
        per_step = "-" if r.get("outside_target_ms_per_step") is None else f"{r['outside_target_ms_per_step']:.2f} ms"
        depth = " ".join(f"{a:.2f}" for a in r.get("acceptance_by_depth") or []) or "-"
        rate = " ".join("-" if a is None else f"{a:.2f}" for a in r.get("acceptance_rate_by_depth") or []) or "-"
        same = "n/a (sampled)" if r["identical"] is None else "yes" if r["identical"] else "NO"
        decoding = "-" if r.get("decoding_speedup_vs_ours_ar") is None else f"{r['decoding_speedup_vs_ours_ar']:.2f}x"
        name = r["method"] + (f" (compiled {r['graphs_compiled_inside']} graph(s) in its best pass: not warm)"
                              if r.get("graphs_compiled_inside") else "")
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['speedup_vs_ours_ar']:.2f}x | {decoding} | "
                     f"{tau} | {efficiency} | {outside} | {per_step} | {rate} | {depth} | {same} |")
    return "\n".join(lines) + "\n"


def plot_acceptance(rows, path) -> bool:
    """The acceptance rate against depth, one line per drafter (solid greedy, dashed sampled); False without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, name in enumerate(PLOTTED):
        for r in rows:
            if r.get("acceptance_rate_by_depth") and r["method"].split(" [")[0] == name and "batch" not in r["method"]:
                acc = [float("nan") if a is None else a for a in r["acceptance_rate_by_depth"]]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", color=f"C{i}",
                        linestyle="--" if "[T=" in r["method"] else "-", label=r["method"].replace("ours ", ""))
    ax.set_xlabel("depth d (draft tokens)")
    ax.set_ylabel("acceptance rate at depth d")
    ax.set_title("of the steps that judged a draft token at depth d, the fraction accepting it", fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--draft", default=os.path.join(ASSETS, "draft"))
    ap.add_argument("--mtp", default=os.path.join(ASSETS, "mtp"), help="the target's MTP module folder")
    ap.add_argument("--parallel", default=os.path.join(ASSETS, "parallel"), help="the parallel drafter's folder")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-bytes", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="passes over all methods; each keeps its best")
    ap.add_argument("--sample-temperature", type=float, default=0.8, help="temperature of the sampled rows")
    ap.add_argument("--value-checks", action="store_true", help="keep specdec's host-side value checks on")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--methods", help="only the rows whose name matches this regular expression")
    ap.add_argument("--compile", action="store_true",
                    help="our decoders with compile=True (the first pass compiles; best of --repeats keeps a warm one)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: no method starts after them (the table has the rows run by then)")
    ap.add_argument("--device", default="cpu",
                    help="where the models run (cuda: our steps replay CUDA graphs, the rows marked [eager] do not)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    specdec.set_value_checks(args.value_checks)

    dev = torch.device(args.device)
    graph_class = step_graph_class(dev, args.compile)
    graphed = graph_class is not None
    target, draft = load_model(args.target, device=dev), load_model(args.draft, device=dev)
    models = {"target": target, "draft": draft, "compile": args.compile,
              "mtp": load_mtp(args.mtp, target.cfg, device=dev) if os.path.isdir(args.mtp) else None,
              "parallel": load_model(args.parallel, device=dev) if os.path.isdir(args.parallel) else None}
    ours = OURS + [row for need, rows in MORE_ROWS if need is None or models[need] is not None for row in rows]
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in held_out_prompts(args.prompts, args.prompt_bytes)]
    eos = target.cfg.eos_token_id

    # (row name, decoder factory, runner, its keyword arguments, cuda_graphs)
    sampled = {"temperature": args.sample_temperature}
    specs = [(name, make, run_ours, {}, graph_class) for name, make in ours]
    specs += [(f"{name} [batch of {len(prompts)}]", make, run_ours_batch, {}, graph_class) for name, make in ours
              if name in BATCHED]
    specs += [(f"{name} [T={args.sample_temperature}]", make, run_ours, sampled, graph_class) for name, make in ours
              if name in SAMPLED]
    # what accept's filters cost end to end (the drafter samples from the same filtered law)
    specs += [(f"{name} [T={args.sample_temperature} top_k={FILTERS['top_k']} top_p={FILTERS['top_p']}]", make,
               run_ours, {**sampled, **FILTERS}, graph_class) for name, make in ours if name in FILTERED]
    if graphed:
        specs += [(f"{name} [eager]", make, run_ours, {}, False) for name, make in ours if name in EAGER]
    # the target's forward where it cannot be timed inside the steps, timed the way they run it
    context = len(prompts[0]) + args.max_new_tokens // 2
    forward_s = forward_timer(target, context, compiled=args.compile, graph_class=graph_class) \
        if args.compile or graphed or dev.type != "cpu" else None
    eager_forward_s = forward_timer(target, context) if graphed else None
    if forward_s is None:  # eager on the CPU: timed inside the steps
        timed_target(target)
    # one decoder per row, kept across its warm-up and passes, as a server keeps one: its CUDA graphs and its adaptive
    # policy's learning last across generate calls. (Graphs are per max_new_tokens: the warm-up decodes as many.)
    decoders = {}
    warm_tokens = args.max_new_tokens if graphed else 8
    methods = []
    for name, make, runner, kw, graphs in specs:
        def get(name=name, make=make, graphs=graphs):
            if name not in decoders:
                decoders[name] = make(models, graphs)
            return decoders[name]
        warm = prompts if runner is run_ours_batch else prompts[:1]
        methods.append((name, _outside_target(lambda get=get, runner=runner, kw=kw: runner(
                            forgetting(get()), prompts, args.max_new_tokens, **kw),
                            eager_forward_s if graphs is False else forward_s),
                        lambda get=get, runner=runner, kw=kw, warm=warm: runner(get(), warm, warm_tokens, **kw)))
    hf_methods = [("transformers AR", {}), ("transformers assisted (assistant_model)", {"assistant": True}),
                  ("transformers prompt lookup (8 tokens)", {"prompt_lookup_num_tokens": 8})]
    skipped = []
    try:
        if args.no_transformers:
            raise ImportError("--no-transformers")
        LlamaForCausalLM = import_transformers().LlamaForCausalLM
        hf_target = LlamaForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).to(dev).eval()
        hf_draft = LlamaForCausalLM.from_pretrained(args.draft, torch_dtype=torch.float32).to(dev).eval()
    except ImportError as exc:
        skipped = [{"method": name, "skipped": f"transformers not available ({exc})"} for name, _ in hf_methods]
    else:
        for name, kw in hf_methods:
            if kw.pop("assistant", False):
                kw["assistant_model"] = hf_draft
            methods.append((name, _outside_target(lambda kw=kw: run_hf(hf_target, prompts, args.max_new_tokens, eos, **kw)),
                            lambda kw=kw: run_hf(hf_target, [prompts[0]], 8, eos, **kw)))
    if args.methods:  # the chosen rows, and our AR run each chosen way (their reference)
        chosen = [m for m in methods if re.search(args.methods, m[0])]
        modes = {""} | {mode(name) for name, *_ in chosen}  # ("": greedy AR, the reference of identical)
        methods = [m for m in methods if m in chosen or m[0] == (OURS[0][0] + " " + mode(m[0])).strip()
                   and mode(m[0]) in modes]
        skipped = [r for r in skipped if re.search(args.methods, r["method"])]
    best, compiled_in_best = {}, {}
    started = time.perf_counter()
    for rep in range(args.repeats):  # other work on the machine only slows a pass: keep each method's best
        for name, run, warm_up in methods:
            if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                print(f"pass {rep + 1}: {name}: not run (--time-budget {args.time_budget:g} s spent)", flush=True)
                continue
            warm_up()
            graphs = compiled_graphs()
            r, outside = run()
            graphs = compiled_graphs() - graphs  # compiled inside the timed run (an adaptive policy's new depth)
            if name not in best or r.wall < best[name][0].wall:
                best[name] = (r, outside)
                compiled_in_best[name] = graphs
            print(f"pass {rep + 1}: {name:40s} {sum(map(len, r.tokens)) / r.wall:8.1f} tok/s"
                  + (f"  ({graphs} graphs compiled inside)" if graphs else ""), flush=True)
    reference = best[OURS[0][0]][0].tokens
    rows = [{"method": name, "tokens_per_s": sum(map(len, r.tokens)) / r.wall, "wall_s": r.wall, "tau": r.tau,
             **(r.acceptance or {"acceptance_by_depth": None}),
             "outside_target": None if outside is None else outside["share"],
             "outside_target_ms_per_step": None if outside is None else outside["ms_per_step"],
             "identical": r.tokens == reference, "new_tokens": sum(map(len, r.tokens)), "prompt_s": r.prompt_s,
             "graphs_compiled_inside": compiled_in_best[name],
             "decoding_tokens_per_s": None if r.prompt_s is None else sum(map(len, r.tokens)) / (r.wall - r.prompt_s)}
            for name, (r, outside) in best.items()] + skipped
    ar = {mode(r["method"]): r for r in rows if r["method"].startswith(OURS[0][0])}
    for r in rows:
        if not r.get("skipped"):  # each row against our AR run the same way (run before it in every pass)
            base = ar[mode(r["method"])]
            r["speedup_vs_ours_ar"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r["decoding_tokens_per_s"] is not None:
                r["decoding_speedup_vs_ours_ar"] = r["decoding_tokens_per_s"] / base["decoding_tokens_per_s"]
            if "[T=" in r["method"]:
                r["identical"] = None  # sampled: AR and speculative draw different (equally distributed) texts
    res = {"machine": machine(dev), "rows": rows,
           "config": {"target": args.target, "draft": args.draft, "target_params": target.num_params(),
                      "draft_params": draft.num_params(), "mtp": args.mtp if models["mtp"] is not None else None,
                      "mtp_params": sum(p.numel() for p in models["mtp"].parameters()) if models["mtp"] else 0,
                      "parallel": args.parallel if models["parallel"] is not None else None,
                      "prompts": len(prompts), "prompt_bytes": args.prompt_bytes,
                      "max_new_tokens": args.max_new_tokens, "value_checks": args.value_checks,
                      "repeats": args.repeats, "sample_temperature": args.sample_temperature, "compile": args.compile,
                      "device": dev.type, "cuda_graphs": graphed}}
    os.makedirs(args.out, exist_ok=True)
    name = "e2e" + ("-compile" if args.compile else "") + ("" if dev.type == "cpu" else f"-{dev.type}")
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = markdown(res)
    if plot_acceptance(rows, os.path.join(args.out, f"{name}-acceptance.png")):
        md += f"\n![acceptance against depth]({name}-acceptance.png)\n"
    path = os.path.join(args.out, f"{name}.md")
    kept = sections_of_other_scripts(path)
    with open(path, "w") as f:
        f.write(md + kept)
    print(md)


def sections_of_other_scripts(path: str) -> str:
    """The sections another script wrote into the markdown file at path (a "## ... (bench.<script>)" heading, to the
    next "## " heading), to keep when this one rewrites it (bench.verifiers writes one into e2e.md)."""
    if not os.path.exists(path):
        return ""
    text = open(path).read()
    kept = [m.group(0).rstrip("\n") for m in re.finditer(r"^## .*\(bench\.\w+\).*\n(?:(?!## ).*\n?)*", text, re.M)]
    return "".join("\n" + section + "\n" for section in kept)

if __name__ == "__main__":
    main()
