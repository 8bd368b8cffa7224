"""bench.structured on a tiny run: every row written for every temperature and batch size, its outputs validated; a
run whose outputs ignore the schema fails, and the validity checks reject what breaks a schema."""
from __future__ import annotations

import json

import pytest

import specdec
from specdec._validation import value_checks_enabled

pytest.importorskip("xgrammar")
from bench import structured  # noqa: E402
from specdec.loop.decoding import SpeculativeDecoder  # noqa: E402
from specdec.loop.grammar import XGrammarBackend  # noqa: E402
from specdec.loop.models.tokenizer import EOS, VOCAB_SIZE  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

METHODS = ["masked AR", "jump-forward 16 (no drafter)"] + [
    f"{drafter}{jump}" for drafter in ("draft model chain:4", "MTP chain:3", "prompt lookup chain:4",
                                       "suffix (16 nodes, depth 8)") for jump in ("", " + jump-forward 16")]


def test_every_row_is_written_with_validated_outputs(tmp_path):
    with specdec.value_checks(True):  # (main turns them off for its runs: the previous setting comes back)
        structured.main(["--prompts", "2", "--batch-sizes", "1,2", "--schemas", "enum", "--temperatures", "0,0.8",
                         "--max-new-tokens", "64", "--repeats", "1", "--out", str(tmp_path)])
    assert value_checks_enabled()  # (the tests after this one check values)
    res = json.loads((tmp_path / "structured.json").read_text())
    rows = {(r["method"], r["temperature"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(m, t, b) for m in METHODS for t in (0.0, 0.8) for b in (1, 2)}
    assert res["outputs"] == res["complete_outputs"] == len(rows) * 2  # (2 prompts a row, all ended at the EOS)
    for (method, temperature, batch), r in rows.items():
        assert r["identical"] is (True if temperature == 0 else None)
        assert (r["forced_fraction"] > 0.5) == ("jump-forward" in method)  # (the schema's keys are forced)
        assert r["matcher_ms_per_step"] > 0 and r["tokens_per_step"] >= 1
    assert rows[("masked AR", 0.0, 1)]["speedup_vs_masked_ar"] == 1.0
    assert rows[("draft model chain:4", 0.0, 1)]["tokens_per_step"] > 2
    md = (tmp_path / "structured.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ") and not line.startswith("| method")]
    assert [line.split(" | ")[0][2:] for line in table] == [m for _ in range(4) for m in METHODS]


def test_a_run_whose_outputs_follow_another_schema_fails(tmp_path, monkeypatch):
    generate = SpeculativeDecoder.generate

    def generate_under_numbers(self, *args, grammar, **kwargs):
        return generate(self, *args, grammar={"json_schema": structured.SCHEMAS["numbers"]}, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate_under_numbers)
    with pytest.raises(RuntimeError, match="masked AR .*not a JSON document of schema 'enum'"):
        structured.main(["--prompts", "1", "--batch-sizes", "1", "--schemas", "enum", "--temperatures", "0",
                         "--max-new-tokens", "64", "--methods", "^$", "--repeats", "1", "--out", str(tmp_path)])
    assert not (tmp_path / "structured.md").exists()


def test_the_checks_reject_outputs_outside_the_schema():
    backend = XGrammarBackend.byte_vocabulary(VOCAB_SIZE, EOS)
    check = lambda text, max_new=64, allow_truncated=False: structured.check_output(  # noqa: E731
        backend, "enum", list(text.encode()), max_new, allow_truncated, "row")
    good = '{"level": "info", "color": "red", "retries": 3}'
    assert check(good)
    for bad in ('{"level": "trace", "color": "red", "retries": 3}', '{"level": "info", "color": "red"}',
                '{"level": "info", "color": "red", "retries": 3'):
        with pytest.raises(RuntimeError, match="not a JSON document of schema 'enum'"):
            check(bad)
    with pytest.raises(RuntimeError, match="reached --max-new-tokens 20"):
        check(good[:20], max_new=20)
    assert not check(good[:20], max_new=20, allow_truncated=True)  # (a valid prefix, cut)
    # the schema's keywords are checked apart from xgrammar's
    schema = structured.SCHEMAS["numbers"]
    assert structured.conforms(schema, {"values": [1, -2.5], "unit": "ms"})
    for bad in ({"values": [], "unit": "ms"}, {"values": [101], "unit": "ms"}, {"values": [1] * 9, "unit": "s"},
                {"values": [True], "unit": "s"}, {"values": [1], "unit": "h"}, {"values": [1]},
                {"values": [1], "unit": "s", "extra": 0}):
        assert not structured.conforms(schema, bad), bad
    assert not structured.conforms(structured.SCHEMAS["nested"], {"name": "a" * 13, "point": {"x": 0, "y": 0},
                                                                  "visible": True})
