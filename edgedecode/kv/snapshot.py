"""The KV of a processed token prefix as it moves between graphs, processes and hosts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgedecode.model.spec import KVContract


def increasing_positions(positions: np.ndarray) -> bool:
    """Whether int64 ``positions`` [n] are non-negative and strictly increasing.

    Neighbours are compared, never subtracted: a difference of int64 positions can wrap around
    (``np.diff([5, -2**63])`` is positive).
    """
    return len(positions) == 0 or bool(positions[0] >= 0 and (positions[1:] > positions[:-1]).all())


@dataclass(frozen=True)
class KVProducer:
    """What computed a KV cache: visible on the receiver, so a cross-quant handoff is reported, not hidden."""

    model: str  # catalog name, e.g. "smollm2-135m-instruct"
    weights_sha256: str  # of the GGUF the graph was built from
    precision: str  # e.g. "prefill float32", "decode float32 int4"

    def describe(self) -> str:
        return f"{self.model} ({self.precision}, weights {self.weights_sha256[:12]})"


@dataclass(frozen=True)
class KVSnapshot:
    """KV of a processed token prefix, in the model's declared layout (``contract.layout``).

    ``positions`` are the tokens' true positions (strictly increasing); when tokens were dropped
    they are no longer 0..n-1, and a receiver stores the kept tokens compacted with these positions.
    """

    contract: KVContract
    token_ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n]
    keys: np.ndarray  # [layers, kv_heads, n, head_dim], post-RoPE, rotate-half order
    values: np.ndarray  # [layers, kv_heads, n, head_dim]
    producer: KVProducer

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values."""
        return int(self.keys.nbytes + self.values.nbytes)

    def slots(self, start: int, stop: int | None = None) -> KVSnapshot:
        """The tokens [start, stop) of this snapshot (views, no copy)."""
        window = slice(start, stop)
        return replace(
            self,
            token_ids=self.token_ids[window],
            positions=self.positions[window],
            keys=self.keys[:, :, window],
            values=self.values[:, :, window],
        )
