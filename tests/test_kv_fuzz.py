"""KV decoder fuzzing, the fast subset of ``tools/adversarial/fuzz_kv.py`` (docs/reliability.md): real SmolLM2
payloads from the prefill pipeline, mutated as a broken link or a hostile sender would, fed in random slices through
the decode engine's stream into its KV buffers; hypothesis draws the cases, derandomized so every run checks the same
ones."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvfuzz import oracle, windowed
from kvfuzz.draw import HypothesisDraw
from kvfuzz.mutant import Mutant
from kvfuzz.mutations import Case, make_case
from kvfuzz.oracle import FuzzFailure, reference_kv, run_case
from kvfuzz.seeds import CONTEXT, Seed, bits, build_seeds
from kvfuzz.segmented import build_segmented_seeds
from test_kv_format import join_frames, per_value, rechunk, rewrite_header, split_frames, streamed_frame

from edgedecode.kv.quant import QuantLayout, quantize
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import reader as reader_module
from edgedecode.kv.wire.chunks import plan_chunk, section_arrays, section_float16
from edgedecode.kv.wire.frames import CHUNK_PREFIX, LOWBIT_MINOR, MAJOR, MINOR
from edgedecode.kv.wire.target import TargetWriter
from edgedecode.kv.wire.value_check import ValueBounds

FUZZ_CASES = 2500


@pytest.fixture(scope="module")
def fuzz_decoder(smollm2_model, decoder):
    """A decode engine of CONTEXT slots on the shared decode session: its own KV buffers to watch."""
    from edgedecode.runtime.engine import Engine

    return Engine(smollm2_model, decoder.options, max_context=CONTEXT, threads=2, share=decoder)


@pytest.fixture(scope="module")
def seeds(smollm2_model, prefiller, fuzz_decoder):
    return build_seeds(smollm2_model.tokenizer, prefiller, fuzz_decoder)


def test_the_seeds_cover_every_tier_every_minor_and_chunkings_and_the_oracle_decodes_them_as_the_reader(seeds):
    tiers = set().union(*(np.unique(seed.header.tiers).tolist() for seed in seeds))
    assert tiers == {tier.value for tier in Tier}
    assert {seed.header.minor for seed in seeds} == {0, 1, MINOR, LOWBIT_MINOR[MAJOR]}
    rotated = [seed for seed in seeds if seed.header.rotation is not None]
    assert len(rotated) == 2 and all((seed.header.tiers == Tier.INT3).any() for seed in rotated)
    assert {seed.header.transfer is None for seed in seeds} == {True, False}
    assert {seed.header.importance is None for seed in seeds} == {True, False}
    assert max(len(seed.header.chunks) for seed in seeds) > 1 and any(seed.head for seed in seeds)
    for seed in seeds:
        np.testing.assert_array_equal(
            bits(reference_kv(seed.header, seed.bodies).astype(seed.clean.dtype)), bits(seed.clean)
        )


@settings(
    max_examples=FUZZ_CASES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.data())
def test_every_mutated_payload_is_refused_typed_or_ingested_verified(seeds, fuzz_decoder, data) -> None:
    run_case(fuzz_decoder, make_case(seeds, HypothesisDraw(data)))


# the windowed (EDKV 2.0) and segmented (resumed transfer) seed families, a few hundred cases each


@pytest.fixture(scope="module")
def windowed_family(tmp_path_factory):
    """(decoder, seeds) of the tiny Gemma 3's EDKV 2.0 payloads."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEDECODE_HOME", str(home))
        prefill, decoder = windowed.engines(windowed.tiny_gemma3(home))
        return decoder, windowed.build_windowed_seeds(prefill, decoder)


@pytest.fixture(scope="module")
def segmented_seeds(smollm2_model, prefiller, fuzz_decoder):
    return build_segmented_seeds(smollm2_model.tokenizer, prefiller, fuzz_decoder)


def _decodes_as_the_reader(seed: Seed) -> None:
    """The oracle's decode of a seed is its clean ingest, in every cell the payload carries."""
    carried = (seed.header.cells != Tier.DROP)[:, seed.header.kept][:, None, None, :, None]
    oracle = bits(reference_kv(seed.header, seed.bodies).astype(seed.clean.dtype))
    np.testing.assert_array_equal(np.where(carried, oracle, 0), np.where(carried, bits(seed.clean), 0))


def test_the_windowed_seeds_are_edkv_2_with_windows_cutting_layers_and_the_oracle_decodes_them(windowed_family):
    _, seeds = windowed_family
    assert {(seed.header.major, seed.header.window is not None) for seed in seeds} == {(2, True), (1, False)}
    windows = [seed.header.window for seed in seeds if seed.header.window is not None]
    assert all(window.start > 0 and window.layers for window in windows)  # windowed cells left out
    assert any(seed.head for seed in seeds) and any(len(seed.header.chunks) > 1 for seed in seeds)
    for seed in seeds:
        _decodes_as_the_reader(seed)


@settings(max_examples=300, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_every_mutated_windowed_payload_is_refused_typed_or_ingested_verified(windowed_family, data) -> None:
    decoder, seeds = windowed_family
    run_case(decoder, make_case(seeds, HypothesisDraw(data)))


def test_the_segmented_seeds_resume_after_a_cut_segment_and_refuse_an_overlapping_resume(segmented_seeds, fuzz_decoder):
    covered = [seed.lead.covered for seed in segmented_seeds if seed.lead is not None]
    assert len(covered) == len(segmented_seeds) and 0 in covered and max(covered) > 0
    assert any(seed.lead is not None and seed.lead.slots < seed.lead.covered for seed in segmented_seeds)  # drops
    for seed in segmented_seeds:
        _decodes_as_the_reader(seed)
        assert seed.header.positions[0] == seed.first_position
    seed = next(seed for seed in segmented_seeds if len(seed.alternates) == 2)
    overlap, gap = (
        Mutant(a.payload, a.name, tuple(c[CHUNK_PREFIX.size :] for c in split_frames(a.payload)[1]))
        for a in seed.alternates
    )
    assert run_case(fuzz_decoder, _case(seed, overlap)).result == "KVInjectionError"  # positions already covered
    assert run_case(fuzz_decoder, _case(seed, gap)).result == "ingested, edited KV"  # later positions: computed


@settings(max_examples=300, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_every_mutated_resume_is_refused_typed_or_ingested_verified(segmented_seeds, fuzz_decoder, data) -> None:
    run_case(fuzz_decoder, make_case(segmented_seeds, HypothesisDraw(data)))


# the oracle itself: each rule it checks can fail


def _case(seed: Seed, mutant: Mutant) -> Case:
    return Case(seed, mutant, (0, len(mutant.payload)))


def _with_raw(seed: Seed, change, which=lambda section: True) -> tuple[bytes, bytes]:
    """(payload, body): the seed with its first chunk's raw bytes changed by ``change(raw, section)`` (its first
    section, or the first ``which`` picks) and every checksum resealed."""
    h, c = seed.header, seed.header.contract
    spec = h.chunks[0]
    rect = (spec.layer_start, spec.layer_stop, spec.token_start, spec.token_stop)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(seed.bodies[0]))
    sections = plan_chunk(h.tiers, h.layouts, c.n_kv_heads, c.head_dim, rect).sections
    change(raw, next(section for section in sections if which(section)))
    body = zstandard.ZstdCompressor().compress(bytes(raw))
    header, chunks, _ = seed.frames
    return join_frames(header, [rechunk(chunks[0], body), *chunks[1:]]), body


def test_the_oracle_refuses_a_sender_edit_passed_off_as_transport_damage(seeds, fuzz_decoder) -> None:
    payload, body = _with_raw(seeds[0], lambda raw, section: raw.__setitem__(section.offset, raw[section.offset] ^ 1))
    sealed = Mutant(payload, "one bit of KV, resealed", (body, *seeds[0].bodies[1:]))
    assert run_case(fuzz_decoder, _case(seeds[0], sealed)).result == "ingested, edited KV"
    with pytest.raises(FuzzFailure, match="wrong ingest"):
        run_case(fuzz_decoder, _case(seeds[0], Mutant(payload, "one bit of KV, as if damaged in transit")))


def test_the_oracle_rotates_back_as_the_stream_declares(seeds, fuzz_decoder) -> None:
    """Another rotation seed, resealed: the reader ingests other KV, which the oracle derives from the format's
    definition; passed off as transport damage, it is a wrong ingest."""
    seed = next(s for s in seeds if s.header.rotation is not None)
    reseeded = rewrite_header(seed.payload, lambda doc: doc["rotation"].update(seed=7), minor=seed.header.minor)
    sealed = Mutant(reseeded, "another rotation seed, resealed", seed.bodies)
    assert run_case(fuzz_decoder, _case(seed, sealed)).result == "ingested, edited KV"
    with pytest.raises(FuzzFailure, match="wrong ingest"):
        run_case(fuzz_decoder, _case(seed, Mutant(reseeded, "another rotation seed, as if damaged in transit")))


def test_the_oracle_unpacks_3_bit_codes_as_the_quantizer_packs_them() -> None:
    layout = QuantLayout("token", 32, 3)
    x = np.random.default_rng(4).standard_normal((2, 7, 64)).astype(np.float32)
    codes, scales, zeros = quantize(x, layout)
    q = oracle.unpack_codes(codes, layout, 64)
    assert q.min() == 0 and q.max() == 7 and (q == np.round(q)).all()
    rebuilt = q * per_value(scales, layout, 7) + per_value(zeros, layout, 7)
    assert np.abs(rebuilt - x).max() <= scales.astype(np.float32).max() / 2 * (1 + 1e-5)


def test_the_oracle_reports_a_chunk_written_despite_non_finite_values(seeds, fuzz_decoder, monkeypatch) -> None:
    seed = seeds[0]
    c = seed.header.contract

    def poison(raw: bytearray, section) -> None:
        section_float16(raw, section, c.n_kv_heads, c.head_dim)[0, 0] = np.nan

    payload, body = _with_raw(seed, poison)
    poisoned = _case(seed, Mutant(payload, "NaN, resealed", (body, *seed.bodies[1:])))
    assert run_case(fuzz_decoder, poisoned).result == "KVValueError"
    monkeypatch.setattr(ValueBounds, "check", lambda *args: None)
    with pytest.raises(FuzzFailure, match="inf or NaN"):
        run_case(fuzz_decoder, poisoned)


def test_the_oracle_expects_the_value_checks_refusal_of_a_rotated_section_beyond_the_limit_once_rotated_back(
    seeds, fuzz_decoder, monkeypatch
) -> None:
    """A rotated section whose groups all hold zero = limit / 4 and scale 0: within the limit as sent, but each
    block rotates back into one entry of √32 / 4 = 1.41 times it. The reader refuses it (KVValueError); with the
    check stubbed out, the oracle reports the write from the format's definition."""
    seed = next(s for s in seeds if s.header.rotation is not None)
    c, rotation, limits = seed.header.contract, seed.header.rotation, fuzz_decoder.cache.value_limits

    def gather(raw: bytearray, section) -> None:
        _, scales, zeros = section_arrays(raw, section, c.n_kv_heads, c.head_dim)
        scales[0] = 0.0
        zeros[0] = limits[section.layer_start, section.kv] / 4

    payload, body = _with_raw(seed, gather, lambda section: rotation.rotates(section.tier))
    gathered = _case(seed, Mutant(payload, "a rotated section gathered, resealed", (body, *seed.bodies[1:])))
    assert run_case(fuzz_decoder, gathered).result == "KVValueError"
    monkeypatch.setattr(ValueBounds, "check", lambda *args: None)
    with pytest.raises(FuzzFailure, match="beyond the receiver's value limits"):
        run_case(fuzz_decoder, gathered)


def test_the_oracle_reports_untyped_errors_hangs_and_allocations_beyond_the_bound(
    seeds, fuzz_decoder, monkeypatch
) -> None:
    clean = _case(seeds[0], Mutant(seeds[0].payload, "none"))
    assert run_case(fuzz_decoder, clean).result == "ingested"
    monkeypatch.setattr(oracle, "FIXED_BYTES", -(1 << 30))
    with pytest.raises(FuzzFailure, match="over allocation"):
        run_case(fuzz_decoder, clean)
    monkeypatch.setattr(oracle, "HANG_S", 0.0)
    with pytest.raises(FuzzFailure, match="hang"):
        run_case(fuzz_decoder, clean)
    monkeypatch.setattr(TargetWriter, "write", lambda *args: [][0])
    with pytest.raises(FuzzFailure, match="crash: IndexError"):
        run_case(fuzz_decoder, clean)


def test_the_oracle_reports_a_zstd_context_beyond_what_the_chunks_need(seeds, fuzz_decoder, monkeypatch) -> None:
    seed = seeds[0]
    body = streamed_frame(zstandard.ZstdDecompressor().decompress(seed.bodies[0]), window_log=27)
    header, chunks, _ = seed.frames
    payload = join_frames(header, [rechunk(chunks[0], body), *chunks[1:]])
    huge_window = _case(seed, Mutant(payload, "a 128 MiB zstd window, resealed", (body, *seed.bodies[1:])))
    assert run_case(fuzz_decoder, huge_window).result == "KVMalformedError"
    monkeypatch.setattr(reader_module, "max_zstd_window", lambda raw_nbytes: 1 << 27)  # the reader before the limit
    with pytest.raises(FuzzFailure, match="zstd context"):
        run_case(fuzz_decoder, huge_window)
