"""EDKV streaming reader: parses and verifies the stream frame by frame (header, chunks, trailer); each verified
chunk is dequantised straight into the receiver's KV buffer (``wire.target``)."""

from __future__ import annotations

import enum
import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import zstandard

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire.chunks import plan_chunk, section_arrays
from edgedecode.kv.wire.errors import (
    KVChecksumError,
    KVContractError,
    KVFormatError,
    KVMalformedError,
    KVTooLargeError,
    KVTruncatedError,
    KVVersionError,
)
from edgedecode.kv.wire.frames import (
    CHUNK_MAGIC,
    CHUNK_PREFIX,
    DEFAULT_MAX_CHUNK_BYTES,
    HEADER_CRC,
    HEADER_MAGIC,
    HEADER_PREFIX,
    MAGIC_NBYTES,
    MIN_ZSTD_WINDOW,
    READABLE_MAJORS,
    TRAILER,
    TRAILER_MAGIC,
    max_header_containers,
    max_header_nbytes,
    max_zstd_window,
)
from edgedecode.kv.wire.header import (
    ChunkSpec,
    EDKVHeader,
    contract_from_doc,
    doc_field,
    load_doc,
)
from edgedecode.kv.wire.target import TargetWriter
from edgedecode.kv.wire.value_check import ValueBounds
from edgedecode.model.spec import KVContract

DECODE_SNAPSHOT_MAX_TOKENS = 1 << 20

TargetFactory = Callable[[EDKVHeader], np.ndarray]
ChunkCallback = Callable[[ChunkSpec, slice], None]


class _Stage(enum.Enum):
    HEADER_PREFIX = enum.auto()
    HEADER_BODY = enum.auto()
    FRAME = enum.auto()  # the next frame's magic decides: chunk or trailer
    CHUNK_PREFIX = enum.auto()
    CHUNK_BODY = enum.auto()
    TRAILER = enum.auto()
    DONE = enum.auto()


@dataclass(frozen=True)
class ReadProgress:
    bytes_in: int
    chunks_done: int
    chunks_total: int | None  # None until the header is in
    tokens_ingested: int  # kept tokens whose every layer is written
    tokens_verified: int  # leading tokens (kept or dropped) whose every layer arrived in verified chunks


class EDKVReader:
    """Incremental EDKV parser (1.x, and 2.x with its window); feed it any slices of the stream, then call `finish`.

    Args:
        expected: the receiver's KVContract; any mismatching field is a KVContractError.
        max_tokens: the receiver's context; a stream with more tokens is a KVTooLargeError.
        target_factory: called once with the validated header; returns the destination, a float32 or float16
            array ``[layers, 2 (K, V), kv_heads, slots >= header.n_kept, head_dim]`` whose head_dim rows are
            contiguous (any view of a decoder's KV buffers qualifies). Kept tokens are written
            compacted: the i-th kept token goes to slot i.
        on_chunk: called after each chunk is written, with its ChunkSpec and the slots it filled.
        max_chunk_bytes: limit on a chunk's compressed and raw sizes.
        max_header_bytes: limit on the header JSON; None (the default): what a legitimate header of up to
            `max_tokens` tokens can need (`frames.max_header_nbytes`).
        value_limits: float32 ``[n_layers, 2]``, the largest |key| and |value| accepted in each layer
            (``KVValueRange.limits()``); None: any finite value. A float16 destination caps them at 65504.

    The header's declared counts (chunks, sections, layouts, meta) are bounded before any per-item work. Each
    chunk is checked (CRC-32, bounded zstd decompression, exact size, values finite and within `value_limits`:
    ``value_check``) before anything from it is written. After any error the reader refuses further input.
    """

    def __init__(
        self,
        expected: KVContract,
        *,
        max_tokens: int,
        target_factory: TargetFactory,
        on_chunk: ChunkCallback | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_header_bytes: int | None = None,
        value_limits: np.ndarray | None = None,
    ) -> None:
        self.expected = expected
        self.max_tokens = max_tokens
        self.max_chunk_bytes = max_chunk_bytes
        self.max_header_bytes = (
            max_header_nbytes(max_tokens, expected.n_layers) if max_header_bytes is None else max_header_bytes
        )
        self._target_factory = target_factory
        self._on_chunk = on_chunk
        self._bounds = ValueBounds(value_limits, expected.n_layers)  # the target's dtype may cap them
        self._stage = _Stage.HEADER_PREFIX
        self._need = HEADER_PREFIX.size
        self._buf = bytearray()
        self._digest = hashlib.sha256()
        self._dctx = zstandard.ZstdDecompressor(max_window_size=MIN_ZSTD_WINDOW)  # the header's replaces it
        self._failure: str | None = None  # why the stream failed (see _failed)
        self._bytes_in = 0
        self._major, self._minor = 0, 0
        self._chunk_crc = 0
        self._chunks_done = 0
        self._tokens_ingested = 0
        self._header: EDKVHeader | None = None
        self._writer: TargetWriter | None = None
        self._raw = bytearray()
        self._layers_done = np.zeros(0, np.int64)

    @property
    def header(self) -> EDKVHeader | None:
        """The validated header, once it has arrived."""
        return self._header

    @property
    def _parsed(self) -> EDKVHeader:
        """The header, in every stage after HEADER_BODY (which sets it together with the target)."""
        assert self._header is not None, "past the header stage"
        return self._header

    @property
    def _target(self) -> TargetWriter:
        """What writes into the target_factory's array, set together with the header."""
        assert self._writer is not None, "past the header stage"
        return self._writer

    @property
    def progress(self) -> ReadProgress:
        total = None if self._header is None else len(self._header.chunks)
        return ReadProgress(self._bytes_in, self._chunks_done, total, self._tokens_ingested, self.verified_tokens)

    @property
    def verified_tokens(self) -> int:
        """Leading tokens of the header (kept or dropped) whose cells in every layer arrived in verified
        chunks: the prefix a cut stream keeps (0 before the header)."""
        if self._header is None:
            return 0
        if self._stage is _Stage.DONE:
            return self._header.n_tokens
        missing = np.flatnonzero(self._layers_done != self._header.contract.n_layers)
        return int(missing[0]) if len(missing) else self._header.n_tokens

    def cut(self) -> int:
        """End the stream here, before its trailer (the receiver stopped reading, or the connection
        broke): returns ``verified_tokens``, whose KV stays written where the destination put it (the
        first ``header.slots_before[verified]`` slots); the reader refuses further input.

        Every kept token of the prefix arrived in chunks whose CRC-32 was verified, under a header
        whose CRC-32 was; the trailer's digest adds no check a prefix needs (docs/kv-format.md §5).
        A complete stream is cut after its last token; a failed stream is cut at what it verified
        before failing.
        """
        verified = self.verified_tokens
        if self._failure is None and self._stage is not _Stage.DONE:
            self._failed(KVTruncatedError(self._cut_at(), f"cut by the receiver after {self._bytes_in} bytes"))
        self._buf = bytearray()
        return verified

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Consume the next bytes of the stream, acting on every frame they complete."""
        if self._failure is not None:
            raise KVFormatError("stream", f"refused: the stream already failed ({self._failure})")
        try:
            view = memoryview(data).cast("B")
            self._bytes_in += len(view)
            if not self._buf:  # common case: parse straight from the caller's buffer, keep only the remainder
                self._buf += view[self._parse(view) :]
                return
            self._buf += view
            with memoryview(self._buf) as buffered:
                consumed = self._parse(buffered)
            if consumed:
                del self._buf[:consumed]
        except Exception as e:
            self._failure = str(e)
            raise

    def finish(self) -> EDKVHeader:
        """Confirm the stream is complete (trailer verified, every chunk written); return its header."""
        if self._failure is not None:
            raise KVFormatError("stream", f"refused: the stream already failed ({self._failure})")
        if self._stage is not _Stage.DONE:
            raise self._failed(KVTruncatedError(self._cut_at(), f"the stream ended after {self._bytes_in} bytes"))
        return self._parsed

    def _failed(self, error: KVFormatError) -> KVFormatError:
        """Record why the stream failed and return ``error``: its text only (its traceback, once raised, holds the
        reader's frames, and a reader holding it would live, buffers and all, until the cycle collector runs)."""
        self._failure = str(error)
        return error

    def _parse(self, view: memoryview) -> int:
        """Handle every complete item at the front of `view`; return the bytes consumed."""
        pos = 0
        while self._stage is not _Stage.DONE and len(view) - pos >= self._need:
            item = view[pos : pos + self._need]
            if self._stage is _Stage.FRAME:
                self._peek_frame(bytes(item))
                continue
            if self._stage not in (_Stage.TRAILER, _Stage.CHUNK_BODY):  # a body is covered by its prefix's CRC
                self._digest.update(item)
            pos += len(item)
            self._HANDLERS[self._stage](self, item)
        if self._stage is _Stage.DONE and pos < len(view):
            raise KVMalformedError("trailer", f"{len(view) - pos} bytes after the trailer")
        return pos

    def _expect(self, stage: _Stage, need: int) -> None:
        self._stage, self._need = stage, need

    def _header_prefix(self, item: memoryview) -> None:
        magic, major, minor, length = HEADER_PREFIX.unpack(item)
        if magic != HEADER_MAGIC:
            raise KVMalformedError("magic", f"expected {HEADER_MAGIC!r}, got {magic!r}: not an EDKV stream")
        if major not in READABLE_MAJORS:
            readable = " and ".join(f"{m}.x" for m in READABLE_MAJORS)
            raise KVVersionError("version", f"EDKV {major}.{minor} is not readable here (this reader: {readable})")
        if length > self.max_header_bytes:
            raise KVTooLargeError("header", f"{length} bytes of header JSON, limit {self.max_header_bytes}")
        self._major, self._minor = major, minor
        self._expect(_Stage.HEADER_BODY, length + HEADER_CRC.size)

    def _header_body(self, item: memoryview) -> None:
        body, (crc,) = item[: -HEADER_CRC.size], HEADER_CRC.unpack(item[-HEADER_CRC.size :])
        if zlib.crc32(body) != crc:
            raise KVChecksumError("header", f"header JSON CRC-32 {zlib.crc32(body):08x} != {crc:08x}")
        doc = load_doc(body, max_header_containers(self.max_tokens, self.expected.n_layers))
        mismatches = self.expected.mismatches(contract_from_doc(doc))
        if mismatches:
            raise KVContractError(mismatches)
        n = doc_field(doc, "n_tokens", int)
        if n > self.max_tokens:
            raise KVTooLargeError("n_tokens", f"{n} tokens, the receiver's context holds {self.max_tokens}")
        header = EDKVHeader.from_doc(doc, self._minor, self._major)  # counts, coverage, raw_nbytes
        table = header.chunk_table
        over = np.flatnonzero(table[:, 4] > self.max_chunk_bytes)
        if over.size:
            raise KVTooLargeError(
                f"chunk {int(over[0])}", f"{int(table[over[0], 4])} raw bytes, limit {self.max_chunk_bytes}"
            )
        self._writer = TargetWriter(self._target_factory(header), header)
        self._bounds = self._bounds.for_target(self._writer.target.dtype)
        self._raw = bytearray(int(table[:, 4].max(initial=0)))
        self._dctx = zstandard.ZstdDecompressor(max_window_size=max_zstd_window(len(self._raw)))
        self._header = header
        self._layers_done = np.zeros(header.n_tokens, np.int64)
        self._expect(_Stage.FRAME, MAGIC_NBYTES)

    def _peek_frame(self, magic: bytes) -> None:
        if magic == CHUNK_MAGIC:
            self._expect(_Stage.CHUNK_PREFIX, CHUNK_PREFIX.size)
        elif magic == TRAILER_MAGIC:
            self._expect(_Stage.TRAILER, TRAILER.size)
        else:
            raise KVMalformedError(
                "magic", f"expected a chunk {CHUNK_MAGIC!r} or the trailer {TRAILER_MAGIC!r}, got {magic!r}"
            )

    def _chunk_prefix(self, item: memoryview) -> None:
        _, index, length, self._chunk_crc = CHUNK_PREFIX.unpack(item)
        if self._chunks_done == len(self._parsed.chunks):
            raise KVMalformedError(
                "chunk index", f"chunk {index} after all {self._chunks_done} chunks of the table; expected the trailer"
            )
        if index != self._chunks_done:
            raise KVMalformedError(
                "chunk index", f"expected chunk {self._chunks_done} of {len(self._parsed.chunks)}, got {index}"
            )
        if length > self.max_chunk_bytes:
            raise KVTooLargeError(f"chunk {index}", f"{length} compressed bytes, limit {self.max_chunk_bytes}")
        self._expect(_Stage.CHUNK_BODY, length)

    def _chunk_body(self, item: memoryview) -> None:
        header = self._parsed
        spec = header.chunks[self._chunks_done]
        crc = zlib.crc32(item)
        if crc != self._chunk_crc:
            raise KVChecksumError(f"chunk {spec.index}", f"CRC-32 {crc:08x} != {self._chunk_crc:08x}")
        raw = self._decompress(item, spec)
        c = header.contract
        plan = plan_chunk(
            header.cells,
            header.layouts,
            c.n_kv_heads,
            c.head_dim,
            (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop),
        )
        if plan.raw_nbytes != spec.raw_nbytes:  # the header's check makes this unreachable
            raise KVMalformedError(f"chunk {spec.index}", f"{spec.raw_nbytes} raw bytes, the plan {plan.raw_nbytes}")
        rotation, target = header.rotation, self._target
        for section in plan.sections:  # every value of the chunk, before anything from it is written
            rotated = rotation is not None and rotation.rotates(section.tier)
            self._bounds.check(spec, section, raw, c.n_kv_heads, c.head_dim, target.unrotation if rotated else None)
        for section in plan.sections:
            target.write(section, section_arrays(raw, section, c.n_kv_heads, c.head_dim))
        self._chunks_done += 1
        done = self._layers_done[spec.token_start : spec.token_stop]
        done += spec.layer_stop - spec.layer_start
        kept = header.kept[spec.token_start : spec.token_stop]
        self._tokens_ingested += int(np.count_nonzero((done == header.contract.n_layers) & kept))
        if self._on_chunk is not None:
            self._on_chunk(spec, header.slot_range(spec))
        self._expect(_Stage.FRAME, MAGIC_NBYTES)

    def _decompress(self, item: memoryview, spec: ChunkSpec) -> memoryview:
        """The raw chunk, in the reader's reused buffer; zstd never writes beyond the size the header gives, nor
        allocates a window beyond the largest chunk's (``frames.max_zstd_window``)."""
        raw = memoryview(self._raw)[: spec.raw_nbytes]
        try:
            declared = zstandard.frame_content_size(item)
            if declared not in (-1, spec.raw_nbytes):
                raise KVMalformedError(
                    f"chunk {spec.index}", f"zstd frame declares {declared} bytes, the chunk table {spec.raw_nbytes}"
                )
            got = 0
            with self._dctx.stream_reader(item) as stream:
                while got < spec.raw_nbytes and (step := stream.readinto(raw[got:])):
                    got += step
                extra = len(stream.read(1))
        except zstandard.ZstdError as e:
            raise KVMalformedError(f"chunk {spec.index}", f"zstd: {e}") from None
        if got != spec.raw_nbytes or extra:
            raise KVMalformedError(
                f"chunk {spec.index}", f"{'more than ' if extra else ''}{got} raw bytes, expected {spec.raw_nbytes}"
            )
        return raw

    def _trailer(self, item: memoryview) -> None:
        _, count, digest = TRAILER.unpack(item)
        total = len(self._parsed.chunks)
        if self._chunks_done < total:
            raise KVTruncatedError(f"chunk {self._chunks_done}", f"trailer after {self._chunks_done} of {total} chunks")
        if count != total:
            raise KVMalformedError("trailer", f"trailer counts {count} chunks, the header {total}")
        if digest != self._digest.digest():
            raise KVChecksumError("trailer", "SHA-256 of the stream does not match the trailer's")
        self._expect(_Stage.DONE, 0)

    def _cut_at(self) -> str:
        """What the stream was cut inside (or before): header, chunk i or trailer."""
        if self._stage in (_Stage.HEADER_PREFIX, _Stage.HEADER_BODY):
            return "header"
        if self._stage is _Stage.TRAILER or self._chunks_done == len(self._parsed.chunks):
            return "trailer"
        return f"chunk {self._chunks_done}"

    # Functions, not the instance's bound methods: a table of those would hold the reader (and its chunk buffers)
    # in a reference cycle, freed only when the cyclic garbage collector runs.
    _HANDLERS: ClassVar[dict[_Stage, Callable[[EDKVReader, memoryview], None]]] = {
        _Stage.HEADER_PREFIX: _header_prefix,
        _Stage.HEADER_BODY: _header_body,
        _Stage.CHUNK_PREFIX: _chunk_prefix,
        _Stage.CHUNK_BODY: _chunk_body,
        _Stage.TRAILER: _trailer,
    }


def decode_snapshot(
    payload: bytes, expected: KVContract, *, max_tokens: int = DECODE_SNAPSHOT_MAX_TOKENS
) -> KVSnapshot:
    """Decode a whole EDKV payload into a KVSnapshot of its kept tokens (float32, true positions); cells a
    window left out (EDKV 2.0) read as zeros."""
    buffers: list[np.ndarray] = []

    def compact(header: EDKVHeader) -> np.ndarray:
        c = header.contract
        buffers.append(np.zeros((c.n_layers, 2, c.n_kv_heads, header.n_kept, c.head_dim), np.float32))
        return buffers[0]

    reader = EDKVReader(expected, max_tokens=max_tokens, target_factory=compact)
    reader.feed(payload)
    header = reader.finish()
    return KVSnapshot(
        header.contract,
        header.token_ids[header.kept],
        header.positions[header.kept],
        buffers[0][:, 0],
        buffers[0][:, 1],
        header.producer,
    )
