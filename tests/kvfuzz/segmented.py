"""Seeds of resumed transfers, the daemon's segmented pull (``daemon.pull.segment``): a first segment broken off after
some chunks (cut, keeping its verified prefix), then the resume the prefill server serves for the rest of the prompt
(its KV from the first position left uncovered), which the fuzz mutates. Each seed also carries the payloads served
from a resume offset off by a few positions (``Alternate``): one before the covered position (an overlap the receiver
must refuse) and one after it (a gap it may accept: the positions between are computed)."""

from __future__ import annotations

import numpy as np
from test_kv_format import split_frames

from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.wire import TransferRef, encode_payload
from edgedecode.model.tokenizer import Tokenizer
from edgedecode.prefill.pipeline import ScoredPrefill, encode_within_budget, payload_meta, prefill_and_score
from edgedecode.runtime.engine import Engine
from kvfuzz.seeds import Alternate, Lead, Seed, make_seed

OFFSETS = (-2, 3)  # the alternates' resume offsets relative to the covered position


def build_segmented_seeds(tokenizer: Tokenizer, prefill: Engine, decoder: Engine) -> list[Seed]:
    """Resumes after a first segment cut after one chunk (tokens dropped before the cut, and not), after two of
    16-token chunks, and before its header arrived (nothing covered: the resume is the whole prompt).

    ``prefill``: a prefill graph engine of the model ``tokenizer`` belongs to; ``decoder``: the CPU decode engine
    the cases run on, with room for 160 tokens and the fuzz's margin.
    """
    prompts = token_windows(tokenizer, pydoc_corpus(), 160, 4)
    transfer = TransferRef("fuzz-resume", 30.0)
    meta = payload_meta("ours", 0.3)
    scored = {i: prefill_and_score(prefill, prompts[i]) for i in (1, 2)}

    def served(i: int, budget: float, start: int, length: int | None = None) -> bytes:
        part = (scored[i] if length is None else _first(scored[i], length)).from_position(start)
        return b"".join(encode_within_budget(part, budget, transfer=transfer).frames)

    fine = _first(scored[2], 48)
    tiers = encode_within_budget(fine, 0.3).tiers
    fine_payload = b"".join(encode_payload(fine.snapshot, tiers, chunk_tokens=16, meta=meta, transfer=transfer))
    specs = [  # name, prompt, first segment, chunks of it kept before the cut (None: cut inside its header), budget
        ("160t resumed after a 128-token chunk", 1, None, served(1, 0.3, 0), 1, 0.3),
        ("160t with drops resumed after a 128-token chunk", 2, None, served(2, 0.12, 0), 1, 0.12),
        ("48t resumed after two 16-token chunks", 2, 48, fine_payload, 2, 0.3),
        ("160t resumed after a cut inside the header", 1, None, served(1, 0.3, 0), None, 0.3),
    ]
    seeds = []
    for name, i, length, first, chunks, budget in specs:
        prompt = prompts[i][:length]
        lead = _lead(decoder, prompt, first, chunks)
        alternates = tuple(
            Alternate(f"resume offset {offset:+d}", served(i, budget, lead.covered + offset, length))
            for offset in OFFSETS
            if 0 <= lead.covered + offset < len(prompt)
        )
        payload = served(i, budget, lead.covered, length)
        seeds.append(make_seed(decoder, name, prompt, 0, payload, 2, lead, alternates))
    return seeds


def _first(scored: ScoredPrefill, length: int) -> ScoredPrefill:
    """The scored prefill of the prompt's first ``length`` tokens (its KV and importance cut there)."""
    return ScoredPrefill(scored.snapshot.slots(0, length), scored.importance[:length])


def _lead(decoder: Engine, prompt: np.ndarray, payload: bytes, chunks: int | None) -> Lead:
    """The first segment: ``payload`` broken off after its first ``chunks`` chunk frames (None: inside its
    header), fed and cut; what it covered and wrote."""
    header, frames, _ = split_frames(payload)
    broken = header[: len(header) // 2] if chunks is None else header + b"".join(frames[:chunks]) + frames[chunks][:7]
    stream = decoder.open_kv_stream(prompt)
    stream.feed(broken)
    covered = stream.cut()
    return Lead(broken, covered, decoder.cache.host[:, :, 0, :, : stream.slots].copy())
