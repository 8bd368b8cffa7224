"""bench.e2e's mechanics on the CPU: a device's run (steps replayed as graphs, some rows also eager, the target's
forward timed apart) with CUDA-graph semantics emulated (helpers.ReplayGraph), and the sections other scripts wrote
into its markdown kept."""
from __future__ import annotations

import json

import pytest

import specdec
from specdec._validation import value_checks_enabled

pytestmark = pytest.mark.usefixtures("one_thread")


def test_e2e_replays_steps_as_graphs_runs_some_rows_eagerly_and_keeps_other_scripts_sections(tmp_path, monkeypatch):
    from helpers import ReplayGraph
    from bench import e2e
    monkeypatch.setattr(e2e, "step_graph_class", lambda device, compile: ReplayGraph)
    (tmp_path / "e2e.md").write_text("# an older table\n\n| x |\n\n## Verifiers (bench.verifiers) (then)\n\n| a |\n")
    with specdec.value_checks(True):  # (main turns them off for the thread: the previous setting comes back)
        e2e.main(["--prompts", "2", "--max-new-tokens", "10", "--repeats", "1", "--no-transformers",
                  "--methods", r"spec chain:4( \[eager\])?$|lookup chain:8( \[eager\])?$|parallel chain:4$", "--out",
                  str(tmp_path)])
    assert value_checks_enabled()  # (the tests after this one check values)
    res = json.loads((tmp_path / "e2e.json").read_text())
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {f"ours {name}{how}" for name in ("AR", "spec chain:4", "prompt lookup chain:8")
                         for how in ("", " [eager]")} | {"ours parallel chain:4"}
    assert all(r["identical"] for r in rows.values()) and res["config"]["cuda_graphs"]
    for how in ("", " [eager]"):  # (prompt lookup's widths vary per step: its forward's time is not known)
        assert rows["ours spec chain:4" + how]["outside_target_ms_per_step"] is not None
        assert rows["ours prompt lookup chain:8" + how]["outside_target"] is None
        assert rows["ours spec chain:4" + how]["tau"] > 1
    assert rows["ours parallel chain:4"]["tau"] > 1 and res["config"]["parallel"].endswith("parallel")
    md = (tmp_path / "e2e.md").read_text()
    assert md.startswith("# End-to-end") and "older table" not in md and "replayed as CUDA graphs" in md
    assert md.count("## Verifiers (bench.verifiers)") == 1 and md.rstrip().endswith("| a |")


def test_e2e_suffix_rows_forget_the_earlier_passes_outputs(tmp_path, monkeypatch):
    """Every pass of a suffix decoding row decodes as a fresh drafter would (its memory of the earlier passes, which
    repeat the prompts, emptied), and its greedy outputs are AR's."""
    from bench import e2e
    from specdec.loop.decoding import SpeculativeDecoder
    from specdec.loop.drafters import SuffixDrafter
    taus, run_ours = [], e2e.run_ours

    def recording(decoder, prompts, max_new, **kw):
        run = run_ours(decoder, prompts, max_new, **kw)
        if isinstance(decoder.drafter, SuffixDrafter) and max_new == 12 and not kw:  # (greedy, timed: no warm-up)
            taus.append(run.tau)
        return run
    monkeypatch.setattr(e2e, "run_ours", recording)
    with specdec.value_checks(True):
        e2e.main(["--prompts", "2", "--max-new-tokens", "12", "--repeats", "2", "--no-transformers",
                  "--methods", r"suffix tree", "--out", str(tmp_path)])
    rows = {r["method"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["rows"]}
    assert rows["ours suffix tree (depth 8, 16 nodes)"]["identical"]
    target = e2e.load_model(e2e.os.path.join(e2e.ASSETS, "target"))
    prompts = [e2e.ByteTokenizer().encode(p) for p in e2e.held_out_prompts(2, 300)]
    fresh = run_ours(SpeculativeDecoder(target, SuffixDrafter(max_depth=8)), prompts, 12)
    assert taus == [fresh.tau] * 2
