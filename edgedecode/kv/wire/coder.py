"""What fills a chunk before zstd: the bytes of each section (docs/kv-format.md §4) from a snapshot.

``SectionCoder`` is the reference: every section quantized (or cast to float16) by ``kv/quant.py`` when its chunk is
filled, or by a ``kernel`` it is given (``kernels/kv_sections.py``: the same bytes in one pass over the rows, straight
into the chunk; the reference takes over any section the kernel declines). ``KeepingCoder`` also keeps whole
compressed chunks for the next payload of the snapshot (what a kernel-backed coder needs for the budget fit's
refits). ``CachingCoder`` writes the same bytes for a sender that encodes one snapshot several times (the prefill
server's budget fit tries a few tier maps): it computes a wave of chunks' sections at once, keeps what a later
payload of the same snapshot can reuse, and leaves the arithmetic to three methods that a device coder
(``prefill/kv_device.py``: onnxruntime next to the KV) overrides:

* token-axis layouts quantize each token on its own, so every token's codes are computed once per tier and layer
  and kept: a later payload gathers them;
* channel-axis layouts group a section's tokens, so a section is computed for its exact token list and kept for the
  next payload, which reuses it where that chunk's tier row did not change;
* FP16 sections likewise; and ``compressed``/``keep`` hold whole compressed chunks, keyed by their tier rows.

What a payload did not use is forgotten when the next one starts (``begin_payload``): at most two payloads' worth.
Waves of distinct chunks may be prepared and filled on different threads at once: they touch distinct cells.

A coder is made for one rotation (EDKV 1.3, ``kv/rotation.py``; None: none): the sections of its tiers are
rotated before they are quantized, and everything kept is kept for that rotation.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from edgedecode.kv.quant import QuantLayout, quantize
from edgedecode.kv.rotation import Rotation, hadamard_signs, rotate
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.wire.chunks import ChunkPlan, Section, section_arrays

# (rows [layers, H, n, D], tokens on axis 2, layout or None for FP16, the section's views) -> written, or False: the
# section is left to the reference (kernels/kv_sections.py)
SectionKernel = Callable[[np.ndarray, np.ndarray, "QuantLayout | None", list[np.ndarray]], bool]
FP16_OVERFLOW = 65520.0  # the smallest magnitude that float16 rounds to infinity
_FP16_EXPONENT = np.uint16(0x7C00)  # all ones: an infinity or a NaN


class SectionCoder:
    """The reference: each section computed with ``kv/quant.py`` (or ``kernel``) when its chunk is filled; nothing
    kept."""

    wave_chunks = 1  # chunks a writer hands to ``prepare`` at once
    fill_stage = "quantize"  # what ``fill`` does, as a stage of ``kv.stage_clock``

    def __init__(
        self,
        snapshot: KVSnapshot,
        rotation: Rotation | None = None,
        kernel: SectionKernel | None = None,
        crc32: Callable[[bytes], int] = zlib.crc32,
    ) -> None:
        self.snapshot = snapshot
        self.contract = snapshot.contract
        self.rotation = rotation
        self.kernel = kernel
        self.crc32 = crc32  # of each compressed chunk, for its frame (zlib's function, or the same values faster)
        if rotation is not None:
            rotation.check_head_dim(snapshot.contract.head_dim)

    def rotates(self, section: Section) -> bool:
        """Whether ``section``'s rows are rotated before they are quantized."""
        return self.rotation is not None and self.rotation.rotates(section.tier)

    def begin_payload(self) -> None:
        """A payload of this snapshot starts (what the one before it did not use may be forgotten)."""

    def prepare(self, plans: Sequence[ChunkPlan]) -> None:
        """Compute what ``plans``' chunks need, ahead of ``fill`` (the reference computes it in ``fill``)."""

    def fill(self, raw: bytearray | memoryview, plan: ChunkPlan) -> None:
        """Write the chunk's bytes before zstd into ``raw`` (``plan.raw_nbytes``).

        Raises:
            ValueError: FP16 values not finite in float16, or values a quantizer cannot represent.
        """
        c = self.contract
        for section in plan.sections:
            arrays = section_arrays(raw, section, c.n_kv_heads, c.head_dim)
            source = self._source(section.kv)[section.layer_start : section.layer_stop]
            rows = None
            if self.rotates(section):
                rows = self.rotated(source[:, :, section.tokens], section.kv, section.layer_start, section.layer_stop)
            if self.kernel is not None:
                at, tokens = (source, section.tokens) if rows is None else (rows, np.arange(len(section.tokens)))
                if self.kernel(at, tokens, section.layout, arrays):
                    continue
            if rows is None:
                rows = source[:, :, section.tokens]
            if section.layout is None:
                with np.errstate(over="ignore"):  # refused just below, with the layers named
                    arrays[0][...] = rows
                if not np.isfinite(arrays[0]).all():
                    raise _fp16_error(section)
                continue
            for array, part in zip(arrays, quantize(rows, section.layout)):
                array[...] = part

    def compressed(self, key: Hashable) -> tuple[bytes, int] | None:
        """A chunk compressed for an earlier payload under ``key`` (its rectangle, tier rows, layouts and zstd
        level), and its CRC-32, if kept."""
        return None

    def keep(self, key: Hashable, body: tuple[bytes, int]) -> None:
        """Remember a compressed chunk and its CRC-32 for a later payload of this snapshot."""

    def rotated(self, rows: np.ndarray, kv: int, l0: int, l1: int) -> np.ndarray:
        """K (kv 0) or V ``rows [l1 - l0, H, m, D]`` of layers [l0, l1), rotated (float32).

        Raises:
            ValueError: a value not finite (the rotation would spread it over its whole block).
        """
        assert self.rotation is not None
        if not np.isfinite(rows).all():
            raise ValueError("cannot quantize non-finite KV values (inf or NaN)")
        c = self.contract
        signs = hadamard_signs(self.rotation.seed, c.n_layers, c.n_kv_heads, c.head_dim)[l0:l1, kv]
        return rotate(rows.astype(np.float32, copy=False), signs, self.rotation.block)

    def _source(self, kv: int) -> np.ndarray:
        return (self.snapshot.keys, self.snapshot.values)[kv]


@dataclass
class _TokenCodes:
    """Every token's codes and parameters under one token-axis layout, for K or V: [layers, H, n, ...]."""

    done: np.ndarray  # bool [layers, n]
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray


class _Kept:
    """Values by key, kept while the current or the previous payload used them."""

    def __init__(self) -> None:
        self.current: dict = {}
        self.previous: dict = {}

    def rotate(self) -> None:
        self.previous, self.current = self.current, {}

    def get(self, key: Hashable):
        found = self.current.get(key)
        if found is None:
            found = self.previous.get(key)
            if found is not None:
                self.current[key] = found
        return found

    def put(self, key: Hashable, value) -> None:
        self.current[key] = value


class KeepingCoder(SectionCoder):
    """The reference's sections (or its kernel's) computed when a chunk is filled, and each compressed chunk kept
    for the next payload of the snapshot, which reuses it where the chunk's tier rows did not change."""

    @functools.cached_property
    def _chunks(self) -> _Kept:
        return _Kept()

    def begin_payload(self) -> None:
        self._chunks.rotate()

    def compressed(self, key: Hashable) -> tuple[bytes, int] | None:
        return self._chunks.get(key)

    def keep(self, key: Hashable, body: tuple[bytes, int]) -> None:
        self._chunks.put(key, body)


class CachingCoder(KeepingCoder):
    """The reference's bytes, computed a wave of chunks at a time and kept for the next payload of the snapshot."""

    fill_stage = "assemble"

    def __init__(self, snapshot: KVSnapshot, rotation: Rotation | None = None) -> None:
        super().__init__(snapshot, rotation)
        self._tokens: dict[tuple[int, QuantLayout, bool], _TokenCodes] = {}
        self._sections = _Kept()  # FP16 rows and channel-axis (codes, scales, zeros) by section key
        self._lock = threading.Lock()

    def begin_payload(self) -> None:
        super().begin_payload()
        self._sections.rotate()

    def prepare(self, plans: Sequence[ChunkPlan]) -> None:
        """Compute every section of ``plans`` not already known: per (K or V, tier, layer run), the tokens a
        token-axis layout has not seen, and the FP16 and channel-axis sections not kept, each group in one call
        (rotated sections apart from the others)."""
        tokens: dict[tuple, list[np.ndarray]] = {}
        sections: dict[tuple, list[Section]] = {}
        for plan in plans:
            for s in plan.sections:
                run = (s.kv, s.layout, s.layer_start, s.layer_stop, self.rotates(s))
                if s.layout is not None and s.layout.axis == "token":
                    cache = self._token_codes(s.kv, s.layout, self.rotates(s))
                    missing = s.tokens[~cache.done[s.layer_start : s.layer_stop, s.tokens].all(axis=0)]
                    if len(missing):
                        tokens.setdefault(run, []).append(missing)
                elif self._sections.get(self._key(s)) is None:
                    sections.setdefault(run, []).append(s)
        for (kv, layout, l0, l1, rotated), parts in tokens.items():
            self._compute_tokens(kv, layout, l0, l1, np.concatenate(parts), rotated)
        for (kv, layout, l0, l1, rotated), group in sections.items():
            lists = [s.tokens for s in group]
            computed = self.fp16_sections(kv, l0, l1, lists) if layout is None else (
                self.quantized_sections(kv, layout, l0, l1, lists, rotated))  # fmt: skip
            for s, value in zip(group, computed):
                self._sections.put(self._key(s), value)

    def fill(self, raw: bytearray | memoryview, plan: ChunkPlan) -> None:
        """Copy the chunk's sections (computed by ``prepare``, which it calls for anything missing) into ``raw``."""
        self.prepare([plan])
        c = self.contract
        for s in plan.sections:
            arrays = section_arrays(raw, s, c.n_kv_heads, c.head_dim)
            if s.layout is not None and s.layout.axis == "token":
                cache = self._tokens[s.kv, s.layout, self.rotates(s)]
                for array, part in zip(arrays, (cache.codes, cache.scales, cache.zeros)):
                    np.take(part[s.layer_start : s.layer_stop], s.tokens, axis=2, out=array, mode="clip")
                continue
            value = self._sections.get(self._key(s))
            for array, part in zip(arrays, (value,) if s.layout is None else value):
                array[...] = part

    # -- the arithmetic: numpy here, onnxruntime in prefill/kv_device.py (HostCoder: ``quantized``; DeviceCoder:
    # the three below, a run on the KV's device each)

    def quantized(
        self, kv: int, layout: QuantLayout, l0: int, l1: int, tokens: np.ndarray, rotated: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, scales, zeros) [l1 - l0, H, m, ...] of K (kv 0) or V at ``tokens`` quantized as one section
        (``rotated``: by the coder's rotation first)."""
        return quantize(self.gathered(kv, l0, l1, tokens, rotated), layout)

    def quantized_tokens(
        self, kv: int, layout: QuantLayout, l0: int, l1: int, tokens: np.ndarray, rotated: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``quantized`` under a token-axis layout: each token's codes on their own."""
        return self.quantized(kv, layout, l0, l1, tokens, rotated)

    def quantized_sections(
        self,
        kv: int,
        layout: QuantLayout,
        l0: int,
        l1: int,
        token_lists: list[np.ndarray],
        rotated: bool = False,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each token list of layers [l0, l1) quantized as one section: (codes, scales, zeros) per list."""
        return [self.quantized(kv, layout, l0, l1, tokens, rotated) for tokens in token_lists]

    def fp16_sections(self, kv: int, l0: int, l1: int, token_lists: list[np.ndarray]) -> list[np.ndarray]:
        """Each token list of layers [l0, l1) as float16 rows [l1 - l0, H, m, D].

        Raises:
            ValueError: a value not finite in float16.
        """
        rows = self.gathered(kv, l0, l1, np.concatenate(token_lists))
        if not fp16_finite(rows):
            raise fp16_error(kv, l0, l1)
        return np.split(self.to_fp16(rows), np.cumsum([len(t) for t in token_lists])[:-1], axis=2)

    def to_fp16(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (finite in float16) as float16, rounded to nearest even."""
        return rows.astype(np.float16, copy=False)

    def gathered(self, kv: int, l0: int, l1: int, tokens: np.ndarray, rotated: bool = False) -> np.ndarray:
        """K (kv 0) or V of layers [l0, l1) at ``tokens``: a C-contiguous copy [l1 - l0, H, m, D] (``rotated``: by
        the coder's rotation, float32)."""
        rows = np.take(self._source(kv)[l0:l1], tokens, axis=2)
        return self.rotated(rows, kv, l0, l1) if rotated else rows

    def _token_codes(self, kv: int, layout: QuantLayout, rotated: bool) -> _TokenCodes:
        key = (kv, layout, rotated)
        found = self._tokens.get(key)
        if found is None:
            with self._lock:
                found = self._tokens.get(key)
                if found is None:
                    found = self._tokens[key] = _new_token_codes(self.contract, self.snapshot.n_tokens, layout)
        return found

    def _compute_tokens(
        self, kv: int, layout: QuantLayout, l0: int, l1: int, tokens: np.ndarray, rotated: bool
    ) -> None:
        cache = self._tokens[kv, layout, rotated]
        computed = self.quantized_tokens(kv, layout, l0, l1, tokens, rotated)
        for part, values in zip((cache.codes, cache.scales, cache.zeros), computed):
            part[l0:l1, :, tokens] = values
        cache.done[l0:l1, tokens] = True

    def _key(self, s: Section) -> tuple:
        return s.kv, s.layout, s.layer_start, s.layer_stop, self.rotates(s), s.tokens.tobytes()


def _new_token_codes(contract, n: int, layout: QuantLayout) -> _TokenCodes:
    h, d = contract.n_kv_heads, contract.head_dim
    lead = (contract.n_layers, h, n)
    return _TokenCodes(
        np.zeros((contract.n_layers, n), bool),
        np.empty((*lead, d * layout.bits // 8), np.uint8),
        np.empty((*lead, d // layout.group), np.float16),
        np.empty((*lead, d // layout.group), np.float16),
    )


def fp16_finite(rows: np.ndarray) -> bool:
    """Whether float32 or float16 ``rows`` are all finite once cast to float16 (two reductions, not a cast)."""
    if rows.dtype == np.float16:
        return not ((rows.view(np.uint16) & _FP16_EXPONENT) == _FP16_EXPONENT).any()
    return bool(rows.min() > -FP16_OVERFLOW and rows.max() < FP16_OVERFLOW)  # a NaN fails both


def _fp16_error(section: Section) -> ValueError:
    return fp16_error(section.kv, section.layer_start, section.layer_stop)


def fp16_error(kv: int, l0: int, l1: int) -> ValueError:
    """The error for FP16 K (kv 0) or V of layers [l0, l1) that float16 cannot hold."""
    return ValueError(
        f"FP16 {('keys', 'values')[kv]} of layers [{l0}, {l1}) hold values that are not finite in float16"
    )
