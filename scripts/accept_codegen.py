"""What the Triton accept kernel compiles to for an H100/H200 (sm_90), no GPU needed: per launch variant at the
benchmark shape (bf16 rows, T 8, V 128256), the registers, spilled bytes and shared memory of the cubin, and a
digest of its PTX without debug information (.loc / .file lines, the debug sections) and with the kernel's name
replaced, so that two trees that generate the same code print the same digests.

    python scripts/accept_codegen.py     # the kernel of the tree this script lies in (a copy in another tree:
                                         # that tree's kernels/, whatever specdec install the Python has)

Compare the outputs of two trees (or two Triton versions) line by line: equal digests mean identical code.
Runs without TRITON_INTERPRET (the interpreter's patches break the compiler). Resource numbers need Triton's
cuobjdump (shipped with its CUDA backend).
"""
import hashlib
import importlib.util
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

import specdec  # noqa: E402
from tests.helpers import compile_for_hopper, resource_usage  # noqa: E402


def load_kernels():
    """This tree's kernels/ as specdec.kernels (setup.py's package_dir mapping; an editable install of another
    checkout would map it there)."""
    spec = importlib.util.spec_from_file_location("specdec.kernels", ROOT / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["specdec.kernels"] = specdec.kernels = module
    spec.loader.exec_module(module)
    from specdec.kernels import accept
    return accept


ka = load_kernels()

T, V = 8, 128_256
TYPES = {"target_ptr": "*bf16", "draft_ptr": "*bf16", "tokens_ptr": "*i32", "parents_ptr": "*i32",
         "temp_ptr": "*fp32", "seeds_ptr": "*i64", "num_nodes_ptr": "*i32", "offsets_ptr": "*i64", "mask_ptr": "*i32",
         "row_offsets_ptr": "*i64", "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32",
         "acc_ptr": "*i32", "num_acc_ptr": "*i32", "next_ptr": "*i64", "state_i_ptr": "*i32", "state_f_ptr": "*fp32",
         "part_f_ptr": "*fp32", "part_i_ptr": "*i32", "search_i_ptr": "*i32", "search_f_ptr": "*fp32",
         "search_d_ptr": "*fp64", "sel_count_ptr": "*i32", "sel_mass_ptr": "*fp64", "sel_value_ptr": "*fp32",
         # step 0's (penalties, bias, min-tokens), in trees whose kernel takes them
         "rep_ptr": "*fp32", "freq_ptr": "*fp32", "pres_ptr": "*fp32", "counts_ptr": "*i32", "prompt_ptr": "*i32",
         "bias_ids_ptr": "*i32", "bias_values_ptr": "*fp32", "min_tokens_ptr": "*i32", "stop_ids_ptr": "*i32",
         "generated_ptr": "*i64"}
# (first split launch, later split launch, walker after split launches)
LAUNCHES = {"first": (True, False), "split": (False, False), "walk": (False, True)}


def variants():
    """(name, method, filters, draft, probs, packed, launch) of every launch variant the tests' compile reports
    cover: each method with and without filters and draft logits where it takes them, and the PROBS and PACKED
    switches on the token-wise draft-logits launches."""
    out = []
    for method, filter_options, draft_options in (("token", (False, True), (True, False)), ("block", (False,), (True,)),
                                                  ("traversal", (False, True), (True,))):
        for filters in filter_options:
            for draft in draft_options:
                for launch in LAUNCHES:
                    out.append((method, filters, draft, False, False, launch))
    out += [("token", False, True, True, False, launch) for launch in ("split", "walk")]
    out.append(("token", False, True, False, True, "split"))
    return out


def entry_kernel(walker: bool):
    """(jit function, extra constexprs) of a split launch or the walker: the entry kernel with its WALKER switch, or
    in a tree from before the two were one kernel, `_split_kernel` / `_walk_kernel`."""
    if hasattr(ka, "_split_kernel"):
        return (ka._walk_kernel if walker else ka._split_kernel), {}
    return ka.launch._accept_kernel, {"WALKER": walker}


def resources(kernel):
    """(registers, spilled bytes a thread, shared bytes) of a compiled kernel (the first two None without
    cuobjdump)."""
    return (*resource_usage(kernel), kernel.metadata.shared)


def ptx_digest(kernel) -> str:
    """sha256 (12 hex digits) of the PTX without debug information (the debug sections, .loc / .file lines and the
    $L__tmp labels that anchor inlined scopes), without comments, and with the kernel's name as KERNEL."""
    ptx = kernel.asm["ptx"].split(".section\t.debug")[0].split(".section .debug")[0]
    lines = [line.split("//")[0].rstrip() for line in ptx.splitlines()
             if not re.match(r"\s*(\.(loc|file)\b|\$L__tmp\d+:)", line)]
    text = "\n".join(line for line in lines if line).replace(kernel.metadata.name, "KERNEL")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def main() -> None:
    print(f"{ka.__file__}: triton {triton.__version__}, sm_90, bf16, T {T}, V {V}")
    print(f"{'variant':58} {'regs':>5} {'spill':>6} {'shared':>7}  ptx")
    for method, filters, draft, probs, packed, launch in variants():
        cfg = ka._config(T, V, 2, torch.device("cuda"), filters, method == "block", method == "traversal")
        S = cfg["num_splits"]
        first, walker = LAUNCHES[launch]
        fn, extra = entry_kernel(walker)
        constexprs = dict(HAS_DRAFT=draft, HAS_OFFSETS=True, HAS_FILTERS=filters, PROBS=probs, PACKED=packed,
                          BLOCK=method == "block", TRAVERSAL=method == "traversal", IS_FIRST=first, NUM_SPLITS=S,
                          SPLIT_V=triton.cdiv(triton.cdiv(V, S), cfg["block_v"]) * cfg["block_v"],
                          BLOCK_V=cfg["block_v"], T_BLOCK=T, S_BLOCK=triton.next_power_of_2(S),
                          PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"], NUM_PIVOTS=cfg["num_pivots"], CAP=cfg["cap"],
                          SELECT_BLOCK=cfg["select_block"], PAIR_BLOCK=cfg["pair_block"], **extra)
        if "HAS_PENALTIES" in fn.arg_names:  # (step 0 off, as the tests' walk group compiles it)
            constexprs.update(HAS_PENALTIES=False, FILTER_ORDER=0)
        # pointers, strides and V 16-divisible, as a launch at this shape marks them
        kernel = compile_for_hopper(fn, TYPES, constexprs,
                                    lambda name: name.startswith("stride_") or name == "V" or name in TYPES,
                                    cfg["num_warps"])
        regs, spill, shared = resources(kernel)
        name = f"{method},filters={filters},draft={draft},{launch}" + (",probs" if probs else "") + \
            (",packed" if packed else "")
        print(f"{name:58} {regs!s:>5} {spill!s:>6} {shared!s:>7}  {ptx_digest(kernel)}", flush=True)


if __name__ == "__main__":
    main()
