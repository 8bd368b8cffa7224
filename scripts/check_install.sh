#!/usr/bin/env bash
# The installs a user makes, each checked from outside the checkout, in a new venv with the newest pip and
# setuptools and torch already there (as in an engine's environment):
#   (a) a regular install built against that torch (`pip install --no-build-isolation .`): the C++ ops built;
#   (b) a wheel build (`pip wheel --no-build-isolation .`): every module, the C++ ops and their sources;
#   (c) a plain `pip install .` (pip's isolated build, no torch in it): torch is kept as it was, and the C++ ops
#       are compiled on first use into the cache, then loaded from it.
# Each install has every module of the checkout, and `python -m specdec generate` runs after it (every runtime
# import a declared requirement). `make check-install` runs it; so does CI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d /tmp/specdec-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"  # away from the checkout: the installed package, not the source folder, is imported

new_venv() {  # new_venv DIR: a venv with the newest pip, setuptools and wheel, and torch
  python3 -m venv "$1"
  "$1/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
  "$1/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0  # the CPU build from the local wheel
}

check_modules() {  # check_modules PYTHON: every module of the checkout imports from the install, not the checkout
  "$1" - "$root" <<'PY'
import importlib, importlib.util, pathlib, sys
root = pathlib.Path(sys.argv[1])
modules = sorted({".".join(("specdec", *p.relative_to(root / "specdec").with_suffix("").parts))
                  for p in (root / "specdec").rglob("*.py")}
                 | {"specdec.kernels." + p.stem for p in (root / "kernels").glob("*.py")})
modules = [m.removesuffix(".__init__").removesuffix(".__main__") for m in modules if not m.endswith("__main__")]
for m in modules:  # (the Triton kernels are found, not imported: triton is an optional requirement)
    spec = importlib.util.find_spec(m)
    assert spec is not None, f"{m} is not installed"
    path = pathlib.Path(importlib.import_module(m).__file__ if not m.startswith("specdec.kernels.") else spec.origin)
    assert root not in path.parents, f"{m} comes from the checkout: {path}"
print(f"installed: all {len(modules)} modules of the checkout ({', '.join(sorted(set(m.rsplit('.', 1)[0] for m in modules)))})")
PY
}

generate() {  # generate PYTHON: the CLI on the shipped pair, plain and with the MTP drafter
  "$1" -m specdec generate --prompt 'def f(x):' --max-new-tokens 16 --threads 1
  "$1" -m specdec generate --prompt 'def f(x):' --max-new-tokens 16 --threads 1 --drafter mtp --tree auto
}

echo "check-install [$SECONDS s]: (a) pip install --no-build-isolation ."
new_venv "$tmp/venv"
py="$tmp/venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation "$root"
"$py" -c "
import pathlib, specdec, specdec._C
assert specdec.ops.HAS_CPP and pathlib.Path(specdec._C.__file__).parent == pathlib.Path(specdec.__file__).parent
print('specdec._C:', specdec._C.__file__)"
check_modules "$py"
generate "$py"

echo "check-install [$SECONDS s]: (b) pip wheel --no-build-isolation ."
"$py" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$tmp/dist" "$root"
"$py" - "$tmp"/dist/specdec-*.whl "$root" <<'PY'
import pathlib, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
root = pathlib.Path(sys.argv[2])
# every Python file of the checkout's package folders, at its installed path, and the C++ sources
sources = {"specdec/" + str(p.relative_to(root / "specdec")) for p in (root / "specdec").rglob("*.py")}
sources |= {"specdec/kernels/" + str(p.relative_to(root / "kernels")) for p in (root / "kernels").rglob("*.py")}
sources |= {"specdec/csrc/" + p.name for p in (root / "csrc").iterdir() if p.suffix in (".cpp", ".h")}
missing = sorted(sources - set(names))
assert not missing, f"the wheel lacks {missing}"
need = {"the C++ ops": "specdec/_C", "the Triton kernels": "specdec/kernels/accept/__init__.py",
        "the shipped pair": "specdec/loop/assets/target/config.json",
        "the shipped MTP module": "specdec/loop/assets/mtp/model.safetensors"}
missing = [what for what, prefix in need.items() if not any(n.startswith(prefix) for n in names)]
assert not missing, f"the wheel lacks {missing}"
print("wheel:", sys.argv[1].rsplit("/", 1)[-1], f"has all {len(sources)} modules and C++ sources,", ", ".join(need))
PY

echo "check-install [$SECONDS s]: (c) pip install . (isolated build) where torch is installed"
new_venv "$tmp/venv-plain"
py="$tmp/venv-plain/bin/python"
torch_id='import os, warnings; warnings.simplefilter("ignore"); import torch; print(torch.__version__, torch.__file__, os.stat(torch.__file__).st_mtime_ns)'
before=$("$py" -c "$torch_id")
"$py" -m pip install -q --disable-pip-version-check "$root"
after=$("$py" -c "$torch_id")
[ "$before" = "$after" ] || { echo "pip install . replaced torch: $before -> $after"; exit 1; }
echo "torch kept: $after"
export SPECDEC_CACHE_DIR="$tmp/cache"
# the first import compiles the C++ ops into the cache; they then run and agree with the reference
cpp_ops='
import pathlib, sys, time, torch
start = time.perf_counter()
import specdec
took = time.perf_counter() - start
assert specdec.ops.HAS_CPP, "the C++ ops did not load"
assert pathlib.Path(specdec._C.__file__).is_relative_to(sys.argv[1]), specdec._C.__file__
logits, tokens, parents = torch.randn(3, 4, 50), torch.randint(0, 50, (3, 4)), torch.tensor([[-1, 0, 1, 1]] * 3)
cpp, ref = (specdec.accept(logits, tokens, parents, backend=b) for b in ("cpp", "torch"))
assert all(torch.equal(x, y) for x, y in zip(cpp, ref)), (cpp, ref)
print(f"import specdec: {took:.1f} s, the C++ ops from {specdec._C.__file__}")'
"$py" -c "$cpp_ops" "$SPECDEC_CACHE_DIR" 2>&1 | tee "$tmp/first.log"
grep -q "compiling the C++ CPU ops" "$tmp/first.log" || { echo "the first import compiled nothing"; exit 1; }
"$py" -c "$cpp_ops" "$SPECDEC_CACHE_DIR" 2>&1 | tee "$tmp/second.log"
if grep -q "compiling" "$tmp/second.log"; then echo "the second import compiled again"; exit 1; fi
check_modules "$py"
generate "$py"
echo "check-install: ok ($SECONDS s)"
