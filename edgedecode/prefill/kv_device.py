"""The prefill node's KV work on its own device: token scoring and EDKV section encoding through onnxruntime.

* ``KVDevice.importance``: the observation window's attention per token (``kv/importance_graph.py``), on the
  engine's device. On the CPU it replaces numpy's batched matmul, whose BLAS threads spin against onnxruntime's on
  a shared box (4k tokens: 0.13 s of CPU against 0.8–1.4 s, `tools/bench/prefill_stages.py`).
* ``KVDevice.coder``: what fills EDKV chunks (``kv/wire/coder.py``). On the CPU, a ``KeepingCoder`` with the
  kernels library's section kernel (``kernels/kv_sections.py``: each section in one pass of C over its rows,
  straight into the chunk; compressed chunks kept across the fit's refits), or where the library is not built,
  ``HostCoder``: numpy's quantizers and onnxruntime's float16 cast (MLAS, F16C: ~17× numpy's). On CUDA,
  ``DeviceCoder``: the snapshot is uploaded once and every section is computed there by the graphs of
  ``kv/quant_graph.py``, a wave of chunks per run; only packed codes, scales and float16 rows come back, and the host
  compresses them. The device graphs have no 3-bit codes and no rotation (EDKV 1.3): a payload that may use either
  is coded on the host instead.

All write byte for byte the reference's chunks (tests/test_kv_device.py runs ``DeviceCoder`` on the CPU EP;
tests/test_kv_sections.py the section kernel).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import onnx

from edgedecode.kernels.kv_sections import crc32_function, section_kernel
from edgedecode.kv.importance_graph import hidden_bias, importance_graph, observation_queries
from edgedecode.kv.quant import QuantLayout, numpy_group_range, quantize, widen_fp16
from edgedecode.kv.quant_graph import fp16_graph, quant_graph, range_graph
from edgedecode.kv.rotation import Rotation
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire.coder import CachingCoder, KeepingCoder, SectionCoder, fp16_error
from edgedecode.model.onnx_builder import GraphBuilder
from edgedecode.model.spec import ModelSpec
from edgedecode.runtime.session import create_session, import_onnxruntime

SCORE_LAYERS = 8  # layers scored per run: bounds the attention weights held at once (8 × H × G·w × n floats)
DEVICE_WAVE_CHUNKS = 8  # chunks a device run encodes at once: fewer, larger runs
DEVICE_BITS = (2, 4, 8)  # the code widths ``quant_graph`` packs (not 3: its two bit planes are numpy's alone)


class KVDevice:
    """onnxruntime sessions for scoring and encoding on ``device`` ("cpu" or "cuda"), built on first use."""

    def __init__(self, device: str = "cpu", threads: int = 1) -> None:
        self.device = device
        self.threads = threads
        self._sessions: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self._host: KVDevice | None = None if device == "cpu" else KVDevice("cpu", threads)

    def session(self, key: tuple, build: Callable[[], onnx.ModelProto], threads: int | None = None):
        """The session of the graph ``build`` makes, once per ``key`` (``threads``: this device's by default)."""
        with self._lock:
            if key not in self._sessions:
                model = build().SerializeToString()
                self._sessions[key] = create_session(model, device=self.device, threads=threads or self.threads)
            return self._sessions[key]

    def importance(
        self, spec: ModelSpec, queries: np.ndarray, query_positions: np.ndarray, snapshot: KVSnapshot
    ) -> np.ndarray:
        """``importance.attention_importance`` [layers, n] of the pre-RoPE ``queries`` at ``query_positions``
        over ``snapshot``'s keys, computed on this device."""
        keys = snapshot.keys
        window = queries.shape[1]
        on_device = self.device != "cpu"
        session = self.session(
            ("importance", keys.dtype.str, window, on_device), lambda: importance_graph(keys.dtype, on_device, window)
        )
        hidden = hidden_bias(query_positions, snapshot.positions)
        bound = _on_device(keys, self.device) if on_device else None
        scores = np.empty((spec.n_layers, snapshot.n_tokens), np.float32)
        for start in range(0, spec.n_layers, SCORE_LAYERS):
            layers = range(start, min(start + SCORE_LAYERS, spec.n_layers))
            feeds = {"queries": observation_queries(spec, queries, query_positions, layers), "hidden": hidden}
            if bound is None:
                feeds["keys"] = np.ascontiguousarray(keys[layers.start : layers.stop])
                scores[layers.start : layers.stop] = session.run(["importance"], feeds)[0]
                continue
            io = session.io_binding()
            io.bind_ortvalue_input("keys", bound)
            for name, value in (*feeds.items(), ("layers", np.arange(layers.start, layers.stop))):
                io.bind_cpu_input(name, value)
            io.bind_output("importance", "cpu")
            session.run_with_iobinding(io)
            scores[layers.start : layers.stop] = io.copy_outputs_to_cpu()[0]
        return scores

    def coder(self, snapshot: KVSnapshot, rotation: Rotation | None = None, int3: bool = False) -> SectionCoder:
        """What fills the EDKV chunks of ``snapshot``'s payloads (``rotation``: theirs, EDKV 1.3) on this device;
        on the host where the payloads may hold what the device graphs do not compute: a rotation, or INT3
        sections (``int3``)."""
        if self._host is None:
            return self.host_coder(snapshot, rotation)
        if rotation is not None or int3:
            return self._host.host_coder(snapshot, rotation)
        return DeviceCoder(snapshot, self)

    def host_coder(self, snapshot: KVSnapshot, rotation: Rotation | None = None) -> SectionCoder:
        """The CPU's coder: the kernels library's section kernel and CRC-32, chunks kept across payloads; without
        the library, or for a float16 snapshot (the kernel reads float32 rows), ``HostCoder`` on this (CPU) device's
        sessions."""
        kernel = section_kernel()
        if kernel is None or snapshot.keys.dtype != np.float32 or snapshot.values.dtype != np.float32:
            return HostCoder(snapshot, self, rotation)
        return KeepingCoder(snapshot, rotation, kernel, crc32_function())


class HostCoder(CachingCoder):
    """The CPU's coder: numpy's quantizers (``kv/quant.py``) with each group's minimum and maximum from onnxruntime
    (a fifth of the time of numpy's reduceat over 32-value groups), and onnxruntime's cast to float16."""

    def __init__(self, snapshot: KVSnapshot, device: KVDevice, rotation: Rotation | None = None) -> None:
        super().__init__(snapshot, rotation)
        self.device = device

    def quantized(
        self, kv: int, layout: QuantLayout, l0: int, l1: int, tokens: np.ndarray, rotated: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One section, its group ranges from onnxruntime: on a gather padded to whole channel groups with copies
        of the last token (which change no group's minimum or maximum), quantized without the padding."""
        pad = -len(tokens) % layout.group if layout.axis == "channel" else 0
        padded = np.concatenate([tokens, np.repeat(tokens[-1:], pad)]) if pad else tokens
        rows = self.gathered(kv, l0, l1, padded, rotated)
        if rows.dtype == np.float16:
            rows = widen_fp16(rows)
        lo, hi = self._group_range(rows, layout)
        return quantize(rows[:, :, : len(tokens)], layout, lambda x, layout: (lo, hi))

    def _group_range(self, x: np.ndarray, layout: QuantLayout) -> tuple[np.ndarray, np.ndarray]:
        """onnxruntime's (min, max) per group of C-contiguous ``x``, or numpy's where a NaN could hide from them or
        a group's minimum is zero (whose sign numpy's reduction decides)."""
        session = self.device.session(("range", layout), lambda: range_graph(layout), threads=1)
        lo, hi, total = session.run(["lo", "hi", "total"], {"x": x})
        if not (np.isfinite(total) and lo.all()):
            return numpy_group_range(x, layout)
        return lo, hi

    def to_fp16(self, rows: np.ndarray) -> np.ndarray:
        if rows.dtype == np.float16:
            return rows
        # one thread: the writer's workers cast their own chunks side by side
        session = self.device.session(("cast-fp16",), _cast_graph, threads=1)
        return session.run(["fp16"], {"rows": rows.reshape(-1)})[0].reshape(rows.shape)


class DeviceCoder(CachingCoder):
    """Every section computed on the device from the snapshot uploaded once; the numpy reference takes over only
    for a section it must refuse (to raise the reference's error), one with a group whose minimum is ±0, or one of
    3-bit codes (which ``KVDevice.coder`` sends to ``HostCoder`` before they get here). No rotation."""

    wave_chunks = DEVICE_WAVE_CHUNKS

    def __init__(self, snapshot: KVSnapshot, device: KVDevice) -> None:
        super().__init__(snapshot)
        self.device = device
        self._bound = [_on_device(part, device.device) for part in (snapshot.keys, snapshot.values)]

    def quantized_tokens(
        self, kv: int, layout: QuantLayout, l0: int, l1: int, tokens: np.ndarray, rotated: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if layout.bits not in DEVICE_BITS:
            return super().quantized_tokens(kv, layout, l0, l1, tokens)
        codes, scales, zeros, bad, zero_groups = self._run_quant(kv, layout, l0, l1, tokens)
        if bad or zero_groups:
            return super().quantized_tokens(kv, layout, l0, l1, tokens)
        return codes, scales, zeros

    def quantized_sections(
        self,
        kv: int,
        layout: QuantLayout,
        l0: int,
        l1: int,
        token_lists: list[np.ndarray],
        rotated: bool = False,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The sections in one run: each token list padded to whole groups with its last token, which changes no
        group's minimum or maximum; the padding's codes are dropped."""
        if layout.bits not in DEVICE_BITS:
            return super().quantized_sections(kv, layout, l0, l1, token_lists)
        group = layout.group
        padded = [np.concatenate([t, np.repeat(t[-1:], -len(t) % group)]) for t in token_lists]
        codes, scales, zeros, bad, zero_groups = self._run_quant(kv, layout, l0, l1, np.concatenate(padded))
        if bad or zero_groups:
            return super().quantized_sections(kv, layout, l0, l1, token_lists)
        rows = np.cumsum([0, *(len(p) for p in padded)])
        return [
            (codes[:, :, a : a + len(t)], scales[:, :, a // group : b // group], zeros[:, :, a // group : b // group])
            for t, a, b in zip(token_lists, rows[:-1], rows[1:])
        ]

    def fp16_sections(self, kv: int, l0: int, l1: int, token_lists: list[np.ndarray]) -> list[np.ndarray]:
        dtype = self._source(kv).dtype
        session = self.device.session(("fp16", dtype.str), lambda: fp16_graph(dtype))
        rows, largest, total = self._run(session, kv, l0, l1, np.concatenate(token_lists), ("fp16", "largest", "total"))
        if np.isinf(largest) or np.isnan(total):
            raise fp16_error(kv, l0, l1)
        return np.split(rows, np.cumsum([len(t) for t in token_lists])[:-1], axis=2)

    def _run_quant(self, kv: int, layout: QuantLayout, l0: int, l1: int, tokens: np.ndarray) -> tuple:
        dtype = self._source(kv).dtype
        session = self.device.session(("quant", layout, dtype.str), lambda: quant_graph(layout, dtype))
        codes, scales, zeros, bad, zero_groups = self._run(
            session, kv, l0, l1, tokens, ("codes", "scales", "zeros", "bad", "zero_groups")
        )
        return codes, scales, zeros, float(bad) != 0, float(zero_groups) != 0

    def _run(self, session, kv: int, l0: int, l1: int, tokens: np.ndarray, outputs: tuple[str, ...]) -> list:
        io = session.io_binding()
        io.bind_ortvalue_input("rows", self._bound[kv])
        io.bind_cpu_input("layers", np.arange(l0, l1, dtype=np.int64))
        io.bind_cpu_input("tokens", np.ascontiguousarray(tokens, np.int64))
        for name in outputs:
            io.bind_output(name, "cpu")
        session.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()


def _on_device(array: np.ndarray, device: str):
    """``array`` as an OrtValue on ``device`` (on the CPU, over the array's own memory where it is contiguous)."""
    return import_onnxruntime().OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device, 0)


def _cast_graph() -> onnx.ModelProto:
    """float32 ``rows`` [n] -> float16 ``fp16`` [n]."""
    g = GraphBuilder("edkv-cast-fp16")
    rows = g.input("rows", onnx.TensorProto.FLOAT, ["n"])
    g.op("Cast", [rows], outputs=["fp16"], to=onnx.TensorProto.FLOAT16)
    g.output("fp16", onnx.TensorProto.FLOAT16, ["n"])
    return g.model()
