"""A sender's header edits: one field of a real header changed (contract, token ids, positions, tier map, layouts,
chunk table, declared sizes, version, the informational fields), sometimes with the chunk table's sizes made to
agree with it, and every checksum resealed."""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from test_kv_format import join_frames

from edgedecode.kv.quant import QuantLayout
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire.chunks import chunk_sizes
from edgedecode.kv.wire.frames import HEADER_CRC, HEADER_PREFIX, LOWBIT_MINOR, MAJOR, MINOR
from edgedecode.kv.wire.header import WindowCut, carried_cells, check_layouts, check_tier_map
from kvfuzz.draw import Draw, chance, pick
from kvfuzz.mutant import Mutant
from kvfuzz.seeds import Seed

Doc = dict[str, Any]
# a rotation a sender may add (EDKV 1.3 reads it; 1.2 ignores it)
ROTATION_DOC = {"kind": "hadamard", "seed": 12345, "block": 16, "tiers": ["int4", "int3", "int2"]}


def int_value(draw: Draw, value: int) -> int:
    """A neighbour of ``value``, a boundary of some integer type, or anything (None: drawn)."""
    boundaries = [value + 1, value - 1, 0, -1, 2 * value, value // 2, 255, 2**31, 2**32 - 1, 2**53 + 1]
    choice = pick(draw, [*boundaries, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, None])
    return draw.integer(-(2**64), 2**64) if choice is None else choice


def any_value(draw: Draw, value: Any) -> Any:
    """A value of the same JSON type as ``value`` (usually), or of another."""
    if isinstance(value, bool) or chance(draw, 15):
        return pick(draw, [None, not value, [], {}, "", 1.5, float("inf"), float("nan"), "AAAA", [value]])
    if isinstance(value, int):
        return int_value(draw, value)
    if isinstance(value, float):
        return pick(draw, [value * 2, value / 2, 0.0, -value, 1e308, 5e-324, float(2**64), value + 1])
    if isinstance(value, str):
        return pick(draw, ["", value + "x", value[:-1], "x" * 1025, "\u0000", "é" * 3, value.upper()])
    return pick(draw, [None, 0, "x"])


def _array(doc: Doc, key: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(doc[key]), dtype).copy()


def _put(doc: Doc, key: str, array: np.ndarray) -> None:
    doc[key] = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def _token_ids(doc: Doc, draw: Draw, seed: Seed) -> str:
    ids = _array(doc, "token_ids", "<i8")
    if not len(ids):
        return "token ids: none to edit"
    i = draw.integer(0, len(ids) - 1)
    op = pick(draw, ["another prompt token", "any id", "swap two", "one fewer", "one more"])
    if op == "another prompt token":
        ids[i] = seed.prompt_ids[draw.integer(0, len(seed.prompt_ids) - 1)]
    elif op == "any id":
        ids[i] = int_value(draw, int(ids[i])) % 2**64 - 2**63
    elif op == "swap two":
        j = draw.integer(0, len(ids) - 1)
        ids[i], ids[j] = ids[j], ids[i]
    else:
        ids = ids[:-1] if op == "one fewer" else np.append(ids, ids[-1])
    _put(doc, "token_ids", ids)
    return f"token ids: {op}"


def _positions(doc: Doc, draw: Draw, seed: Seed) -> str:
    positions = _array(doc, "positions", "<i8")
    if not len(positions):
        return "positions: none to edit"
    i = draw.integer(0, len(positions) - 1)
    op = pick(draw, ["one off", "any", "swap two", "shift all", "shift all with their prompt tokens", "one fewer"])
    if op == "one off":
        positions[i] += pick(draw, [-1, 1])
    elif op == "any":
        positions[i] = int_value(draw, int(positions[i])) % 2**64 - 2**63
    elif op == "swap two":
        j = draw.integer(0, len(positions) - 1)
        positions[i], positions[j] = positions[j], positions[i]
    elif op == "one fewer":
        positions = positions[:-1]
    else:  # a self-consistent edit when the ids follow: the KV claimed for other tokens of the same prompt
        positions += draw.integer(-int(positions[0]), len(seed.prompt_ids) - 1 - int(positions[-1]))
        if op.endswith("tokens"):
            _put(doc, "token_ids", seed.prompt_ids[positions])
    _put(doc, "positions", positions)
    return f"positions: {op}"


def _tiers(doc: Doc, draw: Draw, seed: Seed) -> str:
    layers, n = seed.header.contract.n_layers, int(doc["n_tokens"])
    tiers = _array(doc, "tiers", "u1")
    if tiers.size != layers * n or not n:
        return "tiers: none to edit"
    tiers = tiers.reshape(layers, n)
    layer, token = draw.integer(0, layers - 1), draw.integer(0, n - 1)
    code = pick(draw, [*range(len(Tier)), len(Tier), 255])
    op = pick(draw, ["one cell", "one token", "one layer", "swap two tokens"])
    if op == "one cell":
        tiers[layer, token] = code
    elif op == "one token":
        tiers[:, token] = code
    elif op == "one layer":
        tiers[layer] = code
    else:  # the same bytes in a chunk that holds both: only the KV read from them changes
        other = draw.integer(0, n - 1)
        tiers[:, [token, other]] = tiers[:, [other, token]]
    _put(doc, "tiers", tiers)
    return f"tiers: {op}"


def _layouts(doc: Doc, draw: Draw, seed: Seed) -> str:
    layouts = doc["layouts"]
    name = pick(draw, ["int8", "int4", "int3", "int2"])
    op = pick(draw, ["axis", "group", "bits", "remove", "add"])
    if op == "remove":
        layouts.pop(name, None)
    elif op == "add":
        layouts[name] = {part: {"axis": "token", "group": 64, "bits": 8} for part in ("keys", "values")}
    elif name in layouts:
        layout = layouts[name][pick(draw, ["keys", "values"])]
        if op == "axis":
            layout["axis"] = pick(draw, ["token", "channel", "tokens"])
        else:
            layout[op] = pick(draw, [1, 2, 4, 8, 16, 32, 64, 3, 128, int_value(draw, layout[op])])
    return f"layouts: {op}"


def _chunks(doc: Doc, draw: Draw, seed: Seed) -> str:
    rows = doc["chunks"]
    k = draw.integer(0, len(rows) - 1)
    op = pick(draw, ["one value", "remove a row", "repeat a row", "swap two rows", "split a row", "merge two rows"])
    if op == "one value":
        field = draw.integer(0, 4)
        rows[k][field] = int_value(draw, rows[k][field])
    elif op == "remove a row":
        del rows[k]
    elif op == "repeat a row":
        rows.insert(draw.integer(0, len(rows)), list(rows[k]))
    elif op == "swap two rows":
        j = draw.integer(0, len(rows) - 1)
        rows[j], rows[k] = rows[k], rows[j]
    elif op == "split a row" and rows[k][3] - rows[k][2] > 1:
        l0, l1, t0, t1, _ = rows[k]
        cut = draw.integer(t0 + 1, t1 - 1)
        rows[k : k + 1] = [[l0, l1, t0, cut, 0], [l0, l1, cut, t1, 0]]
    elif op == "merge two rows" and k + 1 < len(rows):
        (l0, l1, t0, _, _), (_, _, _, t1, _) = rows[k], rows[k + 1]
        rows[k : k + 2] = [[l0, l1, t0, t1, 0]]
    return f"chunks: {op}"


def _field(doc: Doc, draw: Draw, seed: Seed) -> str:
    """Any other field: the contract's, n_tokens, the informational ones; or one removed or added."""
    key = pick(
        draw,
        ["contract", "contract", "n_tokens", "zstd_level", "meta", "producer", "transfer", "rotation", "remove", "add"],
    )
    if key == "remove":
        doc.pop(pick(draw, sorted(doc)))
    elif key == "add":
        doc[pick(draw, ["future_field", "transfer", "rotation"])] = pick(
            draw, [1, "x", {"id": "fuzz", "ttl_s": 1}, None, ROTATION_DOC, {**ROTATION_DOC, "kind": "givens"}]
        )
    elif key == "rotation" and isinstance(doc.get(key), dict) and chance(draw, 30):
        doc[key]["tiers"] = pick(draw, [["int4"], ["int8"], ["int3", "int3"], [], ["fp16"], ["INT2", "int4"]])
    elif (
        key in ("contract", "producer", "meta", "transfer", "rotation") and isinstance(doc.get(key), dict) and doc[key]
    ):
        node = doc[key]
        name = pick(draw, sorted(node))
        if isinstance(node[name], dict) and node[name]:
            node, name = node[name], pick(draw, sorted(node[name]))
        node[name] = any_value(draw, node[name])
        key = f"{key}.{name}"
    elif key in doc:
        doc[key] = any_value(draw, doc[key])
    return f"field: {key}"


def _importance(doc: Doc, draw: Draw, seed: Seed) -> str:
    """EDKV 1.2's ``importance`` (float16 a token): a value made NaN, infinite, negative or huge, one too few or
    many, or not base64."""
    if not isinstance(doc.get("importance"), str):
        doc["importance"] = pick(draw, ["", "AAAA", None, 1.5, [0.5]])
        return "importance: added"
    values = _array(doc, "importance", "<f2")
    op = pick(draw, ["one value", "one fewer", "one more", "not base64"])
    if op == "one value" and len(values):
        values[draw.integer(0, len(values) - 1)] = pick(draw, [np.nan, np.inf, -np.inf, -1.0, 65504.0, 0.0])
    elif op == "one fewer":
        values = values[:-1]
    elif op == "one more":
        values = np.append(values, np.float16(1))
    if op == "not base64":
        doc["importance"] = pick(draw, ["@@@@", doc["importance"][:-1], doc["importance"] + "A"])
    else:
        _put(doc, "importance", values)
    return f"importance: {op}"


def _window(doc: Doc, draw: Draw, seed: Seed) -> str:
    """EDKV 2.0's ``window``: its start moved (by one, to the ends, past them, to anything), its layers changed (a
    global layer added, one left out, repeated, out of order, none), or the whole field removed or added."""
    window = doc.get("window")
    if not isinstance(window, dict):
        layers = list(seed.header.contract.sliding_layers) or [0]
        doc["window"] = {"layers": layers, "start": draw.integer(0, max(len(seed.prompt_ids), 1))}
        return "window: added"
    op = pick(draw, ["start", "start", "layers", "layers", "removed", "field"])
    n, n_layers = doc.get("n_tokens", 0), seed.header.contract.n_layers
    if op == "start":
        start = window.get("start", 0)
        start = start if type(start) is int else 0
        window["start"] = pick(draw, [start + 1, start - 1, 0, n, n + 1, -1, None, int_value(draw, start)])
    elif op == "layers":
        layers = list(window.get("layers") or [0])
        change = pick(draw, ["a global layer", "one fewer", "repeat one", "reversed", "none", "out of range"])
        if change == "a global layer":
            layers.append(next((i for i in range(n_layers) if i not in layers), n_layers))
        elif change == "one fewer":
            layers.pop(draw.integer(0, len(layers) - 1))
        elif change == "repeat one":
            layers.append(layers[0])
        elif change == "reversed":
            layers.reverse()
        elif change == "none":
            layers = []
        else:
            layers[draw.integer(0, len(layers) - 1)] = pick(draw, [n_layers, -1, 2**63])
        window["layers"] = layers
        op = f"layers, {change}"
    elif op == "removed":
        del doc["window"]
    else:
        doc["window"] = any_value(draw, window)
    return f"window: {op}"


EDITS: list[Callable[[Doc, Draw, Seed], str]] = [
    _token_ids,
    _positions,
    _tiers,
    _layouts,
    _chunks,
    _field,
    _importance,
    _window,
]


def edit_header(seed: Seed, draw: Draw) -> Mutant:
    """One header edit (and sometimes a version change), resealed; half the time the chunk table's raw sizes
    are recomputed for the edited tier map and layouts, so the header agrees with itself."""
    header, chunks, _ = seed.frames
    doc = json.loads(header[HEADER_PREFIX.size : -HEADER_CRC.size])
    label = pick(draw, EDITS)(doc, draw, seed)
    if chance(draw, 50) and _resize_chunks(doc, seed):
        label += ", sizes agree"
    major, minor = seed.header.major, seed.header.minor
    if chance(draw, 10):
        major, minor = pick(
            draw,
            [
                (0, 9),
                (2, 0),
                (MAJOR, 0),
                (MAJOR, MINOR),
                (MAJOR, LOWBIT_MINOR[MAJOR]),
                (MAJOR, 2**16 - 1),
                (2**16 - 1, 0),
            ],
        )
        label += f", version {major}.{minor}"
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8", "surrogatepass")
    frame = HEADER_PREFIX.pack(b"EDKV", major, minor, len(body)) + body + HEADER_CRC.pack(zlib.crc32(body))
    return Mutant(join_frames(frame, list(chunks)), f"header {label}", seed.bodies)


def _resize_chunks(doc: Doc, seed: Seed) -> bool:
    """Set every chunk row's raw size to what the (edited) tier map and layouts imply; False where they are
    too broken to imply any (the header is refused before its sizes matter then)."""
    c = seed.header.contract
    n, rows = doc.get("n_tokens"), doc.get("chunks")
    if type(n) is not int or n < 0 or not isinstance(rows, list):
        return False
    rects = [row[:4] for row in rows if isinstance(row, list) and len(row) == 5]
    if len(rects) != len(rows) or not all(
        all(type(v) is int for v in r) and 0 <= r[0] < r[1] <= c.n_layers and 0 <= r[2] < r[3] <= n for r in rects
    ):
        return False
    try:  # what the reader would refuse as malformed anyway: no size to agree with
        tiers = _array(doc, "tiers", "u1").reshape(c.n_layers, n)
        layouts = {
            Tier[name.upper()]: (QuantLayout(**pair["keys"]), QuantLayout(**pair["values"]))
            for name, pair in doc["layouts"].items()
        }
        check_tier_map(tiers, c.n_layers, n)  # KVMalformedError is a ValueError
        check_layouts(tiers, layouts, c.head_dim)
        window = WindowCut.from_doc(doc["window"], c.n_layers) if "window" in doc else None
        cells = carried_cells(tiers, window)  # a window's start or layers beyond the map: IndexError
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return False
    raw, _ = chunk_sizes(cells, layouts, c.n_kv_heads, c.head_dim, np.array(rects, np.int64).reshape(-1, 4))
    for row, size in zip(rows, raw.tolist()):
        row[4] = size
    return True
