"""The EDKV section coders write the reference's bytes: numpy's quantizer against the one it replaced, the caching
coder and the onnxruntime coders (``prefill/kv_device.py``: the device coder runs on the CPU EP here, as on a GPU
it runs on the CUDA EP) against the reference coder, payload after payload of one snapshot, on any number of
threads; frames stream in order as chunks finish, and no Python runs per token."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from itertools import pairwise

import numpy as np
import pytest

from edgedecode.kv.quant import DEFAULT_LAYOUTS, QuantLayout, quantize
from edgedecode.kv.quant import _round_fp16 as round_fp16
from edgedecode.kv.quant_graph import quant_graph, range_graph
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.stage_clock import StageClock
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import decode_snapshot, encode_payload
from edgedecode.kv.wire.coder import CachingCoder, SectionCoder
from edgedecode.model.spec import KVContract, KVLayout
from edgedecode.prefill.kv_device import DEVICE_BITS, DeviceCoder, HostCoder, KVDevice
from edgedecode.runtime.session import create_session

LAYERS, HEADS, DIM = 6, 2, 64
WINDOWED = (0, 1, 3, 4)  # sliding-window layers of the windowed contract
LAYOUTS = [layout for pair in DEFAULT_LAYOUTS.values() for layout in pair] + [
    QuantLayout("channel", 16, 8),
    QuantLayout("token", 16, 2),
]
DEVICE_LAYOUTS = [layout for layout in LAYOUTS if layout.bits in DEVICE_BITS]  # the graphs have no 3-bit codes


# -- the oracle: kv/quant.py's quantizer as it was before it was made faster (rint, clip, cast; nextafter rounding)


def _oracle_round_fp16(v: np.ndarray, up: bool) -> np.ndarray:
    h = v.astype(np.float16)
    wrong = h.astype(v.dtype) < v if up else h.astype(v.dtype) > v
    h[wrong] = np.nextafter(h[wrong], np.float16(np.inf if up else -np.inf))
    return h


def _oracle_quantize(x: np.ndarray, layout: QuantLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = np.ascontiguousarray(x, np.float32)
    *lead, m, d = x.shape
    g = layout.group
    if layout.axis == "token":
        starts = np.arange(0, x.size, g)
        lo = np.minimum.reduceat(x.reshape(-1), starts).reshape(*lead, m, d // g)
        hi = np.maximum.reduceat(x.reshape(-1), starts).reshape(*lead, m, d // g)
        expand = lambda p: np.repeat(p, g, axis=-1)  # noqa: E731
    else:
        bounds = list(range(0, m, g)) + [m]
        lo = np.stack([x[..., a:b, :].min(axis=-2) for a, b in pairwise(bounds)], axis=-2)
        hi = np.stack([x[..., a:b, :].max(axis=-2) for a, b in pairwise(bounds)], axis=-2)
        expand = lambda p: np.repeat(p, g, axis=-2)[..., :m, :]  # noqa: E731
    zeros = _oracle_round_fp16(lo, up=False)
    scales = _oracle_round_fp16(np.maximum((hi.astype(np.float64) - zeros) / ((1 << layout.bits) - 1), 2.0**-24), True)
    q = (x - expand(zeros).astype(np.float32)) / expand(scales).astype(np.float32)
    q = np.clip(np.rint(q), 0, (1 << layout.bits) - 1).astype(np.uint8)
    return _oracle_pack(q, layout.bits), scales, zeros


def _oracle_pack(q: np.ndarray, bits: int) -> np.ndarray:
    if bits == 3:  # two planes: the low two bits as 2-bit codes, then the high bits, eight per byte
        return np.concatenate([_oracle_pack(q & 3, 2), _oracle_pack(q >> 2, 1)], axis=-1)
    per = 8 // bits
    return sum(q[..., lane::per].astype(np.uint16) << (bits * lane) for lane in range(per)).astype(np.uint8)


def _awkward(rng: np.random.Generator, shape: tuple[int, ...], zeros: bool = True, dtype=np.float32) -> np.ndarray:
    """Values across float16's whole range, binade edges, constant groups, ties, and (``zeros``) zeros of both
    signs, whose minimum's sign only numpy's reductions decide."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-28, 15, shape))
    x = np.clip(x, -65504, 65504).astype(np.float32)
    flat = x.reshape(-1, x.shape[-1])
    flat[::7] = np.round(flat[::7] * 8) / 8  # exact ties once scaled
    flat[1::11] = 1.0  # constant rows
    flat[4::19, 0], flat[4::19, 1] = 65504, -65504
    if zeros:
        flat[2::13, :32] = -0.0
        flat[3::17, ::2] = 0.0
    x = x.astype(dtype)
    if not zeros:
        x[x == 0] = 0.5  # tiny values round to zero in float16
    return x


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_quantize_writes_the_bytes_of_the_quantizer_it_replaced(layout, dtype):
    rng = np.random.default_rng(7)
    for m in (1, 5, 16, 33, 64):
        x = _awkward(rng, (2, 3, m, DIM), dtype=dtype)
        ours, theirs = quantize(x, layout), _oracle_quantize(x, layout)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()


def test_float16_rounding_matches_nextafter_at_every_float16_and_its_neighbours():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    every = every[np.isfinite(every)]
    values = [every.astype(np.float64)]
    for dtype in (np.float32, np.float64):
        wide = every.astype(dtype)
        values += [np.nextafter(wide, dtype(np.inf)).astype(np.float64), np.nextafter(wide, dtype(-np.inf))]
    values.append(np.random.default_rng(1).uniform(-65504, 65504, 100_000))
    v = np.concatenate(values)
    v = v[np.abs(v) <= 65504]
    for dtype in (np.float32, np.float64):
        x = v.astype(dtype)
        for up in (False, True):
            assert round_fp16(x, up).view(np.uint16).tobytes() == _oracle_round_fp16(x, up).view(np.uint16).tobytes()


@pytest.mark.parametrize("layout", DEVICE_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_quantizer_graph_writes_numpys_bytes_on_the_cpu_ep(layout, dtype):
    """Where no group's minimum is zero; where one is, the graph counts it (``zero_groups``), and the device coder
    leaves that section to numpy (tested with the payloads below)."""
    rng = np.random.default_rng(3)
    session = create_session(quant_graph(layout, dtype).SerializeToString(), threads=1)
    layers = np.array([2, 0, 3], np.int64)
    tokens = np.sort(rng.choice(90, 37, replace=False)).astype(np.int64)
    padded = np.concatenate([tokens, np.repeat(tokens[-1:], -len(tokens) % layout.group)])
    feeds = {"layers": layers, "tokens": padded if layout.axis == "channel" else tokens}
    outputs = ["codes", "scales", "zeros", "bad", "zero_groups"]
    for zeros in (False, True):
        rows = _awkward(rng, (4, 2, 90, DIM), zeros, dtype)
        codes, scales, zero_points, bad, zero_groups = session.run(outputs, {"rows": rows, **feeds})
        ref = quantize(rows[layers][:, :, tokens], layout)
        assert bad == 0 and (zero_groups > 0) == zeros
        if not zeros:
            groups = ref[1].shape[2]
            assert codes[:, :, : len(tokens)].tobytes() == ref[0].tobytes()
            assert scales[:, :, :groups].tobytes() == ref[1].tobytes()
            assert zero_points[:, :, :groups].tobytes() == ref[2].tobytes()


def test_the_range_graph_flags_a_nan_numpys_reductions_would_see():
    x = np.ones((1, 1, 32, DIM), np.float32)
    x[0, 0, 3, 5] = np.nan
    session = create_session(range_graph(QuantLayout("token", 32, 4)).SerializeToString(), threads=1)
    assert np.isnan(session.run(["total"], {"x": x})[0])


# -- payloads


def _snapshot(n: int, dtype=np.float32, seed: int = 0, windowed: bool = False) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    window = {"sliding_window": 8, "sliding_layers": WINDOWED} if windowed else {}
    contract = KVContract("llama", LAYERS, HEADS, DIM, 10000.0, KVLayout(), "synthetic", **window)
    shape = (LAYERS, HEADS, n, DIM)
    keys = (rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, (1, HEADS, 1, DIM)))).astype(dtype)
    values = rng.standard_normal(shape).astype(dtype)
    keys[1, 0, 5:9] = 0.0  # groups whose minimum is zero
    values[2, 1, 3, :32] = -0.0
    ids = np.arange(n, dtype=np.int64)
    return KVSnapshot(contract, ids, ids.copy(), keys, values, KVProducer("synthetic", "0" * 64, "float32"))


def _tier_maps(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    mix = rng.choice([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2, Tier.DROP], n, p=[0.1, 0.2, 0.5, 0.1, 0.1])
    per_layer = rng.choice([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2], (LAYERS, n)).astype(np.uint8)
    per_layer[:, mix == Tier.DROP] = Tier.DROP
    return {
        "int4": np.full(n, Tier.INT4, np.uint8),
        "mix": mix.astype(np.uint8),
        "per-layer": per_layer,
        "fp16": np.zeros(n, np.uint8),
    }


def _coders(snapshot: KVSnapshot, device: KVDevice) -> dict[str, SectionCoder]:
    return {
        "caching": CachingCoder(snapshot),
        "host": HostCoder(snapshot, device),
        "device": DeviceCoder(snapshot, device),
        "cpu": device.coder(snapshot),  # the CPU node's: the kernels library's section kernel where it is built
    }


@pytest.fixture(scope="module")
def device():
    return KVDevice("cpu", 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("workers", [1, 3])
def test_every_coder_writes_the_reference_bytes_payload_after_payload(device, dtype, workers):
    n = 300
    snapshot = _snapshot(n, dtype)
    coders = _coders(snapshot, device)
    for name, tiers in _tier_maps(n).items():  # one coder each for all maps: what refits reuse must stay right
        expected = b"".join(encode_payload(snapshot, tiers, chunk_tokens=64))
        for kind, coder in coders.items():
            got = b"".join(encode_payload(snapshot, tiers, chunk_tokens=64, coder=coder, workers=workers))
            assert got == expected, (name, kind)


def test_windowed_payloads_and_layer_groups_too(device):
    n = 200
    snapshot = _snapshot(n, windowed=True)
    coders = _coders(snapshot, device)
    tiers = _tier_maps(n)["mix"]
    tiers[-40:] = Tier.INT8  # the tail is never dropped
    for start in (0, 120, 150):
        for chunk_layers in (None, 4):
            args = {"chunk_tokens": 64, "chunk_layers": chunk_layers, "window_start": start}
            expected = b"".join(encode_payload(snapshot, tiers, **args))
            for kind, coder in coders.items():
                assert b"".join(encode_payload(snapshot, tiers, coder=coder, workers=2, **args)) == expected, kind


def test_a_refit_reuses_unchanged_chunks_and_tokens(device):
    n = 512
    snapshot = _snapshot(n)
    tiers = np.full(n, Tier.INT4, np.uint8)
    coder = CountingCoder(snapshot)
    list(encode_payload(snapshot, tiers, chunk_tokens=128, coder=coder))
    first = coder.computed.copy()
    tiers[300] = Tier.INT8  # one chunk changes
    again = b"".join(encode_payload(snapshot, tiers, chunk_tokens=128, coder=coder))
    assert again == b"".join(encode_payload(snapshot, tiers, chunk_tokens=128))
    assert first == {"tokens": 4, "sections": 4}  # 4 chunks: V's tokens (cached per token), K's section
    # the changed chunk only: the INT8 token's K and V, and its new INT4 K section; its INT4 V tokens are known
    assert coder.computed == {"tokens": 6, "sections": 5}


def test_a_prediction_from_every_chunk_is_the_payloads_size_and_from_a_sample_is_near_it():
    n = 1024
    snapshot = _snapshot(n)
    tiers = np.random.default_rng(3).choice([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2], n).astype(np.uint8)
    size = len(b"".join(encode_payload(snapshot, tiers, chunk_tokens=64)))
    assert encode_payload(snapshot, tiers, chunk_tokens=64).predicted_bytes(1) == size  # every chunk compressed
    sampled = encode_payload(snapshot, tiers, chunk_tokens=64).predicted_bytes(8)  # 2 of 16 chunks
    assert abs(sampled - size) <= 0.02 * size, (sampled, size)
    with pytest.raises(ValueError, match="sample_every"):
        encode_payload(snapshot, tiers).predicted_bytes(0)


def test_the_chunks_a_prediction_sampled_are_kept_for_the_payload_that_follows():
    n = 1024
    snapshot = _snapshot(n)
    tiers = np.full(n, Tier.INT4, np.uint8)
    coder = CountingCoder(snapshot)
    clock = StageClock()
    encode_payload(snapshot, tiers, chunk_tokens=128, coder=coder, clock=clock).predicted_bytes(4)  # 2 of 8 chunks
    assert coder.computed["sections"] == 2 and clock.calls["sample"] == 1  # their K sections (INT4: channel axis)
    payload = b"".join(encode_payload(snapshot, tiers, chunk_tokens=128, coder=coder))
    assert payload == b"".join(encode_payload(snapshot, tiers, chunk_tokens=128))
    assert coder.computed["sections"] == 8  # the other 6 chunks' only: the sampled two were kept


class CountingCoder(CachingCoder):
    """A caching coder that counts what it computes."""

    def __init__(self, snapshot: KVSnapshot) -> None:
        super().__init__(snapshot)
        self.computed = {"tokens": 0, "sections": 0}
        self.prepared: list[int] = []

    def quantized_tokens(self, kv, layout, l0, l1, tokens, rotated=False):
        self.computed["tokens"] += 1
        return super().quantized_tokens(kv, layout, l0, l1, tokens, rotated)

    def quantized_sections(self, kv, layout, l0, l1, token_lists, rotated=False):
        self.computed["sections"] += len(token_lists)
        return super().quantized_sections(kv, layout, l0, l1, token_lists, rotated)

    def prepare(self, plans):
        self.prepared += [int(p.sections[0].tokens[0]) for p in plans if p.sections]
        super().prepare(plans)


def test_the_first_chunk_leaves_before_the_last_is_quantized():
    n = 64 * 16
    snapshot = _snapshot(n)
    coder = CountingCoder(snapshot)
    frames = iter(encode_payload(snapshot, np.full(n, Tier.INT4, np.uint8), chunk_tokens=64, coder=coder, workers=2))
    next(frames)  # the header
    next(frames)  # chunk 0
    assert 0 in coder.prepared and n - 64 not in coder.prepared  # at most workers + 1 waves ahead
    # distinct chunks: a chunk's fill asks prepare again (a no-op once its wave computed it), whenever its task runs
    assert len(set(coder.prepared)) <= 2 + 1 + 1
    rest = list(frames)
    assert len(rest) == 16 and set(coder.prepared) == set(range(0, n, 64))  # every chunk, in any order


class WideWaveCoder(CachingCoder):
    """A caching coder that prepares eight chunks a wave, as a device coder does, slowly, and notes which thread
    fills each chunk."""

    wave_chunks = 8

    def __init__(self, snapshot: KVSnapshot) -> None:
        super().__init__(snapshot)
        self.fillers: set[int] = set()

    def prepare(self, plans):
        if len(plans) > 1:
            time.sleep(0.2)  # the wave's chunks are queued meanwhile
        super().prepare(plans)

    def fill(self, raw, plan):
        self.fillers.add(threading.get_ident())
        super().fill(raw, plan)


def test_a_wide_wave_is_compressed_on_several_workers():
    n = 64 * 8
    snapshot = _snapshot(n)
    coder = WideWaveCoder(snapshot)
    tiers = np.full(n, Tier.INT4, np.uint8)
    got = b"".join(encode_payload(snapshot, tiers, chunk_tokens=64, coder=coder, workers=4))
    assert got == b"".join(encode_payload(snapshot, tiers, chunk_tokens=64))
    assert len(coder.fillers) > 1  # one wave, its eight chunks filled and compressed side by side


def test_coders_on_many_threads_at_once_stay_exact(device):
    """Payloads of two snapshots encoded concurrently, each on several writer threads, through one KVDevice
    (its onnxruntime sessions shared): every payload is the reference's."""
    snapshots = [_snapshot(256, seed=s) for s in (1, 2)]
    tiers = _tier_maps(256)["mix"]
    expected = [b"".join(encode_payload(s, tiers, chunk_tokens=16)) for s in snapshots]
    results: list[list[bytes]] = [[], []]

    def run(i: int) -> None:
        coder = DeviceCoder(snapshots[i], device) if i else HostCoder(snapshots[i], device)
        for _ in range(3):
            frames = encode_payload(snapshots[i], tiers, chunk_tokens=16, coder=coder, workers=4)
            results[i].append(b"".join(frames))

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got == expected[i] for i in (0, 1) for got in results[i])
    assert len(results[0]) == len(results[1]) == 3


def _python_calls(snapshot: KVSnapshot, tiers: np.ndarray, chunk_tokens: int, coder: SectionCoder) -> int:
    list(encode_payload(snapshot, tiers, chunk_tokens=chunk_tokens))  # first calls import and cache things
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        list(encode_payload(snapshot, tiers, chunk_tokens=chunk_tokens, coder=coder))
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("kind", ["reference", "host"])
def test_no_python_runs_per_token(device, kind):
    """Eight times the tokens in as many chunks, the same tier pattern in each: as many Python calls, give or take
    the branches a section's length takes (a partial channel group or none); one call a token would add 1792."""
    counts = []
    for n in (256, 2048):
        snapshot = _snapshot(n)
        pattern = _tier_maps(64)["mix"]
        tiers = np.tile(pattern, n // 64)
        coder = SectionCoder(snapshot) if kind == "reference" else HostCoder(snapshot, device)
        counts.append(_python_calls(snapshot, tiers, n // 4, coder))
    assert abs(counts[1] - counts[0]) <= 64


def test_device_coder_errors_are_the_references(device):
    n = 128
    for tier, where, message in (
        (Tier.FP16, (0, 1, 0, 5, 3), "not finite in float16"),  # (K or V, layer, head, token, channel)
        (Tier.INT4, (0, 0, 1, 7, 2), "non-finite"),
        (Tier.INT4, (1, 0, 1, 7, 2), "non-finite"),
        (Tier.INT8, (1, 1, 0, 9, 0), "non-finite"),
    ):
        snapshot = _snapshot(n)
        part = snapshot.keys if where[0] == 0 else snapshot.values
        part[where[1:]] = np.inf
        tiers = np.full(n, tier, np.uint8)
        for coder in (None, *_coders(snapshot, device).values()):
            with pytest.raises(ValueError, match=message):
                list(encode_payload(snapshot, tiers, chunk_tokens=64, coder=coder))
    snapshot = _snapshot(n)
    snapshot.values[2, 0, 4, 1] = 65520.0  # rounds to infinity in float16
    for coder in (None, *_coders(snapshot, device).values()):
        with pytest.raises(ValueError, match="not finite in float16"):
            list(encode_payload(snapshot, np.zeros(n, np.uint8), chunk_tokens=64, coder=coder))


def test_a_coder_belongs_to_its_snapshot(device):
    snapshot = _snapshot(64)
    other = dataclasses.replace(snapshot, values=snapshot.values.copy())
    with pytest.raises(ValueError, match="another snapshot"):
        encode_payload(other, np.zeros(64, np.uint8), coder=HostCoder(snapshot, device))


def test_what_the_device_coder_writes_decodes_as_the_references(device):
    snapshot = _snapshot(192, np.float16)
    tiers = _tier_maps(192)["mix"]
    payload = b"".join(encode_payload(snapshot, tiers, coder=DeviceCoder(snapshot, device), workers=2))
    ours = decode_snapshot(payload, snapshot.contract)
    theirs = decode_snapshot(b"".join(encode_payload(snapshot, tiers)), snapshot.contract)
    assert np.array_equal(ours.keys, theirs.keys) and np.array_equal(ours.values, theirs.values)


def test_chunks_without_8_bit_codes_take_the_fast_level_and_decode_the_same(device):
    n = 256
    sparse = _snapshot(n)
    rng = np.random.default_rng(1)
    keys, values = (np.where(rng.random(x.shape) < 0.7, np.float32(0), x) for x in (sparse.keys, sparse.values))
    snapshot = dataclasses.replace(sparse, keys=keys, values=values)  # compressible: zstd's levels differ on it
    tiers = np.full(n, Tier.INT4, np.uint8)
    tiers[64:128:2], tiers[65:128:2] = Tier.INT2, Tier.DROP
    tiers[128:192] = Tier.FP16
    tiers[200] = Tier.INT8  # chunk 3: one INT8 token takes the chunk to the payload's level
    args = {"chunk_tokens": 64, "workers": 2}
    mixed = list(encode_payload(snapshot, tiers, level=3, fast_level=1, coder=HostCoder(snapshot, device), **args))
    level1 = list(encode_payload(snapshot, tiers, level=1, **args))
    level3 = list(encode_payload(snapshot, tiers, level=3, **args))
    assert level1[1] != level3[1] and level1[4] != level3[4]  # the levels give other bytes here
    assert mixed[0] == level3[0]  # the header names the payload's level
    assert mixed[1:4] == level1[1:4] and mixed[4] == level3[4]  # the trailers differ: they hash every frame
    ours, theirs = (decode_snapshot(b"".join(p), snapshot.contract) for p in (mixed, level3))
    assert np.array_equal(ours.keys, theirs.keys) and np.array_equal(ours.values, theirs.values)


def _on_cuda(test):
    """Mark a test as needing onnxruntime-gpu and a CUDA device (skipped elsewhere)."""
    from edgedecode.runtime.session import available_devices

    needs = pytest.mark.skipif("cuda" not in available_devices(), reason="needs onnxruntime-gpu with a CUDA device")
    return pytest.mark.gpu(needs(test))


@_on_cuda
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_cuda_device_coder_writes_the_reference_bytes(dtype):
    """The same bytes from the CUDA EP's kernels: IEEE division, round half to even, exact float64 params."""
    cuda = KVDevice("cuda", 1)
    for windowed in (False, True):
        snapshot = _snapshot(640, dtype, seed=3, windowed=windowed)
        coder = DeviceCoder(snapshot, cuda)
        for name, tiers in _tier_maps(640).items():
            tiers = tiers.copy()
            tiers[..., -40:] = Tier.INT8  # a windowed tail is never dropped
            start = 500 if windowed else None
            expected = b"".join(encode_payload(snapshot, tiers, chunk_tokens=128, window_start=start))
            got = encode_payload(snapshot, tiers, chunk_tokens=128, window_start=start, coder=coder, workers=4)
            assert b"".join(got) == expected, (name, windowed)
    data = np.random.default_rng(0).standard_normal((4, 2, 4096, DIM)).astype(np.float32)
    for layout in DEVICE_LAYOUTS:  # many groups, every layout the graphs compute
        session = cuda.session(("test-quant", layout), lambda layout=layout: quant_graph(layout, np.float32))
        outputs = ["codes", "scales", "zeros", "zero_groups"]
        tokens = np.arange(4096, dtype=np.int64)
        codes, scales, zeros, zero_groups = session.run(
            outputs, {"rows": data, "layers": np.arange(4), "tokens": tokens}
        )
        ref = quantize(data, layout)
        assert zero_groups == 0
        assert (codes.tobytes(), scales.tobytes(), zeros.tobytes()) == tuple(a.tobytes() for a in ref)
