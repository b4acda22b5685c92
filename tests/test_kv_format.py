"""EDKV container: round trips, compaction, streaming, and a typed error naming its field for every bad stream."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from edgedecode.kv.quant import QuantLayout
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import (
    EDKVHeader,
    EDKVReader,
    KVChecksumError,
    KVContractError,
    KVFormatError,
    KVMalformedError,
    KVTooLargeError,
    KVTruncatedError,
    KVVersionError,
    TransferRef,
    decode_snapshot,
    encode_payload,
)
from edgedecode.kv.wire.chunks import plan_chunk, section_arrays
from edgedecode.kv.wire.frames import (
    CHUNK_PREFIX,
    HEADER_CRC,
    HEADER_PREFIX,
    TRAILER,
    TRAILER_MAGIC,
)
from edgedecode.model.spec import KVContract, KVLayout

LAYERS, HEADS = 3, 2


def contract(head_dim: int = 16) -> KVContract:
    return KVContract("llama", LAYERS, HEADS, head_dim, 10000.0, KVLayout(), "tok-hash")


def small_layouts(head_dim: int) -> dict[Tier, tuple[QuantLayout, QuantLayout]]:
    """The default layouts' shapes, with groups that fit a small head_dim."""
    group = min(32, head_dim)
    return {
        Tier.INT8: (QuantLayout("token", head_dim, 8), QuantLayout("token", head_dim, 8)),
        Tier.INT4: (QuantLayout("channel", 4, 4), QuantLayout("token", group, 4)),
        Tier.INT2: (QuantLayout("channel", 4, 2), QuantLayout("token", group, 2)),
    }


def snapshot(n: int, head_dim: int = 16, seed: int = 0) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((LAYERS, HEADS, n, head_dim)).astype(np.float32)
    keys[..., 1] *= 10  # a key outlier channel
    values = rng.standard_normal((LAYERS, HEADS, n, head_dim)).astype(np.float32)
    positions = np.cumsum(rng.integers(1, 4, n)) + 5  # true positions need not start at 0 or be dense
    return KVSnapshot(
        contract(head_dim),
        rng.integers(0, 50000, n),
        positions,
        keys,
        values,
        KVProducer("test-model", "ab" * 32, "float32"),
    )


def encode(snap: KVSnapshot, tiers: np.ndarray, **kwargs) -> bytes:
    kwargs.setdefault("layouts", small_layouts(snap.contract.head_dim))
    return b"".join(encode_payload(snap, tiers, **kwargs))


def read(
    payload: bytes,
    expected: KVContract,
    n_slots: int,
    fill: float = np.nan,
    dtype=np.float32,
    slices: list[int] | None = None,
    **kwargs,
) -> tuple[EDKVReader, np.ndarray]:
    """Feed `payload` (whole, or cut at `slices`) into a reader whose destination is pre-filled with `fill`."""
    c = expected
    target = np.full((c.n_layers, 2, c.n_kv_heads, n_slots, c.head_dim), fill, dtype)
    kwargs.setdefault("max_tokens", 4096)
    reader = EDKVReader(expected, target_factory=lambda header: target, **kwargs)
    cuts = [0, *sorted(slices or []), len(payload)]
    for a, b in itertools.pairwise(cuts):
        reader.feed(payload[a:b])
    return reader, target


def split_frames(payload: bytes) -> tuple[bytes, list[bytes], bytes]:
    """(header frame, chunk frames, trailer) of a well-formed payload."""
    _, _, _, length = HEADER_PREFIX.unpack_from(payload)
    pos = HEADER_PREFIX.size + length + HEADER_CRC.size
    header, chunks = payload[:pos], []
    while payload[pos : pos + 4] != TRAILER_MAGIC:
        _, _, size, _ = CHUNK_PREFIX.unpack_from(payload, pos)
        chunks.append(payload[pos : pos + CHUNK_PREFIX.size + size])
        pos += CHUNK_PREFIX.size + size
    return header, chunks, payload[pos:]


def join_frames(header: bytes, chunks: list[bytes]) -> bytes:
    """Frames plus a trailer with the right count and digest (over the header and the chunk prefixes)."""
    sealed = header + b"".join(chunk[: CHUNK_PREFIX.size] for chunk in chunks)
    return header + b"".join(chunks) + TRAILER.pack(TRAILER_MAGIC, len(chunks), hashlib.sha256(sealed).digest())


def with_header(payload: bytes, body: bytes, major: int = 1, minor: int = 0) -> bytes:
    """The payload with header JSON `body`, every length, CRC and digest made consistent."""
    _, chunks, _ = split_frames(payload)
    frame = HEADER_PREFIX.pack(b"EDKV", major, minor, len(body)) + body + HEADER_CRC.pack(zlib.crc32(body))
    return join_frames(frame, chunks)


def rewrite_header(payload: bytes, change: Callable[[dict], None], major: int = 1, minor: int = 0) -> bytes:
    """The payload with its header JSON edited by `change` (see `with_header`)."""
    header, _, _ = split_frames(payload)
    doc = json.loads(header[HEADER_PREFIX.size : -HEADER_CRC.size])
    change(doc)
    return with_header(payload, json.dumps(doc).encode(), major, minor)


def streamed_frame(raw: bytes, window_log: int) -> bytes:
    """A zstd frame of `raw` that declares no content size and a window of 2**window_log bytes (what a streaming
    encoder that was not told the size writes)."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log, write_content_size=0)
    streaming = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return streaming.compress(raw) + streaming.flush()


def rechunk(frame: bytes, compressed: bytes) -> bytes:
    """A chunk frame carrying `compressed` with a matching length and CRC: damage only zstd can see."""
    _, index, _, _ = CHUNK_PREFIX.unpack_from(frame)
    return CHUNK_PREFIX.pack(b"EDKC", index, len(compressed), zlib.crc32(compressed)) + compressed


def stored_params(payload: bytes, header: EDKVHeader) -> tuple[np.ndarray, np.ndarray]:
    """Per-value scale and zero [layers, 2, H, n, D] as stored in the payload (NaN for FP16 and DROP cells)."""
    c = header.contract
    scale = np.full((c.n_layers, 2, c.n_kv_heads, header.n_tokens, c.head_dim), np.nan, np.float32)
    zero = scale.copy()
    for spec, frame in zip(header.chunks, split_frames(payload)[1]):
        raw = bytearray(zstandard.ZstdDecompressor().decompress(frame[CHUNK_PREFIX.size :]))
        rect = (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop)
        for section in plan_chunk(header.tiers, header.layouts, c.n_kv_heads, c.head_dim, rect).sections:
            layout = section.layout
            if layout is None:
                continue
            _, s, z = section_arrays(raw, section, c.n_kv_heads, c.head_dim)
            for params, out in ((s, scale), (z, zero)):
                p = per_value(params, layout, len(section.tokens))
                out[section.layer_start : section.layer_stop, section.kv][:, :, section.tokens] = p
    return scale, zero


def per_value(params: np.ndarray, layout: QuantLayout, m: int) -> np.ndarray:
    """A section's stored scales or zeros (shaped as ``quant.params_shape``) of m tokens, as float32 ``[..., m, D]``:
    the one that applies to each value."""
    p = params.astype(np.float32)
    if layout.axis == "token":
        return np.repeat(p, layout.group, -1)
    return p[..., np.arange(m) // min(layout.group, max(m, 1)), :]  # a group past m tokens is one group


@st.composite
def tier_maps(draw, n: int) -> np.ndarray:
    """[layers, n]: a per-token DROP shared by all layers; the other tiers may differ per layer."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    allowed = draw(st.lists(st.sampled_from([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2]), min_size=1, unique=True))
    tiers = rng.choice(np.array(allowed, np.uint8), (LAYERS, n))
    if draw(st.booleans()):
        tiers[:] = tiers[0]
    tiers[:, rng.random(n) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = Tier.DROP
    return tiers


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(0, 70), st.sampled_from([8, 16, 32, 64]), st.integers(1, 40), st.integers(1, 3))
def test_round_trip_is_exact_for_fp16_and_within_the_bound_for_quantized_tiers(
    data, n, head_dim, chunk_tokens, chunk_layers
) -> None:
    snap = snapshot(n, head_dim, seed=n)
    tiers = data.draw(tier_maps(n))
    payload = encode(snap, tiers, chunk_tokens=chunk_tokens, chunk_layers=chunk_layers)
    out = decode_snapshot(payload, snap.contract)
    kept = tiers[0] != Tier.DROP
    np.testing.assert_array_equal(out.positions, snap.positions[kept])
    np.testing.assert_array_equal(out.token_ids, snap.token_ids[kept])
    reader, _ = read(payload, snap.contract, int(kept.sum()))
    scale, zero = stored_params(payload, reader.finish())
    source = np.stack([snap.keys, snap.values], axis=1)[:, :, :, kept]  # [layers, 2, H, kept, D]
    decoded = np.stack([out.keys, out.values], axis=1)
    fp16 = np.broadcast_to((tiers[:, kept] == Tier.FP16)[:, None, None, :, None], source.shape)
    np.testing.assert_array_equal(decoded[fp16], source[fp16].astype(np.float16).astype(np.float32))
    s, z = scale[:, :, :, kept][~fp16], zero[:, :, :, kept][~fp16]
    x, x_hat = source[~fp16], decoded[~fp16]
    assert not np.isnan(s).any()
    assert (np.abs(x - x_hat) <= s / 2 + 2.0**-22 * (np.abs(x) + np.abs(z) + s)).all()


@settings(max_examples=25, deadline=None)
@given(st.data(), st.integers(1, 60))
def test_a_payload_fed_in_random_slices_decodes_identically_to_one_feed(data, n) -> None:
    snap = snapshot(n, 16, seed=n)
    tiers = data.draw(tier_maps(n))
    payload = encode(snap, tiers, chunk_tokens=data.draw(st.integers(1, 30)), chunk_layers=2)
    cuts = data.draw(st.lists(st.integers(0, len(payload)), max_size=40))
    whole_reader, whole = read(payload, snap.contract, n)
    sliced_reader, sliced = read(payload, snap.contract, n, slices=cuts)
    np.testing.assert_array_equal(sliced, whole)  # NaN-filled free slots compare equal too
    assert sliced_reader.finish().n_kept == whole_reader.finish().n_kept
    assert sliced_reader.progress == whole_reader.progress
    assert sliced_reader.progress.tokens_ingested == int((tiers[0] != Tier.DROP).sum())


def test_one_byte_at_a_time_works() -> None:
    snap = snapshot(20)
    payload = encode(snap, np.array([Tier.INT4] * 10 + [Tier.FP16, Tier.DROP] * 5, np.uint8), chunk_tokens=7)
    _, whole = read(payload, snap.contract, 20)
    reader, single = read(payload, snap.contract, 20, slices=list(range(1, len(payload))))
    reader.finish()
    np.testing.assert_array_equal(single, whole)


def test_dropped_tokens_are_compacted_and_free_slots_untouched() -> None:
    n = 40
    snap = snapshot(n)
    tiers = np.full(n, Tier.FP16, np.uint8)
    dropped = [0, 5, 6, 7, 20, 39]
    tiers[dropped] = Tier.DROP
    tiers[10:15] = Tier.INT8  # interleaved tiers: some kept slots are filled by a scatter
    payload = encode(snap, tiers, chunk_tokens=16)
    kept = np.setdiff1d(np.arange(n), dropped)
    reader, target = read(payload, snap.contract, n_slots=n + 3)
    header = reader.finish()
    assert header.n_kept == len(kept)
    fp16_kept = tiers[kept] == Tier.FP16
    expected = snap.keys[:, :, kept].astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(target[:, 0, :, : len(kept)][:, :, fp16_kept], expected[:, :, fp16_kept])
    assert np.isnan(target[:, :, :, len(kept) :]).all()
    assert not np.isnan(target[:, :, :, : len(kept)]).any()
    out = decode_snapshot(payload, snap.contract)
    np.testing.assert_array_equal(out.positions, snap.positions[kept])


def test_float16_destination_holds_fp16_tokens_bit_exactly() -> None:
    snap = snapshot(12)
    tiers = np.array([Tier.FP16, Tier.INT8] * 6, np.uint8)
    _, target = read(encode(snap, tiers), snap.contract, 12, dtype=np.float16)
    np.testing.assert_array_equal(target[:, 0][:, :, ::2], snap.keys[:, :, ::2].astype(np.float16))


def test_tiers_may_differ_per_layer() -> None:
    snap = snapshot(10)
    tiers = np.stack([np.full(10, Tier.FP16), np.full(10, Tier.INT4), np.full(10, Tier.INT2)]).astype(np.uint8)
    out = decode_snapshot(encode(snap, tiers), snap.contract)
    np.testing.assert_array_equal(out.keys[0], snap.keys[0].astype(np.float16).astype(np.float32))
    err = [np.abs(out.keys[layer] - snap.keys[layer]).mean() for layer in range(3)]
    assert err[0] < err[1] < err[2]


def test_parallel_encoding_writes_the_same_bytes() -> None:
    snap = snapshot(40)
    tiers = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.DROP] * 10, np.uint8)
    serial = encode(snap, tiers, chunk_tokens=7, chunk_layers=1)
    assert encode(snap, tiers, chunk_tokens=7, chunk_layers=1, workers=4) == serial
    with pytest.raises(ValueError, match="workers"):
        encode(snap, tiers, workers=0)


def test_progress_and_the_per_chunk_callback_follow_each_chunk() -> None:
    snap = snapshot(30)
    tiers = np.full(30, Tier.INT4, np.uint8)
    tiers[3] = Tier.DROP
    payload = encode(snap, tiers, chunk_tokens=10, chunk_layers=2)
    seen = []
    reader, _ = read(
        payload,
        snap.contract,
        30,
        on_chunk=lambda spec, slots: seen.append(
            (spec.index, spec.layer_start, spec.layer_stop, slots.start, slots.stop)
        ),
    )
    assert seen == [
        (0, 0, 2, 0, 9),
        (1, 0, 2, 9, 19),
        (2, 0, 2, 19, 29),
        (3, 2, 3, 0, 9),
        (4, 2, 3, 9, 19),
        (5, 2, 3, 19, 29),
    ]
    assert reader.progress.chunks_done == reader.progress.chunks_total == 6
    assert reader.progress.tokens_ingested == 29
    assert reader.progress.bytes_in == len(payload)


def test_meta_producer_and_layouts_travel_in_the_header() -> None:
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.INT4, np.uint8), meta={"policy": "sink+recent", "budget": 0.3})
    reader, _ = read(payload, snap.contract, 8)
    header = reader.finish()
    assert header.meta == {"policy": "sink+recent", "budget": 0.3}
    assert header.producer == snap.producer
    assert set(header.layouts) == {Tier.INT4}  # only the tiers actually used
    assert header.minor == 2 and header.transfer is None and header.importance is None


@pytest.mark.parametrize(
    "field, change",
    [
        ("n_layers", {"n_layers": LAYERS + 1}),
        ("n_kv_heads", {"n_kv_heads": HEADS + 1}),
        ("head_dim", {"head_dim": 32}),
        ("layout", {"layout": KVLayout(keys_post_rope=False)}),
        ("tokenizer_hash", {"tokenizer_hash": "other-tokenizer"}),
        ("architecture", {"architecture": "qwen2"}),
        ("rope_theta", {"rope_theta": 500000.0}),
        ("sliding_window", {"sliding_window": 512}),
        ("sliding_layers", {"sliding_layers": (0, 1)}),
        ("rope_local_theta", {"rope_local_theta": 10000.0}),
        ("rope_scaling", {"rope_scaling": "llama3:0123456789abcdef"}),
    ],
)
def test_a_contract_mismatch_names_the_field_and_nothing_is_allocated(field, change) -> None:
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.FP16, np.uint8))
    expected = dataclasses.replace(snap.contract, **change)
    reader = EDKVReader(expected, max_tokens=64, target_factory=lambda header: pytest.fail("no target may be made"))
    with pytest.raises(KVContractError) as err:
        reader.feed(payload)
    assert err.value.field == field and err.value.fields == (field,)
    assert field in str(err.value)


def test_a_windowed_contract_round_trips_and_an_older_header_reads_as_unwindowed() -> None:
    windowed = dataclasses.replace(
        snapshot(8).contract, sliding_window=512, sliding_layers=(0, 1), rope_local_theta=1e4, rope_scaling="none"
    )
    snap = dataclasses.replace(snapshot(8), contract=windowed)
    payload = encode(snap, np.full(8, Tier.FP16, np.uint8))
    reader, _ = read(payload, windowed, 8)
    assert reader.finish().contract == windowed
    fields = ("sliding_window", "sliding_layers", "rope_local_theta", "rope_scaling")
    older = rewrite_header(
        encode(snapshot(8), np.full(8, Tier.FP16, np.uint8)), lambda doc: [doc["contract"].pop(f) for f in fields]
    )
    assert read(older, snapshot(8).contract, 8)[0].finish().contract == snapshot(8).contract


def test_an_unknown_major_version_is_refused() -> None:
    snap = snapshot(8)
    payload = rewrite_header(encode(snap, np.full(8, Tier.INT8, np.uint8)), lambda doc: None, major=3)
    with pytest.raises(KVVersionError) as err:
        read(payload, snap.contract, 8)
    assert err.value.field == "version" and "3.0" in str(err.value)


def test_a_minor_bump_with_an_unknown_header_field_is_accepted() -> None:
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.INT8, np.uint8))
    bumped = rewrite_header(payload, lambda doc: doc.update(future_field={"x": [1, 2]}), minor=7)
    reader, target = read(bumped, snap.contract, 8)
    assert reader.finish().minor == 7
    np.testing.assert_array_equal(target, read(payload, snap.contract, 8)[1])


def test_a_transfer_reference_travels_in_the_header_and_a_1_0_reader_ignores_it() -> None:
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.INT8, np.uint8), transfer=TransferRef("t-1_A", 30.0))
    reader, target = read(payload, snap.contract, 8)
    assert reader.finish().transfer == TransferRef("t-1_A", 30.0)
    # the same bytes under a 1.0 prefix: the field is an unknown one, ignored (what a 1.0 reader does)
    as_1_0 = rewrite_header(payload, lambda doc: None, minor=0)
    np.testing.assert_array_equal(read(as_1_0, snap.contract, 8)[1], target)


@pytest.mark.parametrize(
    "transfer, field",
    [
        ({"id": "", "ttl_s": 1}, "transfer.id"),
        ({"id": "a/b", "ttl_s": 1}, "transfer.id"),
        ({"id": "x" * 65, "ttl_s": 1}, "transfer.id"),
        ({"id": "ok", "ttl_s": 0}, "transfer.ttl_s"),
        ({"id": "ok", "ttl_s": 1e9}, "transfer.ttl_s"),
        ({"id": "ok", "ttl_s": 10**400}, "transfer.ttl_s"),
        ({"id": "ok"}, "transfer.ttl_s"),
        ({"ttl_s": 5}, "transfer.id"),
        ([1], "transfer"),
    ],
)
def test_a_bad_transfer_reference_is_malformed(transfer, field) -> None:
    snap = snapshot(8)
    payload = rewrite_header(encode(snap, np.full(8, Tier.INT8, np.uint8)), lambda doc: doc.update(transfer=transfer))
    with pytest.raises(KVMalformedError) as err:
        read(payload, snap.contract, 8)
    assert err.value.field == field


def test_token_importance_travels_as_float16_with_nan_for_unknown_and_a_1_1_reader_ignores_it() -> None:
    snap = snapshot(8)
    importance = np.array([3.5, 0.0, np.nan, 1.25, 0.1, np.nan, 2.0, 1.0], np.float32)
    payload = encode(snap, np.full(8, Tier.INT8, np.uint8), importance=importance)
    reader, target = read(payload, snap.contract, 8)
    got = reader.finish().importance
    assert got is not None and got.dtype == np.float16
    np.testing.assert_array_equal(got, importance.astype(np.float16))  # NaN where NaN, the rest as float16
    as_1_1 = rewrite_header(payload, lambda doc: None, minor=1)  # a 1.1 reader: an unknown field, ignored
    np.testing.assert_array_equal(read(as_1_1, snap.contract, 8)[1], target)


@pytest.mark.parametrize(
    "values, reason",
    [
        (np.array([1, -0.5, 1, 1, 1, 1, 1, 1], "<f2"), "negative"),
        (np.array([1, np.inf, 1, 1, 1, 1, 1, 1], "<f2"), "infinite"),
        (np.ones(7, "<f2"), "one value short"),
        (np.ones(8, "<f4"), "float32, twice the bytes"),
    ],
)
def test_bad_token_importance_is_malformed(values: np.ndarray, reason: str) -> None:
    snap = snapshot(8)
    b64 = base64.b64encode(values.tobytes()).decode()
    payload = rewrite_header(encode(snap, np.full(8, Tier.INT8, np.uint8)), lambda doc: doc.update(importance=b64))
    with pytest.raises(KVMalformedError) as err:
        read(payload, snap.contract, 8)
    assert err.value.field == "importance", reason


def test_importance_a_float16_cannot_hold_is_refused_by_the_writer() -> None:
    snap = snapshot(8)
    with pytest.raises(KVMalformedError, match="importance"):
        encode(snap, np.full(8, Tier.INT8, np.uint8), importance=np.full(8, 1e6, np.float32))


def test_a_cut_stream_keeps_the_tokens_of_its_verified_chunks() -> None:
    snap = snapshot(40)
    tiers = np.full(40, Tier.INT4, np.uint8)
    tiers[[3, 11, 12]] = Tier.DROP
    payload = encode(snap, tiers, chunk_tokens=8)
    whole = read(payload, snap.contract, 40)[1]
    header_frame, chunks, _ = split_frames(payload)
    # two whole chunks and half of the third arrive, then the stream is cut
    reader, target = read(header_frame + b"".join(chunks[:2]) + chunks[2][:20], snap.contract, 40)
    assert reader.progress.tokens_verified == 16
    assert reader.cut() == 16
    slots = int(reader.header.slots_before[16])  # 13 kept tokens of the first 16
    assert slots == 13
    np.testing.assert_array_equal(target[:, :, :, :slots], whole[:, :, :, :slots])
    assert np.isnan(target[:, :, :, slots:]).all()  # nothing of the cut chunk was written
    with pytest.raises(KVFormatError):
        reader.feed(chunks[2][20:])  # a cut stream takes nothing more
    with pytest.raises(KVFormatError):
        reader.finish()


def test_a_cut_keeps_only_tokens_every_layer_of_which_arrived() -> None:
    snap = snapshot(24)
    payload = encode(snap, np.full(24, Tier.INT8, np.uint8), chunk_tokens=8, chunk_layers=2)  # layer groups outermost
    header_frame, chunks, _ = split_frames(payload)
    reader, _ = read(header_frame + b"".join(chunks[:4]), snap.contract, 24)  # layers 0-1 of all, layer 2 of 8
    assert reader.cut() == 8


def test_a_complete_stream_cut_keeps_every_token_and_a_failed_one_what_it_verified() -> None:
    snap = snapshot(24)
    payload = encode(snap, np.full(24, Tier.INT8, np.uint8), chunk_tokens=8)
    reader, _ = read(payload, snap.contract, 24)
    assert reader.cut() == 24 and reader.finish().n_tokens == 24
    header_frame, chunks, _ = split_frames(payload)
    broken = bytearray(chunks[1])
    broken[-1] ^= 0xFF
    reader = EDKVReader(
        snap.contract, max_tokens=64, target_factory=lambda h: np.zeros((LAYERS, 2, HEADS, 24, 16), np.float32)
    )
    with pytest.raises(KVChecksumError):
        reader.feed(header_frame + chunks[0] + bytes(broken))
    assert reader.cut() == 8


@pytest.mark.parametrize("k", [0, 2])
def test_a_flipped_byte_in_a_chunk_is_a_checksum_error_and_nothing_from_it_is_written(k) -> None:
    snap = snapshot(30)
    payload = encode(snap, np.full(30, Tier.INT4, np.uint8), chunk_tokens=10, chunk_layers=2)
    header, chunks, trailer = split_frames(payload)
    bad = bytearray(chunks[k])
    bad[len(bad) // 2] ^= 0x40
    chunks[k] = bytes(bad)
    with pytest.raises(KVChecksumError) as err:
        read(header + b"".join(chunks) + trailer, snap.contract, 30)
    assert err.value.field == f"chunk {k}"
    assert_written_only_before(payload, snap.contract, k, corrupt=header + b"".join(chunks) + trailer)


def assert_written_only_before(payload: bytes, expected: KVContract, k: int, corrupt: bytes) -> None:
    """Feeding `corrupt` (bad from chunk k on) leaves every slot region of chunks >= k NaN, earlier ones written."""
    first, _ = read(payload, expected, 30)  # a clean reader, for the chunk table
    header = first.finish()
    target = np.full((LAYERS, 2, HEADS, 30, expected.head_dim), np.nan, np.float32)
    reader = EDKVReader(expected, max_tokens=64, target_factory=lambda h: target)
    with pytest.raises(KVFormatError):
        reader.feed(corrupt)
    for spec in header.chunks:
        region = target[spec.layer_start : spec.layer_stop, :, :, header.slot_range(spec)]
        assert np.isnan(region).all() == (spec.index >= k), f"chunk {spec.index}"
    with pytest.raises(KVFormatError) as err:
        reader.feed(b"more")
    assert err.value.field == "stream"


def test_zstd_damage_behind_a_valid_crc_is_malformed_and_writes_nothing() -> None:
    snap = snapshot(30)
    payload = encode(snap, np.full(30, Tier.INT4, np.uint8), chunk_tokens=10, chunk_layers=2)
    header, chunks, _ = split_frames(payload)
    body = chunks[1][CHUNK_PREFIX.size :]
    for compressed in (
        body[: len(body) // 2],  # a cut zstd frame
        zstandard.ZstdCompressor().compress(b"\0" * 100),
    ):  # a frame of the wrong raw size
        corrupt = join_frames(header, [chunks[0], rechunk(chunks[1], compressed), *chunks[2:]])
        with pytest.raises(KVMalformedError) as err:
            read(corrupt, snap.contract, 30)
        assert err.value.field == "chunk 1"
        assert_written_only_before(payload, snap.contract, 1, corrupt)


def test_wrong_raw_size_without_a_declared_content_size_is_malformed() -> None:
    snap = snapshot(10)
    payload = encode(snap, np.full(10, Tier.INT8, np.uint8))
    header, chunks, _ = split_frames(payload)
    raw = zstandard.ZstdDecompressor().decompress(chunks[0][CHUNK_PREFIX.size :])
    for size in (len(raw) - 1, len(raw) + 1):
        data = (raw + b"\0")[:size]
        compressed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
        with pytest.raises(KVMalformedError, match="raw bytes") as err:
            read(join_frames(header, [rechunk(chunks[0], compressed)]), snap.contract, 10)
        assert err.value.field == "chunk 0"


@pytest.mark.parametrize(
    "cut, field",
    [
        (lambda p, h, c: p[: len(h) - 3], "header"),
        (lambda p, h, c: p[: len(h) + len(c[0]) + len(c[1]) // 2], "chunk 1"),
        (lambda p, h, c: p[: len(h) + len(c[0])], "chunk 1"),
        (lambda p, h, c: p[: -TRAILER.size], "trailer"),
        (lambda p, h, c: p[:-5], "trailer"),
    ],
)
def test_a_cut_stream_is_a_truncated_error_naming_what_was_cut(cut, field) -> None:
    snap = snapshot(20)
    payload = encode(snap, np.full(20, Tier.INT4, np.uint8), chunk_tokens=8)
    header, chunks, _ = split_frames(payload)
    reader, _ = read(cut(payload, header, chunks), snap.contract, 20)
    with pytest.raises(KVTruncatedError) as err:
        reader.finish()
    assert err.value.field == field


def test_a_trailer_before_the_last_chunk_is_truncation() -> None:
    snap = snapshot(20)
    header, chunks, _ = split_frames(encode(snap, np.full(20, Tier.INT4, np.uint8), chunk_tokens=8))
    with pytest.raises(KVTruncatedError) as err:
        read(join_frames(header, chunks[:2]), snap.contract, 20)
    assert err.value.field == "chunk 2"


def test_a_bad_trailer_digest_is_a_checksum_error() -> None:
    snap = snapshot(8)
    payload = bytearray(encode(snap, np.full(8, Tier.FP16, np.uint8)))
    payload[-1] ^= 1
    with pytest.raises(KVChecksumError) as err:
        read(bytes(payload), snap.contract, 8)
    assert err.value.field == "trailer"


def test_a_bad_header_crc_is_a_checksum_error() -> None:
    snap = snapshot(8)
    payload = bytearray(encode(snap, np.full(8, Tier.FP16, np.uint8)))
    payload[HEADER_PREFIX.size + 5] ^= 1
    with pytest.raises(KVChecksumError) as err:
        read(bytes(payload), snap.contract, 8)
    assert err.value.field == "header"


def test_limits_are_too_large_errors() -> None:
    snap = snapshot(50)
    payload = encode(snap, np.full(50, Tier.FP16, np.uint8), chunk_tokens=25)
    with pytest.raises(KVTooLargeError) as err:
        read(payload, snap.contract, 50, max_header_bytes=100)
    assert err.value.field == "header"
    with pytest.raises(KVTooLargeError) as err:
        read(payload, snap.contract, 50, max_tokens=49)
    assert err.value.field == "n_tokens"
    with pytest.raises(KVTooLargeError) as err:
        read(payload, snap.contract, 50, max_chunk_bytes=1000)
    assert err.value.field == "chunk 0"


def test_a_destination_too_small_or_with_strided_rows_is_refused() -> None:
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.FP16, np.uint8))
    with pytest.raises(ValueError, match=r">= 8"):
        read(payload, snap.contract, n_slots=7)
    strided = np.zeros((LAYERS, 2, HEADS, 8, 32), np.float32)[..., ::2]
    with pytest.raises(ValueError, match="contiguous head_dim rows"):
        EDKVReader(snap.contract, max_tokens=8, target_factory=lambda header: strided).feed(payload)


def test_overlapping_chunks_are_malformed() -> None:
    snap = snapshot(12)
    payload = encode(snap, np.full(12, Tier.INT4, np.uint8), chunk_tokens=4)
    bad = rewrite_header(payload, lambda doc: doc["chunks"][1].__setitem__(2, 3))
    with pytest.raises(KVMalformedError, match="overlaps") as err:
        read(bad, snap.contract, 12)
    assert err.value.field == "chunks"


def test_malformed_streams_name_the_field() -> None:
    snap = snapshot(12)
    payload = encode(snap, np.full(12, Tier.INT4, np.uint8), chunk_tokens=4)
    cases = {
        "magic": b"EDKX" + payload[4:],
        "chunks": rewrite_header(payload, lambda doc: doc["chunks"].pop()),
        "n_tokens": rewrite_header(payload, lambda doc: doc.update(n_tokens=-1)),
        "tiers": rewrite_header(payload, lambda doc: doc.update(tiers="AAAA")),
        "token_ids": rewrite_header(payload, lambda doc: doc.update(token_ids="not base64!")),
        "positions": rewrite_header(payload, lambda doc: doc.update(positions=doc["token_ids"])),
        "layouts": rewrite_header(payload, lambda doc: doc.update(layouts={})),
        "header": with_header(payload, b"[]"),
        "contract": with_header(payload, b'{"n_tokens": 12}'),
        "contract.n_layers": rewrite_header(payload, lambda doc: doc["contract"].update(n_layers="3")),
        "contract.sliding_window": rewrite_header(payload, lambda doc: doc["contract"].update(sliding_window=0)),
        "contract.sliding_layers": rewrite_header(payload, lambda doc: doc["contract"].update(sliding_layers=[3])),
        "contract.rope_local_theta": rewrite_header(
            payload, lambda doc: doc["contract"].update(rope_local_theta="1e4")
        ),
        "trailer": payload + b"\0",
    }
    for field, bad in cases.items():
        with pytest.raises(KVMalformedError) as err:
            read(bad, snap.contract, 12)
        assert err.value.field == field, (field, str(err.value))


def test_a_raw_size_that_disagrees_with_the_tier_map_is_malformed() -> None:
    snap = snapshot(12)
    payload = encode(snap, np.full(12, Tier.INT4, np.uint8), chunk_tokens=4)
    bad = rewrite_header(payload, lambda doc: doc["chunks"][1].__setitem__(4, doc["chunks"][1][4] + 2))
    with pytest.raises(KVMalformedError, match="chunk 1 declares") as err:
        read(bad, snap.contract, 12)
    assert err.value.field == "chunks"


def test_the_writer_refuses_bad_input() -> None:
    snap = snapshot(6)
    tiers = np.full((LAYERS, 6), Tier.INT4, np.uint8)
    tiers[1, 2] = Tier.DROP
    with pytest.raises(KVMalformedError, match="token 2 is DROP in some layers only") as err:
        encode(snap, tiers)
    assert err.value.field == "tiers"
    with pytest.raises(KVMalformedError) as err:
        encode(snap, np.full(6, 9, np.uint8))
    assert err.value.field == "tiers"
    unordered = dataclasses.replace(snap, positions=np.array([0, 1, 2, 2, 3, 4]))
    with pytest.raises(KVMalformedError) as err:
        encode(unordered, np.full(6, Tier.FP16, np.uint8))
    assert err.value.field == "positions"
    with pytest.raises(KVMalformedError) as err:
        encode(dataclasses.replace(snap, keys=snap.keys[:, :, :5]), np.full(6, Tier.FP16, np.uint8))
    assert err.value.field == "keys"
    with pytest.raises(KVMalformedError) as err:
        encode(snap, np.full(6, Tier.INT8, np.uint8), layouts={Tier.INT8: (QuantLayout("token", 16, 4),) * 2})
    assert err.value.field == "layouts.int8.keys"
    with pytest.raises(KVMalformedError, match="INT2 is used in the tier map but has no layout") as err:
        encode(snap, np.full(6, Tier.INT2, np.uint8), layouts={})
    assert err.value.field == "layouts"
    with pytest.raises(KVMalformedError) as err:
        encode(dataclasses.replace(snap, positions=snap.positions[:5]), np.full(6, Tier.FP16, np.uint8))
    assert err.value.field == "positions"
    with pytest.raises(KVMalformedError) as err:
        encode(snap, np.full(6, Tier.FP16, np.uint8), meta={"budget": np.float32(0.3)})
    assert err.value.field == "meta"
    big = dataclasses.replace(snap, keys=np.full_like(snap.keys, 1e6))
    with pytest.raises(ValueError, match="float16"):
        encode(big, np.full(6, Tier.FP16, np.uint8))
