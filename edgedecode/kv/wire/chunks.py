"""What a chunk holds before zstd, and where: the one content layout that the writer fills and the reader reads.

For each layer of the chunk, for K then V, for each non-DROP tier among that layer's tokens (FP16, INT8, INT4,
INT2): FP16 → float16 rows ``[H, m, D]``; quantized → codes, then float16 scales, then float16 zeros. Layers with
identical tier rows have identically sized sections, so one strided view spans a whole run of such layers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from edgedecode.kv.quant import QuantLayout, codes_shape, params_shape, section_nbytes
from edgedecode.kv.tiers import QUANTIZED_TIERS, Tier


@dataclass(frozen=True, eq=False)
class Section:
    """One tier's K or V for a run of consecutive layers whose tier rows are identical within the chunk."""

    layer_start: int
    layer_stop: int
    kv: int  # 0 = keys, 1 = values
    tier: Tier
    tokens: np.ndarray  # int64 [m], absolute token indices, increasing
    layout: QuantLayout | None  # None for FP16
    offset: int  # bytes from the start of the raw chunk to the first layer's section
    layer_stride: int  # bytes from one layer's section to the next layer's


@dataclass(frozen=True)
class ChunkPlan:
    sections: tuple[Section, ...]
    raw_nbytes: int


def chunk_rects(n_layers: int, n_tokens: int, chunk_layers: int, chunk_tokens: int) -> list[tuple[int, int, int, int]]:
    """(layer_start, layer_stop, token_start, token_stop) tiling layers × tokens, layer groups outermost."""
    return [
        (l0, min(l0 + chunk_layers, n_layers), t0, min(t0 + chunk_tokens, n_tokens))
        for l0 in range(0, n_layers, chunk_layers)
        for t0 in range(0, n_tokens, chunk_tokens)
    ]


def plan_chunk(
    tiers: np.ndarray,
    layouts: dict[Tier, tuple[QuantLayout, QuantLayout]],
    n_heads: int,
    head_dim: int,
    rect: tuple[int, int, int, int],
) -> ChunkPlan:
    """The sections of the chunk covering `rect` of the tier map ``uint8 [layers, n]``, with their byte offsets."""
    l0, l1, t0, t1 = rect
    rows = tiers[l0:l1, t0:t1]
    bounds = [0, *(np.flatnonzero((rows[1:] != rows[:-1]).any(axis=1)) + 1).tolist(), l1 - l0]
    sections, offset = [], 0
    for a, b in itertools.pairwise(bounds):
        parts = []
        present = [Tier(int(t)) for t in np.unique(rows[a]) if t != Tier.DROP]
        for kv in (0, 1):
            for tier in present:
                tokens = t0 + np.flatnonzero(rows[a] == tier)
                layout = None if tier is Tier.FP16 else layouts[tier][kv]
                if layout is None:
                    nbytes = n_heads * len(tokens) * head_dim * 2
                else:
                    nbytes = section_nbytes(layout, n_heads, len(tokens), head_dim)
                parts.append((kv, tier, tokens, layout, nbytes))
        layer_nbytes = sum(p[-1] for p in parts)
        inner = 0
        for kv, tier, tokens, layout, nbytes in parts:
            sections.append(Section(l0 + a, l0 + b, kv, tier, tokens, layout, offset + inner, layer_nbytes))
            inner += nbytes
        offset += layer_nbytes * (b - a)
    return ChunkPlan(tuple(sections), offset)


def section_arrays(buf: bytearray | memoryview, section: Section, n_heads: int, head_dim: int) -> list[np.ndarray]:
    """Views of `section` in a raw chunk, each ``[layers, H, ...]``: [rows] for FP16, else [codes, scales, zeros].

    The views share `buf`'s memory: the writer fills them, the reader decodes from them.
    """
    m = len(section.tokens)
    shapes = (
        [((m, head_dim), np.float16)]
        if section.layout is None
        else [(codes_shape(section.layout, m, head_dim), np.uint8)]
        + [(params_shape(section.layout, m, head_dim), np.float16)] * 2
    )
    arrays, offset = [], section.offset
    for shape, dtype in shapes:
        per_layer = (n_heads, *shape)
        itemsize = np.dtype(dtype).itemsize
        arrays.append(
            np.ndarray(
                (section.layer_stop - section.layer_start, *per_layer),
                dtype,
                buffer=buf,
                offset=offset,
                strides=(section.layer_stride, *_c_strides(per_layer, itemsize)),
            )
        )
        offset += int(np.prod(per_layer)) * itemsize
    return arrays


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of `shape`."""
    strides, step = [], itemsize
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def section_float16(buf: bytearray | memoryview, section: Section, n_heads: int, head_dim: int) -> np.ndarray:
    """One float16 view of everything in `section` that must be finite: the FP16 rows, or the scales and the
    zeros together (they are adjacent), ``[layers, ...]``. Shares `buf`'s memory, like `section_arrays`."""
    m = len(section.tokens)
    if section.layout is None:
        return section_arrays(buf, section, n_heads, head_dim)[0]
    codes = n_heads * int(np.prod(codes_shape(section.layout, m, head_dim)))
    params = n_heads * int(np.prod(params_shape(section.layout, m, head_dim)))
    return np.ndarray(
        (section.layer_stop - section.layer_start, 2 * params),
        np.float16,
        buffer=buf,
        offset=section.offset + codes,
        strides=(section.layer_stride, 2),
    )


def chunk_sizes(
    tiers: np.ndarray,
    layouts: dict[Tier, tuple[QuantLayout, QuantLayout]],
    n_heads: int,
    head_dim: int,
    rects: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(raw_nbytes, sections) of each chunk, int64 [C] each, as `plan_chunk` would find them, without planning.

    `rects` is int64 [C, 4] (layer_start, layer_stop, token_start, token_stop) of non-empty rectangles inside the
    tier map, each layer of them at most once per chunk; `layouts` must hold every quantized tier in `tiers`.
    Vectorised over the (chunk, layer) pairs: no Python work per chunk.
    """
    n_layers, n = tiers.shape
    count = len(rects)
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    l0, l1, t0, t1 = (rects[:, k] for k in range(4))
    heights = l1 - l0
    starts = np.cumsum(heights) - heights
    chunk = np.repeat(np.arange(count), heights)  # one entry per (chunk, layer) pair
    layer = l0[chunk] + np.arange(len(chunk)) - starts[chunk]
    a, b = t0[chunk], t1[chunk]
    cum = np.zeros((n_layers, n + 1), np.int64)
    nbytes = np.zeros(len(chunk), np.int64)
    present = np.zeros(len(chunk), np.int64)
    for tier in (Tier.FP16, *QUANTIZED_TIERS):
        np.cumsum(tiers == tier, axis=1, out=cum[:, 1:])
        m = cum[layer, b] - cum[layer, a]  # tokens of `tier` in each pair's layer and token range
        present += m > 0
        if tier is Tier.FP16:
            nbytes += 2 * 2 * n_heads * head_dim * m
            continue
        if tier not in layouts:
            continue  # not in the tier map: m is 0 everywhere
        for layout in layouts[tier]:
            if layout.axis == "token":
                params = m * (head_dim // layout.group)
            else:  # ceil(m / group); a group beyond n tokens is one group, and stays within int64
                group = min(layout.group, max(n, 1))
                params = -(-m // group) * head_dim
            nbytes += n_heads * (m * (head_dim * layout.bits // 8) + 4 * params)
    # a new run of layers starts at the chunk's first layer and wherever a layer's row differs from the one above
    if n_layers > 1:
        np.cumsum(tiers[1:] != tiers[:-1], axis=1, out=cum[1:, 1:])  # cum[l]: row l differs from row l - 1
        new_run = (layer == l0[chunk]) | (cum[layer, b] > cum[layer, a])
    else:
        new_run = np.ones(len(chunk), bool)
    sections = 2 * present * new_run
    return np.add.reduceat(nbytes, starts), np.add.reduceat(sections, starts)
