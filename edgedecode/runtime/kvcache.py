"""Preallocated KV buffers shared by a graph's past and present, and KV snapshots that move between graphs.

Each layer's K and V buffer ``[1, kv_heads, max_context, head_dim]`` is bound to onnxruntime as both
``past_key_values.i.*`` and ``present.i.*``, so GroupQueryAttention appends in place and no step
copies the past. On CPU the buffers are slices of one numpy array ``[layers, 2 (k, v), 1, kv_heads,
max_context, head_dim]``, so injecting KV is a slice assignment (no graph run). That array lives in
an anonymous memory map: its pages are only committed as they are written, and ``release_unused``
hands the pages of slots past ``length`` back to the OS, so the process's memory follows the KV held.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.snapshot import KVProducer, KVSnapshot, increasing_positions
from edgedecode.kv.wire.value_check import ValueBounds
from edgedecode.model.onnx_builder import INT64, GraphBuilder, onnx_dtype
from edgedecode.model.spec import ModelSpec
from edgedecode.runtime.session import create_session, import_onnxruntime


class KVInjectionError(EdgeDecodeError):
    """KV offered for injection does not fit this model's contract, buffers or prompt."""


class KVCache:
    """The graph's KV buffers (bound as both past and present) and how many positions are valid.

    On CPU the bound OrtValues alias ``host`` (numpy), so writes and reads are plain slicing. On
    CUDA the KV stays resident on the device: injection writes only the rows given (``DeviceRows``),
    export reads only the rows held (``DeviceExport``).
    """

    def __init__(
        self,
        spec: ModelSpec,
        max_context: int,
        dtype: npt.DTypeLike = np.float32,
        device: str = "cpu",
        value_limits: np.ndarray | None = None,
    ) -> None:
        """``value_limits``: float32 ``[n_layers, 2]``, the largest |key| and |value| KV received into the cache may
        hold in each layer (``KVValueRange.limits()``; None: any finite value)."""
        ort = import_onnxruntime()
        self.spec = spec
        self.max_context = max_context
        self.device = device
        self.dtype = np.dtype(dtype)
        # capped by the buffers' dtype: a float16 cache on CUDA is fed from float32 staging (ingest_target)
        self.value_limits = ValueBounds(value_limits, spec.n_layers).for_target(self.dtype).limits
        if device == "cpu":
            host_shape = (spec.n_layers, 2, 1, spec.n_kv_heads, max_context, spec.head_dim)
            nbytes = int(np.prod(host_shape)) * self.dtype.itemsize  # private: released pages are gone, not kept aside
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.host = np.frombuffer(self._map, self.dtype).reshape(host_shape)
            self.ortvalues = [
                [ort.OrtValue.ortvalue_from_numpy(self.host[layer, kind]) for kind in (0, 1)]
                for layer in range(spec.n_layers)
            ]
        else:
            shape = [1, spec.n_kv_heads, max_context, spec.head_dim]
            self.ortvalues = [
                [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0) for _ in (0, 1)]
                for _ in range(spec.n_layers)
            ]
            self._rows = DeviceRows(self)
            self._export = DeviceExport(self)
        self.length = 0
        self._staging: dict[int, np.ndarray] = {}  # CUDA: host buffers EDKV streams are ingested into, by first slot

    def update(self, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Write KV for positions [start, start + n); keys/values are [layers, kv_heads, n, head_dim]."""
        end = start + keys.shape[2]
        if self.device == "cpu":
            self.host[:, 0, 0, :, start:end] = keys
            self.host[:, 1, 0, :, start:end] = values
        elif end > start:
            self._rows.write(start, keys, values)
        self.length = end

    def release_unused(self) -> None:
        """Give the memory of the slots past ``length`` back to the OS (they read as zeros afterwards):
        on CPU, the whole pages past each (layer, K/V, head) block's rows in use. On CUDA the buffers
        are allocated whole up front and nothing is released."""
        if self.device != "cpu":
            return
        row = self.spec.head_dim * self.dtype.itemsize
        block = self.max_context * row
        page = mmap.PAGESIZE
        for start in range(0, len(self._map), block):
            begin = -(-(start + self.length * row) // page) * page
            end = (start + block) // page * page
            if end > begin:
                self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def compact(self, kept: np.ndarray) -> None:
        """Keep only the slots where bool ``kept [length]`` is set, moved down in order; ``length``
        becomes their count (the KV of the others is gone)."""
        kept = np.asarray(kept, bool)
        if kept.shape != (self.length,):
            raise KVInjectionError(f"a keep mask for {self.length} slots is needed, got shape {list(kept.shape)}")
        slots = np.flatnonzero(kept)
        if self.device == "cpu":
            self.host[:, :, 0, :, : len(slots)] = np.take(self.host[:, :, 0, :, : self.length], slots, axis=3)
        else:
            kv = self._held_rows(self.length)
            self._rows.write(0, kv[0][:, :, slots], kv[1][:, :, slots])
        self.length = len(slots)

    def _held_rows(self, n: int) -> np.ndarray:
        """A copy of the KV of the first ``n`` slots: [2 (k, v), layers, kv_heads, n, head_dim]."""
        kv = np.empty((2, self.spec.n_layers, self.spec.n_kv_heads, n, self.spec.head_dim), self.dtype)
        if self.device == "cpu":
            kv[:] = self.host[:, :, 0, :, :n].swapaxes(0, 1)
        else:
            self._export.read(kv)
        return kv

    def snapshot(self, token_ids: np.ndarray, positions: np.ndarray, producer: KVProducer) -> KVSnapshot:
        """Copy out the KV of the first len(token_ids) slots, which hold tokens at ``positions``."""
        kv = self._held_rows(len(token_ids))
        return KVSnapshot(
            contract=self.spec.kv_contract,
            token_ids=np.asarray(token_ids, np.int64).copy(),
            positions=np.asarray(positions, np.int64).copy(),
            keys=kv[0],
            values=kv[1],
            producer=producer,
        )

    def ingest_target(self, start: int, n_slots: int) -> np.ndarray:
        """Where an EDKV reader writes ``n_slots`` compacted tokens bound for slots from ``start`` on:
        ``[layers, 2, kv_heads, slots, head_dim]``.

        On CPU that is the bound buffers themselves (no copy); on CUDA a float32 host staging buffer
        that ``commit_ingest`` uploads and casts on the device (numpy's float16 conversion made
        dequantizing into float16 on the host ~100 ms slower for 4k tokens on the H100 machine).
        """
        if self.device == "cpu":
            return self.host[:, :, 0, :, start:]
        s = self.spec
        # zeros: a windowed layer's cells an EDKV window leaves out stay finite (never attended, but multiplied by 0)
        staged = np.zeros((s.n_layers, 2, s.n_kv_heads, n_slots, s.head_dim), np.float32)
        self._staging[start] = staged  # a later segment bound for the same slots replaces an empty one
        return staged

    def commit_ingest(self, spans: Sequence[tuple[int, int]], end: int) -> None:
        """Make ingested tokens the content of their slots: ``spans`` are (first slot, slots) of the
        streams written, up to slot ``end`` (tokens past it are left out)."""
        staging, self._staging = self._staging, {}
        if self.device == "cpu":
            return
        for start, n_slots in spans:
            n_slots = min(n_slots, end - start)
            if n_slots <= 0:
                continue
            staged = staging.get(start)
            if staged is None or staged.shape[3] < n_slots:
                raise KVInjectionError(f"no EDKV stream wrote the {n_slots} slots from slot {start}")
            self.update(start, staged[:, 0, :, :n_slots], staged[:, 1, :, :n_slots])

    def check_prompt_match(self, token_ids: np.ndarray, positions: np.ndarray, prompt_ids: np.ndarray) -> None:
        """Raise KVInjectionError unless the tokens at ``positions`` (strictly increasing) are the prompt's."""
        n = len(token_ids)
        if positions.shape != (n,) or not increasing_positions(positions):
            raise KVInjectionError("KV positions must be non-negative and strictly increasing, one per token")
        if n and (positions[-1] >= len(prompt_ids) or not np.array_equal(token_ids, prompt_ids[positions])):
            raise KVInjectionError("the KV's token ids are not the prompt's tokens at the KV's positions")

    def check_injectable(self, kv: KVSnapshot, prompt_ids: np.ndarray) -> None:
        """Raise KVInjectionError naming the first thing about ``kv`` that does not fit."""
        problems = kv.contract.mismatches(self.spec.kv_contract)
        if problems:
            raise KVInjectionError("KV contract mismatch: " + "; ".join(problems))
        s, n = self.spec, kv.n_tokens
        expected = (s.n_layers, s.n_kv_heads, n, s.head_dim)
        for name, array in (("keys", kv.keys), ("values", kv.values)):
            if array.shape != expected:
                raise KVInjectionError(
                    f"{name} have shape {array.shape}, expected {expected} [layers, kv_heads, seq, head_dim]"
                )
        self.check_prompt_match(kv.token_ids, kv.positions, prompt_ids)
        if n > self.max_context:
            raise KVInjectionError(f"KV holds {n} tokens but the context buffer holds {self.max_context}")


class DeviceRows:
    """Writes KV rows into a CUDA cache's buffers in place, straight from the caller's arrays.

    A small graph per source dtype takes each layer's K and V ``[kv_heads, N, head_dim]``, bound
    over the caller's memory (no host copy when they are row slices of contiguous blocks), keeps
    rows [0, n), casts them to the cache dtype on the device, and splits them into one
    ``[1, n, head_dim]`` output per head, bound to the address of that head's slots [start, start + n)
    inside the cache buffer ``[1, kv_heads, max_context, head_dim]``: the split writes straight into
    the cache and touches nothing else. onnxruntime copies the inputs to the device on its own
    stream, and the run returns once the rows are written.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._sessions: dict[np.dtype, object] = {}
        self._names = [
            (f"kv.{layer}.{kind}", [f"rows.{layer}.{kind}.{head}" for head in range(cache.spec.n_kv_heads)])
            for layer in range(cache.spec.n_layers)
            for kind in (0, 1)
        ]

    def _session(self, source: np.dtype):
        """The splitting graph for source arrays of one dtype (built on first use)."""
        if source not in self._sessions:
            s, cache = self.cache.spec, self.cache
            g = GraphBuilder("kv-rows")
            count = g.input("count", INT64, [1])
            starts = g.initializer("starts", np.array([0], np.int64))
            axes = g.initializer("axes", np.array([1], np.int64))
            for source_name, outputs in self._names:
                block = g.input(source_name, onnx_dtype(source), [s.n_kv_heads, "rows", s.head_dim])
                rows = g.op1("Slice", [block, starts, count, axes], name=f"{source_name}.slice")
                if source != cache.dtype:
                    rows = g.op1("Cast", [rows], name=f"{source_name}.cast", to=onnx_dtype(cache.dtype))
                g.op("Split", [rows], len(outputs), name=f"{source_name}.split", outputs=outputs, axis=0)
                for name in outputs:
                    g.output(name, onnx_dtype(cache.dtype), [1, "n", s.head_dim])
            self._sessions[source] = create_session(g.model().SerializeToString(), device=cache.device, threads=1)
        return self._sessions[source]

    def write(self, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Write keys/values ``[layers, kv_heads, n, head_dim]`` (any float dtype) to slots [start, start + n)."""
        s, cache = self.cache.spec, self.cache
        n = keys.shape[2]
        values = values.astype(keys.dtype, copy=False)
        io = self._session(keys.dtype).io_binding()
        io.bind_cpu_input("count", np.array([n], np.int64))
        row_bytes = s.head_dim * cache.dtype.itemsize
        blocks = []  # the bound host memory, alive until the run ends
        for layer in range(s.n_layers):
            for kind, array in enumerate((keys, values)):
                source_name, outputs = self._names[2 * layer + kind]
                block, total = _row_block(array[layer])
                blocks.append(block)
                io.bind_input(source_name, "cpu", 0, block.dtype, [s.n_kv_heads, total, s.head_dim], block.ctypes.data)
                base = cache.ortvalues[layer][kind].data_ptr()
                for head, name in enumerate(outputs):
                    address = base + (head * cache.max_context + start) * row_bytes
                    io.bind_output(name, cache.device, 0, cache.dtype, [1, n, s.head_dim], address)
        self._session(keys.dtype).run_with_iobinding(io)


class DeviceExport:
    """Reads the first n slots of a CUDA cache's buffers into host memory: a graph slices every layer's K and V
    ``[1, kv_heads, max_context, head_dim]`` to its first n rows on the device and stacks them into
    ``[layers, kv_heads, n, head_dim]`` per kind, written straight into the caller's array, so n rows cross the
    bus rather than whole buffers (onnxruntime's Python API has no partial copy of a device buffer).
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self._session = None

    def _built(self):
        """The slicing graph (built on first use)."""
        if self._session is None:
            s, cache = self.cache.spec, self.cache
            g = GraphBuilder("kv-export")
            count = g.input("count", INT64, [1])
            starts = g.initializer("starts", np.array([0], np.int64))
            axes = g.initializer("axes", np.array([2], np.int64))
            dtype = onnx_dtype(cache.dtype)
            for kind, output in enumerate(("keys", "values")):
                rows = []
                for layer in range(s.n_layers):
                    name = f"kv.{layer}.{kind}"
                    block = g.input(name, dtype, [1, s.n_kv_heads, "max_context", s.head_dim])
                    rows.append(g.op1("Slice", [block, starts, count, axes], name=f"{name}.slice"))
                g.op("Concat", rows, outputs=[output], name=f"{output}.concat", axis=0)
                g.output(output, dtype, [s.n_layers, s.n_kv_heads, "n", s.head_dim])
            self._session = create_session(g.model().SerializeToString(), device=cache.device, threads=1)
        return self._session

    def read(self, out: np.ndarray) -> None:
        """Fill C-contiguous ``out [2 (k, v), layers, kv_heads, n, head_dim]`` (the cache's dtype) with slots
        [0, n)."""
        cache, session = self.cache, self._built()
        n = out.shape[3]
        io = session.io_binding()
        io.bind_cpu_input("count", np.array([n], np.int64))
        for layer, pair in enumerate(cache.ortvalues):
            for kind, value in enumerate(pair):
                io.bind_ortvalue_input(f"kv.{layer}.{kind}", value)
        for kind, name in enumerate(("keys", "values")):
            io.bind_output(name, "cpu", 0, cache.dtype, list(out.shape[1:]), out[kind].ctypes.data)
        session.run_with_iobinding(io)


def _row_block(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """(array, N): ``rows [heads, n, head_dim]`` seen as the first n rows of a C-contiguous
    ``[heads, N, head_dim]`` block at the same address, where it is a row slice of one inside its
    base array (no copy); otherwise a contiguous copy and N = n."""
    heads, n, dim = rows.shape
    item = rows.itemsize
    if rows.strides[2] == item and rows.strides[1] == dim * item and rows.strides[0] % (dim * item) == 0:
        total = rows.strides[0] // (dim * item) if heads > 1 else n
        base = rows
        while isinstance(base.base, np.ndarray):
            base = base.base
        end = rows.ctypes.data + heads * total * dim * item
        if total >= n and base.flags.c_contiguous and end <= base.ctypes.data + base.nbytes:
            return rows, total
    return np.ascontiguousarray(rows), n
