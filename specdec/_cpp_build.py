"""How the C++ CPU ops (csrc/, the module specdec._C) are compiled: the flags, shared by the build ahead of
time (setup.py, against the torch installed at build time) and the build on first use (`load`). A wheel built
without torch (pip's default build isolation) ships the sources as specdec/csrc/; `load` compiles them against
the torch in use, once, into a cache, as FlashInfer's JIT does.

setup.py imports this file by path, where torch may not be importable: only the standard library at module level.
"""
import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

# where a wheel carries csrc/ (setup.py copies it there); a checkout has none (it builds ahead of time)
SHIPPED_SOURCES = Path(__file__).resolve().parent / "csrc"

OPENMP = ["-fopenmp"]  # without it at::parallel_for silently runs on one thread
# -Wno-*: noise from ATen's vec headers (CUDA/clang pragmas, GCC 12 on AVX-512 intrinsics)
QUIET = ["-Wno-unknown-pragmas", "-Wno-maybe-uninitialized"]


def cpu_arch_flags() -> list:
    """-march for the C++ ops: the build machine's own ISA by default (the extension is compiled where it is
    used), so at::vec uses AVX2/AVX-512 where present. SPECDEC_CPU_ARCH=<arch> picks another target (e.g.
    x86-64-v3 for a portable AVX2 build); SPECDEC_CPU_ARCH= (empty) adds no flag."""
    arch = os.environ.get("SPECDEC_CPU_ARCH", "native")
    if not arch or platform.machine().lower() not in ("x86_64", "amd64", "aarch64") or os.name == "nt":
        return []
    return [f"-march={arch}"]


def compile_args() -> list:
    return ["-O3", "-g0", *QUIET, *OPENMP, *cpu_arch_flags()]


def sources(folder: Path) -> list:
    """The translation units of `folder`, as strings, sorted."""
    return sorted(str(p) for p in Path(folder).glob("*.cpp"))


def headers(folder: Path) -> list:
    return sorted(str(p) for p in Path(folder).glob("*.h"))


def _cpu_identity() -> str:
    """What -march=native compiles for: a cache shared by machines (an NFS home) must not hand one CPU's
    build to another that lacks its instructions."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(next((l for l in lines if l.startswith(key)), "") for key in ("model name", "flags"))
    return platform.processor()


def cache_dir(torch_version: str) -> Path:
    """The build folder of this torch, Python, source text and set of flags: SPECDEC_CACHE_DIR, else
    $XDG_CACHE_HOME/specdec (~/.cache/specdec), then torch-<version>-<python>-<hash>."""
    root = os.environ.get("SPECDEC_CACHE_DIR") or \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"
    digest = hashlib.sha256()
    for path in sources(SHIPPED_SOURCES) + headers(SHIPPED_SOURCES):
        digest.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    arch = cpu_arch_flags()
    digest.update(repr((compile_args(), OPENMP, platform.machine(),
                        _cpu_identity() if arch == ["-march=native"] else "")).encode())
    return Path(root) / f"torch-{torch_version}-{sys.implementation.cache_tag}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Holds an OS lock on `lock_path`: one process compiles, the others wait and then load its build. The
    OS drops the lock when its holder dies, so a killed compile never blocks the next one."""
    import fcntl
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder runs `ninja` from PATH; the ninja package's binary is not on it when the venv's python
    runs without the venv activated."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def load():
    """specdec._C compiled from the sources the wheel ships, against the torch in use: from the cache, or
    compiled now (about a minute per core, once per torch version, source text and machine). Importing it
    registers torch.ops.specdec.*. Raises FileNotFoundError when the install shipped no sources (a checkout
    builds ahead of time), and the builder's error when the compile fails (no compiler, no Python headers)."""
    units = sources(SHIPPED_SOURCES)
    if not units:
        raise FileNotFoundError(f"no C++ sources at {SHIPPED_SOURCES}")
    import torch
    from torch.utils import cpp_extension

    build = cache_dir(torch.__version__)
    build.mkdir(parents=True, exist_ok=True)
    built = build / "built"  # written after a whole build loaded: a compile killed midway leaves none
    with _exclusive(build / "specdec.lock"):
        if not built.exists():
            print(f"specdec: compiling the C++ CPU ops against torch {torch.__version__} into {build} "
                  "(first use only; a few minutes; SPECDEC_JIT=0 skips it)", file=sys.stderr, flush=True)
            # torch's own lock file, left behind by a compile that was killed; ours is held, so it is stale
            (build / "lock").unlink(missing_ok=True)
            with _ninja_on_path():
                # (copies of the flag lists: torch appends its own to them, and they are part of the cache key)
                cpp_extension.load("_C", units, extra_cflags=compile_args(), extra_ldflags=list(OPENMP),
                                   extra_include_paths=[str(SHIPPED_SOURCES)], build_directory=str(build),
                                   is_python_module=False)
            built.touch()
    spec = importlib.util.spec_from_file_location("specdec._C", build / "_C.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["specdec._C"] = module
    sys.modules["specdec"]._C = module  # as an import of specdec._C binds it (load runs inside specdec's import)
    return module
