"""EDKV framing: magics, versions, fixed-size frame prefixes and their (un)packing. All integers little-endian."""

from __future__ import annotations

import struct

MAJOR = 1
MINOR = 2  # 1.1: the optional header field `transfer`, and cut streams keep their verified prefix; 1.2: `importance`
# 2.0: 1.2 plus the header field `window`: the windowed layers' cells before window.start are not sent. Only a
# stream with a window is written as 2.0 (and only to a receiver that asked for it); every other stream stays 1.2.
WINDOW_MAJOR = 2
WINDOW_MINOR = 0
# 1.3 and 2.1: the INT3 tier code and the header field `rotation`. Written only for a stream that uses one of them
# (every other stream stays 1.2 or 2.0, byte for byte), and served only to a receiver that asks (docs/serving.md).
LOWBIT_MINOR = {MAJOR: 3, WINDOW_MAJOR: 1}
READABLE_MAJORS = (MAJOR, WINDOW_MAJOR)

HEADER_MAGIC = b"EDKV"
CHUNK_MAGIC = b"EDKC"
TRAILER_MAGIC = b"EDKT"

HEADER_PREFIX = struct.Struct("<4sHHI")  # magic, major, minor, header JSON length
HEADER_CRC = struct.Struct("<I")  # crc32 of the header JSON, right after it
CHUNK_PREFIX = struct.Struct("<4sIII")  # magic, chunk index, compressed length, crc32 of the compressed bytes
TRAILER = struct.Struct("<4sI32s")  # magic, chunk count, SHA-256 of every byte before the trailer
MAGIC_NBYTES = 4

DEFAULT_MAX_CHUNK_BYTES = 64 << 20
MIN_ZSTD_WINDOW = 1 << 10  # zstd's smallest window (ZSTD_WINDOWLOG_ABSOLUTEMIN)

# Limits on what a header may declare (docs/kv-format.md §7), checked on the raw JSON before any per-item work:
# a hostile header must cost the receiver time in proportion to its context, not to what the header claims.
MIN_CHUNK_TOKENS = 64  # a writer with chunk_tokens >= this (any chunk_layers) always stays within the limits
CHUNK_COUNT_FLOOR = 256  # any chunking of up to this many chunks is accepted, however fine
SECTIONS_PER_CHUNK = 10  # 2 (K, V) × 5 non-DROP tiers: a chunk whose layers all share one tier row
MAX_NAME_CHARS = 1024  # each string of the contract and the producer
MAX_META_VALUES = 256  # JSON values inside `meta` (containers, keys and scalars)
MAX_META_DEPTH = 8  # nesting of `meta` below its own object
# nesting of arrays and objects anywhere in a header: a legal one nests 1 + MAX_META_DEPTH levels (its object, then
# meta's, whose own limit is reported as such); deeper is malformed, on every Python (json's own limit varies)
MAX_HEADER_DEPTH = 32
MAX_META_CHARS = 4096  # characters of all keys and strings inside `meta`
HEADER_BASE_BYTES = 128 << 10  # contract, producer, layouts, meta, zstd_level, room for new fields; even \u-escaped
CHUNK_ROW_BYTES = 64  # one chunk-table row, spaced or indented JSON included ("[0,30,0,256,1474560]," is 21)
MAX_TRANSFER_TTL_S = 3600.0  # a `transfer` reference lives at most this long
FIXED_CONTAINERS = 64  # JSON arrays and objects of a header besides chunk rows and meta (about 15 today)


def max_zstd_window(raw_nbytes: int) -> int:
    """The largest zstd window a chunk of ``raw_nbytes`` may declare: that size rounded up to a power of two.

    A frame never needs a window beyond its content, and the writer's frames (one-shot, content size declared)
    have exactly that. The limit keeps a hostile frame from making the decoder allocate the 128 MiB window zstd
    accepts by default for a chunk of a few bytes.
    """
    return max(MIN_ZSTD_WINDOW, 1 << max(raw_nbytes - 1, 0).bit_length())


def max_chunks(n_tokens: int, n_layers: int) -> int:
    """Most chunk-table rows a header of `n_tokens` × `n_layers` may declare.

    CHUNK_COUNT_FLOOR, or one chunk per layer per MIN_CHUNK_TOKENS tokens if that is more: what the writer makes
    with ``chunk_layers=1, chunk_tokens=MIN_CHUNK_TOKENS``, its finest chunking that always fits.
    """
    return max(CHUNK_COUNT_FLOOR, n_layers * -(-n_tokens // MIN_CHUNK_TOKENS))


def max_sections(n_tokens: int, n_layers: int) -> int:
    """Most sections (chunks.py: per layer run, K/V and tier) the chunks of such a header may hold in all."""
    return SECTIONS_PER_CHUNK * max_chunks(n_tokens, n_layers)


def max_header_nbytes(max_tokens: int, n_layers: int) -> int:
    """Header JSON bytes that a legitimate header of up to `max_tokens` tokens can need, generously.

    Base64 token ids, positions (8 bytes a token each), tier map (a byte per layer and token) and importance
    (1.2: 2 bytes a token), a row for each of the `max_chunks` chunks, and HEADER_BASE_BYTES for everything of
    fixed size.
    """
    n = max(0, max_tokens)
    per_token = 2 * _b64_len(8 * n) + _b64_len(n_layers * n) + _b64_len(2 * n)
    return HEADER_BASE_BYTES + per_token + CHUNK_ROW_BYTES * max_chunks(n, n_layers)


def max_header_containers(max_tokens: int, n_layers: int) -> int:
    """JSON arrays and objects ('[' and '{' bytes, counted before parsing: a bracket inside a string counts, too)
    that a legitimate header of up to `max_tokens` tokens can hold: each costs json.loads an allocation and the
    garbage collector a visit, far more than a byte of base64 does."""
    return (
        FIXED_CONTAINERS
        + max_chunks(max(0, max_tokens), n_layers)
        + MAX_META_VALUES
        + MAX_META_CHARS
        + 6 * MAX_NAME_CHARS
    )


def _b64_len(nbytes: int) -> int:
    return 4 * -(-nbytes // 3)
