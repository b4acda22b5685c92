#!/usr/bin/env python3
"""Cross-quant handoff study: does KV from the higher-precision prefill keep a lower-bit decoder closer to it?

For every prompt the reference (the fp32 prefill graph over the GGUF's dequantized weights) samples
N tokens (seeded, temperature 0.7, top-p 0.95, end-of-turn ignored so every run has N tokens).
Every target decode graph (the same weights, re-quantized: GraphOptions.weights) then replays
those tokens teacher-forced in each mode:

* ``target``: from its own prefill of the prompt;
* ``handoff``: from the reference's prefill KV injected into it (the PD path, in process);
* ``wire-<b>`` (one per --budgets entry): the same KV sent through EDKV at budget b (wire bytes ÷
  FP16 bytes) under the "ours" policy and the model's tier profile, decoded as the receiver would.

Per token: KL(ref || mode) and top-1 agreement; per prompt: mean, p50 and p99 of the KL; and the
decay of both over 64-token windows by distance from the prompt; per wire mode and prompt: the
achieved b_wire and the tier mix. Writes box plots, decay curves and the raw results
(``crossquant.json``) to --out-dir and prints markdown tables (or the JSON).

    python tools/study/crossquant.py [--tokens 512] [--prompts 12] [--targets native q4b64 ...] [--budgets 0.5 0.3 0.2]
                               [--json] [--out-dir docs]
    python tools/study/crossquant.py --only 0 4 8 --out-dir part0 ...     # a subset of the prompts (seeds unchanged)
    python tools/study/crossquant.py --merge part*/crossquant.json --out-dir docs/crossquant-wire

Plots need matplotlib: pip install -e '.[bench]'.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pydoc_data.topics import topics

import numpy as np

from edgedecode.evaluation.scoring import kl_per_token, log_softmax
from edgedecode.kv.policy import TierProfile, profile_path
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel, load_model
from edgedecode.model.spec import KVContract
from edgedecode.model.tokenizer import Tokenizer
from edgedecode.prefill.pipeline import ScoredPrefill, prefill_and_score, through_wire
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import Sampler, SamplingParams
from tools.common import cli
from tools.study.crossquant_plot import plot

logger = logging.getLogger(__name__)

WINDOW_TOKENS = 64
TEMPERATURE, TOP_P = 0.7, 0.95
DEFAULT_TARGETS = ("native", "q4b16", "q4b64", "q4b128", "q2b32")
DEFAULT_BUDGETS = (0.5, 0.3, 0.2)
WIRE_POLICY = "ours"
EXCERPT_TOKENS = {"short": 128, "medium": 768, "long": 2000}  # chat "short" prompts are plain questions
KL_CHUNK_ROWS = 128  # rows of [vocab] log-softmax computed at once


@dataclass(frozen=True)
class PromptSpec:
    """One study prompt: chat (through the chat template) or prose (a continuation), of a size class."""

    name: str
    kind: str  # "chat" or "prose"
    size: str  # "short", "medium" or "long"
    source: str  # a pydoc_data topic key, or the question itself for a short chat prompt


# Round-robin over the size classes, so any --prompts >= 3 covers short, medium and long.
PROMPTS = (
    PromptSpec(
        "chat-short-story", "chat", "short", "Write a short story about a lighthouse keeper who befriends a seagull."
    ),
    PromptSpec("prose-medium-attribute-access", "prose", "medium", "attribute-access"),
    PromptSpec("chat-long-compound", "chat", "long", "compound"),
    PromptSpec("prose-short-for", "prose", "short", "for"),
    PromptSpec("chat-medium-typesmapping", "chat", "medium", "typesmapping"),
    PromptSpec("prose-long-specialnames", "prose", "long", "specialnames"),
    PromptSpec(
        "chat-short-list-tuple",
        "chat",
        "short",
        "What are the main differences between a list and a tuple in Python? Answer with examples.",
    ),
    PromptSpec("prose-medium-assignment", "prose", "medium", "assignment"),
    PromptSpec("chat-long-formatstrings", "chat", "long", "formatstrings"),
    PromptSpec("prose-short-exceptions", "prose", "short", "exceptions"),
    PromptSpec("chat-medium-customization", "chat", "medium", "customization"),
    PromptSpec("prose-long-types", "prose", "long", "types"),
)


def prompt_ids(spec: PromptSpec, tokenizer: Tokenizer) -> np.ndarray:
    """Token ids of a study prompt: a documentation excerpt cut to its size class, as prose or inside a chat turn."""
    if spec.kind == "chat" and spec.size == "short":
        return np.asarray(tokenizer.encode_chat([{"role": "user", "content": spec.source}]), np.int64)
    excerpt = tokenizer.decode(tokenizer.encode(topics[spec.source], add_bos=False)[: EXCERPT_TOKENS[spec.size]])
    if spec.kind == "prose":
        return np.asarray(tokenizer.encode(excerpt), np.int64)
    question = (
        f"Here is an excerpt from the Python documentation:\n\n{excerpt}\n\n"
        "Explain what it says in plain words, with an example."
    )
    return np.asarray(tokenizer.encode_chat([{"role": "user", "content": question}]), np.int64)


@dataclass
class Reference:
    """The reference run of one prompt: sampled tokens, their distributions and the prompt's KV."""

    tokens: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n, vocab]: row i is the distribution token i was sampled from
    kv: KVSnapshot  # the reference's KV of the whole prompt
    scored: ScoredPrefill  # the prompt as the prefill side sends it: KV and each token's attention importance


@dataclass(frozen=True)
class Delivery:
    """The prompt KV a target starts from, and what sending it cost (None: handed over in process)."""

    kv: KVSnapshot
    wire: dict | None = None  # budget, b_wire, b_raw, wire_bytes, tiers (tokens per tier)


# A mode: what KV the target starts from, given the reference run and the receiver's KV contract;
# None = the target prefills the prompt itself.
Transport = Callable[[Reference, KVContract], Delivery]


def direct(ref: Reference, receiver: KVContract) -> Delivery:
    """The in-process handoff: the reference's prompt KV, unchanged (float32)."""
    return Delivery(ref.kv)


def through_edkv(budget: float, profile: TierProfile) -> Transport:
    """The handoff through the wire: ref's scored prompt KV encoded as EDKV within ``budget`` under
    WIRE_POLICY, then decoded as the receiver would."""

    def send(ref: Reference, receiver: KVContract) -> Delivery:
        kv, encoded = through_wire(ref.scored, budget, WIRE_POLICY, receiver, profile=profile)
        return Delivery(
            kv,
            {
                "budget": budget,
                "b_wire": encoded.b_wire,
                "b_raw": encoded.b_raw,
                "wire_bytes": encoded.wire_bytes,
                "tiers": encoded.tier_counts(),
            },
        )

    return send


BASELINE = "target"  # every other mode is compared with it
MODES: dict[str, Transport | None] = {BASELINE: None, "handoff": direct}


def study_modes(budgets: list[float], profile: TierProfile) -> dict[str, Transport | None]:
    """MODES plus one ``wire-<budget>`` mode per budget."""
    return {**MODES, **{f"wire-{budget:g}": through_edkv(budget, profile) for budget in budgets}}


def reference_run(engine: Engine, prompt: np.ndarray, n_tokens: int, seed: int) -> Reference:
    """Score the prompt as the prefill side does, then prefill it again and sample n_tokens, keeping
    every distribution.

    Sampling starts from a plain prefill (which resets the engine), so the scoring pass, which re-runs
    the prompt's last tokens to observe their queries, cannot change what the reference samples.
    """
    scored = prefill_and_score(engine, prompt)
    logits = engine.prefill(prompt)
    kv = engine.export_kv()
    sampler = Sampler(SamplingParams(max_tokens=n_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=seed))
    tokens = np.empty(n_tokens, np.int64)
    logprobs = np.empty((n_tokens, engine.spec.vocab_size), np.float32)
    for i in range(n_tokens):
        logprobs[i] = log_softmax(logits)
        tokens[i] = sampler.pick(logits)
        if i + 1 < n_tokens:
            logits = engine.forward(tokens[i : i + 1])
    return Reference(tokens, logprobs, kv, scored)


def replay(engine: Engine, prompt: np.ndarray, tokens: np.ndarray, kv: KVSnapshot | None) -> np.ndarray:
    """Teacher-forced logits [n, vocab] of the target for the reference's tokens (prompt KV injected if given)."""
    first = engine.prefill(prompt, kv=kv).copy()
    return np.concatenate([first[None], engine.forward(tokens[:-1], all_logits=True)])


def token_metrics(ref_logprobs: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KL(ref || target) in nats and whether the two top-1 tokens agree."""
    kl = np.concatenate(
        [
            kl_per_token(
                ref_logprobs[start : start + KL_CHUNK_ROWS], log_softmax(logits[start : start + KL_CHUNK_ROWS])
            )
            for start in range(0, len(logits), KL_CHUNK_ROWS)
        ]
    )
    return kl, ref_logprobs.argmax(-1) == logits.argmax(-1)


def windows(values: np.ndarray) -> list[float]:
    """Means over consecutive WINDOW_TOKENS-token windows (full windows only)."""
    n = len(values) // WINDOW_TOKENS * WINDOW_TOKENS
    return values[:n].reshape(-1, WINDOW_TOKENS).mean(-1).tolist()


def summarize(kl: np.ndarray, top1: np.ndarray) -> dict:
    """One prompt's numbers for one target and mode."""
    p50, p99 = np.percentile(kl, [50, 99])
    return {
        "mean_kl": float(kl.mean()),
        "p50_kl": float(p50),
        "p99_kl": float(p99),
        "top1": float(top1.mean()),
        "window_kl": windows(kl),
        "window_top1": windows(top1.astype(np.float64)),
    }


def run_study(
    model: LoadedModel,
    prompts: list[int],
    targets: list[str],
    n_tokens: int,
    modes: dict[str, Transport | None],
    accuracy_level: int,
    threads: int,
) -> dict:
    """The given prompts (indices into PROMPTS, also their seeds) through the reference, then every
    mode into every target; returns the prompt records and the results tree."""
    ids = [prompt_ids(spec, model.tokenizer) for spec in PROMPTS]
    context = max(len(ids[i]) for i in prompts) + n_tokens + 1
    ref_engine = Engine(model, GraphOptions("prefill", "float32", 0), max_context=context, threads=threads)
    engines = {
        t: Engine(
            model, GraphOptions("decode", "float32", accuracy_level, weights=t), max_context=context, threads=threads
        )
        for t in targets
    }
    receiver = model.spec.kv_contract  # every target's: re-quantized weights share the KV layout
    results: dict[str, dict[str, list[dict]]] = {t: {m: [] for m in modes} for t in targets}
    records = []
    for index in prompts:
        spec, prompt = PROMPTS[index], ids[index]
        started = time.perf_counter()
        ref = reference_run(ref_engine, prompt, n_tokens, seed=index)
        wire = {}
        for mode, transport in modes.items():
            delivery = None if transport is None else transport(ref, receiver)
            if delivery is not None and delivery.wire is not None:
                wire[mode] = delivery.wire
            for target, engine in engines.items():
                logits = replay(engine, prompt, ref.tokens, None if delivery is None else delivery.kv)
                results[target][mode].append(summarize(*token_metrics(ref.logprobs, logits)))
        records.append(
            {
                "index": index,
                "name": spec.name,
                "kind": spec.kind,
                "size": spec.size,
                "prompt_tokens": len(prompt),
                "wire": wire,
            }
        )
        logger.info(
            "%s (%d prompt tokens) done in %.0f s; b_wire %s; mean KL %s",
            spec.name,
            len(prompt),
            time.perf_counter() - started,
            " ".join(f"{m} {w['b_wire']:.3f}" for m, w in wire.items()),
            "; ".join(
                f"{t} " + " ".join(f"{m} {r[-1]['mean_kl']:.4f}" for m, r in per_mode.items())
                for t, per_mode in results.items()
            ),
        )
    return {"prompts": records, "results": results}


def merge(parts: list[dict]) -> dict:
    """One study from runs with the same settings over disjoint prompts and/or targets (e.g. parallel
    --only runs): every target must end up with every mode of every prompt."""
    settings = (
        "model",
        "tokens",
        "temperature",
        "top_p",
        "window_tokens",
        "accuracy_level",
        "budgets",
        "policy",
        "tier_profile",
    )
    first = parts[0]["config"]
    differing = sorted({k for part in parts for k in settings if part["config"].get(k) != first.get(k)})
    if differing:
        raise SystemExit(f"cannot merge runs with different settings: {', '.join(differing)}")
    prompts: dict[int, dict] = {}
    cells: dict[tuple[str, str, int], dict] = {}  # (target, mode, prompt index) -> that prompt's numbers
    for part in parts:
        indices = [prompt.get("index", row) for row, prompt in enumerate(part["prompts"])]
        prompts.update(zip(indices, part["prompts"]))
        for target, modes in part["results"].items():
            for mode, rows in modes.items():
                for index, row in zip(indices, rows):
                    if (target, mode, index) in cells:
                        raise SystemExit(f"{target} {mode} of prompt {index} is in two of the runs")
                    cells[target, mode, index] = row
    order = sorted(prompts)
    targets, modes = list(dict.fromkeys(c[0] for c in cells)), list(dict.fromkeys(c[1] for c in cells))
    missing = [cell for cell in itertools.product(targets, modes, order) if cell not in cells]
    if missing:
        raise SystemExit(f"the runs leave {len(missing)} gaps, e.g. {missing[0]}")
    walls = [w for part in parts for w in part["config"].get("part_wall_seconds", [part["config"]["wall_seconds"]])]
    return {
        "prompts": [prompts[i] for i in order],
        "results": {t: {m: [cells[t, m, i] for i in order] for m in modes} for t in targets},
        "config": {**first, "prompt_indices": order, "wall_seconds": max(walls), "part_wall_seconds": walls},
    }


def aggregate(results: dict) -> dict:
    """Per target and mode: means over prompts, per-window means, and each mode's change against the baseline."""
    summary = {}
    for target, modes in results.items():
        base = modes[BASELINE]
        rows = {}
        for mode, per_prompt in modes.items():
            row = {key: float(np.mean([p[key] for p in per_prompt])) for key in ("mean_kl", "p50_kl", "p99_kl", "top1")}
            row["window_kl"] = np.mean([p["window_kl"] for p in per_prompt], axis=0).tolist()
            if mode != BASELINE:
                row["mean_kl_change"] = row["mean_kl"] / rows[BASELINE]["mean_kl"] - 1
                row["median_prompt_change"] = float(
                    np.median([p["mean_kl"] / b["mean_kl"] - 1 for b, p in zip(base, per_prompt)])
                )
                row["prompts_improved"] = sum(p["mean_kl"] < b["mean_kl"] for b, p in zip(base, per_prompt))
                row["window_change"] = (np.divide(row["window_kl"], rows[BASELINE]["window_kl"]) - 1).tolist()
            rows[mode] = row
        summary[target] = rows
    return summary


def wire_summary(prompts: list[dict]) -> dict:
    """Per wire mode: the budget, achieved b_wire and b_raw (mean, min and max over prompts) and the
    tier mix (tokens over all prompts)."""
    summary = {}
    for mode in prompts[0].get("wire", {}):
        sent = [p["wire"][mode] for p in prompts]
        b_wire = [s["b_wire"] for s in sent]
        summary[mode] = {
            "budget": sent[0]["budget"],
            "b_wire": float(np.mean(b_wire)),
            "b_wire_min": min(b_wire),
            "b_wire_max": max(b_wire),
            "b_raw": float(np.mean([s["b_raw"] for s in sent])),
            "tiers": {tier: sum(s["tiers"][tier] for s in sent) for tier in sent[0]["tiers"]},
        }
    return summary


def markdown_table(summary: dict, n_prompts: int, wire: dict | None = None) -> str:
    """The tables of docs/crossquant.md: one row per target and mode, means over prompts; then, with
    wire modes, what each one sent (b_wire: wire bytes ÷ FP16 bytes of the prompt's KV)."""
    wire = wire or {}
    lines = [
        (
            "| target | mode | b_wire | mean KL | Δ vs target | median Δ per prompt | prompts better | p50 KL "
            "| p99 KL | top-1 % | Δ first / last window |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target, rows in summary.items():
        for mode, r in rows.items():
            b_wire = f"{wire[mode]['b_wire']:.3f}" if mode in wire else "" if mode == BASELINE else "fp32"
            change = (
                "| | | |"
                if mode == BASELINE
                else f"| {r['mean_kl_change']:+.1%} | {r['median_prompt_change']:+.1%} | "
                f"{r['prompts_improved']}/{n_prompts} |"
            )
            windows_change = "" if mode == BASELINE else f"{r['window_change'][0]:+.0%} / {r['window_change'][-1]:+.0%}"
            lines.append(
                f"| {target} | {mode} | {b_wire} | {r['mean_kl']:.4f} {change} {r['p50_kl']:.4f} "
                f"| {r['p99_kl']:.3f} | {100 * r['top1']:.1f} | {windows_change} |"
            )
    if wire:
        tiers = list(next(iter(wire.values()))["tiers"])
        lines += [
            "",
            f"| mode | budget | b_wire mean (min–max) | b_raw | tokens {' / '.join(tiers)} |",
            "|---|---|---|---|---|",
        ]
        for mode, w in wire.items():
            total = sum(w["tiers"].values())
            mix = " / ".join(f"{100 * n / total:.1f} %" for n in w["tiers"].values())
            lines.append(
                f"| {mode} | {w['budget']:g} | {w['b_wire']:.3f} ({w['b_wire_min']:.3f}–{w['b_wire_max']:.3f}) "
                f"| {w['b_raw']:.3f} | {mix} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = cli.parser(__doc__)
    cli.add_model(parser)
    parser.add_argument("--tokens", type=int, default=512, help="tokens the reference generates per prompt")
    select = parser.add_mutually_exclusive_group()
    select.add_argument(
        "--prompts",
        type=int,
        default=len(PROMPTS),
        choices=range(1, len(PROMPTS) + 1),
        metavar=f"1..{len(PROMPTS)}",
        help="the first N prompts",
    )
    select.add_argument(
        "--only",
        type=int,
        nargs="+",
        choices=range(len(PROMPTS)),
        metavar="I",
        help=f"only these prompts (indices 0..{len(PROMPTS) - 1}, also their seeds), e.g. to "
        "split one study over processes",
    )
    select.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: combine the crossquant.json of runs with the same settings over "
        "disjoint prompts and/or targets, and write the outputs of the whole",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        default=list(DEFAULT_TARGETS),
        help="decode-graph weight formats: native or q<bits>b<block_size>",
    )
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=list(DEFAULT_BUDGETS),
        help="EDKV budgets (wire bytes ÷ FP16 bytes of the prompt's KV), one wire-<b> mode "
        "each; none: target and handoff only",
    )
    cli.add_accuracy_level(parser, help="of the target graphs (4: as shipped)")
    cli.add_threads(parser)
    parser.add_argument("--out-dir", type=Path, default=Path("docs"))
    cli.add_json_flag(parser)
    args = parser.parse_args(argv)

    if args.merge:
        study = merge([json.loads(path.read_text()) for path in args.merge])
    else:
        started = time.perf_counter()
        model = load_model(args.model)
        profile = TierProfile.load(profile_path(model))  # the defaults when the model has not been probed
        indices = sorted(set(args.only)) if args.only else list(range(args.prompts))
        study = run_study(
            model,
            indices,
            args.targets,
            args.tokens,
            study_modes(args.budgets, profile),
            args.accuracy_level,
            args.threads,
        )
        study["config"] = {
            "model": model.record.name,
            "tokens": args.tokens,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "window_tokens": WINDOW_TOKENS,
            "accuracy_level": args.accuracy_level,
            "budgets": args.budgets,
            "policy": WIRE_POLICY,
            "tier_profile": json.loads(profile.to_json()),
            "prompt_indices": indices,
            "threads": args.threads,
            "wall_seconds": round(time.perf_counter() - started, 1),
        }
    study.update(summary=aggregate(study["results"]), wire=wire_summary(study["prompts"]))
    cli.write_json(study, args.out_dir / "crossquant.json")
    paths = plot(study, args.out_dir, BASELINE)
    logger.info(
        "wrote %s and %s (study wall time %.0f s)",
        args.out_dir / "crossquant.json",
        ", ".join(map(str, paths)),
        study["config"]["wall_seconds"],
    )
    if args.json:
        cli.print_json(study)
    else:
        print(markdown_table(study["summary"], len(study["prompts"]), study["wire"]))


if __name__ == "__main__":
    cli.run(main)
