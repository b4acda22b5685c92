"""EDKV sections computed by the kernels library on the CPU: the quantizers of ``kv/quant.py`` and the float16 cast
of FP16 sections, byte for byte, in one pass over a section's float32 rows (``csrc/kv_quant.c``); and the chunks'
CRC-32 by carry-less multiplication (``csrc/crc32.c``, ~4× zlib's).

:func:`section_kernel` gives the function a ``kv.wire.coder.SectionCoder`` takes as its ``kernel``: it reads the
section's token rows where they lie in the snapshot (no gather copy) and writes codes, scales and zeros (or float16
rows) straight into the chunk's views. It declines (returns False, having written nothing the caller keeps) what the
numpy reference must decide: a value not finite or beyond float16, a group whose minimum is ±0 (the sign of the
zero follows numpy's reduction order), a shape or a CPU the C code does not cover, or rows that are not float32.
The coder then computes that section with the reference. No library (no compiler at install,
``EDGEDECODE_KERNELS=off``): :func:`section_kernel` is None and the coder uses numpy, and :func:`crc32_function` is
zlib's.
"""

from __future__ import annotations

import ctypes
import functools
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from edgedecode.kernels import load, open_library
from edgedecode.kv.quant import QuantLayout

SectionKernel = Callable[[np.ndarray, np.ndarray, "QuantLayout | None", list[np.ndarray]], bool]
_OK = 0  # csrc/exports.h KVQ_OK
_AXES = {"token": 0, "channel": 1}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def _bind(library: ctypes.CDLL) -> None:
    rows: list[Any] = [_PTR, *[_I64] * 7, _PTR]  # src; layers, heads, m, d and its three strides; tokens
    library.edgedecode_kv_quantize.argtypes = [*rows, ctypes.c_int, ctypes.c_int, ctypes.c_int, _PTR, _PTR, _PTR,
                                               _I64, _I64]  # fmt: skip
    library.edgedecode_kv_quantize.restype = ctypes.c_int
    library.edgedecode_kv_to_fp16.argtypes = [*rows, _PTR, _I64]
    library.edgedecode_kv_to_fp16.restype = ctypes.c_int
    library.edgedecode_crc32.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32)]
    library.edgedecode_crc32.restype = ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | None:
    kernels = load()
    if not kernels.available or kernels.path is None:
        return None
    library = open_library(kernels.path)
    _bind(library)
    return library


@functools.cache
def section_kernel() -> SectionKernel | None:
    """The library's section kernel, or None where the library is not usable (``kernels.load().reason``)."""
    library = _library()
    if library is None:
        return None
    quantize, to_fp16 = library.edgedecode_kv_quantize, library.edgedecode_kv_to_fp16

    def kernel(rows: np.ndarray, tokens: np.ndarray, layout: QuantLayout | None, arrays: list[np.ndarray]) -> bool:
        """Write the section of ``rows [layers, H, n, D]`` (float32, channels contiguous) at ``tokens`` (indices on
        axis 2) into ``arrays`` (``kv.wire.chunks.section_arrays``); False where it leaves it to the reference."""
        if rows.dtype != np.float32 or rows.strides[-1] != 4 or any(s < 0 or s % 4 for s in rows.strides):
            return False
        if not all(_layers_apart(array) for array in arrays):
            return False
        tokens = np.ascontiguousarray(tokens, np.int64)
        layers, heads, _, d = rows.shape
        source = (rows.ctypes.data, layers, heads, len(tokens), d, *(s // 4 for s in rows.strides[:3]),
                  tokens.ctypes.data)  # fmt: skip
        if layout is None:
            (out,) = arrays
            return to_fp16(*source, out.ctypes.data, out.strides[0]) == _OK
        codes, scales, zeros = arrays
        if scales.strides[0] != zeros.strides[0]:
            return False
        status = quantize(
            *source, _AXES[layout.axis], layout.group, layout.bits, codes.ctypes.data, scales.ctypes.data,
            zeros.ctypes.data, codes.strides[0], scales.strides[0],
        )  # fmt: skip
        return status == _OK

    return kernel


@functools.cache
def crc32_function() -> Callable[[bytes], int]:
    """zlib's ``crc32(data)``, computed by the library where it folds with PCLMULQDQ (else by zlib)."""
    library = _library()
    if library is None:
        return zlib.crc32
    fold = library.edgedecode_crc32

    def crc32(data: bytes) -> int:
        value = ctypes.c_uint32(0)
        if fold(data, len(data), ctypes.byref(value)) == _OK:
            return value.value
        return zlib.crc32(data)

    return crc32


def _layers_apart(array: np.ndarray) -> bool:
    """Whether ``array [layers, ...]`` is C-contiguous within each layer (its layers any whole stride apart)."""
    inner = array[0] if len(array) else array
    return inner.flags.c_contiguous and array.strides[0] >= 0
