"""The kernels library's EDKV section kernel and CRC-32 (``kernels/kv_sections.py``: ``csrc/kv_quant.c``,
``csrc/crc32.c``) write the reference's bytes: each section against ``kv/quant.py``'s quantizer and numpy's float16
cast, every layout (3-bit codes included) on every CPU path this machine runs; whole payloads, plain and rotated,
payload after payload, against the reference coder, on random KV and on SmolLM2's; what the kernel declines (a group
whose minimum is ±0, values the reference refuses) is the reference's to compute or refuse."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from test_kv_format import snapshot
from test_kv_lowbit import ROTATED, _mixed_maps, encode, layouts_with_int3
from tool_modules import import_tools

from edgedecode import kernels
from edgedecode.kernels import kv_sections
from edgedecode.kernels.kv_sections import crc32_function, section_kernel
from edgedecode.kv.quant import DEFAULT_LAYOUTS, QuantLayout, codes_shape, params_shape, quantize
from edgedecode.kv.rotation import DEFAULT_ROTATION
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import encode_payload
from edgedecode.kv.wire.coder import KeepingCoder
from edgedecode.prefill.kv_device import HostCoder, KVDevice

pytestmark = pytest.mark.skipif(section_kernel() is None, reason=f"no kernels library: {kernels.load().reason}")

LAYOUTS = sorted(
    {layout for pair in (*DEFAULT_LAYOUTS.values(), *layouts_with_int3(16).values()) for layout in pair}
    | {QuantLayout("token", 8, 4), QuantLayout("channel", 1, 8), QuantLayout("channel", 7, 3)},
    key=str,
)


@pytest.fixture(params=["best", "portable"])
def cpu_path(request):
    """Each CPU path of the library: the one it picks here, and the portable C."""
    library = kernels.open_library(kernels.load().path)
    chosen = library.edgedecode_kernels_cpu_isa().decode()
    if request.param == "portable":
        assert library.edgedecode_kernels_set_cpu_isa(b"portable") == 0
    yield library.edgedecode_kernels_cpu_isa().decode()
    library.edgedecode_kernels_set_cpu_isa(chosen.encode())


def _outputs(layout: QuantLayout | None, layers: int, heads: int, m: int, d: int) -> list[np.ndarray]:
    """A section's arrays as a chunk holds them: C-contiguous within a layer, layers further apart, around bytes
    the kernel must not touch."""
    if layout is None:
        shapes = [((m, d), np.float16)]
    else:
        shapes = [(codes_shape(layout, m, d), np.uint8)] + [(params_shape(layout, m, d), np.float16)] * 2
    arrays = []
    for shape, dtype in shapes:
        per_layer = heads * int(np.prod(shape)) * np.dtype(dtype).itemsize
        buffer = np.full(layers * (per_layer + 6) + 3, 0xA5, np.uint8)
        strides = (per_layer + 6, *np.empty((heads, *shape), dtype).strides)
        arrays.append(np.ndarray((layers, heads, *shape), dtype, buffer, 3, strides))
    return arrays


def _reference(rows: np.ndarray, tokens: np.ndarray, layout: QuantLayout | None) -> list[np.ndarray]:
    gathered = rows[:, :, tokens]
    return [gathered.astype(np.float16)] if layout is None else list(quantize(gathered, layout))


def _same(got: list[np.ndarray], expected: list[np.ndarray]) -> bool:
    return all(np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
               for a, b in zip(got, expected))  # fmt: skip


def _kv(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """float32 KV-like values: a spread of magnitudes per head, one outlier channel; or the corner cases of the
    float16 parameters (subnormal scales, ranges near ±65504, constant groups, negative-only groups)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "spread":
        x *= rng.uniform(0.01, 50, (1, shape[1], 1, 1)).astype(np.float32)
        x[..., 3] *= 40
    elif kind == "tiny":
        x *= np.float32(3e-6)  # zeros and scales below float16's smallest normal, 2^-14
    elif kind == "huge":
        x = np.clip(x * 30000, -65504, 65504).astype(np.float32)
    elif kind == "constant":
        x = np.repeat(x[:, :, :1], shape[2], axis=2) + np.float32(0.5)
    elif kind == "negative":
        x = -np.abs(x) - np.float32(0.25)
    return x


@pytest.mark.parametrize("kind", ["spread", "tiny", "huge", "constant", "negative"])
def test_every_section_is_the_references_on_every_cpu_path(cpu_path, kind):
    rng = np.random.default_rng(len(kind))
    for d in (16, 64):
        kv = _kv(kind, (5, 3, 90, d), rng)
        rows = kv[1:4, ::2]  # a strided source: layers sliced, every other head
        for layout in [None, *(lay for lay in LAYOUTS if d % lay.group == 0 or lay.axis == "channel")]:
            for m in (1, 7, 33, 90):
                tokens = np.sort(rng.choice(90, m, replace=False))
                got = _outputs(layout, 3, 2, m, d)
                written = section_kernel()(rows, tokens, layout, got)
                if layout is None and cpu_path == "portable":
                    assert not written  # no F16C: numpy casts
                    continue
                assert written, (cpu_path, kind, layout, m)
                assert _same(got, _reference(rows, tokens, layout)), (cpu_path, kind, d, layout, m)


def test_float16_rows_round_as_numpy_does(cpu_path):
    rng = np.random.default_rng(3)
    edges = np.array([65504, 65519.99, -65519.99, 2.0**-25, 2.0**-24 * 1.5, -(2.0**-26), 1 + 2.0**-11], np.float32)
    kv = (rng.standard_normal((2, 2, 40, 16)) * np.exp(rng.uniform(-20, 8, (2, 2, 40, 1)))).astype(np.float32)
    kv[0, 0, :7, 0] = edges
    tokens = np.arange(40)
    got = _outputs(None, 2, 2, 40, 16)
    fp16 = section_kernel()(kv, tokens, None, got)
    assert fp16 == (cpu_path != "portable")  # F16C's cast, or numpy's
    if fp16:
        assert _same(got, _reference(kv, tokens, None))


def test_it_declines_what_the_reference_decides_or_refuses():
    rng = np.random.default_rng(4)
    kernel = section_kernel()
    tokens = np.arange(32)
    for layout in (QuantLayout("token", 32, 4), QuantLayout("channel", 32, 4), None):
        for value in (np.nan, np.inf, -np.inf, 65520.0, -0.0, 0.0, 65505.0):
            kv = rng.uniform(0.5, 1.0, (1, 1, 32, 64)).astype(np.float32)
            kv[0, 0, 5, 9] = value
            written = kernel(kv, tokens, layout, _outputs(layout, 1, 1, 32, 64))
            if layout is not None:  # a group minimum of ±0 (its sign is numpy's to decide), or a value beyond ±65504
                assert not written, (layout, value)
            elif not abs(value) < 65520.0:  # a float16 cast: what float16 cannot hold (65520 on rounds to infinity)
                assert not written, value
    half = rng.uniform(0.5, 1.0, (1, 1, 32, 64)).astype(np.float16)
    assert not kernel(half, tokens, QuantLayout("token", 32, 4), _outputs(QuantLayout("token", 32, 4), 1, 1, 32, 64))
    strided = [array[:, :, ::2] for array in _outputs(QuantLayout("token", 32, 4), 1, 1, 64, 64)]
    assert not kernel(half.astype(np.float32), tokens, QuantLayout("token", 32, 4), strided)


def _coder(snap, rotation=None, written: list[bool] | None = None) -> KeepingCoder:
    """The CPU prefill node's coder; ``written`` notes what its kernel wrote (True) and declined (False)."""
    kernel = section_kernel()
    assert kernel is not None

    def noted(*args) -> bool:
        done = kernel(*args)
        if written is not None:
            written.append(done)
        return done

    return KeepingCoder(snap, rotation, noted, crc32_function())


@pytest.mark.parametrize("workers", [1, 3])
def test_payloads_are_the_reference_coders_every_tier_plain_and_rotated(workers):
    snap = snapshot(300, head_dim=64)
    for part, zero in ((snap.keys, 0.0), (snap.values, -0.0)):  # groups whose minimum is ±0: numpy's sections
        part[2] = np.abs(part[2])
        part[2, :, ::9, ::5] = zero
    written: list[bool] = []
    for rotation in (None, ROTATED):
        coder = _coder(snap, rotation, written)  # one for every map: what a refit reuses must stay right
        for name, tiers in _mixed_maps(300, snap.contract.n_layers).items():
            expected = encode(snap, tiers, rotation=rotation, chunk_tokens=64)
            got = encode(snap, tiers, rotation=rotation, chunk_tokens=64, coder=coder, workers=workers)
            assert got == expected, (name, rotation)
    assert any(written) and not all(written)  # the kernel wrote sections, and left the ±0 minima to numpy


def test_errors_are_the_references():
    snap = snapshot(64, head_dim=64)
    snap.values[1, 0, 9, 3] = np.inf
    for tier, message in ((Tier.INT4, "non-finite"), (Tier.FP16, "not finite in float16")):
        tiers = np.full(64, tier, np.uint8)
        with pytest.raises(ValueError, match=message):
            encode(snap, tiers)
        with pytest.raises(ValueError, match=message):
            encode(snap, tiers, coder=_coder(snap))


def test_the_crc32_is_zlibs():
    crc32 = crc32_function()
    rng = np.random.default_rng(5)
    for n in (*range(0, 200), 1023, 4096, 65537, 3_000_001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32(data) == zlib.crc32(data), n


def test_a_float16_snapshot_is_coded_as_before():
    """The kernel reads float32 rows: a float16 snapshot (a float16 prefill's export) keeps ``HostCoder``."""
    snap = snapshot(64, head_dim=64)
    half = dataclasses.replace(snap, keys=snap.keys.astype(np.float16), values=snap.values.astype(np.float16))
    assert isinstance(KVDevice("cpu", 1).coder(half), HostCoder)
    assert KVDevice("cpu", 1).coder(snap).kernel is section_kernel()


def test_without_the_library_the_cpu_codes_with_numpy_and_zlib(monkeypatch):
    cached = (kernels.load, kv_sections._library, section_kernel, crc32_function)
    monkeypatch.setenv("EDGEDECODE_KERNELS", "off")
    for function in cached:
        function.cache_clear()
    try:
        snap = snapshot(64, head_dim=64)
        assert section_kernel() is None and crc32_function() is zlib.crc32
        coder = KVDevice("cpu", 1).coder(snap)
        assert isinstance(coder, HostCoder)
        tiers = np.full(64, Tier.INT4, np.uint8)
        assert encode(snap, tiers, coder=coder) == encode(snap, tiers)
    finally:
        monkeypatch.delenv("EDGEDECODE_KERNELS")
        for function in cached:
            function.cache_clear()
    assert section_kernel() is not None


def test_smollm2s_kv_fits_every_budget_to_the_reference_bytes(prefiller, smollm2_model):
    """Real KV (a prefill of 700 tokens): the CPU prefill node's fit, with INT3 and the rotation allowed, gives the
    reference coder's payload at every budget; and every tier alone, plain and rotated, is the reference's."""
    from edgedecode.kv.policy import TierProfile
    from edgedecode.prefill.pipeline import encode_within_budget, prefill_and_score

    (prompts,) = import_tools("bench.prompts")
    scored = prefill_and_score(prefiller, prompts.prompt_tokens(smollm2_model.tokenizer, 700))
    snap = scored.snapshot
    every = (Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2, Tier.DROP)
    profile = TierProfile(every, dict(zip(every, (0.0, 0.0002, 0.07, 0.12, 0.5, 1.0))))
    device = KVDevice("cpu", 1)
    assert device.coder(snap).kernel is section_kernel()
    for budget in (1.0, 0.5, 0.3, 0.2):
        for rotation in (None, DEFAULT_ROTATION):
            args = {"profile": profile, "rotation": rotation}
            expected = encode_within_budget(scored, budget, **args).frames
            assert encode_within_budget(scored, budget, device=device, workers=2, **args).frames == expected
    for tier in every[:-1]:
        tiers = np.full(snap.n_tokens, tier, np.uint8)
        for rotation in (None, DEFAULT_ROTATION):
            expected = b"".join(encode_payload(snap, tiers, rotation=rotation))
            assert b"".join(encode_payload(snap, tiers, rotation=rotation, coder=_coder(snap, rotation))) == expected
