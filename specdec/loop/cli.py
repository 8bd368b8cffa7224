"""Command line: `python -m specdec generate --prompt TEXT ...` (see `--help`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

import torch

import specdec
from .._validation import METHODS
from ..reference import FILTER_ORDERS

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
DEFAULT_TREE = "chain:4"
AUTO_TREE = "chain:8"  # --tree auto: the deepest chain the adaptive policy may choose (it picks 0..8 per step)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}  # vLLM's names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specdec", description="Speculative decoding on specdec's ops.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--target", default=os.path.join(ASSETS, "target"), help="target checkpoint folder (HF format)")
    g.add_argument("--drafter", choices=("model", "mtp", "eagle3", "parallel", "ngram", "suffix", "none"),
                   default="model",
                   help="a separate draft model (--draft), the target's own MTP module (--mtp), an EAGLE-3 head "
                        "(--eagle3), a parallel drafter "
                        "(--parallel: one forward drafts every level), prompt lookup, "
                        "suffix decoding (trees from the request's and earlier outputs' matched suffixes), or none "
                        "(plain decoding: with --jump-forward, the grammar's forced tokens alone are drafted)")
    g.add_argument("--draft", default=os.path.join(ASSETS, "draft"), help="draft checkpoint folder (HF format)")
    g.add_argument("--parallel", default=os.path.join(ASSETS, "parallel"),
                   help="parallel drafter checkpoint folder (a draft model plus a mask token, HF format)")
    g.add_argument("--mtp", help="MTP module folder (DeepSeek-V3 or Qwen3-Next names; default: the --target folder "
                                 "when it holds MTP layers, else the shipped specdec/loop/assets/mtp)")
    g.add_argument("--eagle3", help="EAGLE-3 head folder for --drafter eagle3 (the EAGLE authors' or vLLM "
                                    "speculators' layout; none is shipped: scripts/train_eagle3.py trains one)")
    g.add_argument("--tree", default=DEFAULT_TREE,
                   help="draft tree: chain:K, tree:b1,b2,..., parents:-1,0,0,..., dynamic:N,D,k "
                        "(drafters model, mtp, eagle3 and parallel); "
                        "auto (= chain:8 --adaptive); "
                        "chain:K for ngram, and for suffix its trees' depth (default %(default)s)")
    g.add_argument("--suffix-tokens", type=int, default=16,
                   help="--drafter suffix: the most draft tokens in a step's tree (default %(default)s)")
    g.add_argument("--suffix-max-match", type=int, default=32,
                   help="--drafter suffix: the longest suffix matched (default %(default)s)")
    g.add_argument("--adaptive", action="store_true",
                   help="choose each step's draft depth (0 = plain decoding) from the target's cost measured at "
                        "start-up and the running acceptance by depth (specdec.loop.adaptive)")
    g.add_argument("--compile", action="store_true",
                   help="each decoding step through torch.compile as one graph (one per batch size, depth and drafter "
                        "state; a first run compiles them, later runs reuse Inductor's disk cache); the warm-up is "
                        "then a whole run, reported as compile_s, and the AR baseline is compiled too")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each step as a CUDA graph, captured per draft depth at its second step (default: on "
                        "with --device cuda, unless --compile)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off, default)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * max p (0 = off, default)")
    g.add_argument("--filter-order", choices=FILTER_ORDERS, default="hf",
                   help="the order of top-k, top-p and min-p: hf (default: top-k, top-p, min-p), vllm (min-p first) "
                        "or sglang (top-p over the whole law, jointly with top-k)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's: logits of tokens in the prompt or the output so far divided (> 0) or multiplied "
                        "(<= 0) by it (1 = off, default)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="vLLM's: minus this times each token's count in the output so far (0 = off, default)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="vLLM's: minus this for each token in the output so far (0 = off, default)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS to token id TOKEN's logit (repeat for several tokens)")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="hold the stop tokens (--stop-token-ids, default the EOS) back until this many tokens are "
                        "generated (0 = off, default)")
    g.add_argument("--stop-token-ids", help="comma-separated token ids that --min-tokens holds back (default: the EOS)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="report each generated token's logprob and the N best of its position (0..20; JSON output)")
    g.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                   help="the target's log-softmax (raw, default) or the law the token was drawn from (processed)")
    structured = g.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE|JSON",
                            help="structured output: every output is a JSON document of this schema (a file, or the "
                                 "schema itself)")
    structured.add_argument("--regex", help="structured output: every output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE",
                            help="structured output: every output is in this EBNF grammar's language (rule root)")
    g.add_argument("--jump-forward", type=int, default=0, metavar="N",
                   help="with a grammar: propose up to N tokens the grammar forces as a chain instead of the "
                        "drafter's tree (default 0: off)")
    g.add_argument("--method", choices=METHODS, default="token",
                   help="verifier of sampled drafts: token-wise (default), block verification (chains) or "
                        "traversal verification (static trees and chains)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over the vocabulary: the target's LM head split over N gloo processes "
                        "(CPU), its logits verified by specdec.distributed.accept without gathering them (default 1)")
    g.add_argument("--compare-ar", action="store_true", help="also run plain autoregressive decoding")
    g.add_argument("--passes", type=int, default=1,
                   help="timed passes, the fastest reported; with --compare-ar they alternate speculative and plain "
                        "decoding, so that a machine whose speed drifts slows both alike (default 1)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--device", default="cpu", help="cpu (C++ ops) or cuda (Triton kernels); default %(default)s")
    g.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="weights, activations and KV caches")
    g.add_argument("--kv-cache-dtype", choices=tuple(KV_CACHE_DTYPES), default="auto",
                   help="the KV caches (target's and draft model's): auto (= --dtype) or float8 (fp8 = fp8_e4m3; "
                        "scales 1)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: small models gain nothing from more, and a busy machine "
                        "makes multi-threaded small matmuls wait on each other)")
    g.add_argument("--check-values", action="store_true",
                   help="keep specdec's host-side value checks on inside the loop (off by default here: the loop "
                        "builds its op inputs itself, and the test suite runs it with the checks on)")
    g.add_argument("--no-progress", action="store_true")
    return ap


def make_drafter(args, target):
    from .drafters import (DraftModelDrafter, Eagle3Drafter, MTPDrafter, NgramDrafter, ParallelDrafter, SuffixDrafter,
                           parse_tree)
    from .models.eagle3 import load_eagle3
    from .models.hf import load_model
    from .models.mtp import load_mtp, mtp_folder
    if args.drafter == "none":
        return None
    tree = parse_tree(AUTO_TREE if args.tree == "auto" else args.tree)
    if args.drafter in ("ngram", "suffix"):
        if tree.parents is None or list(tree.parents) != list(range(-1, len(tree.parents) - 1)):
            what = "proposes chains (chain:K)" if args.drafter == "ngram" else "takes chain:K (its trees' depth)"
            raise ValueError(f"--tree {args.tree}: the {args.drafter} drafter {what}")
        if args.drafter == "ngram":
            return NgramDrafter(num_tokens=len(tree.parents) - 1)
        if args.suffix_tokens < 1 or args.suffix_max_match < 1:
            raise ValueError("--suffix-tokens and --suffix-max-match must be >= 1")
        return SuffixDrafter(max_depth=len(tree.parents) - 1, max_tokens=args.suffix_tokens,
                             max_match=args.suffix_max_match)
    if args.drafter == "mtp":
        folder = args.mtp or (args.target if mtp_folder(args.target) else os.path.join(ASSETS, "mtp"))
        mtp = load_mtp(folder, target.cfg, dtype=DTYPES[args.dtype], device=args.device)
        return MTPDrafter(target, mtp, tree, kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    if args.drafter == "eagle3":
        if args.eagle3 is None:
            raise ValueError("--drafter eagle3: give the head's folder with --eagle3 DIR (none is shipped)")
        head = load_eagle3(args.eagle3, target, dtype=DTYPES[args.dtype], device=args.device)
        return Eagle3Drafter(target, head, tree, kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    if args.drafter == "parallel":
        parallel = load_model(args.parallel, dtype=DTYPES[args.dtype], device=args.device)
        if parallel.cfg.vocab_size != target.cfg.vocab_size + 1:
            raise ValueError(f"vocab mismatch: parallel drafter {args.parallel} has {parallel.cfg.vocab_size} tokens, "
                             f"expected the target's {target.cfg.vocab_size} plus a mask token")
        return ParallelDrafter(parallel, tree, kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])
    draft = load_model(args.draft, dtype=DTYPES[args.dtype], device=args.device)
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"vocab mismatch: draft {args.draft} has {draft.cfg.vocab_size} tokens, target "
                         f"{args.target} has {target.cfg.vocab_size}")
    return DraftModelDrafter(draft, tree, kv_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype])


def step0_args(args) -> dict:
    """generate's penalty, logit-bias and min-tokens arguments from the flags."""
    bias = {}
    for item in args.logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = bias.get(int(token), 0.0) + float(value)
        except ValueError:
            raise ValueError(f"--logit-bias {item}: expected TOKEN=BIAS (an int, a number)") from None
        if not sep:
            raise ValueError(f"--logit-bias {item}: expected TOKEN=BIAS (an int, a number)")
    stop = None
    if args.stop_token_ids is not None:
        try:
            stop = [int(x) for x in args.stop_token_ids.split(",")]
        except ValueError:
            raise ValueError(f"--stop-token-ids {args.stop_token_ids}: expected comma-separated ints") from None
    return dict(repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                presence_penalty=args.presence_penalty, logit_bias=bias or None, min_tokens=args.min_tokens,
                stop_token_ids=stop)


def grammar_arg(args) -> Optional[dict]:
    """generate's grammar spec from --json-schema, --regex or --grammar (None: free)."""
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar is not None:
        try:
            with open(args.grammar) as f:
                return {"ebnf": f.read()}
        except OSError as e:
            raise ValueError(f"--grammar {args.grammar}: {e.strerror}") from None
    if args.json_schema is None:
        return None
    text = args.json_schema
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema: neither a file nor a JSON schema ({e})") from None


def generate(args, vocab_group=None) -> dict:
    """One generate run; with args.tp > 1, in args.tp processes (each calls this with its vocab_group)."""
    if args.tp < 1:
        raise ValueError("--tp must be >= 1")
    if args.tp > 1 and args.drafter == "mtp":  # its draft logits come from the LM head that --tp shards
        raise ValueError("--drafter mtp with --tp: the MTP module's logits need the whole LM head; use --tp 1")
    if args.tp > 1 and vocab_group is None:
        if args.device != "cpu":
            raise ValueError("--tp: the processes talk over gloo, on the CPU: use --device cpu")
        return _generate_tensor_parallel(args)
    from .decoding import SpeculativeDecoder
    from .models.hf import load_model
    from .models.tokenizer import load_tokenizer
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be >= 1")
    if args.passes < 1:
        raise ValueError("--passes must be >= 1")
    if args.temperature < 0:
        raise ValueError("--temperature must be >= 0")
    if args.top_k < 0 or not 0 < args.top_p <= 1 or not 0 <= args.min_p < 1:
        raise ValueError("--top-k must be >= 0, --top-p in (0, 1], --min-p in [0, 1)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device available")
    torch.set_num_threads(max(1, args.threads))
    target = load_model(args.target, dtype=DTYPES[args.dtype], device=device)
    tok = load_tokenizer(args.target, target.cfg.vocab_size)
    drafter = make_drafter(args, target)
    prompts = [tok.encode(p) for p in args.prompt]
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    shard = None if vocab_group is None else specdec.distributed.shard_lm_head(target, vocab_group)
    adaptive = args.adaptive or args.tree == "auto"
    graphs = dict(compile=args.compile, cuda_graphs=args.cuda_graphs)
    decoders = (SpeculativeDecoder(target, drafter, kv_dtype=kv_dtype, method=args.method, vocab_shard=shard,
                                   adaptive=adaptive, jump_forward=args.jump_forward, **graphs),
                SpeculativeDecoder(target, kv_dtype=kv_dtype, vocab_shard=shard, **graphs))
    filters = dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, filter_order=args.filter_order,
                   **step0_args(args), logprobs=args.logprobs, logprobs_mode=args.logprobs_mode,
                   grammar=grammar_arg(args))
    t0 = time.perf_counter()
    for decoder in decoders[:1 + args.compare_ar]:  # warm-up, so that the timings compare steady states
        if args.compile or decoder.graph_class:  # every graph of the timed run: the same batch, length, tree, filters
            decoder.generate(prompts, args.max_new_tokens, args.temperature, args.seed, **filters)
        else:
            decoder.generate(prompts[:1], 4, grammar=filters["grammar"])  # (a grammar engine loads here too)
    compile_s = time.perf_counter() - t0 if args.compile else None
    progress = not args.no_progress and not args.json and sys.stderr.isatty()
    fastest = [None, None]  # speculative, AR
    for _ in range(args.passes):  # (the same seed: every pass emits the same tokens)
        for i, decoder in enumerate(decoders[:1 + args.compare_ar]):
            run = decoder.generate(prompts, args.max_new_tokens, args.temperature, args.seed, progress=progress,
                                   **filters)
            if fastest[i] is None or run.summary["tokens_per_s"] > fastest[i].summary["tokens_per_s"]:
                fastest[i] = run
    spec, ar = fastest
    result = {"prompt": args.prompt, "text": [tok.decode(t) for t in spec.tokens], "tokens": spec.tokens,
              "tokens_per_step": spec.summary["tokens_per_step"],
              **{key: spec.summary[key]
                 for key in ("acceptance_by_depth", "acceptance_rate_by_depth", "judged_by_depth")},
              "spec_tokens_per_s": spec.summary["tokens_per_s"], "spec_wall_s": spec.summary["wall_s"],
              "steps": spec.summary["steps"], "drafter": args.drafter, "tree": args.tree, "method": args.method,
              "temperature": args.temperature, **filters, "device": str(device), "dtype": args.dtype,
              "kv_cache_dtype": args.kv_cache_dtype, "tp": args.tp, "adaptive": adaptive, "compile_s": compile_s,
              "depth_chosen": spec.summary.get("depth_chosen"), "requests": spec.stats, "passes": args.passes,
              **{key: spec.summary[key] for key in ("grammar_s", "forced_tokens") if key in spec.summary}}
    if args.logprobs is not None:
        result.update(token_logprobs=spec.logprobs, top_logprobs=spec.top_logprobs)
    if args.compare_ar:
        result.update(ar_tokens=ar.tokens, ar_tokens_per_s=ar.summary["tokens_per_s"], ar_wall_s=ar.summary["wall_s"],
                      identical=ar.tokens == spec.tokens,
                      speedup=spec.summary["tokens_per_s"] / ar.summary["tokens_per_s"])
    return result


def _generate_tensor_parallel(args) -> dict:
    """generate(args) in args.tp processes of one gloo group (a file store); rank 0's result."""
    import tempfile
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_tensor_parallel_rank, (args, d), nprocs=args.tp)
        with open(os.path.join(d, "result.json")) as f:
            result = json.load(f)
    if "error" in result:
        raise ValueError(result["error"])
    return result


def _tensor_parallel_rank(rank: int, args, d: str) -> None:
    import torch.distributed as dist
    from .models.hf import CheckpointError
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=rank, world_size=args.tp)
    if rank:
        args.no_progress = True
    try:
        with specdec.value_checks(args.check_values):
            result = generate(args, vocab_group=dist.group.WORLD)
    except (CheckpointError, ValueError) as exc:  # (the same on every rank: the inputs are)
        result = {"error": str(exc)}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump(result, f)


def print_text(r: dict) -> None:
    for prompt, text in zip(r["prompt"], r["text"]):
        print(f"\033[1m{prompt}\033[0m{text}" if sys.stdout.isatty() else prompt + text)
        print("-" * 60)
    depth = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth"])
    rate = " ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_rate_by_depth"])
    fastest = f" (the fastest of {r['passes']} passes)" if r["passes"] > 1 else ""
    print(f"speculative ({r['drafter']}, {r['tree']}): {r['spec_tokens_per_s']:.1f} tokens/s{fastest}, "
          f"{r['tokens_per_step']:.2f} tokens/step over {r['steps']} steps")
    print(f"acceptance rate by depth: {rate} (of the steps that judged a draft at depth d, the fraction accepting it; "
          f"d = 1..)")
    print(f"acceptance by depth: {depth} (the fraction of steps accepting d or more drafts)")
    if r.get("depth_chosen"):
        chosen = ", ".join(f"{k}: {n}" for k, n in enumerate(r["depth_chosen"]) if n)
        print(f"steps per draft depth chosen (adaptive, 0 = plain decoding): {chosen}")
    if "grammar_s" in r:
        print(f"grammar: {r['forced_tokens']} tokens emitted by jump-forward; the matchers' host time "
              f"{r['grammar_s'] * 1e3:.1f} ms over {r['steps']} steps")
    if r.get("compile_s") is not None:
        print(f"torch.compile: the warm-up run (compiling each graph, or loading it from the cache) took "
              f"{r['compile_s']:.1f} s, not counted above")
    if "ar_tokens_per_s" in r:
        same = "identical" if r["identical"] else "different" + (" (expected when sampling)" if r["temperature"] else "")
        print(f"autoregressive: {r['ar_tokens_per_s']:.1f} tokens/s{fastest} -> speedup {r['speedup']:.2f}x, "
              f"outputs {same}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .models.hf import CheckpointError
    try:
        with specdec.value_checks(args.check_values):
            result = generate(args)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print_text(result)
    return 0
