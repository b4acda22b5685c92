#!/usr/bin/env python3
"""The per-token cost of constrained decoding (runtime/constraint.py), and a sweep of answers under JSON schemas.

Cost: the shipped decode engine generates ``--tokens`` greedy tokens of a chat prompt asking for JSON, once free
and once under a schema, alternating, ``--runs`` times (the free run never stops early: no stop tokens). Each
token's interval (yield to yield) is timed in both, and, under the schema, the constraint's own work per token
(computing the mask, applying it to the logits row, taking the token) apart: the table gives their medians and
the constraint's share of an unconstrained step, measured in the same process, one after the other; in wall
time and in CPU time (the process's, onnxruntime's threads included, which a loaded machine disturbs less; the
constraint's CPU time there counts onnxruntime's threads spinning after their last run too), and the
constraint's CPU time on its own thread.

Sweep (``--answers N``): N answers, sampled (temperature 0.8, a seed each) over varied prompts and schemas with
nested objects, arrays, enums and required fields (every string, number and array bounded: a small model can
run to max_tokens inside an unbounded string or number); each answer that ends by itself must parse and validate
(jsonschema), and the answers ``--max-tokens`` cut are counted apart.

    python tools/bench/structured.py [--model NAME] [--runs 5] [--tokens 64] [--threads 2] [--answers 100]
        [--max-tokens 200] [--json F]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import itertools
import json
import logging
import statistics
import time
from collections import Counter
from typing import Any

import numpy as np

from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import load_model
from edgedecode.runtime.constraint import GrammarCompiler, TokenMask, json_schema_grammar
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams
from tools.common import cli

logger = logging.getLogger(__name__)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "hobbies"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "status": {"enum": ["open", "paid", "shipped"]},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            },
        },
        "required": ["id", "status", "lines"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
            "recommended": {"type": "boolean"},
        },
        "required": ["title", "stars", "pros", "recommended"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "when": {
                "type": "object",
                "properties": {
                    "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    "month": {"type": "integer", "minimum": 1, "maximum": 12},
                },
                "additionalProperties": False,
            },
            "kind": {"enum": ["concert", "talk", "match"]},
            "tags": {"type": "array", "items": {"enum": ["free", "outdoor", "family"]}, "maxItems": 3},
        },
        "required": ["name", "when", "kind"],
        "additionalProperties": False,
    },
}
PROMPTS = [
    "Answer in JSON: {what}.",
    "Make up {what}, as a JSON object.",
    "Write {what} in JSON, nothing else.",
    "I need {what} for a test fixture. JSON please.",
    "Invent {what}. Reply with JSON.",
]
WHAT = {"person": "a person", "order": "a shop order", "review": "a product review", "event": "an event"}


def question(i: int) -> tuple[str, str]:
    """The schema's name and the question of the sweep's ``i``-th answer: SCHEMAS in turn, then the next of PROMPTS."""
    names = sorted(SCHEMAS)
    name = names[i % len(names)]
    return name, PROMPTS[(i // len(names)) % len(PROMPTS)].format(what=WHAT[name])


def schema_error(text: str, name: str) -> str | None:
    """Why ``text`` is no answer under SCHEMAS[name] (not JSON, or not valid: jsonschema's words), or None."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
        return str(exc)
    return None


def print_failures(failures: list[dict[str, Any]], label: str, width: int) -> None:
    """One line a failed answer: ``label`` formatted with its fields, then its error's first ``width`` characters."""
    for failure in failures:
        print(f"    {label.format(**failure)}: {failure['error'][:width]!r}")


def clocks() -> np.ndarray:
    """Wall time, this process's CPU time (every thread's: onnxruntime's too) and this thread's, in seconds."""
    return np.array([time.perf_counter(), time.process_time(), time.thread_time()])


class TimedMask:
    """A ``TokenMask`` whose work per token (``apply`` + ``accept``) is timed, wall and CPU."""

    def __init__(self, mask: TokenMask) -> None:
        self._mask = mask
        self.seconds: list[np.ndarray] = []
        self._pending = np.zeros(3)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        started = clocks()
        row = self._mask.apply(logits)
        self._pending = clocks() - started
        return row

    def accept(self, token: int) -> None:
        started = clocks()
        self._mask.accept(token)
        self.seconds.append(self._pending + clocks() - started)

    @property
    def finished(self) -> bool:
        return self._mask.finished


def intervals(engine: Engine, prompt: list[int], params: SamplingParams, constraint: Any = None) -> list[np.ndarray]:
    """Wall and CPU seconds between consecutive tokens of one generation (the first token's prefill left out)."""
    stamps = [clocks() for _ in engine.generate(prompt, params, constraint=constraint)]
    return [b - a for a, b in itertools.pairwise(stamps)]


def cost(engine: Engine, compiler: GrammarCompiler, prompt: list[int], runs: int, tokens: int) -> dict[str, Any]:
    """Median per-token intervals, free and under ``PERSON``, and the constraint's own median per token."""
    grammar = compiler.compile(json_schema_grammar(PERSON))
    free_params = SamplingParams(max_tokens=tokens, stop_token_ids=())
    bound_params = SamplingParams(max_tokens=tokens)
    free: list[np.ndarray] = []
    bound: list[np.ndarray] = []
    mask_seconds: list[np.ndarray] = []
    intervals(engine, prompt, free_params)  # warm-up
    for run in range(runs):
        free += intervals(engine, prompt, free_params)
        timed = TimedMask(grammar.start())
        bound += intervals(engine, prompt, bound_params, timed)
        mask_seconds += timed.seconds
        logger.info("run %d: %d free intervals, %d constrained", run + 1, len(free), len(bound))
    report: dict[str, Any] = {
        "samples": {"free": len(free), "constrained": len(bound), "constraint": len(mask_seconds)}
    }
    for column, clock in ((0, "wall"), (1, "cpu")):
        step, constrained, mask = (
            statistics.median(float(x[column]) for x in xs) for xs in (free, bound, mask_seconds)
        )
        report[clock] = {
            "unconstrained_step_ms": step * 1e3,
            "constrained_step_ms": constrained * 1e3,
            "constraint_per_token_us": mask * 1e6,
            "constraint_over_step": mask / step,
            "constrained_over_unconstrained": constrained / step,
        }
    own = statistics.median(float(x[2]) for x in mask_seconds)
    report["constraint_thread_cpu_us"] = own * 1e6
    report["constraint_thread_cpu_over_cpu_step"] = own / report["cpu"]["unconstrained_step_ms"] * 1e3
    return report


def sweep(engine: Engine, compiler: GrammarCompiler, model: Any, answers: int, max_tokens: int) -> dict[str, Any]:
    """``answers`` sampled answers over PROMPTS x SCHEMAS: how each ended, and whether it parsed and validated."""
    ended: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []  # answers that ended by themselves and do not validate: none may
    cut = 0
    examples: list[dict[str, Any]] = []  # answers max_tokens cut
    for i in range(answers):
        name, asked = question(i)
        prompt = model.tokenizer.encode_chat([{"role": "user", "content": asked}])
        grammar = compiler.compile(json_schema_grammar(SCHEMAS[name]))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i)
        text = model.tokenizer.decode(list(engine.generate(prompt, params, constraint=grammar.start())))
        ended[engine.stats.finish_reason] += 1
        if engine.stats.finish_reason == "length":
            cut += 1
            examples.append({"schema": name, "text": text})
            continue
        error = schema_error(text, name)
        if error is not None:
            failures.append({"schema": name, "finish_reason": engine.stats.finish_reason, "text": text, "error": error})
    return {
        "answers": answers,
        "finish_reasons": dict(ended),
        "valid": answers - cut - len(failures),
        "cut_by_max_tokens": cut,
        "invalid": len(failures),
        "failures": failures[:5],
        "cut": examples[:5],
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    cli.add_model(p)
    cli.add_runs(p, 5, "alternating free and constrained generations")
    p.add_argument("--tokens", type=int, default=64, help="tokens per generation in the cost runs")
    cli.add_threads(p)
    p.add_argument("--answers", type=int, default=0, help="answers in the sweep (0: no sweep)")
    p.add_argument("--max-tokens", type=int, default=200, help="max_tokens of each sweep answer")
    cli.add_json_file(p)
    args = p.parse_args(argv)
    started = time.time()
    model = load_model(args.model)
    engine = Engine(model, GraphOptions.for_device("decode", "cpu"), max_context=1024, threads=args.threads)
    spec = model.spec
    compiler = GrammarCompiler(model.tokenizer, spec.vocab_size, spec.stop_token_ids)
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "Describe a person as JSON."}])
    report: dict[str, Any] = {
        **cli.record(__file__, argv, started),
        "model": model.record.name,
        "settings": cli.settings(args, leave_out=("json",)),
        "cost": cost(engine, compiler, prompt, args.runs, args.tokens),
    }
    print(f"{model.record.name}, {args.threads} threads, {args.tokens} greedy tokens x {args.runs} runs (medians):")
    for clock in ("wall", "cpu"):
        c = report["cost"][clock]
        print(f"  {clock:>4}: unconstrained step {c['unconstrained_step_ms']:8.2f} ms, constrained step ", end="")
        print(
            f"{c['constrained_step_ms']:8.2f} ms ({c['constrained_over_unconstrained']:.3f}x), constraint per ", end=""
        )
        print(f"token {c['constraint_per_token_us']:7.1f} us ({100 * c['constraint_over_step']:.2f} % of a step)")
    own, share = report["cost"]["constraint_thread_cpu_us"], report["cost"]["constraint_thread_cpu_over_cpu_step"]
    print(f"  the constraint's CPU on its own thread: {own:.1f} us a token ({100 * share:.2f} % of a step's CPU)")
    if args.answers:
        report["sweep"] = sweep(engine, compiler, model, args.answers, args.max_tokens)
        s = report["sweep"]
        print(
            f"  sweep: {s['answers']} answers: {s['valid']} valid, {s['cut_by_max_tokens']} cut by max_tokens, ", end=""
        )
        print(f"{s['invalid']} invalid (ended {s['finish_reasons']})")
        print_failures(s["failures"], "{schema} ({finish_reason})", 80)
    if args.json is not None:
        cli.write_json(report, args.json)
    return 0


if __name__ == "__main__":
    cli.run(main)
