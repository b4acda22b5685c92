"""EDKV writer: a KVSnapshot and its tier map -> header frame, chunk frames, trailer, ready to stream."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import numpy as np
import zstandard

from edgedecode.kv.quant import DEFAULT_LAYOUTS, QuantLayout, quantize
from edgedecode.kv.rotation import Rotation, hadamard_signs, rotate
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import QUANTIZED_TIERS, Tier
from edgedecode.kv.wire.chunks import ChunkPlan, chunk_rects, plan_chunk, section_arrays
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
) -> Iterator[bytes]:
    """Encode `snapshot` as an EDKV stream: 1.2, or 2.0 where `window_start` cuts the windowed layers; 1.3 (2.1)
    where INT3 or a rotation is used, which only a reader of 1.3 (2.1) reads right.

    Args:
        snapshot: the KV to send; keys/values ``[layers, kv_heads, n, head_dim]`` (float16 or float32).
        tiers: ``uint8 [n]`` (every layer alike) or ``[layers, n]`` Tier codes; a DROP must hold in all layers.
        layouts: (keys, values) quant layout per quantized tier; only the tiers used are written.
        chunk_tokens, chunk_layers: chunk size (chunk_layers None: all layers in every chunk). The reader's limits
            (docs/kv-format.md §7) bound the chunks and sections: chunk_tokens >= frames.MIN_CHUNK_TOKENS always
            fits; a finer chunking that does not is a ValueError.
        level: zstd level.
        meta: free-form JSON object stored in the header (policy name, budget, ...).
        workers: threads that quantize and compress chunks at once (numpy and zstd release the GIL);
            the frames come out in order either way, byte for byte the same.
        transfer: where the sender keeps this prefill for a resume (EDKV 1.1 header field).
        importance: float [n], each token's relative importance to the sender (>= 0; NaN where none is known),
            written as float16 (EDKV 1.2 header field): what a receiver ranks tokens by when it must drop some later.
        window_start: the contract's windowed (sliding-window) layers carry the tokens from this index on only
            (EDKV 2.0 ``window``; ``kv.window`` says which tokens a receiver needs); None: every cell is sent.
        rotation: rotate the K and V of these tiers before quantizing (EDKV 1.3 ``rotation``, ``kv.rotation``);
            written only when the tier map uses one of them. A head_dim its blocks do not tile is a ValueError.

    Returns:
        An iterator of frames: the header frame, one frame per chunk, then the trailer. The header is built and
        validated here (KVMalformedError on a bad tier map or snapshot); chunks are encoded as they are pulled
        (ValueError on values a quantizer cannot represent).
    """
    window = None if window_start is None else WindowCut(snapshot.contract.sliding_layers, window_start)
    header, plans = _build_header(snapshot, tiers, layouts, chunk_tokens, chunk_layers, level, meta, window, rotation)
    if transfer is not None or importance is not None:
        given = None if importance is None else np.asarray(importance, np.float32).astype(np.float16)
        header = dataclasses.replace(header, transfer=transfer, importance=given)
    try:
        body = header.to_json()
    except TypeError as e:  # every other field is built here from numbers and strings
        raise KVMalformedError("meta", f"meta must be JSON-serialisable: {e}") from None
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return _frames(snapshot, body, plans, level, workers, (header.major, header.minor), header.rotation)


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
    plans = [plan_chunk(carried_cells(tiers, window), used, c.n_kv_heads, c.head_dim, rect) for rect in rects]
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
    )
    return header, plans


def _frames(
    snapshot: KVSnapshot,
    body: bytes,
    plans: list[ChunkPlan],
    level: int,
    workers: int,
    version: tuple[int, int],
    rotation: Rotation | None,
) -> Iterator[bytes]:
    digest = hashlib.sha256()
    frame = HEADER_PREFIX.pack(HEADER_MAGIC, *version, len(body)) + body + HEADER_CRC.pack(zlib.crc32(body))
    digest.update(frame)
    yield frame
    compressors = threading.local()  # a ZstdCompressor is not shared between threads

    def encode(plan: ChunkPlan) -> bytes:
        if not hasattr(compressors, "zstd"):
            compressors.zstd = zstandard.ZstdCompressor(level=level)
        return compressors.zstd.compress(_raw_chunk(snapshot, plan, rotation))

    with ThreadPoolExecutor(workers, thread_name_prefix="edkv-encode") if workers > 1 else nullcontext() as pool:
        for index, compressed in enumerate(pool.map(encode, plans) if pool else map(encode, plans)):
            prefix = CHUNK_PREFIX.pack(CHUNK_MAGIC, index, len(compressed), zlib.crc32(compressed))
            digest.update(prefix)  # the body is covered by the CRC-32 inside the prefix
            yield prefix + compressed
    yield TRAILER.pack(TRAILER_MAGIC, len(plans), digest.digest())


def _raw_chunk(snapshot: KVSnapshot, plan: ChunkPlan, rotation: Rotation | None) -> bytearray:
    """The chunk's bytes before zstd: every section quantized (rotated first where `rotation` says so, or cast to
    float16) into its place."""
    raw = bytearray(plan.raw_nbytes)
    c = snapshot.contract
    for section in plan.sections:
        source = (snapshot.keys, snapshot.values)[section.kv][section.layer_start : section.layer_stop]
        rows = source[:, :, section.tokens, :]  # [layers, H, m, D]
        if rotation is not None and rotation.rotates(section.tier):
            signs = hadamard_signs(rotation.seed, c.n_layers, c.n_kv_heads, c.head_dim)
            rows = _rotated(rows, signs[section.layer_start : section.layer_stop, section.kv], rotation.block)
        arrays = section_arrays(raw, section, c.n_kv_heads, c.head_dim)
        if section.layout is None:
            with np.errstate(over="ignore"):  # refused just below, with the layers named
                arrays[0][...] = rows
            if not np.isfinite(arrays[0]).all():
                raise ValueError(
                    f"FP16 {('keys', 'values')[section.kv]} of layers [{section.layer_start}, "
                    f"{section.layer_stop}) hold values that are not finite in float16"
                )
            continue
        for array, part in zip(arrays, quantize(rows, section.layout)):
            array[...] = part
    return raw


def _rotated(rows: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """`rotate`, refusing non-finite rows first (a rotation would spread one inf or NaN over its whole row)."""
    if not np.isfinite(rows).all():
        raise ValueError("cannot quantize non-finite KV values (inf or NaN)")
    return rotate(rows.astype(np.float32, copy=False), signs, block)
