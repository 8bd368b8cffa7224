"""specdec.RollbackPlan: planned once for a set of caches, run at every step, equal to the functional op and
to the reference on every backend, cache form and layout; bad input rejected at construction or at run
before anything is written; the Triton layer table built once per plan.

Caches hold distinct random values, rows past the tree and the spare blocks of paged caches NaN (a move from
a wrong row shows), and are compared through an integer view (bit-exact, NaN included). Inputs are built on
the CPU; a backend other than the reference runs on copies on tests.helpers.DEVICE with the same strides.
"""
import zlib

import pytest
import torch

import specdec
from specdec import reference
from tests.helpers import (BACKENDS, DEVICE, as_form, from_paged, random_root_paths, random_trees, to_device,
                           to_paged)

PLAN_BACKENDS = ["torch"] + BACKENDS
LAYOUTS = ["contiguous", "paged"]
FORMS = ["layer", "stacked", "list", "list_of_stacks"]
BLOCK_SIZE = 4
STEPS = 3
LAYERS, B, T, H, D, CAP = 3, 5, 6, 2, 4, 32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def make_caches(layout, gen, dtype=torch.float32):
    """K, V stacks (LAYERS, B, CAP, H, D) or paged (LAYERS, num_blocks, BLOCK_SIZE, H, D) with a shuffled block
    table (the same for every layer), and initial lengths leaving room for STEPS trees of T nodes. Rows from
    the first tree's end on are NaN: no correct move of the first step reads them."""
    lens = torch.randint(0, CAP - STEPS * T + 1, (B,), generator=gen, dtype=torch.int32)
    lens[0] = 0
    stacks = []
    for _ in range(2):
        x = torch.randn(LAYERS, B, CAP, H, D, generator=gen).to(dtype)
        for b in range(B):
            x[:, b, int(lens[b]) + T:] = float("nan")
        stacks.append(x)
    if layout == "contiguous":
        return stacks[0], stacks[1], None, lens
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    pages = [[to_paged(x[i], BLOCK_SIZE, torch.Generator().manual_seed(seed)) for i in range(LAYERS)] for x in stacks]
    table = pages[0][0][1]  # the same seed: every layer shares one block table
    return torch.stack([p for p, _ in pages[0]]), torch.stack([p for p, _ in pages[1]]), table, lens


def random_steps(gen):
    """STEPS (accepted_nodes (B, T) int32, num_accepted (B,) int32): root paths of random trees, except request
    0, an overlap-prone run (moves 2->1, 3->2, ...), and request 1, its whole chain (every row in place)."""
    steps = []
    for _ in range(STEPS):
        parents, _ = random_trees(B, T, gen, ragged=False)
        paths, num_accepted = random_root_paths(parents, gen)
        paths[0], num_accepted[0] = torch.tensor([0] + list(range(2, T)) + [-1], dtype=torch.int32), T - 2
        paths[1], num_accepted[1] = torch.arange(T, dtype=torch.int32), T - 1
        steps.append((paths, num_accepted))
    return steps


def for_backend(backend, *tensors):
    """The inputs as `backend` gets them: the reference the CPU tensors themselves, another backend copies on
    DEVICE with the same strides (the very tensors on a CPU run); non-tensors pass through."""
    return tensors if backend == "torch" else tuple(to_device(t) for t in tensors)


def copies(backend, *tensors):
    """Fresh copies of the inputs as `backend` gets them."""
    return for_backend(backend, *(t.clone() if isinstance(t, torch.Tensor) else t for t in tensors))


def args_for(backend, args: dict) -> dict:
    return dict(zip(args, for_backend(backend, *args.values())))


@pytest.mark.parametrize("backend", PLAN_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", FORMS)
def test_plan_run_equals_functional_op_and_reference(backend, layout, form):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((backend, layout, form)).encode()))
    k, v, table, lens0 = make_caches(layout, gen)
    steps = random_steps(gen)
    plan_k, plan_v, plan_lens, plan_table = copies(backend, k, v, lens0, table)
    fn_k, fn_v, fn_lens, fn_table = copies(backend, k, v, lens0, table)
    ref_k, ref_v, ref_lens = k.clone(), v.clone(), lens0.clone()
    plan = specdec.RollbackPlan(as_form(plan_k, form), as_form(plan_v, form), plan_table, backend=backend)
    used = 1 if form == "layer" else LAYERS
    for paths, num_accepted in steps:
        before, before_lens = (ref_k.clone(), ref_v.clone()), ref_lens.clone()
        plan.run(plan_lens, *for_backend(backend, paths, num_accepted))
        specdec.kv_rollback(as_form(fn_k, form), as_form(fn_v, form), fn_lens,
                            *for_backend(backend, paths, num_accepted), block_table=fn_table, backend=backend)
        reference.kv_rollback(list(ref_k[:used]), list(ref_v[:used]), ref_lens, paths, num_accepted, table)
        for got_k, got_v, got_lens in ((plan_k, plan_v, plan_lens), (fn_k, fn_v, fn_lens)):
            assert torch.equal(got_lens.cpu(), ref_lens)
            assert same_bits(got_k.cpu(), ref_k) and same_bits(got_v.cpu(), ref_v)
        # independent of the reference: lengths advance by the path, the prefix and the rows past the new length
        # keep their values, the path's rows are compacted (in the layers given; the others keep every row)
        assert torch.equal(ref_lens, before_lens + num_accepted + 1)
        for old_stack, new_stack in zip(before, (ref_k, ref_v)):
            for layer in range(LAYERS):
                old, new = old_stack[layer], new_stack[layer]
                if table is not None:
                    old, new = from_paged(old, table), from_paged(new, table)
                for b in range(B):
                    L, n = int(before_lens[b]), int(num_accepted[b]) + 1
                    moved = paths[b, :n].long() if layer < used else torch.arange(n)
                    assert same_bits(new[b, :L], old[b, :L]) and same_bits(new[b, L + n:], old[b, L + n:])
                    assert same_bits(new[b, L: L + n], old[b, L + moved])


@pytest.mark.parametrize("backend", PLAN_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ["stacked", "list"])
def test_single_cache_plan_over_steps(backend, layout, form):
    """Single-cache layers (MLA's latent caches, v_cache None): STEPS runs of one plan move each accepted latent row
    once, as the reference does on the same caches (overlap-prone paths included); V's channels move with them."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("single", backend, layout, form)).encode()))
    latent, _, table, lens0 = make_caches(layout, gen)
    plan_latent, plan_lens, plan_table = copies(backend, latent, lens0, table)
    ref_latent, ref_lens = latent.clone(), lens0.clone()
    plan = specdec.RollbackPlan(as_form(plan_latent, form), None, plan_table, backend=backend)
    steps = random_steps(gen)
    for paths, num_accepted in steps:
        plan.run(plan_lens, *for_backend(backend, paths, num_accepted))
        reference.kv_rollback(list(ref_latent), [], ref_lens, paths, num_accepted, table)
        assert torch.equal(plan_lens.cpu(), ref_lens) and same_bits(plan_latent.cpu(), ref_latent)
    assert torch.equal(plan_lens.cpu(), lens0 + sum(num_accepted + 1 for _, num_accepted in steps))
    assert not same_bits(ref_latent, latent)  # (the steps moved rows)


@pytest.mark.parametrize("backend", PLAN_BACKENDS)
def test_plan_reads_the_block_table_at_every_run(backend):
    """An engine rewrites its block table in place between steps (blocks allocated, swapped): the plan follows."""
    gen = torch.Generator().manual_seed(5)
    k, v, table, lens = make_caches("paged", gen)
    (paths, num_accepted), = random_steps(gen)[:1]
    pk, pv, plens, ptable = copies(backend, k, v, lens, table)
    plan = specdec.RollbackPlan(pk, pv, ptable, backend=backend)
    new_table = table.flip(1)  # every request's blocks in the opposite order
    ptable.copy_(to_device(new_table))
    plan.run(plens, *for_backend(backend, paths, num_accepted))
    ref_k, ref_v, ref_lens = k.clone(), v.clone(), lens.clone()
    reference.kv_rollback([ref_k], [ref_v], ref_lens, paths, num_accepted, new_table)
    assert same_bits(pk.cpu(), ref_k) and same_bits(pv.cpu(), ref_v) and torch.equal(plens.cpu(), ref_lens)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton backend")
def test_triton_plan_builds_its_layer_table_once(monkeypatch):
    from specdec.kernels import kv_cache
    builds = []
    original = kv_cache.layer_tables
    monkeypatch.setattr(kv_cache, "layer_tables", lambda *a: builds.append(1) or original(*a))
    gen = torch.Generator().manual_seed(6)
    k, v, table, lens0 = make_caches("paged", gen)
    k, v, lens, table = to_device(k, v, lens0.clone(), table)
    plan = specdec.RollbackPlan(list(k.unbind(0)), list(v.unbind(0)), table, backend="triton")
    assert len(builds) == 1
    steps = random_steps(gen)
    for paths, num_accepted in steps:
        plan.run(lens, *to_device(paths, num_accepted))
    assert len(builds) == 1  # runs reuse the plan's table
    specdec.kv_rollback(k, v, to_device(lens0.clone()), *to_device(*steps[0]), block_table=table, backend="triton")
    assert len(builds) == 2  # the functional op is a one-step plan


# ----------------------------------------------------------------------------------------------
# bad input: at construction (cache metadata) and at run (per-step arguments), nothing written
# ----------------------------------------------------------------------------------------------
def small_caches():
    k, v = torch.randn(2, B, 8, H, D), torch.randn(2, B, 8, H, D)
    return dict(k_cache=k, v_cache=v, block_table=None)


def paged_caches():
    k, v = torch.randn(2, 12, BLOCK_SIZE, H, D), torch.randn(2, 12, BLOCK_SIZE, H, D)
    return dict(k_cache=k, v_cache=v, block_table=torch.arange(10, dtype=torch.int32).view(B, 2))


CONSTRUCTION_CASES = [
    ("k_cache", TypeError, lambda a: a.update(k_cache=[])),
    ("k_cache", TypeError, lambda a: a.update(k_cache=[a["k_cache"][0], "layer"])),
    ("k_cache", TypeError, lambda a: a.update(k_cache=a["k_cache"].int(), v_cache=a["v_cache"].int())),
    ("k_cache", ValueError, lambda a: a.update(k_cache=a["k_cache"][0, 0], v_cache=a["v_cache"][0, 0])),
    ("v_cache", ValueError, lambda a: a.update(v_cache=list(a["v_cache"]), k_cache=[a["k_cache"][0]])),
    ("v_cache", ValueError, lambda a: a.update(v_cache=a["v_cache"][:, :, :4])),
    ("v_cache", TypeError, lambda a: a.update(v_cache=a["v_cache"].half())),
    ("v_cache", TypeError, lambda a: a.update(v_cache="layer")),
    ("v_cache", ValueError, lambda a: a.update(v_cache=a["k_cache"][..., :2])),  # MLA's V view: rows moved twice
    (r"k_cache\[1\]", ValueError, lambda a: a.update(k_cache=[a["k_cache"][0], a["k_cache"][1, :, :4]],
                                                     v_cache=[a["v_cache"][0], a["v_cache"][1, :, :4]])),
    (r"k_cache\[1\]", ValueError, lambda a: a.update(k_cache=[a["k_cache"][0], a["k_cache"][1].half()],
                                                     v_cache=[a["v_cache"][0], a["v_cache"][1].half()])),
    ("block_table", TypeError, lambda a: a.update(block_table=torch.zeros(B, 2, dtype=torch.int64))),
    ("block_table", ValueError, lambda a: a.update(block_table=torch.zeros(B * 2, dtype=torch.int32))),
    ("block_table", TypeError, lambda a: a.update(block_table=[[0, 1]])),
    ("backend", ValueError, lambda a: a.update(backend="cuda")),
]


@pytest.mark.parametrize("name,exc,mutate", CONSTRUCTION_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CONSTRUCTION_CASES)])
def test_plan_rejects_bad_caches_at_construction(name, exc, mutate):
    args = small_caches()
    mutate(args)
    with pytest.raises(exc, match=f"^{name}"):
        specdec.RollbackPlan(args.pop("k_cache"), args.pop("v_cache"), args.pop("block_table"), **args)


def run_args():
    return dict(cache_lens=torch.tensor([0, 1, 2, 3, 0], dtype=torch.int32),
                accepted_nodes=torch.tensor([[0, 2, 3]] * B, dtype=torch.int32),
                num_accepted=torch.full((B,), 2, dtype=torch.int32))


def with_entry(x, index, value):
    x = x.clone()
    x[index] = value
    return x


RUN_CASES = [
    ("cache_lens", TypeError, lambda a: a.update(cache_lens=a["cache_lens"].long())),
    ("cache_lens", ValueError, lambda a: a.update(cache_lens=a["cache_lens"].view(1, B))),
    ("cache_lens", TypeError, lambda a: a.update(cache_lens=[0] * B)),
    ("k_cache", ValueError, lambda a: a.update(cache_lens=a["cache_lens"][:4], accepted_nodes=a["accepted_nodes"][:4],
                                               num_accepted=a["num_accepted"][:4])),  # B rows, 4 requests
    ("accepted_nodes", TypeError, lambda a: a.update(accepted_nodes=a["accepted_nodes"].float())),
    ("accepted_nodes", ValueError, lambda a: a.update(accepted_nodes=a["accepted_nodes"][:3])),
    ("accepted_nodes", ValueError, lambda a: a.update(accepted_nodes=a["accepted_nodes"][0])),
    ("num_accepted", ValueError, lambda a: a.update(num_accepted=a["num_accepted"][:3])),
    ("num_accepted", TypeError, lambda a: a.update(num_accepted=a["num_accepted"].double())),
    # value checks
    ("accepted_nodes", ValueError, lambda a: a.update(accepted_nodes=with_entry(a["accepted_nodes"], (2, 0), 1))),
    ("accepted_nodes", ValueError, lambda a: a.update(accepted_nodes=with_entry(a["accepted_nodes"], (4, 2), 2))),
    ("num_accepted", ValueError, lambda a: a.update(num_accepted=with_entry(a["num_accepted"], 3, 3))),
    ("num_accepted", ValueError, lambda a: a.update(num_accepted=with_entry(a["num_accepted"], 0, -1))),
    ("cache_lens", ValueError, lambda a: a.update(cache_lens=with_entry(a["cache_lens"], 1, 5))),  # 5 + 3 + 1 > 8
    ("cache_lens", ValueError, lambda a: a.update(cache_lens=with_entry(a["cache_lens"], 1, -1))),
]


@pytest.mark.parametrize("backend", PLAN_BACKENDS)
@pytest.mark.parametrize("name,exc,mutate", RUN_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RUN_CASES)])
def test_plan_run_rejects_bad_input_before_writing(name, exc, mutate, backend):
    caches = small_caches()
    k, v = copies(backend, caches["k_cache"], caches["v_cache"])
    plan = specdec.RollbackPlan(k, v, backend=backend)
    args = run_args()
    mutate(args)
    args = args_for(backend, args)
    lens_before = args["cache_lens"].clone() if isinstance(args["cache_lens"], torch.Tensor) else None
    with pytest.raises(exc, match=f"^{name}"):
        plan.run(**args)
    assert same_bits(k.cpu(), caches["k_cache"]) and same_bits(v.cpu(), caches["v_cache"])
    if lens_before is not None:
        assert torch.equal(args["cache_lens"], lens_before)
    plan.run(**args_for(backend, run_args()))  # still usable


@pytest.mark.parametrize("backend", PLAN_BACKENDS)
def test_plan_run_checks_the_blocks_it_touches(backend):
    caches = paged_caches()
    k, v, table = copies(backend, caches["k_cache"], caches["v_cache"], caches["block_table"])
    plan = specdec.RollbackPlan(k, v, table, backend=backend)
    table.copy_(to_device(with_entry(caches["block_table"], (3, 1), 12)))  # block 12 of 12 does not exist
    args = args_for(backend, run_args())  # request 3 touches rows 3 .. 6: its second block
    with pytest.raises(ValueError, match=r"^block_table: block ids in use must be in \[0, 12\)"):
        plan.run(**args)
    assert same_bits(k.cpu(), caches["k_cache"]) and same_bits(v.cpu(), caches["v_cache"])
    assert torch.equal(args["cache_lens"].cpu(), run_args()["cache_lens"])


@pytest.mark.parametrize("backend", PLAN_BACKENDS)
def test_plan_run_value_checks_follow_the_switch_at_run_time(backend):
    """The switch is read at each run, not frozen at construction. (The C++ op checks its CPU inputs itself,
    always: it raises either way.)"""
    caches = small_caches()
    k, v = copies(backend, caches["k_cache"], caches["v_cache"])
    plan = specdec.RollbackPlan(k, v, backend=backend)
    args = run_args()
    args["accepted_nodes"] = with_entry(args["accepted_nodes"], (0, 2), 2)  # not increasing, rows in range
    args = args_for(backend, args)
    with specdec.value_checks(False):
        if backend == "cpp":
            with pytest.raises(ValueError, match="^accepted_nodes"):
                plan.run(**args)
        else:
            plan.run(**args)
    with pytest.raises(ValueError, match="^accepted_nodes"):
        plan.run(**args)


def test_plan_run_under_torch_compile_matches_eager():
    gen = torch.Generator().manual_seed(7)
    k, v, table, lens = make_caches("paged", gen)
    (paths, num_accepted), = random_steps(gen)[:1]
    eager_k, eager_v, eager_lens = k.clone(), v.clone(), lens.clone()
    specdec.RollbackPlan(eager_k, eager_v, table).run(eager_lens, paths, num_accepted)
    plan = specdec.RollbackPlan(k, v, table)
    torch._dynamo.reset()
    torch.compile(plan.run, fullgraph=True)(lens, paths, num_accepted)
    assert same_bits(k, eager_k) and same_bits(v, eager_v) and torch.equal(lens, eager_lens)


def test_cuda_graph_replays_a_plan_built_outside_the_capture():
    """The documented path: plan (and its layer table) built eagerly, run captured once and replayed; the
    capture keeps no host table alive."""
    if DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specdec.kernels import kv_cache
    gen = torch.Generator().manual_seed(8)
    k, v, table, lens0 = make_caches("paged", gen)
    (paths, num_accepted), = random_steps(gen)[:1]
    ref_k, ref_v, ref_lens = k.clone(), v.clone(), lens0.clone()
    reference.kv_rollback([ref_k], [ref_v], ref_lens, paths, num_accepted, table)
    gk, gv, glens, gtable, gpaths, gnum = (t.cuda() for t in (k, v, lens0, table, paths, num_accepted))
    plan = specdec.RollbackPlan(list(gk.unbind(0)), list(gv.unbind(0)), gtable)
    plan.run(glens.clone(), gpaths, gnum)  # warm-up: compiles the kernel outside the capture
    torch.cuda.synchronize()
    kept = len(kv_cache._captured_sources)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(glens, gpaths, gnum)
    assert len(kv_cache._captured_sources) == kept
    for _ in range(2):  # caches and lengths restored before each replay
        gk.copy_(k)
        gv.copy_(v)
        glens.copy_(lens0)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits(gk.cpu(), ref_k) and same_bits(gv.cpu(), ref_v) and torch.equal(glens.cpu(), ref_lens)
