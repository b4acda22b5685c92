"""Opening GGUF files defensively: a truncated, corrupt or foreign file becomes a named error."""

from __future__ import annotations

import hashlib
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
        reader = GGUFReader(path, "r")
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
