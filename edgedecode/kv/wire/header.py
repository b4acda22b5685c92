"""The EDKV header: everything a receiver needs to validate, size and place each chunk before any arrives."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from edgedecode.kv.quant import QuantLayout
from edgedecode.kv.snapshot import KVProducer
from edgedecode.kv.tiers import QUANTIZED_TIERS, TIER_BITS, Tier
from edgedecode.kv.wire.errors import KVMalformedError
from edgedecode.kv.wire.frames import MINOR
from edgedecode.model.spec import KVContract, KVLayout

KV_PARTS = ("keys", "values")
PRODUCER_FIELDS = ("model", "weights_sha256", "precision")


@dataclass(frozen=True)
class ChunkSpec:
    """One row of the chunk table: a rectangle of layers × tokens and its size before zstd."""

    index: int
    layer_start: int
    layer_stop: int
    token_start: int
    token_stop: int
    raw_nbytes: int


@dataclass(frozen=True, eq=False)
class EDKVHeader:
    """The parsed (or to-be-written) header; construction validates that its parts agree with each other."""

    contract: KVContract
    producer: KVProducer
    token_ids: np.ndarray  # int64 [n]
    positions: np.ndarray  # int64 [n], true positions, strictly increasing
    tiers: np.ndarray  # uint8 [layers, n], Tier codes
    layouts: dict[Tier, tuple[QuantLayout, QuantLayout]]  # (keys, values) for each quantized tier in `tiers`
    chunks: tuple[ChunkSpec, ...]
    zstd_level: int
    meta: dict[str, Any]
    minor: int = MINOR  # of the stream it came from; the writer writes the current one

    def __post_init__(self) -> None:
        self._check_arrays()
        self._check_chunks()

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @cached_property
    def kept(self) -> np.ndarray:
        """bool [n]: tokens that are not dropped (a token's DROP is shared by all layers)."""
        return self.tiers[0] != Tier.DROP

    @cached_property
    def slots_before(self) -> np.ndarray:
        """int64 [n + 1]: kept tokens before each token, i.e. a kept token's compacted slot."""
        return np.concatenate([[0], np.cumsum(self.kept, dtype=np.int64)])

    @property
    def n_kept(self) -> int:
        return int(self.slots_before[-1])

    def slot_range(self, chunk: ChunkSpec) -> slice:
        """The compacted slots that the kept tokens of `chunk` fill."""
        return slice(int(self.slots_before[chunk.token_start]), int(self.slots_before[chunk.token_stop]))

    def to_json(self) -> bytes:
        """The header JSON (UTF-8) as written on the wire."""
        doc = {
            "contract": dataclasses.asdict(self.contract),
            "producer": dataclasses.asdict(self.producer),
            "n_tokens": self.n_tokens,
            "token_ids": _b64(self.token_ids.astype("<i8")),
            "positions": _b64(self.positions.astype("<i8")),
            "tiers": _b64(self.tiers),
            "layouts": {
                tier.name.lower(): {part: dataclasses.asdict(lay) for part, lay in zip(KV_PARTS, pair)}
                for tier, pair in sorted(self.layouts.items())
            },
            "chunks": [[c.layer_start, c.layer_stop, c.token_start, c.token_stop, c.raw_nbytes] for c in self.chunks],
            "zstd_level": self.zstd_level,
            "meta": self.meta,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_doc(cls, doc: dict[str, Any], minor: int) -> EDKVHeader:
        """Parse a header JSON object; unknown fields are ignored (a later minor version may add them)."""
        contract = contract_from_doc(doc)
        n = doc_field(doc, "n_tokens", int)
        if n < 0:
            raise KVMalformedError("n_tokens", f"must be >= 0, got {n}")
        producer = doc_field(doc, "producer", dict)
        return cls(
            contract=contract,
            producer=KVProducer(*(doc_field(producer, k, str, "producer.") for k in PRODUCER_FIELDS)),
            token_ids=_array(doc, "token_ids", "<i8", n),
            positions=_array(doc, "positions", "<i8", n),
            tiers=_array(doc, "tiers", "u1", contract.n_layers * n).reshape(contract.n_layers, n),
            layouts=_layouts(doc_field(doc, "layouts", dict)),
            chunks=tuple(_chunk(i, row) for i, row in enumerate(doc_field(doc, "chunks", list))),
            zstd_level=doc_field(doc, "zstd_level", int),
            meta=doc_field(doc, "meta", dict),
            minor=minor,
        )

    def _check_arrays(self) -> None:
        n, layers = self.n_tokens, self.contract.n_layers
        if self.positions.shape != (n,):
            raise KVMalformedError("positions", f"{list(self.positions.shape)} positions for {n} token ids")
        if n and (self.positions[0] < 0 or (np.diff(self.positions) <= 0).any()):
            raise KVMalformedError("positions", "positions must be non-negative and strictly increasing")
        check_tier_map(self.tiers, layers, n)
        check_layouts(self.tiers, self.layouts, self.contract.head_dim)

    def _check_chunks(self) -> None:
        layers, n = self.contract.n_layers, self.n_tokens
        covered = np.zeros((layers, n), bool)
        for c in self.chunks:
            if not (0 <= c.layer_start < c.layer_stop <= layers and 0 <= c.token_start < c.token_stop <= n
                    and c.raw_nbytes >= 0):
                raise KVMalformedError("chunks", f"chunk {c.index} {_rect(c)} (raw {c.raw_nbytes} B) is empty or "
                                       f"outside {layers} layers × {n} tokens")
            cells = covered[c.layer_start:c.layer_stop, c.token_start:c.token_stop]
            if cells.any():
                raise KVMalformedError("chunks", f"chunk {c.index} {_rect(c)} overlaps an earlier chunk")
            cells[...] = True
        if not covered.all():
            layer, token = np.argwhere(~covered)[0]
            raise KVMalformedError("chunks", f"no chunk covers layer {layer}, token {token}; the chunk table must "
                                   "cover every layer × token exactly once")


def check_tier_map(tiers: np.ndarray, n_layers: int, n_tokens: int) -> None:
    """Raise KVMalformedError unless `tiers` is uint8 [n_layers, n_tokens] of Tier codes with whole-token DROPs."""
    if tiers.dtype != np.uint8 or tiers.shape != (n_layers, n_tokens):
        raise KVMalformedError("tiers", f"tier map must be uint8 [{n_layers}, {n_tokens}], got {tiers.dtype} "
                               f"{list(tiers.shape)}")
    if tiers.size and tiers.max() > max(Tier):
        raise KVMalformedError("tiers", f"unknown tier code {int(tiers.max())}; known: 0..{int(max(Tier))}")
    dropped = tiers == Tier.DROP
    split = np.flatnonzero(dropped.any(axis=0) != dropped.all(axis=0))
    if split.size:
        raise KVMalformedError("tiers", f"token {int(split[0])} is DROP in some layers only; "
                               "a token's DROP must be shared by all layers")


def check_layouts(tiers: np.ndarray, layouts: dict[Tier, tuple[QuantLayout, QuantLayout]], head_dim: int) -> None:
    """Raise KVMalformedError unless every quantized tier in `tiers` has a (keys, values) layout that fits it."""
    for code in np.unique(tiers):
        tier = Tier(int(code))
        if tier not in QUANTIZED_TIERS:
            continue
        if tier not in layouts:
            raise KVMalformedError("layouts", f"tier {tier.name} is used in the tier map but has no layout")
        for part, layout in zip(KV_PARTS, layouts[tier]):
            where = f"layouts.{tier.name.lower()}.{part}"
            if layout.bits != TIER_BITS[tier]:
                raise KVMalformedError(where, f"{layout.bits} bits for tier {tier.name}, which has {TIER_BITS[tier]}")
            try:
                layout.check_head_dim(head_dim)
            except ValueError as e:
                raise KVMalformedError(where, str(e)) from None


def load_doc(body: bytes | memoryview) -> dict[str, Any]:
    """The header JSON object; anything else is a KVMalformedError."""
    try:
        doc = json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KVMalformedError("header", f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(doc, dict):
        raise KVMalformedError("header", f"header JSON must be an object, got {type(doc).__name__}")
    return doc


def contract_from_doc(doc: dict[str, Any]) -> KVContract:
    """The producer's KVContract, read first so a mismatch is reported before anything else."""
    c = doc_field(doc, "contract", dict)
    lay = doc_field(c, "layout", dict, "contract.")
    dims = {k: doc_field(c, k, int, "contract.") for k in ("n_layers", "n_kv_heads", "head_dim")}
    for name, value in dims.items():
        if value < 1:
            raise KVMalformedError(f"contract.{name}", f"must be positive, got {value}")
    return KVContract(
        architecture=doc_field(c, "architecture", str, "contract."),
        rope_theta=float(doc_field(c, "rope_theta", float, "contract.")),
        layout=KVLayout(doc_field(lay, "axes", str, "contract.layout."),
                        doc_field(lay, "keys_post_rope", bool, "contract.layout."),
                        doc_field(lay, "rope_order", str, "contract.layout.")),
        tokenizer_hash=doc_field(c, "tokenizer_hash", str, "contract."),
        **dims,
    )


def doc_field(doc: dict[str, Any], key: str, kind: type, prefix: str = "") -> Any:
    """doc[key], checked to be of `kind` (an int is no bool; a float may be an int)."""
    if key not in doc:
        raise KVMalformedError(prefix + key, "missing from the header")
    value = doc[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, (int, float) if kind is float else kind):
        raise KVMalformedError(prefix + key, f"expected {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def _array(doc: dict[str, Any], key: str, dtype: str, count: int) -> np.ndarray:
    """A base64 little-endian array field of exactly `count` items."""
    try:
        raw = base64.b64decode(doc_field(doc, key, str), validate=True)
    except binascii.Error as e:
        raise KVMalformedError(key, f"not base64: {e}") from None
    itemsize = np.dtype(dtype).itemsize
    if len(raw) != count * itemsize:
        raise KVMalformedError(key, f"{len(raw)} bytes, expected {count} × {itemsize}")
    return np.frombuffer(raw, dtype).astype(np.dtype(dtype).newbyteorder("="), copy=False)


def _layouts(doc: dict[str, Any]) -> dict[Tier, tuple[QuantLayout, QuantLayout]]:
    """{"int4": {"keys": {axis, group, bits}, "values": {...}}, ...} -> {Tier.INT4: (keys, values), ...}"""
    layouts = {}
    for name in doc:
        tier = Tier.__members__.get(name.upper())
        if tier not in QUANTIZED_TIERS:
            raise KVMalformedError("layouts", f"{name!r} is not a quantized tier")
        pair = doc_field(doc, name, dict, "layouts.")
        layouts[tier] = tuple(_layout(doc_field(pair, part, dict, f"layouts.{name}."), f"layouts.{name}.{part}")
                              for part in KV_PARTS)
    return layouts


def _layout(doc: dict[str, Any], where: str) -> QuantLayout:
    fields = (doc_field(doc, "axis", str, where + "."), doc_field(doc, "group", int, where + "."),
              doc_field(doc, "bits", int, where + "."))
    try:
        return QuantLayout(*fields)
    except ValueError as e:
        raise KVMalformedError(where, str(e)) from None


def _chunk(index: int, row: Any) -> ChunkSpec:
    if not (isinstance(row, list) and len(row) == 5 and all(type(v) is int for v in row)):
        raise KVMalformedError("chunks", f"row {index} must be 5 ints [layer_start, layer_stop, token_start, "
                               f"token_stop, raw_nbytes], got {row!r:.80}")
    return ChunkSpec(index, *row)


def _rect(c: ChunkSpec) -> str:
    return f"layers [{c.layer_start}, {c.layer_stop}) × tokens [{c.token_start}, {c.token_stop})"


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")
