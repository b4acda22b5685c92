#!/usr/bin/env python3
"""The conversation store on the real model: bytes per token of a conversation's KV in each form, the
time to compress, re-tier and rehydrate it, and what each form costs in quality.

A pydoc window of --tokens tokens is prefilled by the INT4 decode graph (accuracy level 4, as shipped)
and its KV exported (float32, what a slot holds today). Forms: FP32 resident; FP16 (its quality is the
graph's own noise floor); in the store: INT8 (the starting tier), re-tiered to INT4 (sinks and recent
window kept at INT8), INT4 everywhere, and re-tiered then trimmed to a third of its INT8 bytes (tokens
dropped by position importance). Store bytes are what the budget counts: the payload after zstd, plus
6 B/token of tier map, importance and pins. Times are medians over --runs of ``ConversationStore.put``
(compress at INT8), ``make_room`` (re-tier INT8 -> INT4) and rehydration (``Engine.open_kv_stream``:
the payload verified and dequantized into the engine's KV buffers). Quality: the next --continuation
tokens teacher-forced after the context, the context's KV from each form against the float32 KV: mean
KL (nats), top-1 agreement, Δ mean NLL.

    python tools/bench/store.py [--tokens 2048] [--continuation 128] [--runs 5] [--threads 2]
                                [--accuracy-level 4] [--json]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from edgedecode.daemon.memory.conversation import StoredConversation
from edgedecode.daemon.memory.ledger import MemoryLedger
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.daemon.slots import SlotPool
from edgedecode.evaluation.scoring import mean_kl, score_continuation, top1_agreement
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import decode_snapshot
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.engine import Engine
from tools.common import cli

SESSION = "bench"


def median_seconds(fn: Callable[[], object], runs: int, setup: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(runs):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stored(
    snapshot: KVSnapshot, tiers: Tier = Tier.INT8, budget_bytes: int = 1 << 40, workers: int = 1
) -> StoredConversation:
    """The conversation as a store of ``budget_bytes`` holds it after putting it at ``tiers``."""
    store = ConversationStore(1, workers=workers)
    MemoryLedger(store, SlotPool([], 1), budget_bytes=budget_bytes).put(SESSION, snapshot, tiers=tiers)
    entry = store.take(SESSION)
    assert entry is not None, "the budget is too small for the conversation even at the drop rung's floor"
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--continuation", type=int, default=128)
    cli.add_runs(parser, 5)
    cli.add_threads(parser, help="onnxruntime threads")
    parser.add_argument("--workers", type=int, default=1, help="threads encoding each payload")
    cli.add_accuracy_level(parser, help="decode graph's MatMulNBits accuracy (0: exact fp32 arithmetic)")
    cli.add_json_flag(parser)
    args = parser.parse_args(argv)

    model = load_model()
    engine = Engine(
        model,
        GraphOptions("decode", "float32", args.accuracy_level),
        max_context=args.tokens + args.continuation + 8,
        threads=args.threads,
    )
    window = token_windows(model.tokenizer, pydoc_corpus(), args.tokens + args.continuation, 1)[0]
    context, continuation = window[: args.tokens], window[args.tokens :]
    engine.prefill(context)
    snapshot = engine.export_kv()
    n = snapshot.n_tokens

    int8 = stored(snapshot, workers=args.workers)
    forms = {
        "INT8": int8,
        "INT4 (re-tiered; pins INT8)": stored(snapshot, budget_bytes=int8.nbytes - 1, workers=args.workers),
        "INT4 everywhere": stored(snapshot, Tier.INT4, workers=args.workers),
    }
    trimmed = stored(snapshot, budget_bytes=int8.nbytes // 3, workers=args.workers)  # re-tiered, then dropped
    forms[f"INT4, {trimmed.n_tokens - trimmed.n_kept} tokens dropped"] = trimmed
    bytes_per_token = {"FP32 resident": engine.kv_bytes_per_slot, "FP16": engine.kv_bytes_per_slot // 2}
    bytes_per_token |= {name: round(entry.nbytes / n) for name, entry in forms.items()}

    compress_s = median_seconds(lambda: stored(snapshot, workers=args.workers), args.runs)
    # a budget that holds the INT8 conversation exactly
    full = MemoryLedger(ConversationStore(1, workers=args.workers), SlotPool([], 1), budget_bytes=int8.nbytes)
    retier_s = median_seconds(lambda: full.make_room(1), args.runs, setup=lambda: full.put(SESSION, snapshot))

    def rehydrate() -> None:
        stream = engine.open_kv_stream(context)
        stream.feed(int8.payload)
        stream.finish()

    rehydrate_s = median_seconds(rehydrate, args.runs)

    reference = score_continuation(engine, context, continuation, snapshot)
    quality = {}
    rehydrated = {name: decode_snapshot(entry.payload, snapshot.contract) for name, entry in forms.items()}
    fp16 = replace(snapshot, keys=snapshot.keys.astype(np.float16), values=snapshot.values.astype(np.float16))
    for name, kv in ({"FP16": fp16} | rehydrated).items():
        score = score_continuation(engine, context, continuation, kv)
        quality[name] = {
            "kl": mean_kl(reference, score),
            "top1": top1_agreement(reference, score),
            "delta_nll": score.mean_nll - reference.mean_nll,
        }
    results = {
        "tokens": n,
        "bytes_per_token": bytes_per_token,
        "compress_int8_ms": compress_s * 1e3,
        "retier_int8_to_int4_ms": retier_s * 1e3,
        "rehydrate_int8_ms": rehydrate_s * 1e3,
        "quality_vs_fp32": quality,
        "runs": args.runs,
        "threads": args.threads,
        "workers": args.workers,
    }
    if args.json:
        cli.print_json(results, indent=2)
        return
    print(f"{n}-token conversation (pydoc window), SmolLM2-135M KV")
    for name, value in bytes_per_token.items():
        q = quality.get(name)
        shown = f"  KL {q['kl']:.2e}  top-1 {q['top1']:.3f}  ΔNLL {q['delta_nll']:+.4f}" if q else ""
        print(f"  {name:32s} {value:7d} B/token{shown}")
    print(
        f"median of {args.runs}: compress (INT8) {compress_s * 1e3:.0f} ms, re-tier INT8 -> INT4 "
        f"{retier_s * 1e3:.0f} ms, rehydrate {rehydrate_s * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    cli.run(main)
