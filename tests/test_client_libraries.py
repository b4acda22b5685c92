"""The client libraries people point at OpenAI-style servers, against a real daemon on 127.0.0.1
pulling its KV from a real prefill server (docs/clients.md): LangChain's ``ChatOpenAI``, LiteLLM
(``completion`` and ``acompletion``) and Simon Willison's ``llm`` command line, each streamed and
whole. Each must get the greedy answer the official ``openai`` client gets, and nothing may reach
beyond 127.0.0.1 (``loopback_only``: a lookup of any other host fails the test at once, and is
recorded even where a library swallows the error).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback_only import REFUSED, LoopbackOnly, sitecustomize_dir
from openai import OpenAI
from serving_helpers import metric_samples, pulling_daemon

TOKEN = "clients-secret"
MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
MESSAGES = [{"role": "user", "content": QUESTION}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def daemon(prefill_server, tmp_path_factory):
    server = pulling_daemon(tmp_path_factory.mktemp("clients"), prefill_server.url, TOKEN)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base_url(daemon) -> str:
    return daemon.url + "/v1"


@pytest.fixture(scope="module")
def greedy_answer(base_url) -> str:
    """What the official openai client gets for MESSAGES: the answer every library must get too."""
    client = OpenAI(base_url=base_url, api_key=TOKEN, timeout=120, max_retries=0)
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    answer = completion.choices[0].message.content
    assert answer and "Paris" in answer, answer
    return answer


@pytest.fixture(scope="module")
def offline() -> Iterator[LoopbackOnly]:
    """Lookups of hosts beyond loopback refused and recorded for the module (the servers are up by then)."""
    guard = LoopbackOnly()
    yield guard
    guard.restore()


@pytest.fixture
def served(daemon, offline) -> Iterator[None]:
    """Around a test: it reached nothing beyond 127.0.0.1, and the daemon refused none of its requests
    (a library that retries with other fields after a 400 would otherwise pass) and fell back to local
    prefill for none (its KV came from the prefill server)."""
    before, looked_up = _counts(daemon), len(offline.refused)
    yield
    refused = offline.refused[looked_up:]
    assert refused == [], f"a client library looked up hosts beyond 127.0.0.1: {refused}"
    after = _counts(daemon)
    assert after["refused"] == before["refused"], "the daemon refused a request of this test (see its log)"
    assert after["fallbacks"] == before["fallbacks"]
    assert after["served"] > before["served"]


def _counts(daemon) -> dict[str, float]:
    samples = metric_samples(daemon.url, TOKEN)
    requests = {k: v for k, v in samples.items() if k.startswith("edgedecode_requests_total{")}
    return {
        "served": sum(v for k, v in requests.items() if "status=200" in k),
        "refused": sum(v for k, v in requests.items() if "status=200" not in k),
        "fallbacks": sum(v for k, v in samples.items() if k.startswith("edgedecode_prefill_fallbacks_total{")),
    }


def test_the_guard_refuses_every_host_beyond_loopback_and_sees_litellm_phone_home(tmp_path):
    """The guard is no placebo: in process it refuses and records a lookup of any other host, and in a
    subprocess it catches litellm fetching its model-cost map from GitHub at import when
    LITELLM_LOCAL_MODEL_COST_MAP is not set (litellm then falls back to its bundled copy silently)."""
    guard = LoopbackOnly()
    try:
        with pytest.raises(OSError, match=r"example\.org"):
            socket.getaddrinfo("example.org", 443)
        assert socket.getaddrinfo("localhost", 80) and socket.getaddrinfo("127.0.0.1", 80)
    finally:
        guard.restore()
    assert guard.refused == ["example.org"]
    env = {  # no proxy either: the lookup to see is GitHub's, not a proxy's
        key: value
        for key, value in os.environ.items()
        if key != "LITELLM_LOCAL_MODEL_COST_MAP" and not key.lower().endswith("_proxy")
    }
    env["PYTHONPATH"] = str(sitecustomize_dir(tmp_path))
    imported = subprocess.run(
        [sys.executable, "-c", "import litellm"], capture_output=True, text=True, env=env, timeout=120
    )
    assert imported.returncode == 0, imported.stderr
    assert f"{REFUSED} 'raw.githubusercontent.com'" in imported.stderr


# --- LangChain ----------------------------------------------------------------------------------


def test_langchain_chatopenai_invokes_and_streams(base_url, greedy_answer, served, monkeypatch):
    for tracing in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2"):  # a developer's LangSmith tracing would phone home
        monkeypatch.delenv(tracing, raising=False)
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=base_url,
        api_key=TOKEN,
        model=MODEL,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=120,
        stream_usage=True,  # stream_options.include_usage: the counts arrive in a last chunk of their own
    )
    whole = chat.invoke(QUESTION)
    assert whole.content == greedy_answer
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] > 0
    chunks = list(chat.stream(QUESTION))
    assert sum(1 for chunk in chunks if chunk.content) > 1  # streamed, not one answer in one chunk
    streamed = sum(chunks[1:], chunks[0])  # LangChain's own merge of the chunks
    assert streamed.content == greedy_answer
    assert streamed.usage_metadata
    counts = ("input_tokens", "output_tokens", "total_tokens")
    assert [streamed.usage_metadata[k] for k in counts] == [whole.usage_metadata[k] for k in counts]


# --- LiteLLM ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm(offline):
    """litellm imported under the guard, with its model-cost map read from the package (by default
    it fetches the map from GitHub at import)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        assert offline.refused == [], f"importing litellm looked up {offline.refused}"
        litellm.suppress_debug_info = True
        yield litellm


def _litellm_args(base_url: str, **extra) -> dict:
    return {
        "model": f"openai/{MODEL}",  # the openai/ prefix: any OpenAI-compatible server at api_base
        "api_base": base_url,
        "api_key": TOKEN,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "timeout": 120,
        "num_retries": 0,
        **extra,
    }


def test_litellm_completion_whole_and_streamed(litellm, base_url, greedy_answer, served):
    whole = litellm.completion(**_litellm_args(base_url))
    assert whole.choices[0].message.content == greedy_answer
    assert whole.usage.completion_tokens > 0
    stream = litellm.completion(**_litellm_args(base_url, stream=True, stream_options={"include_usage": True}))
    chunks = list(stream)
    pieces = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert sum(1 for piece in pieces if piece) > 1
    assert "".join(pieces) == greedy_answer
    usage = [chunk.usage for chunk in chunks if getattr(chunk, "usage", None)]
    assert usage and usage[-1].completion_tokens == whole.usage.completion_tokens


def test_litellm_acompletion_whole_and_streamed(litellm, base_url, greedy_answer, served):
    async def both() -> tuple[str, str]:
        whole = await litellm.acompletion(**_litellm_args(base_url))
        stream = await litellm.acompletion(**_litellm_args(base_url, stream=True))
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
        return whole.choices[0].message.content, "".join(pieces)

    whole, streamed = asyncio.run(both())
    assert whole == greedy_answer
    assert streamed == greedy_answer


# --- the llm command line -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_env(base_url, tmp_path_factory) -> dict[str, str]:
    """The environment of an ``llm`` subprocess: its own LLM_USER_PATH holding the daemon as an
    OpenAI-compatible model in extra-openai-models.yaml, and the loopback guard (sitecustomize)."""
    user_path = tmp_path_factory.mktemp("llm-user")
    (user_path / "extra-openai-models.yaml").write_text(
        f"- model_id: edgedecode\n  model_name: {MODEL}\n  api_base: {base_url}\n  api_key_name: edgedecode\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OPENAI_", "LLM_"))}
    guard = sitecustomize_dir(tmp_path_factory.mktemp("llm-guard"))
    env.update(LLM_USER_PATH=str(user_path), PYTHONPATH=str(guard))
    return env


def _llm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``llm ARGS``, the console script installed beside this Python; it must succeed and have looked up
    no host beyond 127.0.0.1."""
    command = [str(Path(sys.executable).parent / "llm"), *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, stdin=subprocess.DEVNULL)
    assert REFUSED not in result.stderr, result.stderr
    assert result.returncode == 0, f"{command} failed:\n{result.stderr}"
    return result


def test_llm_command_line_streamed_and_not(llm_env, greedy_answer, served):
    _llm(llm_env, "keys", "set", "edgedecode", "--value", TOKEN)  # the key that api_key_name names
    shown = {**llm_env, "LLM_OPENAI_SHOW_RESPONSES": "1"}  # llm echoes each HTTP exchange to stderr
    options = ["-o", "temperature", "0", "-o", "max_tokens", str(MAX_TOKENS)]
    streamed = _llm(shown, "-m", "edgedecode", *options, QUESTION)
    whole = _llm(shown, "-m", "edgedecode", "--no-stream", *options, QUESTION)
    assert streamed.stdout == greedy_answer + "\n"
    assert whole.stdout == greedy_answer + "\n"
    assert "data: [DONE]" in streamed.stderr  # server-sent events
    assert "data: [DONE]" not in whole.stderr and '"stream": false' in whole.stderr
