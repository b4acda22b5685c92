"""EDKV from a hostile peer: every stream that checksums correctly but should not be accepted ends in a typed
KVFormatError, fast, and writes nothing of a refused chunk (docs/kv-format.md §5, §7)."""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import weakref

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kv_format import (
    HEADS,
    LAYERS,
    contract,
    encode,
    join_frames,
    read,
    rechunk,
    rewrite_header,
    snapshot,
    split_frames,
    streamed_frame,
    with_header,
)

from edgedecode.kv.quant import DEFAULT_LAYOUTS, QuantLayout
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import (
    EDKVReader,
    KVFormatError,
    KVMalformedError,
    KVTooLargeError,
    KVValueError,
)
from edgedecode.kv.wire import header as header_module
from edgedecode.kv.wire import reader as reader_module
from edgedecode.kv.wire.chunks import chunk_sizes, plan_chunk, section_arrays
from edgedecode.kv.wire.frames import (
    CHUNK_PREFIX,
    HEADER_CRC,
    HEADER_PREFIX,
    MAX_META_DEPTH,
    max_chunks,
    max_header_nbytes,
    max_sections,
    max_zstd_window,
)

SENTINEL = 12345.0


def header_doc(payload: bytes) -> dict:
    header, _, _ = split_frames(payload)
    return json.loads(header[HEADER_PREFIX.size : -HEADER_CRC.size])


def with_header_text(payload: bytes, change, placeholder: str, text: str) -> bytes:
    """The payload with its header edited by `change`, then the JSON string `placeholder` replaced by raw `text`
    (for JSON that Python's json cannot write, such as a 5000-digit integer); resealed."""
    doc = header_doc(payload)
    change(doc)
    body = json.dumps(doc).replace(json.dumps(placeholder), text)
    return with_header(payload, body.encode())


def expect_refusal(payload: bytes, error: type[KVFormatError], field: str, n_slots: int = 64, **kwargs):
    with pytest.raises(error) as err:
        read(payload, contract(), n_slots, **kwargs)
    assert err.value.field == field, str(err.value)
    return err.value


# 1. JSON that json.loads refuses with something other than JSONDecodeError


def test_a_deeply_nested_header_is_malformed_not_a_recursion_error() -> None:
    payload = encode(snapshot(8), np.full(8, Tier.INT4, np.uint8))
    depth = 5000  # within the header's byte and container limits, beyond the interpreter's recursion limit
    nested = with_header_text(payload, lambda doc: doc.update(future="DEEP"), "DEEP", "[" * depth + "]" * depth)
    err = expect_refusal(nested, KVMalformedError, "header")
    assert "nested" in str(err)
    depth = 32  # (the header's object around it) one level beyond the limit, which json parses on any Python
    nested = with_header_text(payload, lambda doc: doc.update(future="DEEP"), "DEEP", "[" * depth + "]" * depth)
    assert "nested deeper than 32 levels" in str(expect_refusal(nested, KVMalformedError, "header"))
    depth = 20_000  # more arrays than a header for this context can hold: refused before parsing
    nested = with_header_text(payload, lambda doc: doc.update(future="DEEP"), "DEEP", "[" * depth + "]" * depth)
    err = expect_refusal(nested, KVTooLargeError, "header")
    assert "arrays and objects" in str(err)


def test_a_huge_integer_in_the_header_is_malformed_not_a_value_error() -> None:
    payload = encode(snapshot(8), np.full(8, Tier.INT4, np.uint8))
    huge = with_header_text(payload, lambda doc: doc.update(zstd_level="BIG"), "BIG", "9" * 5000)
    expect_refusal(huge, KVMalformedError, "header")
    # below Python's int-string limit it parses, but float() of it overflows
    theta = with_header_text(payload, lambda doc: doc["contract"].update(rope_theta="BIG"), "BIG", "9" * 4000)
    expect_refusal(theta, KVMalformedError, "contract.rope_theta")


# 2. the header's size is bounded by the receiver's context


def test_a_header_too_large_for_the_receivers_context_is_refused_at_its_prefix() -> None:
    snap = snapshot(16)
    payload = encode(snap, np.full(16, Tier.INT4, np.uint8))
    limit = max_header_nbytes(16, LAYERS)
    assert limit < 1 << 20  # the old default was 16 MiB whatever the context
    read(payload, snap.contract, 16, max_tokens=16)[0].finish()  # the real header fits
    padded = rewrite_header(payload, lambda doc: doc.update(future="x" * limit))  # a legal field, too much of it
    reader = EDKVReader(snap.contract, max_tokens=16, target_factory=lambda h: pytest.fail("no target"))
    with pytest.raises(KVTooLargeError) as err:
        reader.feed(padded[: HEADER_PREFIX.size])  # refused before any of the JSON is buffered
    assert err.value.field == "header" and str(limit) in str(err.value)
    # a larger context allows a larger header; an explicit limit still overrides the derived one
    assert max_header_nbytes(4096, 30) > max_header_nbytes(16, 30)
    read(padded, snap.contract, 16, max_tokens=1 << 20)[0].finish()
    with pytest.raises(KVTooLargeError):
        read(payload, snap.contract, 16, max_tokens=1 << 20, max_header_bytes=100)


# 3. declared counts are bounded before any per-item work


def one_cell_chunks(n: int) -> list[list[int]]:
    """A valid tiling of LAYERS × n with one-cell chunks; raw sizes of an all-FP16 tier map, head_dim 16."""
    return [[layer, layer + 1, token, token + 1, 2 * 2 * HEADS * 16] for layer in range(LAYERS) for token in range(n)]


def test_too_many_chunks_are_refused_before_any_chunk_is_built(monkeypatch) -> None:
    n = 100
    snap = snapshot(n)
    payload = encode(snap, np.full(n, Tier.FP16, np.uint8))
    rows = one_cell_chunks(n)
    assert len(rows) > max_chunks(n, LAYERS)
    many = rewrite_header(payload, lambda doc: doc.update(chunks=rows))

    def no_per_chunk_work(*args, **kwargs):
        raise AssertionError("per-chunk work before the chunk count was checked")

    monkeypatch.setattr(header_module, "ChunkSpec", no_per_chunk_work)
    monkeypatch.setattr(header_module, "_int64_table", no_per_chunk_work, raising=False)
    monkeypatch.setattr(reader_module, "plan_chunk", no_per_chunk_work)
    err = expect_refusal(many, KVTooLargeError, "chunks", n_slots=n)
    assert f"{len(rows)} chunks declared, at most {max_chunks(n, LAYERS)}" in str(err)


def test_the_chunk_limit_admits_fine_chunkings_of_small_payloads_and_the_writer_keeps_to_it() -> None:
    n = 80  # 240 one-cell chunks: within the floor of the limit
    snap = snapshot(n)
    tiers = np.full(n, Tier.FP16, np.uint8)
    reader, _ = read(encode(snap, tiers, chunk_tokens=1, chunk_layers=1), snap.contract, n)
    assert len(reader.finish().chunks) == LAYERS * n
    with pytest.raises(ValueError, match="chunks"):
        encode(snapshot(100), np.full(100, Tier.FP16, np.uint8), chunk_tokens=1, chunk_layers=1)


def mixed_rows(n: int, seed: int = 0) -> np.ndarray:
    """[LAYERS, n]: every layer's row differs from the one above, and every 4 tokens hold all 4 kept tiers."""
    rng = np.random.default_rng(seed)
    base = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2], np.uint8)
    return np.stack([np.concatenate([rng.permutation(base) for _ in range(n // 4)]) for _ in range(LAYERS)])


def test_too_many_sections_are_refused_at_the_header() -> None:
    n = 1024
    snap = snapshot(n)
    tiers = mixed_rows(n)
    c = snap.contract
    layouts = {
        tier: (QuantLayout("channel", 4, bits), QuantLayout("token", 16, bits))
        for tier, bits in ((Tier.INT8, 8), (Tier.INT4, 4), (Tier.INT2, 2))
    }
    payload = encode(snap, tiers, chunk_tokens=64, layouts=layouts)
    rects = np.array([[0, LAYERS, t, t + 4] for t in range(0, n, 4)], np.int64)  # 256 chunks: within the count
    raw, sections = chunk_sizes(tiers, layouts, c.n_kv_heads, c.head_dim, rects)
    assert len(rects) <= max_chunks(n, LAYERS) and sections.sum() > max_sections(n, LAYERS)
    rows = np.column_stack([rects, raw]).tolist()
    err = expect_refusal(
        rewrite_header(payload, lambda doc: doc.update(chunks=rows)), KVTooLargeError, "chunks", n_slots=n
    )
    assert "sections" in str(err)
    with pytest.raises(ValueError, match="sections"):
        encode(snap, tiers, chunk_tokens=4, layouts=layouts)


@pytest.mark.parametrize(
    "field, change, error",
    [
        ("meta", lambda doc: doc.update(meta={"a": [[[[[[[[[[1]]]]]]]]]]}), KVTooLargeError),
        ("meta", lambda doc: doc.update(meta={f"k{i}": i for i in range(1000)}), KVTooLargeError),
        ("meta", lambda doc: doc.update(meta={"policy": "x" * 10_000}), KVTooLargeError),
        ("producer.model", lambda doc: doc["producer"].update(model="m" * 5000), KVTooLargeError),
        ("contract.architecture", lambda doc: doc["contract"].update(architecture="a" * 5000), KVTooLargeError),
        (
            "layouts",
            lambda doc: doc["layouts"].update({name: doc["layouts"]["int4"] for name in ("INT4", "Int4", "iNT4")}),
            KVMalformedError,
        ),
        ("chunks", lambda doc: doc["chunks"][0].__setitem__(4, 2**70), KVMalformedError),
        ("chunks", lambda doc: doc["chunks"][0].__setitem__(4, True), KVMalformedError),
        ("positions", lambda doc: doc.update(positions="é" * 12), KVMalformedError),  # non-ASCII base64: ValueError
    ],
)
def test_declared_counts_sizes_and_odd_values_are_typed_errors(field, change, error) -> None:
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.INT4, np.uint8), meta={"a": [[[[[[[1]]]]]]]})  # nesting 8 is fine
    assert MAX_META_DEPTH == 8
    read(payload, snap.contract, 8)[0].finish()
    expect_refusal(rewrite_header(payload, change), error, field, n_slots=8)


def test_positions_whose_differences_wrap_around_int64_are_not_increasing() -> None:
    """A header whose last position was -2**63 passed as strictly increasing (np.diff wrapped to a positive step),
    and the decode engine's prompt check then raised IndexError (found by tools/adversarial/fuzz_kv.py)."""
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.INT4, np.uint8))
    positions = np.append(snap.positions[:-1], -(2**63)).astype("<i8")
    assert np.diff(positions)[-1] > 0
    wrapped = rewrite_header(payload, lambda doc: doc.update(positions=base64.b64encode(positions.tobytes()).decode()))
    expect_refusal(wrapped, KVMalformedError, "positions", n_slots=8)


def test_a_chunk_frame_beyond_the_table_is_malformed_not_an_index_error() -> None:
    for n in (12, 0):
        snap = snapshot(n)
        payload = encode(snap, np.full(n, Tier.INT4, np.uint8), chunk_tokens=4)
        header, chunks, _ = split_frames(payload)
        extra = CHUNK_PREFIX.pack(b"EDKC", len(chunks), 9, 0) + b"\0" * 9
        reader = EDKVReader(
            snap.contract, max_tokens=64, target_factory=lambda h: np.zeros((LAYERS, 2, HEADS, 12, 16), np.float32)
        )
        with pytest.raises(KVMalformedError) as err:
            reader.feed(join_frames(header, [*chunks, extra]))
        assert err.value.field == "chunk index"


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 40), st.sampled_from([8, 16]))
def test_vectorised_chunk_sizes_match_the_chunk_plans(data, n, head_dim) -> None:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tiers = rng.choice(np.arange(5, dtype=np.uint8), (LAYERS, n))
    tiers[:, tiers[0] == Tier.DROP] = Tier.DROP
    if data.draw(st.booleans()):
        tiers[:] = tiers[0]
    layouts = {
        Tier.INT8: (QuantLayout("token", head_dim, 8), QuantLayout("channel", 3, 8)),
        Tier.INT4: (QuantLayout("channel", data.draw(st.sampled_from([1, 4, 10**30])), 4), QuantLayout("token", 8, 4)),
        Tier.INT2: (QuantLayout("channel", 4, 2), QuantLayout("token", 4, 2)),
    }
    rects = [
        (l0, l0 + data.draw(st.integers(1, LAYERS - l0)), t0, t0 + data.draw(st.integers(1, n - t0)))
        for l0, t0 in data.draw(
            st.lists(st.tuples(st.integers(0, LAYERS - 1), st.integers(0, n - 1)), min_size=1, max_size=8)
        )
    ]
    raw, sections = chunk_sizes(tiers, layouts, HEADS, head_dim, np.array(rects, np.int64))
    plans = [plan_chunk(tiers, layouts, HEADS, head_dim, rect) for rect in rects]
    assert raw.tolist() == [plan.raw_nbytes for plan in plans]
    assert sections.tolist() == [len(plan.sections) for plan in plans]


def test_a_dropped_reader_is_freed_at_once_not_by_the_cycle_collector() -> None:
    """Readers held themselves in reference cycles: through their table of bound stage handlers, and once a stream
    failed through its exception, whose traceback holds the reader's frames. Every dropped reader, with its chunk
    buffers, lived until the cyclic garbage collector ran (found by tools/adversarial/fuzz_kv.py: 34 dropped readers
    holding 31 MiB were still alive after 8,000 cases)."""
    n = 16
    snap = snapshot(n)
    payload = encode(snap, np.full(n, Tier.INT4, np.uint8))
    target = np.zeros((LAYERS, 2, HEADS, n, 16), np.float32)

    def dropped(data: bytes, end) -> weakref.ref:
        reader = EDKVReader(snap.contract, max_tokens=n, target_factory=lambda header: target)
        with contextlib.suppress(KVFormatError):
            reader.feed(data)
            end(reader)
        with contextlib.suppress(KVFormatError):
            reader.feed(b"more")  # after the trailer, or refused: the stream already failed
        return weakref.ref(reader)

    corrupt = payload[:-1] + bytes([payload[-1] ^ 1])  # the trailer's digest
    gc.disable()
    try:
        assert dropped(payload, EDKVReader.finish)() is None
        assert dropped(corrupt, EDKVReader.finish)() is None
        assert dropped(payload[:-5], EDKVReader.finish)() is None  # truncated: finish raises
        assert dropped(payload[:-5], EDKVReader.cut)() is None
    finally:
        gc.enable()


# 4. sealed payloads with non-finite values


def poisoned(payload: bytes, k: int, tier: Tier, part: int, value: float) -> bytes:
    """The payload with `value` in the last section of `tier` of chunk k (part 0: rows or codes, 1: scales,
    2: zeros), recompressed and resealed: every CRC and the trailer's digest are valid."""
    header, chunks, _ = split_frames(payload)
    doc = header_doc(payload)
    reader, _ = read(payload, contract(), doc["n_tokens"])
    h = reader.finish()
    spec = h.chunks[k]
    raw = bytearray(zstandard.ZstdDecompressor().decompress(chunks[k][CHUNK_PREFIX.size :]))
    plan = plan_chunk(
        h.tiers, h.layouts, HEADS, 16, (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop)
    )
    section = [s for s in plan.sections if s.tier is tier][-1]  # written last of its tier: nothing before it may be
    array = section_arrays(raw, section, HEADS, 16)[part]
    array[-1, -1, -1, -1] = value
    chunks[k] = rechunk(chunks[k], zstandard.ZstdCompressor().compress(bytes(raw)))
    return join_frames(header, chunks)


@pytest.mark.parametrize(
    "tier, part, value, dtype",
    [
        (Tier.FP16, 0, np.nan, np.float32),  # NaN in an FP16 row
        (Tier.FP16, 0, -np.inf, np.float16),
        (Tier.INT4, 1, np.inf, np.float32),  # inf in an INT4 scale
        (Tier.INT4, 2, -np.inf, np.float16),  # -inf in an INT4 zero
        (Tier.INT8, 1, np.nan, np.float32),  # NaN in an INT8 scale
        (Tier.INT2, 2, np.nan, np.float32),
    ],
)
def test_non_finite_values_are_refused_before_anything_of_their_chunk_is_written(tier, part, value, dtype) -> None:
    n = 30
    snap = snapshot(n)
    tiers = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2, Tier.INT4, Tier.DROP] * 5, np.uint8)
    payload = encode(snap, tiers, chunk_tokens=10, chunk_layers=2)
    bad = poisoned(payload, 1, tier, part, value)
    header = read(payload, snap.contract, n)[0].finish()
    target = np.full((LAYERS, 2, HEADS, n, 16), SENTINEL, dtype)
    reader = EDKVReader(snap.contract, max_tokens=n, target_factory=lambda h: target)
    with pytest.raises(KVValueError) as err:
        reader.feed(bad)
    assert isinstance(err.value, KVMalformedError)
    assert err.value.field == "chunk 1" and tier.name in str(err.value)
    for spec in header.chunks:  # chunk 0 was written, chunk 1 (refused) and the rest untouched
        region = target[spec.layer_start : spec.layer_stop, :, :, header.slot_range(spec)]
        assert (region == SENTINEL).all() == (spec.index >= 1), spec.index
    assert np.isfinite(target).all()


def test_finite_extremes_and_random_float16_bits_never_raise_untyped() -> None:
    n = 16
    snap = snapshot(n)
    payload = encode(snap, np.full(n, Tier.FP16, np.uint8), chunk_tokens=16)
    header, chunks, _ = split_frames(payload)
    raw_len = len(zstandard.ZstdDecompressor().decompress(chunks[0][CHUNK_PREFIX.size :]))
    extremes = np.array([65504, -65504, 2**-24, -(2**-24), 0, -0.0], np.float16)
    for raw in (
        np.resize(extremes, raw_len // 2).tobytes(),
        np.random.default_rng(0).integers(0, 256, raw_len, np.uint8).tobytes(),
    ):
        sealed = join_frames(header, [rechunk(chunks[0], zstandard.ZstdCompressor().compress(raw))])
        target = np.full((LAYERS, 2, HEADS, n, 16), SENTINEL, np.float32)
        reader = EDKVReader(snap.contract, max_tokens=n, target_factory=lambda h, target=target: target)
        if np.isfinite(np.frombuffer(raw, np.float16)).all():
            reader.feed(sealed)
            reader.finish()
        else:
            with pytest.raises(KVValueError):
                reader.feed(sealed)
            assert (target == SENTINEL).all()


def test_a_zstd_window_beyond_the_largest_chunk_is_refused_before_zstd_allocates_it() -> None:
    """A 5 KiB chunk whose frame asks for zstd's default maximum window made the decoder allocate 128 MiB (found
    by tools/adversarial/fuzz_kv.py); a window up to the chunk's size rounded up to a power of two is accepted."""
    n = 16
    snap = snapshot(n)
    payload = encode(snap, np.full(n, Tier.INT4, np.uint8), chunk_tokens=n)
    header, chunks, _ = split_frames(payload)
    raw = zstandard.ZstdDecompressor().decompress(chunks[0][CHUNK_PREFIX.size :])
    fitting = max_zstd_window(len(raw)).bit_length() - 1
    assert 2**fitting >= len(raw) > 2 ** (fitting - 1)
    reader, target = read(join_frames(header, [rechunk(chunks[0], streamed_frame(raw, fitting))]), snap.contract, n)
    reader.finish()
    np.testing.assert_array_equal(target, read(payload, snap.contract, n)[1])
    for window_log in (fitting + 1, 27):
        huge = join_frames(header, [rechunk(chunks[0], streamed_frame(raw, window_log))])
        err = expect_refusal(huge, KVMalformedError, "chunk 0")
        assert "memory" in str(err)


@pytest.mark.parametrize("level", [1, 3, 19, 22])
def test_the_writers_zstd_frames_stay_within_the_window_limit(level) -> None:
    for nbytes in (0, 1, 1000, 1024, 1025, 100_000, 3 << 20):
        frame = zstandard.ZstdCompressor(level=level).compress(
            bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
        )
        assert zstandard.get_frame_parameters(frame).window_size <= max_zstd_window(nbytes), nbytes


# 5. anything a peer can put in a header field ends in a KVFormatError

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, -(2**63) - 1, 10**300])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.just("AAAA"),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(["int4", "int8", "keys", "values", "axis", "group", "bits", "x"]), inner, max_size=4
        )
    ),
    max_leaves=12,
)


def field_paths(doc, prefix=()):
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield from field_paths(value, (*prefix, key))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_value_in_any_header_field_is_accepted_or_a_typed_error(data) -> None:
    n = 12
    snap = snapshot(n)
    tiers = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2, Tier.DROP, Tier.INT4] * 2, np.uint8)
    payload = encode(
        snap,
        tiers,
        chunk_tokens=4,
        layouts={
            **DEFAULT_LAYOUTS,
            Tier.INT8: (QuantLayout("token", 16, 8), QuantLayout("token", 16, 8)),
            Tier.INT4: (QuantLayout("channel", 4, 4), QuantLayout("token", 16, 4)),
            Tier.INT2: (QuantLayout("channel", 4, 2), QuantLayout("token", 16, 2)),
        },
    )
    doc = header_doc(payload)
    path = data.draw(st.sampled_from(list(field_paths(doc))[1:]))
    node = doc
    for key in path[:-1]:
        node = node[key]
    if data.draw(st.booleans()) and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = data.draw(json_values)
    body = json.dumps(doc).encode("utf-8", "surrogatepass")
    with contextlib.suppress(KVFormatError):
        read(with_header(payload, body), snap.contract, n)
