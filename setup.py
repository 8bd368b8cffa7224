"""Build and install specdec: the Python package, the Triton kernels (as specdec.kernels) and the
C++ CPU ops (specdec._C). Build against the torch already installed:

    pip install --no-build-isolation -e .

The build fails when torch cannot be imported (an isolated build environment has none): install torch
first and build with --no-build-isolation, or set SPECDEC_NO_CPP=1 to skip the C++ extension on purpose
(the package then runs on the PyTorch reference backend on CPU).
The extension is compiled for the build machine's CPU (-march=native); SPECDEC_CPU_ARCH=<arch> (e.g.
x86-64-v3) builds for another target, SPECDEC_CPU_ARCH= (empty) for the compiler's default.
"""
import glob
import os
import platform
import shutil
import sys

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}


def cpu_arch_flags():
    """-march for the C++ ops: the build machine's own ISA by default (the extension is compiled where
    it is installed), so at::vec uses AVX2/AVX-512 where present. SPECDEC_CPU_ARCH=<arch> picks another
    target (e.g. x86-64-v3 for a portable AVX2 build); SPECDEC_CPU_ARCH= (empty) adds no flag."""
    arch = os.environ.get("SPECDEC_CPU_ARCH", "native")
    if not arch or platform.machine().lower() not in ("x86_64", "amd64", "aarch64") or os.name == "nt":
        return []
    return [f"-march={arch}"]


if os.environ.get("SPECDEC_NO_CPP") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        sys.exit(f"setup.py: the C++ ops (specdec._C) are compiled against the installed torch, but torch cannot be "
                 f"imported here ({exc}). Install torch first, then build without isolation: "
                 "`pip install --no-build-isolation -e .` (or `.`). SPECDEC_NO_CPP=1 builds without the C++ ops.")
    else:
        sources = sorted(glob.glob("csrc/*.cpp"))
        if sources:
            openmp = ["-fopenmp"]  # without it at::parallel_for silently runs on one thread
            # -Wno-*: noise from ATen's vec headers (CUDA/clang pragmas, GCC 12 on AVX-512 intrinsics)
            quiet = ["-Wno-unknown-pragmas", "-Wno-maybe-uninitialized"]
            ext_modules.append(CppExtension(
                "specdec._C", sources,
                depends=sorted(glob.glob("csrc/*.h")),
                extra_compile_args=["-O3", "-g0", *quiet, *openmp, *cpu_arch_flags()],
                extra_link_args=openmp))
            # ninja compiles the translation units in parallel and only the changed ones
            cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)

setup(
    name="specdec",
    version="0.1.0",
    description="Fused Triton/C++ kernels for speculative decoding: tree attention, lossless acceptance, KV rollback",
    # every subpackage of specdec/ (found, not listed: a list by hand dropped specdec.integrations), and the
    # Triton kernels of kernels/ as specdec.kernels
    packages=[*find_packages(include=["specdec", "specdec.*"]), "specdec.kernels"],
    package_dir={"specdec": "specdec", "specdec.kernels": "kernels"},
    package_data={"specdec": ["assets/*/*"]},
    python_requires=">=3.9",
    # every import of the package at run time (the CLI loads safetensors checkpoints)
    # (numpy: torch warns at every start without it)
    install_requires=["torch>=2.4", "safetensors>=0.4", "numpy"],
    # optional: Triton kernels (GPU, or CPU through TRITON_INTERPRET=1), progress bars, Hugging Face tokenizers
    # and the comparison rows of the end-to-end benchmark; without them those features are skipped
    extras_require={"triton": ["triton>=3.0"], "progress": ["tqdm"], "hf": ["transformers"],
                    "test": ["pytest", "pytest-xdist", "pytest-random-order", "numpy", "scipy", "pytest-benchmark", "hypothesis"],
                    "bench": ["pytest-benchmark", "numpy", "transformers"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
