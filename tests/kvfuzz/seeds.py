"""The valid payloads fuzz cases start from, in three families, each built once per run and kept in memory with what
a clean ingest writes:

- ``build_seeds``: real SmolLM2 KV from the prefill pipeline (``prefill_and_score``, tiers from the allocator under a
  budget, as the prefill server serves them) as EDKV 1.2 (with ``importance``), 1.1 and 1.0;
- ``build_windowed_seeds`` (``kvfuzz.windowed``): EDKV 2.0 payloads of a sliding-window model;
- ``build_segmented_seeds`` (``kvfuzz.segmented``): resumed transfers, a segment after a cut one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from test_kv_format import split_frames, with_header

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.policy import TierProfile
from edgedecode.kv.rotation import DEFAULT_ROTATION
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import EDKVHeader, TransferRef, encode_payload
from edgedecode.kv.wire.frames import CHUNK_PREFIX, HEADER_CRC, HEADER_PREFIX
from edgedecode.model.tokenizer import Tokenizer
from edgedecode.prefill.pipeline import encode_within_budget, payload_meta, prefill_and_score, smallest_payload
from edgedecode.runtime.engine import Engine

CONTEXT = 512  # the fuzz decoder's KV slots: every seed's prompt fits, with room past it to see stray writes
# a NaN of each KV dtype the decoder may hold: the reader writes only finite values, so a slot holding one was
# not written
SENTINEL_BITS = {np.dtype(np.float32): 0x7FC0_ED1E, np.dtype(np.float16): 0x7E1E}


def bits(values: np.ndarray) -> np.ndarray:
    """The bit patterns of float ``values`` (unsigned integers of their width): NaNs compare, -0.0 differs from 0.0."""
    return values.view(f"u{values.dtype.itemsize}")


@dataclass(frozen=True, eq=False)
class Seed:
    """A valid payload, the prompt it was pulled for and what its clean ingest writes."""

    name: str
    prompt_ids: np.ndarray  # int64 [prompt]
    head: int  # positions before the payload's that the decoder computes itself: its tokens land from slot `head`
    payload: bytes
    header: EDKVHeader
    clean: np.ndarray  # [layers, 2, kv_heads, n_kept, head_dim] in the decoder's KV dtype: the clean ingest's KV
    weight: int  # how often cases start from it (small payloads more often: they are cheaper)
    lead: Lead | None = None  # a resume: the cut segment fed before this payload (None: the payload is the first)
    alternates: tuple[Alternate, ...] = ()  # the same prompt's payloads as served from other resume offsets

    @property
    def first_slot(self) -> int:
        """The cache slot the payload's first kept token lands in."""
        return self.head + (0 if self.lead is None else self.lead.slots)

    @property
    def first_position(self) -> int:
        """The first prompt position the payload may hold (the positions before are computed or covered)."""
        return self.head if self.lead is None else self.lead.covered

    @cached_property
    def frames(self) -> tuple[bytes, tuple[bytes, ...], bytes]:
        """(header frame, chunk frames, trailer)."""
        header, chunks, trailer = split_frames(self.payload)
        return header, tuple(chunks), trailer

    @cached_property
    def bodies(self) -> tuple[bytes, ...]:
        """The chunk frames' bodies (zstd frames), in order."""
        return tuple(chunk[CHUNK_PREFIX.size :] for chunk in self.frames[1])


@dataclass(frozen=True, eq=False)
class Lead:
    """The first segment of a resumed transfer: ``payload`` (a clean stream broken off after some chunks) is fed,
    then cut, keeping its verified prefix; the next segment is the seed's payload."""

    payload: bytes
    covered: int  # the first prompt position the cut segment left uncovered: where the resume starts
    rows: np.ndarray  # the KV the cut segment wrote, [layers, 2, kv_heads, slots, head_dim] in the decoder's dtype

    @property
    def slots(self) -> int:
        return self.rows.shape[3]


@dataclass(frozen=True)
class Alternate:
    """A payload the prefill server serves for the same prompt from another position than the resume asks."""

    name: str  # e.g. "from covered - 2"
    payload: bytes


def build_seeds(tokenizer: Tokenizer, prefill: Engine, decoder: Engine) -> list[Seed]:
    """Seed payloads covering the FP16, INT8, INT4, INT3, INT2 and DROP tiers, EDKV 1.2 with a transfer and
    importance, 1.1 with a transfer only, 1.0 with neither, and 1.3 with INT3 and rotated tiers (as served to a 1.3
    receiver, and by layer with small chunks), one and several chunks (and layer groups), a segment after computed
    positions, and no kept token.

    ``prefill``: a prefill graph engine (emit_queries) of the model ``tokenizer`` belongs to; ``decoder``: the
    CPU decode engine the cases run on, with CONTEXT slots.
    """
    prompts = token_windows(tokenizer, pydoc_corpus(), 160, 4)
    transfer = TransferRef("fuzz-seed", 30.0)

    def served(prompt: np.ndarray, budget: float, head: int = 0) -> bytes:
        scored = prefill_and_score(prefill, prompt).from_position(head)
        return b"".join(encode_within_budget(scored, budget, transfer=transfer).frames)

    def served_1_3(prompt: np.ndarray, budget: float) -> bytes:
        """As the prefill server serves a 1.3 receiver under a profile with INT3 and the rotation."""
        scored = prefill_and_score(prefill, prompt)
        every = (Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.INT2, Tier.DROP)
        profile = TierProfile(every, dict(zip(every, (0.0, 0.0002, 0.07, 0.12, 0.5, 1.0))))
        encoded = encode_within_budget(scored, budget, profile=profile, transfer=transfer, rotation=DEFAULT_ROTATION)
        return b"".join(encoded.frames)

    fine = prefill_and_score(prefill, prompts[2][:32])  # per-layer tiers with INT2, 16-token chunks, layer groups
    short = prefill_and_score(prefill, prompts[0][:16]).snapshot
    kept_tiers = np.array([Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2], np.uint8)
    runs = np.random.default_rng(0).choice(kept_tiers, (6, 32))  # 6 runs of 5 layers: 2 in each 10-layer chunk
    tiers = np.repeat(runs, fine.snapshot.contract.n_layers // len(runs), axis=0)
    tiers[:, ::5] = Tier.DROP
    specs = [
        ("24t INT8+INT4, 1.2", prompts[0][:24], 0, served(prompts[0][:24], 0.45), 4),
        ("24t INT4+DROP, 1.0", prompts[1][:24], 0, as_minor(served(prompts[1][:24], 0.25), 0), 4),
        ("24t INT4+DROP, 1.1", prompts[1][:24], 0, as_minor(served(prompts[1][:24], 0.25), 1), 2),
        ("12t FP16+INT8", prompts[3][:12], 0, served(prompts[3][:12], 0.6), 4),
        (
            "32t tiers by layer with INT2, 16-token chunks of 10 layers",
            prompts[2][:32],
            0,
            b"".join(
                encode_payload(
                    fine.snapshot,
                    tiers,
                    chunk_tokens=16,
                    chunk_layers=10,
                    meta=payload_meta("fuzz", 0.3),
                    transfer=transfer,
                )
            ),
            3,
        ),
        (
            "32t tiers by layer with INT3, INT4/INT3/INT2 rotated, 16-token chunks, 1.3",
            prompts[2][:32],
            0,
            b"".join(
                encode_payload(
                    fine.snapshot,
                    np.where(tiers == Tier.INT8, Tier.INT3, tiers).astype(np.uint8),
                    chunk_tokens=16,
                    meta=payload_meta("fuzz", 0.3),
                    rotation=DEFAULT_ROTATION,
                )
            ),
            3,
        ),
        ("40t INT8+INT4+INT3+DROP rotated, 1.3 as served", prompts[0][:40], 0, served_1_3(prompts[0][:40], 0.2), 3),
        ("48t from position 16 (a later segment)", prompts[3][:48], 16, served(prompts[3][:48], 0.3, head=16), 3),
        (
            "16t all dropped",
            prompts[0][:16],
            0,
            b"".join(smallest_payload(short, payload_meta("ours", 0.01)).frames),
            2,
        ),
        ("160t INT8+INT4+DROP, 2 chunks as served", prompts[1], 0, served(prompts[1], 0.15), 1),
    ]
    return [make_seed(decoder, name, prompt, head, payload, weight) for name, prompt, head, payload, weight in specs]


MINOR_FIELDS = {0: ("transfer", "importance"), 1: ("importance",)}  # the 1.x fields a stream of that minor lacks


def as_minor(payload: bytes, minor: int) -> bytes:
    """The EDKV 1.2 payload as a stream of an earlier ``minor`` version: without the fields that minor lacks
    (1.0: ``transfer`` and ``importance``; 1.1: ``importance``), resealed."""
    header, _, _ = split_frames(payload)
    doc = json.loads(header[HEADER_PREFIX.size : -HEADER_CRC.size])
    for name in MINOR_FIELDS[minor]:
        doc.pop(name, None)
    return with_header(payload, json.dumps(doc, separators=(",", ":")).encode(), minor=minor)


def make_seed(
    decoder: Engine,
    name: str,
    prompt: np.ndarray,
    head: int,
    payload: bytes,
    weight: int,
    lead: Lead | None = None,
    alternates: tuple[Alternate, ...] = (),
) -> Seed:
    """The seed of ``payload``, its clean ingest read back from ``decoder``'s KV buffers (after ``lead``'s cut
    segment, where given)."""
    stream = decoder.open_kv_stream(prompt, head=head)
    if lead is not None:
        stream.feed(lead.payload)
        stream.cut()
        stream.resume()
    stream.feed(payload)
    header = stream.finish()
    first = head + (0 if lead is None else lead.slots)
    rows = decoder.cache.host[:, :, 0, :, first : first + header.n_kept].copy()
    return Seed(name, np.asarray(prompt, np.int64), head, payload, header, rows, weight, lead, alternates)
