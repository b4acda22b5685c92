"""Run one fuzz case through the decode engine's EDKV stream into its real KV buffers, as the daemon's pull does
(feed the pieces, finish; on a refusal cut the segment, keeping its verified prefix), and judge what happened.

A case passes when it ends in a typed refusal (``KVFormatError`` from the reader, ``KVInjectionError`` from the
engine's prompt checks) or a complete ingest, and in either case:

- every KV slot holds what the oracle expects: the rows of each chunk the reader verified, and a sentinel
  everywhere else (nothing written from a refused chunk, before the segment's first slot or past its last);
  verified rows are the clean payload's for transport damage, and for a sender's resealed edit what the stream
  declares, decoded here value by value (a rotated section, EDKV 1.3, rotated back from the format's definition),
  finite and within the receiver's value limits (``KVCache.value_limits``: the reader refuses the rest);
- the kept prefix (``cut``) is exactly the leading tokens every layer of which those chunks hold, and the token
  ids and positions adopted are the prompt's;
- it took at most HANG_S of CPU, allocated at most ``allocation_bound`` (as tracemalloc sees it) and left the
  reader's zstd context within ``zstd_bound``.
"""

from __future__ import annotations

import itertools
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zstandard
from test_kv_format import per_value

from edgedecode.kv.quant import QuantLayout
from edgedecode.kv.rotation import Rotation
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import EDKVHeader, EDKVReader, KVFormatError
from edgedecode.kv.wire.chunks import plan_chunk, section_arrays
from edgedecode.kv.wire.frames import HEADER_CRC, HEADER_PREFIX
from edgedecode.kv.wire.target import BLOCK_VALUES
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.handoff import StreamedKV
from edgedecode.runtime.kvcache import KVInjectionError
from kvfuzz.mutations import Case
from kvfuzz.seeds import SENTINEL_BITS, Seed, bits

TYPED_ERRORS = (KVFormatError, KVInjectionError)
HANG_S = 1.0
MARGIN_SLOTS = 8  # slots past the prompt's last that are watched for stray writes, too
LIMIT_SLACK = 1e-5  # relative: the reader's float32 arithmetic (a rotation's GEMM) against this one's
FIXED_BYTES = 64 << 10  # see allocation_bound
HEADER_FACTOR = 8
CELL_BYTES = 32
SIGN_BYTES = 16  # per sign of a rotation (1.3): its random bytes, the bits, float64 and float32 arrays
ZSTD_BYTES = 1 << 20


class FuzzFailure(AssertionError):
    """A case that broke a rule: ``kind`` is crash, hang, wrong ingest or over allocation."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


@dataclass(frozen=True)
class Outcome:
    result: str  # "ingested", "ingested, edited KV" (a sender's edit accepted as declared), or the error's class
    field: str | None  # the refused field, for a KVFormatError
    verified_tokens: int  # the segment's kept prefix (all its tokens when ingested)
    chunks_written: int
    seconds: float  # wall clock, feeds to cut
    cpu_seconds: float  # this thread's CPU time over the same span
    peak_bytes: int  # peak of the allocations traced during the ingest (tracemalloc runs only then)
    bound_bytes: int
    zstd_bytes: int  # the reader's zstd decompression context, allocated by libzstd


def run_case(decoder: Engine, case: Case) -> Outcome:
    """Feed the case into ``decoder`` (a CPU engine with room for the seed's prompt and MARGIN_SLOTS) and check it;
    raises FuzzFailure."""
    seed, mutant = case.seed, case.mutant
    window = _window(decoder, seed)
    window[...] = SENTINEL_BITS[decoder.cache.host.dtype]
    stream = decoder.open_kv_stream(seed.prompt_ids, head=seed.head)
    if seed.lead is not None:  # a resume: the first segment broken off, its verified prefix kept
        stream.feed(seed.lead.payload)
        stream.cut()
        stream.resume()
    data = memoryview(mutant.payload)
    tracemalloc.start()  # only the ingest's own allocations are traced (and slowed)
    start, start_cpu = time.perf_counter(), time.thread_time()
    refused: tuple[str, str | None] | None = None  # (class, field); not the exception, which holds these frames
    try:
        for a, b in itertools.pairwise(case.cuts):
            stream.feed(data[a:b])
        stream.finish()
    except TYPED_ERRORS as exc:
        refused = type(exc).__name__, getattr(exc, "field", None)
    except Exception as exc:
        tracemalloc.stop()
        raise FuzzFailure("crash", f"{type(exc).__name__}: {exc}") from exc
    finally:
        if not stream.ended:
            stream.cut()  # what the daemon does with a refused or broken pull: its verified prefix stays
    seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - start_cpu
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    if cpu_seconds > HANG_S:  # CPU time: the work the case made (the wall clock adds the neighbours' load)
        raise FuzzFailure("hang", f"{cpu_seconds:.2f} s of CPU, {seconds:.2f} s")
    edited = _check_slots(stream, case, window, decoder.cache.value_limits)
    bound = allocation_bound(mutant.payload, stream.reader)
    if peak > bound:
        raise FuzzFailure("over allocation", f"{peak} bytes traced, bound {bound}")
    zstd_nbytes = stream.reader._dctx.memory_size()  # the reader's own decompression context: no public handle
    if zstd_nbytes > zstd_bound(stream.reader):
        raise FuzzFailure(
            "over allocation", f"a zstd context of {zstd_nbytes} bytes, bound {zstd_bound(stream.reader)}"
        )
    return Outcome(
        refused[0] if refused else "ingested, edited KV" if edited else "ingested",
        refused[1] if refused else None,
        stream.segments[-1].tokens,
        stream.reader.progress.chunks_done,
        seconds,
        cpu_seconds,
        peak,
        bound,
        zstd_nbytes,
    )


def allocation_bound(payload: bytes, reader: EDKVReader) -> int:
    """Bytes an ingest of ``payload`` by ``reader`` may allocate at its peak, from what was fed, what the header
    declared and the receiver's limits:

    - FIXED_BYTES: the reader, the stream and their small objects, a refusal's exception;
    - the bytes fed: a feed that ends inside a frame is buffered (at most the frame, at most what was fed);
    - HEADER_FACTOR × the header JSON: its copy, its text, the parsed document, the decoded arrays;
    - once the whole header arrived, CELL_BYTES per cell of the receiver's context (layers × max_tokens): the
      header's coverage and size checks are vectorised over its cells (layers × n_tokens, n_tokens ≤ max_tokens);
    - once a header is accepted: its largest chunk's raw bytes (the decompression buffer) and twice the float32
      staging for its widest chunk (the staging itself, and the code unpacking's index temporaries, at most a
      staging block's size);
    - once a header with a rotation (1.3) is accepted: twice that staging again (the rotated values, and the product
      before its signs) and SIGN_BYTES per sign (layers × 2 × kv_heads × head_dim).
    """
    bound = FIXED_BYTES + len(payload)
    if len(payload) >= HEADER_PREFIX.size:
        header_nbytes = HEADER_PREFIX.unpack_from(payload)[3]
        bound += HEADER_FACTOR * min(header_nbytes, len(payload))
        if len(payload) >= HEADER_PREFIX.size + header_nbytes + HEADER_CRC.size:
            bound += CELL_BYTES * reader.expected.n_layers * reader.max_tokens
    if reader.header is not None:
        c, table = reader.header.contract, reader.header.chunk_table
        widest = int((table[:, 3] - table[:, 2]).max(initial=0))
        staging = 4 * max(BLOCK_VALUES, widest * c.n_kv_heads * c.head_dim)
        bound += int(table[:, 4].max(initial=0)) + 2 * staging
        if reader.header.rotation is not None:
            bound += 2 * staging + SIGN_BYTES * c.n_layers * 2 * c.n_kv_heads * c.head_dim
    return bound


def zstd_bound(reader: EDKVReader) -> int:
    """Bytes the reader's zstd context may hold (allocated by libzstd, which tracemalloc does not see): ZSTD_BYTES
    for the context and its block buffers, and twice the largest window the accepted header's chunks can need (a
    frame needs no window beyond its content: the largest chunk's raw size, rounded up to a power of two)."""
    if reader.header is None:
        return ZSTD_BYTES
    largest = int(reader.header.chunk_table[:, 4].max(initial=0))
    return ZSTD_BYTES + 2 * (1 << max(largest - 1, 0).bit_length())


def _window(decoder: Engine, seed: Seed) -> np.ndarray:
    """The watched KV slots as bits (``bits``) ``[layers, 2, kv_heads, slots, head_dim]``: every slot of the
    prompt and MARGIN_SLOTS past it."""
    return bits(decoder.cache.host[:, :, 0, :, : len(seed.prompt_ids) + MARGIN_SLOTS])


def _check_slots(stream: StreamedKV, case: Case, window: np.ndarray, limits: np.ndarray) -> bool:
    """Check the watched slots, the kept prefix and the adopted tokens (``limits``: the decoder's value limits,
    float32 [layers, 2]); returns whether the KV written is a sender's edit (not the clean payload's)."""
    header, done = stream.reader.header, stream.reader.progress.chunks_done
    kv_dtype = case.seed.clean.dtype  # the decoder's
    expected = np.full(window.shape, SENTINEL_BITS[kv_dtype], window.dtype)
    edited = False
    lead = case.seed.lead
    if lead is not None:  # the cut first segment's rows stay as it wrote them
        expected[:, :, :, : lead.slots] = bits(lead.rows)
    if header is None:
        if done or stream.segments[-1].tokens:
            raise FuzzFailure("wrong ingest", f"{done} chunks, {stream.segments[-1].tokens} tokens kept, no header")
    else:
        kv, edited = _expected_kv(case, header, done, limits)
        cells = _written(header, done)[:, header.kept][:, None, None, :, None]
        slots = slice(case.seed.first_slot, case.seed.first_slot + header.n_kept)
        expected[:, :, :, slots] = np.where(cells, bits(kv.astype(kv_dtype)), SENTINEL_BITS[kv_dtype])
        _check_prefix(stream, case.seed, header, done)
    if not np.array_equal(window, expected):
        layer, kind, head, slot, _ = np.argwhere(window != expected)[0]
        raise FuzzFailure(
            "wrong ingest",
            f"slot {slot} (layer {layer}, {'KV'[kind]}, head {head}) holds {window[layer, kind, head, slot, :4]}, "
            f"expected {expected[layer, kind, head, slot, :4]}",
        )
    return edited


def _expected_kv(case: Case, header: EDKVHeader, done: int, limits: np.ndarray) -> tuple[np.ndarray, bool]:
    """The KV the verified chunks must have written, ``[layers, 2, kv_heads, n_kept, head_dim]`` (meaningful in
    their cells), and whether it is a sender's edit: other tokens or positions, or other KV in those cells, than
    the clean payload's."""
    seed, bodies = case.seed, case.mutant.bodies
    if bodies is None:
        if not _same_kv_layout(header, seed.header):
            raise FuzzFailure("wrong ingest", "transport damage changed the header the reader accepted")
        return seed.clean, False
    kv = reference_kv(header, bodies[:done])
    cells = _written(header, done)[:, header.kept][:, None, None, :, None]
    if not np.isfinite(np.where(cells, kv, 0)).all():
        raise FuzzFailure("wrong ingest", "a chunk holding inf or NaN was written")
    peaks = np.abs(np.where(cells, kv, 0)).max(axis=(2, 3, 4), initial=0.0)  # [layers, 2]
    over = np.argwhere(peaks > limits * (1 + LIMIT_SLACK))
    if over.size:
        layer, kind = over[0]
        raise FuzzFailure(
            "wrong ingest",
            f"a chunk beyond the receiver's value limits was written: layer {layer} {'KV'[kind]} reach "
            f"{peaks[layer, kind]:g}, limit {limits[layer, kind]:g}",
        )
    same_tokens = all(
        np.array_equal(getattr(header, name), getattr(seed.header, name)) for name in ("token_ids", "positions", "kept")
    )
    stored = kv.astype(seed.clean.dtype)  # as the decoder's KV dtype holds it
    return kv, not same_tokens or not np.array_equal(np.where(cells, stored, 0), np.where(cells, seed.clean, 0))


def _check_prefix(stream: StreamedKV, seed: Seed, header: EDKVHeader, done: int) -> None:
    """The segment keeps exactly the leading tokens whose every layer is in the verified chunks, and what it
    adopts are the prompt's tokens at their positions, from the first position it may hold on."""
    whole = _cells(header, done).all(axis=0)
    prefix = header.n_tokens if whole.all() else int(np.argmin(whole))
    segment = stream.segments[-1]
    ids, positions = segment.token_ids, segment.positions
    if segment.tokens != prefix or len(ids) != header.slots_before[prefix]:
        raise FuzzFailure(
            "wrong ingest", f"kept {segment.tokens} tokens ({len(ids)} slots); the verified chunks hold {prefix}"
        )
    prompt = seed.prompt_ids
    if len(positions) and (
        positions[0] < seed.first_position
        or positions[-1] >= len(prompt)
        or (positions[1:] <= positions[:-1]).any()
        or not np.array_equal(prompt[positions], ids)
    ):
        raise FuzzFailure("wrong ingest", "the tokens adopted are not the prompt's at their positions")


def _cells(header: EDKVHeader, done: int) -> np.ndarray:
    """bool [layers, n_tokens]: the cells the table's first ``done`` chunks hold."""
    cells = np.zeros((header.contract.n_layers, header.n_tokens), bool)
    for spec in header.chunks[:done]:
        cells[spec.layer_start : spec.layer_stop, spec.token_start : spec.token_stop] = True
    return cells


def _written(header: EDKVHeader, done: int) -> np.ndarray:
    """bool [layers, n_tokens]: the cells the first ``done`` chunks write: those they hold and carry (an EDKV 2.0
    window leaves the windowed layers' cells before its start out)."""
    return _cells(header, done) & (header.cells != Tier.DROP)


def _same_kv_layout(header: EDKVHeader, clean: EDKVHeader) -> bool:
    """Whether ``header`` places the same KV at the same tokens as ``clean`` (it may differ in meta, producer,
    transfer, zstd level and minor version)."""
    return (
        header.contract == clean.contract
        and header.layouts == clean.layouts
        and header.rotation == clean.rotation
        and all(
            np.array_equal(getattr(header, name), getattr(clean, name))
            for name in ("token_ids", "positions", "tiers", "chunk_table")
        )
        and header.window == clean.window
    )


def reference_kv(header: EDKVHeader, bodies: Sequence[bytes]) -> np.ndarray:
    """What the chunk bodies (the table's first ones, in order) declare under ``header``, decoded here value by
    value, apart from the reader's blocked, scattered writes: KV float32 ``[layers, 2, kv_heads, n_kept,
    head_dim]`` (zeros in the cells no body holds)."""
    c = header.contract
    kv = np.zeros((c.n_layers, 2, c.n_kv_heads, header.n_tokens, c.head_dim), np.float32)
    rotation = header.rotation
    signs = None if rotation is None else rotation_signs(rotation.seed, c.n_layers, c.n_kv_heads, c.head_dim)
    for spec, body in zip(header.chunks, bodies):
        raw = bytearray()  # a chunk of no bytes (every token dropped) may come with no zstd frame: the reader takes it
        if spec.raw_nbytes:
            raw = bytearray(zstandard.ZstdDecompressor().decompress(body, spec.raw_nbytes))
        rect = (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop)
        for section in plan_chunk(header.cells, header.layouts, c.n_kv_heads, c.head_dim, rect).sections:
            arrays = section_arrays(raw, section, c.n_kv_heads, c.head_dim)
            if section.layout is None:
                values = arrays[0].astype(np.float32)
            else:
                codes, scales, zeros = arrays
                m = len(section.tokens)
                q = unpack_codes(codes, section.layout, c.head_dim)
                values = q * per_value(scales, section.layout, m) + per_value(zeros, section.layout, m)
                if rotation is not None and section.tier in rotation.tiers:
                    assert signs is not None
                    values = rotated_back(values, signs[section.layer_start : section.layer_stop, section.kv], rotation)
            kv[section.layer_start : section.layer_stop, section.kv][:, :, section.tokens] = values
    return kv[:, :, :, header.kept]


def unpack_codes(codes: np.ndarray, layout: QuantLayout, head_dim: int) -> np.ndarray:
    """Packed codes ``[..., m, D·bits/8]`` as float32 ``[..., m, D]`` (lowest bits first; 3 bits: D/4 bytes of
    their low two bits, then D/8 bytes of their high bits)."""
    if layout.bits == 3:
        low, high = codes[..., : head_dim // 4], codes[..., head_dim // 4 :]
        return _unpack(low, 2, head_dim) + 4 * _unpack(high, 1, head_dim)
    return _unpack(codes, layout.bits, head_dim)


def _unpack(codes: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    lanes = 8 // bits
    shifts = (bits * np.arange(lanes)).astype(np.uint8)
    q = (codes[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*codes.shape[:-1], head_dim).astype(np.float32)


def rotation_signs(seed: int, n_layers: int, n_heads: int, head_dim: int) -> np.ndarray:
    """σ of docs/kv-format.md §4a, float32 [layers, 2, heads, D] of ±1: bit i (lowest first) of the uint8 stream
    of ``Generator(PCG64(seed))``, 1 meaning −1, in C order."""
    count = n_layers * 2 * n_heads * head_dim
    stream = np.random.Generator(np.random.PCG64(seed)).integers(0, 256, -(-count // 8), np.uint8)
    flags = [(int(stream[i // 8]) >> (i % 8)) & 1 for i in range(count)]
    return np.where(np.array(flags, bool), np.float32(-1), np.float32(1)).reshape(n_layers, 2, n_heads, head_dim)


def rotated_back(values: np.ndarray, signs: np.ndarray, rotation: Rotation) -> np.ndarray:
    """``(r̂ · H) ⊙ σ`` of float32 ``values [layers, H, m, D]`` with ``signs [layers, H, D]``: H the Sylvester
    Walsh–Hadamard matrix of order B over √B on each run of B channels. One float32 matrix product over all the
    rows at once (the reader's runs in batches: a row's product does not depend on the rows beside it)."""
    block = rotation.block
    sylvester = np.ones((1, 1))
    while len(sylvester) < block:
        sylvester = np.kron([[1, 1], [1, -1]], sylvester)
    h = (sylvester / np.sqrt(block)).astype(np.float32)
    product = np.matmul(np.ascontiguousarray(values, np.float32).reshape(-1, block), h).reshape(values.shape)
    return product * signs[:, :, None, :]
