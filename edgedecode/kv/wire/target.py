"""Where an EDKV reader writes: the receiver's KV destination, checked against the stream's header, and each
verified section decoded straight into its compacted slots (widened, or dequantised and, for a tier the header's
rotation lists, rotated back). The staging is sized once, from the header: a chunk allocates nothing here but
a float16 destination's scattered blocks."""

from __future__ import annotations

import numpy as np

from edgedecode.kv.quant import dequantize_into, widen_fp16_into
from edgedecode.kv.rotation import hadamard_signs, unrotate_into
from edgedecode.kv.wire.chunks import Section
from edgedecode.kv.wire.header import EDKVHeader
from edgedecode.kv.wire.value_check import Unrotation

BLOCK_VALUES = 1 << 18  # values decoded per step: 1 MiB of float32 staging, about a core's L2


class TargetWriter:
    """Writes one stream's sections into ``target``, the array its reader's target_factory returned for
    ``header`` (``EDKVReader``'s ``target_factory`` says what it must be; anything else is a ValueError)."""

    def __init__(self, target: np.ndarray, header: EDKVHeader) -> None:
        self.target = checked_target(target, header)
        self._header = header
        c, table = header.contract, header.chunk_table
        widest = int((table[:, 3] - table[:, 2]).max(initial=0))
        self._scratch = np.empty(max(BLOCK_VALUES, widest * c.n_kv_heads * c.head_dim), np.float32)
        self._rotated = np.empty((2, 0), np.float32)  # a rotated section's x̂ and its product with H, staged
        self._signs = np.empty((0, 2, 0, 0), np.float32)  # [layers, K/V, heads, D] of a rotated stream
        self.unrotation: Unrotation | None = None  # how the value check rotates a section back, likewise
        if header.rotation is not None:
            self._rotated = np.empty((2, len(self._scratch)), np.float32)
            self._signs = hadamard_signs(header.rotation.seed, c.n_layers, c.n_kv_heads, c.head_dim)
            self.unrotation = Unrotation(header.rotation.block, self._signs, self._rotated)

    def write(self, section: Section, arrays: list[np.ndarray]) -> None:
        """Decode one section into its compacted slots: slices when they are contiguous, else one scatter.

        Runs of layers go in blocks of about BLOCK_VALUES values, so the float32 staging stays in cache.
        """
        dest = self.target[section.layer_start : section.layer_stop, section.kv]  # [layers, H, slots, D]
        slots = self._header.slots_before[section.tokens]
        first, last = int(slots[0]), int(slots[-1])
        contiguous = last - first + 1 == len(slots)
        per_layer = dest.shape[1] * len(slots) * dest.shape[3]
        step = max(1, BLOCK_VALUES // per_layer)
        for start in range(0, len(dest), step):
            block = slice(start, start + step)
            parts = [a[block] for a in arrays]
            layers = slice(section.layer_start + start, section.layer_start + start + len(dest[block]))
            if contiguous:
                self._decode(section, parts, dest[block, :, first : last + 1], layers)
                continue
            shape = (len(dest[block]), dest.shape[1], len(slots), dest.shape[3])
            staged = (
                self._scratch[: int(np.prod(shape))].reshape(shape)
                if dest.dtype == np.float32
                else np.empty(shape, dest.dtype)
            )
            self._decode(section, parts, staged, layers)
            rows = np.dtype((np.void, dest.shape[3] * dest.itemsize))  # a head_dim row as one item: cheaper scatter
            dest[block].view(rows)[..., 0][:, :, slots] = staged.view(rows)[..., 0]

    def _decode(self, section: Section, arrays: list[np.ndarray], out: np.ndarray, layers: slice) -> None:
        """Write `section`'s values for `layers` into `out`: widened, or dequantised (then rotated back, for a tier
        the header's rotation lists)."""
        rotation = self._header.rotation
        if section.layout is None:
            widen_fp16_into(arrays[0], out, self._scratch)
        elif rotation is not None and rotation.rotates(section.tier):
            codes, scales, zeros = arrays
            rotated = self._rotated[0, : out.size].reshape(out.shape)
            dequantize_into(codes, scales, zeros, section.layout, rotated)
            unrotate_into(rotated, self._signs[layers, section.kv], rotation.block, out, self._rotated[1])
        else:
            codes, scales, zeros = arrays
            dequantize_into(codes, scales, zeros, section.layout, out, self._scratch)


def checked_target(target: np.ndarray, header: EDKVHeader) -> np.ndarray:
    """``target``, once it is an array ``header``'s kept tokens fit (see ``EDKVReader``); else a ValueError."""
    c = header.contract
    if (
        not isinstance(target, np.ndarray)
        or target.dtype not in (np.float32, np.float16)
        or target.ndim != 5
        or target.shape[:3] != (c.n_layers, 2, c.n_kv_heads)
        or target.shape[4] != c.head_dim
        or target.shape[3] < header.n_kept
        or (target.size and target.strides[4] != target.itemsize)
    ):
        got = f"{target.dtype} {list(target.shape)}" if isinstance(target, np.ndarray) else type(target).__name__
        raise ValueError(
            f"target_factory must return a float32/float16 array [{c.n_layers}, 2, {c.n_kv_heads}, "
            f">= {header.n_kept}, {c.head_dim}] with contiguous head_dim rows, got {got}"
        )
    return target
