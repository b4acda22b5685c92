"""EDKV framing: magics, versions, fixed-size frame prefixes and their (un)packing. All integers little-endian."""

from __future__ import annotations

import struct

MAJOR = 1
MINOR = 0

HEADER_MAGIC = b"EDKV"
CHUNK_MAGIC = b"EDKC"
TRAILER_MAGIC = b"EDKT"

HEADER_PREFIX = struct.Struct("<4sHHI")  # magic, major, minor, header JSON length
HEADER_CRC = struct.Struct("<I")  # crc32 of the header JSON, right after it
CHUNK_PREFIX = struct.Struct("<4sIII")  # magic, chunk index, compressed length, crc32 of the compressed bytes
TRAILER = struct.Struct("<4sI32s")  # magic, chunk count, SHA-256 of every byte before the trailer
MAGIC_NBYTES = 4

DEFAULT_MAX_HEADER_BYTES = 16 << 20
DEFAULT_MAX_CHUNK_BYTES = 64 << 20
