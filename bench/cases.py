"""The shape grids: toy cases (every backend, the slow reference and the Triton interpreter included), the
cases with performance targets (CPU: C++ against the PyTorch peers; H200: bandwidth against the copy ceiling
and speed against the peers), and engine-real shapes (B 1-256, T 1-64, prefix 512-32K, V 32K-152K, D 128,
Hkv 8, Hq 32). Cases carrying targets come first in every grid, so a time budget cuts the others."""
from __future__ import annotations

from .common import Case, Target

# ----------------------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------------------


def attn(B, T, L, dtype="bf16", Hq=32, Hkv=8, D=128, page=0, kv=None, window=None):
    extra = {**({"kv": kv} if kv else {}), **({"window": window} if window is not None else {})}
    return dict(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, L=L, dtype=dtype, page=page, **extra)


def acc(B, T, V, dtype="fp32", tree="chain", draft="iid", temp=1.0, top_k=0, top_p=1.0, penalties=False):
    filters = {**({"top_k": top_k} if top_k else {}), **({"top_p": top_p} if top_p < 1 else {}),
               **({"penalties": True} if penalties else {})}
    return dict(B=B, T=T, V=V, dtype=dtype, tree=tree, draft=draft, temp=temp, **filters)


def rb(layers, B, T, P, L=1024, dtype="bf16", Hkv=8, D=128, page=0, form="stacked", path="random"):
    return dict(layers=layers, B=B, Hkv=Hkv, D=D, L=L, T=T, P=P, dtype=dtype, page=page, form=form, path=path)


def app(B, T, L, dtype="bf16", Hkv=8, D=128, page=0):
    return dict(B=B, T=T, Hkv=Hkv, D=D, L=L, dtype=dtype, page=page)


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------
TOY = [
    Case("attention", attn(2, 5, 40, "fp32", Hq=4, Hkv=2, D=64, page=16), toy=True),
    Case("accept", acc(2, 5, 1000, tree="tree"), toy=True),
    Case("rollback", rb(2, 2, 6, 3, L=40, dtype="fp32", Hkv=2, D=64, page=16), toy=True),
    Case("append", app(2, 5, 40, "fp32", Hkv=2, D=64, page=16), toy=True),
]

CPU_FLOOR = "CPU floor: C++ vs PyTorch"
CPU_TARGETS = [
    Case("attention", attn(4, 16, 2048, "fp32", Hq=16, Hkv=4), targets=(Target("cpp", "sdpa", 1.5, CPU_FLOOR),)),
    Case("accept", acc(32, 8, 32000), targets=(Target("cpp", "torch-sampler", 3.0, CPU_FLOOR),)),
    Case("accept", acc(32, 8, 32000, top_k=50, top_p=0.9),
         targets=(Target("cpp", "torch-sampler", 3.0, CPU_FLOOR),  # and at most 1.5x the time without filters:
                  Target("cpp", "cpp-unfiltered", 1 / 1.5, "CPU floor: filters' cost"))),
    # the penalties, a 16-entry logit bias and 5 top logprobs, beside the same call without them and the PyTorch way
    Case("accept", acc(32, 8, 32000, penalties=True),
         targets=(Target("cpp", "torch-penalized-sampler", 5.0, CPU_FLOOR),
                  Target("cpp", "cpp-unfiltered", 1 / 1.5, "CPU floor: sampling parameters' cost"))),
    Case("rollback", rb(16, 8, 16, 4, L=256, dtype="fp32"), targets=(Target("cpp", "torch-index", 2.0, CPU_FLOOR),)),
]

CPU_QUICK = TOY + CPU_TARGETS + [Case("append", app(8, 16, 1024, "fp32"))]

CPU_FULL = CPU_QUICK + [
    Case("attention", attn(1, 1, 512, "fp32")),
    Case("attention", attn(1, 16, 4096, "fp32")),
    Case("attention", attn(8, 8, 1024, "fp32")),
    Case("attention", attn(4, 16, 2048, "fp32", Hq=16, Hkv=4, page=16)),
    Case("attention", attn(4, 16, 2048, "bf16", Hq=16, Hkv=4)),
    Case("attention", attn(4, 16, 2048, "fp32", Hq=16, Hkv=4, kv="fp8")),
    Case("attention", attn(4, 16, 2048, "fp32", Hq=16, Hkv=4, window=511)),
    Case("accept", acc(32, 8, 32000, temp=0.0)),
    Case("accept", acc(32, 8, 32000, "bf16")),
    Case("accept", acc(1, 8, 152064)),
    Case("accept", acc(8, 16, 32000, tree="tree")),
    Case("accept", acc(8, 16, 32000, tree="tree", draft="topk")),
    Case("rollback", rb(16, 8, 16, 4, L=256, dtype="fp32", form="list")),
    Case("rollback", rb(16, 8, 16, 4, L=256, dtype="fp32", page=16)),
    Case("rollback", rb(16, 1, 64, 8, L=256, dtype="bf16")),
    Case("rollback", rb(16, 8, 16, 4, L=256, dtype="fp32", path="chain")),
    Case("append", app(8, 16, 1024, "fp32", page=16)),
    Case("append", app(64, 4, 256, "bf16")),
]

# ----------------------------------------------------------------------------------------------
# GPU (H200)
# ----------------------------------------------------------------------------------------------
H200_FLOOR = "H200 floor"
PEER_GOAL = "goal: beat SDPA and Flex"


def _attention_goals(flex: bool):
    return (Target("triton", "sdpa", 1.0, PEER_GOAL),) + ((Target("triton", "flex", 1.0, PEER_GOAL),) if flex else ())


GPU_TARGETS = [
    Case("attention", attn(8, 16, 32768), flex=True,
         targets=(Target("triton", "copy", 80.0, H200_FLOOR),) + _attention_goals(True)),
    Case("attention", attn(1, 16, 8192), flex=True,
         targets=(Target("triton", "copy", 50.0, H200_FLOOR),) + _attention_goals(True)),
    Case("accept", acc(64, 8, 128256),
         targets=(Target("triton", "copy", 60.0, H200_FLOOR), Target("triton", "torch-sampler", 5.0, H200_FLOOR))),
    Case("rollback", rb(32, 64, 64, 8),
         targets=(Target("triton", "copy", 70.0, H200_FLOOR),)),
]

GPU_GRID = GPU_TARGETS + [
    Case("attention", attn(8, 16, 32768, page=16), targets=_attention_goals(False)),
    Case("attention", attn(8, 16, 32768, kv="fp8"), targets=_attention_goals(False)),
    Case("attention", attn(1, 16, 8192, kv="fp8", page=16), targets=_attention_goals(False)),
    Case("attention", attn(8, 16, 32768, window=4095), flex=True, targets=_attention_goals(True)),  # Mistral-like
    Case("attention", attn(64, 8, 2048, window=127, page=16), targets=_attention_goals(False)),  # gpt-oss-like
    Case("attention", attn(1, 1, 512), targets=_attention_goals(False)),
    Case("attention", attn(1, 64, 32768), targets=_attention_goals(False)),
    Case("attention", attn(4, 64, 16384), targets=_attention_goals(False)),
    Case("attention", attn(32, 16, 4096), targets=_attention_goals(False)),
    Case("attention", attn(64, 8, 2048), targets=_attention_goals(False)),
    Case("attention", attn(256, 4, 512), targets=_attention_goals(False)),
    Case("attention", attn(16, 32, 8192, "fp16", page=64), targets=_attention_goals(False)),
    Case("accept", acc(64, 8, 128256, "bf16")),
    Case("accept", acc(64, 8, 128256, temp=0.0)),
    # the filters at V = 128K, beside the same call without them (peer triton-unfiltered) and the sort-based way
    Case("accept", acc(32, 8, 128256, top_k=50, top_p=0.9)),
    Case("accept", acc(64, 8, 128256, penalties=True)),
    Case("accept", acc(1, 8, 32000)),
    Case("accept", acc(256, 4, 32000)),
    Case("accept", acc(16, 64, 152064, tree="tree")),
    Case("accept", acc(32, 16, 152064, tree="tree", draft="topk")),
    Case("rollback", rb(32, 64, 64, 8, form="list")),
    Case("rollback", rb(32, 64, 64, 8, page=16)),
    Case("rollback", rb(32, 1, 64, 8)),
    Case("rollback", rb(32, 256, 64, 8, L=256)),
    Case("rollback", rb(32, 64, 8, 8, path="chain")),
    Case("append", app(64, 16, 4096)),
    Case("append", app(64, 16, 4096, page=16)),
    Case("append", app(256, 64, 512)),
    Case("append", app(1, 8, 32768)),
]

GRIDS = {("cpu", False): CPU_FULL, ("cpu", True): CPU_QUICK, ("cuda", False): GPU_GRID, ("cuda", True): GPU_TARGETS}
