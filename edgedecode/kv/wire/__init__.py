"""EDKV 1.x and 2.x, the KV-cache wire format (docs/kv-format.md): per-token tiers, zstd chunks, checksums."""

from edgedecode.kv.wire.errors import (
    KVChecksumError,
    KVContractError,
    KVFormatError,
    KVMalformedError,
    KVTooLargeError,
    KVTruncatedError,
    KVUnsupportedError,
    KVValueError,
    KVVersionError,
)
from edgedecode.kv.wire.header import ChunkSpec, EDKVHeader, TransferRef, WindowCut
from edgedecode.kv.wire.reader import EDKVReader, ReadProgress, decode_snapshot
from edgedecode.kv.wire.writer import encode_payload

__all__ = [
    "ChunkSpec",
    "EDKVHeader",
    "EDKVReader",
    "KVChecksumError",
    "KVContractError",
    "KVFormatError",
    "KVMalformedError",
    "KVTooLargeError",
    "KVTruncatedError",
    "KVUnsupportedError",
    "KVValueError",
    "KVVersionError",
    "ReadProgress",
    "TransferRef",
    "WindowCut",
    "decode_snapshot",
    "encode_payload",
]
