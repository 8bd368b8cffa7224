"""Bad input: a clear ValueError/TypeError naming the argument, raised before anything is written."""
import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch

import specdec
from specdec._validation import value_checks_enabled

B, T, Hq, Hkv, D, CAP, V = 2, 4, 4, 2, 8, 16, 10


def attention_args():
    parents = torch.tensor([[-1, 0, 0, 1]] * B)
    return dict(q=torch.randn(B, T, Hq, D), k_cache=torch.randn(B, CAP, Hkv, D), v_cache=torch.randn(B, CAP, Hkv, D),
                cache_lens=torch.tensor([3, 5], dtype=torch.int32), tree_mask=specdec.build_tree(parents).mask)


def paged_attention_args():
    args = attention_args()
    args["k_cache"], args["v_cache"] = torch.randn(6, 8, Hkv, D), torch.randn(6, 8, Hkv, D)
    args["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return args


# The reference checks in Python; the default backend on CPU is the C++ op when built, which runs the
# value checks itself: both must raise the same errors.
CHECKED_BY = ["torch", None]


def call_attention(args, backend="torch"):
    args = dict(args)
    return specdec.tree_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_lens"),
                                  args.pop("tree_mask"), backend=backend, **args)


def no_self_bit():
    args = attention_args()
    args["tree_mask"] = args["tree_mask"].clone()
    args["tree_mask"][1, 2, 0] = 0b001
    return args


ATTENTION_CASES = [
    ("q", TypeError, lambda a: a.update(q=a["q"].to(torch.int32))),
    ("q", ValueError, lambda a: a.update(q=a["q"][0])),
    ("q", ValueError, lambda a: a.update(q=torch.randn(B, T, 3, D))),  # 3 heads over 2 KV heads
    ("k_cache", TypeError, lambda a: a.update(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half())),
    ("v_cache", TypeError, lambda a: a.update(v_cache=a["v_cache"].half())),
    ("k_cache", ValueError, lambda a: a.update(k_cache=torch.randn(B, CAP, Hkv, D + 1), v_cache=torch.randn(B, CAP, Hkv, D + 1))),
    ("v_cache", ValueError, lambda a: a.update(v_cache=a["v_cache"][:, :8])),
    ("cache_lens", TypeError, lambda a: a.update(cache_lens=a["cache_lens"].long())),
    ("cache_lens", ValueError, lambda a: a.update(cache_lens=torch.tensor([-1, 2], dtype=torch.int32))),
    ("cache_lens", ValueError, lambda a: a.update(cache_lens=torch.tensor([CAP - T + 1, 0], dtype=torch.int32))),
    ("tree_mask", ValueError, lambda a: a.update(tree_mask=a["tree_mask"][:, :3])),
    ("tree_mask", TypeError, lambda a: a.update(tree_mask=a["tree_mask"].long())),
    ("num_nodes", ValueError, lambda a: a.update(num_nodes=torch.tensor([0, 4], dtype=torch.int32))),
    ("num_nodes", ValueError, lambda a: a.update(num_nodes=torch.tensor([5, 4], dtype=torch.int32))),
    ("scale", TypeError, lambda a: a.update(scale="big")),
    ("scale", ValueError, lambda a: a.update(scale=float("nan"))),
    ("scale", ValueError, lambda a: a.update(scale=float("inf"))),
    ("window_left", ValueError, lambda a: a.update(window_left=T - 2)),  # a node could not see its parent
    ("window_left", ValueError, lambda a: a.update(window_left=-2)),
    ("window_left", TypeError, lambda a: a.update(window_left=4.0)),
    ("logits_soft_cap", ValueError, lambda a: a.update(logits_soft_cap=-1.0)),
    ("logits_soft_cap", ValueError, lambda a: a.update(logits_soft_cap=float("inf"))),
    ("logits_soft_cap", TypeError, lambda a: a.update(logits_soft_cap=None)),
    ("q", TypeError, lambda a: a.update(q=a["q"].to(torch.float8_e4m3fn))),  # float8 is for caches only
    ("k_scale", TypeError, lambda a: a.update(k_scale="big")),
    ("k_scale", ValueError, lambda a: a.update(k_scale=2.0)),  # scales come with float8 caches only
    ("v_scale", ValueError, lambda a: a.update(v_scale=0.5)),
    ("k_scale", ValueError, lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e5m2),
                                               v_cache=a["v_cache"].to(torch.float8_e5m2), k_scale=0.0)),
    ("v_scale", ValueError, lambda a: a.update(k_cache=a["k_cache"].to(torch.float8_e4m3fn),
                                               v_cache=a["v_cache"].to(torch.float8_e4m3fn), v_scale=float("nan"))),
]


@pytest.mark.parametrize("backend", CHECKED_BY)
@pytest.mark.parametrize("name,exc,mutate", ATTENTION_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ATTENTION_CASES)])
def test_tree_attention_bad_input(name, exc, mutate, backend):
    args = attention_args()
    mutate(args)
    with pytest.raises(exc, match=f"^{name}"):
        call_attention(args, backend)


@pytest.mark.parametrize("backend", CHECKED_BY)
def test_tree_attention_mask_checks(backend):
    with pytest.raises(ValueError, match="^tree_mask: every real node must have its own bit"):
        call_attention(no_self_bit(), backend)
    args = attention_args()
    args["tree_mask"] = args["tree_mask"].clone()
    args["tree_mask"][0, 1, 0] = 0b111  # node 1 sees node 2
    with pytest.raises(ValueError, match="^tree_mask: node i may only see"):
        call_attention(args, backend)


@pytest.mark.parametrize("backend", CHECKED_BY)
def test_paged_attention_bad_block_table(backend):
    args = paged_attention_args()
    call_attention(args, backend)  # valid
    args["block_table"] = torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)  # block 6 of 6 does not exist
    with pytest.raises(ValueError, match=r"^block_table: block ids in use must be in \[0, 6\)"):
        call_attention(args, backend)
    args["block_table"] = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="^block_table: expected 2 rows"):
        call_attention(args, backend)
    args["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    with pytest.raises(TypeError, match="^block_table"):
        call_attention(args, backend)


def test_value_checks_switch():
    args = no_self_bit()
    specdec.set_value_checks(False)
    try:
        call_attention(args)  # the prefix keeps the softmax defined: runs without the check
    finally:
        specdec.set_value_checks(True)
    with pytest.raises(ValueError):
        call_attention(args)


def test_value_checks_block_restores_the_previous_setting():
    args = no_self_bit()
    with specdec.value_checks(False):
        with specdec.value_checks(True):
            with pytest.raises(ValueError):
                call_attention(args)
        call_attention(args)  # off again after the inner block
    with pytest.raises(ValueError):
        call_attention(args)


def test_value_checks_block_undoes_a_switch_inside_it():
    args = no_self_bit()
    with specdec.value_checks(True):
        specdec.set_value_checks(False)
        call_attention(args)  # off for the rest of the block
    with pytest.raises(ValueError):
        call_attention(args)  # the setting from before the block
    with pytest.raises(RuntimeError):
        with specdec.value_checks(False):
            raise RuntimeError
    assert value_checks_enabled()


def test_value_checks_switch_is_per_thread():
    """Turning the checks off in one thread leaves them on in another, running at the same time; a new thread
    starts from the default (SPECDEC_VALUE_CHECKS, unset here: on), whatever the thread starting it set."""
    args = no_self_bit()
    switched_off, main_checked = threading.Event(), threading.Event()
    seen = {}

    def worker():
        seen["at_start"] = value_checks_enabled()
        specdec.set_value_checks(False)
        switched_off.set()
        main_checked.wait(timeout=60)
        try:
            call_attention(args)
            seen["call"] = "ran"
        except ValueError:
            seen["call"] = "raised"

    with specdec.value_checks(False):
        thread = threading.Thread(target=worker)
        thread.start()
    assert switched_off.wait(timeout=60)
    with pytest.raises(ValueError):
        call_attention(args)  # this thread's checks: on, the worker's switch notwithstanding
    main_checked.set()
    thread.join(timeout=60)
    assert seen == {"at_start": True, "call": "ran"}


def test_value_checks_switch_is_per_asyncio_task():
    async def both():
        async def switches_off():
            specdec.set_value_checks(False)
            await asyncio.sleep(0)  # the other task runs in between
            return value_checks_enabled()

        async def leaves_alone():
            await asyncio.sleep(0)
            return value_checks_enabled()
        return await asyncio.gather(switches_off(), leaves_alone())
    assert asyncio.run(both()) == [False, True]
    assert value_checks_enabled()


def test_value_checks_default_comes_from_the_environment():
    code = ("import threading, specdec._validation as v; seen = []; "
            "t = threading.Thread(target=lambda: seen.append(v.value_checks_enabled())); t.start(); t.join(); "
            "print(v.value_checks_enabled(), seen[0])")
    for setting, expected in (("0", ["False", "False"]), ("1", ["True", "True"])):
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPECDEC_VALUE_CHECKS": setting},
                              capture_output=True, text=True, timeout=300)
        assert done.stdout.split()[-2:] == expected, done.stderr[-2000:]


def test_bad_backend_name():
    with pytest.raises(ValueError, match="^backend"):
        specdec.build_tree(torch.tensor([[-1, 0]]), backend="cuda")


# ----------------------------------------------------------------------------------------------
# build_tree / accept
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parents,name", [
    ([[0, 0, 1]], "parents"),      # root parent must be -1
    ([[-1, 1, 0]], "parents"),     # parent not before the node
    ([[-1, 0, 3]], "parents"),
    ([[-1, 0, -1]], "parents"),    # a real non-root node without parent
])
def test_build_tree_bad_parents(parents, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        specdec.build_tree(torch.tensor(parents))


def test_build_tree_types():
    with pytest.raises(TypeError, match="^parents"):
        specdec.build_tree(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(TypeError, match="^parents"):
        specdec.build_tree([[-1, 0]])
    with pytest.raises(ValueError, match="^num_nodes"):
        specdec.build_tree(torch.tensor([[-1, 0]]), torch.tensor([3], dtype=torch.int32))


def accept_args():
    return dict(target_logits=torch.randn(B, T, V), tokens=torch.randint(0, V, (B, T)),
                parents=torch.tensor([[-1, 0, 1, 2]] * B))


ACCEPT_CASES = [
    ("target_logits", TypeError, lambda a: a.update(target_logits=a["target_logits"].long())),
    ("target_logits", ValueError, lambda a: a["target_logits"].__setitem__((1, 2, 3), float("nan"))),
    ("target_logits", ValueError, lambda a: a["target_logits"].__setitem__((0, 0, 0), float("inf"))),
    ("target_logits", ValueError, lambda a: a["target_logits"][1, 3].fill_(float("-inf"))),
    ("tokens", ValueError, lambda a: a["tokens"].__setitem__((0, 2), V)),
    ("tokens", ValueError, lambda a: a["tokens"].__setitem__((1, 1), -1)),
    ("tokens", ValueError, lambda a: a.update(tokens=a["tokens"][:, :2])),
    ("parents", ValueError, lambda a: a.update(parents=torch.tensor([[-1, 0, 2, 2]] * B))),
    ("draft_logits", ValueError, lambda a: a.update(draft_logits=torch.randn(B, T, V + 1))),
    ("draft_logits", ValueError, lambda a: a.update(draft_logits=torch.full((B, T, V), float("nan")))),
    ("temperature", ValueError, lambda a: a.update(temperature=-0.5)),
    ("temperature", ValueError, lambda a: a.update(temperature=torch.tensor([1.0, -1.0]))),
    ("temperature", ValueError, lambda a: a.update(temperature=torch.tensor([1.0]))),
    ("seeds", TypeError, lambda a: a.update(seeds=torch.tensor([1.0, 2.0]))),
    ("seeds", ValueError, lambda a: a.update(seeds=torch.tensor([1, 2, 3]))),
    ("num_nodes", ValueError, lambda a: a.update(num_nodes=torch.tensor([0, 1], dtype=torch.int32))),
    ("offset", TypeError, lambda a: a.update(offset=-1)),
    ("offset", TypeError, lambda a: a.update(offset=1.0)),
    ("offset", ValueError, lambda a: a.update(offset=2**60)),
    ("offset", TypeError, lambda a: a.update(offset=torch.tensor([0.0, 1.0]))),
    ("offset", ValueError, lambda a: a.update(offset=torch.tensor([1, 2, 3]))),
    ("offset", ValueError, lambda a: a.update(offset=torch.tensor([5, -1]))),
]


W = (V + 31) // 32
ACCEPT_CASES += [  # the filters
    ("top_k", ValueError, lambda a: a.update(top_k=-1)),
    ("top_k", ValueError, lambda a: a.update(top_k=torch.tensor([3, -2], dtype=torch.int32))),
    ("top_k", TypeError, lambda a: a.update(top_k=2.0)),
    ("top_k", TypeError, lambda a: a.update(top_k=torch.tensor([1.0, 2.0]))),
    ("top_k", ValueError, lambda a: a.update(top_k=torch.tensor([1, 2, 3]))),
    ("top_p", ValueError, lambda a: a.update(top_p=0.0)),
    ("top_p", ValueError, lambda a: a.update(top_p=-0.5)),
    ("top_p", ValueError, lambda a: a.update(top_p=1.5)),
    ("top_p", ValueError, lambda a: a.update(top_p=float("nan"))),
    ("top_p", ValueError, lambda a: a.update(top_p=torch.tensor([0.5, 0.0]))),
    ("top_p", ValueError, lambda a: a.update(top_p=torch.tensor([1.01, 0.5]))),
    ("top_p", ValueError, lambda a: a.update(top_p=torch.tensor([0.5, float("nan")]))),
    ("top_p", TypeError, lambda a: a.update(top_p=torch.tensor([1, 1]))),
    ("top_p", TypeError, lambda a: a.update(top_p="0.9")),
    ("min_p", ValueError, lambda a: a.update(min_p=1.0)),
    ("min_p", ValueError, lambda a: a.update(min_p=-0.1)),
    ("min_p", ValueError, lambda a: a.update(min_p=torch.tensor([0.2, 1.0]))),
    ("min_p", ValueError, lambda a: a.update(min_p=torch.tensor([-0.2, 0.5]))),
    ("min_p", ValueError, lambda a: a.update(min_p=torch.tensor([0.5]))),
    ("token_bitmask", ValueError, lambda a: a.update(token_bitmask=torch.full((B, T, W), -1, dtype=torch.int64))),
    ("token_bitmask", ValueError, lambda a: a.update(token_bitmask=torch.full((B, T, W + 1), -1, dtype=torch.int32))),
    ("token_bitmask", ValueError, lambda a: a.update(token_bitmask=torch.full((B, T), -1, dtype=torch.int32))),
    ("token_bitmask", ValueError, lambda a: a.update(token_bitmask=torch.full((B, T - 1, W), -1, dtype=torch.int32))),
    ("token_bitmask", TypeError, lambda a: a.update(token_bitmask=[[-1]])),
    # a real row allowing nothing in [0, V) (bits past V do not count)
    ("token_bitmask", ValueError, lambda a: a.update(token_bitmask=torch.tensor([[[-1]] * T, [[-1], [-1], [~(2**V - 1)], [-1]]],
                                                                                dtype=torch.int32))),
    # allowed tokens all -inf
    ("target_logits", ValueError, lambda a: (a["target_logits"].__setitem__((0, 1, 0), float("-inf")),
                                             a.update(token_bitmask=torch.ones(B, T, W, dtype=torch.int32)))),
    ("draft_logits", ValueError, lambda a: a.update(draft_logits=torch.randn(B, T, V).index_fill_(2, torch.tensor([3]), float("-inf")),
                                                    token_bitmask=torch.full((B, T, W), 8, dtype=torch.int32))),
]


@pytest.mark.parametrize("backend", CHECKED_BY)
@pytest.mark.parametrize("name,exc,mutate", ACCEPT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ACCEPT_CASES)])
def test_accept_bad_input(name, exc, mutate, backend):
    args = accept_args()
    mutate(args)
    with pytest.raises(exc, match=f"^{name}"):
        specdec.accept(args.pop("target_logits"), args.pop("tokens"), args.pop("parents"), backend=backend, **args)


def test_accept_filter_messages():
    args = accept_args()
    with pytest.raises(ValueError, match=r"^top_p: must be in \(0, 1\] \(1: off\), got 0"):
        specdec.accept(**args, top_p=0, backend="torch")
    with pytest.raises(ValueError, match=r"^min_p: must be in \[0, 1\) \(0: off\)$"):
        specdec.accept(**args, min_p=torch.tensor([0.5, 1.0]), backend="torch")
    with pytest.raises(ValueError, match=r"^token_bitmask: dtype int64 not supported \(expected int32\)"):
        specdec.accept(**args, token_bitmask=torch.zeros(B, T, 1, dtype=torch.int64), backend="torch")
    with pytest.raises(ValueError, match=r"^token_bitmask: expected shape \(2, 4, 1\), got \(2, 4, 2\)"):
        specdec.accept(**args, token_bitmask=torch.zeros(B, T, 2, dtype=torch.int32), backend="torch")


def test_accept_filter_values_not_checked_with_checks_off():
    """Value checks off: tensors of bad filter values run (no host sync), ids stay in range."""
    args = accept_args()
    with specdec.value_checks(False):
        res = specdec.accept(**args, temperature=1.0, top_k=torch.tensor([-3, 2]), top_p=torch.tensor([0.0, 2.0]),
                             min_p=torch.tensor([1.5, -1.0]), seeds=torch.tensor([1, 2]), backend="torch")
    assert ((res.next_tokens >= 0) & (res.next_tokens < V)).all()


def test_accept_padding_tokens_and_rows_are_not_checked():
    args = accept_args()
    args["tokens"][0, 3] = 10**6  # padding node of request 0
    args["target_logits"][0, 3] = float("-inf")
    specdec.accept(args["target_logits"], args["tokens"], args["parents"], num_nodes=torch.tensor([3, 4]),
                   backend="torch")
    nothing_at_padding = torch.full((B, T, 1), -1, dtype=torch.int32)
    nothing_at_padding[0, 3] = 0  # padding node of request 0: its row is not checked
    for backend in CHECKED_BY:
        specdec.accept(args["target_logits"], args["tokens"], args["parents"], num_nodes=torch.tensor([3, 4]),
                       token_bitmask=nothing_at_padding, backend=backend)


# ----------------------------------------------------------------------------------------------
# KV ops: nothing written on error
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CHECKED_BY)
def test_kv_append_rejects_before_writing(backend):
    k, v = torch.randn(B, CAP, Hkv, D), torch.randn(B, CAP, Hkv, D)
    k0, v0 = k.clone(), v.clone()
    lens = torch.tensor([0, CAP - 2], dtype=torch.int32)  # request 1 has room for 2 rows, not 3
    with pytest.raises(ValueError, match="^cache_lens: no room"):
        specdec.kv_append(k, v, torch.randn(B, 3, Hkv, D), torch.randn(B, 3, Hkv, D), lens, backend=backend)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(TypeError, match="^k_new"):
        specdec.kv_append(k, v, torch.randn(B, 3, Hkv, D).half(), torch.randn(B, 3, Hkv, D).half(),
                          torch.zeros(B, dtype=torch.int32), backend="torch")
    with pytest.raises(ValueError, match="^k_new"):
        specdec.kv_append(k, v, torch.randn(B, 3, Hkv + 1, D), torch.randn(B, 3, Hkv + 1, D),
                          torch.zeros(B, dtype=torch.int32), backend="torch")
    with pytest.raises(ValueError, match="^v_new"):
        specdec.kv_append(k, v, torch.randn(B, 3, Hkv, D), torch.randn(B, 2, Hkv, D),
                          torch.zeros(B, dtype=torch.int32), backend="torch")
    with pytest.raises(ValueError, match="^k_scale: only float8 caches are scaled; this cache is float32"):
        specdec.kv_append(k, v, torch.randn(B, 3, Hkv, D), torch.randn(B, 3, Hkv, D),
                          torch.zeros(B, dtype=torch.int32), k_scale=0.5, backend=backend)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    k8, v8 = torch.zeros(B, CAP, Hkv, D, dtype=torch.float8_e4m3fn), torch.zeros(B, CAP, Hkv, D, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^v_scale: must be a finite number > 0, got -inf"):
        specdec.kv_append(k8, v8, torch.randn(B, 3, Hkv, D), torch.randn(B, 3, Hkv, D),
                          torch.zeros(B, dtype=torch.int32), v_scale=-float("inf"), backend=backend)
    with pytest.raises(TypeError, match="^v_new: dtype float8_e4m3fn not supported"):
        specdec.kv_append(k8, v8, torch.randn(B, 3, Hkv, D), torch.zeros(B, 3, Hkv, D, dtype=torch.float8_e4m3fn),
                          torch.zeros(B, dtype=torch.int32), backend=backend)
    assert not k8.float().any() and not v8.float().any()


ROLLBACK_CASES = [
    ("accepted_nodes", "every path must start at node 0", [[1, 2, -1], [0, -1, -1]], [1, 0]),
    ("accepted_nodes", "strictly increasing", [[0, 2, 2], [0, -1, -1]], [2, 0]),
    ("accepted_nodes", "strictly increasing", [[0, 3, 1], [0, -1, -1]], [2, 0]),
    ("num_accepted", r"must be in \[0, 2\]", [[0, 1, 2], [0, -1, -1]], [3, 0]),
    ("num_accepted", r"must be in \[0, 2\]", [[0, 1, 2], [0, -1, -1]], [-1, 0]),
    ("cache_lens", "no room", [[0, 1, 2], [0, 1, 9]], [2, 2]),  # row L + 9 beyond the capacity
]


@pytest.mark.parametrize("backend", CHECKED_BY)
@pytest.mark.parametrize("name,message,path,num", ROLLBACK_CASES)
def test_kv_rollback_rejects_before_writing(name, message, path, num, backend):
    layers = torch.randn(3, B, 8, Hkv, D), torch.randn(3, B, 8, Hkv, D)
    before = [t.clone() for t in layers]
    lens = torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"^{name}: .*{message}"):
        specdec.kv_rollback(*layers, lens, torch.tensor(path, dtype=torch.int32), torch.tensor(num, dtype=torch.int32),
                            backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(layers, before))
    assert lens.tolist() == [1, 0]


def test_kv_rollback_layer_lists_must_agree():
    lens, path, num = torch.zeros(B, dtype=torch.int32), torch.zeros(B, 1, dtype=torch.int32), torch.zeros(B, dtype=torch.int32)
    ks = [torch.randn(B, 8, Hkv, D) for _ in range(2)]
    with pytest.raises(ValueError, match="^v_cache: 1 layer tensors but k_cache has 2"):
        specdec.kv_rollback(ks, ks[:1], lens, path, num, backend="torch")
    with pytest.raises(ValueError, match=r"^k_cache\[1\]: every layer must share"):
        specdec.kv_rollback([ks[0], ks[1].half()], [ks[0], ks[1].half()], lens, path, num, backend="torch")
    with pytest.raises(TypeError, match="^k_cache"):
        specdec.kv_rollback([], [], lens, path, num, backend="torch")
    vs = [torch.randn(B, 8, Hkv, D) for _ in range(2)]
    with pytest.raises(TypeError, match="^cache_lens"):
        specdec.kv_rollback(ks, vs, lens.long(), path, num, backend="torch")


@pytest.mark.parametrize("backend", CHECKED_BY)
def test_kv_rollback_rejects_a_tensor_listed_twice(backend):
    """K and V one tensor (an MLA-style latent cache), or a layer listed twice: its rows would be moved twice (a row
    moved onto a later one's source moved again; on a GPU two programs move the same rows at once)."""
    lens, path = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([[0, 2], [0, 1]], dtype=torch.int32)
    num = torch.tensor([1, 1], dtype=torch.int32)
    stack = torch.randn(3, B, 8, Hkv, D)
    before = stack.clone()
    for k, v, message in ((stack, stack, r"^v_cache: shares memory with k_cache;"),
                          (list(stack), [stack[0], stack[1], stack[0]], r"^v_cache\[0\]: shares memory with k_cache\[0\]"),
                          (list(stack[:2]) + [stack[0]], list(torch.randn(3, B, 8, Hkv, D)),
                           r"^k_cache\[2\]: shares memory with k_cache\[0\]")):
        with pytest.raises(ValueError, match=message):
            specdec.kv_rollback(k, v, lens, path, num, backend=backend)
    assert torch.equal(stack, before) and lens.tolist() == [1, 0]
    specdec.kv_rollback(stack[:, :, :4], stack[:, :, 4:], lens, path, num, backend=backend)  # (other rows: fine)


# ----------------------------------------------------------------------------------------------
# hostile input: int64 ids past int32, positions past int32, shared memory, empty dimensions, extreme floats
# ----------------------------------------------------------------------------------------------
INT64_CASES = [  # (argument, op call on valid arguments with that argument replaced by an int64 tensor past int32)
    ("tokens", lambda be: specdec.accept(**dict(accept_args(), tokens=torch.tensor([[0, 2**32 + 5, 1, 2]] * B)),
                                         backend=be)),
    ("parents", lambda be: specdec.accept(**dict(accept_args(), parents=torch.tensor([[-1, 2**32, 1, 2]] * B)),
                                          backend=be)),
    ("num_nodes", lambda be: specdec.accept(**accept_args(), num_nodes=torch.tensor([2**32 + 2, 2]), backend=be)),
    ("num_nodes", lambda be: specdec.build_tree(torch.tensor([[-1, 0, 1]]), torch.tensor([2**32 + 2]), backend=be)),
    ("parents", lambda be: specdec.build_tree(torch.tensor([[-1, 0, 2**32 + 1]]), backend=be)),
    ("num_nodes", lambda be: call_attention(dict(attention_args(), num_nodes=torch.tensor([2**32 + 2, 4])), be)),
]


@pytest.mark.parametrize("backend", ["torch", "triton", None])
def test_int64_padding_past_int32_is_not_read(backend):
    """Only the real nodes' ids must fit in int32: padding is never read (an engine's buffers may hold anything)."""
    tokens = torch.tensor([[0, 2**40, 2**40], [0, 3, 2**40]])
    parents = torch.tensor([[-1, 2**40, 2**40], [-1, 0, 2**40]])
    res = specdec.accept(torch.randn(2, 3, V), tokens, parents, num_nodes=torch.tensor([1, 2]), backend=backend)
    assert res.num_accepted.tolist()[0] == 0
    specdec.build_tree(parents, torch.tensor([1, 2]), backend=backend)


def huge_paged_cache():
    """A paged cache of blocks of 2**16 positions whose table addresses 2**31 + 2**16 positions per request (8 MB in
    all): positions past int32 are within its capacity."""
    k, v = torch.randn(2, 2**16, Hkv, D), torch.randn(2, 2**16, Hkv, D)
    return k, v, torch.zeros(B, 2**15 + 1, dtype=torch.int32)


@pytest.mark.parametrize("backend", CHECKED_BY)
def test_positions_past_int32_are_refused(backend):
    """cache_lens is int32: a rollback from 2**31 - 2 that keeps 2 rows would wrap it to -2**31 (it did, silently)."""
    k, v, table = huge_paged_cache()
    k0, v0 = k.clone(), v.clone()
    lens = torch.tensor([2**31 - 2, 0], dtype=torch.int32)
    path, num = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cache_lens: no room for the tree rows: cache_lens \+ count exceeds 2\*\*31 - 1"):
        specdec.kv_rollback(k, v, lens, path, num, block_table=table, backend=backend)
    assert lens.tolist() == [2**31 - 2, 0] and torch.equal(k, k0) and torch.equal(v, v0)
    with pytest.raises(ValueError, match=r"^cache_lens: no room for the T new tokens: cache_lens \+ count exceeds 2\*\*31"):
        specdec.kv_append(k, v, torch.randn(B, 2, Hkv, D), torch.randn(B, 2, Hkv, D), lens, block_table=table,
                          backend=backend)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    args = dict(attention_args(), k_cache=k, v_cache=v, block_table=table, cache_lens=lens)
    with pytest.raises(ValueError, match=r"^cache_lens: no room for the T new tokens: cache_lens \+ count exceeds 2\*\*31"):
        call_attention(args, backend)
    # the last position that fits: a rollback from 2**31 - 3 keeping 2 rows leaves cache_lens at 2**31 - 1
    lens = torch.tensor([2**31 - 3, 0], dtype=torch.int32)
    specdec.kv_rollback(k, v, lens, path, num, block_table=table, backend=backend)
    assert lens.tolist() == [2**31 - 1, 1]


@pytest.mark.parametrize("backend", CHECKED_BY)
def test_kv_rollback_rejects_caches_that_share_memory(backend):
    """Overlapping views (K rows 0..7, V rows 1..8 of one buffer) and a stride-0 stack of layers: rows would be moved
    twice. Checked by memory overlap, not by equal pointers."""
    lens, path = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([[0, 2], [0, 1]], dtype=torch.int32)
    num = torch.tensor([1, 1], dtype=torch.int32)
    buf = torch.randn(B, 9, Hkv, D)
    one_layer = torch.randn(1, B, 8, Hkv, D)
    before = buf.clone(), one_layer.clone()
    with pytest.raises(ValueError, match="^v_cache: shares memory with k_cache"):
        specdec.kv_rollback(buf[:, :8], buf[:, 1:], lens, path, num, backend=backend)
    stack = torch.randn(4, B, 8, Hkv, D)
    with pytest.raises(ValueError, match="^v_cache: shares memory with k_cache"):
        specdec.kv_rollback(stack[0:2], stack[1:3], lens, path, num, backend=backend)
    with pytest.raises(ValueError, match="^k_cache: its elements overlap"):
        specdec.kv_rollback(one_layer.expand(3, -1, -1, -1, -1), torch.randn(3, B, 8, Hkv, D), lens, path, num,
                            backend=backend)
    assert torch.equal(buf, before[0]) and torch.equal(one_layer, before[1]) and lens.tolist() == [1, 0]


@pytest.mark.parametrize("backend", CHECKED_BY)
def test_kv_rollback_takes_interleaved_halves_of_one_buffer(backend):
    """K and V interleaved in one buffer (K|V per block, or per head) share a storage and an address range but no
    element: valid, and moved as the reference moves separate tensors."""
    path, num = torch.tensor([[0, 2], [0, 1]], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32)
    for split in (1, 3):  # K|V along the rows' axis (vLLM's (blocks, 2, ...) layout) or along the heads' axis
        kv = torch.randn(3, B, 8, 2, Hkv, D).movedim(3, split + 1) if split == 1 else torch.randn(3, B, 8, Hkv, 2, D)
        k, v = kv.select(split + 1, 0), kv.select(split + 1, 1)
        k_ref, v_ref = k.clone(), v.clone()
        lens, lens_ref = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
        specdec.kv_rollback(k, v, lens, path, num, backend=backend)
        specdec.kv_rollback(k_ref, v_ref, lens_ref, path, num, backend="torch")
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref) and torch.equal(lens, lens_ref)


EMPTY_DIM_CASES = [
    ("k_cache", lambda be: call_attention(dict(attention_args(), k_cache=torch.randn(B, CAP, 0, D),
                                               v_cache=torch.randn(B, CAP, 0, D)), be)),  # Hkv = 0
    ("k_cache", lambda be: call_attention(dict(attention_args(), q=torch.randn(B, T, Hq, 0),
                                               k_cache=torch.randn(B, CAP, Hkv, 0), v_cache=torch.randn(B, CAP, Hkv, 0)),
                                          be)),  # D = 0
    ("target_logits", lambda be: specdec.accept(**dict(accept_args(), target_logits=torch.randn(B, T, 0)), backend=be)),
    ("target_logits", lambda be: specdec.accept(torch.tensor(1.0), torch.zeros(B, T, dtype=torch.long),
                                                torch.tensor([[-1, 0, 1, 2]] * B), backend=be)),
]


# (argument, message, call): int64 ids narrowed to int32 would wrap (2**32 + 5 would be token 5, 2**32 + 2 nodes
# would be 2: the C++ op once took them so); empty or missing dimensions raised ZeroDivisionError (Hkv = 0, D = 0)
# or IndexError (V = 0, a 0-dim tensor)
NAMED_VALUE_ERRORS = ([(name, "int64 values must fit in int32", call) for name, call in INT64_CASES]
                      + [(name, "", call) for name, call in EMPTY_DIM_CASES])


@pytest.mark.parametrize("backend", CHECKED_BY)
@pytest.mark.parametrize("name,message,call", NAMED_VALUE_ERRORS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(NAMED_VALUE_ERRORS)])
def test_hostile_values_and_shapes_are_named_value_errors(name, message, call, backend):
    with pytest.raises(ValueError, match=f"^{name}: {message}"):
        call(backend)


def test_non_tensors_are_type_errors_in_every_form():
    """The packed forms count rows before the other checks: a list there was an AttributeError."""
    cu = torch.tensor([0, 2])
    with pytest.raises(TypeError, match="^target_logits: expected a torch.Tensor"):
        specdec.accept([[0.0]], torch.zeros(2, dtype=torch.long), torch.tensor([-1, 0]), cu_num_nodes=cu, max_nodes=2)
    with pytest.raises(TypeError, match="^target_logits: expected a torch.Tensor"):
        specdec.accept([[0.0]], torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1, 0]]))
    with pytest.raises(TypeError, match="^q: expected a torch.Tensor"):
        specdec.tree_attention([1.0], torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16), torch.zeros(1, dtype=torch.int32),
                               torch.ones(2, 1, dtype=torch.int32), cu_num_nodes=cu, max_nodes=2)


@pytest.mark.parametrize("backend", ["torch", "triton", None])
def test_paged_attention_of_an_empty_batch(backend):
    """B = 0 with a block table: empty results (the reference's mask unpacking and the Triton launch heuristic failed)."""
    k, v = torch.randn(4, 8, 1, 16), torch.randn(4, 8, 1, 16)
    out, lse = specdec.tree_attention(torch.randn(0, 2, 2, 16), k, v, torch.zeros(0, dtype=torch.int32),
                                      torch.zeros(0, 2, 1, dtype=torch.int32), block_table=torch.zeros(0, 2, dtype=torch.int32),
                                      return_lse=True, backend=backend)
    assert out.shape == (0, 2, 2, 16) and lse.shape == (0, 2, 2)


def test_temperature_past_float32_is_a_value_error():
    with pytest.raises(ValueError, match=r"^temperature: must be finite and >= 0 \(at most float32's largest"):
        specdec.accept(**accept_args(), temperature=1e39)
    for backend in CHECKED_BY:
        with pytest.raises(ValueError, match="^temperature: must be finite and >= 0"):
            specdec.accept(**accept_args(), temperature=torch.tensor([1.0, 1e39], dtype=torch.float64), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton", None])
def test_fractions_valid_in_the_callers_dtype_are_taken(backend):
    """top_p = 1e-50 (0 in float32) keeps the top token only; a float64 min_p of 1 - 1e-12 (1 in float32) keeps the
    tokens within 1e-12 of the top one: both were refused as their float32 roundings. A top_p of 1 + 1e-12, which
    rounds to a valid 1, is still refused."""
    logits = torch.tensor([[[0.0, 2.0, 1.0, 1.5]]]).expand(B, 1, 4).contiguous()
    args = dict(target_logits=logits, tokens=torch.zeros(B, 1, dtype=torch.long), parents=torch.full((B, 1), -1),
                temperature=1.0, seeds=torch.arange(B), backend=backend)
    for key, value in (("top_p", torch.tensor([1e-50] * B, dtype=torch.float64)), ("top_p", 1e-50),
                       ("min_p", torch.tensor([1 - 1e-12] * B, dtype=torch.float64)), ("min_p", 1 - 1e-12)):
        res = specdec.accept(**args, **{key: value})
        assert res.next_tokens.tolist() == [1] * B, (key, value)
    with pytest.raises(ValueError, match=r"^top_p: must be in \(0, 1\]"):
        specdec.accept(**args, top_p=torch.tensor([1 + 1e-12] * B, dtype=torch.float64))
