"""pytest-benchmark suites of every op: `pytest bench/ --benchmark-only` (small shapes; on CPU unless
BENCH_DEVICE=cuda). Each benchmark first checks the output of what it times.

Plain `pytest bench/` also runs the harness's own tests: the peers and the harness's checks against the
reference backend, negative controls of those checks, and the runner and report on toy cases. `make test`
runs this file with --benchmark-disable (every benchmark once, untimed, as a test of its check).
"""
from __future__ import annotations

import os

import pytest
import torch

import specdec
import specdec.ops
from bench import op_accept, op_append, op_attention, op_rollback, report, run, sweep
from bench.cases import TOY, acc, app, attn, rb
from bench.common import Case, Target

DEVICE = torch.device(os.environ.get("BENCH_DEVICE", "cpu"))
BACKENDS = ["triton"] if DEVICE.type == "cuda" else ["cpp"]
SMALL = {
    op_attention: (attn(2, 8, 512, "fp32", Hq=8, Hkv=2), ["sdpa"]),
    op_accept: (acc(8, 8, 8000), ["torch-sampler"]),
    op_rollback: (rb(4, 4, 16, 4, L=128, dtype="fp32"), ["torch-index", "torch-index-stacked"]),
    op_append: (app(4, 8, 256, "fp32"), ["index_put"]),
}


def _inputs(mod, params, device=DEVICE):
    return mod.Inputs(params, device, torch.Generator().manual_seed(0))


def _timed(fn):
    if DEVICE.type != "cuda":
        return fn

    def synced():
        fn()
        torch.cuda.synchronize(DEVICE)
    return synced


@pytest.mark.parametrize("mod,impl", [pytest.param(m, i, id=f"{m.OP}-{i}")
                                      for m, (_, peers) in SMALL.items() for i in BACKENDS + peers])
def test_benchmark_op(benchmark, mod, impl):
    if impl == "cpp" and not specdec.ops.HAS_CPP:
        pytest.skip("C++ extension not built")
    params = SMALL[mod][0]
    x = _inputs(mod, params)
    fn = mod.specdec_fn(x, impl) if impl in BACKENDS else mod.peers(x, Case(mod.OP, params))[impl]()
    x.reset()
    try:
        out = fn()
    except (ImportError, NotImplementedError) as exc:
        pytest.skip(f"{impl} not implemented yet: {exc}")
    assert mod.check(x, out, mod.reference_value(x)).startswith("ok")
    benchmark.extra_info["min_bytes"] = mod.min_bytes(x, out)
    with specdec.value_checks(False):
        benchmark(_timed(fn))


# ----------------------------------------------------------------------------------------------
# the harness's own tests (CPU, toy shapes)
# ----------------------------------------------------------------------------------------------
CPU = torch.device("cpu")


@pytest.mark.parametrize("params", [attn(2, 5, 40, "fp32", Hq=4, Hkv=2, D=64, page=16),
                                    attn(2, 37, 70, "bf16", Hq=4, Hkv=1, D=64)], ids=["paged-fp32", "contig-bf16"])
def test_attention_peer_and_check_value_match_reference(params):
    x = _inputs(op_attention, params, CPU)
    expected = op_attention.reference_value(x)
    out = specdec.tree_attention(x.q, x.k_cache, x.v_cache, x.cache_lens, x.tree_mask, block_table=x.block_table,
                                 num_nodes=x.num_nodes, scale=x.scale, backend="torch")
    assert op_attention.check(x, out, expected).startswith("ok")
    assert op_attention.check(x, op_attention.sdpa_tree_attention(x), expected).startswith("ok")
    wrong = out.clone()
    wrong[0, -1] += 0.1  # negative control: one node's output off
    assert op_attention.check(x, wrong, expected).startswith("MISMATCH")


def test_accept_greedy_peer_matches_reference():
    x = _inputs(op_accept, acc(6, 7, 500, temp=0.0), CPU)
    ref = specdec.accept(x.target_logits, x.tokens, x.parents, draft_logits=x.draft_logits,
                         temperature=x.temperature, seeds=x.seeds, backend="torch")
    assert op_accept.check(x, ref, op_accept.reference_value(x)) == "ok (= greedy peer)"
    assert int(ref.num_accepted.sum()) > 0  # the drafts are good enough to accept something


def test_accept_sampler_peer_accepts_everything_when_draft_is_target():
    x = _inputs(op_accept, acc(16, 6, 300), CPU)
    x.draft_logits = x.target_logits.clone()
    res = op_accept.torch_rejection_sampler(x)
    assert bool((res.num_accepted == 5).all())
    assert op_accept.check(x, res, None) == "ok (valid paths)"


def test_accept_filtered_case_and_its_peer():
    """top_k / top_p cases: accept gets the filters, the drafter samples from the processed law, the peer
    masks the same tokens (vLLM's sort-based masking; random logits have no ties to break)."""
    from specdec.sampling import keep_mask
    x = _inputs(op_accept, acc(6, 5, 300, top_k=20, top_p=0.8), CPU)
    assert op_accept.describe(acc(6, 5, 300, top_k=20, top_p=0.8)).endswith("t1 top_k20 top_p0.8")
    res = specdec.accept(x.target_logits, x.tokens, x.parents, draft_logits=x.draft_logits,
                         temperature=x.temperature, seeds=x.seeds, backend="torch", **x.filters)
    assert op_accept.check(x, res, None) == "ok (valid paths)"
    assert op_accept.check(x, op_accept.torch_rejection_sampler(x), None) == "ok (valid paths)"
    assert set(op_accept.peers(x, None)) == {"torch-sampler", "cpp-unfiltered"}  # the filters' cost is timed too
    rows = x.target_logits.flatten(0, 1)
    peer = op_accept.apply_top_k_top_p(rows.float() / x.temp, 20, 0.8) > float("-inf")
    assert torch.equal(peer, keep_mask(rows, x.temp, 20, 0.8))
    q_keep = keep_mask(x.draft_logits.flatten(0, 1), x.temp, 20, 0.8).view(x.draft_logits.shape)
    drafted = q_keep[:, :-1].gather(-1, x.tokens[:, 1:].long().unsqueeze(-1))  # chain: node i + 1 drawn at node i
    assert bool(drafted.all()), "the drafter drew a token outside its processed law"


@pytest.mark.parametrize("params", [acc(5, 9, 400, tree="tree"), acc(5, 9, 400, tree="tree", draft="topk")],
                         ids=["iid", "topk"])
def test_accept_path_check(params):
    x = _inputs(op_accept, params, CPU)
    res = specdec.accept(x.target_logits, x.tokens, x.parents, draft_logits=x.draft_logits,
                         temperature=x.temperature, seeds=x.seeds, backend="torch")
    assert op_accept.check(x, res, None) == "ok (valid paths)"
    b, j = (int(i) for i in (x.parents > 0).nonzero()[0])  # node j is not a child of the root
    nodes = torch.full_like(res.accepted_nodes, -1)
    nodes[:, 0] = 0
    nodes[b, 1] = j
    num = torch.zeros_like(res.num_accepted)
    num[b] = 1
    broken = specdec.AcceptResult(nodes, num, res.next_tokens)  # negative control
    assert op_accept.check(x, broken, None) == "MISMATCH (path does not follow parent links)"
    assert op_accept.min_bytes(x, res) > 0


@pytest.mark.parametrize("form,page", [("stacked", 16), ("list", 0)])
def test_rollback_peers_and_reference_pass_the_check(form, page):
    x = _inputs(op_rollback, rb(3, 3, 8, 4, L=21, dtype="fp32", Hkv=2, D=16, page=page, form=form), CPU)
    expected = op_rollback.reference_value(x)
    k, v = (x.k_caches[0], x.v_caches[0]) if form == "stacked" else (x.k_caches, x.v_caches)
    x.reset()
    specdec.kv_rollback(k, v, x.cache_lens, x.accepted_nodes, x.num_accepted, block_table=x.block_table,
                        backend="torch")
    assert op_rollback.check(x, None, expected) == "ok (exact)"
    for name, factory in op_rollback.peers(x, None).items():
        x.reset()
        factory()()
        assert op_rollback.check(x, None, expected) == "ok (exact)", name
    x.reset()
    x.cache_lens += x.num_accepted + 1  # negative control: lengths advanced, rows not moved
    assert op_rollback.moved_rows(x) > 0
    assert op_rollback.check(x, None, expected) == "MISMATCH (cache rows)"


def test_append_peer_and_reference_pass_the_check():
    x = _inputs(op_append, app(3, 5, 30, "fp32", Hkv=2, D=16, page=8), CPU)
    x.reset()
    assert op_append.check(x, None, op_append.reference_value(x)) == "MISMATCH (cache rows)"  # poisoned
    specdec.kv_append(x.k_cache, x.v_cache, x.k_new, x.v_new, x.cache_lens, block_table=x.block_table, backend="torch")
    assert op_append.check(x, None, op_append.reference_value(x)) == "ok (exact)"
    x.reset()
    op_append.torch_index_put(x)
    assert op_append.check(x, None, op_append.reference_value(x)) == "ok (exact)"


@pytest.mark.parametrize("case", TOY, ids=[c.op for c in TOY])
def test_runner_rows_on_toy_cases(case):
    ceiling = {"gbps": 10.0}
    rows = list(run.run_case(case, CPU, ["torch", "cpp"], None, ceiling, budget_s=0.01))
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["torch"]["status"] == "ok" and by_impl["torch"]["check"].startswith("ok")
    assert by_impl["torch"]["time_s"] > 0 and by_impl["torch"]["bytes"] > 0
    assert by_impl["cpp"]["status"] in ("ok", "skipped")
    for r in rows:
        assert r["status"] != "error", r
        if r["kind"] == "peer":
            assert r["check"].startswith("ok"), r


def test_report_ratios_and_targets():
    def row(impl, kind, t, pct=None, check="ok"):
        return {"op": "accept", "case": "c", "impl": impl, "kind": kind, "status": "ok", "time_s": t,
                "pct_copy": pct, "check": check, "extra": {}, "note": ""}
    result = {"meta": {}, "ceiling": {"gbps": 10.0},
              "cases": [{"op": "accept", "name": "c", "params": {},
                         "targets": [Target("cpp", "peer", 3.0, "s").__dict__, Target("cpp", "copy", 50.0, "s").__dict__,
                                     Target("triton", "peer", 2.0, "s").__dict__]}],
              "rows": [row("cpp", "specdec", 1.0, pct=40.0), row("peer", "peer", 4.0),
                       {"op": "accept", "case": "c", "impl": "triton", "kind": "specdec", "status": "skipped",
                        "note": "not implemented yet", "check": "n/a", "extra": {}}]}
    assert report.ratios(result) == [{"op": "accept", "case": "c", "impl": "cpp", "vs": "peer", "speedup": 4.0,
                                      "graph_speedup": None}]
    verdicts = [t["verdict"] for t in report.targets(result)]
    assert verdicts == ["PASS", "FAIL", "n/a (not implemented yet)"]
    result["rows"][0]["check"] = "MISMATCH (x)"
    assert report.targets(result)[0]["verdict"] == "PASS (output MISMATCH)"


def test_report_prefers_graph_replay_where_both_sides_were_captured():
    def row(impl, kind, t, pct, graph):
        return {"op": "accept", "case": "c", "impl": impl, "kind": kind, "status": "ok", "time_s": t,
                "pct_copy": pct, "check": "ok", "extra": {}, "note": "", "graph": graph}
    result = {"meta": {"device": "cuda", "date": "d", "cpu_count": 1, "cpu": "x", "torch_threads": 1,
                       "python": "3", "torch": "t", "triton": "t", "git_commit": "c", "git_dirty": False,
                       "triton_interpret": ""},
              "ceiling": {"gbps": 10.0, "method": "m", "timer": "t"},
              "cases": [{"op": "accept", "name": "c", "params": {},
                         "targets": [Target("triton", "copy", 50.0, "s").__dict__,
                                     Target("triton", "peer", 5.0, "s").__dict__,
                                     Target("triton", "sync-peer", 5.0, "s").__dict__]}],
              "rows": [row("triton", "specdec", 1.0, 40.0, {"time_s": 0.5, "pct_copy": 80.0}),
                       row("peer", "peer", 3.0, None, {"time_s": 3.0}),
                       row("sync-peer", "peer", 6.0, None, {"note": "not capturable (RuntimeError: sync)"})]}
    by_vs = {r["vs"]: r for r in report.ratios(result)}
    assert by_vs["peer"]["speedup"] == 3.0 and by_vs["peer"]["graph_speedup"] == 6.0
    assert by_vs["sync-peer"]["speedup"] == 6.0 and by_vs["sync-peer"]["graph_speedup"] is None
    tg = report.targets(result)
    assert [(t["value"], t["timing"], t["eager_value"], t["verdict"]) for t in tg] == [
        (80.0, "graph", 40.0, "PASS"), (6.0, "graph", 3.0, "PASS"), (6.0, "eager", 6.0, "PASS")]
    text = report.markdown(result)
    assert "80.00% (graph replay; eager 40.00%)" in text and "graph: not capturable" in text
    assert "| 500.00 ms | 80.0 |" in text  # the graph columns of the triton row
    result["rows"][0]["graph"] = {"note": "not capturable (x)"}  # no graph time: every target falls back to eager
    assert [(t["value"], t["timing"]) for t in report.targets(result)] == [(40.0, "eager"), (3.0, "eager"), (6.0, "eager")]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton launchers on CPU need the interpreter")
@pytest.mark.parametrize("case", [c for c in TOY if c.op in sweep.SWEEPS], ids=lambda c: c.op)
def test_sweep_variants_compute_the_op(case):
    """Every tuning variant the GPU sweep times returns a checked result (accept: a schedule the default's exact
    one; a candidate count other, equally exact, draws)."""
    rows = list(sweep.sweep_case(case, CPU, {"gbps": 10.0}, budget_s=0.01, smoke=True))
    assert rows[0]["impl"] == "triton default" and len(rows) >= 4
    for r in rows:
        assert r["status"] == "ok" and r["check"].startswith("ok") and "MISMATCH" not in r["check"], r
    if case.op == "accept":
        schedules = [r for r in rows[1:] if "trials" not in r["variant"]]
        assert len(schedules) < len(rows) - 1 and all(r["check"].endswith("= default") for r in schedules)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton launchers on CPU need the interpreter")
def test_sweep_flags_an_accept_variant_that_changes_the_result(monkeypatch):
    from specdec.kernels import accept as ka

    def other_stream(x, kwargs):  # negative control: every non-default variant draws from another Philox offset
        return lambda: specdec.AcceptResult.from_op(ka.accept(x.target_logits, x.tokens, x.parents, x.draft_logits,
                                                               x.temperature, x.seeds, x.num_nodes, 7 if kwargs else 0,
                                                               **kwargs))
    # the default and one schedule variant are enough to show a changed result is flagged
    monkeypatch.setitem(sweep.SWEEPS, "accept", (lambda x: sweep.accept_variants(x)[:2], other_stream))
    case = next(c for c in TOY if c.op == "accept")
    rows = list(sweep.sweep_case(case, CPU, {"gbps": 10.0}, budget_s=0.01, smoke=True))
    assert len(rows) == 2 and "trials" not in rows[1]["variant"]
    assert "differs from the default" in rows[1]["check"]


def test_sweep_ranking_orders_variants_and_marks_the_copy_goal():
    def row(impl, eager, graph, pct):
        return {"op": "attention", "case": "c", "impl": impl, "status": "ok", "time_s": eager, "check": "ok",
                "graph": {"time_s": graph, "pct_copy": pct}}
    result = {"cases": [{"op": "attention", "name": "c", "targets": [], "copy_goal": 80.0}],
              "rows": [row("triton default", 3e-6, 2e-6, 70.0), row("triton num_splits=8", 4e-6, 1.6e-6, 87.5),
                       {"op": "attention", "case": "c", "impl": "triton block_n=128", "status": "error",
                        "time_s": None, "check": "n/a"}]}
    lines = sweep.ranking(result).splitlines()
    assert lines[0] == "attention c (by graph time; target >= 80% copy)"
    assert lines[1].split()[:2] == ["triton", "num_splits=8"] and "1.25x default meets the target" in lines[1]
    assert lines[2].split()[:2] == ["triton", "default"] and "below the target" in lines[2]
    assert len(lines) == 3  # the failed variant is not ranked
