"""Typed EDKV errors: each names the offending field, so a surface can report exactly what was refused."""

from __future__ import annotations

from edgedecode.errors import EdgeDecodeError


class KVFormatError(EdgeDecodeError, ValueError):
    """An EDKV stream (or the input to the writer) that cannot be accepted; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"EDKV {field}: {message}")
        self.field = field


class KVVersionError(KVFormatError):
    """A major version this reader does not know."""


class KVContractError(KVFormatError):
    """The producer's KVContract differs from the receiver's; ``fields`` names every differing field."""

    def __init__(self, mismatches: list[str]) -> None:
        self.fields = tuple(m.split(":", 1)[0] for m in mismatches)
        super().__init__(", ".join(self.fields), "KV contract mismatch: " + "; ".join(mismatches))


class KVUnsupportedError(KVFormatError):
    """A well-formed stream using a feature of the format this reader does not implement (an unknown
    ``rotation.kind``): a newer sender, not a corrupt one."""


class KVChecksumError(KVFormatError):
    """A CRC-32 (header, chunk) or the trailer's SHA-256 does not match the bytes received."""


class KVTruncatedError(KVFormatError):
    """The stream ended inside (or before) the named header, chunk or trailer."""


class KVTooLargeError(KVFormatError):
    """A header, chunk or token count beyond the receiver's limits."""


class KVMalformedError(KVFormatError):
    """Bytes or header fields that break the format: bad magic, JSON, tier map, chunk table, sizes."""


class KVValueError(KVMalformedError):
    """A chunk whose checksums hold but whose float16 values (FP16 rows, quantization scales or zeros) are not
    finite; refused before anything from the chunk is written."""
