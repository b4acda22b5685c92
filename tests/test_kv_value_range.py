"""KV values within what the model can produce (issue 34 item 2): finite but absurd KV — huge FP16 rows, huge
quantization scales or zeros — is refused with a typed error before anything of its chunk is written, real KV
passes, and a float16 destination never receives ±inf (docs/kv-format.md §5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_kv_format import HEADS, LAYERS, encode, read, snapshot
from test_kv_hostile import SENTINEL, poisoned
from test_kv_lowbit import ROTATED
from test_kv_lowbit import encode as encode_lowbit

from edgedecode.kv.policy import TierProfile
from edgedecode.kv.quant import FP16_MAX, QuantLayout
from edgedecode.kv.rotation import hadamard_signs, rotate
from edgedecode.kv.tiers import Tier
from edgedecode.kv.value_range import RANGES_DIR, KVValueRange, load_value_range
from edgedecode.kv.wire import EDKVReader, KVMalformedError, KVValueError
from edgedecode.kv.wire.value_check import ValueBounds

N = 30
MIXED = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2, Tier.INT4, Tier.DROP] * 5, np.uint8)
MIXED_LOWBIT = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2, Tier.DROP] * 5, np.uint8)


def measured_limits(snap) -> np.ndarray:
    return KVValueRange.measure([snap], "test").limits()


@pytest.mark.parametrize(
    "tier, part, value",
    [
        (Tier.FP16, 0, 3000.0),  # a huge finite FP16 row value
        (Tier.FP16, 0, -3000.0),
        (Tier.INT8, 1, 500.0),  # a huge finite INT8 scale: x̂ up to 255 × 500
        (Tier.INT4, 1, -500.0),  # a negative scale (a writer never makes one): x̂ down to −15 × 500
        (Tier.INT4, 2, 2000.0),  # a huge zero
        (Tier.INT2, 2, -2000.0),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_huge_finite_values_beyond_the_measured_range_are_refused_before_anything_of_their_chunk_is_written(
    tier, part, value, dtype
) -> None:
    snap = snapshot(N)
    payload = encode(snap, MIXED, chunk_tokens=10, chunk_layers=2)
    bad = poisoned(payload, 1, tier, part, value)
    header = read(payload, snap.contract, N)[0].finish()
    target = np.full((LAYERS, 2, HEADS, N, 16), SENTINEL, dtype)
    reader = EDKVReader(
        snap.contract, max_tokens=N, target_factory=lambda h: target, value_limits=measured_limits(snap)
    )
    with pytest.raises(KVValueError) as err:
        reader.feed(bad)
    assert isinstance(err.value, KVMalformedError)  # what the daemon counts as a bad payload, then prefills locally
    assert err.value.field == "chunk 1" and tier.name in str(err.value) and "limit" in str(err.value)
    for spec in header.chunks:  # chunk 0 was written, chunk 1 (refused) and the rest untouched
        region = target[spec.layer_start : spec.layer_stop, :, :, header.slot_range(spec)]
        assert (region == SENTINEL).all() == (spec.index >= 1), spec.index
    # without the model's range the same payload is accepted into float32 (every value finite there)
    if dtype == np.float32:
        read(bad, snap.contract, N)[0].finish()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("seed", range(4))
def test_real_payloads_of_every_tier_pass_and_decode_as_without_the_check(dtype, seed) -> None:
    snap = snapshot(N, seed=seed)
    tiers = np.random.default_rng(seed).permutation(MIXED)
    payload = encode(snap, tiers, chunk_tokens=7, chunk_layers=2)
    checked = read(payload, snap.contract, N, dtype=dtype, value_limits=measured_limits(snap))
    plain = read(payload, snap.contract, N, dtype=dtype)
    checked[0].finish()
    np.testing.assert_array_equal(checked[1], plain[1])


def test_the_multiple_is_what_separates_real_values_from_refused_ones() -> None:
    """The FP16 rows' check is exact at the limit: |x| at the limit passes, the next float16 above it does not."""
    snap = snapshot(8)
    payload = encode(snap, np.full(8, Tier.FP16, np.uint8), chunk_tokens=8)
    peak = np.float16(np.abs(snap.keys[0]).max())  # layer 0's largest key, as the FP16 tier sends it
    limits = np.full((LAYERS, 2), np.inf, np.float32)
    limits[0, 0] = peak
    read(payload, snap.contract, 8, value_limits=limits)[0].finish()
    limits[0, 0] = np.nextafter(peak, np.float16(0))
    with pytest.raises(KVValueError, match="keys FP16 rows of layer 0"):
        read(payload, snap.contract, 8, value_limits=limits)


@pytest.mark.parametrize("tier, part", [(Tier.INT8, 1), (Tier.INT4, 1), (Tier.INT2, 1), (Tier.FP16, 0)])
def test_a_float16_target_never_receives_inf_from_finite_values(tier, part) -> None:
    """Without any measured range (value_limits None), a float16 destination still caps |x̂| at 65504: a finite
    scale of 60000 made q·scale overflow to inf there; a float32 destination holds it."""
    snap = snapshot(N)
    payload = encode(snap, MIXED, chunk_tokens=10, chunk_layers=2)
    bad = poisoned(payload, 1, tier, part, 60000.0 if part else -65504.0)
    reader, target = read(bad, snap.contract, N, fill=0.0)
    reader.finish()
    assert np.isfinite(target).all()
    if part:  # a quantized section: the float16 buffer would have overflowed
        with pytest.raises(KVValueError, match="limit of 65504"):
            read(bad, snap.contract, N, fill=0.0, dtype=np.float16)
    else:  # -65504 is a float16: it fits, and is accepted
        reader, target = read(bad, snap.contract, N, fill=0.0, dtype=np.float16)
        reader.finish()
        assert np.isfinite(target).all()


def test_a_group_the_writer_quantizes_at_the_float16_extremes_cannot_overflow_a_float16_target() -> None:
    """The writer accepts values up to ±65504, and rounds the scale up: an INT8 group spanning [−65504, 65504]
    dequantizes up to 65566 at its largest code, inf in float16. The reader refuses it there, never writes inf."""
    snap = snapshot(4, head_dim=16)
    keys = snap.keys.copy()
    keys[0, 0, 0, :2] = (-FP16_MAX, FP16_MAX)
    extreme = type(snap)(snap.contract, snap.token_ids, snap.positions, keys, snap.values, snap.producer)
    layouts = {Tier.INT8: (QuantLayout("token", 16, 8), QuantLayout("token", 16, 8))}
    payload = encode(extreme, np.full(4, Tier.INT8, np.uint8), layouts=layouts)
    reader, target = read(payload, snap.contract, 4)
    reader.finish()
    assert np.abs(target).max() > FP16_MAX  # float32 holds what the codes say
    with pytest.raises(KVValueError, match="INT8 keys dequantized values of layer 0"):
        read(payload, snap.contract, 4, dtype=np.float16, fill=0.0)


def test_bounds_refuse_limits_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"\[3, 2\]"):
        ValueBounds(np.ones((2, 2), np.float32), 3)
    with pytest.raises(ValueError, match="non-negative"):
        ValueBounds(-np.ones((3, 2), np.float32), 3)


def test_the_probes_range_travels_in_its_profile_and_overrides_the_shipped_one(tmp_path) -> None:
    measured = KVValueRange(((1.0, 2.0), (3.0, 4.5)), "probe")
    profile = TierProfile(value_range=measured)
    assert TierProfile.from_json(profile.to_json()) == profile
    assert TierProfile.from_json(TierProfile().to_json()).value_range is None
    path = tmp_path / "tier_profile.json"
    path.write_text(profile.to_json())
    assert load_value_range("smollm2-135m-instruct", path) == measured
    np.testing.assert_array_equal(measured.limits(), np.array([[8, 16], [24, 36]], np.float32))
    path.write_text(TierProfile().to_json())  # a probe verdict without a range: the shipped one
    shipped = load_value_range("smollm2-135m-instruct", path)
    assert shipped is not None and len(shipped.abs_max) == 30
    assert load_value_range("no-such-model", path) is None


@pytest.mark.parametrize("path", sorted(RANGES_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_range_is_finite_positive_and_far_below_the_float16_limit(path) -> None:
    saved = json.loads(path.read_text())
    limits = KVValueRange.from_dict(saved).limits()
    assert saved["model"] == path.stem and saved["source"]
    assert (limits > 0).all() and (limits < FP16_MAX).all()


# rotated sections (EDKV 1.3): the limits hold for the values the reader writes, after the inverse rotation


def aligned(snap, scale: float, head_dim: int = 16):
    """``snap`` with every key and value head vector ``scale · s`` (s: ROTATED's signs for it): rotated, each
    block gathers into one entry of √B·scale, the rest 0 — legitimate KV of |x| = scale everywhere."""
    signs = hadamard_signs(ROTATED.seed, LAYERS, HEADS, head_dim)
    keys = np.broadcast_to(scale * signs[:, 0, :, None, :], snap.keys.shape).astype(np.float32)
    values = np.broadcast_to(scale * signs[:, 1, :, None, :], snap.values.shape).astype(np.float32)
    return type(snap)(snap.contract, snap.token_ids, snap.positions, keys, values, snap.producer)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("tier", [Tier.INT4, Tier.INT3])
def test_rotated_int3_and_int4_payloads_of_real_values_pass_and_decode_as_without_the_check(tier, dtype) -> None:
    snap = snapshot(N)  # an outlier key channel, which the rotation spreads over its block
    payload = encode_lowbit(snap, np.full(N, tier, np.uint8), rotation=ROTATED, chunk_tokens=10, chunk_layers=2)
    checked = read(payload, snap.contract, N, dtype=dtype, value_limits=measured_limits(snap))
    plain = read(payload, snap.contract, N, dtype=dtype)
    assert checked[0].finish().rotation == ROTATED
    np.testing.assert_array_equal(checked[1], plain[1])


@pytest.mark.parametrize("tier", [Tier.INT4, Tier.INT3])
def test_valid_rotated_values_beyond_the_limit_only_in_the_rotated_domain_are_accepted(tier) -> None:
    """A rotation may gather a block into one entry of √B times its values: judged in the rotated domain, this
    payload (|x| = 1 everywhere, rotated entries of 4) would be refused under a limit of 1.5; rotated back it is
    within it, and accepted."""
    snap = aligned(snapshot(N), 1.0)
    assert np.abs(rotate(snap.values, hadamard_signs(ROTATED.seed, LAYERS, HEADS, 16)[:, 1], 16)).max() > 3.9
    payload = encode_lowbit(snap, np.full(N, tier, np.uint8), rotation=ROTATED, chunk_tokens=10)
    limits = KVValueRange.measure([snap], "test").limits(1.5)
    reader, target = read(payload, snap.contract, N, value_limits=limits)
    reader.finish()
    assert np.abs(target).max() <= 1.5
    np.testing.assert_allclose(target[:, 1], snap.values, atol=0.3)


@pytest.mark.parametrize("tier", [Tier.INT4, Tier.INT3])
def test_rotated_values_beyond_the_limit_only_once_rotated_back_are_refused_before_their_chunk_is_written(
    tier,
) -> None:
    """The converse: rotated entries of 1 that rotate back into one entry of 4 per block, under a limit of 2 —
    within it in the rotated domain, beyond it in what the reader would write."""
    spread = snapshot(N)
    signs = hadamard_signs(ROTATED.seed, LAYERS, HEADS, 16)
    values = np.zeros_like(spread.values)
    values[..., 0] = 4.0 * signs[:, 1, :, None, 0]  # rotated: ±1 in every channel of the block
    keys = np.clip(spread.keys, -1.0, 1.0)
    snap = type(spread)(spread.contract, spread.token_ids, spread.positions, keys, values, spread.producer)
    payload = encode_lowbit(snap, np.full(N, tier, np.uint8), rotation=ROTATED, chunk_tokens=10)
    limits = np.full((LAYERS, 2), 2.0, np.float32)
    target = np.full((LAYERS, 2, HEADS, N, 16), SENTINEL, np.float32)
    reader = EDKVReader(snap.contract, max_tokens=N, target_factory=lambda h: target, value_limits=limits)
    with pytest.raises(KVValueError, match=f"{tier.name} values values rotated back of layer 0 reach") as err:
        reader.feed(payload)
    assert err.value.field == "chunk 0" and (target == SENTINEL).all()  # nothing of it was written
    read(payload, snap.contract, N, value_limits=np.full((LAYERS, 2), 4.5, np.float32))[0].finish()


@pytest.mark.parametrize("tier", [Tier.INT4, Tier.INT3, Tier.INT2])
def test_a_rotated_section_that_would_overflow_float16_once_rotated_back_is_refused(tier) -> None:
    """A zero of 20000 (finite, within float16) in a rotated group of one whole block: rotated back, one entry
    reaches ±80000, inf in float16. A float16 target refuses it (no measured range needed); a float32 one holds
    it."""
    snap = snapshot(N)
    payload = encode_lowbit(snap, MIXED_LOWBIT, rotation=ROTATED, chunk_tokens=10, chunk_layers=2)
    bad = poisoned(payload, 1, tier, 2, 20000.0)
    reader, target = read(bad, snap.contract, N, fill=0.0)
    reader.finish()
    assert np.abs(target).max() > FP16_MAX and np.isfinite(target).all()
    with pytest.raises(KVValueError, match=r"rotated back .* limit of 65504") as err:
        read(bad, snap.contract, N, fill=0.0, dtype=np.float16)
    assert err.value.field == "chunk 1"
