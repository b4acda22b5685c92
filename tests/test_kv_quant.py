"""KV quantizers: the documented error bound holds per element against the stored params, packing, sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgedecode.kv.quant import (
    DEFAULT_LAYOUTS,
    FP16_MAX,
    QuantLayout,
    dequantize_into,
    params_shape,
    quantize,
    section_nbytes,
    token_nbytes,
    widen_fp16_into,
)
from edgedecode.kv.tiers import Tier


def per_value(params: np.ndarray, layout: QuantLayout, m: int) -> np.ndarray:
    """Stored float16 params [..., groups] -> float32 per value [..., m, D]."""
    p = params.astype(np.float32)
    if layout.axis == "token":
        return np.repeat(p, layout.group, axis=-1)
    return p[..., np.arange(m) // layout.group, :]


def assert_within_bound(
    x: np.ndarray, x_hat: np.ndarray, scales: np.ndarray, zeros: np.ndarray, layout: QuantLayout
) -> None:
    """|x − x̂| ≤ scale/2 + 2^-22·(|x| + |zero| + scale), element by element, with the params actually stored."""
    m = x.shape[-2]
    s, z = per_value(scales, layout, m), per_value(zeros, layout, m)
    x = x.astype(np.float32)
    bound = s / 2 + 2.0**-22 * (np.abs(x) + np.abs(z) + s)
    err = np.abs(x - x_hat)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), f"error {err[worst]} > bound {bound[worst]} at {worst}"


layouts = st.builds(
    QuantLayout,
    st.sampled_from(["token", "channel"]),
    st.sampled_from([1, 4, 8, 32, 64]),
    st.sampled_from([2, 3, 4, 8]),
)


@st.composite
def kv_blocks(draw) -> tuple[np.ndarray, QuantLayout]:
    """(x [..., m, D], layout) with realistic spreads: mixed magnitudes, outlier channels, constant groups."""
    layout = draw(layouts)
    d = draw(st.sampled_from([8, 16, 32, 64]).filter(lambda d: layout.axis == "channel" or d % layout.group == 0))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(0, 70)), d)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal(shape) * 10.0 ** draw(st.integers(-4, 3))
    x[..., rng.integers(0, d)] *= draw(st.sampled_from([1.0, 10.0, 100.0]))
    if draw(st.booleans()):
        x[..., :3, :] = x[..., :1, :1]  # constant runs: zero spread in some groups
    x = np.clip(x, -FP16_MAX, FP16_MAX).astype(draw(st.sampled_from([np.float32, np.float16])))
    return x, layout


@settings(max_examples=60, deadline=None)
@given(kv_blocks())
def test_dequantized_error_stays_within_the_documented_bound(block) -> None:
    x, layout = block
    codes, scales, zeros = quantize(x, layout)
    out = np.empty(x.shape, np.float32)
    dequantize_into(codes, scales, zeros, layout, out)
    assert codes.shape == (*x.shape[:-1], x.shape[-1] * layout.bits // 8)
    assert scales.shape == zeros.shape == (*x.shape[:-2], *params_shape(layout, x.shape[-2], x.shape[-1]))
    assert scales.dtype == zeros.dtype == np.float16
    assert np.isfinite(scales).all() and (scales > 0).all()
    assert_within_bound(x, out, scales, zeros, layout)


@settings(max_examples=30, deadline=None)
@given(kv_blocks())
def test_params_bracket_every_group(block) -> None:
    """zero ≤ the group's min and zero + (2^b − 1)·scale ≥ its max: rounding never cuts off a value."""
    x, layout = block
    _, scales, zeros = quantize(x, layout)
    m = x.shape[-2]
    s, z = per_value(scales, layout, m).astype(np.float64), per_value(zeros, layout, m).astype(np.float64)
    x = x.astype(np.float64)
    assert (z <= x).all()
    assert (z + ((1 << layout.bits) - 1) * s >= x).all()


@settings(max_examples=20, deadline=None)
@given(kv_blocks(), st.integers(1, 5))
def test_dequantize_into_views_float16_and_scratch_agree(block, pad) -> None:
    """A strided view, a float16 destination and a caller scratch all give the contiguous float32 result."""
    x, layout = block
    parts = quantize(x, layout)
    expected = np.empty(x.shape, np.float32)
    dequantize_into(*parts, layout, expected)
    big = np.full((*x.shape[:-2], x.shape[-2] + 2 * pad, x.shape[-1]), np.nan, np.float32)
    view = big[..., pad : pad + x.shape[-2], :]
    dequantize_into(*parts, layout, view, np.empty(x.size + 7, np.float32))
    np.testing.assert_array_equal(view, expected)
    assert np.isnan(big[..., :pad, :]).all() and np.isnan(big[..., pad + x.shape[-2] :, :]).all()
    half = np.empty(x.shape, np.float16)
    with np.errstate(over="ignore"):  # x̂ within scale/2 of ±65504 rounds to ±inf in float16, as a cast would
        dequantize_into(*parts, layout, half)
        np.testing.assert_array_equal(half, expected.astype(np.float16))


def test_codes_pack_lowest_bits_first() -> None:
    """4-bit: even index in the low nibble; 2-bit: four per byte, lowest bits first; exact codes for a ramp."""
    ramp4 = np.arange(16, dtype=np.float32)[None, None, :]  # one token, min 0, max 15 -> scale 1, zero 0
    codes, scales, zeros = quantize(ramp4, QuantLayout("token", 16, 4))
    assert scales.item() == 1.0 and zeros.item() == 0.0
    assert codes.tolist() == [[[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]]
    ramp2 = np.array([[[0, 1, 2, 3, 3, 2, 1, 0]]], np.float32)
    codes, _, _ = quantize(ramp2, QuantLayout("token", 8, 2))
    assert codes.tolist() == [[[0b11100100, 0b00011011]]]


def test_3bit_codes_are_two_planes_low_bits_first() -> None:
    """3-bit: the codes' low two bits packed as 2-bit codes (D/4 bytes), then their high bits eight per byte."""
    ramp = np.array([[[0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0]]], np.float32)  # scale 1, zero 0
    codes, scales, zeros = quantize(ramp, QuantLayout("token", 16, 3))
    assert scales.item() == 1.0 and zeros.item() == 0.0
    low = [0b11100100, 0b11100100, 0b00011011, 0b00011011]  # 0,1,2,3 | 0,1,2,3 | 3,2,1,0 | 3,2,1,0
    high = [0b11110000, 0b00001111]  # codes 4-7 and 8-11 have the high bit
    assert codes.tolist() == [[low + high]]
    out = np.empty_like(ramp)
    dequantize_into(codes, scales, zeros, QuantLayout("token", 16, 3), out)
    np.testing.assert_array_equal(out, ramp)


def test_channel_groups_restart_every_group_tokens_and_a_partial_group_uses_its_own_tokens() -> None:
    x = np.zeros((1, 5, 2), np.float32)
    x[0, :, 0] = [0, 1, 2, 100, 101]  # tokens 0-1, 2-3, 4 with group 2
    _, scales, zeros = quantize(x, QuantLayout("channel", 2, 8))
    assert scales.shape == (1, 3, 2)
    assert zeros[0, :, 0].tolist() == [0.0, 2.0, 101.0]
    assert scales[0, 2, 0] < 1e-3  # the last group holds one token: a tiny but positive scale


def test_constant_input_gets_a_tiny_positive_scale() -> None:
    x = np.full((2, 4, 8), 0.1, np.float32)
    codes, scales, zeros = quantize(x, QuantLayout("token", 8, 4))
    out = np.empty_like(x)
    dequantize_into(codes, scales, zeros, QuantLayout("token", 8, 4), out)
    assert (scales > 0).all() and np.isfinite(scales).all()
    assert np.abs(out - x).max() <= scales.astype(np.float32).max()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 65520.0, -70000.0])
def test_values_a_float16_param_cannot_represent_are_refused(bad) -> None:
    x = np.zeros((1, 3, 8), np.float32)
    x[0, 1, 2] = bad
    with pytest.raises(ValueError, match=r"non-finite|float16 range"):
        quantize(x, QuantLayout("token", 8, 4))


def test_the_float16_extremes_quantize() -> None:
    x = np.array([[[-FP16_MAX, FP16_MAX, 0.0, 1.0]]], np.float32)
    layout = QuantLayout("token", 4, 8)
    codes, scales, zeros = quantize(x, layout)
    out = np.empty_like(x)
    dequantize_into(codes, scales, zeros, layout, out)
    assert_within_bound(x, out, scales, zeros, layout)


def test_unpackable_layouts_and_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="axis"):
        QuantLayout("row", 32, 4)
    with pytest.raises(ValueError, match="bits"):
        QuantLayout("token", 32, 5)
    with pytest.raises(ValueError, match="whole bytes"):
        quantize(np.zeros((1, 2, 12), np.float32), QuantLayout("channel", 32, 3))
    with pytest.raises(ValueError, match="group"):
        QuantLayout("token", 0, 4)
    with pytest.raises(ValueError, match="multiple"):
        quantize(np.zeros((1, 2, 48), np.float32), QuantLayout("token", 32, 4))
    with pytest.raises(ValueError, match="whole bytes"):
        quantize(np.zeros((1, 2, 6), np.float32), QuantLayout("channel", 32, 2))
    with pytest.raises(TypeError, match="float16 or float32"):
        quantize(np.zeros((1, 2, 8), np.float64), QuantLayout("token", 8, 4))


def test_fp16_widening_is_exact_for_every_float16_bit_pattern() -> None:
    rows = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(4, 128, 128)
    big = np.zeros((4, 130, 128), np.float32)
    widen_fp16_into(rows, big[:, 1:129])
    expected = rows.astype(np.float32)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(big[:, 1:129].view(np.uint32)[~nan], expected.view(np.uint32)[~nan])
    assert np.isnan(big[:, 1:129][nan]).all()


def test_token_nbytes_is_the_cost_model_of_the_default_layouts() -> None:
    h, d = 3, 64
    fp16 = token_nbytes(Tier.FP16, h, d)
    assert fp16 == 2 * 2 * h * d
    assert token_nbytes(Tier.DROP, h, d) == 0
    assert token_nbytes(Tier.INT8, h, d) / fp16 == pytest.approx(0.53125)  # research: int8_tok b_raw 0.531
    assert token_nbytes(Tier.INT4, h, d) / fp16 == pytest.approx(0.3125)  # int4_kchan32_vtok32 b_raw 0.312
    assert token_nbytes(Tier.INT3, h, d) / fp16 == pytest.approx(0.25)  # 3 bits + a (scale, zero) per 32
    for tier in (Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2):
        m = 128  # a multiple of every group: amortised bytes are exact
        sections = sum(section_nbytes(layout, h, m, d) for layout in DEFAULT_LAYOUTS[tier])
        assert token_nbytes(tier, h, d) == sections / m
