#!/usr/bin/env python3
"""What EDKV 2.0 windows save for a sliding-window model, and what the saving buys at the same budget.

For each ``--lengths`` prompt (CPython's pydoc prose, the model's tokenizer), prefilled and scored as the
prefill server does (fp32 prefill graph, attention importance):

1. **Bytes at the same tiers**: the tier map the server picks at budget b for a 1.x receiver, encoded as
   EDKV 1.2 (every layer, every kept token) and as 2.0 (the windowed layers for the prompt's tail only,
   ``kv.window``): the saving the window alone makes.
2. **Quality at the same budget**: what a 2.0 receiver gets at b (the allocator spends the saving on
   higher tiers for the tokens before the tail, which cost only their global layers) against the 1.x
   receiver's payload; the next ``--continuation`` tokens are teacher-forced after each by the INT4 decode
   graph (accuracy level 0) and compared with the FP16 KV of every cell: mean KL and top-1 agreement.

    python tools/study/window_bytes.py [--model gemma3-270m] [--lengths 2048 4096] [--budgets 1.0 0.3 0.15] [--json F]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import time

import numpy as np

from edgedecode.evaluation.scoring import mean_kl, score_continuation, top1_agreement
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.tiers import Tier
from edgedecode.kv.window import tail_tokens, window_start
from edgedecode.kv.wire import decode_snapshot
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.prefill.pipeline import EncodedKV, encode_within_budget, prefill_and_score, served_payload
from edgedecode.runtime.engine import Engine
from tools.common import cli


def tier_mix(encoded: EncodedKV) -> dict[str, int]:
    return {name: count for name, count in encoded.tier_counts().items() if count}


def measure(args: argparse.Namespace) -> dict:
    model = load_model(args.model)
    contract = model.spec.kv_contract
    if not tail_tokens(contract):
        raise SystemExit(f"{args.model} has no sliding-window layers: EDKV windows change nothing for it")
    context = max(args.lengths) + args.continuation + 8
    prefiller = Engine(model, GraphOptions("prefill", "float32", 0), max_context=context, threads=args.threads)
    decoder = Engine(model, GraphOptions("decode", "float32", 0), max_context=context, threads=args.threads)
    rows = []
    for length in args.lengths:
        ids = token_windows(model.tokenizer, pydoc_corpus(), length + args.continuation, 1)[0]
        prompt, continuation = ids[:length], ids[length:]
        started = time.perf_counter()
        scored = prefill_and_score(prefiller, prompt)
        prefill_s = time.perf_counter() - started
        fp16 = encode_within_budget(scored, 1.0)
        reference = score_continuation(decoder, prompt, continuation, decode_snapshot(b"".join(fp16.frames), contract))
        for budget in args.budgets:
            plain = encode_within_budget(scored, budget)
            start = window_start(plain.tiers != Tier.DROP, tail_tokens(contract))
            same_tiers = list(served_payload(scored.snapshot, plain.tiers, {}, np.ones(length), window_start=start))
            windowed = encode_within_budget(scored, budget, windowed=True)
            quality = {}
            for name, encoded in (("edkv_1", plain), ("edkv_2", windowed)):
                kv = decode_snapshot(b"".join(encoded.frames), contract)
                score = score_continuation(decoder, prompt, continuation, kv)
                quality[name] = {
                    "wire_bytes": encoded.wire_bytes,
                    "b_wire": round(encoded.b_wire, 4),
                    "tiers": tier_mix(encoded),
                    "kl": mean_kl(reference, score),
                    "top1": top1_agreement(reference, score),
                }
            row = {
                "length": length,
                "budget": budget,
                "prefill_s": round(prefill_s, 2),
                "same_tiers": {
                    "edkv_1_bytes": plain.wire_bytes,
                    "edkv_2_bytes": sum(len(frame) for frame in same_tiers),
                },
                "same_budget": quality,
            }
            row["same_tiers"]["ratio"] = round(row["same_tiers"]["edkv_2_bytes"] / plain.wire_bytes, 4)
            rows.append(row)
            print_row(row)
    return {
        "model": args.model,
        "window": contract.sliding_window,
        "windowed_layers": len(contract.sliding_layers),
        "layers": contract.n_layers,
        "tail_tokens": tail_tokens(contract),
        "continuation": args.continuation,
        "threads": args.threads,
        "rows": rows,
    }


def print_row(row: dict) -> None:
    same, q = row["same_tiers"], row["same_budget"]
    print(
        f"{row['length']:>5} tokens  b {row['budget']:<5} same tiers: {same['edkv_1_bytes'] / 1e6:7.2f} MB -> "
        f"{same['edkv_2_bytes'] / 1e6:6.2f} MB ({same['ratio']:.3f})   same budget: KL "
        f"{q['edkv_1']['kl']:.4f} -> {q['edkv_2']['kl']:.4f}, top-1 {q['edkv_1']['top1']:.3f} -> "
        f"{q['edkv_2']['top1']:.3f}   tiers {q['edkv_1']['tiers']} -> {q['edkv_2']['tiers']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser, "gemma3-270m", help="a registered model with sliding-window layers")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.3, 0.15])
    parser.add_argument("--continuation", type=int, default=32)
    cli.add_threads(parser)
    cli.add_json_file(parser, help="Also write the results here.")
    args = parser.parse_args(argv)
    results = measure(args)
    if args.json:
        cli.write_json(results, args.json)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    cli.run(main)
