"""Opening GGUF files defensively: a truncated, corrupt or foreign file becomes a named error."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from edgedecode.errors import EdgeDecodeError

GGUF_MAGIC = b"GGUF"
_HASH_CHUNK_BYTES = 8 << 20


class ModelFileError(EdgeDecodeError):
    """The model file is missing, truncated, corrupt or of an unsupported kind."""


def sha256_file(path: Path) -> str:
    """Return the hex SHA-256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class _BulkArrayReader(GGUFReader):
    """gguf's reader, cutting metadata arrays of scalars or strings into their per-element parts in one
    pass over plain array views. gguf 0.19 makes two or three memory-map views per element (14 s for
    Gemma 3's 262,144-token vocabulary, on every start); the fields it builds are the same (same parts,
    dtypes and indices; tests/test_gguf_file.py)."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type = GGUFValueType(raw_item_type[0])
        data = self.data.view(np.ndarray)  # slices of a plain array: no memmap bookkeeping per element
        start = orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            end = start + np.dtype(scalar).itemsize * int(count[0])
            if end > len(data):
                raise ValueError(f"array at byte {orig_offs} ends past the end of the file")
            values = data[start:end].view(scalar)
            parts = [values[i : i + 1] for i in range(len(values))]
            indices = list(range(2, 2 + len(parts)))
        elif item_type == GGUFValueType.STRING:
            parts, end = self._string_parts(data, start, int(count[0]))
            indices = list(range(3, 2 + len(parts), 2))
        else:  # nested arrays: gguf's own path
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY] + ([item_type] if parts else [])
        return end - orig_offs, [raw_item_type, count, *parts], indices, types

    @staticmethod
    def _string_parts(data: np.ndarray, start: int, count: int) -> tuple[list[np.ndarray], int]:
        """[length (uint64 [1]), bytes (uint8 [length])] per string of an array; and where it ends."""
        parts: list[np.ndarray] = []
        offset, size, buffer = start, len(data), data.data  # the array's buffer, for struct
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", buffer, offset)
            if offset + 8 + length > size:
                raise ValueError(f"string at byte {offset} ends past the end of the file")
            parts += (data[offset : offset + 8].view(np.uint64), data[offset + 8 : offset + 8 + length])
            offset += 8 + length
        return parts, offset


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file and check that every tensor's data lies inside the file.

    Raises:
        ModelFileError: the file is missing, is not GGUF, or is truncated or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
    size_bytes = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _BulkArrayReader(path, "r")
    except Exception as exc:  # gguf raises ValueError, IndexError, struct errors... on damaged headers
        raise ModelFileError(
            f"{path}: cannot parse the GGUF header or tensor table ({size_bytes} bytes; "
            f"the file is truncated or corrupt): {exc}"
        ) from exc
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size_bytes:
            raise ModelFileError(
                f"{path}: truncated: tensor {tensor.name!r} ends at byte {end} but the file has {size_bytes} bytes"
            )
    return reader


def field_value(reader: GGUFReader, key: str):
    """Return a metadata value as a Python scalar, string or list; None when the key is absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    value_type = field.types[0]
    if value_type == GGUFValueType.ARRAY:
        item_type = field.types[-1]
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if value_type == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def field_array(reader: GGUFReader, key: str) -> np.ndarray | None:
    """Return a numeric array field as one numpy array (fast path for large vocab arrays)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.empty(0)


def tensor_table(reader: GGUFReader) -> dict[str, ReaderTensor]:
    """Map tensor names to reader tensors."""
    return {t.name: t for t in reader.tensors}
