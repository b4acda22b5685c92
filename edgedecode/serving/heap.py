"""The C heap of a long-running server: large buffers go back to the OS when they are freed.

glibc's malloc serves a buffer above its mmap threshold with its own mapping, returned to the OS on
free, but it raises that threshold (up to 32 MiB) each time such a buffer is freed, and keeps a heap
arena per thread. A server that makes transient megabyte-sized copies on several threads (KV
exports, EDKV payloads, activations) then keeps their high-water mark for good: the decode daemon's
RSS rose 1.5–2× above its KV budget in ``tools/bench/memory.py``. Fixing the threshold at 128 KiB
(what setting it does: no more raising) and capping the arenas makes freed buffers leave the
process, for a few page faults per allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters (malloc.h)
_M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 << 10
ARENA_MAX = 2


def _libc_function(name: str):
    """glibc's ``name`` from the process's C library, or None where there is none (musl, macOS)."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        logger.debug("no %s in %s: the heap keeps its defaults", name, library)
        return None


def return_freed_buffers() -> bool:
    """Set the process's malloc so that freed large buffers go back to the OS (glibc only); returns
    whether it was set. Elsewhere (musl, macOS) nothing changes."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_ARENA_MAX, ARENA_MAX))


def release_free_pages() -> bool:
    """Give the heap's free pages back to the OS (glibc's malloc_trim); returns whether any went. Worth it once
    after loading a model: parsing a GGUF's vocabulary (128k-256k strings, their merges, the reader's views) frees
    tens of MiB in small pieces that stay resident between live ones (21 MiB on Llama 3.2's vocabulary)."""
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(malloc_trim(0))
