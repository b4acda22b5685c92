#!/usr/bin/env python3
"""How large a model's KV gets on its calibration text, and on text unlike it: the basis of the reader's value check.

Measures each layer's largest |key| and |value| (``kv.value_range``) on the probe's calibration contexts (the same
windows of CPython's pydoc prose ``edgedecode probe`` prefills), then on held-out prompts unlike them: chat turns,
Python source, digits, one token repeated, uniformly random token ids, and one long context. For each held-out
prompt and graph (the prefill server's fp32 graph, and the decoder's own, whose KV a conversation store keeps) it
reports the largest ratio of a layer's measured |x| to its calibrated range: what the reader's multiple
(``VALUE_RANGE_MULTIPLE``) must exceed. ``--save`` writes the calibrated range where edgedecode ships it.

    python tools/study/kv_value_range.py [--model NAME] [--long-tokens 4096] [--save] [--json F]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import inspect
import json
import textwrap

import numpy as np

from edgedecode.evaluation.probe import ProbeSettings, calibration_contexts, calibration_source
from edgedecode.evaluation.texts import pydoc_corpus
from edgedecode.kv.value_range import RANGES_DIR, KVValueRange
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel, load_model
from edgedecode.runtime.engine import Engine
from tools.common import cli

CHAT_TURNS = [
    "What is the capital of France, and why did it become the capital?",
    "Write a haiku about the sea. Then explain its meter.",
    "Translate 'the quick brown fox jumps over the lazy dog' into German and Spanish.",
    "List five prime numbers larger than 1000 and show how you checked them.",
]


def held_out_prompts(model: LoadedModel, long_tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Prompts unlike the calibration prose, by name (token ids)."""
    tok = model.tokenizer
    code = inspect.getsource(json) + inspect.getsource(textwrap)
    digits = " ".join(str(i * 7919 % 100003) for i in range(600))
    corpus = "\n\n".join(reversed(pydoc_corpus()))  # a long context, from the other end of the corpus
    vocab = model.spec.vocab_size
    prompts = {
        "chat": np.asarray(tok.encode_chat([{"role": "user", "content": "\n".join(CHAT_TURNS)}]), np.int64),
        "python source": np.asarray(tok.encode(code, parse_special=False), np.int64)[:2048],
        "digits": np.asarray(tok.encode(digits, parse_special=False), np.int64)[:2048],
        "one token repeated": np.full(1024, tok.encode(" the", parse_special=False)[0], np.int64),
        "random token ids": rng.integers(0, vocab, 1024, dtype=np.int64),
        f"long prose ({long_tokens})": np.asarray(tok.encode(corpus, parse_special=False), np.int64)[:long_tokens],
    }
    return prompts


def kv_of(engine: Engine, ids: np.ndarray):
    engine.reset()
    engine.prefill(ids)
    return engine.export_kv()


def measure(args: argparse.Namespace) -> dict:
    model = load_model(args.model)
    settings = ProbeSettings()
    max_context = max(args.long_tokens, settings.context_tokens) + 8
    prefill = Engine(model, GraphOptions("prefill"), max_context=max_context, threads=args.threads)
    calibrated = KVValueRange.measure(
        (kv_of(prefill, context) for context in calibration_contexts(model, settings)),
        f"tools/study/kv_value_range.py: {calibration_source(settings)}",
    )
    reference = np.asarray(calibrated.abs_max)
    decoder = Engine(model, GraphOptions(), max_context=max_context, threads=args.threads)
    rows = []
    for name, ids in held_out_prompts(model, args.long_tokens, np.random.default_rng(0)).items():
        for graph, engine in (("prefill", prefill), ("decode", decoder)):
            seen = np.asarray(KVValueRange.measure([kv_of(engine, ids)], name).abs_max)
            ratio = seen / reference
            worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
            rows.append(
                {
                    "prompt": name,
                    "graph": graph,
                    "tokens": len(ids),
                    "max_ratio_keys": float(ratio[:, 0].max()),
                    "max_ratio_values": float(ratio[:, 1].max()),
                    "worst_layer": int(worst[0]),
                    "worst_kind": ("keys", "values")[int(worst[1])],
                }
            )
            print(
                f"{name:<24} {graph:<8} {len(ids):>5} tokens: max ratio keys {ratio[:, 0].max():5.2f}, "
                f"values {ratio[:, 1].max():5.2f} (layer {worst[0]} {('keys', 'values')[worst[1]]})",
                flush=True,
            )
    return {
        "model": model.record.name,
        "decoder_kv_dtype": str(decoder.cache.dtype),
        "calibrated": calibrated.to_dict(),
        "largest_calibrated": {"keys": float(reference[:, 0].max()), "values": float(reference[:, 1].max())},
        "held_out": rows,
        "max_ratio": max(max(r["max_ratio_keys"], r["max_ratio_values"]) for r in rows),
    }


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    parser.add_argument("--long-tokens", type=int, default=4096, help="tokens of the long held-out context")
    cli.add_threads(parser)
    parser.add_argument("--save", action="store_true", help=f"write the calibrated range to {RANGES_DIR}/<model>.json")
    cli.add_json_file(parser, help="write the whole measurement here")
    args = parser.parse_args(argv)
    result = measure(args)
    print(f"{result['model']}: largest ratio to the calibrated range on held-out text {result['max_ratio']:.2f}")
    if args.json:
        cli.write_json(result, args.json, indent=2)
    if args.save:
        path = RANGES_DIR / f"{result['model']}.json"
        cli.write_json({"model": result["model"], **result["calibrated"]}, path, indent=2)
        print(f"saved {path}")


if __name__ == "__main__":
    cli.run(main)
