"""Preallocated KV buffers shared by a graph's past and present, and KV snapshots that move between graphs.

The buffers are one numpy array ``[layers, 2 (k, v), 1, kv_heads, max_context, head_dim]``; each
layer's K and V slice is bound to onnxruntime as both ``past_key_values.i.*`` and ``present.i.*``,
so GroupQueryAttention appends in place and injecting KV is a slice assignment (no graph run, no
copy of the past on any step). Pages of the buffer are only committed as they are written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.errors import EdgeDecodeError
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
    """The decode graph's KV buffers and how many positions of them are valid."""

    def __init__(self, spec: ModelSpec, max_context: int, dtype: np.dtype = np.float32) -> None:
        self.spec = spec
        self.max_context = max_context
        self.buffers = np.zeros((spec.n_layers, 2, 1, spec.n_kv_heads, max_context, spec.head_dim), dtype)
        self.length = 0

    def layer_buffer(self, layer: int, kind: int) -> np.ndarray:
        """The contiguous [1, kv_heads, max_context, head_dim] buffer of one layer's K (0) or V (1)."""
        return self.buffers[layer, kind]

    def update(self, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Write KV for positions [start, start + n); keys/values are [layers, kv_heads, n, head_dim]."""
        end = start + keys.shape[2]
        self.buffers[:, 0, 0, :, start:end] = keys
        self.buffers[:, 1, 0, :, start:end] = values
        self.length = end

    def snapshot(self, token_ids: np.ndarray, producer: str) -> KVSnapshot:
        """Copy out the KV of the first len(token_ids) positions."""
        n = len(token_ids)
        return KVSnapshot(
            contract=self.spec.kv_contract,
            token_ids=np.asarray(token_ids, np.int64).copy(),
            positions=np.arange(n, dtype=np.int64),
            keys=self.buffers[:, 0, 0, :, :n].copy(),
            values=self.buffers[:, 1, 0, :, :n].copy(),
            producer=producer,
        )

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
