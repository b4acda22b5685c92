"""EDKV 1.3: the INT3 tier, the Hadamard rotation negotiated in the header, and 1.2 payloads still reading the same."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from test_kv_format import contract, read, rewrite_header, small_layouts, snapshot
from test_kv_quant import per_value

from edgedecode.kv.quant import QuantLayout, dequantize_into, params_shape, quantize
from edgedecode.kv.rotation import DEFAULT_ROTATION, Rotation, hadamard, hadamard_signs, rotate
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import (
    KVMalformedError,
    KVUnsupportedError,
    decode_snapshot,
    encode_payload,
)
from edgedecode.kv.wire.frames import HEADER_PREFIX
from edgedecode.model.spec import KVContract, KVLayout

FIXTURE = Path(__file__).parent / "vectors" / "edkv"
ROTATED = Rotation("hadamard", 7, (Tier.INT4, Tier.INT3, Tier.INT2), 16)


def layouts_with_int3(head_dim: int) -> dict[Tier, tuple[QuantLayout, QuantLayout]]:
    return {**small_layouts(head_dim), Tier.INT3: (QuantLayout("channel", 4, 3), QuantLayout("token", 16, 3))}


def encode(snap, tiers, **kwargs) -> bytes:
    kwargs.setdefault("layouts", layouts_with_int3(snap.contract.head_dim))
    return b"".join(encode_payload(snap, tiers, **kwargs))


def version(payload: bytes) -> tuple[int, int]:
    _, major, minor, _ = HEADER_PREFIX.unpack_from(payload)
    return major, minor


def test_a_payload_written_by_edkv_1_2_decodes_exactly_as_it_did() -> None:
    """tests/vectors/edkv/edkv-1.2.bin was written by main's 1.2 writer; its decoded KV hashes as recorded then."""
    meta = json.loads((FIXTURE / "edkv-1.2.json").read_text())
    payload = (FIXTURE / "edkv-1.2.bin").read_bytes()
    assert version(payload) == (1, 2)
    receiver = KVContract("llama", 2, 2, 16, 10000.0, KVLayout(), "tok-hash")
    out = decode_snapshot(payload, receiver)
    assert out.n_tokens == meta["kept_tokens"]
    assert hashlib.sha256(out.keys.tobytes() + out.values.tobytes()).hexdigest() == meta["decoded_sha256"]


def test_streams_without_int3_or_a_rotated_tier_stay_1_2_byte_for_byte() -> None:
    snap = snapshot(40)
    tiers = np.array([Tier.FP16, Tier.INT8] * 20, np.uint8)
    plain = encode(snap, tiers)
    assert version(plain) == (1, 2)
    assert encode(snap, tiers, rotation=ROTATED) == plain  # nothing to rotate: no `rotation`, still 1.2
    assert version(encode(snap, np.full(40, Tier.INT3, np.uint8))) == (1, 3)
    assert version(encode(snap, np.full(40, Tier.INT4, np.uint8), rotation=ROTATED)) == (1, 3)


def test_int3_round_trips_within_the_quantizer_bound_in_every_slot() -> None:
    snap = snapshot(70)
    tiers = np.array([Tier.INT3, Tier.INT4, Tier.INT3, Tier.DROP, Tier.FP16] * 14, np.uint8)
    out = decode_snapshot(encode(snap, tiers), snap.contract)
    kept = tiers != Tier.DROP
    int3 = (tiers == Tier.INT3)[kept]
    for got, sent, layout in zip((out.keys, out.values), (snap.keys, snap.values), layouts_with_int3(16)[Tier.INT3]):
        x = sent[:, :, tiers == Tier.INT3]
        _, scales, _ = quantize(x, layout)
        err = np.abs(got[:, :, int3] - x)
        assert err.max() <= scales.astype(np.float32).max() / 2 + 1e-5
        assert err.max() > 0  # 3 bits do lose something: the INT3 sections were really quantized


def rotated_bound(x: np.ndarray, layout: QuantLayout, signs: np.ndarray) -> np.ndarray:
    """Per head vector, the L2 norm of the per-element quantizer bound in the rotated domain (an orthogonal
    rotation back keeps the error's L2 norm)."""
    r = rotate(x, signs, ROTATED.block)
    _, scales, _ = quantize(r, layout)
    half_steps = per_value(scales, layout, r.shape[-2]) / 2
    return np.sqrt((half_steps**2).sum(-1)) * (1 + 1e-5) + 1e-6


@pytest.mark.parametrize("tier", [Tier.INT4, Tier.INT3, Tier.INT2])
def test_rotated_tiers_round_trip_within_the_rotated_quantizers_bound(tier: Tier) -> None:
    snap = snapshot(64)
    tiers = np.full(64, tier, np.uint8)
    payload = encode(snap, tiers, rotation=ROTATED)
    reader, target = read(payload, snap.contract, 64)
    assert reader.finish().rotation == ROTATED
    signs = hadamard_signs(ROTATED.seed, *target.shape[:1], target.shape[2], target.shape[4])
    for kv, sent in enumerate((snap.keys, snap.values)):
        layout = layouts_with_int3(16)[tier][kv]
        err = np.sqrt(((target[:, kv] - sent) ** 2).sum(-1))
        assert (err <= rotated_bound(sent, layout, signs[:, kv])).all()


def test_the_rotation_spreads_outlier_channels_so_per_token_groups_lose_less() -> None:
    """Keys with a few large channels, per-token INT3 groups over the whole head: rotated, the error is smaller."""
    snap = snapshot(64, head_dim=64)  # channel 1 of every key ×10
    layout = QuantLayout("token", 64, 3)
    layouts = {Tier.INT3: (layout, layout)}
    tiers = np.full(64, Tier.INT3, np.uint8)
    plain = decode_snapshot(encode(snap, tiers, layouts=layouts), snap.contract)
    turned = decode_snapshot(encode(snap, tiers, layouts=layouts, rotation=ROTATED), snap.contract)
    plain_err = np.abs(plain.keys - snap.keys).mean()
    assert np.abs(turned.keys - snap.keys).mean() < 0.7 * plain_err


def test_rotated_sections_land_the_same_in_float16_scattered_and_streamed_destinations() -> None:
    snap = snapshot(90)
    tiers = np.array([Tier.INT3, Tier.INT4, Tier.DROP, Tier.INT2, Tier.INT8, Tier.FP16] * 15, np.uint8)
    payload = encode(snap, tiers, rotation=ROTATED, chunk_tokens=32)
    _, whole = read(payload, snap.contract, 75)
    _, half = read(payload, snap.contract, 80, dtype=np.float16, slices=list(range(1, len(payload), 97)))
    np.testing.assert_array_equal(half[:, :, :, :75], whole.astype(np.float16))
    assert np.isnan(half[:, :, :, 75:]).all()  # nothing beyond the kept tokens' slots was written


def test_hadamard_is_orthogonal_and_its_own_inverse() -> None:
    for block in (2, 32, 64):
        h = hadamard(block)
        np.testing.assert_allclose(h @ h, np.eye(block), atol=1e-6)
        assert set(np.unique(np.abs(h) * np.sqrt(block)).round(5)) == {1.0}
    signs = hadamard_signs(1, 2, 3, 64)
    assert set(np.unique(signs)) == {-1.0, 1.0} and signs.shape == (2, 2, 3, 64)
    assert not np.array_equal(signs, hadamard_signs(2, 2, 3, 64))  # the seed matters


def rotated_payload() -> bytes:
    snap = snapshot(20)
    return encode(snap, np.full(20, Tier.INT3, np.uint8), rotation=ROTATED)


@pytest.mark.parametrize(
    "change, error, field",
    [
        (lambda r: r.update(kind="givens"), KVUnsupportedError, "rotation.kind"),
        (lambda r: r.update(seed=-1), KVMalformedError, "rotation.seed"),
        (lambda r: r.update(seed=2**32), KVMalformedError, "rotation.seed"),
        (lambda r: r.update(tiers=["int3", "INT3"]), KVMalformedError, "rotation.tiers"),
        (lambda r: r.update(tiers=["fp16"]), KVMalformedError, "rotation.tiers"),
        (lambda r: r.update(tiers=[]), KVMalformedError, "rotation.tiers"),
        (lambda r: r.pop("kind"), KVMalformedError, "rotation.kind"),
        (lambda r: r.update(block=24), KVMalformedError, "rotation.block"),
        (lambda r: r.update(block=1), KVMalformedError, "rotation.block"),
        (lambda r: r.update(block=32), KVMalformedError, "rotation"),  # head_dim 16 is not a multiple of 32
    ],
)
def test_bad_rotations_are_typed_errors_naming_their_field(change, error, field) -> None:
    payload = rewrite_header(rotated_payload(), lambda doc: change(doc["rotation"]), 1, 3)
    with pytest.raises(error) as caught:
        read(payload, contract(), 20)
    assert caught.value.field == field


def test_rotation_is_read_from_1_3_on_and_int3_refused_before() -> None:
    """A 1.2 stream's `rotation` is an unknown field (ignored, as a 1.2 reader does); INT3 needs 1.3."""
    snap = snapshot(20)
    int4 = encode(snap, np.full(20, Tier.INT4, np.uint8), rotation=ROTATED)
    as_1_2 = rewrite_header(int4, lambda doc: None, 1, 2)
    reader, _ = read(as_1_2, snap.contract, 20)
    assert reader.finish().rotation is None
    with pytest.raises(KVMalformedError) as caught:
        read(rewrite_header(rotated_payload(), lambda doc: doc.pop("rotation"), 1, 2), contract(), 20)
    assert caught.value.field == "tiers"


def test_rotation_blocks_must_tile_head_dim() -> None:
    snap = snapshot(20, head_dim=24)  # 24 = 3 blocks of 8, not of 16
    layouts = {Tier.INT4: (QuantLayout("channel", 4, 4), QuantLayout("token", 8, 4))}
    with pytest.raises(ValueError, match="multiple of the rotation block"):
        encode(snap, np.full(20, Tier.INT4, np.uint8), layouts=layouts, rotation=ROTATED)
    by8 = Rotation("hadamard", 7, (Tier.INT4,), 8)
    out = decode_snapshot(encode(snap, np.full(20, Tier.INT4, np.uint8), layouts=layouts, rotation=by8), snap.contract)
    assert np.abs(out.values - snap.values).max() < 0.5
    plain = encode(snap, np.full(20, Tier.INT4, np.uint8), layouts=layouts)
    rotation = {"kind": "hadamard", "seed": 1, "block": 16, "tiers": ["int4"]}
    forged = rewrite_header(plain, lambda doc: doc.update(rotation=rotation), 1, 3)
    with pytest.raises(KVMalformedError) as caught:
        read(forged, snap.contract, 20)
    assert caught.value.field == "rotation"


def test_the_default_rotation_rotates_the_tiers_below_int8() -> None:
    assert set(DEFAULT_ROTATION.tiers) == {Tier.INT4, Tier.INT3, Tier.INT2}
    with pytest.raises(ValueError):
        Rotation("hadamard", 1, (Tier.FP16,))
    with pytest.raises(ValueError):
        Rotation("walsh", 1, (Tier.INT4,))
    with pytest.raises(ValueError):
        Rotation("hadamard", 1, (Tier.INT4,), 48)


def test_dequantize_of_int3_matches_its_params_shape() -> None:
    x = np.random.default_rng(3).standard_normal((2, 5, 64)).astype(np.float32)
    layout = QuantLayout("channel", 4, 3)
    codes, scales, zeros = quantize(x, layout)
    assert codes.shape == (2, 5, 24) and scales.shape == (2, *params_shape(layout, 5, 64))
    out = np.empty_like(x)
    dequantize_into(codes, scales, zeros, layout, out)
    assert np.abs(out - x).max() <= scales.astype(np.float32).max() / 2 + 1e-5


@pytest.mark.parametrize(
    "terms, lowbit",
    [({}, False), ({"edkv_minor": 2}, False), ({"edkv_minor": 3}, True), ({"edkv_major": 2, "edkv_minor": 0}, False)]
    + [({"edkv_major": 2, "edkv_minor": 1}, True)],
)
def test_a_receiver_gets_int3_and_rotation_only_when_it_asks_for_1_3(terms: dict, lowbit: bool) -> None:
    from edgedecode.prefill.service import PrefillRequestError, ResumeRequest

    request = ResumeRequest.parse("t1", {"held_tokens": 0, **terms}).for_prompt(np.arange(8))
    assert request.lowbit is lowbit
    with pytest.raises(PrefillRequestError) as caught:
        ResumeRequest.parse("t1", {"held_tokens": 0, "edkv_minor": -1})
    assert caught.value.param == "edkv_minor"


def _mixed_maps(n: int, layers: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    every = [Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2, Tier.DROP]
    mix = rng.choice(every, n).astype(np.uint8)
    per_layer = rng.choice(every[:-1], (layers, n)).astype(np.uint8)
    per_layer[:, mix == Tier.DROP] = Tier.DROP
    return {"int3": np.full(n, Tier.INT3, np.uint8), "mix": mix, "per-layer": per_layer}


@pytest.mark.parametrize("workers", [1, 3])
def test_the_caching_coders_write_the_references_int3_and_rotated_bytes(workers: int) -> None:
    """Payload after payload of one snapshot (what a refit reuses must stay right), plain and rotated; the device
    coder (on the CPU EP) only plain: it leaves 3-bit sections to numpy and is never given a rotation."""
    from edgedecode.kv.wire.coder import CachingCoder
    from edgedecode.prefill.kv_device import DeviceCoder, HostCoder, KVDevice

    snap = snapshot(300, head_dim=64)
    layouts = layouts_with_int3(64)
    device = KVDevice("cpu", 1)
    for rotation in (None, ROTATED):
        coders = {
            "caching": CachingCoder(snap, rotation),
            "host": HostCoder(snap, device, rotation),
            "cpu": device.coder(snap, rotation),  # the section kernel where the kernels library is built
        }
        if rotation is None:
            coders["device"] = DeviceCoder(snap, device)
        for name, tiers in _mixed_maps(300, snap.contract.n_layers).items():
            expected = encode(snap, tiers, layouts=layouts, rotation=rotation, chunk_tokens=64)
            assert version(expected) == (1, 3)
            for kind, coder in coders.items():
                got = encode(snap, tiers, layouts=layouts, rotation=rotation, chunk_tokens=64, coder=coder,
                             workers=workers)  # fmt: skip
                assert got == expected, (name, kind, rotation)


def test_a_coder_made_for_another_rotation_is_refused() -> None:
    from edgedecode.kv.wire.coder import CachingCoder

    snap = snapshot(64, head_dim=64)
    tiers = np.full(64, Tier.INT4, np.uint8)
    for coder, rotation in ((CachingCoder(snap), ROTATED), (CachingCoder(snap, ROTATED), None)):
        with pytest.raises(ValueError, match="rotation"):
            encode(snap, tiers, rotation=rotation, coder=coder)


def test_a_cuda_prefill_node_codes_payloads_with_int3_or_a_rotation_on_the_host() -> None:
    """The device graphs have neither: such a plan goes to the host coder, whose bytes are the reference's. Runs
    anywhere: nothing here touches CUDA (a device coder would, and fail without it)."""
    from edgedecode.kernels.kv_sections import section_kernel
    from edgedecode.kv.policy import TierProfile
    from edgedecode.kv.rotation import DEFAULT_ROTATION
    from edgedecode.prefill.kv_device import DeviceCoder, HostCoder, KVDevice
    from edgedecode.prefill.pipeline import ScoredPrefill, encode_within_budget

    cuda = KVDevice("cuda", 1)
    snap = snapshot(512, head_dim=64)
    for rotation, int3 in ((DEFAULT_ROTATION, False), (None, True), (DEFAULT_ROTATION, True)):
        coder = cuda.coder(snap, rotation, int3)
        assert not isinstance(coder, DeviceCoder) and coder.rotation == rotation
        # the host's coder: the kernels library's section kernel, or without it HostCoder on CPU sessions
        assert coder.kernel is section_kernel() if section_kernel() else coder.device.device == "cpu"
    cpu = KVDevice("cpu", 1)
    on_cpu = cpu.coder(snap, DEFAULT_ROTATION)
    assert on_cpu.kernel is section_kernel() if section_kernel() else isinstance(on_cpu, HostCoder)
    scored = ScoredPrefill(snap, np.random.default_rng(2).random(512).astype(np.float32))
    every = (Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2, Tier.DROP)
    profile = TierProfile(every, dict(zip(every, (0.0, 0.0002, 0.07, 0.12, 0.5, 1.0))))  # INT3 worth its bytes
    for budget in (0.3, 0.2, 0.1):
        reference = encode_within_budget(scored, budget, profile=profile, rotation=DEFAULT_ROTATION)
        assert (reference.tiers == Tier.INT3).any()
        routed = encode_within_budget(
            scored, budget, profile=profile, rotation=DEFAULT_ROTATION, device=cuda, workers=2
        )
        assert routed.frames == reference.frames
        assert version(routed.frames[0]) == (1, 3)


def test_the_daemon_asks_every_segment_for_the_newest_minor_it_reads() -> None:
    """So the prefill server may send it INT3 and rotated tiers (2.1 for a reader of 2, as 1.3 for 1)."""
    from edgedecode.daemon.pull.segment import first_segment, resume_segment
    from edgedecode.kv.wire.frames import LOWBIT_MINOR, READABLE_MAJORS
    from edgedecode.prefill.service import ResumeRequest

    first = first_segment(np.arange(8), 0, 0.2, "ours")
    resume = resume_segment("t1", 4, 0.2, "ours")
    for body in (first.body, resume.body):
        assert body["edkv_major"] == max(READABLE_MAJORS) and body["edkv_minor"] == LOWBIT_MINOR[body["edkv_major"]]
    assert ResumeRequest.parse("t1", resume.body).for_prompt(np.arange(8)).lowbit
