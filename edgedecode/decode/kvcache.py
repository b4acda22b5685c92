"""Preallocated KV buffers shared by a graph's past and present, and KV snapshots that move between graphs.

Each layer's K and V buffer ``[1, kv_heads, max_context, head_dim]`` is bound to onnxruntime as both
``past_key_values.i.*`` and ``present.i.*``, so GroupQueryAttention appends in place and no step
copies the past. On CPU the buffers are slices of one numpy array ``[layers, 2 (k, v), 1, kv_heads,
max_context, head_dim]``, so injecting KV is a slice assignment (no graph run); its pages are only
committed as they are written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.session import import_onnxruntime
from edgedecode.model.spec import KVContract, ModelSpec


class KVInjectionError(EdgeDecodeError):
    """KV offered for injection does not fit this model's contract, buffers or prompt."""


@dataclass(frozen=True)
class KVSnapshot:
    """KV of a processed token prefix, in the model's declared layout (``contract.layout``)."""

    contract: KVContract
    token_ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    keys: np.ndarray  # [layers, kv_heads, n, head_dim], post-RoPE, rotate-half order
    values: np.ndarray  # [layers, kv_heads, n, head_dim]
    producer: str  # what computed it, e.g. "smollm2-135m-instruct prefill float32"

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class KVCache:
    """The graph's KV buffers (bound as both past and present) and how many positions are valid.

    On CPU the bound OrtValues alias ``host`` (numpy), so writes and reads are plain slicing. On
    CUDA the KV stays resident on the device; ``host`` is a staging mirror for injection and export,
    which move whole layer buffers (onnxruntime's Python API has no partial device copy).
    """

    def __init__(self, spec: ModelSpec, max_context: int, dtype: np.dtype = np.float32, device: str = "cpu") -> None:
        ort = import_onnxruntime()
        self.spec = spec
        self.max_context = max_context
        self.device = device
        self.host = np.zeros((spec.n_layers, 2, 1, spec.n_kv_heads, max_context, spec.head_dim), dtype)
        if device == "cpu":
            self.ortvalues = [[ort.OrtValue.ortvalue_from_numpy(self.host[layer, kind]) for kind in (0, 1)]
                              for layer in range(spec.n_layers)]
        else:
            shape = list(self.host.shape[2:])
            self.ortvalues = [[ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0) for _ in (0, 1)]
                              for _ in range(spec.n_layers)]
        self.length = 0

    def update(self, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Write KV for positions [start, start + n); keys/values are [layers, kv_heads, n, head_dim]."""
        end = start + keys.shape[2]
        self.host[:, 0, 0, :, start:end] = keys
        self.host[:, 1, 0, :, start:end] = values
        if self.device != "cpu":
            for layer, kind, value in self._bound():
                value.update_inplace(self.host[layer, kind])
        self.length = end

    def snapshot(self, token_ids: np.ndarray, producer: str) -> KVSnapshot:
        """Copy out the KV of the first len(token_ids) positions."""
        n = len(token_ids)
        kv = np.empty((2, self.spec.n_layers, self.spec.n_kv_heads, n, self.spec.head_dim), self.host.dtype)
        if self.device == "cpu":
            kv[:] = self.host[:, :, 0, :, :n].swapaxes(0, 1)
        else:  # the device buffer comes back whole (no partial copy); keep only the first n rows
            for layer, kind, value in self._bound():
                kv[kind, layer] = value.numpy()[0, :, :n]
        return KVSnapshot(
            contract=self.spec.kv_contract,
            token_ids=np.asarray(token_ids, np.int64).copy(),
            positions=np.arange(n, dtype=np.int64),
            keys=kv[0],
            values=kv[1],
            producer=producer,
        )

    def _bound(self):
        """(layer, kind, OrtValue) for every bound buffer; kind 0 is K, 1 is V."""
        for layer, pair in enumerate(self.ortvalues):
            for kind, value in enumerate(pair):
                yield layer, kind, value

    def check_injectable(self, kv: KVSnapshot, prompt_ids: np.ndarray) -> None:
        """Raise KVInjectionError naming the first thing about ``kv`` that does not fit."""
        problems = kv.contract.mismatches(self.spec.kv_contract)
        if problems:
            raise KVInjectionError("KV contract mismatch: " + "; ".join(problems))
        s, n = self.spec, kv.n_tokens
        expected = (s.n_layers, s.n_kv_heads, n, s.head_dim)
        for name, array in (("keys", kv.keys), ("values", kv.values)):
            if array.shape != expected:
                raise KVInjectionError(f"{name} have shape {array.shape}, expected {expected} [layers, kv_heads, seq, head_dim]")
        if not np.array_equal(kv.positions, np.arange(n)):
            raise KVInjectionError("KV positions must be 0..n-1 (this graph has no masked or compacted slots)")
        if n > len(prompt_ids) or not np.array_equal(kv.token_ids, prompt_ids[:n]):
            raise KVInjectionError("the KV's token ids are not a prefix of the prompt")
        if n > self.max_context:
            raise KVInjectionError(f"KV holds {n} tokens but the context buffer holds {self.max_context}")
