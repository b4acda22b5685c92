"""The EDKV header: everything a receiver needs to validate, size and place each chunk before any arrives."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from edgedecode.kv.quant import QuantLayout
from edgedecode.kv.rotation import MAX_BLOCK, MAX_SEED, ROTATION_KINDS, Rotation
from edgedecode.kv.snapshot import KVProducer, increasing_positions
from edgedecode.kv.tiers import QUANTIZED_TIERS, TIER_BITS, Tier
from edgedecode.kv.wire.chunks import chunk_sizes
from edgedecode.kv.wire.errors import KVMalformedError, KVTooLargeError, KVUnsupportedError
from edgedecode.kv.wire.frames import (
    LOWBIT_MINOR,
    MAJOR,
    MAX_HEADER_DEPTH,
    MAX_META_CHARS,
    MAX_META_DEPTH,
    MAX_META_VALUES,
    MAX_NAME_CHARS,
    MAX_TRANSFER_TTL_S,
    MINOR,
    WINDOW_MAJOR,
    max_chunks,
    max_sections,
)
from edgedecode.model.spec import KVContract, KVLayout

KV_PARTS = ("keys", "values")
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
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


@dataclass(frozen=True)
class TransferRef:
    """EDKV 1.1: the sender keeps the prefill this payload was cut from under ``id`` for ``ttl_s``
    seconds after sending it, so a receiver may ask for the KV of any later positions of the same
    prompt (a resume, at a budget of its choice) without the prompt being processed again."""

    id: str  # 1..64 characters of [A-Za-z0-9_-]
    ttl_s: float  # > 0, at most MAX_TRANSFER_TTL_S

    def __post_init__(self) -> None:
        if not _TRANSFER_ID.fullmatch(self.id):
            raise KVMalformedError("transfer.id", "must be 1 to 64 characters of A-Z, a-z, 0-9, '_' and '-'")
        if not (math.isfinite(self.ttl_s) and 0 < self.ttl_s <= MAX_TRANSFER_TTL_S):
            raise KVMalformedError("transfer.ttl_s", f"must be in (0, {MAX_TRANSFER_TTL_S:g}] seconds")

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> TransferRef:
        ttl = doc_field(doc, "ttl_s", float, "transfer.")
        try:
            return cls(doc_field(doc, "id", str, "transfer."), float(ttl))
        except OverflowError:  # an integer beyond the float range
            raise KVMalformedError("transfer.ttl_s", "beyond the float range") from None


@dataclass(frozen=True)
class WindowCut:
    """EDKV 2.0: the windowed (sliding-window) ``layers`` carry the KV of tokens ``start`` and after only; their
    cells before it are not sent, and a receiver's windowed layers never attend to those slots."""

    layers: tuple[int, ...]  # increasing, each one of the contract's sliding_layers
    start: int  # first token index whose windowed cells are carried

    @classmethod
    def from_doc(cls, doc: dict[str, Any], n_layers: int) -> WindowCut:
        layers = doc_field(doc, "layers", list, "window.")
        if len(layers) > n_layers or not all(type(layer) is int for layer in layers):
            raise KVMalformedError("window.layers", f"must be a list of at most {n_layers} layer indices")
        return cls(tuple(layers), doc_field(doc, "start", int, "window."))


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
    transfer: TransferRef | None = None  # 1.1: where the rest of this prefill can be asked for
    importance: np.ndarray | None = None  # 1.2: float16 [n], each token's relative importance; NaN: none known
    window: WindowCut | None = None  # 2.0: the windowed layers carry tokens from window.start on only
    major: int = MAJOR  # of the stream it came from; the writer writes WINDOW_MAJOR where there is a window
    rotation: Rotation | None = None  # 1.3 / 2.1: the tiers whose K and V were rotated before quantization

    def __post_init__(self) -> None:
        self._check_arrays()
        self._check_lowbit()
        self._check_window()
        self._check_chunks()
        self._check_sizes()

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @cached_property
    def kept(self) -> np.ndarray:
        """bool [n]: tokens that are not dropped (a token's DROP is shared by all layers)."""
        return self.tiers[0] != Tier.DROP

    @cached_property
    def cells(self) -> np.ndarray:
        """uint8 [layers, n]: the tier of each (layer, token) cell as the chunks carry it: the tier map, with the
        windowed layers' cells before ``window.start`` DROP (not sent). Chunk content and sizes follow it."""
        return carried_cells(self.tiers, self.window)

    @cached_property
    def slots_before(self) -> np.ndarray:
        """int64 [n + 1]: kept tokens before each token, i.e. a kept token's compacted slot."""
        return np.concatenate([[0], np.cumsum(self.kept, dtype=np.int64)])

    @property
    def n_kept(self) -> int:
        return int(self.slots_before[-1])

    @cached_property
    def chunk_table(self) -> np.ndarray:
        """int64 [chunks, 5]: the chunk table, (layer_start, layer_stop, token_start, token_stop, raw_nbytes)."""
        rows = [(c.layer_start, c.layer_stop, c.token_start, c.token_stop, c.raw_nbytes) for c in self.chunks]
        try:
            return np.array(rows, np.int64).reshape(len(rows), 5)
        except OverflowError:
            raise KVMalformedError("chunks", "a value beyond the int64 range") from None

    def windowed_slot(self, tokens: int) -> int:
        """The compacted slot, among those of the first ``tokens`` tokens, from which the windowed layers hold KV
        (0: every slot, or no window)."""
        return 0 if self.window is None else int(self.slots_before[min(self.window.start, tokens)])

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
        if self.transfer is not None:
            doc["transfer"] = dataclasses.asdict(self.transfer)
        if self.importance is not None:
            doc["importance"] = _b64(self.importance.astype("<f2"))
        if self.window is not None:
            doc["window"] = {"layers": list(self.window.layers), "start": self.window.start}
        if self.rotation is not None:
            r = self.rotation
            tiers = [t.name.lower() for t in r.tiers]
            doc["rotation"] = {"kind": r.kind, "seed": r.seed, "block": r.block, "tiers": tiers}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_doc(cls, doc: dict[str, Any], minor: int, major: int = MAJOR) -> EDKVHeader:
        """Parse a header JSON object; unknown fields are ignored (a later minor version may add them), and so
        are ``window`` in a 1.x stream, whose chunks carry every cell, and ``rotation`` before 1.3 / 2.1."""
        contract = contract_from_doc(doc)
        n = doc_field(doc, "n_tokens", int)
        if n < 0:
            raise KVMalformedError("n_tokens", f"must be >= 0, got {n}")
        # every declared count is bounded before anything is built per item (docs/kv-format.md §7)
        rows = doc_field(doc, "chunks", list)
        limit = max_chunks(n, contract.n_layers)
        if len(rows) > limit:
            raise KVTooLargeError(
                "chunks", f"{len(rows)} chunks declared, at most {limit} for {n} tokens × {contract.n_layers} layers"
            )
        layouts = doc_field(doc, "layouts", dict)
        if len(layouts) > len(QUANTIZED_TIERS):
            raise KVMalformedError(
                "layouts", f"{len(layouts)} layouts, there are {len(QUANTIZED_TIERS)} quantized tiers"
            )
        meta = doc_field(doc, "meta", dict)
        check_meta(meta)
        producer = doc_field(doc, "producer", dict)
        table = _int64_table(rows, "chunks")
        return cls(
            contract=contract,
            producer=KVProducer(*(_name(producer, k, "producer.") for k in PRODUCER_FIELDS)),
            token_ids=_array(doc, "token_ids", "<i8", n),
            positions=_array(doc, "positions", "<i8", n),
            tiers=_array(doc, "tiers", "u1", contract.n_layers * n).reshape(contract.n_layers, n),
            layouts=_layouts(layouts),
            chunks=tuple(ChunkSpec(i, *row) for i, row in enumerate(table.tolist())),
            zstd_level=doc_field(doc, "zstd_level", int),
            meta=meta,
            minor=minor,
            transfer=TransferRef.from_doc(doc_field(doc, "transfer", dict)) if "transfer" in doc else None,
            importance=_array(doc, "importance", "<f2", n) if "importance" in doc else None,
            window=WindowCut.from_doc(doc_field(doc, "window", dict), contract.n_layers)
            if major >= WINDOW_MAJOR and "window" in doc
            else None,
            major=major,
            rotation=_rotation(doc_field(doc, "rotation", dict))
            if minor >= LOWBIT_MINOR.get(major, minor + 1) and "rotation" in doc
            else None,
        )

    def _check_arrays(self) -> None:
        n, layers = self.n_tokens, self.contract.n_layers
        if self.positions.shape != (n,):
            raise KVMalformedError("positions", f"{list(self.positions.shape)} positions for {n} token ids")
        if not increasing_positions(self.positions):
            raise KVMalformedError("positions", "positions must be non-negative and strictly increasing")
        check_tier_map(self.tiers, layers, n)
        check_layouts(self.tiers, self.layouts, self.contract.head_dim)
        if self.importance is not None:
            check_importance(self.importance, n)

    def _check_lowbit(self) -> None:
        """INT3 and ``rotation`` come with 1.3 / 2.1; a rotation's blocks must tile head_dim."""
        if self.minor < LOWBIT_MINOR.get(self.major, self.minor + 1) and (self.tiers == Tier.INT3).any():
            raise KVMalformedError(
                "tiers", f"tier code {int(Tier.INT3)} (INT3) in an EDKV {self.major}.{self.minor} stream"
            )
        if self.rotation is not None:
            try:
                self.rotation.check_head_dim(self.contract.head_dim)
            except ValueError as e:
                raise KVMalformedError("rotation", str(e)) from None

    def _check_window(self) -> None:
        """A window names windowed layers of the contract and leaves them at least the last ``sliding_window - 1``
        kept tokens (all of them, when fewer are kept): what the next token's query sees in those layers."""
        if self.window is None:
            return
        c, window = self.contract, self.window
        if not window.layers or list(window.layers) != sorted(set(window.layers)):
            raise KVMalformedError("window.layers", "must be increasing layer indices, at least one")
        if not set(window.layers) <= set(c.sliding_layers) or not c.sliding_window:
            raise KVMalformedError(
                "window.layers",
                f"{list(window.layers)} are not all windowed layers of the contract {list(c.sliding_layers)}",
            )
        if not 0 <= window.start <= self.n_tokens:
            raise KVMalformedError("window.start", f"must be in [0, {self.n_tokens}], got {window.start}")
        needed = min(c.sliding_window - 1, self.n_kept)
        carried = self.n_kept - int(self.slots_before[window.start])
        if carried < needed:
            raise KVMalformedError(
                "window.start",
                f"the windowed layers carry {carried} kept tokens from token {window.start} on; the next query "
                f"needs the last {needed} (window {c.sliding_window})",
            )

    def _check_chunks(self) -> None:
        """The chunk table tiles layers × tokens exactly: vectorised, no Python work per chunk or per cell."""
        layers, n = self.contract.n_layers, self.n_tokens
        limit = max_chunks(n, layers)
        if len(self.chunks) > limit:
            raise KVTooLargeError(
                "chunks", f"{len(self.chunks)} chunks, at most {limit} for {n} tokens × {layers} layers"
            )
        table = self.chunk_table
        l0, l1, t0, t1, raw = table.T
        bad = np.flatnonzero(~((l0 >= 0) & (l0 < l1) & (l1 <= layers) & (t0 >= 0) & (t0 < t1) & (t1 <= n) & (raw >= 0)))
        if bad.size:
            c = self.chunks[bad[0]]
            raise KVMalformedError(
                "chunks",
                f"chunk {c.index} {_rect(c)} (raw {c.raw_nbytes} B) is empty or outside {layers} layers × {n} tokens",
            )
        # how many chunks cover each cell: +1/-1 at the rectangles' corners, then a 2-D prefix sum
        corners = np.concatenate([l0 * (n + 1) + t0, l1 * (n + 1) + t1, l0 * (n + 1) + t1, l1 * (n + 1) + t0])
        weights = np.repeat(np.array([1, 1, -1, -1], np.int64), len(table))
        cover = np.bincount(corners, weights, (layers + 1) * (n + 1)).reshape(layers + 1, n + 1)
        cover = cover.cumsum(axis=0).cumsum(axis=1)[:layers, :n]
        if (cover > 1).any():
            layer, token = np.argwhere(cover > 1)[0]
            holders = np.flatnonzero((l0 <= layer) & (layer < l1) & (t0 <= token) & (token < t1))
            c = self.chunks[holders[1]]
            raise KVMalformedError(
                "chunks",
                f"chunk {c.index} {_rect(c)} overlaps an earlier chunk (chunk "
                f"{holders[0]}) at layer {layer}, token {token}",
            )
        if (cover < 1).any():
            layer, token = np.argwhere(cover < 1)[0]
            raise KVMalformedError(
                "chunks",
                f"no chunk covers layer {layer}, token {token}; the chunk table must "
                "cover every layer × token exactly once",
            )

    def _check_sizes(self) -> None:
        """Each chunk's raw_nbytes is what its tier map needs, and all chunks' sections stay within the limit."""
        c = self.contract
        raw, sections = chunk_sizes(self.cells, self.layouts, c.n_kv_heads, c.head_dim, self.chunk_table[:, :4])
        wrong = np.flatnonzero(raw != self.chunk_table[:, 4])
        if wrong.size:
            k = int(wrong[0])
            raise KVMalformedError(
                "chunks", f"chunk {k} declares {self.chunks[k].raw_nbytes} raw bytes, its tier map needs {int(raw[k])}"
            )
        limit = max_sections(self.n_tokens, c.n_layers)
        if int(sections.sum()) > limit:
            raise KVTooLargeError(
                "chunks",
                f"the chunks hold {int(sections.sum())} sections (runs of layers × K/V "
                f"× tiers), at most {limit} for {self.n_tokens} tokens × {c.n_layers} layers",
            )


def carried_cells(tiers: np.ndarray, window: WindowCut | None) -> np.ndarray:
    """The tier map ``uint8 [layers, n]`` as the chunks carry it: the windowed layers' cells before the window's
    start are DROP (not sent); without a window (or one from token 0), the tier map itself."""
    if window is None or window.start == 0:
        return tiers
    cells = tiers.copy()
    cells[list(window.layers), : window.start] = Tier.DROP
    return cells


def check_tier_map(tiers: np.ndarray, n_layers: int, n_tokens: int) -> None:
    """Raise KVMalformedError unless `tiers` is uint8 [n_layers, n_tokens] of Tier codes with whole-token DROPs."""
    if tiers.dtype != np.uint8 or tiers.shape != (n_layers, n_tokens):
        raise KVMalformedError(
            "tiers", f"tier map must be uint8 [{n_layers}, {n_tokens}], got {tiers.dtype} {list(tiers.shape)}"
        )
    if tiers.size and tiers.max() > max(Tier):
        raise KVMalformedError("tiers", f"unknown tier code {int(tiers.max())}; known: 0..{int(max(Tier))}")
    dropped = tiers == Tier.DROP
    split = np.flatnonzero(dropped.any(axis=0) != dropped.all(axis=0))
    if split.size:
        raise KVMalformedError(
            "tiers", f"token {int(split[0])} is DROP in some layers only; a token's DROP must be shared by all layers"
        )


def check_importance(importance: np.ndarray, n_tokens: int) -> None:
    """The ``importance`` field: float16 [n], each value >= 0 or NaN (none known for that token)."""
    if importance.dtype != np.float16 or importance.shape != (n_tokens,):
        raise KVMalformedError(
            "importance", f"must be float16 [{n_tokens}], got {importance.dtype} {list(importance.shape)}"
        )
    known = importance[~np.isnan(importance)]
    if not (np.isfinite(known) & (known >= 0)).all():
        raise KVMalformedError("importance", "values must be >= 0 and finite, or NaN where none is known")


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


def load_doc(body: bytes | memoryview, max_containers: int | None = None) -> dict[str, Any]:
    """The header JSON object; anything else is a KVMalformedError.

    With `max_containers`, a body with more '[' and '{' bytes than that is a KVTooLargeError before it is parsed.
    Besides syntax, arrays and objects nested deeper than MAX_HEADER_DEPTH levels (whatever the interpreter's
    recursion limit lets json parse: 3.11 stops near 1,000, 3.12 goes deeper) and integers beyond Python's
    int-string limit (ValueError) are malformed headers, too.
    """
    body = bytes(body)
    if max_containers is not None:
        containers = body.count(b"[") + body.count(b"{")
        if containers > max_containers:
            raise KVTooLargeError(
                "header", f"{containers} JSON arrays and objects ('[', '{{'), at most {max_containers}"
            )
    try:
        doc = json.loads(body.decode("utf-8"))
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, an integer of too many digits
        raise KVMalformedError("header", f"header is not UTF-8 JSON within limits: {e!s:.200}") from None
    if not isinstance(doc, dict):
        raise KVMalformedError("header", f"header JSON must be an object, got {type(doc).__name__}")
    _check_depth(doc)
    return doc


def _check_depth(doc: dict[str, Any]) -> None:
    """Raise KVMalformedError if arrays and objects in `doc` nest deeper than MAX_HEADER_DEPTH levels (iterative:
    the parsed document may be far deeper than the interpreter's recursion limit)."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            if isinstance(item, (dict, list)):
                if depth >= MAX_HEADER_DEPTH:
                    raise _too_deep()
                stack.append((item, depth + 1))


def _too_deep() -> KVMalformedError:
    return KVMalformedError("header", f"header JSON is nested deeper than {MAX_HEADER_DEPTH} levels")


def contract_from_doc(doc: dict[str, Any]) -> KVContract:
    """The producer's KVContract, read first so a mismatch is reported before anything else."""
    c = doc_field(doc, "contract", dict)
    lay = doc_field(c, "layout", dict, "contract.")
    dims = {k: doc_field(c, k, int, "contract.") for k in ("n_layers", "n_kv_heads", "head_dim")}
    for name, value in dims.items():
        if value < 1:
            raise KVMalformedError(f"contract.{name}", f"must be positive, got {value}")
    try:
        rope_theta = float(doc_field(c, "rope_theta", float, "contract."))
    except OverflowError:  # an integer beyond the float range
        raise KVMalformedError("contract.rope_theta", "beyond the float range") from None
    return KVContract(
        architecture=_name(c, "architecture", "contract."),
        rope_theta=rope_theta,
        layout=KVLayout(
            _name(lay, "axes", "contract.layout."),
            doc_field(lay, "keys_post_rope", bool, "contract.layout."),
            _name(lay, "rope_order", "contract.layout."),
        ),
        tokenizer_hash=_name(c, "tokenizer_hash", "contract."),
        **dims,
        **_windows_and_rope(c, dims["n_layers"]),
    )


def _windows_and_rope(c: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """The contract's sliding-window and RoPE-variant fields; absent (a producer older than them): the defaults,
    which are what a model without windows or RoPE scaling has."""
    p = "contract."
    fields: dict[str, Any] = {}
    if c.get("sliding_window") is not None:
        fields["sliding_window"] = doc_field(c, "sliding_window", int, p)
        if fields["sliding_window"] < 1:
            raise KVMalformedError(p + "sliding_window", f"must be positive, got {fields['sliding_window']}")
    if "sliding_layers" in c:
        layers = doc_field(c, "sliding_layers", list, p)
        if len(layers) > n_layers or any(type(i) is not int or not 0 <= i < n_layers for i in layers):
            raise KVMalformedError(p + "sliding_layers", f"must be layer indices below {n_layers}")
        fields["sliding_layers"] = tuple(layers)
    if c.get("rope_local_theta") is not None:
        try:
            fields["rope_local_theta"] = float(doc_field(c, "rope_local_theta", float, p))
        except OverflowError:
            raise KVMalformedError(p + "rope_local_theta", "beyond the float range") from None
    if "rope_scaling" in c:
        fields["rope_scaling"] = _name(c, "rope_scaling", p)
    return fields


def check_meta(meta: dict[str, Any]) -> None:
    """Raise KVTooLargeError unless `meta` stays within MAX_META_VALUES values, MAX_META_DEPTH levels of nesting
    and MAX_META_CHARS characters of keys and strings. Iterative, and stops at the first limit exceeded."""
    values, chars = 1, 0
    stack: list[tuple[Any, int]] = [(meta, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, (dict, list, tuple)):  # a writer's meta may hold tuples: JSON arrays
            if depth >= MAX_META_DEPTH:
                raise KVTooLargeError("meta", f"nested deeper than {MAX_META_DEPTH} levels")
            is_dict = isinstance(value, dict)
            values += len(value) * (2 if is_dict else 1)  # a dict's keys count, too
            if values > MAX_META_VALUES:
                raise KVTooLargeError("meta", f"more than {MAX_META_VALUES} values")
            if is_dict:
                chars += sum(len(key) for key in value if isinstance(key, str))
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
        if chars > MAX_META_CHARS:
            raise KVTooLargeError("meta", f"more than {MAX_META_CHARS} characters of keys and strings")


def doc_field(doc: dict[str, Any], key: str, kind: type, prefix: str = "") -> Any:
    """doc[key], checked to be of `kind` (an int is no bool; a float may be an int)."""
    if key not in doc:
        raise KVMalformedError(prefix + key, "missing from the header")
    value = doc[key]
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, (int, float) if kind is float else kind):
        raise KVMalformedError(prefix + key, f"expected {kind.__name__}, got {_describe(value)}")
    return value


def _name(doc: dict[str, Any], key: str, prefix: str) -> str:
    """A string field of the contract or the producer, at most MAX_NAME_CHARS long."""
    value = doc_field(doc, key, str, prefix)
    if len(value) > MAX_NAME_CHARS:
        raise KVTooLargeError(prefix + key, f"{len(value)} characters, at most {MAX_NAME_CHARS}")
    return value


def _describe(value: Any) -> str:
    """A short description of a JSON value for an error message: never a repr of a whole (deep) container."""
    if isinstance(value, (list, dict)):
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"int of {len(str(abs(value)))} digits"  # below json's int-string limit, so str() is allowed
    return f"{type(value).__name__} {value!r:.60}"


def _int64_table(rows: list[Any], field: str) -> np.ndarray:
    """int64 [len(rows), 5] from JSON rows of 5 ints (no bools), each within int64."""
    for index, row in enumerate(rows):
        if not (type(row) is list and len(row) == 5 and all(type(v) is int for v in row)):
            raise KVMalformedError(
                field,
                f"row {index} must be 5 ints [layer_start, layer_stop, token_start, "
                f"token_stop, raw_nbytes], got {_describe(row)}",
            )
    try:
        return np.array(rows, np.int64).reshape(len(rows), 5)
    except OverflowError:
        raise KVMalformedError(field, "a value beyond the int64 range") from None


def _array(doc: dict[str, Any], key: str, dtype: str, count: int) -> np.ndarray:
    """A base64 little-endian array field of exactly `count` items."""
    try:
        raw = base64.b64decode(doc_field(doc, key, str), validate=True)
    except ValueError as e:  # binascii.Error; or a str with non-ASCII characters
        raise KVMalformedError(key, f"not base64: {e}") from None
    itemsize = np.dtype(dtype).itemsize
    if len(raw) != count * itemsize:
        raise KVMalformedError(key, f"{len(raw)} bytes, expected {count} × {itemsize}")
    return np.frombuffer(raw, dtype).astype(np.dtype(dtype).newbyteorder("="), copy=False)


def _layouts(doc: dict[str, Any]) -> dict[Tier, tuple[QuantLayout, QuantLayout]]:
    """{"int4": {"keys": {axis, group, bits}, "values": {...}}, ...} -> {Tier.INT4: (keys, values), ...}"""
    layouts: dict[Tier, tuple[QuantLayout, QuantLayout]] = {}
    for name in doc:
        tier = Tier.__members__.get(name.upper())
        if tier not in QUANTIZED_TIERS:
            raise KVMalformedError("layouts", f"{name!r} is not a quantized tier")
        if tier in layouts:
            raise KVMalformedError("layouts", f"{name!r} names tier {tier.name} a second time")
        pair = doc_field(doc, name, dict, "layouts.")
        keys, values = (
            _layout(doc_field(pair, part, dict, f"layouts.{name}."), f"layouts.{name}.{part}") for part in KV_PARTS
        )
        layouts[tier] = (keys, values)
    return layouts


def _rotation(doc: dict[str, Any]) -> Rotation:
    """{"kind": "hadamard", "seed": int, "block": int, "tiers": ["int4", ...]} -> Rotation; an unknown kind is
    unsupported."""
    kind = _name(doc, "kind", "rotation.")
    if kind not in ROTATION_KINDS:
        raise KVUnsupportedError(
            "rotation.kind", f"{kind!r:.80} is not a rotation this reader knows ({ROTATION_KINDS})"
        )
    seed = doc_field(doc, "seed", int, "rotation.")
    if not 0 <= seed <= MAX_SEED:
        raise KVMalformedError("rotation.seed", f"must be in [0, {MAX_SEED}]")
    block = doc_field(doc, "block", int, "rotation.")
    if not (2 <= block <= MAX_BLOCK and not block & (block - 1)):
        raise KVMalformedError("rotation.block", f"must be a power of two in [2, {MAX_BLOCK}]")
    names = doc_field(doc, "tiers", list, "rotation.")
    tiers = [Tier.__members__.get(name.upper()) if isinstance(name, str) else None for name in names[:8]]
    if (
        not names
        or len(names) > len(QUANTIZED_TIERS)
        or len(set(tiers)) < len(tiers)
        or not set(tiers) <= set(QUANTIZED_TIERS)
    ):
        raise KVMalformedError(
            "rotation.tiers", f"must name distinct quantized tiers, at least one, got {_describe(names)}"
        )
    return Rotation(kind, seed, tuple(t for t in tiers if t is not None), block)


def _layout(doc: dict[str, Any], where: str) -> QuantLayout:
    fields = (
        doc_field(doc, "axis", str, where + "."),
        doc_field(doc, "group", int, where + "."),
        doc_field(doc, "bits", int, where + "."),
    )
    try:
        return QuantLayout(*fields)
    except ValueError as e:
        raise KVMalformedError(where, str(e)) from None


def _rect(c: ChunkSpec) -> str:
    return f"layers [{c.layer_start}, {c.layer_stop}) × tokens [{c.token_start}, {c.token_stop})"


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")
