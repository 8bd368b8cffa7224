"""specdec.accept on every backend against the reference: greedy results exactly, sampling results by
their structure (valid root path, tokens in the vocabulary, never a -inf entry), determinism, batch
invariance and mixed greedy/sampling batches. Losslessness of sampling: tests/ops/accept/test_lossless.py.
Sizes are small (the Triton kernel runs in the interpreter); V = 37 is not a multiple of any tile.
Inputs are built on the CPU; the tested backend runs on tests.helpers.DEVICE (SPECDEC_TEST_DEVICE=cuda
runs the compiled kernel on a GPU), the reference on the CPU."""
from __future__ import annotations

import collections

import pytest
import torch
import triton

from specdec.ops import AcceptResult
from tests.helpers import (BACKENDS, DEVICE, MemorySpy, accept_on, element_addresses, needs_the_compiler, random_trees,
                           report_from_fresh_process, to_device)

# the interpreted kernel computes log(0) = -inf and exp(-inf) on purpose (masked entries); numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

V = 37
NEG_INF = float("-inf")


def _batch(B, T, gen, *, dtype=torch.float32, kinds=("chain", "star", "random"), draft=False, masked=0.0,
           temperature=0.0):
    """Random trees whose draft tokens often equal the target argmax at their parent (long greedy paths).

    masked: fraction of target logits set to -inf (at least one entry per row stays finite).
    With draft=True, draft tokens are drawn from softmax(draft_logits[parent]) instead.
    """
    parents, num_nodes = random_trees(B, T, gen, kinds)
    target = torch.randn(B, T, V, generator=gen) * 2
    if masked:
        drop = torch.rand(B, T, V, generator=gen) < masked
        drop[..., torch.randint(0, V, (1,), generator=gen)] = False
        target = target.masked_fill(drop, NEG_INF)
    target = target.to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    draft_logits = torch.randn(B, T, V, generator=gen).to(dtype) if draft else None
    best = target.float().argmax(-1)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            p = int(parents[b, i])
            if draft:
                q = torch.softmax(draft_logits[b, p].double(), -1)
                tokens[b, i] = int(torch.multinomial(q, 1, generator=gen))
            elif torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = best[b, p]
    temp = temperature if isinstance(temperature, torch.Tensor) else torch.full((B,), float(temperature))
    return dict(target_logits=target, tokens=tokens, parents=parents, num_nodes=num_nodes, draft_logits=draft_logits,
                temperature=temp, seeds=torch.randint(0, 2**62, (B,), generator=gen))


def _check_structure(res, batch):
    """The result is a valid root path of each tree, padded with -1, and the next token is a finite-logit
    entry of the last path node's target row (so in [0, V))."""
    acc, num, nxt = res[:3]
    B, T = batch["tokens"].shape
    assert acc.dtype == torch.int32 and acc.shape == (B, T)
    assert num.dtype == torch.int32 and num.shape == (B,)
    assert nxt.dtype == torch.int64 and nxt.shape == (B,)
    parents, target, tokens = batch["parents"], batch["target_logits"].float(), batch["tokens"]
    for b in range(B):
        n = int(num[b])
        assert 0 <= n < int(batch["num_nodes"][b]), f"request {b}: num_accepted {n}"
        path = acc[b, : n + 1].tolist()
        assert path[0] == 0 and acc[b, n + 1:].eq(-1).all(), f"request {b}: {acc[b].tolist()}"
        for prev, node in zip(path, path[1:]):
            assert prev < node < int(batch["num_nodes"][b]) and int(parents[b, node]) == prev, f"request {b}: {path}"
            assert target[b, prev, int(tokens[b, node])] > NEG_INF, f"request {b}: accepted a -inf token"
        x = int(nxt[b])
        assert 0 <= x < V and target[b, path[-1], x] > NEG_INF, f"request {b}: next token {x}"


def _accept(batch, backend, **kw):
    """specdec.accept on the batch with keyword overrides `kw` (tests.helpers.accept_on)."""
    return accept_on(backend, **{**batch, **kw})


def _same(a, b):
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kinds", [("chain",), ("star",), ("random", "chain", "star")], ids=["chain", "star", "mixed"])
def test_greedy_matches_reference(backend, dtype, kinds):
    gen = torch.Generator().manual_seed(len(kinds) * 7 + int(dtype.itemsize))
    batch = _batch(8, 7, gen, dtype=dtype, kinds=kinds)
    res = _accept(batch, backend)
    ref = _accept(batch, "torch")
    assert _same(res, ref), f"{res} != {ref}"
    assert int(res.num_accepted.max()) >= (1 if kinds == ("star",) else 2)  # the paths really descend


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_ties_and_vocab_tail(backend):
    """Ties take the first index; the argmax may sit in the last, partial tile (index V - 1)."""
    B, T = 4, 3
    target = torch.zeros(B, T, V)
    target[0, :, V - 1] = 5.0  # argmax in the tail
    target[1, :, 3] = target[1, :, 30] = 4.0  # tie: 3 wins
    target[2, :, 36] = target[2, :, 35] = 4.0  # tie inside the tail: 35 wins
    # request 3: all equal: 0 wins
    tokens = torch.tensor([[0, V - 1, V - 1], [0, 30, 3], [0, 35, 35], [0, 1, 0]])
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0], [-1, 0, 1], [-1, 0, 0]])
    batch = dict(target_logits=target, tokens=tokens, parents=parents)
    res = _accept(batch, backend)
    assert res.accepted_nodes.tolist() == [[0, 1, 2], [0, 2, -1], [0, 1, 2], [0, 2, -1]]
    assert res.next_tokens.tolist() == [V - 1, 3, 35, 0]
    assert _same(res, _accept(batch, "torch"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_sampling_one_hot_target_equals_greedy(backend, draft):
    """A target with one finite logit per row is deterministic: sampling must give the greedy result
    (every rejection, residual and draw must land on that entry, also in the vocabulary tail)."""
    gen = torch.Generator().manual_seed(5 + draft)
    batch = _batch(8, 7, gen, draft=draft)
    keep = torch.randint(V - 8, V, batch["target_logits"].shape[:2], generator=gen)  # often in the tail
    one_hot = torch.full_like(batch["target_logits"], NEG_INF).scatter_(-1, keep[..., None], 1.0)
    tokens = batch["tokens"].clone()
    for b in range(8):  # half the children carry the target's token
        for i in range(1, 7):
            if torch.rand((), generator=gen) < 0.5:
                tokens[b, i] = keep[b, max(int(batch["parents"][b, i]), 0)]
    batch.update(target_logits=one_hot, tokens=tokens, temperature=torch.full((8,), 0.9))
    res = _accept(batch, backend)
    ref = _accept(batch, "torch", temperature=0.0)
    assert _same(res, ref), f"{res} != greedy {ref}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_sampling_never_emits_masked_entries(backend, draft):
    """-inf target logits are never accepted nor drawn, even where the drafter proposes them."""
    gen = torch.Generator().manual_seed(11 + draft)
    batch = _batch(16, 6, gen, draft=draft, masked=0.8, temperature=1.0)
    res = _accept(batch, backend)
    _check_structure(res, batch)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_structure_and_determinism(backend):
    gen = torch.Generator().manual_seed(3)
    batch = _batch(12, 8, gen, draft=True, temperature=0.7, kinds=("random", "chain", "star"))
    res = _accept(batch, backend)
    _check_structure(res, batch)
    assert _same(res, _accept(batch, backend)), "same seeds, different result"
    other_seeds = _accept(batch, backend, seeds=batch["seeds"] + 1)
    other_offset = _accept(batch, backend, offset=1)
    for other in (other_seeds, other_offset):
        _check_structure(other, batch)
        assert not _same(res, other), "the result does not depend on the seed / offset"


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_request_offsets(backend):
    """offset as a (B,) tensor: all equal == that int; request b with offsets[b] == request b alone with the
    int offset offsets[b] (a request's numbers do not depend on when it joined the batch); each offset
    moves the stream (a request whose offset changes gets another result, the others keep theirs)."""
    gen = torch.Generator().manual_seed(41)
    temps = torch.tensor([0.9, 1.0, 0.6, 1.2, 0.8])
    batch = _batch(5, 7, gen, draft=True, temperature=temps, kinds=("chain", "random"))
    B = 5
    res_int = _accept(batch, backend, offset=3)
    assert _same(res_int, _accept(batch, backend, offset=torch.full((B,), 3, dtype=torch.int64)))
    offsets = torch.tensor([0, 2**40 + 5, 3, 2**31 + 1, 77])
    res = _accept(batch, backend, offset=offsets)
    _check_structure(res, batch)
    for b in range(B):
        alone = {k: (v[b:b + 1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        assert _same([x[b:b + 1] for x in res], _accept(alone, backend, offset=int(offsets[b]))), f"request {b}"
    changed = 0
    for b in range(B):
        moved = offsets.clone()
        moved[b] += 1
        other = _accept(batch, backend, offset=moved)
        keep = torch.arange(B) != b
        assert all(torch.equal(x[keep], y[keep]) for x, y in zip(res, other))
        changed += not all(torch.equal(x[b], y[b]) for x, y in zip(res, other))
    assert changed >= 3, "the result does not depend on the offset"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_batch_invariance(backend, draft):
    """A request's result depends only on its own inputs and seed: reorder the batch, replace the others."""
    gen = torch.Generator().manual_seed(21 + draft)
    temps = torch.tensor([0.0, 0.8, 1.3, 0.0, 1.0, 0.6])
    batch = _batch(6, 6, gen, draft=draft, temperature=temps)
    others = _batch(6, 6, torch.Generator().manual_seed(99), draft=draft, temperature=1.0)
    _check_structure(_assert_batch_invariant(batch, others, backend), batch)


def _assert_batch_invariant(batch, others, backend):
    """The batch's result is the same reordered (perm), and for requests 0-2 with requests 3.. replaced by
    those of `others`. Returns the result."""
    res = _accept(batch, backend)
    perm = torch.tensor([5, 3, 1, 0, 4, 2])
    permuted = {k: (v[perm] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    assert all(torch.equal(x[perm], y) for x, y in zip(res, _accept(permuted, backend)))
    mixed = {k: (torch.cat([v[:3], others[k][3:]]) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    assert all(torch.equal(x[:3], y[:3]) for x, y in zip(res, _accept(mixed, backend)))
    return res


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_greedy_and_sampling_batch(backend):
    """Greedy rows of a mixed batch equal the reference exactly; sampling rows are valid; root-only
    requests (num_nodes = 1) emit one token."""
    gen = torch.Generator().manual_seed(31)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 2.0, 0.0, 1.0])
    batch = _batch(8, 6, gen, draft=True, temperature=temps)
    batch["num_nodes"][6:] = 1
    batch["parents"][6:, 1:] = -1
    res = _accept(batch, backend)
    _check_structure(res, batch)
    ref = _accept(batch, "torch")
    greedy = temps == 0
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(res, ref))
    assert res.num_accepted[6:].tolist() == [0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_node_trees(backend):
    """T = 1 (no draft at all): greedy emits the argmax, sampling a finite-logit token."""
    gen = torch.Generator().manual_seed(51)
    target = torch.randn(4, 1, V, generator=gen)
    target[1, 0, :30] = NEG_INF
    tokens, parents = torch.zeros(4, 1, dtype=torch.int64), torch.full((4, 1), -1)
    temps = torch.tensor([0.0, 1.0, 0.0, 0.5])
    res = _accept(dict(target_logits=target, tokens=tokens, parents=parents, temperature=temps,
                       seeds=torch.arange(4)), backend)
    assert res.accepted_nodes.tolist() == [[0]] * 4 and res.num_accepted.tolist() == [0] * 4
    assert res.next_tokens[0::2].tolist() == target[0::2, 0].argmax(-1).tolist()
    assert 30 <= int(res.next_tokens[1]) < V and 0 <= int(res.next_tokens[3]) < V


def test_triton_schedules_agree():
    """Triton only: the V-split schedule (chunks, split launches, walker) never changes a result."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(41)
    T = 6
    for draft in (True, False):
        temps = torch.tensor([0.0, 1.0, 0.7, 1.0, 0.0, 1.5])
        batch = _batch(6, T, gen, draft=draft, temperature=temps, masked=0.3)
        args = (*to_device(batch["target_logits"], batch["tokens"].int(), batch["parents"].int(),
                           batch["draft_logits"], batch["temperature"], batch["seeds"], batch["num_nodes"]), 3)
        base = [x.cpu() for x in triton_accept(*args, block_v=16, num_splits=3, split_steps=0)]
        _check_structure(base, batch)
        for steps in (1, 2, T + 1):
            assert _same(base, triton_accept(*args, block_v=16, num_splits=3, split_steps=steps)), steps
        # other tilings only change float rounding, which these inputs are far from
        for block_v, splits in ((16, 1), (32, 2), (64, 1)):
            assert _same(base, triton_accept(*args, block_v=block_v, num_splits=splits, split_steps=1))
        # deeper prefetch: the same tiles folded in the same order
        for steps in (0, T + 1):
            assert _same(base, triton_accept(*args, block_v=16, num_splits=3, split_steps=steps, prefetch=2))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("schedule", [dict(num_splits=1, split_steps=0), dict(num_splits=3, split_steps=7),
                                      dict(num_splits=2, split_steps=7, prefetch=2),
                                      dict(num_splits=1, split_steps=0, trials=0),
                                      dict(num_splits=3, split_steps=7, trials=0)],
                         ids=["walker", "split-launches", "split-launches-prefetch-2", "walker-z-pass",
                              "split-launches-z-pass"])
def test_triton_reads_only_the_walked_rows(monkeypatch, schedule):
    """The bytes claim of the kernel (only walked rows are read), element by element, on chains mixing greedy and sampling
    requests: a row off the accepted path is never read; a path row is read once (greedy: the argmax;
    sampling: target and draft statistics), except the last one of a sampling request. At a leaf its target
    row is read once plus the draw's scan (a prefix of one chunk), its draft row never. After a rejected
    child, the draw tries candidates: each scans a prefix of one chunk of the target row and looks up one
    target and one draft entry, so the draft row is read once but for at most `trials` entries; only when
    every candidate is rejected (or with trials=0) are both rows read twice (statistics, then the
    residual's mass) before the draw's scan. A greedy request never reads a draft row. The tested child
    tokens' own entries are excluded (single-element lookups, repeated by every program of a split
    launch)."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(61)
    B, T = 8, 7
    temps = torch.tensor([0.0, 1.0, 0.8, 0.0, 1.3, 1.0, 0.0, 0.6])
    batch = _batch(B, T, gen, draft=True, temperature=temps, kinds=("chain",))
    # a draft close to the target, chain tokens drawn from it: long paths, some accepted to the leaf
    target = batch["target_logits"] * 3
    draft = batch["draft_logits"] = target + 0.3 * torch.randn(B, T, V, generator=gen)
    batch["target_logits"] = target
    for i in range(1, T):
        law = torch.softmax(draft[:, i - 1] / torch.where(temps > 0, temps, 1.0).unsqueeze(1), -1)
        batch["tokens"][:, i] = torch.multinomial(law, 1, generator=gen).squeeze(1)
    spy = MemorySpy(monkeypatch)
    res = AcceptResult.from_op(triton_accept(target, batch["tokens"].int(), batch["parents"].int(), draft, temps,
                                      batch["seeds"], batch["num_nodes"], 0, block_v=16, **schedule))
    _check_structure(res, batch)
    finals = [(int(res.num_accepted[b]) + 1 == int(batch["num_nodes"][b])) for b in range(B) if temps[b] > 0]
    assert any(finals) and not all(finals), "both kinds of last rows (leaf, rejected child) are exercised"
    reads = {name: spy.counts([x]) for name, x in (("target", target), ("draft", draft))}
    lookups = set()
    allowed = {"target": {}, "draft": {}}  # address -> (fewest, most) reads
    trials = schedule.get("trials", 8)
    draws = []  # (name, addresses of a row the draw scans, reads before the scan)
    paths = []  # how each draw after a rejection went
    for b in range(B):
        n, last = int(res.num_accepted[b]), int(res.accepted_nodes[b, int(res.num_accepted[b])])
        sampling, leaf = bool(temps[b] > 0), last == int(batch["num_nodes"][b]) - 1
        for node in res.accepted_nodes[b, : n + 1].tolist():
            rows = {name: element_addresses(x)[b, node].tolist() for name, x in (("target", target), ("draft", draft))}
            if node == last and sampling and not leaf:
                # candidates (draft row read once but for <= trials lookups) or the Z-pass draw (both rows twice)
                extra = sum(reads["draft"].get(a, 0) > 1 for a in rows["draft"])
                z_pass = extra > trials
                assert not z_pass or extra == V, f"request {b}: a partial second pass over its draft row"
                times = ({"target": (2, 3), "draft": (2, 3)} if z_pass
                         else {"target": (1, 1 + 2 * trials), "draft": (1, 1 + trials)})
                paths.append("z-pass" if z_pass else "candidates")
                draws.append(("target", rows["target"], times["target"][0]))
            elif node == last and sampling:
                times = {"target": (1, 2), "draft": (0, 0)}
                draws.append(("target", rows["target"], 1))
            else:
                times = {"target": (1, 1), "draft": (1, 1) if sampling else (0, 0)}
            for name in ("target", "draft"):
                allowed[name].update({a: times[name] for a in rows[name] if times[name][1]})
                if sampling and node + 1 < int(batch["num_nodes"][b]):  # its child's token was tested
                    lookups.add(rows[name][int(batch["tokens"][b, node + 1])])
    for name in ("target", "draft"):
        assert set(reads[name]) == set(allowed[name]), f"{name}: rows off the walked path were read"
        for address, count in reads[name].items():
            fewest, most = allowed[name][address]
            assert fewest <= count and (count <= most or address in lookups), (name, count, fewest, most)
    assert "candidates" in paths if trials else set(paths) == {"z-pass"}, paths
    for name, row, fewest in draws:  # the draw scanned (a prefix of one chunk of) that row once more
        assert any(reads[name][a] >= fewest + 1 for a in row if a not in lookups), name


# ----------------------------------------------------------------------------------------------
# compiled code for an H100/H200 (sm_90), no GPU needed: the interpreter runs code the compiler
# rejects (e.g. a name bound only under a constexpr branch) and says nothing of registers
# ----------------------------------------------------------------------------------------------
HOPPER_TYPES = {
    "target_ptr": "*bf16", "draft_ptr": "*bf16", "tokens_ptr": "*i32", "parents_ptr": "*i32", "temp_ptr": "*fp32",
    "seeds_ptr": "*i64", "num_nodes_ptr": "*i32", "offsets_ptr": "*i64", "mask_ptr": "*i32", "row_offsets_ptr": "*i64",
    "top_k_ptr": "*i32", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "acc_ptr": "*i32", "num_acc_ptr": "*i32",
    "next_ptr": "*i64", "state_i_ptr": "*i32", "state_f_ptr": "*fp32", "part_f_ptr": "*fp32", "part_i_ptr": "*i32",
    "search_i_ptr": "*i32", "search_f_ptr": "*fp32", "search_d_ptr": "*fp64", "sel_count_ptr": "*i32",
    "sel_mass_ptr": "*fp64", "sel_value_ptr": "*fp32", "rep_ptr": "*fp32", "freq_ptr": "*fp32", "pres_ptr": "*fp32",
    "counts_ptr": "*i32", "prompt_ptr": "*i32", "bias_ids_ptr": "*i32", "bias_values_ptr": "*fp32",
    "min_tokens_ptr": "*i32", "stop_ids_ptr": "*i32", "generated_ptr": "*i64", "taus_ptr": "*fp32",
    "logprobs_ptr": "*fp32", "top_lp_ptr": "*fp32", "top_ids_ptr": "*i64", "ranks_ptr": "*i64"}


def hopper_compile_report(group: str) -> None:
    """Prints (JSON) the spilled bytes of launch variants at the benchmark shape (bf16, T 8, V 128256), by `group`:
    "walk", every launch variant of the walk without step 0 (filters, block, draft; the probabilities (PROBS) and
    packed-row (PACKED) switches on the token-wise draft-logits launches); "penalties", the same methods with step 0
    fused (HAS_PENALTIES), the filtered ones in each filter order (FILTER_ORDER changes their SELECT passes' code);
    "logprobs", the logprobs kernel (raw / processed, with and without filters and step 0; 32 top slots).
    Runs in a fresh process without TRITON_INTERPRET (the interpreter's patches break the compiler)."""
    import json

    from specdec.kernels import accept as ka
    from tests.ops.test_tree_attention import compile_for_hopper, spilled_bytes

    T, V = 8, 128_256
    cfg = ka._config(T, V, 2, torch.device("cuda"))
    S = cfg["num_splits"]
    split_v = triton.cdiv(triton.cdiv(V, S), cfg["block_v"]) * cfg["block_v"]
    shape = dict(HAS_OFFSETS=True, NUM_SPLITS=S, SPLIT_V=split_v, BLOCK_V=cfg["block_v"], T_BLOCK=T,
                 S_BLOCK=triton.next_power_of_2(S), PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"],
                 NUM_PIVOTS=cfg["num_pivots"], CAP=cfg["cap"], SELECT_BLOCK=cfg["select_block"],
                 PAIR_BLOCK=cfg["pair_block"])
    # (V marked 16-divisible, as a launch marks V = 128256 and the padded vocabularies of most checkpoints:
    # unmarked, the filtered walker compiles to code with many more spills)
    report = {}
    if group == "logprobs":
        fn = ka.logprobs._logprobs_kernel
        for processed, has_filters, penalties in [(p, f, q) for p in (True, False) for f in (False, True)
                                                  for q in (False, True)]:
            constexprs = dict(HAS_OFFSETS=True, HAS_FILTERS=has_filters, PROBS=False, PACKED=False,
                              PROCESSED=processed, T_BLOCK=T, N_BLOCK=32, BLOCK_V=cfg["block_v"],
                              HAS_PENALTIES=penalties, FILTER_ORDER=0)
            kernel = compile_for_hopper(fn, HOPPER_TYPES, constexprs, cfg["num_warps"], divisible_ints=("V",))
            report[f"logprobs,processed={processed},filters={has_filters},penalties={penalties}"] = \
                spilled_bytes(kernel)
        print(json.dumps(report))
        return
    # (filters, block, draft, probs, packed, order, launches (first, walk)): every combination of the
    # first three, the two input-form switches on the split launch that streams both rows and the walker
    launches = ((True, False), (False, False), (False, True))
    penalties = group == "penalties"
    variants = [(has_filters, block, has_draft, False, False, order, launch)
                for has_filters, block in ((False, False), (True, False), (False, True))
                for has_draft in ((True, False) if not block else (True,))
                for order in ((0, 1, 2) if has_filters and penalties else (0,)) for launch in launches]
    if not penalties:
        variants += [(False, False, True, True, False, 0, launch) for launch in launches[1:]]
        variants += [(False, False, True, False, True, 0, launches[1])]
    for has_filters, block, has_draft, probs, packed, order, (first, walk) in variants:
        constexprs = dict(shape, HAS_DRAFT=has_draft, HAS_FILTERS=has_filters, PROBS=probs, PACKED=packed,
                          BLOCK=block, TRAVERSAL=False, IS_FIRST=first, WALKER=walk, HAS_PENALTIES=penalties,
                          FILTER_ORDER=order)
        kernel = compile_for_hopper(ka.launch._accept_kernel, HOPPER_TYPES, constexprs, cfg["num_warps"],
                                    divisible_ints=("V",))
        name = f"filters={has_filters},block={block},draft={has_draft},first={first},walk={walk}"
        name += ",probs=True" if probs else ",packed=True" if packed else ""
        name += f",order={order}" if has_filters and penalties else ""
        report[name] = spilled_bytes(kernel)
    print(json.dumps(report))


@needs_the_compiler
@pytest.mark.parametrize("group", ["walk", "penalties", "logprobs"])
def test_compiles_for_hopper(group):
    """Every launch variant of the walk and of the logprobs kernel compiles for sm_90 (each group in a process of
    its own: minutes of compiling for "walk" and "penalties", whose filtered walkers take a minute or two each on
    a busy 2-core machine); register spills stay negligible (<= 64 bytes a thread)."""
    report = report_from_fresh_process("from tests.ops.accept.test_against_reference import hopper_compile_report; "
                                       f"hopper_compile_report({group!r})", timeout=1800)
    assert all(spilled is None or spilled <= 64 for spilled in report.values()), report


def test_emitted_tokens_layout():
    """AcceptResult.emitted_tokens: accepted draft tokens in path order, then the next token, -1 after."""
    res = AcceptResult(accepted_nodes=torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32),
                       num_accepted=torch.tensor([2, 0, 3], dtype=torch.int32), next_tokens=torch.tensor([9, 7, 4]))
    tokens = torch.tensor([[5, 11, 12, 13], [5, 21, 22, 23], [5, 31, 32, 33]], dtype=torch.int32)
    assert res.emitted_tokens(tokens).tolist() == [[12, 13, 9, -1], [7, -1, -1, -1], [31, 32, 33, 4]]


# ----------------------------------------------------------------------------------------------
# filters: top-k, top-p, min-p and a grammar bitmask (one row per node), per request
# ----------------------------------------------------------------------------------------------
import specdec  # noqa: E402
from specdec import reference  # noqa: E402
from specdec.sampling import pack_bitmask  # noqa: E402


def _filters(B, T, gen, *, p_off=0.3):
    """Per-request top_k / top_p / min_p tensors (each request off with probability p_off per parameter)
    and a (B, T, W) bitmask allowing ~70% of the tokens (the argmax of every target row always allowed,
    so long greedy paths still happen)."""
    def off(x, value):
        return torch.where(torch.rand(B, generator=gen) < p_off, torch.full_like(x, value), x)
    return dict(top_k=off(torch.randint(1, 8, (B,), generator=gen, dtype=torch.int32), 0),
                top_p=off(torch.rand(B, generator=gen) * 0.8 + 0.15, 1.0),
                min_p=off(torch.rand(B, generator=gen) * 0.3, 0.0),
                allowed=torch.rand(B, T, V, generator=gen) < 0.7)


def _filtered_batch(B, T, gen, *, draft=False, temperature=1.0, kinds=("chain", "star", "random"), dtype=torch.float32):
    """A batch with filters on; draft tokens drawn from the processed draft law at their parent (the law the
    drafter must sample from), else the processed target argmax 60% of the time."""
    batch = _batch(B, T, gen, dtype=dtype, kinds=kinds, draft=draft, temperature=temperature)
    f = _filters(B, T, gen)
    allowed = f.pop("allowed")
    allowed |= torch.nn.functional.one_hot(batch["target_logits"].float().argmax(-1), V).bool()
    batch.update(f, token_bitmask=pack_bitmask(allowed))
    tokens = batch["tokens"].clone()
    for b in range(B):
        t = float(batch["temperature"][b])
        k, top_p, min_p = reference.request_filters(b, batch["top_k"], batch["top_p"], batch["min_p"])
        for i in range(1, int(batch["num_nodes"][b])):
            par = int(batch["parents"][b, i])
            if draft and t > 0:
                q = reference.processed_probs(batch["draft_logits"][b, par], t, k, top_p, min_p, allowed[b, par])
                tokens[b, i] = int(torch.multinomial(q, 1, generator=gen))
            elif torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = reference.greedy_token(batch["target_logits"][b, par], allowed[b, par])
    batch["tokens"] = tokens
    return batch


def _law(batch, b, node):
    """The processed target law (float64) at node of request b (greedy: one-hot at the masked argmax)."""
    allowed = reference.unpack_bits(batch["token_bitmask"], V)[b, node] if batch.get("token_bitmask") is not None else None
    t = float(batch["temperature"][b])
    row = batch["target_logits"][b, node]
    if t == 0:
        law = torch.zeros(V, dtype=torch.float64)
        law[reference.greedy_token(row, allowed)] = 1.0
        return law
    k, top_p, min_p = reference.request_filters(b, batch.get("top_k"), batch.get("top_p"), batch.get("min_p"))
    return reference.processed_probs(row, t, k, top_p, min_p, allowed)


def _check_support(res, batch):
    """_check_structure, and every emitted token (accepted drafts and the next token) has a positive
    probability under the processed target law at its parent node."""
    _check_structure(res, batch)
    acc, num, nxt = res[:3]
    for b in range(acc.shape[0]):
        path = acc[b, : int(num[b]) + 1].tolist()
        for prev, node in zip(path, path[1:]):
            assert _law(batch, b, prev)[int(batch["tokens"][b, node])] > 0, f"request {b}: accepted a dropped token"
        assert _law(batch, b, path[-1])[int(nxt[b])] > 0, f"request {b}: next token {int(nxt[b])} is dropped"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_with_bitmask_matches_reference(backend, dtype):
    """Greedy takes the argmax of the masked row (the filters change nothing), exactly as the reference."""
    gen = torch.Generator().manual_seed(61)
    batch = _filtered_batch(8, 7, gen, temperature=0.0, dtype=dtype)
    allowed = reference.unpack_bits(batch["token_bitmask"], V)
    allowed[..., batch["target_logits"].float().argmax(-1)] = True  # (keeps many paths long)
    masked = batch["target_logits"].float().masked_fill(~allowed, NEG_INF)
    best = masked.argmax(-1)
    tokens = batch["tokens"].clone()
    for b in range(8):
        for i in range(1, 7):
            tokens[b, i] = best[b, max(int(batch["parents"][b, i]), 0)] if i % 3 else tokens[b, i]
    allowed[0, 0, best[0, 0]] = False  # one root whose argmax is banned: the runner-up wins
    batch.update(tokens=tokens, token_bitmask=pack_bitmask(allowed))
    res = _accept(batch, backend)
    ref = _accept(batch, "torch")
    assert _same(res, ref), f"{res} != {ref}"
    assert int(res.num_accepted.max()) >= 2
    assert _same(res, _accept(batch, backend, top_k=None, top_p=None, min_p=None))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_a_banned_huge_float64_logit_leaves_the_allowed_law(backend, draft):
    """float64 rows whose largest logit, 1e300, is one the grammar bans: the law is the masked row, so the kernel's
    shift into float32's range is by the largest allowed logit (shifted by 1e300, every allowed logit read as
    float32 was -inf and a sampled or greedy row emitted the banned token). Greedy equals the reference, sampled
    rows emit only allowed tokens."""
    gen = torch.Generator().manual_seed(71 + draft)
    temperature = torch.tensor([0.0, 1.0] * 4)
    batch = _filtered_batch(8, 5, gen, draft=draft, temperature=temperature, dtype=torch.float64)
    allowed = reference.unpack_bits(batch["token_bitmask"], V)
    banned = (~allowed).float().argmax(-1, keepdim=True)  # (a banned token of each row: the filters leave some)
    assert not allowed.gather(-1, banned).any()
    for name in ("target_logits", "draft_logits") if draft else ("target_logits",):
        batch[name] = batch[name].scatter(-1, banned, 1e300)
    res = _accept(batch, backend)
    _check_support(res, batch)
    greedy = temperature == 0
    ref = _accept(batch, "torch")
    assert _same([x[greedy] for x in res], [x[greedy] for x in ref])


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_keeps_a_subnormal_bfloat16_probability(backend):
    """A greedy row of bfloat16 probabilities whose only allowed positive entry is a subnormal (9.2e-41) emits
    that entry, as the reference: a bfloat16 subnormal read as 0 left the row without an allowed token."""
    probs = torch.tensor([[[0.0, 2.9e-4, 0.0, 9.1835e-41, 1.08e-3]]], dtype=torch.bfloat16)
    assert 0 < float(probs[0, 0, 3]) < torch.finfo(torch.bfloat16).tiny
    batch = dict(target_probs=probs, tokens=torch.tensor([[3]]), parents=torch.tensor([[-1]]),
                 token_bitmask=torch.tensor([[[0b01101]]], dtype=torch.int32))
    assert _accept(batch, backend).next_tokens.tolist() == _accept(batch, "torch").next_tokens.tolist() == [3]


def _point_mass_rows(gen, B, T):
    """Sampling rows whose processed law is a point mass, each by another parameter: top_k = 1, a tiny
    top_p, min_p close to 1, a mask allowing one token; distinct values, the max often in the tail."""
    target = torch.randn(B, T, V, generator=gen)
    top = torch.randint(V - 6, V, (B, T), generator=gen)
    target.scatter_(-1, top[..., None], 6.0)
    allowed = torch.ones(B, T, V, dtype=torch.bool)
    top_k = torch.zeros(B, dtype=torch.int32)
    top_p, min_p = torch.ones(B), torch.zeros(B)
    kind = torch.arange(B) % 4
    top_k[kind == 0] = 1
    top_p[kind == 1] = 1e-4
    min_p[kind == 2] = 0.999
    keep = torch.randint(0, V, (B, T), generator=gen)
    only = torch.zeros(B, T, V, dtype=torch.bool).scatter_(-1, keep[..., None], True)
    allowed[kind == 3] = only[kind == 3]
    top = torch.where((kind == 3).view(B, 1), keep, top)
    return target, top, dict(top_k=top_k, top_p=top_p, min_p=min_p, token_bitmask=pack_bitmask(allowed))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_point_mass_filters_sample_deterministically(backend, draft):
    """A processed law that is a point mass makes sampling deterministic: every backend equals the
    reference (and greedy over the processed argmax). Exact thresholds or nothing: one extra kept token
    is drawn for some seed."""
    gen = torch.Generator().manual_seed(62 + draft)
    B, T = 16, 6
    batch = _batch(B, T, gen, draft=draft, temperature=1.0)
    target, top, filters = _point_mass_rows(gen, B, T)
    tokens = batch["tokens"].clone()
    for b in range(B):
        for i in range(1, T):  # drafts drawn from q (a point mass at `top` too), or given proposals
            if draft or torch.rand((), generator=gen) < 0.6:
                tokens[b, i] = top[b, max(int(batch["parents"][b, i]), 0)]
    batch.update(target_logits=target, tokens=tokens, **filters)
    if draft:
        batch["draft_logits"] = torch.randn(B, T, V, generator=gen)
        batch["draft_logits"].scatter_(-1, top[..., None], 6.0)
    res = _accept(batch, backend)
    ref = _accept(batch, "torch")
    assert _same(res, ref), f"{res} != {ref}"
    greedy = _accept(batch, "torch", temperature=0.0, top_k=None, top_p=None, min_p=None,
                     token_bitmask=filters["token_bitmask"])
    assert _same(res, greedy)
    assert int(res.num_accepted.max()) >= 2


def _boundary_rows():
    """(logits (R, V), kwargs) rows whose kept sets sit on the thresholds: the next token's support must be
    exactly the reference's kept set. Every kept token has probability >= 0.15, so a few dozen draws show
    each one; the first dropped token sits 1e-4 past its threshold."""
    p4 = torch.tensor([0.35, 0.25, 0.22, 0.18], dtype=torch.float64)
    rows, params = [], []

    def add(logits, top_k=0, top_p=1.0, min_p=0.0, allowed=None):
        rows.append(torch.as_tensor(logits, dtype=torch.float64))
        params.append((top_k, top_p, min_p, allowed))

    tail = [-30.0] * (V - 4)  # finite, ~1e-14 of the mass: always dropped by top-p / min-p
    base = p4.log().tolist() + tail
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(7))  # spread over the vocabulary
    add(base, top_p=0.82 + 1e-4)  # the mass above token 3 is 0.82: kept
    add(base, top_p=0.82 - 1e-4)  # dropped
    add(base, top_p=0.6 + 1e-4)  # the mass above token 2: kept
    add(base, min_p=0.18 / 0.35 - 1e-4)  # p(3) / max p: kept
    add(base, min_p=0.18 / 0.35 + 1e-4)  # dropped
    add([1.5, 1.0, 1.0, 1.0] + [0.0] * (V - 4), top_k=2)  # ties at the 2nd value: 4 kept
    add([1.5, 1.0, 1.0, 1.0] + [0.0] * (V - 4), top_k=4)  # k-th value 1.0: the 0.0 ones are dropped
    add([1.0] * 5 + [NEG_INF] * (V - 5), top_k=1, top_p=1e-6, min_p=0.99)  # all equal: all 5 kept
    add([0.5, NEG_INF, 0.2, NEG_INF] + [NEG_INF] * (V - 4), top_k=3)  # fewer finite than k
    allowed = torch.ones(V, dtype=torch.bool)
    allowed[0] = False  # the max disallowed: top-k counts the allowed only
    add([3.0, 1.2, 1.0, 0.9, 0.5] + tail[1:], top_k=3, allowed=allowed)
    add(base, top_k=3, top_p=0.35 / 0.82 + 1e-4)  # top-k first, then top-p on the renormalized 3: token 1 kept
    add(base, top_k=3, top_p=0.35 / 0.82 - 1e-4)  # ... dropped
    out = []
    for row, (k, tp, mp, al) in zip(rows, params):
        al = torch.ones(V, dtype=torch.bool) if al is None else al
        out.append((row[perm].float(), k, tp, mp, al[perm]))
    return out


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_boundary_rows_keep_exactly_the_reference_set(backend):
    """Next tokens drawn (t = 1) at the root of rows built on the thresholds: every token drawn is kept by
    the reference, and every kept token is drawn (probabilities >= 0.15, 80 or 200 draws per row: a kept token
    is missed with probability < 3e-6)."""
    rows = _boundary_rows()
    n = 80 if backend == "triton" and DEVICE.type == "cpu" else 200  # (the interpreter's time)
    logits = torch.stack([r[0] for r in rows]).repeat_interleave(n, 0)  # (R n, V)
    N = logits.shape[0]
    per_row = lambda j, dtype: torch.tensor([r[j] for r in rows], dtype=dtype).repeat_interleave(n)  # noqa: E731
    allowed = torch.stack([r[4] for r in rows]).repeat_interleave(n, 0)
    batch = dict(target_logits=logits.view(N, 1, V), tokens=torch.zeros(N, 1, dtype=torch.int64),
                 parents=torch.full((N, 1), -1), temperature=torch.ones(N), seeds=torch.arange(N),
                 top_k=per_row(1, torch.int32), top_p=per_row(2, torch.float32), min_p=per_row(3, torch.float32),
                 token_bitmask=pack_bitmask(allowed).view(N, 1, -1))
    res = _accept(batch, backend)
    for j, (row, k, tp, mp, al) in enumerate(rows):
        keep = reference.processed_keep(row, 1.0, k, float(torch.tensor(tp)), float(torch.tensor(mp)), al)
        drawn = set(res.next_tokens[j * n:(j + 1) * n].tolist())
        assert drawn == set(torch.nonzero(keep).flatten().tolist()), f"row {j}: drew {sorted(drawn)}"
    assert [int(reference.processed_keep(r[0], 1.0, r[1], r[2], r[3], r[4]).sum()) for r in rows] == \
        [4, 3, 3, 4, 3, 4, 4, 5, 2, 3, 2, 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_mixed_filtered_batch(backend, draft):
    """Greedy and sampling requests, each parameter on or off per request, a bitmask row per node: greedy
    results equal the reference, sampled ones stay inside the processed laws; deterministic."""
    gen = torch.Generator().manual_seed(63 + draft)
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 0.9, 0.0, 1.1, 0.8, 1.0])
    batch = _filtered_batch(10, 6, gen, draft=draft, temperature=temps)
    res = _accept(batch, backend)
    _check_support(res, batch)
    greedy = temps == 0
    ref = _accept(batch, "torch")
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(res, ref))
    assert _same(res, _accept(batch, backend))
    assert int(res.num_accepted.max()) >= 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_filters_off_change_nothing(backend):
    """Every parameter given but off (top_k 0 or >= V, top_p 1, min_p 0, a bitmask allowing everything):
    the same results as without them (the same laws and the same random numbers)."""
    gen = torch.Generator().manual_seed(64)
    batch = _batch(8, 6, gen, draft=True, temperature=torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 0.9, 1.1, 0.8]))
    plain = _accept(batch, backend)
    off = dict(top_k=torch.tensor([0, V, 0, V + 5, 0, 0, V, 0], dtype=torch.int32), top_p=torch.ones(8),
               min_p=torch.zeros(8))
    assert _same(plain, _accept(batch, backend, **off))
    assert _same(plain, _accept(batch, backend, top_k=0, top_p=1.0, min_p=0.0))  # None once normalized
    everything = pack_bitmask(torch.ones(8, 6, V, dtype=torch.bool))
    assert _same(plain, _accept(batch, backend, token_bitmask=everything))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_filtered_batch_invariance(backend, draft):
    """A request's result depends on its own parameters and bitmask rows only: change the others'
    (values, on/off, their bitmask rows), reorder the batch."""
    gen = torch.Generator().manual_seed(65 + draft)
    temps = torch.tensor([0.0, 0.8, 1.3, 0.0, 1.0, 0.6])
    batch = _filtered_batch(6, 6, gen, draft=draft, temperature=temps)
    others = _filtered_batch(6, 6, torch.Generator().manual_seed(99), draft=draft, temperature=temps)
    res = _assert_batch_invariant(batch, others, backend)
    _check_support(res, batch)
    changed = dict(batch)
    for name in ("top_k", "top_p", "min_p", "token_bitmask"):  # requests 3.. get other parameters
        changed[name] = torch.cat([batch[name][:3], others[name][3:]])
    res_changed = _accept(changed, backend)
    assert all(torch.equal(x[:3], y[:3]) for x, y in zip(res, res_changed))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("schedule", [dict(num_splits=1, split_steps=0), dict(num_splits=3, split_steps=20)],
                         ids=["walker", "split-launches"])
def test_triton_filtered_rows_reads(monkeypatch, schedule):
    """What the fused filters cost in reads, element by element (the spy): only walked rows are read; a walked
    row of a sampling request with top-k / top-p is read 3 times (statistics, pivots, gathering of the bracket:
    the kept weights come with the threshold), with min-p alone twice (the threshold is closed-form from the
    max, then statistics through it), its draft row alike where q is used (not at a leaf); greedy rows once,
    with any filter. The last row's draw reads more of it (a chunk's scan, candidates), never less."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(68)
    B, T = 6, 4
    temps = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 0.9])
    batch = _batch(B, T, gen, draft=True, temperature=temps, kinds=("chain",))
    target = batch["target_logits"] * 3
    draft = target + 0.3 * torch.randn(B, T, V, generator=gen)
    for i in range(1, T):  # chain tokens from the draft: long paths
        law = torch.softmax(draft[:, i - 1] / torch.where(temps > 0, temps, 1.0).unsqueeze(1), -1)
        batch["tokens"][:, i] = torch.multinomial(law, 1, generator=gen).squeeze(1)
    top_k = torch.tensor([8, 0, 5, 0, 0, 30], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.9, 1.0, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.2, 0.01])
    passes = [1 if temps[b] == 0 else 3 if top_k[b] > 0 or top_p[b] < 1 else 2 for b in range(B)]
    spy = MemorySpy(monkeypatch)
    res = AcceptResult.from_op(triton_accept(target, batch["tokens"].int(), batch["parents"].int(), draft, temps,
                                      batch["seeds"], batch["num_nodes"], 0, None, top_k, top_p, min_p, None, **schedule))
    reads = {name: spy.counts([x]) for name, x in (("target", target), ("draft", draft))}
    walked = {"target": set(), "draft": set()}
    for b in range(B):
        n = int(res.num_accepted[b])
        path = res.accepted_nodes[b, : n + 1].tolist()
        for node in path:
            last = node == path[-1]
            for name, x in (("target", target), ("draft", draft)):
                row = element_addresses(x)[b, node].tolist()
                has_child = node + 1 < int(batch["num_nodes"][b])
                lookup = row[int(batch["tokens"][b, node + 1])] if has_child else None  # the child's test
                counts = [reads[name].get(a, 0) for a in row if a != lookup]
                expect = passes[b] if name == "target" or (temps[b] > 0 and has_child) else 0
                if last:
                    assert min(counts) >= expect, (b, node, name, counts)
                else:
                    assert counts == [expect] * len(counts), (b, node, name, counts)
                walked[name].update(row)
    assert int(res.num_accepted.max()) >= 2
    for name in ("target", "draft"):  # (and nothing else, but the children's looked-up entries)
        lookups = {element_addresses(x)[b, i, int(batch["tokens"][b, i + 1])].item() for b in range(B)
                   for i in range(int(batch["num_nodes"][b]) - 1) for x in ((target, draft)[name == "draft"],)}
        assert set(reads[name]) - lookups <= walked[name], f"{name}: rows off the walked path were read"
    _check_support(res, dict(batch, target_logits=target, draft_logits=draft, top_k=top_k, top_p=top_p, min_p=min_p))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("filter_order", ["hf", "vllm", "sglang"])
@pytest.mark.parametrize("method,draft,split", [("token", True, False), ("token", False, False), ("block", True, False),
                                                ("traversal", True, False), ("token", True, True),
                                                ("traversal", True, True)],
                         ids=["token-draft_logits", "token-given", "block", "traversal",
                              "token-draft_logits-split-launches", "traversal-split-launches"])
def test_triton_logprobs_read_each_emitted_row_once(monkeypatch, mode, filter_order, method, draft, split):
    """What return_logprobs costs in reads, element by element (the spy): the op's reads with return_logprobs=3
    minus its reads without are exactly one read of each emitted position's row (its parent node's target row)
    and nothing else, in both modes, for greedy requests and for sampling ones with top-k, top-p and min-p
    (alone and together, in each filter order): the filters' thresholds come from the walk, which found them
    reading the same rows, never from a search of the logprobs' own. Split launches record the same
    thresholds as the walker: the same outputs, logprobs included, bit for bit."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(69 + len(filter_order) + 2 * draft)
    B, T = 7, 4
    temps = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 0.9, 0.0])
    batch = _batch(B, T, gen, draft=draft, temperature=temps, kinds=("chain",) if method == "block" else
                   ("chain", "star", "random"))
    target = batch["target_logits"] * 3
    proposer = target + 0.3 * torch.randn(B, T, V, generator=gen)
    for b in range(B):  # tokens from the proposer's law at their parent: long paths
        for i in range(1, int(batch["num_nodes"][b])):
            law = torch.softmax(proposer[b, int(batch["parents"][b, i])] / max(float(temps[b]), 1e-3), -1)
            batch["tokens"][b, i] = int(torch.multinomial(law, 1, generator=gen))
    draft_logits = proposer if draft else None
    top_k = torch.tensor([8, 0, 5, 0, 6, 30, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.9, 1.0, 0.8, 0.95, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.1, 0.01, 0.0])
    args = (target, batch["tokens"].int(), batch["parents"].int(), draft_logits, temps, batch["seeds"],
            batch["num_nodes"], 0, None, top_k, top_p, min_p, None)
    options = dict(method=method, filter_order=filter_order, logprobs_mode=mode, block_v=16, num_splits=3)
    schedule = dict(split_steps=20 if split else 0)
    reads = {}
    for n in (-1, 3):
        spy = MemorySpy(monkeypatch)
        res = AcceptResult.from_op(triton_accept(*args, **options, **schedule, return_logprobs=n))
        reads[n] = spy.counts([target])
        monkeypatch.undo()
        if n < 0:
            plain = res
    assert all(torch.equal(x, y) for x, y in zip(plain[:3], res[:3]))  # (logprobs change no draw)
    if split:
        walker = AcceptResult.from_op(triton_accept(*args, **options, split_steps=0, return_logprobs=3))
        for x, y in zip((*res[:3], *res.logprobs), (*walker[:3], *walker.logprobs)):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    rows = element_addresses(target)
    emitted = {a for b in range(B) for node in res.accepted_nodes[b, : int(res.num_accepted[b]) + 1].tolist()
               for a in rows[b, node].tolist()}
    extra = {a: reads[3].get(a, 0) - reads[-1].get(a, 0) for a in set(reads[3]) | set(reads[-1]) | emitted}
    assert {a for a, n in extra.items() if n} <= emitted, "rows no position emits from were read"
    assert all(extra[a] == 1 for a in emitted), sorted(collections.Counter(extra[a] for a in emitted).items())
    assert int(res.num_accepted.max()) >= 2


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("draft", [True, False], ids=["draft_logits", "given"])
def test_triton_long_threshold_searches_find_the_same_thresholds(monkeypatch, draft):
    """The Triton kernel's top-k / top-p searches (kernels/accept/filters.py) with a bracket capacity of 4
    values and 4 pivots: brackets too big to gather are narrowed by more pivot passes (evenly spaced keys),
    top-p searches on its own range after top-k, and ties of many values end as one-value brackets. The
    thresholds are exact either way, so the results are bit-identical to the default search's (and to another
    schedule's); the spy shows that the long searches read the rows more often."""
    from specdec.kernels.accept import accept as triton_accept

    gen = torch.Generator().manual_seed(67 + draft)
    B, T = 8, 4
    temps = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.9, 2.0, 1.0])
    batch = _filtered_batch(B, T, gen, draft=draft, temperature=temps)
    rows = [batch["target_logits"]] + ([batch["draft_logits"]] if draft else [])
    grid = torch.tensor([1.0, 2.0, 1.0, 4.0, 1.0, 2.0, 2.0, 1.0]).view(B, 1, 1)
    rows = [(x * grid).round() / grid for x in rows]  # coarse grids: ties, some spanning whole brackets
    filters = dict(top_k=torch.tensor([5, 0, 20, 3, 12, 0, 30, 9], dtype=torch.int32),
                   top_p=torch.tensor([0.9, 0.8, 1.0, 0.5, 0.97, 0.3, 0.99, 1.0]),
                   min_p=torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.2, 0.001, 0.0]))
    args = (rows[0], batch["tokens"].int(), batch["parents"].int(), rows[1] if draft else None, temps,
            batch["seeds"], batch["num_nodes"], 0, None, filters["top_k"], filters["top_p"], filters["min_p"],
            batch["token_bitmask"])
    spy = MemorySpy(monkeypatch)
    base = AcceptResult.from_op(triton_accept(*args))
    default_reads = sum(spy.counts(rows).values())
    spy.loads.clear()
    long = AcceptResult.from_op(triton_accept(*args, cap=4, num_pivots=4))
    assert sum(spy.counts(rows).values()) > 1.5 * default_reads
    assert _same(base, long), f"{base} != {long}"
    split = dict(num_splits=3, split_steps=4 * (T + 1))
    assert _same(base, triton_accept(*args, cap=4, num_pivots=4, **split))
    assert _same(base, triton_accept(*args, **split))
    checked = dict(batch, target_logits=rows[0], **filters)
    if draft:
        checked["draft_logits"] = rows[1]
    _check_support(base, checked)


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
def test_empty_mask_row(backend):
    """A real node's row that the bitmask leaves empty (or -inf on every allowed token) is a ValueError with
    the value checks on; with them off the op never writes an out-of-range id (the reference: the walk stops
    there with token 0). The C++ op checks its (host) inputs whatever the switch, after a walk that stays in
    bounds."""
    gen = torch.Generator().manual_seed(66)
    B, T = 4, 4
    batch = _batch(B, T, gen, kinds=("chain",), temperature=torch.tensor([0.0, 1.0, 0.7, 0.0]), draft=True)
    batch.update(num_nodes=torch.full((B,), T, dtype=torch.int32), parents=torch.arange(-1, T - 1).expand(B, T))
    best = batch["target_logits"].argmax(-1)
    batch["tokens"][:, 1:] = best[:, :-1]
    allowed = torch.ones(B, T, V, dtype=torch.bool)
    allowed[:, 2] = False  # nothing after node 2
    empty = pack_bitmask(allowed)
    with pytest.raises(ValueError, match="^token_bitmask: a real node's row allows no token"):
        _accept(batch, backend, token_bitmask=empty)
    only_inf = torch.zeros(B, T, V, dtype=torch.bool)
    only_inf[..., 0] = True
    logits = batch["target_logits"].clone()
    logits[0, 1, 0] = NEG_INF  # the one allowed token of request 0's node 1 is -inf
    with pytest.raises(ValueError, match="^target_logits: a real node's row is -inf on every token token_bitmask"):
        _accept(batch, backend, target_logits=logits, token_bitmask=pack_bitmask(only_inf))
    with specdec.value_checks(False):
        if backend == "cpp":
            with pytest.raises(ValueError, match="^token_bitmask"):
                _accept(batch, backend, token_bitmask=empty)
            return
        res = _accept(batch, backend, token_bitmask=empty)
    assert ((res.next_tokens >= 0) & (res.next_tokens < V)).all()
    assert (res.num_accepted <= 2).all()
    if backend == "torch":
        greedy_full = torch.tensor([0, 3])  # greedy chains of argmax drafts: they reach node 2
        assert res.next_tokens[greedy_full].tolist() == [0, 0] and res.num_accepted[greedy_full].tolist() == [2, 2]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("draft", [True, False], ids=["draft", "given"])
def test_non_finite_rows_end_the_walk(backend, draft):
    """Bad input the value checks reject (here with them off): a NaN target row, a target row without a finite
    logit, a subnormal temperature (1/t overflows in float32). The walk must end (the Triton walker's fallback
    for a vanished residual once looped forever on a NaN total) and write ids in [0, V) only; on the NaN and
    the -inf rows the result is the reference's: the walk stops at that node and emits token 0."""
    gen = torch.Generator().manual_seed(67)
    B, T = 4, 4
    batch = _batch(B, T, gen, kinds=("chain",), temperature=torch.tensor([1.0, 0.8, 1e-40, 1.0]), draft=draft)
    batch.update(num_nodes=torch.full((B,), T, dtype=torch.int32), parents=torch.arange(-1, T - 1).expand(B, T))
    logits = batch["target_logits"].clone()
    batch["tokens"][:, 1:] = logits.argmax(-1)[:, :-1]  # likely paths, so the walks reach the bad rows
    point = torch.full((V,), NEG_INF)
    point[int(batch["tokens"][0, 1])] = 0.0
    logits[0, 0] = point  # p is a point mass on node 1's token: node 1 is always accepted
    logits[0, 1] = float("nan")
    logits[1, 0] = NEG_INF
    batch["target_logits"] = logits
    with specdec.value_checks(False):
        res = _accept(batch, backend)
    assert ((res.next_tokens >= 0) & (res.next_tokens < V)).all()
    assert res.num_accepted[:2].tolist() == [1, 0] and res.next_tokens[:2].tolist() == [0, 0]


@pytest.mark.skipif(DEVICE.type == "cuda", reason="interpreter spy: the kernels run compiled on the GPU")
@pytest.mark.parametrize("schedule", [dict(num_splits=1, split_steps=0), dict(num_splits=3, split_steps=7)],
                         ids=["walker", "split-launches"])
def test_triton_fuses_the_bitmask(monkeypatch, schedule):
    """A bitmask without top-k/top-p/min-p is applied inside the kernel: the result is the reference's for
    greedy requests and inside the processed law for sampled ones, the kernel reads the bitmask words of
    the walked nodes only (every word of each: the mask is read beside its row), and no pass processes the
    rows before the kernel (the launcher's processing is made to fail)."""
    import specdec.sampling
    from specdec.kernels.accept import accept as triton_accept

    def no_processing(*args, **kwargs):
        raise AssertionError("the rows were processed before the kernel")
    monkeypatch.setattr(specdec.sampling, "processed_tree_logits", no_processing)

    gen = torch.Generator().manual_seed(62)
    B, T = 6, 6
    temps = torch.tensor([0.0, 1.0, 0.8, 0.0, 1.3, 0.0])
    batch = _filtered_batch(B, T, gen, draft=True, temperature=temps, kinds=("chain", "random"))
    for name in ("top_k", "top_p", "min_p"):
        batch[name] = None
    mask = batch["token_bitmask"]
    spy = MemorySpy(monkeypatch)
    res = AcceptResult.from_op(triton_accept(batch["target_logits"], batch["tokens"].int(), batch["parents"].int(),
                                      batch["draft_logits"], temps, batch["seeds"], batch["num_nodes"], 0,
                                      token_bitmask=mask, block_v=16, **schedule))
    _check_support(res, batch)
    expected = accept_on("torch", **batch)
    greedy = temps == 0
    assert all(torch.equal(x[greedy], y[greedy]) for x, y in zip(res, expected))
    read = set(spy.counts([mask]))
    words = element_addresses(mask)
    walked = set()
    for b in range(B):
        for node in res.accepted_nodes[b, : int(res.num_accepted[b]) + 1].tolist():
            walked |= set(words[b, node].tolist())
    assert read == walked


# Temperatures below reference.GREEDY_BELOW (1e-5 as a float32) are greedy on every backend: at t ~ 1e-12 the
# Triton kernel's logits / t rounded the argmax away and drew a token the bitmask forbids, with top-k or top-p
# for t in ~[1e-18, 1e-10], at 1e-20, and with any setting at a subnormal t (~1e-40).
TINY_FILTERS = {"none": {}, "top_k": dict(top_k=2), "top_p": dict(top_p=0.5)}


@pytest.mark.parametrize("backend", ["torch"] + BACKENDS)
@pytest.mark.parametrize("filters", list(TINY_FILTERS))
@pytest.mark.parametrize("probs", [False, True], ids=["logits", "probs"])
@pytest.mark.parametrize("t", [1e-12, 1e-20, 1e-40, 0.99e-5], ids=str)
def test_temperature_below_greedy_below_is_greedy(backend, filters, probs, t):
    """log([.2, .3, .5]) at every node of a chain, tokens {1, 2} allowed: every request (8 seeds) takes the
    greedy path, the masked argmax 2 at each node, as with temperature 0."""
    B = 8
    rows = torch.tensor([0.2, 0.3, 0.5]).expand(B, 3, 3)
    allowed = torch.tensor([False, True, True]).expand(B, 3, 3)
    laws = dict(target_probs=rows) if probs else dict(target_logits=rows.log())
    batch = dict(laws, tokens=torch.tensor([0, 2, 1]).expand(B, 3), parents=torch.tensor([-1, 0, 1]).expand(B, 3),
                 token_bitmask=pack_bitmask(allowed), seeds=torch.arange(B), **TINY_FILTERS[filters])
    res = accept_on(backend, **batch, temperature=torch.full((B,), t))
    assert res.num_accepted.tolist() == [1] * B and res.next_tokens.tolist() == [2] * B, res
    assert _same(res, accept_on(backend, **batch, temperature=0.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_rows_greedy_in_float64(backend):
    """Float64 rows on every backend: greedy takes the float64 argmax. The Triton kernel computes in float32, so
    its wrapper shifts float64 logits by their max and turns float64 probabilities into shifted logs: 0.3 and the
    next float64 up stay apart (as probabilities divided by their max they were a float32 tie, token 0 won), and
    a column-major view of float64 rows is read as rows (the shifted copy kept its strides and was misread: the
    masked argmax 13 came out as 5)."""
    near = torch.tensor([0.3, 0.3]).double()
    near[1] = torch.nextafter(near[1], torch.tensor(1.0, dtype=torch.float64))
    res = accept_on(backend, target_probs=near.view(1, 1, 2), tokens=torch.zeros(1, 1, dtype=torch.long),
                    parents=torch.full((1, 1), -1))
    assert res.next_tokens.tolist() == [1]
    for row in ([0.0, 5e-324], [-1e-300, 0.0, -2e-300]):  # differences below float32's smallest value
        res = accept_on(backend, target_logits=torch.tensor(row, dtype=torch.float64).view(1, 1, -1),
                        tokens=torch.zeros(1, 1, dtype=torch.long), parents=torch.full((1, 1), -1))
        assert res.next_tokens.tolist() == [1], row
    logits = torch.linspace(0.0, 1.0, 16, dtype=torch.float64).flip(0).reshape(1, 16).expand(3, 16)
    columns = torch.empty(16, 3, dtype=torch.float64).copy_(logits.T).T  # (3, 16), strides (1, 3)
    allowed = torch.zeros(3, 16, dtype=torch.bool)
    allowed[:, [5, 13]] = True
    for packed in (dict(cu_num_nodes=torch.arange(4), max_nodes=1, target_logits=columns, tokens=torch.zeros(3),
                        parents=torch.full((3,), -1), token_bitmask=pack_bitmask(allowed)),
                   dict(target_logits=columns.unsqueeze(1), tokens=torch.zeros(3, 1), parents=torch.full((3, 1), -1),
                        token_bitmask=pack_bitmask(allowed.unsqueeze(1)))):
        args = {k: v.long() if k in ("tokens", "parents") else v for k, v in packed.items()}
        assert accept_on(backend, **args).next_tokens.tolist() == [5, 5, 5]
