"""The reader's value check: every value a chunk can write is finite and within the receiver's per-layer limits.

What a section can write is bounded before anything is written:

- FP16 rows: the rows themselves. As uint16 bits, a float16's magnitude orders like its bits without the sign:
  the largest positive value is the int16 maximum of the bits, the largest negative one's magnitude the uint16
  maximum less 0x8000. Two max-reductions per layer, no copy; ±inf and NaN (an all-ones exponent) exceed any
  finite limit the same way.
- Quantized sections: ``x̂ = q·scale + zero`` (float32, ``quant.dequantize_into``) is monotone in the code q, so
  a group's extremes are its ``zero`` (q = 0) and ``zero + (2^b − 1)·scale``, computed with the same float32
  rounding: the largest |x̂| any codes can give, whatever the codes are. Scales and zeros are checked finite by
  their bits first.
- Rotated sections (EDKV 1.3): x̂ is in the rotated domain; the reader writes ``(x̂ · H) ⊙ s`` (``kv.rotation``),
  each entry a ±1/√B sum of B of x̂'s, so up to √B times x̂'s largest; and a valid payload's x̂ may itself be √B
  times the largest value it rotates back to (a rotation keeps a block's L2 norm, and may gather it into one
  entry). x̂'s reach (zeros and top codes) therefore proves a layer within its limit only when √B times it is;
  real KV, whose outliers the rotation spreads, nearly always is. Any other layer is rotated back here, with the
  reader's own arithmetic, into the reader's staging (nothing of the chunk is written yet), and its largest |x|
  checked: valid data is never refused for where the rotation put its values, and what is written is what was
  checked.

A float16 destination caps every limit at 65504, the largest float16: a finite payload can then never write
±inf into it (docs/kv-format.md §5), rotated or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.kv.quant import FP16_MAX, dequantize_into
from edgedecode.kv.rotation import unrotate_into
from edgedecode.kv.wire.chunks import Section, section_arrays, section_float16
from edgedecode.kv.wire.errors import KVValueError
from edgedecode.kv.wire.header import ChunkSpec

_SIGN = 0x8000
_FINITE_BITS = 0x7BFF  # the largest finite float16's bits (65504)
_KINDS = ("keys", "values")
# float32 GEMM rounding over a block of B ≤ 1024 terms stays far below this relative margin: √B·reach·(1 + it)
# within the limit proves the rotated-back values within it
_GEMM_MARGIN = 2.0**-12


@dataclass(frozen=True)
class Unrotation:
    """What rotating a section's values back takes, as the reader does it: the rotation's ``block``, its ``signs``
    (float32 ``[layers, 2, heads, D]``, ``rotation.hadamard_signs``) and float32 ``staging [2, n]`` with n at least
    one layer of the widest section's values (the reader's own: the check runs before any write)."""

    block: int
    signs: np.ndarray
    staging: np.ndarray


class ValueBounds:
    """The largest |x| a reader writes per layer, for keys and values.

    ``limits``: float32 ``[n_layers, 2]`` (keys, values), e.g. ``KVValueRange.limits()``; None: finite values only.
    """

    def __init__(self, limits: np.ndarray | None, n_layers: int) -> None:
        given = np.full((n_layers, 2), np.inf, np.float32) if limits is None else np.asarray(limits, np.float32)
        if given.shape != (n_layers, 2) or not (given >= 0).all():
            raise ValueError(f"value limits must be non-negative float32 [{n_layers}, 2], got {given.shape}")
        self.limits = given
        # the largest float16 within each limit, as bits (a limit beyond 65504 admits every finite float16)
        halves = np.minimum(given, FP16_MAX).astype(np.float16)
        halves = np.where(halves.astype(np.float32) > given, np.nextafter(halves, np.float16(0)), halves)
        self.bits = halves.view(np.uint16).astype(np.int32)

    def for_target(self, dtype: np.dtype) -> ValueBounds:
        """These bounds for a destination of ``dtype``: a float16 one caps every limit at 65504."""
        return (
            ValueBounds(np.minimum(self.limits, np.float32(FP16_MAX)), len(self.limits))
            if dtype == np.float16
            else self
        )

    def check(
        self,
        spec: ChunkSpec,
        section: Section,
        raw: memoryview,
        n_heads: int,
        head_dim: int,
        unrotation: Unrotation | None = None,
    ) -> None:
        """KVValueError unless everything `section` of the raw chunk can write is finite and within the limits;
        ``unrotation``: how its values are rotated back, for a section of a rotated tier (EDKV 1.3)."""
        halves = section_float16(raw, section, n_heads, head_dim).view(np.uint16)
        layers = slice(section.layer_start, section.layer_stop)
        flat = halves.reshape(len(halves), -1)
        if not flat.shape[1]:
            return
        if section.layout is None:
            self._within(spec, section, _magnitude_bits(flat), self.bits[layers, section.kv], "FP16 rows")
            return
        params = flat.shape[1] // 2
        scales, zeros = flat[:, :params], flat[:, params:]
        self._within(spec, section, _magnitude_bits(scales), np.full(len(flat), _FINITE_BITS), "scales")
        zero_bits = _magnitude_bits(zeros)  # x̂ at q = 0
        if unrotation is None:
            self._within(spec, section, zero_bits, self.bits[layers, section.kv], "zeros")
        else:  # judged with the top once rotated back, below
            self._within(spec, section, zero_bits, np.full(len(flat), _FINITE_BITS), "zeros")
        # x̂ at the largest code, rounded as dequantize_into rounds it: float32 q·scale, then + zero
        top = np.multiply(scales.view(np.float16), np.float32((1 << section.layout.bits) - 1), dtype=np.float32)
        np.add(top, zeros.view(np.float16), out=top, dtype=np.float32)
        reach = np.maximum(top.max(axis=1), -top.min(axis=1))
        limits = self.limits[layers, section.kv]
        if unrotation is not None:
            np.maximum(reach, zero_bits.astype(np.uint16).view(np.float16), out=reach)
            unsure = np.flatnonzero(reach * np.float32(np.sqrt(unrotation.block) * (1 + _GEMM_MARGIN)) > limits)
            if unsure.size:
                self._check_rotated_back(spec, section, raw, (n_heads, head_dim), unsure, unrotation)
            return
        over = np.flatnonzero(reach > limits)
        if over.size:
            self._refuse(spec, section, int(over[0]), float(reach[over[0]]), "dequantized values")

    def _check_rotated_back(
        self,
        spec: ChunkSpec,
        section: Section,
        raw: memoryview,
        shape: tuple[int, int],
        rows: np.ndarray,
        unrotation: Unrotation,
    ) -> None:
        """Rotate the section's layers ``rows`` back (dequantized, times H, signs applied: the reader's own
        arithmetic) one layer at a time into the staging, and refuse the first whose largest |x| is beyond its
        limit (or not finite)."""
        assert section.layout is not None
        codes, scales, zeros = section_arrays(raw, section, *shape)
        n_heads, head_dim = shape
        values = n_heads * len(section.tokens) * head_dim
        rotated, product = (unrotation.staging[i, :values].reshape(n_heads, -1, head_dim) for i in (0, 1))
        for row in rows.tolist():
            layer = section.layer_start + row
            dequantize_into(codes[row], scales[row], zeros[row], section.layout, rotated)
            signs = unrotation.signs[layer : layer + 1, section.kv]
            unrotate_into(rotated[None], signs, unrotation.block, product[None], product)
            worst = max(float(product.max()), -float(product.min()))
            if not worst <= self.limits[layer, section.kv]:  # NaN too
                self._refuse(spec, section, row, worst, "values rotated back")

    def _within(self, spec: ChunkSpec, section: Section, magnitude: np.ndarray, bits: np.ndarray, what: str) -> None:
        over = np.flatnonzero(magnitude > bits)
        if over.size:
            self._refuse(spec, section, int(over[0]), float(np.uint16(magnitude[over[0]]).view(np.float16)), what)

    def _refuse(self, spec: ChunkSpec, section: Section, row: int, worst: float, what: str) -> None:
        layer = section.layer_start + row
        if not np.isfinite(worst):
            why = "hold inf or NaN"
        else:
            limit = float(self.limits[layer, section.kv])
            why = f"reach |x| = {worst:g}, beyond the receiver's limit of {limit:g} for this layer"
        raise KVValueError(
            f"chunk {spec.index}",
            f"{section.tier.name} {_KINDS[section.kv]} {what} of layer {layer} {why}; nothing of the chunk was written",
        )


def _magnitude_bits(flat: np.ndarray) -> np.ndarray:
    """int32 [layers]: the bits of each row's largest-magnitude float16 (of uint16 ``flat [layers, n]``), sign
    cleared; any inf or NaN reads above every finite value's bits."""
    positive = flat.view(np.int16).max(axis=1).astype(np.int32)  # negatives' bits are negative int16
    negative = flat.max(axis=1).astype(np.int32) - _SIGN  # below 0 when the row has no negative value
    return np.maximum(positive, negative)
