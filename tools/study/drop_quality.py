#!/usr/bin/env python3
"""Which tokens the memory ladder's drop rung should drop: the quality of a conversation's next
text after its stored KV lost a share of its tokens, chosen by each importance source.

For each of ``--texts`` pydoc prose windows, the first ``--context`` tokens are prefilled as the
prefill server does (the fp32 prefill graph, with its attention importance from the observation
window) and stored as the daemon's store holds an idle conversation at the re-tier rung: every
token INT4 but the store's pins (sinks and the recent window, INT8). Then ``fraction`` of the
tokens are dropped, least important first by each source, with the store's own drop order
(``daemon.memory.conversation``: unpinned tokens only, ties oldest first):

- ``position``: position importance (the oldest tokens after the sinks go first), what the store
  uses when nothing better came with the KV;
- ``attention``: the prefill side's attention importance, what a pull can carry (EDKV ``importance``);
- ``key_norm``: minus the keys' L2 norm, mean over layers and heads (a query-free proxy: tokens
  with small keys draw more attention; Devoto et al., 2024), computable from the stored KV alone;
- ``none``: nothing dropped (the re-tier rung alone), for scale;
- ``int3``: nothing dropped, the unpinned tokens re-tiered once more, from the stored INT4 to INT3 (the stored
  conversation decoded and encoded again, as a re-tier rung does): what a rung before dropping would cost;
- ``int3_rotated``: the same with the INT3 tokens rotated before quantizing (EDKV 1.3's Hadamard rotation, blocks
  of 32 channels, ``kv.rotation.DEFAULT_ROTATION``'s seed), which the store does not do today.

Each row records the stored payload's chunk bytes, so a share dropped can be set against INT3 at equal bytes.

The KV goes through the store's encoder and ``Engine.restore`` as in the daemon; the next
``--continuation`` tokens are teacher-forced after it by the INT4 decode graph at accuracy level 0
and compared with the same context's KV uncompressed: Δ perplexity (%), mean KL, top-1 agreement.

    python tools/study/drop_quality.py [--texts 16] [--context 512] [--continuation 64] [--fractions 0.25 0.5]
        [--json F]
    python tools/study/drop_quality.py --report F
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import json
import math
import statistics
import time

import numpy as np

from edgedecode.daemon.memory.conversation import drop_order, store_pins
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.evaluation.scoring import mean_kl, score_continuation, top1_agreement
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.importance import position_importance
from edgedecode.kv.rotation import DEFAULT_ROTATION, Rotation
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import encode_payload
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.prefill.pipeline import prefill_and_score
from edgedecode.runtime.engine import Engine
from tools.common import cli

SOURCES = ("none", "int3", "int3_rotated", "position", "attention", "key_norm")
WHOLE = ("none", "int3", "int3_rotated")  # sources that drop nothing
INT3_ROTATION = Rotation(DEFAULT_ROTATION.kind, DEFAULT_ROTATION.seed, (Tier.INT3,), DEFAULT_ROTATION.block)


def key_norm_importance(keys: np.ndarray) -> np.ndarray:
    """A query-free importance [n] from the KV alone: minus each token's key L2 norm, averaged over
    layers and KV heads (tokens with small keys draw more attention: Devoto et al., 2024). ``keys``:
    [layers, kv_heads, n, head_dim] (RoPE rotates keys, so pre- and post-RoPE norms are equal)."""
    norms = np.linalg.norm(keys.astype(np.float32, copy=False), axis=-1)  # [layers, kv_heads, n]
    return -norms.mean(axis=(0, 1)).astype(np.float32)


def stored_tiers(positions: np.ndarray, importance: np.ndarray, fraction: float) -> np.ndarray:
    """uint8 [n]: INT4 but the store's pins (INT8), then ``fraction`` of all tokens dropped in the
    store's drop order for ``importance``."""
    pinned = store_pins(positions)
    tiers = np.where(pinned, Tier.INT8, Tier.INT4).astype(np.uint8)
    count = round(fraction * len(positions))
    tiers[drop_order(tiers, pinned, importance, room=count)] = Tier.DROP
    return tiers


def restored(
    engine: Engine, store: ConversationStore, context: np.ndarray, kv: KVSnapshot, tiers: np.ndarray
) -> tuple[KVSnapshot, int]:
    """The context's KV after the store held it at ``tiers`` and the engine restored it, and the stored chunk
    bytes."""
    engine.reset()
    entry = store.compress("drop-quality", kv, None, tiers)
    engine.restore(context, entry.payload)
    return engine.export_kv(), entry.chunk_nbytes


def retiered_int3(
    engine: Engine,
    store: ConversationStore,
    context: np.ndarray,
    kv: KVSnapshot,
    tiers: np.ndarray,
    rotation: Rotation | None = None,
) -> tuple[KVSnapshot, int]:
    """The context's KV stored at ``tiers``, then its INT4 tokens re-tiered to INT3 (rotated by ``rotation`` if
    given) from what the store held (as a rung re-encodes), restored; and the stored chunk bytes."""
    held, _ = restored(engine, store, context, kv, tiers)
    lower = np.where(tiers == Tier.INT4, Tier.INT3, tiers).astype(np.uint8)
    if rotation is None:
        return restored(engine, store, context, held, lower)
    engine.reset()
    frames = list(encode_payload(held, lower, rotation=rotation))
    engine.restore(context, b"".join(frames))
    return engine.export_kv(), sum(len(frame) for frame in frames[1:-1])  # the chunks: less header and trailer


def table(rows: list[dict], fractions: list[float]) -> list[str]:
    """The markdown table of ``rows`` (scores per text, source and fraction), one line per source and fraction."""
    lines = [
        "| dropped share | source | Δ PPL % mean (min … max) | Δ PPL % median | KL mean | KL median | top-1 mean "
        "| stored bytes ÷ none's |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    stored = [r["chunk_bytes"] for r in rows if r["source"] == "none" and "chunk_bytes" in r]
    for fraction in [0.0, *fractions]:
        for source in SOURCES:
            picked = [r for r in rows if r["fraction"] == fraction and r["source"] == source]
            if not picked:
                continue
            d = [r["dppl_pct"] for r in picked]
            kl = [r["kl"] for r in picked]
            lines.append(
                f"| {fraction:.1%} | {source} | {statistics.mean(d):+.2f} ({min(d):+.2f} … {max(d):+.2f}) | "
                f"{statistics.median(d):+.2f} | {statistics.mean(kl):.4f} | {statistics.median(kl):.4f} | "
                f"{statistics.mean(r['top1'] for r in picked):.3f} | {_bytes_ratio(picked, stored)} |"
            )
    return lines


def _bytes_ratio(picked: list[dict], stored: list[int]) -> str:
    """The rows' mean stored chunk bytes over the unchanged conversations' ("—" for a run that kept none)."""
    if not stored or any("chunk_bytes" not in r for r in picked):
        return "—"
    return f"{statistics.mean(r['chunk_bytes'] for r in picked) / statistics.mean(stored):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--texts", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    cli.add_threads(parser)
    cli.add_json_file(parser, help="write every score here")
    parser.add_argument("--report", type=Path, help="print the table of a saved run (its --json) instead of running")
    args = parser.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        print("\n".join(table(saved["rows"], saved["args"]["fractions"])))
        return 0
    started = time.monotonic()
    model = load_model()
    length = args.context + args.continuation
    prefiller = Engine(model, GraphOptions("prefill"), max_context=length, threads=args.threads)
    restorer = Engine(model, GraphOptions(), max_context=length, threads=args.threads)
    scorer = Engine(model, GraphOptions(accuracy_level=0), max_context=length, threads=args.threads)
    store = ConversationStore(1)  # only its encoder
    rows = []
    for index, window in enumerate(token_windows(model.tokenizer, pydoc_corpus(), length, args.texts)):
        context, continuation = window[: args.context], window[args.context :]
        scored = prefill_and_score(prefiller, context)
        kv = scored.snapshot
        importance = {
            "position": position_importance(kv.positions),
            "attention": scored.importance,
            "key_norm": key_norm_importance(kv.keys),
        }
        reference = score_continuation(scorer, context, continuation, kv)
        for fraction in args.fractions:
            for source in SOURCES:
                whole = source in WHOLE
                if whole and fraction != args.fractions[0]:
                    continue
                ranking = importance.get(source, importance["position"])
                tiers = stored_tiers(kv.positions, ranking, 0.0 if whole else fraction)
                if source.startswith("int3"):
                    rotation = INT3_ROTATION if source == "int3_rotated" else None
                    held, chunk_bytes = retiered_int3(restorer, store, context, kv, tiers, rotation)
                else:
                    held, chunk_bytes = restored(restorer, store, context, kv, tiers)
                score = score_continuation(scorer, context, continuation, held)
                rows.append(
                    {
                        "text": index,
                        "source": source,
                        "fraction": 0.0 if whole else fraction,
                        "dropped": int(np.count_nonzero(tiers == Tier.DROP)),
                        "chunk_bytes": chunk_bytes,
                        "dppl_pct": 100 * math.expm1(score.mean_nll - reference.mean_nll),
                        "kl": mean_kl(reference, score),
                        "top1": top1_agreement(reference, score),
                    }
                )
        print(f"text {index}: done ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    print(
        f"\n{args.texts} texts of {args.context} context + {args.continuation} continuation tokens; "
        f"{time.monotonic() - started:.0f} s\n"
    )
    print("\n".join(table(rows, args.fractions)))
    if args.json:
        cli.write_json({"args": cli.settings(args), "rows": rows}, args.json, indent=None)
    return 0


if __name__ == "__main__":
    cli.run(main)
