#!/usr/bin/env python3
"""Cross-quant handoff study: does KV from the higher-precision prefill keep a lower-bit decoder closer to it?

For every prompt the reference (the fp32 prefill graph over the GGUF's dequantized weights) samples
N tokens (seeded, temperature 0.7, top-p 0.95, end-of-turn ignored so every run has N tokens).
Every target decode graph (the same weights, re-quantized: GraphOptions.weights) then replays
those tokens teacher-forced in each mode:

* ``target``: from its own prefill of the prompt;
* ``handoff``: from the reference's prefill KV injected into it (the PD path).

Per token: KL(ref || mode) and top-1 agreement; per prompt: mean, p50 and p99 of the KL; and the
decay of both over 64-token windows by distance from the prompt. Writes box plots, decay curves
and the raw results (``crossquant.json``) to --out-dir and prints a markdown table (or the JSON).

    python tools/crossquant.py [--tokens 512] [--prompts 12] [--targets native q4b64 ...] [--json] [--out-dir docs]

Plots need matplotlib: pip install -e '.[bench]'.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np

from edgedecode.decode.engine import Engine
from edgedecode.decode.sampler import Sampler, SamplingParams
from edgedecode.evaluation.scoring import kl_per_token, log_softmax
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel, load_model
from edgedecode.model.tokenizer import Tokenizer

logger = logging.getLogger("crossquant")

WINDOW_TOKENS = 64
TEMPERATURE, TOP_P = 0.7, 0.95
DEFAULT_TARGETS = ("native", "q4b16", "q4b64", "q4b128", "q2b32")
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
    PromptSpec("chat-short-story", "chat", "short",
               "Write a short story about a lighthouse keeper who befriends a seagull."),
    PromptSpec("prose-medium-attribute-access", "prose", "medium", "attribute-access"),
    PromptSpec("chat-long-compound", "chat", "long", "compound"),
    PromptSpec("prose-short-for", "prose", "short", "for"),
    PromptSpec("chat-medium-typesmapping", "chat", "medium", "typesmapping"),
    PromptSpec("prose-long-specialnames", "prose", "long", "specialnames"),
    PromptSpec("chat-short-list-tuple", "chat", "short",
               "What are the main differences between a list and a tuple in Python? Answer with examples."),
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
    excerpt = tokenizer.decode(tokenizer.encode(topics[spec.source], add_bos=False)[:EXCERPT_TOKENS[spec.size]])
    if spec.kind == "prose":
        return np.asarray(tokenizer.encode(excerpt), np.int64)
    question = (f"Here is an excerpt from the Python documentation:\n\n{excerpt}\n\n"
                "Explain what it says in plain words, with an example.")
    return np.asarray(tokenizer.encode_chat([{"role": "user", "content": question}]), np.int64)


@dataclass
class Reference:
    """The reference run of one prompt: sampled tokens, their distributions and the prompt's KV."""

    tokens: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n, vocab]: row i is the distribution token i was sampled from
    kv: KVSnapshot  # the reference's KV of the whole prompt


# A mode: what KV the target starts from, given the reference run; None = the target prefills the
# prompt itself. Part 3 ("through the wire") adds one mode per EDKV budget here: the reference's KV
# encoded and decoded (edgedecode.evaluation.transfer.through_wire, which also wants the tokens'
# attention importance, so Reference then carries the prefill's scores as well).
Transport = Callable[[Reference], KVSnapshot]


def direct(ref: Reference) -> KVSnapshot:
    """The in-process handoff: the reference's prompt KV, unchanged."""
    return ref.kv


BASELINE = "target"  # every other mode is compared with it
MODES: dict[str, Transport | None] = {BASELINE: None, "handoff": direct}


def reference_run(engine: Engine, prompt: np.ndarray, n_tokens: int, seed: int) -> Reference:
    """Prefill the prompt with the reference graph and sample n_tokens, keeping every distribution."""
    logits = engine.prefill(prompt)
    kv = engine.export_kv()
    sampler = Sampler(SamplingParams(max_tokens=n_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=seed))
    tokens = np.empty(n_tokens, np.int64)
    logprobs = np.empty((n_tokens, engine.spec.vocab_size), np.float32)
    for i in range(n_tokens):
        logprobs[i] = log_softmax(logits)
        tokens[i] = sampler.pick(logits)
        if i + 1 < n_tokens:
            logits = engine.forward(tokens[i:i + 1])
    return Reference(tokens, logprobs, kv)


def replay(engine: Engine, prompt: np.ndarray, tokens: np.ndarray, kv: KVSnapshot | None) -> np.ndarray:
    """Teacher-forced logits [n, vocab] of the target for the reference's tokens (prompt KV injected if given)."""
    first = engine.prefill(prompt, kv=kv).copy()
    return np.concatenate([first[None], engine.forward(tokens[:-1], all_logits=True)])


def token_metrics(ref_logprobs: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KL(ref || target) in nats and whether the two top-1 tokens agree."""
    kl = np.concatenate([kl_per_token(ref_logprobs[start:start + KL_CHUNK_ROWS],
                                      log_softmax(logits[start:start + KL_CHUNK_ROWS]))
                         for start in range(0, len(logits), KL_CHUNK_ROWS)])
    return kl, ref_logprobs.argmax(-1) == logits.argmax(-1)


def windows(values: np.ndarray) -> list[float]:
    """Means over consecutive WINDOW_TOKENS-token windows (full windows only)."""
    n = len(values) // WINDOW_TOKENS * WINDOW_TOKENS
    return values[:n].reshape(-1, WINDOW_TOKENS).mean(-1).tolist()


def summarize(kl: np.ndarray, top1: np.ndarray) -> dict:
    """One prompt's numbers for one target and mode."""
    p50, p99 = np.percentile(kl, [50, 99])
    return {"mean_kl": float(kl.mean()), "p50_kl": float(p50), "p99_kl": float(p99), "top1": float(top1.mean()),
            "window_kl": windows(kl), "window_top1": windows(top1.astype(np.float64))}


def run_study(model: LoadedModel, prompts: list[PromptSpec], targets: list[str], n_tokens: int,
              modes: dict[str, Transport | None], accuracy_level: int, threads: int) -> dict:
    """Every prompt through the reference, then every target in every mode; returns the results tree."""
    ids = [prompt_ids(p, model.tokenizer) for p in prompts]
    context = max(len(i) for i in ids) + n_tokens + 1
    ref_engine = Engine(model, GraphOptions("prefill", "float32", 0), max_context=context, threads=threads)
    engines = {t: Engine(model, GraphOptions("decode", "float32", accuracy_level, weights=t),
                         max_context=context, threads=threads) for t in targets}
    results: dict[str, dict[str, list[dict]]] = {t: {m: [] for m in modes} for t in targets}
    for seed, (spec, prompt) in enumerate(zip(prompts, ids)):
        started = time.perf_counter()
        ref = reference_run(ref_engine, prompt, n_tokens, seed)
        for target, engine in engines.items():
            for mode, transport in modes.items():
                kv = None if transport is None else transport(ref)
                kl, top1 = token_metrics(ref.logprobs, replay(engine, prompt, ref.tokens, kv))
                results[target][mode].append(summarize(kl, top1))
        logger.info("%s (%d prompt tokens) done in %.0f s; mean KL %s", spec.name, len(prompt),
                    time.perf_counter() - started,
                    "; ".join(f"{t} " + " ".join(f"{m} {r[-1]['mean_kl']:.4f}" for m, r in per_mode.items())
                              for t, per_mode in results.items()))
    return {"prompts": [{"name": p.name, "kind": p.kind, "size": p.size, "prompt_tokens": len(i)}
                        for p, i in zip(prompts, ids)],
            "results": results}


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
                row["median_prompt_change"] = float(np.median([p["mean_kl"] / b["mean_kl"] - 1
                                                               for b, p in zip(base, per_prompt)]))
                row["prompts_improved"] = sum(p["mean_kl"] < b["mean_kl"] for b, p in zip(base, per_prompt))
                row["window_change"] = (np.divide(row["window_kl"], rows[BASELINE]["window_kl"]) - 1).tolist()
            rows[mode] = row
        summary[target] = rows
    return summary


def markdown_table(summary: dict, n_prompts: int) -> str:
    """The table of docs/crossquant.md: one row per target and mode, means over prompts."""
    lines = [("| target | mode | mean KL | Δ vs target | median Δ per prompt | prompts better | p50 KL | p99 KL "
              "| top-1 % | Δ first / last window |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for target, rows in summary.items():
        for mode, r in rows.items():
            change = ("| | | |" if mode == BASELINE else
                      f"| {r['mean_kl_change']:+.1%} | {r['median_prompt_change']:+.1%} | "
                      f"{r['prompts_improved']}/{n_prompts} |")
            windows_change = ("" if mode == BASELINE else
                              f"{r['window_change'][0]:+.0%} / {r['window_change'][-1]:+.0%}")
            lines.append(f"| {target} | {mode} | {r['mean_kl']:.4f} {change} {r['p50_kl']:.4f} | {r['p99_kl']:.3f} "
                         f"| {100 * r['top1']:.1f} | {windows_change} |")
    return "\n".join(lines)


def plot(study: dict, summary: dict, out_dir: Path) -> list[Path]:
    """Box plots of per-prompt mean and p99 KL per target and mode, and decay curves; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(summary)
    modes = list(study["results"][targets[0]])
    colors = dict(zip(modes, ["tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown"]))
    markers = {"short": "o", "medium": "s", "long": "D"}
    sizes = [p["size"] for p in study["prompts"]]
    width = 0.8 / len(modes)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key in zip(axes, ("mean_kl", "p99_kl")):
        for i, mode in enumerate(modes):
            data = [[p[key] for p in study["results"][t][mode]] for t in targets]
            positions = np.arange(len(targets)) + (i - (len(modes) - 1) / 2) * width
            style = {"color": colors[mode]}
            ax.boxplot(data, positions=positions, widths=width * 0.8, showfliers=False, boxprops=style,
                       medianprops=style, whiskerprops=style, capprops=style)
            for x, values in zip(positions, data):
                for value, size in zip(values, sizes):
                    ax.scatter(x, value, marker=markers[size], s=14, facecolors="none", edgecolors=colors[mode])
        ax.set_xticks(range(len(targets)), targets)
        ax.set(yscale="log", ylabel="KL(ref || ·), nats", title=f"{key.split('_')[0]} KL per prompt")
    handles = [plt.Line2D([], [], color=c, label=m) for m, c in colors.items()]
    handles += [plt.Line2D([], [], marker=m, linestyle="", color="gray", markerfacecolor="none", label=s)
                for s, m in markers.items()]
    axes[1].legend(handles=handles, fontsize=8)
    fig.suptitle(f"Cross-quant, {len(sizes)} prompts: {BASELINE} = own prefill, handoff = fp32 prefill KV")
    fig.tight_layout()
    box_path = out_dir / "crossquant_kl.png"
    fig.savefig(box_path, dpi=110)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = dict(zip(modes, ["--", "-", ":", "-.", (0, (5, 1)), (0, (1, 3))]))
    for target, rows in summary.items():
        color = None
        for mode, row in rows.items():
            starts = np.arange(len(row["window_kl"])) * WINDOW_TOKENS
            line, = left.plot(starts, row["window_kl"], linestyle=styles[mode], color=color,
                              label=f"{target} {mode}")
            color = line.get_color()
            if mode != BASELINE:
                right.plot(starts, 100 * np.asarray(row["window_change"]), linestyle=styles[mode], color=color,
                           marker="o", label=f"{target} {mode}")
    left.set(yscale="log", xlabel="generated tokens (window start)", ylabel="mean KL over prompts, nats",
             title="KL by distance from the prompt")
    right.axhline(0, color="gray", linewidth=0.8)
    right.set(xlabel="generated tokens (window start)", ylabel=f"% KL change vs {BASELINE}",
              title=f"Change in KL per {WINDOW_TOKENS}-token window")
    left.legend(fontsize=7, ncol=2)
    right.legend(fontsize=7)
    fig.tight_layout()
    decay_path = out_dir / "crossquant_decay.png"
    fig.savefig(decay_path, dpi=110)
    plt.close(fig)
    return [box_path, decay_path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=512, help="tokens the reference generates per prompt")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                        metavar=f"1..{len(PROMPTS)}")
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS),
                        help="decode-graph weight formats: native or q<bits>b<block_size>")
    parser.add_argument("--accuracy-level", type=int, default=4, help="of the target graphs (4: as shipped)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("docs"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    started = time.perf_counter()
    model = load_model(args.model)
    study = run_study(model, list(PROMPTS[:args.prompts]), args.targets, args.tokens, MODES,
                      args.accuracy_level, args.threads)
    summary = aggregate(study["results"])
    study.update(config={"model": model.record.name, "tokens": args.tokens, "temperature": TEMPERATURE,
                         "top_p": TOP_P, "window_tokens": WINDOW_TOKENS, "accuracy_level": args.accuracy_level,
                         "threads": args.threads, "wall_seconds": round(time.perf_counter() - started, 1)},
                 summary=summary)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "crossquant.json").write_text(json.dumps(study, indent=1))
    paths = plot(study, summary, args.out_dir)
    logger.info("wrote %s and %s in %.0f s", args.out_dir / "crossquant.json", ", ".join(map(str, paths)),
                study["config"]["wall_seconds"])
    print(json.dumps(study, indent=1) if args.json else markdown_table(summary, args.prompts))


if __name__ == "__main__":
    main()
