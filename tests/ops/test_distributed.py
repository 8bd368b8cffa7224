"""specdec.distributed.accept: vocab-parallel acceptance over gloo process groups of 2 and 4 ranks.

Each group is spawned once per test process (torch.multiprocessing, a file store) and runs every scenario
below on every rank; the tests then check what the ranks returned. The vocabulary is split unevenly, and
rank r does not hold the r-th piece (the shards tile [0, V) in any order). Checked:
  - greedy results equal specdec.accept (the reference) on the gathered logits: trees, ragged counts, grammar
    masks, the packed form, probabilities, greedy rows among sampled ones;
  - sampled results follow the target's law: chi-square over the first one, two and three emitted tokens
    (tests/ops/accept/test_lossless.py's scenarios and tests/ops/accept/markov.py's Markov steps: chains and trees,
    with and without draft laws, every filter and a path-dependent mask, block verification, probabilities);
  - traversal verification likewise (random trees, binary trees, every filter);
  - the mean accepted length equals its exact value (enumerated), token-wise, block and traversal;
  - every rank returns the same result; a call repeated returns it again; packed == padded;
  - the bytes that cross do not grow with V (never a row of logits);
  - bad input raises the same error on every rank, also when only one rank's input is bad, and the group
    stays usable afterwards (no rank left in a collective).
"""
from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specdec
from specdec import distributed as sd
from tests.ops.accept import markov
from tests.ops.accept import test_lossless as lossless
from tests.helpers import random_trees
from tests.stats import assert_law, first_tokens

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

WORLDS = (2, 4)
N = lossless.SAMPLES


def pieces(V: int, world: int) -> list[tuple[int, int]]:
    """Rank r's columns: uneven cuts (widths 1, 2, 1, 2, ... scaled up to V), handed out in reverse order."""
    widths = [1 + (i % 2) for i in range(world)]
    scale = V // sum(widths)
    widths = [w * scale for w in widths] if scale else [1] * world
    widths[-1] += V - sum(widths)
    starts = [sum(widths[:i]) for i in range(world)]
    spans = [(s, s + w) for s, w in zip(starts, widths)]
    return spans[::-1]


def _rank_accept(backend=None, *, target_logits=None, draft_logits=None, target_probs=None, draft_probs=None,
                 **args):
    """The test modules' accept_on(backend, ...) with full-vocabulary inputs, as this rank's shard call."""
    full = target_logits if target_logits is not None else target_probs
    V = full.shape[-1]
    start, end = pieces(V, dist.get_world_size())[dist.get_rank()]
    cut = {name: x[..., start:end] for name, x in (("target_logits_shard", target_logits),
                                                    ("draft_logits_shard", draft_logits),
                                                    ("target_probs_shard", target_probs),
                                                    ("draft_probs_shard", draft_probs)) if x is not None}
    return sd.accept(**cut, vocab_start=start, vocab_size=V, **args)


# ----------------------------------------------------------------------------------------------
# the scenarios, run on every rank; each returns tensors (or error records) for the tests to check
# ----------------------------------------------------------------------------------------------
def _greedy_batches():
    """Random batches with their reference results: (name, kwargs of accept, reference AcceptResult, rows to
    compare)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for name in ("trees", "mask", "packed", "probs", "mixed", "near_ties"):
        B, T, V = 6, 7, 301
        parents, num_nodes = random_trees(B, T, gen)
        logits = torch.randn(B, T, V, generator=gen) * 2
        tokens = torch.randint(0, V, (B, T), generator=gen)
        best = logits.argmax(-1)  # make acceptance likely: half the nodes carry their parent's argmax
        take = torch.rand(B, T, generator=gen) < 0.6
        tokens = torch.where(take, best.gather(1, parents.clamp(min=0).long()), tokens)
        args = dict(tokens=tokens, parents=parents, num_nodes=num_nodes)
        rows = torch.ones(B, dtype=torch.bool)
        if name == "mask":
            allowed = torch.rand(B, T, V, generator=gen) < 0.3
            allowed[..., 0] = True
            args["token_bitmask"] = specdec.sampling.pack_bitmask(allowed)
        if name == "mixed":  # (t < GREEDY_BELOW is greedy: a subnormal t overflowed logits / t)
            t = torch.tensor([0.0, 0.9, 1e-40, 1.3, 0.99e-5, 0.7])
            args.update(temperature=t, seeds=torch.arange(B), top_k=torch.tensor([0, 3, 5, 0, 2, 9]), top_p=0.8,
                        draft_logits=torch.randn(B, T, V, generator=gen))
            rows = t < specdec.reference.GREEDY_BELOW
        if name == "near_ties":  # probabilities a float32 ulp apart at the top, the larger one second: argmax 1
            probs = torch.softmax(logits, -1)
            top = probs.amax(-1)
            probs[..., 0], probs[..., 1] = torch.nextafter(top, torch.zeros(())), top
            args["tokens"] = torch.where(take, 1, tokens)
            ref = specdec.accept(target_probs=probs, backend="torch", **args)
            args["target_probs"] = probs
        else:
            ref = specdec.accept(target_logits=logits, backend="torch", **args)
        if name == "probs":
            args["target_probs"] = torch.softmax(logits, -1) * 3.0
        elif name != "near_ties":
            args["target_logits"] = logits
        if name == "packed":
            keep = torch.arange(T) < num_nodes.unsqueeze(1)
            for key in ("target_logits", "tokens", "parents"):
                args[key] = args[key][keep]
            args["cu_num_nodes"] = torch.cat([torch.zeros(1, dtype=torch.long), num_nodes.long().cumsum(0)])
            args["max_nodes"] = T
            del args["num_nodes"]
        out.append((name, args, ref, rows))
    return out


def scenario_greedy():
    return [(name, _rank_accept(**args), ref, rows) for name, args, ref, rows in _greedy_batches()]


def scenario_first_token():
    out = {}
    for name, cfg in lossless.SCENARIOS.items():
        batch = lossless._scenario(n=N, seed=len(name), **cfg)
        out[name] = first_tokens(_rank_accept(**batch), batch["tokens"])
    # given proposals that repeat a token among siblings: a rejected token stays rejected
    batch = lossless._scenario(n=N, seed=98, parents=lossless.TOPK_TREE, t=1.0, with_draft=False,
                               given_tokens=[0, 0, 0, 1, 0, 2, 3])
    out["repeated_given"] = first_tokens(_rank_accept(**batch), batch["tokens"])
    batch = lossless._scenario(n=N, seed=99, **lossless.SCENARIOS["tree_iid_draft"])  # probabilities
    t = batch.pop("temperature")
    probs = {"target_probs": torch.softmax(batch.pop("target_logits") / t, -1) * 2.5,
             "draft_probs": torch.softmax(batch.pop("draft_logits") / t, -1) * 0.5}
    out["probs"] = first_tokens(_rank_accept(**batch, **probs, temperature=1.0), batch["tokens"])
    return out


def scenario_two_tokens():
    out = {}
    for with_draft, parents, t in ((True, markov.MARKOV_TREE, 1.0), (False, markov.CHAIN, 0.8)):
        out[("plain", with_draft)] = markov.generated_tokens(_rank_accept, parents, t, N, 3 + with_draft, 2,
                                                             with_draft=with_draft)
        for i, name in enumerate(markov.FILTERS if with_draft else ["all"]):
            out[(name, with_draft)] = markov.generated_tokens(_rank_accept, parents, t, N, 5 + i, 2,
                                                              with_draft=with_draft, filters=markov.FILTERS[name])
    return out


def scenario_two_tokens_few_candidates():
    """The filtered cases again with one candidate per rank and row: most thresholds are not resolved by the
    candidates and come from the bisections, some are (on the 4-token vocabulary)."""
    default, sd._CANDIDATES = sd._CANDIDATES, 1
    try:
        return {name: markov.generated_tokens(_rank_accept, markov.MARKOV_TREE, 1.0, N, 40 + i, 2,
                                              filters=markov.FILTERS[name])
                for i, name in enumerate(("top_k", "top_p", "all"))}
    finally:
        sd._CANDIDATES = default


def scenario_block():
    chain = markov.chain(3)
    return {"plain": markov.generated_tokens(_rank_accept, chain, 1.0, N, 14, 3, method="block"),
            "all": markov.generated_tokens(_rank_accept, chain, 0.9, N, 21, 2, filters=markov.FILTERS["all"],
                                           method="block")}


def scenario_traversal():
    trees = markov.SAMPLED_TREES
    return {"random7": markov.generated_tokens(_rank_accept, trees["random7"], 1.0, N, 38, 3, method="traversal"),
            "binary": markov.generated_tokens(_rank_accept, trees["binary"], 2.0, N, 37, 3, method="traversal"),
            "all": markov.generated_tokens(_rank_accept, markov.BINARY, 0.9, N, 23, 2, filters=markov.FILTERS["all"],
                                           method="traversal")}


MEAN_LENGTH_CASES = [("token", markov.chain(3)), ("block", markov.chain(4)), ("traversal", markov.BINARY),
                     ("traversal", markov.MIXED)]


def scenario_mean_length():
    out = []
    for method, parents in MEAN_LENGTH_CASES:
        gen = torch.Generator().manual_seed(5 + len(parents))
        batch = markov.markov_step(torch.zeros(N, dtype=torch.int64), parents, 1.0, True, gen)
        out.append(_rank_accept(**batch, seeds=torch.arange(N) + 17, offset=0, method=method).num_accepted)
    return out


def scenario_repeat_and_packed():
    """The same sampled call twice, its packed form, and that with fresh seeds."""
    gen = torch.Generator().manual_seed(3)
    B, T, V = 8, 6, 97
    parents, num_nodes = random_trees(B, T, gen)
    args = dict(target_logits=torch.randn(B, T, V, generator=gen), draft_logits=torch.randn(B, T, V, generator=gen),
                tokens=torch.randint(0, V, (B, T), generator=gen), parents=parents, temperature=0.9,
                seeds=torch.arange(B) * 3, offset=torch.arange(B) + 5, top_p=0.95)
    first, again = _rank_accept(**args, num_nodes=num_nodes), _rank_accept(**args, num_nodes=num_nodes)
    keep = torch.arange(T) < num_nodes.unsqueeze(1)
    for key in ("target_logits", "draft_logits", "tokens", "parents"):
        args[key] = args[key][keep]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), num_nodes.long().cumsum(0)])
    packed = _rank_accept(**args, cu_num_nodes=cu, max_nodes=T)
    del args["seeds"]  # fresh seeds: rank 0's, so the ranks still agree (test_every_rank_returns_the_same_results)
    fresh = _rank_accept(**args, cu_num_nodes=cu, max_nodes=T)
    return first, again, packed, fresh


def scenario_bytes():
    """The bytes this rank sends, for the same batch shape at two vocabulary sizes (greedy, sampled)."""
    out = {}
    for V in (64, 640):
        gen = torch.Generator().manual_seed(V)
        B, T = 4, 5
        parents, num_nodes = random_trees(B, T, gen)
        for t in (0.0, 1.0):
            stats = {}
            start, end = pieces(V, dist.get_world_size())[dist.get_rank()]
            sd.accept(torch.randn(B, T, V, generator=gen)[..., start:end], torch.randint(0, V, (B, T), generator=gen),
                      parents, draft_logits_shard=torch.randn(B, T, V, generator=gen)[..., start:end],
                      num_nodes=num_nodes, temperature=t, seeds=torch.arange(B), vocab_start=start, vocab_size=V,
                      stats=stats)
            out[(V, t)] = stats
    return out


LOOP_PROMPTS = ["def fib(n):\n    ", "import os\nimport s", "class Stack:\n    def push(self, x):"]
LOOP_CASES = [("chain:4", None), ("tree:2,2,1", 4)]  # (tree, the target cache's block size: paged)


def _shipped_pair_on_this_rank():
    """The shipped pair with the target's LM head cut to this rank's piece, and that piece's VocabShard."""
    from specdec.loop.cli import ASSETS
    from specdec.loop.models.hf import load_model
    target, draft = (load_model(os.path.join(ASSETS, name)) for name in ("target", "draft"))
    V = target.cfg.vocab_size
    start, end = pieces(V, dist.get_world_size())[dist.get_rank()]
    target.shard_lm_head(start, end)
    return target, draft, sd.VocabShard(start, V)


def scenario_loop():
    """The loop on the shipped pair with the target's head sharded: greedy outputs (chain and paged tree, a
    batch of 3) and, sampled at T = 0.8, the first two tokens of many seeds (token-wise chain:3, block chain:4)."""
    from specdec.loop.decoding import SpeculativeDecoder
    from specdec.loop.drafters import DraftModelDrafter
    from specdec.loop.models.tokenizer import ByteTokenizer
    target, draft, shard = _shipped_pair_on_this_rank()
    prompts = [ByteTokenizer().encode(p) for p in LOOP_PROMPTS]
    out = {"greedy": {}, "sampled": {}}
    for tree, block_size in LOOP_CASES:
        decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), block_size=block_size, vocab_shard=shard)
        out["greedy"][tree] = decoder.generate(prompts, 24).tokens
    n = 600 if dist.get_world_size() == 2 else 0  # (the law once: 4 ranks on 2 cores make it slow)
    for tree, method in (("chain:3", "token"), ("chain:4", "block")) if n else ():
        decoder = SpeculativeDecoder(target, DraftModelDrafter(draft, tree), method=method, vocab_shard=shard)
        out["sampled"][method] = decoder.generate([prompts[1]] * n, 2, 0.8, seed=list(range(1000, 1000 + n))).tokens
    return out


def _bad_calls():
    """(name, call) pairs; each call is bad on some ranks only, or on all."""
    rank, world = dist.get_rank(), dist.get_world_size()
    B, T, V = 2, 3, 40
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(B, T, V, generator=gen)
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 0]])
    tokens = torch.randint(0, V, (B, T), generator=gen)
    start, end = pieces(V, world)[rank]

    def call(shard=None, **kw):
        args = dict(vocab_start=start, vocab_size=V, temperature=1.0, seeds=torch.arange(B))
        args.update(kw)
        return sd.accept(logits[..., start:end] if shard is None else shard, args.pop("tokens", tokens),
                         args.pop("parents", parents), **args)

    nan = logits[..., start:end].clone()
    nan[0, 1, 0] = math.nan
    return [
        ("nan on the last rank", lambda: call(nan if rank == world - 1 else None)),
        ("token out of range", lambda: call(tokens=torch.where(torch.arange(T) == 2, V + 3, tokens))),
        ("overlapping shards", lambda: call(vocab_start=0)),
        ("a gap", lambda: call(shard=logits[..., start:end - 1] if rank == 0 else None)),
        ("tokens differ", lambda: call(tokens=tokens + (rank == 1))),
        ("bad top_p on one rank", lambda: call(top_p=1.5 if rank == 0 else 0.9)),
        ("block on a tree", lambda: call(method="block", draft_logits_shard=logits[..., start:end])),
    ]


def scenario_errors():
    out = []
    for name, bad in _bad_calls():
        try:
            bad()
            out.append((name, None, None))
        except (TypeError, ValueError) as e:
            out.append((name, type(e).__name__, str(e)))
    gen = torch.Generator().manual_seed(0)  # the group still works
    logits = torch.randn(2, 3, 40, generator=gen)
    start, end = pieces(40, dist.get_world_size())[dist.get_rank()]
    res = sd.accept(logits[..., start:end], torch.zeros(2, 3, dtype=torch.long), torch.tensor([[-1, 0, 1]] * 2),
                    vocab_start=start, vocab_size=40)
    out.append(("after", None, res.next_tokens.tolist()))
    return out


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def _worker(rank, world, store, outdir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn()
        except Exception:  # reported by the test of that scenario
            results[name] = traceback.format_exc()
    torch.save(results, os.path.join(outdir, f"{rank}.pt"))
    dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def group_results(world: int) -> list[dict]:
    """Every scenario's results on each rank of a fresh gloo group of `world` processes."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, (world, os.path.join(d, "store"), d), nprocs=world)
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def results(world: int, name: str) -> list:
    per_rank = [r[name] for r in group_results(world)]
    for r in per_rank:
        if isinstance(r, str):
            pytest.fail(f"scenario {name} raised on a rank:\n{r}")
    return per_rank


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", WORLDS)
def test_every_rank_returns_the_same_results(world):
    ranks = group_results(world)
    for name in SCENARIOS:
        results(world, name)  # (none raised)
        for r in range(1, world):
            assert _same(ranks[r][name], ranks[0][name]), f"{name}: rank {r} differs from rank 0"


@pytest.mark.parametrize("world", WORLDS)
def test_greedy_equals_unsharded_accept(world):
    for name, got, ref, rows in results(world, "greedy")[0]:
        for g, e in zip(got, ref):
            assert torch.equal(g[rows].long(), e[rows].long()), name


@pytest.mark.parametrize("world", WORLDS)
def test_sampled_first_token_follows_the_target(world):
    got = results(world, "first_token")[0]
    for name, cfg in lossless.SCENARIOS.items():
        assert_law(got[name], lossless.target_law(lossless.TARGET_ROOT, cfg["t"]), f"{name}, {world} ranks")
    for name in ("repeated_given", "probs"):
        assert_law(got[name], lossless.target_law(lossless.TARGET_ROOT, 1.0), f"{name}, {world} ranks")


@pytest.mark.parametrize("world", WORLDS)
def test_first_two_tokens_follow_the_markov_target_with_and_without_filters(world):
    got = results(world, "two_tokens")[0]
    for (filters, with_draft), pairs in got.items():
        t = 1.0 if with_draft else 0.8
        law = markov.two_token_law(t, None if filters == "plain" else markov.FILTERS[filters])
        assert_law(markov.index(pairs), law, f"{filters}, draft={with_draft}, {world} ranks")


@pytest.mark.parametrize("world", WORLDS)
def test_filters_follow_the_target_when_the_candidates_do_not_settle_them(world):
    got = results(world, "two_tokens_few_candidates")[0]
    for name, pairs in got.items():
        law = markov.two_token_law(1.0, markov.FILTERS[name])
        assert_law(markov.index(pairs), law, f"{name}, one candidate, {world} ranks")


@pytest.mark.parametrize("world", WORLDS)
def test_block_verification_follows_the_markov_target(world):
    got = results(world, "block")[0]
    assert_law(markov.index(got["plain"]), markov.k_token_law(1.0, 3), f"block, three tokens, {world} ranks")
    assert_law(markov.index(got["all"]), markov.two_token_law(0.9, markov.FILTERS["all"]),
               f"block with every filter, {world} ranks")


@pytest.mark.parametrize("world", WORLDS)
def test_traversal_verification_follows_the_markov_target(world):
    got = results(world, "traversal")[0]
    for name, t in (("random7", 1.0), ("binary", 2.0)):
        tokens = got[name]
        assert_law(markov.index(tokens[:, :2]), markov.k_token_law(t, 2), f"traversal, two tokens, {name}")
        assert_law(markov.index(tokens), markov.k_token_law(t, 3), f"traversal, three tokens, {name}, {world} ranks")
    assert_law(markov.index(got["all"]), markov.two_token_law(0.9, markov.FILTERS["all"]),
               f"traversal with every filter, {world} ranks")


@pytest.mark.parametrize("world", WORLDS)
def test_mean_accepted_length_is_the_exact_one(world):
    got = results(world, "mean_length")[0]
    p = torch.softmax(markov.P_TARGET.log(), -1)
    q = torch.softmax(markov.Q_DRAFT.log(), -1)
    for (method, parents), n in zip(MEAN_LENGTH_CASES, got):
        n, want = n.double(), markov.exact_accepted(method, p, q, parents)
        assert abs(float(n.mean()) - want) < 4 * float(n.std()) / math.sqrt(n.numel()), (method, parents, want)


@pytest.mark.parametrize("world", WORLDS)
def test_results_repeat_and_the_packed_form_equals_the_padded(world):
    first, again, packed, _ = results(world, "repeat_and_packed")[0]
    assert _same(first, again)
    assert _same(first, packed)
    assert int(first.num_accepted.sum()) > 0  # (a batch that accepts something: the comparison bites)


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_sent_do_not_grow_with_the_vocabulary(world):
    got = results(world, "bytes")[0]
    for t in (0.0, 1.0):
        assert got[(64, t)] == got[(640, t)], t
        # a (B, T) = (4, 5) batch: far below one row of logits per node (640 * 4 bytes each)
        assert 0 < got[(640, t)]["bytes"] < 4 * 5 * 640 * 4 / 2


@pytest.mark.parametrize("world", WORLDS)
def test_loop_with_a_sharded_lm_head_equals_the_unsharded_run(world):
    """Greedy: the tokens of the unsharded loop (and of AR), every request; sampled: the target's exact law of the
    first two tokens (chi-square, as tests/loop/test_loop.py's on the shipped pair)."""
    import numpy as np
    from scipy.stats import chi2
    from specdec.loop.cli import ASSETS
    from specdec.loop.decoding import generate_ar
    from specdec.loop.models.hf import load_model
    from specdec.loop.models.tokenizer import ByteTokenizer
    from tests.loop.test_loop import exact_two_token_law
    got = results(world, "loop")[0]
    target = load_model(os.path.join(ASSETS, "target"))
    prompts = [ByteTokenizer().encode(p) for p in LOOP_PROMPTS]
    ar = generate_ar(target, prompts, 24).tokens
    for tree, _ in LOOP_CASES:
        assert got["greedy"][tree] == ar, tree
    law = exact_two_token_law(target, prompts[1], 0.8)
    assert len(got["sampled"]) == (2 if world == 2 else 0)
    for method, tokens in got["sampled"].items():
        n = len(tokens)
        cells = [c for c, p in law.items() if p * n >= 5]
        observed = np.array([sum(tuple(t[:2]) == c for t in tokens) for c in cells], dtype=float)
        expected = np.array([law[c] * n for c in cells])
        observed, expected = np.append(observed, n - observed.sum()), np.append(expected, n - expected.sum())
        assert len(cells) >= 3
        assert float(((observed - expected) ** 2 / expected).sum()) < chi2.ppf(0.999, len(cells)), method


def test_cli_tp_2_greedy_output_equals_the_unsharded_run(capsys):
    """`python -m specdec generate --tp 2`: two gloo processes, the target's head split; the same tokens."""
    from specdec.loop.cli import main
    args = ["generate", "--prompt", "def fib(n):", "--prompt", "import os", "--max-new-tokens", "20", "--json",
            "--no-progress"]
    outs = []
    for extra in ([], ["--tp", "2"]):
        assert main(args + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[1]["tp"] == 2 and outs[1]["tokens"] == outs[0]["tokens"]
    assert main(args + ["--tp", "2", "--tree", "chain:3", "--max-new-tokens", "0"]) == 2  # errors reach the caller
    assert "--max-new-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("world", WORLDS)
def test_bad_input_raises_the_same_error_on_every_rank(world):
    per_rank = results(world, "errors")
    expected_arg = {"nan on the last rank": "target_logits_shard", "token out of range": "tokens",
                    "overlapping shards": "vocab_start", "a gap": "vocab_start", "tokens differ": "tokens",
                    "bad top_p on one rank": "top_p", "block on a tree": "method"}
    for i, (name, kind, message) in enumerate(per_rank[0]):
        if name == "after":
            assert all(r[i] == per_rank[0][i] for r in per_rank) and len(message) == 2
            continue
        assert kind == "ValueError" and message.startswith(expected_arg[name] + ":"), (name, kind, message)
        assert all(r[i] == (name, kind, message) for r in per_rank), name
