"""A sender's chunk edits, every checksum resealed: chunk content re-encoded (other zstd parameters, sizes off by a
few bytes, random or non-finite values, damage only zstd sees, a zstd bomb, a huge zstd window), and chunk frames
dropped, repeated, reordered or taken from another payload with their indices renumbered."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np
import zstandard
from test_kv_format import join_frames, streamed_frame

from edgedecode.kv.wire.chunks import plan_chunk, section_float16
from edgedecode.kv.wire.frames import CHUNK_MAGIC, CHUNK_PREFIX
from kvfuzz.draw import Draw, chance, pick, random_bytes
from kvfuzz.mutant import Mutant
from kvfuzz.seeds import Seed

BOMB_NBYTES = 1 << 30  # what the zstd bomb decompresses to: a GiB of zeros, from about 40 KB
HUGE_WINDOW_LOG = 27  # the largest window zstd decoders accept by default: 128 MiB


@functools.cache
def zstd_bomb(declare_size: bool) -> bytes:
    """A zstd frame of BOMB_NBYTES zeros, declaring its size in its header or not."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declare_size).compressobj(size=BOMB_NBYTES)
    zeros = bytes(1 << 20)
    return b"".join(compressor.compress(zeros) for _ in range(BOMB_NBYTES // len(zeros))) + compressor.flush()


def _frame(index: int, body: bytes) -> bytes:
    return CHUNK_PREFIX.pack(CHUNK_MAGIC, index, len(body), zlib.crc32(body)) + body


def _sealed(seed: Seed, bodies: list[bytes], label: str) -> Mutant:
    header, _, _ = seed.frames
    return Mutant(join_frames(header, [_frame(i, b) for i, b in enumerate(bodies)]), label, tuple(bodies))


def _compress(raw: bytes, **params) -> bytes:
    return zstandard.ZstdCompressor(**params).compress(raw)


def recode_chunk(seed: Seed, draw: Draw) -> Mutant:
    """Chunk k's body replaced by another zstd encoding of its raw bytes, or of other raw bytes."""
    bodies = list(seed.bodies)
    k = draw.integer(0, len(bodies) - 1)
    raw = zstandard.ZstdDecompressor().decompress(bodies[k])
    op = pick(
        draw,
        [
            "level 19",
            "no content size",
            "raw off by a few bytes",
            "random raw bytes",
            "a non-finite or extreme float16",
            "zstd frame cut short",
            "bytes after the zstd frame",
            "two zstd frames",
            "a skippable frame first",
            "empty body",
            "zstd bomb",
            "zstd bomb declaring its size",
            "huge zstd window",
        ],
    )
    if op == "level 19":
        body = _compress(raw, level=19)
    elif op == "no content size":
        body = _compress(raw, write_content_size=False)
    elif op == "raw off by a few bytes":
        delta = pick(draw, [-2, -1, 1, 2])
        body = _compress(raw[:delta] if delta < 0 else raw + bytes(delta), write_content_size=chance(draw, 50))
    elif op == "random raw bytes":
        body = _compress(random_bytes(draw, len(raw)))
    elif op == "a non-finite or extreme float16":
        body = _compress(_poisoned(seed, k, raw, draw))
    elif op == "zstd frame cut short":
        body = bodies[k][: draw.integer(0, len(bodies[k]) - 1)]
    elif op == "bytes after the zstd frame":
        body = bodies[k] + random_bytes(draw, draw.integer(1, 16))
    elif op == "two zstd frames":
        body = bodies[k] + bodies[k]
    elif op == "a skippable frame first":
        body = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip" + bodies[k]
    elif op == "empty body":
        body = b""
    elif op == "huge zstd window":
        body = streamed_frame(raw, HUGE_WINDOW_LOG)
    else:
        body = zstd_bomb(op.endswith("size"))
    bodies[k] = body
    return _sealed(seed, bodies, f"chunk: {op}")


def _poisoned(seed: Seed, k: int, raw: bytes, draw: Draw) -> bytes:
    """``raw`` (chunk k) with one float16 that must be finite (an FP16 row value, a scale, a zero) replaced."""
    header = seed.header
    c, spec = header.contract, header.chunks[k]
    rect = (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop)
    sections = plan_chunk(header.cells, header.layouts, c.n_kv_heads, c.head_dim, rect).sections
    buffer = bytearray(raw)
    if sections:
        halves = section_float16(buffer, pick(draw, sections), c.n_kv_heads, c.head_dim)
        value = pick(draw, [np.inf, -np.inf, np.nan, 65504.0, -65504.0, 2.0**-24, -0.0])
        halves[draw.integer(0, len(halves) - 1), draw.integer(0, halves.shape[1] - 1)] = value
    return bytes(buffer)


def reorder_chunks(seed: Seed, draw: Draw, donors: Sequence[Seed]) -> Mutant:
    """Chunk frames dropped, repeated, swapped or taken from another payload (of ``donors``), their indices
    renumbered in stream order: every CRC and the trailer hold, only the header's sizes and the bodies' content
    can tell."""
    bodies = list(seed.bodies)
    k = draw.integer(0, len(bodies) - 1)
    op = pick(draw, ["drop", "repeat", "swap", "from another payload"])
    if op == "drop":
        del bodies[k]
    elif op == "repeat":
        bodies.insert(draw.integer(0, len(bodies)), bodies[k])
    elif op == "swap":
        j = draw.integer(0, len(bodies) - 1)
        bodies[j], bodies[k] = bodies[k], bodies[j]
    else:
        bodies[k] = pick(draw, pick(draw, donors).bodies)
    return _sealed(seed, bodies, f"chunk frames: {op}, renumbered")
