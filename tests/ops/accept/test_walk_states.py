"""The Triton accept kernel follows its transition table (`TRANSITIONS`, kernels/accept/records.py): under the
interpreter every decision (`_decide`, `_select_decide`) and every draw (`_draw_if_due`, `_merge_candidates`) is
recorded with the walk's kind before and after it, on batches that take every kind of step (greedy and sampling
requests; token-wise, block and traversal verification; given proposals; filters; candidates or none; the walker
alone and split launches)."""
import numpy as np
import pytest
import torch

from specdec.kernels import accept as kernel
from specdec.kernels.accept import launch, records
from tests.helpers import DEVICE

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.skipif(DEVICE.type != "cpu", reason="records the interpreter's walks")]

V = 40
KIND = {name: records.__dict__[name].value for name in records.TRANSITIONS}
NAME = {value: name for name, value in KIND.items()}
ALLOWED = {(kind, after) for kind, outcomes in records.TRANSITIONS.items() for after in outcomes.values()}
# the steps whose kind before and after are recorded: (name in launch.py, the kinds it acts on: None for any)
STEPS = {"_decide": None, "_select_decide": None, "_draw_if_due": {"TRIAL", "LOCATE"},
         "_merge_candidates": None}


def _kind(walk) -> str:
    return NAME[int(np.asarray(walk.kind.handle.data).reshape(-1)[0])]


def record_transitions(monkeypatch) -> set:
    """Patches the steps in launch.py to record (kind before, kind after) of each call: the set it returns."""
    seen = set()

    def recording(step, acts_on):
        def recorded(req, walk, *args):
            before = _kind(walk)
            out = step(req, walk, *args)
            if acts_on is None or before in acts_on:
                seen.add((before, _kind(out if isinstance(out, records.Walk) else out[0])))
            return out
        return recorded

    for name, acts_on in STEPS.items():
        monkeypatch.setattr(launch, name, recording(getattr(launch, name), acts_on))
    return seen


def _batch(seed, parents, B=8, draft_noise=1.0):
    """B requests of the tree `parents` (odd ones cut short), temperatures 0 and above; each child's token from
    the draft law at its parent, or the target's argmax (long accepted paths)."""
    gen = torch.Generator().manual_seed(seed)
    T = len(parents)
    target = torch.randn(B, T, V, generator=gen) * 2.0
    draft = target + draft_noise * torch.randn(B, T, V, generator=gen)
    tokens = torch.zeros(B, T, dtype=torch.int32)
    for i in range(1, T):
        argmax = target[:, parents[i]].argmax(-1)
        drawn = torch.multinomial(torch.softmax(draft[:, parents[i]], -1), 1, generator=gen).squeeze(1)
        tokens[:, i] = torch.where(torch.rand(B, generator=gen) < 0.3, argmax, drawn).int()
    num_nodes = torch.tensor([T if b % 2 == 0 else 1 + b % T for b in range(B)], dtype=torch.int32)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3] * (B // 4))
    return (target, tokens, torch.tensor([parents] * B, dtype=torch.int32), draft, temperature,
            torch.arange(B, dtype=torch.int64) + seed, num_nodes, 0)


STAR, CHAIN, TREE = [-1, 0, 0, 0, 0], [-1, 0, 1, 2, 3], [-1, 0, 0, 1, 1, 2]
FILTERS = dict(top_k=torch.tensor([3, 0, 5, 2, 0, 4, 6, 0], dtype=torch.int32),
               top_p=torch.tensor([0.9, 0.8, 1.0, 1.0, 0.95, 0.7, 1.0, 0.85]),
               min_p=torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.2, 0.0]))
SCHEDULES = {"walker": dict(num_splits=1, split_steps=0), "split-launches": dict(num_splits=3, split_steps=6)}
# (tree, method, draft logits, filters, extra tunables): together they take every transition of the table
CASES = {"token-star": (STAR, "token", True, False, {}), "token-chain-z-pass": (CHAIN, "token", True, False,
                                                                                 dict(trials=0)),
         "proposals": (TREE, "token", False, False, {}), "block": (CHAIN, "block", True, False, {}),
         "traversal": (TREE, "traversal", True, False, {}), "token-filtered": (STAR, "token", True, True, {}),
         "traversal-filtered": (TREE, "traversal", True, True, dict(trials=0)),
         "proposals-filtered": (TREE, "token", False, True, {})}


def _run(case, schedule, seed=5):
    parents, method, draft, filters, extra = CASES[case]
    args = list(_batch(seed, parents, draft_noise=2.0 if case.endswith("z-pass") else 1.0))
    if not draft:
        args[3] = None
    kernel.accept(*args, method=method, block_v=16, **(FILTERS if filters else {}), **SCHEDULES[schedule], **extra)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_walk_takes_only_the_transitions_of_its_table(monkeypatch, schedule):
    seen = record_transitions(monkeypatch)
    for case in CASES:
        _run(case, schedule)
    assert seen <= ALLOWED, f"transitions not in the table: {sorted(seen - ALLOWED)}"
    # and the batches take every transition of the table (the recording sees the walks; no entry is dead)
    assert seen == ALLOWED, f"not taken: {sorted(ALLOWED - seen)}"
