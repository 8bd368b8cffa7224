"""Build and install specdec: the Python package, the Triton kernels (as specdec.kernels) and the
C++ CPU ops (specdec._C, compiled from csrc/).

    pip install .                            # any environment with torch (an engine's): torch is kept as is
    pip install --no-build-isolation -e .    # development: the C++ ops built now, against the installed torch

Where torch can be imported at build time (--no-build-isolation), the C++ ops are compiled now, against it.
In pip's default isolated build there is no torch (and none is fetched: it would be another multi-GB build,
not the one the package loads), so the wheel is pure Python and carries csrc/ as specdec/csrc/: the package
compiles the C++ ops against the torch in use on first import, once, into a cache (specdec/_cpp_build.py).
SPECDEC_BUILD_CPP=1 requires the build now (it fails without torch); SPECDEC_NO_CPP=1 skips it (the wheel
then compiles on first use like an isolated build's). The flags: specdec/_cpp_build.py (-march=native by
default; SPECDEC_CPU_ARCH=<arch>, e.g. x86-64-v3, for another target, SPECDEC_CPU_ARCH= for none).
"""
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _cpp_build():
    """specdec/_cpp_build.py (the compiler flags), loaded by path: importing specdec needs torch."""
    spec = importlib.util.spec_from_file_location("_specdec_cpp_build", ROOT / "specdec" / "_cpp_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithSources(build_py):
    """Also copies csrc/ into the built package as specdec/csrc/, the sources of the build on first use, and
    lists it among the package's sources (so an sdist carries it). An editable install maps specdec/ to the
    checkout, which builds the C++ ops ahead of time instead."""

    def cpp_sources(self):
        return sorted(ROOT.glob("csrc/*.cpp")) + sorted(ROOT.glob("csrc/*.h"))

    def get_source_files(self):
        return [*super().get_source_files(), *(str(p.relative_to(ROOT)) for p in self.cpp_sources())]

    def run(self):
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib) / "specdec" / "csrc"
            target.mkdir(parents=True, exist_ok=True)
            for path in self.cpp_sources():
                shutil.copyfile(path, target / path.name)


def cpp_extension():
    """(ext_modules, build_ext command) of the C++ ops compiled now, or ([], None) when they are left to the
    first use: torch cannot be imported here (pip's isolated build) or SPECDEC_NO_CPP=1."""
    if os.environ.get("SPECDEC_NO_CPP") == "1":
        return [], None
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        if os.environ.get("SPECDEC_BUILD_CPP") == "1":
            sys.exit(f"setup.py: SPECDEC_BUILD_CPP=1 compiles the C++ ops (specdec._C) against the installed torch, "
                     f"but torch cannot be imported here ({exc}). Install torch first, then build without "
                     "isolation: `pip install --no-build-isolation .`")
        print("setup.py: torch is not importable in this build environment (pip's build isolation): the C++ ops "
              "ship as sources and compile on first use", file=sys.stderr)
        return [], None
    flags = _cpp_build()
    sources = [str(Path(p).relative_to(ROOT)) for p in flags.sources(ROOT / "csrc")]
    extension = CppExtension("specdec._C", sources,
                             depends=[str(Path(p).relative_to(ROOT)) for p in flags.headers(ROOT / "csrc")],
                             extra_compile_args=flags.compile_args(), extra_link_args=list(flags.OPENMP))
    # ninja compiles the translation units in parallel and only the changed ones
    return [extension], BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)


ext_modules, build_ext = cpp_extension()
cmdclass = {"build_py": BuildPyWithSources, **({"build_ext": build_ext} if build_ext else {})}

setup(
    name="specdec",
    version="0.1.0",
    description="Fused Triton/C++ kernels for speculative decoding: tree attention, lossless acceptance, KV rollback",
    # every subpackage of specdec/ (found, not listed: a list by hand dropped specdec.integrations), and the
    # Triton kernels of kernels/ as specdec.kernels, with their subpackages (specdec.kernels.accept)
    packages=[*find_packages(include=["specdec", "specdec.*"]), "specdec.kernels",
              *("specdec.kernels." + name for name in find_packages("kernels"))],
    package_dir={"specdec": "specdec", "specdec.kernels": "kernels"},
    package_data={"specdec": ["loop/assets/*/*"]},
    python_requires=">=3.9",
    # every import of the package at run time (the CLI loads safetensors checkpoints)
    # (numpy: torch warns at every start without it; ninja: torch's builder of the C++ ops on first use)
    install_requires=["torch>=2.4", "safetensors>=0.4", "numpy", "ninja"],
    # optional: Triton kernels (GPU, or CPU through TRITON_INTERPRET=1), progress bars, Hugging Face tokenizers,
    # the grammars of structured outputs (specdec.loop.grammar) and the comparison rows of the end-to-end benchmark;
    # without them those features are skipped
    extras_require={"triton": ["triton>=3.0"], "progress": ["tqdm"], "hf": ["transformers"],
                    "structured": ["xgrammar==0.2.8"],
                    "test": ["pytest", "pytest-xdist", "pytest-random-order", "numpy", "scipy", "pytest-benchmark", "hypothesis",
                             "xgrammar==0.2.8"],
                    "bench": ["pytest-benchmark", "numpy", "transformers"]},
    # vLLM loads every `vllm.general_plugins` entry point in each of its processes; specdec's changes nothing
    # unless SPECDEC_VLLM_REJECTION_SAMPLER=1 (then its model runner builds specdec's rejection sampler)
    entry_points={"vllm.general_plugins": ["specdec = specdec.integrations.vllm_plugin:register"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
