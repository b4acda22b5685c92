"""Transport damage: what a broken link, a bad buffer or a confused proxy does to a stream, with no checksum
recomputed. Whatever a receiver accepts of such a stream must be the clean payload's KV."""

from __future__ import annotations

from collections.abc import Callable

from edgedecode.kv.wire.frames import CHUNK_PREFIX, DEFAULT_MAX_CHUNK_BYTES, HEADER_CRC, HEADER_PREFIX, TRAILER
from kvfuzz.draw import Draw, chance, pick, random_bytes
from kvfuzz.mutant import Mutant
from kvfuzz.seeds import Seed

Span = tuple[str, int, int]  # (region name, start, stop) in the payload


def regions(seed: Seed) -> list[Span]:
    """The payload's fields by kind: header prefix, JSON and CRC; each chunk's prefix and body; the trailer."""
    header, chunks, trailer = seed.frames
    spans = [
        ("header prefix", 0, HEADER_PREFIX.size),
        ("header JSON", HEADER_PREFIX.size, len(header) - HEADER_CRC.size),
        ("header CRC", len(header) - HEADER_CRC.size, len(header)),
    ]
    pos = len(header)
    for chunk in chunks:
        spans += [
            ("chunk prefix", pos, pos + CHUNK_PREFIX.size),
            ("chunk body", pos + CHUNK_PREFIX.size, pos + len(chunk)),
        ]
        pos += len(chunk)
    return [*spans, ("trailer", pos, pos + len(trailer))]


def boundaries(seed: Seed) -> list[int]:
    """Where each frame and field starts (and the payload ends)."""
    return sorted({start for _, start, _ in regions(seed)} | {len(seed.payload)})


def _region(seed: Seed, draw: Draw) -> Span:
    """A region, its kind first (so the few header and prefix bytes are hit as often as the bulk of the bodies)."""
    spans = regions(seed)
    kind = pick(draw, sorted({name for name, start, stop in spans if stop > start}))
    return pick(draw, [span for span in spans if span[0] == kind and span[2] > span[1]])


def flip_bits(seed: Seed, draw: Draw) -> Mutant:
    """One to eight bits flipped in one region."""
    name, start, stop = _region(seed, draw)
    payload = bytearray(seed.payload)
    for _ in range(draw.integer(1, 8)):
        bit = draw.integer(8 * start, 8 * stop - 1)
        payload[bit // 8] ^= 1 << (bit % 8)
    return Mutant(bytes(payload), f"flip bits: {name}")


def overwrite(seed: Seed, draw: Draw) -> Mutant:
    """A run of up to 32 bytes in one region zeroed, set or randomised."""
    name, start, stop = _region(seed, draw)
    at = draw.integer(start, stop - 1)
    n = min(draw.integer(1, 32), stop - at)
    fill = pick(draw, ["zeros", "ones", "random"])
    run = {"zeros": bytes(n), "ones": b"\xff" * n}.get(fill) or random_bytes(draw, n)
    return Mutant(seed.payload[:at] + run + seed.payload[at + n :], f"overwrite {fill}: {name}")


def truncate(seed: Seed, draw: Draw) -> Mutant:
    """The stream ends early: anywhere, or within four bytes of a frame or field boundary."""
    if chance(draw, 50):
        at = draw.integer(0, len(seed.payload) - 1)
    else:  # at or next to a frame or field boundary
        at = min(max(pick(draw, boundaries(seed)) + draw.integer(-4, 4), 0), len(seed.payload) - 1)
    return Mutant(seed.payload[:at], "truncate")


def reframe(seed: Seed, draw: Draw) -> Mutant:
    """Whole frames lost, repeated, reordered or surrounded by stray bytes; every frame intact."""
    header, chunks, trailer = seed.frames
    op = pick(draw, ["drop chunk", "repeat chunk", "swap chunks", "early trailer", "repeat header", "stray bytes"])
    k = draw.integer(0, len(chunks) - 1)
    frames = [header, *chunks, trailer]
    if op == "drop chunk":
        del frames[1 + k]
    elif op == "repeat chunk":
        frames.insert(1 + draw.integer(0, len(chunks)), chunks[k])
    elif op == "swap chunks":
        j = draw.integer(0, len(chunks) - 1)
        frames[1 + j], frames[1 + k] = frames[1 + k], frames[1 + j]
    elif op == "early trailer":
        frames.insert(1 + k, trailer)
    elif op == "repeat header":
        frames.insert(draw.integer(1, len(frames)), header)
    else:
        frames.insert(draw.integer(0, len(frames)), random_bytes(draw, draw.integer(1, 64)))
    return Mutant(b"".join(frames), f"reframe: {op}")


def declared_sizes(seed: Seed, draw: Draw) -> Mutant:
    """A length, count or index field set to a huge or off-by-one value."""
    header, chunks, _ = seed.frames
    body_len = len(header) - HEADER_PREFIX.size - HEADER_CRC.size
    trailer_at = len(seed.payload) - TRAILER.size
    k = draw.integer(0, len(chunks) - 1)
    chunk_at = len(header) + sum(len(c) for c in chunks[:k])
    field, at, value = pick(
        draw,
        [
            ("header length", 8, body_len),
            ("chunk length", chunk_at + 8, len(chunks[k]) - CHUNK_PREFIX.size),
            ("chunk index", chunk_at + 4, k),
            ("trailer count", trailer_at + 4, len(chunks)),
        ],
    )
    huge = [0, value - 1, value + 1, DEFAULT_MAX_CHUNK_BYTES, DEFAULT_MAX_CHUNK_BYTES + 1, 2**31, 2**32 - 1]
    new = pick(draw, huge) % 2**32
    payload = seed.payload[:at] + new.to_bytes(4, "little") + seed.payload[at + 4 :]
    return Mutant(payload, f"declared size: {field}")


TRANSPORT: list[Callable[[Seed, Draw], Mutant]] = [flip_bits, overwrite, truncate, reframe, declared_sizes]
