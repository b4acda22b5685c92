"""Seeds of EDKV 2.0 windowed payloads: a sliding-window model's KV with the windowed layers carried for the
prompt's tail only (``window``), and the same prompt as 1.2 (every cell carried), from the real prefill pipeline.

The model is a tiny synthetic Gemma 3 (``synthetic_gguf``: 6 layers, 1 KV head of 128, window 5 on layers 0-4 as
Gemma 3's pattern has it, a 69-token tail): it takes the reader's windowed paths (the header's ``window`` checks, the
carried cells' chunk plans and sizes, the window's slot in a cut segment) as gemma3-270m's payloads do, at payloads
small enough to fuzz 100k cases (a real Gemma 3 270M 2.0 payload needs 577+ kept tokens: megabytes a case).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType
from synthetic_gguf import TinyLlama, write_tiny_llama

from edgedecode.kv.importance import relative_importance
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import tail_tokens, window_start
from edgedecode.kv.wire import TransferRef, encode_payload
from edgedecode.model.fetch import register_gguf
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel, load_model
from edgedecode.prefill.pipeline import encode_within_budget, payload_meta, prefill_and_score
from edgedecode.runtime.engine import Engine
from kvfuzz.seeds import Seed, make_seed

CONTEXT = 256  # the tiny model's context: the prompt and the fuzz's margin fit
PROMPT_TOKENS = 200
TYPES = {name: QType.Q4_0 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
TYPES |= {"token_embd": QType.Q8_0, "output": QType.Q8_0}


def tiny_gemma3(home: Path) -> LoadedModel:
    """The tiny Gemma 3, written into ``home`` and registered; the caller makes ``home`` EDGEDECODE_HOME while the
    model is registered and its engines made (its graphs are built there, not in the shared model cache)."""
    dims = TinyLlama(key_length=128, kv_heads=1, layers=6)
    path = write_tiny_llama(home / "tiny-gemma3.gguf", TYPES, dims, seed=4, tied=True, arch="gemma3")
    return load_model(register_gguf(path, "fuzz-tiny-gemma3").name)


def engines(model: LoadedModel) -> tuple[Engine, Engine]:
    """(prefill engine, decode engine as the daemon runs it on CPU) of CONTEXT slots."""
    prefill = Engine(model, GraphOptions("prefill"), max_context=CONTEXT, threads=1)
    decoder = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=CONTEXT, threads=1)
    return prefill, decoder


def build_windowed_seeds(prefill: Engine, decoder: Engine) -> list[Seed]:
    """2.0 payloads as served (a window after dropped tokens, and after none), with 16-token chunks of 2 layers (a
    window inside a chunk), as a later segment, and the same prompt as 1.2 (no window)."""
    contract = decoder.spec.kv_contract
    prompt = np.random.default_rng(5).integers(0, 95, PROMPT_TOKENS)
    scored = prefill_and_score(prefill, prompt)
    transfer = TransferRef("fuzz-window", 30.0)

    def served(budget: float, head: int = 0, windowed: bool = True) -> bytes:
        part = scored.from_position(head)
        return b"".join(encode_within_budget(part, budget, transfer=transfer, windowed=windowed).frames)

    tiers = encode_within_budget(scored, 0.15).tiers
    start = window_start(tiers != Tier.DROP, tail_tokens(contract))
    fine = encode_payload(
        scored.snapshot,
        tiers,
        chunk_tokens=16,
        chunk_layers=2,
        meta=payload_meta("ours", 0.15),
        transfer=transfer,
        importance=relative_importance(scored.importance),
        window_start=start + 3,  # not on a chunk boundary
    )
    specs = [
        ("200t 2.0, INT4+DROP before the window", served(0.15), 0, 4),
        ("200t 2.0, FP16+INT8", served(0.6), 0, 2),
        ("200t 2.0, 16-token chunks of 2 layers", b"".join(fine), 0, 3),
        ("200t 2.0 from position 60 (a later segment)", served(0.2, head=60), 60, 3),
        ("200t 1.2 of the windowed model", served(0.15, windowed=False), 0, 2),
    ]
    return [make_seed(decoder, name, prompt, head, payload, weight) for name, payload, head, weight in specs]
