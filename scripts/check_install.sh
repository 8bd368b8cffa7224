#!/usr/bin/env bash
# The installs a user makes, each checked from outside the checkout, in a new venv with the newest pip and
# setuptools: a regular install (`pip install --no-build-isolation .`) and a wheel build (`pip wheel
# --no-build-isolation .`) must both contain the C++ ops, and `python -m specdec generate` must run after the
# plain install (every runtime import a declared requirement). `make check-install` runs it; so does CI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d /tmp/specdec-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" torch==2.13.0  # the CPU build from the local wheel; the package's own requirements come next

echo "check-install: pip install --no-build-isolation ."
"${pip[@]}" --no-build-isolation "$root"
cd "$tmp"  # away from the checkout: the installed package, not the source folder, is imported
"$py" -c "import specdec, specdec._C; assert specdec.ops.HAS_CPP; print('specdec._C:', specdec._C.__file__)"
# every module of the checkout (specdec/*, and kernels/* as specdec.kernels) imports from the regular install
"$py" - "$root" <<'PY'
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
"$py" -m specdec generate --prompt 'def f(x):' --max-new-tokens 16 --threads 1
"$py" -m specdec generate --prompt 'def f(x):' --max-new-tokens 16 --threads 1 --drafter mtp --tree auto

echo "check-install: pip wheel --no-build-isolation ."
"$py" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$tmp/dist" "$root"
"$py" - "$tmp"/dist/specdec-*.whl "$root" <<'PY'
import pathlib, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
root = pathlib.Path(sys.argv[2])
# every Python file of the checkout's package folders, at its installed path
sources = {"specdec/" + str(p.relative_to(root / "specdec")) for p in (root / "specdec").rglob("*.py")}
sources |= {"specdec/kernels/" + p.name for p in (root / "kernels").glob("*.py")}
missing = sorted(sources - set(names))
assert not missing, f"the wheel lacks {missing}"
need = {"the C++ ops": "specdec/_C", "the Triton kernels": "specdec/kernels/accept.py",
        "the shipped pair": "specdec/assets/target/config.json",
        "the shipped MTP module": "specdec/assets/mtp/model.safetensors"}
missing = [what for what, prefix in need.items() if not any(n.startswith(prefix) for n in names)]
assert not missing, f"the wheel lacks {missing}"
print("wheel:", sys.argv[1].rsplit("/", 1)[-1], f"has all {len(sources)} modules,", ", ".join(need))
PY
echo "check-install: ok"
