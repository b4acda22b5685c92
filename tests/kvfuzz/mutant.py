"""A fuzz case's input: mutated payload bytes, what was done to them, and what a receiver may accept from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    """A mutated payload.

    ``bodies`` is None for transport damage (bits flipped, bytes cut, frames lost or repeated: no checksum was
    recomputed), whose KV, where a receiver accepts any, must be the clean payload's. A sender's edit reseals
    every checksum it touched: a receiver cannot tell its KV from a real one, so what it accepts must be what the
    edited stream declares, its chunk bodies ``bodies`` (in stream order) decoded under the header it sent, for
    the prompt it was pulled for.
    """

    payload: bytes
    label: str  # the mutation, e.g. "flip bits: chunk body" (the report counts cases by it)
    bodies: tuple[bytes, ...] | None = None

    @property
    def sealed(self) -> bool:
        return self.bodies is not None
