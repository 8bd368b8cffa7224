"""Traversal verification (accept(..., method="traversal")) in the Triton kernel, on interpreted Triton.

The kernel walks the reference's post-order visit (reference._traversal_verify) with one scalar c per node
(`_traversal_step`). Checked here: the split launches and the walker alone give bit-identical results (with
filters and a bitmask too, mixed greedy and sampling requests, ragged trees of several shapes); greedy
requests are those of method="token"; for a fixed draft tree (and a star whose root draws through the
candidates) the law of (emitting node, next token) is the exact one (enumerated from the reference's
traversal_child_weight / traversal_residual), and on a Markov target the first two generated tokens follow
the target law (chi-square); the memory spy: the rows read are exactly those of the nodes the walk visits
(recomputed in float64 from the reference's functions with the kernel's own uniforms); the launch variants
compile for sm_90 without (more than negligible) spills.
"""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from specdec import reference
from specdec.kernels.accept.records import U_TEST, Stream
from specdec.kernels.accept.rows import _uniform
from specdec.sampling import pack_bitmask
from tests.helpers import (DEVICE, MemorySpy, accept_on, element_addresses, needs_the_compiler,
                           report_from_fresh_process)
from tests.stats import assert_law, emitted_tokens, first_tokens
from tests.ops.accept.markov import M, P_TARGET, markov_step

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.skipif(DEVICE.type != "cpu", reason="interpreter checks (the spy, the uniforms)")]

V = 11
SHAPES = {"star": [-1, 0, 0, 0, 0, 0], "two_two": [-1, 0, 0, 1, 1, 2, 2], "chain": [-1, 0, 1, 2, 3, 4, 5],
          "mixed": [-1, 0, 0, 1, 3, 1, 0]}


def _kernel():
    from specdec.kernels.accept import accept
    return accept


def _tree_batch(B, T, gen, temperature, filters=False):
    """B requests over the SHAPES (cycled), ragged num_nodes on odd requests; children drawn from the
    (unprocessed) draft law at their parent, sometimes the target's argmax (accepted paths get long)."""
    shapes = list(SHAPES.values())
    parents = torch.full((B, T), -1, dtype=torch.int32)
    num_nodes = torch.full((B,), T, dtype=torch.int32)
    for b in range(B):
        shape = shapes[b % len(shapes)]
        n = len(shape) if b % 2 == 0 else int(torch.randint(1, len(shape) + 1, (1,), generator=gen))
        parents[b, :n] = torch.tensor(shape[:n], dtype=torch.int32)
        num_nodes[b] = n
    target = torch.randn(B, T, V, generator=gen) * 1.5
    draft = target + torch.randn(B, T, V, generator=gen)
    tokens = torch.zeros(B, T, dtype=torch.int32)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            par = int(parents[b, i])
            if torch.rand((), generator=gen) < 0.3:
                tokens[b, i] = int(target[b, par].argmax())
            else:
                tokens[b, i] = int(torch.multinomial(torch.softmax(draft[b, par], -1), 1, generator=gen))
    batch = dict(target_logits=target, tokens=tokens, parents=parents, draft_logits=draft, temperature=temperature,
                 seeds=torch.arange(B, dtype=torch.int64) + 11, num_nodes=num_nodes)
    if filters:
        allowed = torch.rand(B, T, V, generator=gen) < 0.75
        allowed |= torch.nn.functional.one_hot(target.argmax(-1), V).bool()
        batch.update(top_k=torch.tensor([3, 0, 5, 2, 0, 4, 6, 0][:B], dtype=torch.int32),
                     top_p=torch.tensor([0.9, 0.8, 1.0, 1.0, 0.95, 0.7, 1.0, 0.85][:B]),
                     min_p=torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.2, 0.0][:B]),
                     token_bitmask=pack_bitmask(allowed))
    return batch


def _run(batch, method="traversal", **schedule):
    keys = ("target_logits", "tokens", "parents", "draft_logits", "temperature", "seeds", "num_nodes")
    args = [batch[k] for k in keys] + [0, None] + [batch.get(k) for k in ("top_k", "top_p", "min_p", "token_bitmask")]
    return _kernel()(*args, method, **schedule)


@pytest.mark.parametrize("filters", [False, True], ids=["plain", "filters"])
def test_traversal_schedules_agree_and_greedy_is_token_wise(filters):
    """The walker alone and two split schedules give bit-identical results; greedy requests (temperature 0)
    give method="token"'s results bit for bit; every sampled result is a path from the root."""
    gen = torch.Generator().manual_seed(7 + filters)
    B, T = 8, 7
    temps = torch.tensor([1.0, 0.8, 0.0, 1.3, 1.0, 0.0, 0.7, 1.0])
    batch = _tree_batch(B, T, gen, temps, filters)
    base = _run(batch)
    for schedule in (dict(num_splits=3, split_steps=40), dict(num_splits=2, split_steps=4)):
        got = _run(batch, **schedule)
        assert all(torch.equal(x, y) for x, y in zip(base, got)), schedule
    token = _run(batch, method="token")
    greedy = temps == 0
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(base, token))
    acc, num, nxt = base[:3]
    for b in range(B):
        path = acc[b, : int(num[b]) + 1].tolist()
        assert path[0] == 0 and all(int(batch["parents"][b, c]) == p for p, c in zip(path, path[1:])), (b, path)
        assert (acc[b, int(num[b]) + 1:] == -1).all() and 0 <= int(nxt[b]) < V
    assert int(num[~greedy].max()) >= 2  # (deep paths were walked)


# ----------------------------------------------------------------------------------------------
# the law: exact for a fixed draft tree, and over drafts on a Markov target
# ----------------------------------------------------------------------------------------------
def _exact_outcomes(P, Q, tokens, kids):
    """{(emitting node, next token): probability} of the reference's traversal verification of one fixed draft
    tree, enumerated: visit(v, w) returns the emissions of v's subtree (the rest is its failure)."""
    def visit(v, w):
        out = {}
        if w == 0.0:
            return out
        law, alive = P[v], 1.0
        for c in kids[v]:
            sub = visit(c, reference.traversal_child_weight(w, law, Q[v], int(tokens[c])))
            for key, pr in sub.items():
                out[key] = out.get(key, 0.0) + alive * pr
            alive *= 1.0 - sum(sub.values())
            law, w = reference.traversal_residual(w, law, Q[v])
            if w == 0.0:
                return out
        for y in range(len(law)):
            if law[y] > 0:
                out[(v, y)] = out.get((v, y), 0.0) + alive * w * float(law[y] / law.sum())
        return out

    return visit(0, 1.0)


@pytest.mark.parametrize("parents,tokens,n", [([-1, 0, 0, 1, 1, 2], [0, 4, 1, 4, 0, 4], 500),
                                              ([-1, 0, 0, 0], [0, 0, 0, 0], 300)], ids=["tree", "star"])
def test_traversal_follows_the_exact_law_of_a_fixed_draft_tree(parents, tokens, n):
    """A fixed draft tree, n seeds: the (emitting node, next token) pairs follow the exact law (chi-square).
    The tree's tokens were chosen (by enumeration) so that nodes 1-5, inner nodes and leaves, emit with
    probability 0.07-0.38; the star's so that the root's last children fail at once (weight 0) after its
    first one failed: the draw's candidates from the residual before (TRIAL)."""
    gen = torch.Generator().manual_seed(7)
    Vs, T, t = 5, len(parents), 1.0
    target = torch.randn(T, Vs, generator=gen)
    draft = torch.randn(T, Vs, generator=gen)
    P = [torch.softmax(target[i].double() / t, -1) for i in range(T)]
    Q = [torch.softmax(draft[i].double() / t, -1) for i in range(T)]
    exact = _exact_outcomes(P, Q, tokens, reference.children_of(parents, T))
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)
    law = torch.zeros(T * Vs, dtype=torch.float64)
    for (v, y), pr in exact.items():
        law[v * Vs + y] = pr
    assert (law.view(T, Vs).sum(-1) > 0.05).sum() >= min(5, T - 2)  # (several nodes emit often)
    batch = dict(target_logits=target.expand(n, T, Vs), tokens=torch.tensor(tokens).expand(n, T),
                 parents=torch.tensor(parents).expand(n, T), draft_logits=draft.expand(n, T, Vs), temperature=t,
                 seeds=torch.arange(n, dtype=torch.int64) + 101)
    res = accept_on("triton", **batch, method="traversal")
    node = res.accepted_nodes.gather(1, res.num_accepted.long()[:, None])[:, 0].long()
    assert_law(node * Vs + res.next_tokens, law, f"traversal on triton, a fixed draft {len(parents)}-node tree")


def test_traversal_first_two_tokens_follow_the_markov_target():
    """Children drawn i.i.d. from the drafter on the tree [-1, 0, 0, 1, 1] at t = 1: the first two generated
    tokens follow the target's Markov law (chi-square; a second step where the first emits one token)."""
    parents, t, n = [-1, 0, 0, 1, 1], 1.0, 500
    gen = torch.Generator().manual_seed(13)
    seeds = torch.arange(n, dtype=torch.int64) + 7919
    batch = markov_step(torch.zeros(n, dtype=torch.int64), parents, t, True, gen)
    out = emitted_tokens(accept_on("triton", **batch, seeds=seeds, offset=0, method="traversal"), batch["tokens"])
    first = torch.tensor([o[0] for o in out])
    short = torch.tensor([len(o) == 1 for o in out])
    second = torch.tensor([o[1] if len(o) > 1 else -1 for o in out])
    step2 = markov_step(first[short], parents, t, True, gen)
    res2 = accept_on("triton", **step2, seeds=seeds[short], offset=1, method="traversal")
    second[short] = first_tokens(res2, step2["tokens"])
    p = torch.softmax(P_TARGET.log() / t, -1)
    assert_law(first * M + second, (p[0][:, None] * p).flatten(), "traversal on triton, Markov two tokens")


# ----------------------------------------------------------------------------------------------
# the rows read
# ----------------------------------------------------------------------------------------------
@triton.jit
def _u_test_kernel(seeds_ptr, out_ptr, T, T_BLOCK: tl.constexpr):
    """The kernel's u_test uniforms of request program_id(0) at offset 0 (word 0 of (node, U_TEST))."""
    b = tl.program_id(0)
    idx = tl.arange(0, T_BLOCK)
    zero = tl.full((), 0, tl.int32)
    stream = Stream(seed=tl.load(seeds_ptr + b), off_lo=zero, base=zero)
    tl.store(out_ptr + b * T + idx, _uniform(stream, idx, U_TEST), mask=idx < T)


def _kernel_uniforms(seeds, T):
    out = torch.zeros(seeds.numel(), T, dtype=torch.float32)
    _u_test_kernel[(seeds.numel(),)](seeds, out, T, T_BLOCK=triton.next_power_of_2(T))
    return out


def _visits(P, Q, tokens, kids, u):
    """The reference's visit with the kernel's uniforms u[v] for the emission decisions: (inner nodes entered
    with w > 0, the emitting node)."""
    entered = []

    def visit(v, w):
        if w == 0.0:
            return None
        if kids[v]:
            entered.append(v)
        law = P[v]
        for c in kids[v]:
            found = visit(c, reference.traversal_child_weight(w, law, Q[v], int(tokens[c])))
            if found is not None:
                return found
            law, w = reference.traversal_residual(w, law, Q[v])
            if w == 0.0:
                return None
        return v if v == 0 or float(u[v]) < w else None

    return entered, visit(0, 1.0)


@pytest.mark.parametrize("filters", [False, True], ids=["plain", "filters"])
def test_traversal_reads_exactly_the_rows_of_the_visited_nodes(monkeypatch, filters):
    """The memory spy: the target and draft rows (every element) of each inner node the walk enters with
    weight > 0, the emitting node's target row (a leaf: its target row only), and not one element of any
    other row: no leaf's draft row, nothing of a node entered with weight 0 or never reached. The visited
    nodes are recomputed in float64 from the reference's functions with the kernel's own uniforms, and the
    kernel's accepted path is the one they give."""
    gen = torch.Generator().manual_seed(21 + filters)
    B, T = 8, 7
    temps = torch.tensor([1.0, 0.9, 1.0, 1.3, 1.0, 0.0, 0.7, 1.0])
    batch = _tree_batch(B, T, gen, temps, filters)
    batch["tokens"][0, 1:] = batch["target_logits"][0, 0].argmax()  # (a star of equal tokens: many rejections)
    spy = MemorySpy(monkeypatch)
    acc, num, _ = _run(batch, **(dict(num_splits=3, split_steps=9) if filters else {}))[:3]
    target, draft = batch["target_logits"], batch["draft_logits"]
    reads = {name: spy.counts([x]) for name, x in (("target", target), ("draft", draft))}
    monkeypatch.undo()
    u = _kernel_uniforms(batch["seeds"], T)
    kinds = set()  # (what the batch covers)
    allowed = reference.unpack_bits(batch["token_bitmask"], V) if filters else None
    for b in range(B):
        if temps[b] == 0:
            continue
        n = int(batch["num_nodes"][b])
        k, top_p, min_p = reference.request_filters(b, batch.get("top_k"), batch.get("top_p"), batch.get("min_p"))
        rows = [None if allowed is None else allowed[b, i] for i in range(n)]
        P = [reference.processed_probs(target[b, i], float(temps[b]), k, top_p, min_p, rows[i]) for i in range(n)]
        Q = [reference.processed_probs(draft[b, i], float(temps[b]), k, top_p, min_p, rows[i]) for i in range(n)]
        kids = reference.children_of(batch["parents"][b].tolist(), n)
        entered, emitter = _visits(P, Q, batch["tokens"][b].tolist(), kids, u[b])
        reference_path = [emitter]
        while reference_path[0] != 0:
            reference_path.insert(0, int(batch["parents"][b, reference_path[0]]))
        assert acc[b, : int(num[b]) + 1].tolist() == reference_path, (b, acc[b], reference_path)
        kinds |= {"inner node emits" if kids[emitter] and emitter else "leaf emits" if emitter else "root emits"}
        kinds |= {"an entered subtree fails"} if set(entered) - set(reference_path) else set()
        for i in range(T):
            want_target = i in entered or i == emitter
            want_draft = i in entered
            for name, want in (("target", want_target), ("draft", want_draft)):
                addresses = element_addresses(target if name == "target" else draft)[b, i].tolist()
                read = sum(reads[name].get(a, 0) > 0 for a in addresses)
                assert read == (V if want else 0), (b, i, name, read, entered, emitter)
    assert filters or len(kinds) == 4, kinds


def test_traversal_reads_every_row_of_an_accepted_chain(monkeypatch):
    """A chain whose drafts are the target's own tokens with a drafter equal to the target: every weight is 1,
    nothing fails, the last node emits: every row read but the last node's draft row."""
    gen = torch.Generator().manual_seed(5)
    B, T = 2, 5
    target = torch.randn(B, T, V, generator=gen)
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int32), target[:, :-1].argmax(-1).int()], 1)
    batch = dict(target_logits=target, tokens=tokens, parents=torch.arange(-1, T - 1).expand(B, T).int(),
                 draft_logits=target.clone(), temperature=torch.ones(B), seeds=torch.arange(B, dtype=torch.int64),
                 num_nodes=torch.full((B,), T, dtype=torch.int32))
    spy = MemorySpy(monkeypatch)
    acc, num, _ = _run(batch)[:3]
    reads = {name: spy.counts([batch[name]]) for name in ("target_logits", "draft_logits")}
    assert num.tolist() == [T - 1] * B and acc.tolist() == [list(range(T))] * B
    for b in range(B):
        for i in range(T):
            for name in ("target_logits", "draft_logits"):
                read = sum(reads[name].get(a, 0) > 0 for a in element_addresses(batch[name])[b, i].tolist())
                assert read == (0 if name == "draft_logits" and i == T - 1 else V), (b, i, name, read)


# ----------------------------------------------------------------------------------------------
# sm_90 compilation
# ----------------------------------------------------------------------------------------------
def hopper_compile_report() -> None:
    """Prints (JSON) the spilled bytes of every launch variant, traversal's and the others (TRAVERSAL baked in
    as False), at the benchmark shape (bf16, T 8, V 128256), like
    tests.ops.accept.test_against_reference.hopper_compile_report. Runs in a fresh process without TRITON_INTERPRET."""
    import json

    from specdec.kernels import accept as ka
    from tests.helpers import resource_usage
    from tests.ops.test_tree_attention import compile_for_hopper, spilled_bytes

    T, Vb = 8, 128_256
    types = {"target_ptr": "*bf16", "draft_ptr": "*bf16", "tokens_ptr": "*i32", "parents_ptr": "*i32",
             "temp_ptr": "*fp32", "seeds_ptr": "*i64", "num_nodes_ptr": "*i32", "offsets_ptr": "*i64",
             "mask_ptr": "*i32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "acc_ptr": "*i32",
             "num_acc_ptr": "*i32", "next_ptr": "*i64", "state_i_ptr": "*i32", "state_f_ptr": "*fp32",
             "part_f_ptr": "*fp32", "part_i_ptr": "*i32", "search_i_ptr": "*i32", "search_f_ptr": "*fp32",
             "search_d_ptr": "*fp64", "sel_count_ptr": "*i32", "sel_mass_ptr": "*fp64", "sel_value_ptr": "*fp32",
             "row_offsets_ptr": "*i64", "rep_ptr": "*fp32", "freq_ptr": "*fp32", "pres_ptr": "*fp32",
             "counts_ptr": "*i32", "prompt_ptr": "*i32", "bias_ids_ptr": "*i32", "bias_values_ptr": "*fp32",
             "min_tokens_ptr": "*i32", "stop_ids_ptr": "*i32", "generated_ptr": "*i64"}
    report = {}
    for method in ("token", "block", "traversal"):
        cfg = ka._config(T, Vb, 2, torch.device("cuda"), False, method == "block", method == "traversal")
        S = cfg["num_splits"]
        split_v = triton.cdiv(triton.cdiv(Vb, S), cfg["block_v"]) * cfg["block_v"]
        for has_filters in (False, True) if method != "block" else (False,):
            for has_draft in (True, False) if method == "token" else (True,):
                for first, walk in ((True, False), (False, False), (False, True)):
                    constexprs = dict(HAS_DRAFT=has_draft, HAS_OFFSETS=True, HAS_FILTERS=has_filters,
                                      PROBS=False, PACKED=False, BLOCK=method == "block",
                                      TRAVERSAL=method == "traversal", IS_FIRST=first, NUM_SPLITS=S, SPLIT_V=split_v,
                                      BLOCK_V=cfg["block_v"], T_BLOCK=T, S_BLOCK=triton.next_power_of_2(S),
                                      PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"], NUM_PIVOTS=cfg["num_pivots"],
                                      CAP=cfg["cap"], SELECT_BLOCK=cfg["select_block"], PAIR_BLOCK=cfg["pair_block"],
                                      WALKER=walk, HAS_PENALTIES=False, FILTER_ORDER=0)
                    kernel = compile_for_hopper(ka.launch._accept_kernel, types, constexprs, cfg["num_warps"],
                                                divisible_ints=("V",))
                    key = f"{method},filters={has_filters},draft={has_draft},first={first},walk={walk}"
                    report[key] = spilled_bytes(kernel)
                    report[key + ",regs"] = resource_usage(kernel)[0]
    print(json.dumps(report))


@needs_the_compiler
def test_traversal_compiles_for_hopper():
    """Every launch variant, traversal's included, compiles for sm_90; register spills stay negligible."""
    report = report_from_fresh_process("from tests.ops.accept.test_traversal_triton import hopper_compile_report; "
                                       "hopper_compile_report()")
    assert all(v is None or v <= 64 for k, v in report.items() if not k.endswith(",regs")), report
