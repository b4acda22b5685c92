"""edgedecode's own onnxruntime custom ops: matmuls and gathers that read GGUF blocks as they are stored.

The ops (domain ``com.edgedecode``; the contract is in the module's C sources and in docs) live in a small C library,
``libedgedecode_kernels.so``, that ``pip install`` compiles from ``csrc/`` when a C compiler is present. This module
finds it, asks it what it is through ctypes, checks that the installed onnxruntime can host it, and adds it to a
session's options. It never raises for a missing or unusable library: :func:`load` says why in ``reason`` and the
graph builder falls back to onnxruntime's MatMulNBits forms. ``EDGEDECODE_KERNELS=off`` forces that fallback.

It imports only the standard library: onnxruntime's C entry point is reached through ctypes, so asking whether the
kernels are usable costs no onnxruntime import.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

KERNEL_DOMAIN = "com.edgedecode"
LIBRARY_NAME = "libedgedecode_kernels.so"
# The exports' version this module speaks (csrc/exports.h EDGEDECODE_KERNELS_ABI); another means a stale build.
ABI_VERSION = 2
# GGML type ids the CPU ops read: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
CPU_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
_HERE = Path(__file__).resolve().parent
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelLibrary:
    """The kernels library as found: usable, or why not."""

    path: Path | None  # the built shared library, None where none is usable
    reason: str  # why not usable ("" when usable)
    cpu_isa: str  # the CPU path chosen at run time: "avx512vnni", "avx2", "neon", "neondot", "portable" ("" if none)
    cuda: bool  # the CUDA ops were built, the CUDA driver can be used and NVRTC (which compiles them) can be found
    cuda_reason: str = ""  # why the CUDA ops cannot run here ("" when ``cuda``)

    @property
    def available(self) -> bool:
        return self.path is not None and not self.reason


def _unusable(reason: str) -> KernelLibrary:
    return KernelLibrary(None, reason, "", False, reason)


class _OrtApiBase(ctypes.Structure):
    """onnxruntime's two-entry C entry table (csrc/ort_abi.h): GetApi(version) and GetVersionString()."""

    _fields_ = [
        ("GetApi", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)),
        ("GetVersionString", ctypes.CFUNCTYPE(ctypes.c_char_p)),
    ]


def onnxruntime_api_base() -> tuple[ctypes.c_void_p | None, str]:
    """The installed onnxruntime's OrtApiBase pointer, found without importing onnxruntime, and why not if None.

    The pointer comes from ``OrtGetApiBase`` in the shared library beside onnxruntime's Python binding (the same file
    the binding loads, so the same process-wide instance).
    """
    try:
        spec = importlib.util.find_spec("onnxruntime")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, "onnxruntime is not installed"
    candidates = sorted(
        path
        for folder in spec.submodule_search_locations
        for path in (Path(folder) / "capi").glob("libonnxruntime.so*")
    )
    if not candidates:
        return None, f"no libonnxruntime.so under {list(spec.submodule_search_locations)}"
    try:
        runtime = ctypes.CDLL(str(candidates[-1]))
        get_base = runtime.OrtGetApiBase
    except (OSError, AttributeError) as error:
        return None, f"onnxruntime's C library could not be opened: {error}"
    get_base.restype = ctypes.c_void_p
    get_base.argtypes = []
    return ctypes.c_void_p(get_base()), ""


def _bind(library: ctypes.CDLL) -> None:
    """Declare the exports' signatures (csrc/exports.h)."""
    library.edgedecode_kernels_version.restype = ctypes.c_int
    library.edgedecode_kernels_required_api.restype = ctypes.c_uint32
    library.edgedecode_kernels_cuda_built.restype = ctypes.c_int
    library.edgedecode_cuda_driver_status.restype = ctypes.c_char_p
    library.edgedecode_kernels_cpu_isa.restype = ctypes.c_char_p
    library.edgedecode_kernels_cpu_isas.restype = ctypes.c_char_p
    library.edgedecode_kernels_set_cpu_isa.argtypes = [ctypes.c_char_p]
    library.edgedecode_kernels_set_cpu_isa.restype = ctypes.c_int
    library.edgedecode_kernels_abi_selftest.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    library.edgedecode_kernels_abi_selftest.restype = ctypes.c_int
    library.edgedecode_kernels_last_refusal.restype = ctypes.c_char_p
    library.RegisterCustomOps.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    library.RegisterCustomOps.restype = ctypes.c_void_p


def open_library(path: Path) -> ctypes.CDLL:
    """The library at ``path`` opened through ctypes with its exports declared (raises OSError if it cannot be)."""
    library = ctypes.CDLL(str(path))
    try:
        _bind(library)
    except AttributeError as error:
        raise OSError(f"{path} lacks an export: {error}") from error
    return library


def _check_runtime(library: ctypes.CDLL) -> str:
    """Why the installed onnxruntime cannot host the library ("" if it can), checked through its C entry point."""
    base, why = onnxruntime_api_base()
    if base is None:
        return why
    table = ctypes.cast(base, ctypes.POINTER(_OrtApiBase)).contents
    needed = library.edgedecode_kernels_required_api()
    if not table.GetApi(needed):
        version = table.GetVersionString().decode()
        return (
            f"refused by onnxruntime {version}: the kernels need its C API version >= {needed} "
            f"(onnxruntime >= 1.{needed}); upgrade onnxruntime"
        )
    message = ctypes.create_string_buffer(256)
    if library.edgedecode_kernels_abi_selftest(base, message, len(message)) != 0:
        return f"the kernels' view of onnxruntime's C API disagrees with onnxruntime: {message.value.decode()}"
    return ""


@functools.cache
def load() -> KernelLibrary:
    """The kernels library of this install, cached. Never raises: an unusable library comes back with a reason."""
    if os.environ.get("EDGEDECODE_KERNELS", "").strip().lower() in ("off", "0", "false", "no"):
        return _unusable("disabled by EDGEDECODE_KERNELS=off")
    path = _HERE / LIBRARY_NAME
    if not path.is_file():
        return _unusable(
            "not built: `pip install` compiles it when a C compiler (gcc or clang) is present; "
            "install one and reinstall edgedecode"
        )
    try:
        library = open_library(path)
    except OSError as error:
        return _unusable(f"{path} could not be loaded: {error}")
    if library.edgedecode_kernels_version() != ABI_VERSION:
        return _unusable(
            f"{path} is a stale build (exports version {library.edgedecode_kernels_version()}, "
            f"this edgedecode expects {ABI_VERSION}); reinstall edgedecode"
        )
    reason = _check_runtime(library)
    cpu_isa = library.edgedecode_kernels_cpu_isa().decode()
    if reason:
        return KernelLibrary(None, reason, cpu_isa, False, reason)
    cuda_reason = _cuda_unusable(library)
    return KernelLibrary(path, "", cpu_isa, not cuda_reason, cuda_reason)


def _cuda_unusable(library: ctypes.CDLL) -> str:
    """Why the library's CUDA ops cannot run here ("" if they can): not built, no usable CUDA driver (asking
    initializes it: cuInit, no context), or no NVRTC to compile their kernels with (nvrtc.find_nvrtc)."""
    if not library.edgedecode_kernels_cuda_built():
        return "the library was built without its CUDA ops"
    if driver := library.edgedecode_cuda_driver_status().decode():
        return driver
    from edgedecode.kernels import nvrtc  # standard library only, like this module

    if nvrtc.find_nvrtc() is None:
        return (
            "NVRTC, which compiles the CUDA kernels, was not found: install onnxruntime-gpu's CUDA extra "
            "(pip install 'onnxruntime-gpu[cuda]', which brings nvidia-cuda-nvrtc) or set EDGEDECODE_NVRTC"
        )
    return ""


def register(session_options) -> bool:
    """Add the kernels to an onnxruntime ``SessionOptions``; False (and nothing added) when they are unusable."""
    kernels = load()
    if not kernels.available:
        return False
    try:
        session_options.register_custom_ops_library(str(kernels.path))
    except Exception as error:  # onnxruntime raises its own Fail/RuntimeException types; any means: fall back
        _log.warning("edgedecode kernels not registered with onnxruntime: %s", error)
        return False
    return True


def supports(ggml_type: int, device: str) -> bool:
    """Whether the op path covers a tensor type (GGML type id) on a device ("cpu" or "cuda") in this install."""
    kernels = load()
    if not kernels.available:
        return False
    if device == "cpu":
        return ggml_type in CPU_TYPES
    return device == "cuda" and kernels.cuda and ggml_type in CPU_TYPES
