"""Property-based fuzzing of bad input: a valid call (tests/fuzz/strategies.py) with one argument broken (a list or a
0-dim tensor for a tensor, a wrong dtype or rank, an empty dimension, an index past its range or past 2**32, a NaN,
an infinite or huge number, aliased caches) is refused on every backend with a ValueError / TypeError whose message
starts with the broken argument's name, before anything is written. Edge values that are valid (top_p 1e-50, a
float64 min_p just below 1, windows near 2**31) are served."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from tests.fuzz.strategies import (BACKENDS, accept_cases, append_cases, assert_untouched, assert_well_formed_error,
                                   attention_cases, build_tree_cases, first_word, fuzz, op_argument_names,
                                   rollback_cases, run_on)
from tests.fuzz.test_fuzz_ops import describe

ANY = None  # a mutation whose result may be valid: served, or refused naming any argument


def tensor_names(args):
    return [k for k, v in args.items() if isinstance(v, torch.Tensor)]


def as_list(draw, args):
    name = draw(st.sampled_from(tensor_names(args)))
    return dict(args, **{name: args[name].tolist()}), (name,)


def zero_dim(draw, args):
    name = draw(st.sampled_from(tensor_names(args)))
    return dict(args, **{name: args[name].reshape(-1)[:1].reshape(()).clone()
                         if args[name].numel() else args[name].new_zeros(())}), (name,)


# the arguments whose shapes follow another's: a wrong rank of one may be reported as the other's mismatch
SHAPE_PARTNERS = {"k_cache": ("v_cache",), "v_cache": ("k_cache",), "k_new": ("v_new", "k_cache"), "v_new": ("k_new",)}


def extra_dim(draw, args):
    name = draw(st.sampled_from(tensor_names(args)))
    x = args[name]
    if name == "k_cache" and x.dim() == 4 and args.get("v_cache", 0) is None and "accepted_nodes" in args:
        return dict(args, k_cache=x.unsqueeze(0)), ()  # kv_rollback's single cache: a stack of one layer, valid
    return dict(args, **{name: x.unsqueeze(0)}), (name, *SHAPE_PARTNERS.get(name, ()))


def wrong_dtype(draw, args):
    name = draw(st.sampled_from(tensor_names(args)))
    x = args[name]
    other = draw(st.sampled_from([torch.bool, torch.uint8, torch.int16, torch.complex64] +
                                 ([torch.int32] if x.is_floating_point() else [torch.float32])))
    return dict(args, **{name: x.to(other)}), (name,)


def emptied(draw, args):
    """A dimension of some tensor made empty: B = 0, T = 0, V = 0, Hkv = 0, D = 0, ... (valid or not)."""
    name = draw(st.sampled_from(tensor_names(args)))
    x = args[name]
    if x.dim() == 0:
        return args, ANY
    d = draw(st.integers(0, x.dim() - 1))
    return dict(args, **{name: x.narrow(d, 0, 0)}), ANY


GENERIC = [as_list, zero_dim, extra_dim, wrong_dtype, emptied]


def set_index(args, name, b_i, value):
    x = args[name].clone().long()
    x[b_i] = value
    return x


# ----------------------------------------------------------------------------------------------
# per-op mutations: (draw, args) -> (args, the names a refusal may start with, ANY, or () for "must be served")
# ----------------------------------------------------------------------------------------------
def accept_tokens_out_of_range(draw, args):
    if "cu_num_nodes" in args or args["tokens"].shape[1] < 2 or int(args["num_nodes"].max() if args.get(
            "num_nodes") is not None else args["tokens"].shape[1]) < 2:
        return args, ANY
    V = args.get("target_logits", args.get("target_probs")).shape[-1]
    nn = args.get("num_nodes")
    b = int(torch.argmax(nn.long())) if nn is not None else 0
    value = draw(st.sampled_from([V, -1, 2**31, 2**32 + draw(st.integers(0, V - 1)), -(2**32) + 1]))
    return dict(args, tokens=set_index(args, "tokens", (b, 1), value)), ("tokens",)


def accept_num_nodes_out_of_range(draw, args):
    if "cu_num_nodes" in args:
        return args, ANY
    B, T = args["tokens"].shape
    b = draw(st.integers(0, B - 1))
    value = draw(st.sampled_from([0, -1, T + 1, 2**32 + 1, 2**32 + T, 2**32 + 2, -(2**32) + 1]))
    nn = torch.full((B,), T, dtype=torch.int64) if args.get("num_nodes") is None else args["num_nodes"].long().clone()
    nn[b] = value
    return dict(args, num_nodes=nn), ("num_nodes",)


def accept_bad_temperature(draw, args):
    B = args["seeds"].shape[0]
    value = draw(st.sampled_from([math.nan, -1.0, math.inf, -1e-30, 1e39, 1e300]))
    if draw(st.booleans()) or value > 1e38 and B > 1:
        dtype = draw(st.sampled_from([torch.float64] + ([torch.float32] if abs(value) < 1e38 else [])))
        t = torch.full((B,), value, dtype=dtype)
    else:
        t = value
    return dict(args, temperature=t), ("temperature",)


def accept_bad_filter(draw, args):
    B = args["seeds"].shape[0]
    name, value = draw(st.sampled_from([("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
                                        ("top_p", -1e-30), ("min_p", 1.0), ("min_p", -0.1), ("min_p", math.nan)]))
    if draw(st.booleans()):
        value = torch.full((B,), value, dtype=torch.int64 if name == "top_k" else torch.float64)
    return dict(args, **{name: value}), (name,)


def accept_valid_extreme_filter(draw, args):
    """Values valid in the caller's dtype, which fp32 rounding must not turn into a refusal."""
    B = args["seeds"].shape[0]
    name, value, dtype = draw(st.sampled_from([("top_p", 1e-50, None), ("top_p", 1e-50, torch.float64),
                                               ("top_p", 1e-300, torch.float64), ("min_p", 1 - 1e-12, torch.float64),
                                               ("min_p", 1 - 1e-12, None), ("min_p", 5e-324, None)]))
    return dict(args, **{name: value if dtype is None else torch.full((B,), value, dtype=dtype)}), ()


def accept_nan_row(draw, args):
    law = "target_logits" if "target_logits" in args else "target_probs"
    x = args[law].clone()
    first_row = x[(0,) * (x.dim() - 1)]  # a view in any layout the strategy drew, unlike x.view(-1, V)
    first_row[draw(st.integers(0, x.shape[-1] - 1))] = draw(st.sampled_from([math.nan, math.inf]))
    return dict(args, **{law: x}), (law,)


def accept_bad_sampling_parameter(draw, args):
    """One of accept's step-0 or logprob arguments out of its domain (the others valid, or absent)."""
    B = args["seeds"].shape[0]
    V = args.get("target_logits", args.get("target_probs")).shape[-1]
    counts = torch.zeros(B, V, dtype=torch.int32)
    bad = draw(st.sampled_from([
        (dict(repetition_penalty=draw(st.sampled_from([0.0, -1.0, math.nan, math.inf])), output_token_counts=counts),
         "repetition_penalty"),
        (dict(frequency_penalty=torch.full((B,), math.nan), output_token_counts=counts), "frequency_penalty"),
        (dict(presence_penalty=0.5), "output_token_counts"),
        (dict(presence_penalty=0.5, output_token_counts=counts - 1), "output_token_counts"),
        (dict(presence_penalty=0.5, output_token_counts=torch.full((B, V), 2**40)), "output_token_counts"),
        (dict(repetition_penalty=1.5, output_token_counts=counts,
              prompt_token_mask=torch.zeros(B, (V + 31) // 32 + 1, dtype=torch.int32)), "prompt_token_mask"),
        (dict(logit_bias=(torch.full((B, 2), draw(st.sampled_from([V, -2, 2**40]))), torch.zeros(B, 2))),
         "logit_bias"),
        (dict(logit_bias=(torch.zeros(B, 2, dtype=torch.int64), torch.full((B, 2), math.inf))), "logit_bias"),
        (dict(min_tokens=-1, stop_token_ids=torch.zeros(B, 1, dtype=torch.int64), output_token_counts=counts),
         "min_tokens"),
        (dict(min_tokens=2, stop_token_ids=torch.full((B, 1), V), output_token_counts=counts), "stop_token_ids"),
        (dict(return_logprobs=draw(st.sampled_from([21, -2]))), "return_logprobs"),
        (dict(filter_order="top_p_first"), "filter_order"),
    ]))
    return dict(args, **bad[0]), (bad[1],)


def accept_bad_parents(draw, args):
    if "cu_num_nodes" in args:
        return args, ANY
    T = args["parents"].shape[1]
    if T < 2 or (args.get("num_nodes") is not None and int(args["num_nodes"].max()) < 2):
        return args, ANY
    b = int(torch.argmax(args["num_nodes"].long())) if args.get("num_nodes") is not None else 0
    return dict(args, parents=set_index(args, "parents", (b, 1), draw(st.sampled_from([1, 2**32, -2, 2**32 + 0])))), \
        ("parents",)


def tree_attention_empty_heads(draw, args):
    """Hkv = 0 or D = 0 (caches and q alike)."""
    d = draw(st.sampled_from([-2, -1]))
    q = args["q"].narrow(d, 0, 0)
    k, v = args["k_cache"].narrow(d, 0, 0), args["v_cache"].narrow(d, 0, 0)
    return dict(args, q=q, k_cache=k, v_cache=v), ("q", "k_cache", "v_cache")


def tree_attention_bad_cache_lens(draw, args):
    lens = args["cache_lens"].clone()
    lens[0] = draw(st.sampled_from([-1, 2**31 - 1, -(2**31), 2**31 - 2]))
    return dict(args, cache_lens=lens), ("cache_lens",)


def tree_attention_bad_num_nodes(draw, args):
    if "cu_num_nodes" in args:
        return args, ANY
    B, T = args["q"].shape[:2]
    nn = args["num_nodes"].long().clone()
    nn[0] = draw(st.sampled_from([0, T + 1, 2**32 + 1, 2**32 + T, -(2**32) + 1]))
    return dict(args, num_nodes=nn), ("num_nodes",)


def tree_attention_bad_numbers(draw, args):
    name, value = draw(st.sampled_from([("scale", math.nan), ("scale", math.inf), ("scale", "1"), ("logits_soft_cap", -1.0),
                                        ("logits_soft_cap", math.nan), ("window_left", -2), ("window_left", 1.5),
                                        ("k_scale", 0.0), ("v_scale", math.inf), ("window_left", True)]))
    return dict(args, **{name: value}), (name,)


def tree_attention_bad_sinks(draw, args):
    """sinks: NaN or +inf at some head (-inf is valid: no sink), or one logit too many."""
    Hq = args["q"].shape[-2]
    sinks = torch.zeros(Hq, dtype=torch.float32)
    if draw(st.booleans()):
        sinks[draw(st.integers(0, Hq - 1))] = draw(st.sampled_from([math.nan, math.inf]))
    else:
        sinks = torch.zeros(Hq + 1, dtype=torch.float32)
    return dict(args, sinks=sinks), ("sinks",)


def kv_append_bad_cache_lens(draw, args):
    lens = args["cache_lens"].clone()
    lens[0] = draw(st.sampled_from([-1, 2**31 - 1, 2**31 - 2, -(2**31)]))
    return dict(args, cache_lens=lens), ("cache_lens",)


def rollback_path_out_of_range(draw, args):
    B, P = args["accepted_nodes"].shape
    if P < 2:
        return args, ANY
    path = args["accepted_nodes"].long().clone()
    num = args["num_accepted"].long().clone()
    choice = draw(st.sampled_from(["truncated node", "num", "not increasing"]))
    if choice == "truncated node":  # a node past 2**32 whose low bits make a valid path
        num[0] = 1
        path[0, :2] = torch.tensor([0, 2**32 + 1])
        return dict(args, accepted_nodes=path, num_accepted=num), ("accepted_nodes", "cache_lens")
    if choice == "num":
        num[0] = draw(st.sampled_from([-1, P, 2**32, 2**32 + 1]))
        return dict(args, accepted_nodes=path, num_accepted=num), ("num_accepted",)
    num[0] = 1
    path[0, :2] = torch.tensor([0, 0])
    return dict(args, accepted_nodes=path, num_accepted=num), ("accepted_nodes",)


def rollback_aliased_caches(draw, args):
    """K and V overlapping (one buffer, shifted by a row or a value), or a stride-0 expand of one row."""
    k = args["k_cache"] if isinstance(args["k_cache"], torch.Tensor) else args["k_cache"][0]
    shape = k.shape
    kind = draw(st.sampled_from(["shifted", "expanded"]))
    if kind == "shifted":
        shift = draw(st.sampled_from([1, shape[-1], shape[-1] * shape[-2]]))
        buf = torch.randn(k.numel() + shift).to(k.dtype)
        k2 = buf[:k.numel()].view(shape)
        v2 = buf[shift:shift + k.numel()].view(shape)
        return dict(args, k_cache=k2, v_cache=v2), ("k_cache", "v_cache")
    row = torch.randn(shape[-1]).to(k.dtype)
    return dict(args, k_cache=row.expand(shape), v_cache=torch.randn(shape).to(k.dtype)), ("k_cache",)


def rollback_cache_lens_overflow(draw, args):
    """cache_lens near 2**31 in a paged cache that addresses 2**31 positions (blocks of 2**16 rows, the table's
    last columns valid): the rows exist, the advanced cache_lens (2**31 and up) does not fit int32."""
    B = args["cache_lens"].shape[0]
    path, num = args["accepted_nodes"], args["num_accepted"]
    block_size, per = 2**16, 2**15
    k = torch.zeros(2, block_size, 1, 1, dtype=torch.float8_e4m3fn)
    v = torch.zeros(2, block_size, 1, 1, dtype=torch.float8_e4m3fn)
    table = torch.full((B, per), -1, dtype=torch.int32)
    table[:, -1] = 1
    table[:, -2] = 0
    last = path.long().gather(1, num.long().view(-1, 1)).view(-1)  # each request's furthest row: the capacity's last
    lens = (2**31 - 1 - last).to(torch.int32)
    overflows = bool((last == num.long()).any())  # a path 0..n advances cache_lens to 2**31
    return dict(args, k_cache=k, v_cache=v, block_table=table, cache_lens=lens), ("cache_lens",) if overflows else ANY


MUTATIONS = {
    "build_tree": GENERIC,
    "accept": GENERIC + [accept_tokens_out_of_range, accept_num_nodes_out_of_range, accept_bad_temperature,
                         accept_bad_filter, accept_valid_extreme_filter, accept_nan_row, accept_bad_parents,
                         accept_bad_sampling_parameter],
    "tree_attention": GENERIC + [tree_attention_empty_heads, tree_attention_bad_cache_lens,
                                 tree_attention_bad_num_nodes, tree_attention_bad_numbers, tree_attention_bad_sinks],
    "kv_append": GENERIC + [kv_append_bad_cache_lens],
    "kv_rollback": GENERIC + [rollback_path_out_of_range, rollback_aliased_caches, rollback_cache_lens_overflow],
}
CASES = {"build_tree": lambda backend: build_tree_cases(), "accept": lambda backend: accept_cases(backend=backend),
         "tree_attention": lambda backend: attention_cases(backend=backend),
         "kv_append": lambda backend: append_cases(backend=backend),
         "kv_rollback": lambda backend: rollback_cases(backend=backend)}


def check_mutated(op, base, args, names, backend):
    """A mutated call on `backend`: refused naming one of `names` (ANY: any argument, or served), or served (():
    a valid change, checked on a base case the reference serves: a drawn case may be invalid already)."""
    note(describe(args))
    if names == ():
        assume(run_on(op, base, "torch")[1] is None)
    result, error, after = run_on(op, args, backend)
    if names == ():
        assert error is None, f"{op}: valid input refused: {error}"
        return
    if error is None:
        assert names is ANY, f"{op} on {backend}: served input that must be refused naming {names}"
        return
    assert_well_formed_error(error, op_argument_names(op), f"{op} on {backend}")
    assert names is ANY or first_word(error).split("[")[0].split(",")[0] in names, \
        f"{op} on {backend}: refused naming {first_word(error)!r}, expected one of {names}: {error[1]}"
    assert_untouched(args, after, f"{op} on {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(MUTATIONS))
@fuzz
@given(data=st.data())
def test_bad_input_is_refused_naming_it(op, backend, data):
    base = data.draw(CASES[op](backend))
    mutate = data.draw(st.sampled_from(MUTATIONS[op]), label="mutation")
    args, names = mutate(data.draw, base)
    check_mutated(op, base, args, names, backend)
