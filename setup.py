"""Builds edgedecode's custom-op library (edgedecode/kernels/csrc) at install; everything else is in pyproject.toml.

The library is plain C11 compiled with the system's gcc or clang: no onnxruntime headers (csrc/ort_abi.h declares the
ABI), no Python headers used, no -march flag (each SIMD function carries its own target attribute and the library
picks its path at run time). It is not a Python module: onnxruntime loads it by path (edgedecode.kernels.register).
A missing compiler or a failed build leaves a warning and an install without it; the graphs then use MatMulNBits.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("edgedecode/kernels/csrc")
LIBRARY = "edgedecode.kernels.libedgedecode_kernels"


class BuildKernels(build_ext):
    """Names the library libedgedecode_kernels.so (not a Python extension's ABI-tagged name) and turns any build
    failure into a warning."""

    def get_ext_filename(self, fullname: str) -> str:
        # called with the dotted name and, by get_ext_fullpath, with its last part alone
        if fullname.rsplit(".", 1)[-1] == LIBRARY.rsplit(".", 1)[-1]:
            return str(Path(*fullname.split("."))) + ".so"
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # a compiler's absence or failure may surface as any distutils or OS error
            message = (
                f"WARNING: edgedecode's kernels library was not built ({type(error).__name__}: {error}); "
                "the install goes on without it and the graphs use onnxruntime's MatMulNBits "
                "(`edgedecode info` says so). Install gcc or clang and reinstall to build it."
            )
            print(message, file=sys.stderr)
            self.warn(message)


setup(
    ext_modules=[
        Extension(
            LIBRARY,
            sources=sorted(str(path) for path in CSRC.glob("*.c")),
            depends=sorted(str(path) for path in CSRC.glob("*.h")),
            extra_compile_args=["-std=c11", "-O3", "-g0", "-fvisibility=hidden", "-fno-math-errno", "-Wall"],
            libraries=["m", "pthread", "dl"],  # dl: dlopen of the CUDA driver (cuda_driver.c) on glibc < 2.34
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
