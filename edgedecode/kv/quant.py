"""Asymmetric min/max quantizers for KV tiers: pure, vectorised numpy, bit-exact with the receiver.

Arrays are ``[..., m, D]``: m tokens of head_dim D, with any leading axes (usually ``[kv_heads]``,
or ``[layers, kv_heads]``). A group of values shares one float16 (scale, zero):

- ``axis="token"``: one pair per token per ``group`` consecutive channels; params ``[..., m, D/group]``.
- ``axis="channel"``: one pair per channel per ``group`` consecutive tokens (a partial last group uses only
  its real tokens); params ``[..., ceil(m/group), D]``.

``q = clip(rint((x - zero) / scale), 0, 2^b - 1)`` and ``x̂ = q·scale + zero``. zero is the largest float16
≤ the group's min and scale the smallest float16 ≥ (max − zero)/(2^b − 1), both rounded *before*
quantizing, so ``|x − x̂| ≤ scale/2 + 2^-22·(|x| + |zero| + scale)`` (float32 arithmetic) and the sender's x̂
is exactly what a receiver rebuilds. Codes are packed along D, lowest bits first (4-bit: even index in the
low nibble; 2-bit: four per byte; 3-bit: the codes' low two bits as 2-bit codes, D/4 bytes, then their high
bits, eight per byte, D/8 bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edgedecode.kv.tiers import Tier

FP16_MAX = 65504.0
MIN_SCALE = 2.0**-24  # smallest positive float16: the scale of a constant group
_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


@dataclass(frozen=True)
class QuantLayout:
    """How one tier quantizes K or V: the axis its groups run along, the group length and the code width."""

    axis: Literal["channel", "token"]
    group: int
    bits: int

    def __post_init__(self) -> None:
        if self.axis not in ("channel", "token"):
            raise ValueError(f"quant axis must be 'channel' or 'token', got {self.axis!r}")
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"quant bits must be 2, 3, 4 or 8, got {self.bits!r}")
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"quant group must be a positive int, got {self.group!r}")

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless rows of ``head_dim`` pack into whole bytes and whole channel groups."""
        if head_dim * self.bits % 8:
            raise ValueError(f"head_dim {head_dim} does not pack into whole bytes at {self.bits} bits")
        if self.axis == "token" and head_dim % self.group:
            raise ValueError(f"head_dim {head_dim} is not a multiple of the token-axis group {self.group}")


GroupRange = Callable[[np.ndarray, "QuantLayout"], tuple[np.ndarray, np.ndarray]]

# (keys, values) per quantized tier; research/kv_calibration.md: INT8 per token is lossless, INT4 needs
# per-channel keys over 32-token groups.
DEFAULT_LAYOUTS: dict[Tier, tuple[QuantLayout, QuantLayout]] = {
    Tier.INT8: (QuantLayout("token", 64, 8), QuantLayout("token", 64, 8)),
    Tier.INT4: (QuantLayout("channel", 32, 4), QuantLayout("token", 32, 4)),
    Tier.INT3: (QuantLayout("channel", 32, 3), QuantLayout("token", 32, 3)),
    Tier.INT2: (QuantLayout("channel", 32, 2), QuantLayout("token", 32, 2)),
}

# byte -> its codes as float32, lowest bits first: one gather unpacks a whole section.
_UNPACK = {
    bits: ((np.arange(256)[:, None] >> (bits * np.arange(8 // bits))) & ((1 << bits) - 1)).astype(np.float32)
    for bits in (1, 2, 4)
}
# 3-bit codes, four at a time: index = the byte of their low two bits | the nibble of their high bits << 8
_UNPACK3 = (_UNPACK[2][np.arange(4096) & 0xFF] + 4 * _UNPACK[1][np.arange(4096) >> 8, :4]).astype(np.float32)
_FP16_TO_FP32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
_ROUND_TO_LOW_BYTE = np.float32(1 << 23)


def codes_shape(layout: QuantLayout, n_tokens: int, head_dim: int) -> tuple[int, int]:
    """Shape of one head's packed codes: ``(n_tokens, head_dim·bits/8)`` bytes."""
    return n_tokens, head_dim * layout.bits // 8


def params_shape(layout: QuantLayout, n_tokens: int, head_dim: int) -> tuple[int, int]:
    """Shape of one head's scales (and of its zeros): ``(m, D/group)`` per token, ``(ceil(m/group), D)`` per channel."""
    if layout.axis == "token":
        return n_tokens, head_dim // layout.group
    return -(-n_tokens // layout.group), head_dim


def section_nbytes(layout: QuantLayout, n_heads: int, n_tokens: int, head_dim: int) -> int:
    """Wire bytes of one quantized section: codes, then float16 scales, then float16 zeros."""
    codes = np.prod(codes_shape(layout, n_tokens, head_dim))
    params = np.prod(params_shape(layout, n_tokens, head_dim))
    return int(n_heads * (codes + 4 * params))


def token_nbytes(
    tier: Tier, n_kv_heads: int, head_dim: int, layouts: dict[Tier, tuple[QuantLayout, QuantLayout]] = DEFAULT_LAYOUTS
) -> float:
    """Amortised wire bytes (before zstd) of one token's K and V in one layer, with full groups."""
    tier = Tier(tier)
    if tier is Tier.DROP:
        return 0.0
    if tier is Tier.FP16:
        return float(2 * 2 * n_kv_heads * head_dim)
    # per value: bits/8 of code plus a (scale, zero) fp16 pair shared by `group` values, on either axis
    return float(sum(n_kv_heads * head_dim * (lay.bits / 8 + 4 / lay.group) for lay in layouts[tier]))


def quantize(
    x: np.ndarray, layout: QuantLayout, group_range: GroupRange | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize ``x [..., m, D]`` (float16 or float32).

    ``group_range(x, layout)`` returns each group's (min, max) of float32 ``x`` (any strides), shaped like the
    params; another than the default (``numpy_group_range``, on a C-contiguous copy) must return the same values,
    the sign of a zero minimum included.

    Returns:
        ``(codes uint8 [..., m, D·bits/8], scales float16, zeros float16)``, params shaped as `params_shape`.

    Raises:
        ValueError: non-finite values, values beyond ±65504 (float16), or a head_dim the layout cannot pack.
        TypeError: x is not float16 or float32.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize takes float16 or float32, got {x.dtype}")
    d = x.shape[-1]
    layout.check_head_dim(d)
    if x.dtype == np.float16:
        x = widen_fp16(x)
    if group_range is None:
        x = np.ascontiguousarray(x)  # the token axis's reduceat runs over the flat array
    lo, hi = (group_range or numpy_group_range)(x, layout)
    (scales, scales32), (zeros, zeros32) = _fp16_params(lo, hi, layout.bits)
    q = np.empty(x.shape, np.float32)
    _per_group(np.subtract, x, zeros32, layout, q)
    _per_group(np.divide, q, scales32, layout, q)
    # q lies in [0, 2^b - 1] (x >= zero, and scale >= (max - zero) / (2^b - 1): both rounded outwards, so clipping
    # changes nothing). Adding 2^23 rounds it half to even onto the integers, as rint does (float32 keeps no fraction
    # from 2^23 on), and leaves the code in the float's low byte: one pass instead of rint, clip and a cast.
    np.add(q, _ROUND_TO_LOW_BYTE, out=q)
    return _pack(q.view(np.uint8)[..., ::4], layout.bits), scales, zeros


def dequantize_into(
    codes: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray,
    layout: QuantLayout,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
) -> None:
    """Write ``x̂ = q·scale + zero`` into ``out [..., m, D]`` (float32 or float16, any strides; a view is fine).

    The codes are unpacked into float32 (a cast for 8 bits, else one table gather): into `out` itself when it is
    C-contiguous float32, else into `scratch` (float32, at least ``out.size`` values) when given, else a new array.
    """
    values = _float32_buffer(out, scratch)
    if layout.bits == 8:
        np.copyto(values, codes)  # a plain cast beats a gather when a byte is one code
    elif layout.bits == 3:
        quads = values.reshape(*codes.shape[:-1], values.shape[-1] // 4, 4)
        np.take(_UNPACK3, _index3(codes), axis=0, out=quads, mode="clip")
    else:
        np.take(_UNPACK[layout.bits], codes, axis=0, out=values.reshape(*codes.shape, 8 // layout.bits), mode="clip")
    _per_group(np.multiply, values, scales.astype(np.float32), layout, values)
    _per_group(np.add, values, zeros.astype(np.float32), layout, out)


def widen_fp16_into(rows: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """Copy float16 `rows` into `out` (float32 or float16, same shape), exactly.

    float16 -> float32 goes through a 65536-entry table (one gather, about twice as fast as numpy's cast);
    `scratch` is used as in `dequantize_into` when `out` is not C-contiguous.
    """
    if out.dtype == np.float16:
        np.copyto(out, rows)
        return
    values = _float32_buffer(out, scratch)
    np.take(_FP16_TO_FP32, rows.view(np.uint16), out=values, mode="clip")
    if values is not out:
        np.copyto(out, values)


def widen_fp16(rows: np.ndarray) -> np.ndarray:
    """float16 ``rows`` as a new C-contiguous float32 array, exactly (the table gather of ``widen_fp16_into``)."""
    return np.take(_FP16_TO_FP32, rows.view(np.uint16), mode="clip")


def _float32_buffer(out: np.ndarray, scratch: np.ndarray | None) -> np.ndarray:
    """A C-contiguous float32 array shaped like `out`: out itself if it qualifies, else scratch, else new."""
    if out.dtype == np.float32 and out.flags.c_contiguous:
        return out
    if scratch is not None:
        return scratch[: out.size].reshape(out.shape)
    return np.empty(out.shape, np.float32)


def _fp16_params(
    lo: np.ndarray, hi: np.ndarray, bits: int
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(scale, zero) per group, each as float16 and as the same values in float32: zero rounded down from min,
    scale rounded up, so x̂ covers [min, max]."""
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise ValueError("cannot quantize non-finite KV values (inf or NaN)")
    if lo.size and max(-float(lo.min()), float(hi.max())) > FP16_MAX:
        raise ValueError(f"cannot quantize KV values beyond the float16 range ±{FP16_MAX:g}")
    zeros, zeros64 = _round_fp16_exact(lo, up=False)
    span = hi.astype(np.float64) - zeros64
    scales, scales64 = _round_fp16_exact(np.maximum(span / ((1 << bits) - 1), MIN_SCALE), up=True)
    return (scales, scales64.astype(np.float32)), (zeros, zeros64.astype(np.float32))


def _round_fp16(v: np.ndarray, up: bool) -> np.ndarray:
    """The nearest float16 on one side of v (within ±65504): the smallest ≥ v when `up`, else the largest ≤ v."""
    return _round_fp16_exact(v, up)[0]


def _round_fp16_exact(v: np.ndarray, up: bool) -> tuple[np.ndarray, np.ndarray]:
    """``_round_fp16(v, up)`` as float16 and as the same values in float64.

    In v's binade [2^(e-1), 2^e) float16 values are the multiples of 2^(e-11) (of 2^-24 below 2^-14), so v is
    scaled by that power of two and rounded to an integer count of steps, every step exact in float64. The float16
    is built from its bits, not converted (numpy's conversion costs more than the rest together): a count c of
    steps in binade e >= -13 is the bit pattern ((e + 14) << 10) + c - 1024, which carries into the next binade
    at c = 2048 and gives the subnormal c below 2^-14 (e clamped to -13); a zero count is a zero of the count's sign.
    """
    v = v.astype(np.float64)
    _, e = np.frexp(v)
    binade = np.maximum(e, -13)
    shift = 11 - binade
    steps = (np.ceil if up else np.floor)(np.ldexp(v, shift))
    count = np.abs(steps).astype(np.int32)
    magnitude = np.where(count == 0, 0, ((binade + 14) << 10) + count - 1024)
    bits = (magnitude | (np.signbit(steps).astype(np.int32) << 15)).astype(np.uint16)
    return bits.view(np.float16), np.ldexp(steps, -shift)


def numpy_group_range(x: np.ndarray, layout: QuantLayout) -> tuple[np.ndarray, np.ndarray]:
    """Each group's (min, max) of C-contiguous float32 ``x [..., m, D]``, shaped like the params."""
    return _group_reduce(np.minimum, x, layout), _group_reduce(np.maximum, x, layout)


def _group_reduce(ufunc: np.ufunc, x: np.ndarray, layout: QuantLayout) -> np.ndarray:
    """ufunc.reduce over each group of C-contiguous ``x [..., m, D]``, shaped like the params."""
    *lead, m, d = x.shape
    g = layout.group
    if layout.axis == "token":  # reduceat over the flat array: much faster than reducing a short last axis
        starts = np.arange(0, x.size, g)
        return ufunc.reduceat(x.reshape(-1), starts).reshape(*lead, m, d // g) if x.size else x[..., ::g]
    full = m // g * g
    parts = [ufunc.reduce(x[..., :full, :].reshape(*lead, full // g, g, d), axis=-2)]
    if full < m:
        parts.append(ufunc.reduce(x[..., full:, :], axis=-2, keepdims=True))
    return np.concatenate(parts, axis=-2)


def _per_group(ufunc: np.ufunc, values: np.ndarray, params: np.ndarray, layout: QuantLayout, out: np.ndarray) -> None:
    """``out = ufunc(values, the param of each value's group)`` for values and out ``[..., m, D]`` (views are fine)."""
    *lead, m, d = values.shape
    g = layout.group
    if layout.axis == "token":
        shape = (*lead, m, d // g, g)
        ufunc(values.reshape(shape), params[..., None], out=out.reshape(shape))
        return
    full = m // g * g
    if full:
        shape = (*lead, full // g, g, d)
        ufunc(
            values[..., :full, :].reshape(shape),
            params[..., : full // g, None, :],
            out=out[..., :full, :].reshape(shape),
        )
    if full < m:
        ufunc(values[..., full:, :], params[..., -1:, :], out=out[..., full:, :])


def _index3(codes: np.ndarray) -> np.ndarray:
    """uint16 [..., D/4]: for each four 3-bit codes of packed rows ``[..., 3·D/8]``, the `_UNPACK3` row that
    holds them (their low-bits byte, and the nibble of their high bits above it)."""
    quarter = codes.shape[-1] * 2 // 3  # D/4 low-bit bytes, then D/8 high-bit bytes
    high = codes[..., quarter:]
    index = np.empty((*codes.shape[:-1], quarter), np.uint16)
    np.left_shift(high & 0x0F, 8, out=index[..., 0::2], dtype=np.uint16)
    np.left_shift(high >> 4, 8, out=index[..., 1::2], dtype=np.uint16)
    index |= codes[..., :quarter]
    return index


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., D] (any strides) -> bytes [..., D·bits/8], lowest bits first (3 bits: two planes, see the
    module)."""
    if bits == 8:
        return np.ascontiguousarray(q)
    if bits == 3:
        return np.concatenate([_pack(q & 3, 2), _pack(q >> 2, 1)], axis=-1)
    per = 8 // bits
    packed = q[..., 0::per].copy()
    for lane in range(1, per):
        packed |= q[..., lane::per] << np.uint8(bits * lane)
    return packed
