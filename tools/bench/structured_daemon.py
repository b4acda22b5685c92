#!/usr/bin/env python3
"""Structured answers through a real daemon: the sweep of tools/bench/structured.py (its prompts and schemas)
asked of ``edgedecode serve`` on 127.0.0.1 through the official ``openai`` client, each answer twice — whole
and streamed (the deltas joined as the client would), with the same seed — under ``response_format``
``json_schema`` (strict). Every answer that ends by itself must parse and validate (jsonschema); the two forms
must be the same text; answers ``--max-tokens`` cuts (``finish_reason: "length"``) are counted apart. The daemon
pulls its KV from its embedded prefill server at ``--budget`` (so the answers decode over lossy KV, as the
product runs); where each whole answer's KV came from (the daemon's ``edgedecode.kv.source``) is tallied.

    python tools/bench/structured_daemon.py [--model NAME] [--answers 100] [--max-tokens 400] [--budget 0.3]
        [--threads 2] [--json F]
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import tempfile
import time
from collections import Counter
from typing import Any

from tools.bench.structured import SCHEMAS, print_failures, question, schema_error
from tools.common import cli
from tools.common.servers import running, toml_config


def ask(
    client: Any, model: str, question: str, name: str, seed: int, max_tokens: int, stream: bool
) -> tuple[str, str, str | None]:
    """One chat completion under SCHEMAS[name]: its text, finish_reason (a stream's deltas joined) and, whole,
    where its KV came from."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
        "temperature": 0.8,
        "seed": seed,
        "max_tokens": max_tokens,
    }
    if not stream:
        completion = client.chat.completions.create(**body)
        report = (completion.model_extra or {}).get("edgedecode") or {}
        choice = completion.choices[0]
        return choice.message.content or "", choice.finish_reason, report.get("kv", {}).get("source")
    parts, finish = [], ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, None


def verdict(text: str, finish: str, name: str) -> str:
    """``valid``, ``cut`` (max_tokens ended it) or ``invalid: <why>``."""
    if finish == "length":
        return "cut"
    error = schema_error(text, name)
    return "valid" if error is None else f"invalid: {error[:200]}"


def sweep(url: str, answers: int, max_tokens: int) -> dict[str, Any]:
    """``answers`` questions over PROMPTS x SCHEMAS, each asked whole and streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    model = client.models.list().data[0].id
    sources: Counter[str] = Counter()
    verdicts: dict[str, Counter[str]] = {"whole": Counter(), "streamed": Counter()}
    failures: list[dict[str, Any]] = []
    differ = 0
    for i in range(answers):
        name, asked = question(i)
        texts = {}
        for form in ("whole", "streamed"):
            text, finish, source = ask(client, model, asked, name, i, max_tokens, form == "streamed")
            if form == "whole":
                sources[str(source)] += 1
            said = verdict(text, finish, name)
            verdicts[form]["invalid" if said.startswith("invalid") else said] += 1
            if said.startswith("invalid"):
                failures.append({"answer": i, "form": form, "schema": name, "text": text, "error": said})
            texts[form] = text
        differ += texts["whole"] != texts["streamed"]
    return {
        "model": model,
        "answers": answers,
        "kv_sources": dict(sources),
        "whole": dict(verdicts["whole"]),
        "streamed": dict(verdicts["streamed"]),
        "whole_and_streamed_differ": differ,
        "failures": failures[:5],
    }


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    cli.add_model(p)
    p.add_argument("--answers", type=int, default=100, help="questions, each asked whole and streamed")
    p.add_argument("--max-tokens", type=int, default=400, help="max_tokens of each answer")
    p.add_argument("--budget", type=float, default=0.3, help="the daemon's KV budget b (its pulls' wire size)")
    cli.add_threads(p)
    cli.add_json_file(p)
    args = p.parse_args(argv)
    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        directory = Path(workdir)
        config = toml_config(
            directory / "daemon.toml",
            {
                "model": {"threads": args.threads} | ({"name": args.model} if args.model else {}),
                "daemon": {"port": 0, "budget": args.budget, "max_context": 2048},
            },
        )
        with running(["serve", "--config", str(config)], directory / "daemon.log") as (_, url):
            result = sweep(url, args.answers, args.max_tokens)
    report = {**cli.record(__file__, argv, started), "settings": cli.settings(args, leave_out=("json",)), **result}
    print(f"{report['model']}: {args.answers} answers through the daemon (b {args.budget}), whole and streamed:")
    for form in ("whole", "streamed"):
        print(f"  {form:>8}: {report[form]}")
    print(f"  whole and streamed differ: {report['whole_and_streamed_differ']}; KV sources: {report['kv_sources']}")
    print_failures(report["failures"], "answer {answer} {form} {schema}", 100)
    if args.json is not None:
        cli.write_json(report, args.json)
    return 0


if __name__ == "__main__":
    cli.run(main)
