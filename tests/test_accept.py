"""specdec.accept on every backend against the reference: greedy results exactly, sampling results by
their structure (valid root path, tokens in the vocabulary, never a -inf entry), determinism, batch
invariance and mixed greedy/sampling batches. Losslessness of sampling: test_accept_lossless.py.
Sizes are small (the Triton kernel runs in the interpreter); V = 37 is not a multiple of any tile.
Inputs are built on the CPU; the tested backend runs on tests.helpers.DEVICE (SPECDEC_TEST_DEVICE=cuda
runs the compiled kernel on a GPU), the reference on the CPU."""
from __future__ import annotations

import pytest
import torch
import triton

from specdec.ops import AcceptResult
from tests.helpers import BACKENDS, DEVICE, MemorySpy, accept_on, element_addresses, random_trees, to_device

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
    acc, num, nxt = res
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
    res = _accept(batch, backend)
    _check_structure(res, batch)
    perm = torch.tensor([5, 3, 1, 0, 4, 2])
    permuted = {k: (v[perm] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    res_perm = _accept(permuted, backend)
    assert all(torch.equal(x[perm], y) for x, y in zip(res, res_perm))
    others = _batch(6, 6, torch.Generator().manual_seed(99), draft=draft, temperature=1.0)
    mixed = {k: (torch.cat([v[:3], others[k][3:]]) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    res_mixed = _accept(mixed, backend)
    assert all(torch.equal(x[:3], y[:3]) for x, y in zip(res, res_mixed))


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
    res = AcceptResult(*triton_accept(target, batch["tokens"].int(), batch["parents"].int(), draft, temps,
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
def hopper_compile_report() -> None:
    """Prints (JSON) the spilled bytes of every launch variant at the benchmark shape (bf16, T 8, V 128256).
    Runs in a fresh process without TRITON_INTERPRET (the interpreter's patches break the compiler)."""
    import json

    from specdec.kernels import accept as ka
    from tests.test_tree_attention import compile_for_hopper, spilled_bytes

    T, V = 8, 128_256
    cfg = ka._config(T, V, 2, torch.device("cuda"))
    S = cfg["num_splits"]
    types = {"target_ptr": "*bf16", "draft_ptr": "*bf16", "tokens_ptr": "*i32", "parents_ptr": "*i32",
             "temp_ptr": "*fp32", "seeds_ptr": "*i64", "num_nodes_ptr": "*i32", "offsets_ptr": "*i64",
             "acc_ptr": "*i32",
             "num_acc_ptr": "*i32", "next_ptr": "*i64", "state_i_ptr": "*i32", "state_f_ptr": "*fp32",
             "part_f_ptr": "*fp32", "part_i_ptr": "*i32"}
    report = {}
    for has_draft in (True, False):
        for first, walk in ((True, False), (False, False), (False, True)):
            constexprs = dict(HAS_DRAFT=has_draft, HAS_OFFSETS=True, IS_FIRST=first, NUM_SPLITS=S,
                              SPLIT_V=triton.cdiv(triton.cdiv(V, S), cfg["block_v"]) * cfg["block_v"],
                              BLOCK_V=cfg["block_v"], T_BLOCK=T, S_BLOCK=triton.next_power_of_2(S),
                              PREFETCH=cfg["prefetch"], TRIALS=cfg["trials"])
            kernel = compile_for_hopper(ka._walk_kernel if walk else ka._split_kernel, types, constexprs,
                                        cfg["num_warps"])
            report[f"draft={has_draft},first={first},walk={walk}"] = spilled_bytes(kernel)
    print(json.dumps(report))


@pytest.mark.skipif("nvidia" not in getattr(triton.backends, "backends", {}), reason="no Triton CUDA backend")
@pytest.mark.skipif(DEVICE.type == "cuda", reason="an offline compile check; on a GPU the kernels run for real")
def test_compiles_for_hopper():
    """Every launch variant compiles for sm_90; register spills stay negligible."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "from tests.test_accept import hopper_compile_report; hopper_compile_report()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(spilled is None or spilled <= 64 for spilled in report.values()), report


def test_emitted_tokens_layout():
    """AcceptResult.emitted_tokens: accepted draft tokens in path order, then the next token, -1 after."""
    res = AcceptResult(accepted_nodes=torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 2, 3]], dtype=torch.int32),
                       num_accepted=torch.tensor([2, 0, 3], dtype=torch.int32), next_tokens=torch.tensor([9, 7, 4]))
    tokens = torch.tensor([[5, 11, 12, 13], [5, 21, 22, 23], [5, 31, 32, 33]], dtype=torch.int32)
    assert res.emitted_tokens(tokens).tolist() == [[12, 13, 9, -1], [7, -1, -1, -1], [31, 32, 33, 4]]
