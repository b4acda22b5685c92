"""EDKV writer: a KVSnapshot and its tier map -> header frame, chunk frames, trailer, ready to stream."""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain, islice
from typing import Any

import numpy as np
import zstandard

from edgedecode.kv.quant import DEFAULT_LAYOUTS, QuantLayout
from edgedecode.kv.rotation import Rotation
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.stage_clock import UNCLOCKED, StageClock
from edgedecode.kv.tiers import QUANTIZED_TIERS, Tier
from edgedecode.kv.wire.chunks import ChunkPlan, chunk_rects, plan_chunk
from edgedecode.kv.wire.coder import SectionCoder
from edgedecode.kv.wire.errors import KVMalformedError
from edgedecode.kv.wire.frames import (
    CHUNK_MAGIC,
    CHUNK_PREFIX,
    HEADER_CRC,
    HEADER_MAGIC,
    HEADER_PREFIX,
    LOWBIT_MINOR,
    MAJOR,
    MINOR,
    TRAILER,
    TRAILER_MAGIC,
    WINDOW_MAJOR,
    WINDOW_MINOR,
    max_chunks,
    max_sections,
)
from edgedecode.kv.wire.header import (
    ChunkSpec,
    EDKVHeader,
    TransferRef,
    WindowCut,
    carried_cells,
    check_layouts,
    check_meta,
    check_tier_map,
)

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_ZSTD_LEVEL = 3
# zstd level 1 compresses real FP16, INT4 and INT2 chunks to within 0.6 % of level 3's size at 0.6-0.7 of its CPU
# time; INT8 codes gain 1.9 % from level 3 (docs/performance.md, "The prefill node's own time"). The prefill server
# takes it for every chunk (prefill.pipeline.SERVED_ZSTD_LEVEL)
FAST_ZSTD_LEVEL = 1


def encode_payload(
    snapshot: KVSnapshot,
    tiers: np.ndarray,
    *,
    layouts: dict[Tier, tuple[QuantLayout, QuantLayout]] = DEFAULT_LAYOUTS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    chunk_layers: int | None = None,
    level: int = DEFAULT_ZSTD_LEVEL,
    meta: dict[str, Any] | None = None,
    workers: int = 1,
    transfer: TransferRef | None = None,
    importance: np.ndarray | None = None,
    window_start: int | None = None,
    rotation: Rotation | None = None,
    coder: SectionCoder | None = None,
    clock: StageClock = UNCLOCKED,
    fast_level: int | None = None,
) -> PlannedPayload:
    """Encode `snapshot` as an EDKV stream: 1.2, or 2.0 where `window_start` cuts the windowed layers; 1.3 (2.1)
    where INT3 or a rotation is used, which only a reader of 1.3 (2.1) reads right.

    Args:
        snapshot: the KV to send; keys/values ``[layers, kv_heads, n, head_dim]`` (float16 or float32).
        tiers: ``uint8 [n]`` (every layer alike) or ``[layers, n]`` Tier codes; a DROP must hold in all layers.
        layouts: (keys, values) quant layout per quantized tier; only the tiers used are written.
        chunk_tokens, chunk_layers: chunk size (chunk_layers None: all layers in every chunk). The reader's limits
            (docs/kv-format.md §7) bound the chunks and sections: chunk_tokens >= frames.MIN_CHUNK_TOKENS always
            fits; a finer chunking that does not is a ValueError.
        level: zstd level (the header's ``zstd_level``).
        meta: free-form JSON object stored in the header (policy name, budget, ...).
        workers: threads that quantize and compress chunks at once (numpy and zstd release the GIL);
            the frames come out in order either way, byte for byte the same, each as soon as it and the ones
            before it are ready: at most ``workers + 1`` waves of chunks are in work ahead of the one consumed.
        transfer: where the sender keeps this prefill for a resume (EDKV 1.1 header field).
        importance: float [n], each token's relative importance to the sender (>= 0; NaN where none is known),
            written as float16 (EDKV 1.2 header field): what a receiver ranks tokens by when it must drop some later.
        window_start: the contract's windowed (sliding-window) layers carry the tokens from this index on only
            (EDKV 2.0 ``window``; ``kv.window`` says which tokens a receiver needs); None: every cell is sent.
        rotation: rotate the K and V of these tiers before quantizing (EDKV 1.3 ``rotation``, ``kv.rotation``);
            written only when the tier map uses one of them. A head_dim its blocks do not tile is a ValueError.
        coder: what computes the sections (``wire.coder``): the reference ``SectionCoder`` by default; a
            ``CachingCoder`` of this snapshot, reused across payloads, computes each chunk's bytes once. It must
            have been made for ``rotation``.
        clock: records CPU and wall time of the stages header (once a payload), quantize, assemble, compress and
            frame (``kv.stage_clock``).
        fast_level: zstd level of the chunks that hold no 8-bit codes (FP16 and sections of 4 bits or fewer),
            which gain little from a higher level; None: ``level``. Each chunk is its own zstd frame: a reader
            takes any level.

    Returns:
        The payload, planned: iterating it yields its frames — the header frame, one frame per chunk, then the
        trailer — each chunk encoded as it is pulled (ValueError on values a quantizer cannot represent; each
        iteration encodes anew, a keeping coder reusing what it kept); ``predicted_bytes`` predicts their size from a
        sample. The header is built and validated here (KVMalformedError on a bad tier map or snapshot).
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    window = None if window_start is None else WindowCut(snapshot.contract.sliding_layers, window_start)
    with clock.stage("header"):
        given = None if importance is None else np.asarray(importance, np.float32).astype(np.float16)
        header, plans = _build_header(
            snapshot, tiers, layouts, chunk_tokens, chunk_layers, level, meta, window, rotation, transfer, given
        )
        try:
            body = header.to_json()
        except TypeError as e:  # every other field is built here from numbers and strings
            raise KVMalformedError("meta", f"meta must be JSON-serialisable: {e}") from None
    if coder is not None and coder.snapshot is not snapshot:
        raise ValueError("the coder was made for another snapshot")
    if coder is not None and coder.rotation != rotation:
        raise ValueError(f"the coder was made for rotation {coder.rotation}, not {rotation}")
    cells = carried_cells(header.tiers, window)
    levels = [level if fast_level is None else chunk_level(plan, level, fast_level) for plan in plans]
    # a chunk's bytes follow from its rectangle's tier rows, the layouts, the rotation and the level (and the
    # snapshot: the coder's)
    layouts_given = tuple(layouts.items())
    keys = [
        (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop, chunk, layouts_given, rotation,
         cells[spec.layer_start : spec.layer_stop, spec.token_start : spec.token_stop].tobytes())
        for spec, chunk in zip(header.chunks, levels)
    ]  # fmt: skip
    version = (header.major, header.minor)
    chunks = _ChunkEncoder(plans, keys, levels, coder or SectionCoder(snapshot, rotation), clock)
    return PlannedPayload(body, version, chunks, workers)


def chunk_level(plan: ChunkPlan, level: int, fast_level: int) -> int:
    """``level`` for a chunk with a section of 8-bit codes, else ``fast_level``."""
    return level if any(s.layout is not None and s.layout.bits == 8 for s in plan.sections) else fast_level


def _build_header(
    snapshot: KVSnapshot,
    tiers: np.ndarray,
    layouts: dict[Tier, tuple[QuantLayout, QuantLayout]],
    chunk_tokens: int,
    chunk_layers: int | None,
    level: int,
    meta: dict[str, Any] | None,
    window: WindowCut | None,
    rotation: Rotation | None,
    transfer: TransferRef | None,
    importance: np.ndarray | None,
) -> tuple[EDKVHeader, list[ChunkPlan]]:
    c, n = snapshot.contract, snapshot.n_tokens
    shape = (c.n_layers, c.n_kv_heads, n, c.head_dim)
    for name, array in (("keys", snapshot.keys), ("values", snapshot.values)):
        if array.shape != shape or array.dtype not in (np.float16, np.float32):
            raise KVMalformedError(
                name, f"expected float16/float32 {list(shape)} for the contract, got {array.dtype} {list(array.shape)}"
            )
    tiers = np.asarray(tiers)
    if tiers.shape not in ((n,), (c.n_layers, n)) or tiers.dtype.kind not in "ui":
        raise KVMalformedError(
            "tiers", f"tier map must be uint8 [{n}] or [{c.n_layers}, {n}], got {tiers.dtype} {list(tiers.shape)}"
        )
    tiers = np.ascontiguousarray(np.broadcast_to(tiers.astype(np.uint8), (c.n_layers, n)))
    check_tier_map(tiers, c.n_layers, n)
    check_layouts(tiers, layouts, c.head_dim)
    chunk_layers = c.n_layers if chunk_layers is None else chunk_layers
    if chunk_tokens < 1 or chunk_layers < 1:
        raise ValueError(f"chunk_tokens and chunk_layers must be positive, got {chunk_tokens}, {chunk_layers}")
    if meta is not None:
        check_meta(meta)
    used = {tier: layouts[tier] for tier in QUANTIZED_TIERS if (tiers == tier).any()}
    if rotation is not None and not set(rotation.tiers) & set(used):
        rotation = None  # nothing it would rotate: the stream stays readable by older readers
    if rotation is not None:
        rotation.check_head_dim(c.head_dim)
    major = MAJOR if window is None else WINDOW_MAJOR
    minor = MINOR if window is None else WINDOW_MINOR
    if rotation is not None or Tier.INT3 in used:
        minor = LOWBIT_MINOR[major]
    count = -(-c.n_layers // chunk_layers) * -(-n // chunk_tokens)
    if count > max_chunks(n, c.n_layers):
        raise ValueError(
            f"chunk_tokens {chunk_tokens} and chunk_layers {chunk_layers} make {count} chunks, more "
            f"than a reader accepts for {n} tokens × {c.n_layers} layers "
            f"({max_chunks(n, c.n_layers)}); use larger chunks"
        )
    rects = chunk_rects(c.n_layers, n, chunk_layers, chunk_tokens)
    cells = carried_cells(tiers, window)
    plans = [plan_chunk(cells, used, c.n_kv_heads, c.head_dim, rect) for rect in rects]
    sections = sum(len(plan.sections) for plan in plans)
    if sections > max_sections(n, c.n_layers):
        raise ValueError(
            f"chunk_tokens {chunk_tokens} and chunk_layers {chunk_layers} make {sections} sections "
            f"with this tier map, more than a reader accepts ({max_sections(n, c.n_layers)}); "
            "use larger chunks"
        )
    header = EDKVHeader(
        contract=c,
        producer=snapshot.producer,
        token_ids=np.asarray(snapshot.token_ids, np.int64),
        positions=np.asarray(snapshot.positions, np.int64),
        tiers=tiers,
        layouts=used,
        chunks=tuple(ChunkSpec(i, *rect, plan.raw_nbytes) for i, (rect, plan) in enumerate(zip(rects, plans))),
        zstd_level=level,
        meta={} if meta is None else meta,
        window=window,
        major=major,
        minor=minor,
        rotation=rotation,
        transfer=transfer,
        importance=importance,
    )  # validated once, here
    return header, plans


class _ChunkEncoder:
    """A payload's chunks compressed, each with its CRC-32: kept from an earlier payload of the snapshot (the
    coder's), or made now. Threads may encode distinct chunks at once (each has its own compressors and buffer)."""

    def __init__(
        self, plans: list[ChunkPlan], keys: list[tuple], levels: list[int], coder: SectionCoder, clock: StageClock
    ) -> None:
        self.plans, self.keys, self.levels, self.coder, self.clock = plans, keys, levels, coder, clock
        self._compressors = threading.local()  # a ZstdCompressor is not shared between threads
        self._scratch = (
            threading.local()
        )  # each thread's raw chunk, reused: a new one a chunk cost as much as quantizing

    def prepare(self, chunks: Sequence[int]) -> None:
        """Compute the sections of ``chunks`` not kept from an earlier payload (a device coder: in one run)."""
        missing = [i for i in chunks if self.coder.compressed(self.keys[i]) is None]
        with self.clock.stage("quantize"):
            self.coder.prepare([self.plans[i] for i in missing])

    def encoded(self, i: int, ready: Future | None = None) -> tuple[bytes, int]:
        """Chunk ``i`` compressed, and its CRC-32 (once its sections are ``ready``: a chunk waits only for its own
        wave's)."""
        if ready is not None:
            ready.result()
        coder, clock = self.coder, self.clock
        body = coder.compressed(self.keys[i])
        if body is None:
            raw = self._raw(self.plans[i].raw_nbytes)
            with clock.stage(coder.fill_stage):
                coder.fill(raw, self.plans[i])
            with clock.stage("compress"):
                compressed = self._compressor(self.levels[i]).compress(raw)
            with clock.stage("frame"):
                body = (compressed, coder.crc32(compressed))
            coder.keep(self.keys[i], body)
        return body

    def _compressor(self, level: int) -> zstandard.ZstdCompressor:
        """This thread's compressor at ``level``."""
        if not hasattr(self._compressors, "zstd"):
            self._compressors.zstd = {}
        if level not in self._compressors.zstd:
            self._compressors.zstd[level] = zstandard.ZstdCompressor(level=level)
        return self._compressors.zstd[level]

    def _raw(self, nbytes: int) -> memoryview:
        """This thread's buffer for a chunk's bytes before zstd (left as the last chunk wrote it: ``fill`` writes
        every byte, the sections tile the chunk)."""
        buffer = getattr(self._scratch, "raw", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = self._scratch.raw = bytearray(nbytes)
        return memoryview(buffer)[:nbytes]


class PlannedPayload:
    """A payload whose header is built and chunks planned (``encode_payload``): iterated, its frames; or a
    prediction of their size from a sample of its chunks."""

    def __init__(self, body: bytes, version: tuple[int, int], chunks: _ChunkEncoder, workers: int) -> None:
        self.body = body  # the header's JSON
        self.version = version
        self.chunks = chunks
        self.workers = workers  # threads that encode chunks at once

    def __iter__(self) -> Iterator[bytes]:
        """The header frame, then each chunk's frame in order as soon as it is ready, then the trailer."""
        chunks, clock, workers = self.chunks, self.chunks.clock, self.workers
        with clock.stage("header"):
            digest = hashlib.sha256()
            body = self.body
            frame = (
                HEADER_PREFIX.pack(HEADER_MAGIC, *self.version, len(body)) + body + HEADER_CRC.pack(zlib.crc32(body))
            )
            digest.update(frame)
        yield frame
        chunks.coder.begin_payload()
        for index, (compressed, crc) in enumerate(chain.from_iterable(self._waves(workers))):
            with clock.stage("frame"):
                prefix = CHUNK_PREFIX.pack(CHUNK_MAGIC, index, len(compressed), crc)
                digest.update(prefix)  # the body is covered by the CRC-32 inside the prefix
                frame = prefix + compressed
            yield frame
        yield TRAILER.pack(TRAILER_MAGIC, len(chunks.plans), digest.digest())

    def predicted_bytes(self, sample_every: int) -> int:
        """The payload's size predicted from a sample of its chunks compressed — one in ``sample_every``, at least
        two, each in the middle of an equal run of chunks: the others compress as well, byte for byte of their raw
        size. A keeping coder keeps the sampled chunks for the payload that follows. ``clock`` times it as the
        stage "sample", which holds the sampled chunks' own stages (quantize, compress, frame)."""
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        chunks = self.chunks
        count = len(chunks.plans)
        picked = min(count, max(2, count // sample_every))
        sample = [(2 * j + 1) * count // (2 * picked) for j in range(picked)]
        with chunks.clock.stage("sample"):  # the sampled chunks' stages are clocked in it too
            chunks.coder.begin_payload()
            chunks.prepare(sample)
            raw = sum(chunks.plans[i].raw_nbytes for i in sample)
            compressed = sum(len(chunks.encoded(i)[0]) for i in sample)
        ratio = compressed / raw if raw else 1.0
        body = sum(plan.raw_nbytes for plan in chunks.plans) * ratio
        framing = HEADER_PREFIX.size + len(self.body) + HEADER_CRC.size + count * CHUNK_PREFIX.size + TRAILER.size
        return framing + round(body)

    def _waves(self, workers: int) -> Iterator[list[tuple[bytes, int]]]:
        """The chunks encoded, a wave (the chunks the coder prepares at once) at a time, in order."""
        chunks = self.chunks
        count = len(chunks.plans)
        step = max(chunks.coder.wave_chunks, 1)
        waves = [range(start, min(start + step, count)) for start in range(0, count, step)]
        if workers == 1:
            for wave in waves:
                chunks.prepare(wave)
                yield [chunks.encoded(i) for i in wave]
            return
        # A wave's sections are prepared by one task, its chunks compressed by one task each, so a wave of many
        # chunks (a device coder's) still spreads over the workers. Each task is queued after the preparation it
        # waits for, so a waiting chunk's preparation is already running or done.
        with ThreadPoolExecutor(workers, thread_name_prefix="edkv-encode") as pool:

            def submit(wave: range) -> list[Future]:
                ready = pool.submit(chunks.prepare, wave)
                return [pool.submit(chunks.encoded, i, ready) for i in wave]

            ahead = iter(waves)
            pending = deque(submit(wave) for wave in islice(ahead, workers + 1))
            while pending:
                wave_chunks = pending.popleft()
                bodies = [chunk.result() for chunk in wave_chunks]
                pending.extend(submit(wave) for wave in islice(ahead, 1))
                yield bodies
