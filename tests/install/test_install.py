"""What an install must give a user: the C++ ops built, and every import the package makes at run time declared
as a requirement (optional features as extras that degrade gracefully when missing)."""
import ast
import importlib.metadata
import os
import re
import sys
from pathlib import Path

import pytest

import specdec

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "specdec").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
# imports that only some features make, each inside a function and each behind the extra that provides it
OPTIONAL = {"triton": "triton", "tqdm": "progress", "transformers": "hf", "xgrammar": "structured"}
# the engines an integration adapts to: never a requirement (the engine is there already, with its own pins), only
# imported inside the functions that run in it
PEERS = {"vllm", "sglang", "sgl_kernel", "flashinfer"}


def test_cpp_extension_is_built():
    """A build that silently left out the C++ ops (setuptools' legacy develop path, a build environment without
    torch) fails here. SPECDEC_NO_CPP=1, the switch that builds without them on purpose, skips the check."""
    if os.environ.get("SPECDEC_NO_CPP") == "1":
        pytest.skip("built with SPECDEC_NO_CPP=1")
    assert specdec.ops.HAS_CPP, "specdec._C did not build or does not load: `pip install --no-build-isolation -e .`"
    from specdec import _C
    assert Path(_C.__file__).parent == Path(specdec.__file__).parent


def _third_party_imports():
    """{top-level module: [(file, is it imported at module level)]} of every non-stdlib import in the package."""
    assert ROOT / "specdec" / "ops.py" in SOURCES and ROOT / "kernels" / "accept" / "__init__.py" in SOURCES, ROOT
    found = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root not in sys.stdlib_module_names and root not in ("specdec", "kernels"):
                    found.setdefault(root, []).append((path.relative_to(ROOT).as_posix(), id(node) in top_level))
    return found


def _requirements():
    """(install_requires names, {extra: names}) from the installed package's metadata."""
    required, extras = set(), {}
    for line in importlib.metadata.requires("specdec") or []:
        name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", line)
        (extras.setdefault(extra.group(1), set()) if extra else required).add(name)
    return required, extras


def test_every_runtime_import_is_a_requirement():
    required, extras = _requirements()
    for module, places in _third_party_imports().items():
        if module in PEERS:
            assert not any(top for _, top in places), f"{module}: a peer, but imported at module level"
        elif module in OPTIONAL:
            assert module in extras.get(OPTIONAL[module], set()), f"{module}: not in extra {OPTIONAL[module]!r}"
            if module != "triton":  # the kernels' own modules import triton; the package imports them lazily
                assert not any(top for _, top in places), f"{module}: optional, but imported at module level"
        else:
            assert module in required, f"{module} (imported by {places[0][0]}) is not in install_requires"


def test_package_imports_no_kernel_module_eagerly():
    """`import specdec` works without triton (CPU users): the Triton kernels load on their first use."""
    code = ("import sys, builtins\n"
            "real = builtins.__import__\n"
            "def no_triton(name, *a, **k):\n"
            "    if name.split('.')[0] == 'triton': raise ImportError('no triton')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = no_triton\n"
            "import specdec, torch\n"
            "res = specdec.accept(torch.randn(1, 2, 8), torch.zeros(1, 2, dtype=torch.long), torch.tensor([[-1, 0]]))\n"
            "print(int(res.num_accepted[0]) in (0, 1))\n")
    import subprocess
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
