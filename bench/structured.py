"""Structured generation under speculation: JSON under a schema, masked autoregressive decoding against each drafter
with and without jump-forward, on the shipped pair.

    python -m bench.structured [--prompts 4] [--max-new-tokens 96] [--schemas nested,enum,numbers]
                               [--temperatures 0,0.8] [--batch-sizes 1,4] [--repeats 2] [--methods REGEX] [--out DIR]

Every row decodes the same prompts under every schema (`generate(..., grammar={"json_schema": ...})`), greedy and
sampled, one request at a time (batch 1) and in batches: masked AR (the grammar's masks, no drafter), the draft
model, the target's MTP module, prompt lookup and suffix decoding, each with and without jump-forward (the tokens a
grammar forces proposed as a chain), and jump-forward with no drafter. Reports new tokens/s (each
row's best of --repeats passes; a fresh decoder each pass, so that suffix decoding's global index never holds a
previous pass's outputs), the speedup against masked AR run the same way (temperature, batch size), tokens per step,
the acceptance rate by depth, the matchers' host time per step (`summary["grammar_s"]`) and its share of the steps'
time, the fraction of the emitted tokens that jump-forward forced, and whether greedy outputs equal masked AR's.

Every output is validated: a complete one (ended at the EOS) is a JSON document of its schema (json.loads and a
check of the schema's keywords, independent of xgrammar) that a fresh matcher accepts to its end; one cut at
--max-new-tokens is an error (too few tokens for the schema), or with --allow-truncated a prefix a fresh matcher
accepts. An invalid output raises. Writes structured.json and structured.md under --out (bench/results by default).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
from typing import NamedTuple

import torch

import specdec
from specdec.loop.decoding import SpeculativeDecoder
from specdec.loop.drafters import DraftModelDrafter, MTPDrafter, NgramDrafter, NoDrafter, SuffixDrafter
from specdec.loop.grammar import XGrammarBackend
from specdec.loop.models.hf import load_model
from specdec.loop.models.mtp import load_mtp
from specdec.loop.models.tokenizer import ByteTokenizer

from .e2e import ASSETS, RESULTS, acceptance, machine

# what every row decodes under: a nested object, enums, an array of numbers (each with fixed keys, which the grammar
# forces: jump-forward's tokens)
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["x", "y"]},
        "visible": {"type": "boolean"}}, "required": ["name", "point", "visible"]},
    "enum": {"type": "object", "properties": {
        "level": {"enum": ["debug", "info", "warning", "error"]},
        "color": {"enum": ["red", "green", "blue"]},
        "retries": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["level", "color", "retries"]},
    "numbers": {"type": "object", "properties": {
        "values": {"type": "array", "minItems": 1, "maxItems": 8,
                   "items": {"type": "number", "minimum": -100, "maximum": 100}},
        "unit": {"enum": ["ms", "s"]}}, "required": ["values", "unit"]},
}
PROMPTS = ["import json\nconfig = ", "data = ", "def settings():\n    return ", "# defaults\nDEFAULTS = ",
           "payload = json.loads(", "response = {", "    kwargs = ", "options = dict(**"]
JUMP_FORWARD = 16  # the most forced tokens a step proposes


def methods(jump: int) -> list:
    """The rows: (name, decoder factory over the models (target, draft, mtp)); jump: jump-forward's most tokens."""
    def drafter_rows(name, make):
        return [(name, lambda m: SpeculativeDecoder(m[0], make(m))),
                (f"{name} + jump-forward {jump}", lambda m: SpeculativeDecoder(m[0], make(m), jump_forward=jump))]
    return ([("masked AR", lambda m: SpeculativeDecoder(m[0], NoDrafter())),
             (f"jump-forward {jump} (no drafter)", lambda m: SpeculativeDecoder(m[0], NoDrafter(), jump_forward=jump))]
            + drafter_rows("draft model chain:4", lambda m: DraftModelDrafter(m[1], "chain:4"))
            + drafter_rows("MTP chain:3", lambda m: MTPDrafter(m[0], m[2], "chain:3"))
            + drafter_rows("prompt lookup chain:4", lambda m: NgramDrafter(num_tokens=4))
            + drafter_rows("suffix (16 nodes, depth 8)", lambda m: SuffixDrafter(max_depth=8, max_tokens=16)))


def conforms(schema: dict, value) -> bool:
    """Whether value satisfies schema's keywords (those SCHEMAS use: type, properties, required, enum, minimum,
    maximum, items, minItems, maxItems, maxLength)."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        return isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"]) \
            and all(conforms(schema["properties"][k], v) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) \
            and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)) \
            and all(conforms(schema["items"], v) for v in value)
    if kind in ("integer", "number"):
        return isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool) \
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def check_output(backend: XGrammarBackend, schema_name: str, tokens: list, max_new: int, allow_truncated: bool,
                 where: str) -> bool:
    """Validate one output of SCHEMAS[schema_name] (module doc); True where it is complete. RuntimeError naming
    `where` (the row) and the text where it is invalid."""
    text = ByteTokenizer().decode(tokens)
    schema = SCHEMAS[schema_name]
    matcher = backend.matchers({"json_schema": schema}, 1)[0]
    prefix_ok = all(matcher.accept(t) for t in tokens)
    complete = len(tokens) < max_new
    if complete:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not (prefix_ok and matcher.accept(backend.stop_token_ids[0]) and matcher.is_terminated()
                and conforms(schema, value)):
            raise RuntimeError(f"{where}: an output is not a JSON document of schema {schema_name!r}: {text!r}")
    elif not allow_truncated:
        raise RuntimeError(f"{where}: an output of schema {schema_name!r} reached --max-new-tokens {max_new} before "
                           f"its end (raise it, or pass --allow-truncated): {text!r}")
    elif not prefix_ok:
        raise RuntimeError(f"{where}: a cut output leaves schema {schema_name!r}: {text!r}")
    return complete


class Pass(NamedTuple):
    """One pass of a row over every schema and prompt: outputs by (schema, prompt index); wall and prompt seconds;
    steps (the batches' steps) and request_steps (summed over requests), emitted tokens (the EOS included), forced
    ones (jump-forward), the matchers' host seconds, and each output's GenerationOutput.stats."""
    outputs: dict
    wall: float
    prompt_s: float
    steps: int
    request_steps: int
    emitted: int
    forced: int
    grammar_s: float
    stats: list

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.outputs.values()))


def run_pass(decoder, prompts: list, schemas: list, max_new: int, temperature: float, batch: int) -> Pass:
    """Every schema's prompts in batches of `batch` (seed: the batch's index, so sampled rows draw alike)."""
    outputs, stats = {}, []
    wall = prompt_s = grammar_s = 0.0
    steps = request_steps = emitted = forced = 0
    for name in schemas:
        for start in range(0, len(prompts), batch):
            out = decoder.generate(prompts[start:start + batch], max_new, temperature, seed=start // batch,
                                   grammar={"json_schema": SCHEMAS[name]})
            outputs.update({(name, start + i): tokens for i, tokens in enumerate(out.tokens)})
            s = out.summary
            wall, prompt_s, grammar_s = wall + s["wall_s"], prompt_s + s["prompt_s"], grammar_s + s["grammar_s"]
            n = sum(r["steps"] for r in out.stats)
            steps, request_steps = steps + s["steps"], request_steps + n
            emitted, forced = emitted + round(s["tokens_per_step"] * n), forced + s["forced_tokens"]
            stats += out.stats
    return Pass(outputs, wall, prompt_s, steps, request_steps, emitted, forced, grammar_s, stats)


def row_of(method: str, temperature: float, batch: int, p: Pass) -> dict:
    """A table row (the JSON's record) of a row's best pass, before its comparison with masked AR."""
    steps_s = p.wall - p.prompt_s
    return {"method": method, "temperature": temperature, "batch": batch, "new_tokens": p.new_tokens,
            "wall_s": p.wall, "tokens_per_s": p.new_tokens / p.wall, "tokens_per_step": p.emitted / p.request_steps,
            **acceptance(p.stats), "steps": p.steps,
            "matcher_ms_per_step": 1e3 * p.grammar_s / p.steps, "matcher_share": p.grammar_s / max(steps_s, 1e-9),
            "forced_fraction": p.forced / p.emitted}


def markdown(res: dict) -> str:
    m, cfg = res["machine"], res["config"]
    lines = [f"# Structured generation: JSON under a schema, {cfg['target_params'] / 1e6:.1f}M target, "
             f"{cfg['draft_params'] / 1e6:.2f}M draft, {cfg['mtp_params'] / 1e6:.2f}M MTP module", "",
             f"{m['date']}, commit {m['git_commit'][:7]}, {m['cpu']} ({m['cpu_count']} cores, torch threads "
             f"{m['torch_threads']}), Python {m['python']}, torch {m['torch']}, xgrammar {m['xgrammar']}, specdec CPU "
             f"backend: {m['specdec_cpu_backend']}, eager steps, value checks off. The CPU was shared with other jobs "
             f"(load average {' / '.join(map(str, m['load_average']))} at the start): tokens/s and the matchers' "
             "times are rough "
             "(each row's best of its passes); tokens/step, acceptance and forced fractions are exact. "
             "`python -m bench.structured`.", "",
             f"{cfg['prompts']} prompts x {len(cfg['schemas'])} schemas ({', '.join(cfg['schemas'])}: "
             f"`bench/structured.py` SCHEMAS) in every row, {cfg['max_new_tokens']} new tokens max, jump-forward "
             f"rows up to {cfg['jump_forward']} forced tokens a step; batch b: b prompts per generate call (seed: the "
             f"call's index), one decoder per row and pass, warmed up first; best of {cfg['repeats']} passes. Every "
             "output of every pass validated "
             f"({res['complete_outputs']} of {res['outputs']} complete JSON documents of their schema"
             + (", the rest cut at max_new_tokens, valid prefixes" if res["complete_outputs"] < res["outputs"] else "")
             + ").", "",
             "Speedup: against masked AR (the grammar's masks, no drafter) at the same temperature and batch size. "
             "Acceptance rate by depth d: of the steps that judged a draft token at depth d, the fraction that "
             "accepted it (forced chains included; \"1.00 x12\": 12 depths in a row at 1.00). Matcher: the host "
             "time per batch step in the grammar's matchers (walking the draft tree, filling masks, finding forced "
             "chains, advancing), and its share of the steps' time. Forced: the fraction of the emitted tokens that "
             "jump-forward proposed. Same as masked AR: greedy outputs equal masked AR's token for token. Suffix "
             "decoding's global index holds the earlier generate calls' outputs of its pass (at batch 1 the earlier "
             "requests', the same schema's among them; at batch 4 the earlier schemas'), as a server's would.", "",
             "| method | T | batch | new tokens/s | speedup vs masked AR | tokens/step | acceptance rate by depth | "
             "matcher ms/step | matcher share | forced | same as masked AR |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in res["rows"]:
        rate = runs(["-" if a is None else f"{a:.2f}" for a in r["acceptance_rate_by_depth"]]) or "-"
        same = "n/a (sampled)" if r["identical"] is None else "yes" if r["identical"] else "NO"
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_masked_ar']:.2f}x | {r['tokens_per_step']:.2f} | {rate} | "
                     f"{r['matcher_ms_per_step']:.2f} | {100 * r['matcher_share']:.1f}% | "
                     f"{100 * r['forced_fraction']:.0f}% | {same} |")
    return "\n".join(lines) + "\n"


def runs(cells: list) -> str:
    """cells joined by spaces, a run of n > 2 equal ones written once as "cell xn" (forced chains' long runs)."""
    out = []
    for cell in cells:
        if out and out[-1][0] == cell:
            out[-1][1] += 1
        else:
            out.append([cell, 1])
    return " ".join(" ".join([cell] * n) if n <= 2 else f"{cell} x{n}" for cell, n in out)


def run_rows(models, rows: list, modes: list, prompts: list, schemas: list, backend, args) -> tuple:
    """Every row in every (temperature, batch size) mode, --repeats passes, every output validated: (the best pass
    of each (row, temperature, batch size), the complete outputs, all outputs)."""
    best, complete, outputs = {}, 0, 0
    for rep in range(args.repeats):  # other work on the machine only slows a pass: keep each row's best
        for temperature, batch in modes:
            for name, make in rows:
                # a fresh decoder each pass (suffix decoding's index never holds a pass's outputs), warmed up
                decoder = make(models)
                decoder.generate(prompts[:batch], 8, temperature, grammar={"json_schema": SCHEMAS[schemas[0]]})
                p = run_pass(decoder, prompts, schemas, args.max_new_tokens, temperature, batch)
                where = f"{name} [T={temperature:g}, batch {batch}]"
                for (schema, _), tokens in p.outputs.items():
                    ok = check_output(backend, schema, tokens, args.max_new_tokens, args.allow_truncated, where)
                    complete, outputs = complete + ok, outputs + 1
                key = (name, temperature, batch)
                if key not in best or p.wall < best[key].wall:
                    best[key] = p
                print(f"pass {rep + 1}: {where:60s} {p.new_tokens / p.wall:8.1f} tok/s", flush=True)
    return best, complete, outputs


def parse_list(text: str, kind) -> list:
    """A comma-separated argument's values."""
    return [kind(x) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--draft", default=os.path.join(ASSETS, "draft"))
    ap.add_argument("--mtp", default=os.path.join(ASSETS, "mtp"), help="the target's MTP module folder")
    ap.add_argument("--prompts", type=int, default=4, help=f"the first N of {len(PROMPTS)} prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--schemas", default=",".join(SCHEMAS), help=f"of {', '.join(SCHEMAS)}")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--batch-sizes", default="1,4", help="each divides --prompts")
    ap.add_argument("--jump-forward", type=int, default=JUMP_FORWARD, help="the jump-forward rows' most forced tokens")
    ap.add_argument("--repeats", type=int, default=2, help="passes over all rows; each keeps its best")
    ap.add_argument("--methods", help="only the rows whose name matches this regular expression (and masked AR)")
    ap.add_argument("--allow-truncated", action="store_true",
                    help="accept outputs cut at --max-new-tokens (valid prefixes) instead of raising")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    schemas, temperatures = args.schemas.split(","), parse_list(args.temperatures, float)
    batch_sizes = parse_list(args.batch_sizes, int)
    if not set(schemas) <= set(SCHEMAS):
        ap.error(f"--schemas: {args.schemas!r} names a schema not in {', '.join(SCHEMAS)}")
    if not 1 <= args.prompts <= len(PROMPTS) or any(b < 1 or args.prompts % b for b in batch_sizes):
        ap.error(f"--prompts {args.prompts} (1 to {len(PROMPTS)}) must be a multiple of each of --batch-sizes")
    torch.set_num_threads(args.threads)

    target, draft = load_model(args.target), load_model(args.draft)
    mtp = load_mtp(args.mtp, target.cfg)
    models = (target, draft, mtp)
    tok = ByteTokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    backend = XGrammarBackend.byte_vocabulary(target.cfg.vocab_size, target.cfg.eos_token_id)
    rows = [(name, make) for name, make in methods(args.jump_forward)
            if name == "masked AR" or not args.methods or re.search(args.methods, name)]
    modes = [(t, b) for t in temperatures for b in batch_sizes]
    with specdec.value_checks(False):  # (the timed runs without host syncs; the caller's setting comes back)
        best, complete, outputs = run_rows(models, rows, modes, prompts, schemas, backend, args)
    result_rows = []
    for temperature, batch in modes:
        masked_ar = best[("masked AR", temperature, batch)]
        for name, _ in rows:
            p = best[(name, temperature, batch)]
            r = row_of(name, temperature, batch, p)
            r["speedup_vs_masked_ar"] = r["tokens_per_s"] / (masked_ar.new_tokens / masked_ar.wall)
            r["identical"] = p.outputs == masked_ar.outputs if temperature == 0 else None
            result_rows.append(r)
    res = {"machine": {**machine(), "xgrammar": importlib.metadata.version("xgrammar")}, "rows": result_rows,
           "outputs": outputs, "complete_outputs": complete,
           "config": {"target": args.target, "draft": args.draft, "mtp": args.mtp,
                      "target_params": target.num_params(), "draft_params": draft.num_params(),
                      "mtp_params": sum(p.numel() for p in mtp.parameters()), "prompts": args.prompts,
                      "schemas": schemas, "temperatures": temperatures, "batch_sizes": batch_sizes,
                      "max_new_tokens": args.max_new_tokens, "jump_forward": args.jump_forward,
                      "repeats": args.repeats}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "structured.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = markdown(res)
    with open(os.path.join(args.out, "structured.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
