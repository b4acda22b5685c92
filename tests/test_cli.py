"""The `edgedecode` command line on the real model."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from edgedecode.cli import app
from edgedecode.runtime.sampler import SamplingParams

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


def test_generate_json_reports_ids_text_and_timings(model, decoder):
    result = invoke("generate", "The capital of France is", "--max-tokens", "12", "--json", "--threads", "2")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prompt_token_ids"] == model.tokenizer.encode("The capital of France is")
    expected = list(decoder.generate(report["prompt_token_ids"], SamplingParams(max_tokens=12)))
    assert report["token_ids"] == expected
    assert report["text"] == model.tokenizer.decode(expected)
    timings = report["timings"]
    assert timings["prefill_seconds"] > 0 and timings["decode_seconds"] > 0 and timings["decode_tokens_per_second"] > 0


def test_generate_streams_the_same_text(model):
    streamed = invoke("generate", "Once upon a time", "-n", "16", "--threads", "2")
    as_json = json.loads(invoke("generate", "Once upon a time", "-n", "16", "--threads", "2", "--json").stdout)
    assert streamed.exit_code == 0
    assert streamed.stdout == as_json["text"] + "\n"
    assert "generated 16 tokens" in streamed.stderr and "0 from the prefill graph's KV" in streamed.stderr


def test_chat_handoff_injects_the_prefill_graphs_kv(model):
    result = invoke("generate", "Name a river in Paris.", "--chat", "--handoff", "-n", "8", "--json", "--threads", "2")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prompt_token_ids"][0] == model.tokenizer.encode("<|im_start|>")[0]
    assert report["timings"]["injected_tokens"] == len(report["prompt_token_ids"]) - 1
    assert report["timings"]["handoff_prefill_seconds"] > 0
    assert report["token_ids"]
    transfer = report["kv_transfer"]
    assert transfer["tiers"]["FP16"] == len(report["prompt_token_ids"]) and transfer["b_wire"] <= 1.0


def test_handoff_at_a_budget_sends_fewer_bytes_in_lower_tiers(model):
    result = invoke(
        "generate", "Name a river in Paris.", "--chat", "--handoff", "--budget", "0.3", "-n", "4", "--threads", "2"
    )
    assert result.exit_code == 0, result.output
    assert "KV over EDKV" in result.stderr and "INT4" in result.stderr
    b_wire = float(result.stderr.split("b_wire ")[1].split()[0])
    assert 0.25 < b_wire <= 0.3


def test_probe_saves_a_verdict_the_allocator_reads(model):
    from edgedecode.kv.policy import TierProfile, profile_path
    from edgedecode.kv.tiers import Tier

    path = profile_path(model)
    try:
        result = invoke(
            "probe",
            "--contexts",
            "2",
            "--context-tokens",
            "160",
            "--continuation",
            "24",
            "--niah-trials",
            "5",
            "--niah-tokens",
            "150",
            "--threads",
            "2",
        )
        assert result.exit_code == 0, result.output
        profile = TierProfile.load(path)
        assert profile.source.startswith("edgedecode probe")
        assert Tier.FP16 in profile.allowed and Tier.DROP in profile.allowed
        d = profile.distortion
        assert 0 <= d[Tier.INT8] < d[Tier.INT4] < d[Tier.INT2]  # measured, and ordered by precision
        measured = profile.value_range  # each layer's |K| and |V| range, which the daemon's reader checks against
        assert measured is not None and len(measured.abs_max) == model.spec.n_layers
        assert all(0 < k < 1e3 and 0 < v < 1e3 for k, v in measured.abs_max)
        assert "INT2" in result.stdout and "saved" in result.stdout
    finally:
        path.unlink(missing_ok=True)


def test_prompt_from_stdin_with_a_system_message(model):
    result = runner.invoke(
        app,
        ["generate", "-", "--chat", "--system", "Answer in French.", "-n", "4", "--json", "--max-context", "256"],
        input="Hello there",
    )
    assert result.exit_code == 0, result.output
    expected = model.tokenizer.encode_chat(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello there"}]
    )
    assert json.loads(result.stdout)["prompt_token_ids"] == expected


def test_prompt_beyond_max_context_is_a_clear_error(model):
    result = invoke("generate", "word " * 300, "--max-context", "128")
    assert result.exit_code == 2
    assert "the context holds 128" in result.stderr


def test_info_prints_spec_files_and_providers(model):
    report = json.loads(invoke("info").stdout)
    assert report["spec"]["n_layers"] == 30 and report["spec"]["n_kv_heads"] == 3
    assert report["model"]["sha256"] == model.record.sha256
    assert "cpu" in report["onnxruntime"]["devices"]
    assert report["onnxruntime"]["distributions"] == ["onnxruntime"]
    assert report["kv_bytes_per_token_fp16"] == 23040
    assert "smollm2-135m-instruct" in report["local_models"]


def test_build_reports_the_cached_graph(model):
    result = invoke("build", "--kind", "decode")
    assert result.exit_code == 0
    assert "decode:" in result.stdout and ".onnx" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
        (["build", "--kind", "sideways"], "graph kind must be one of"),
    ],
)
def test_bad_input_is_a_clear_error_with_exit_code_2(model, args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.stderr


def test_registering_a_non_gguf_file_fails_clearly(tmp_path, model):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    result = invoke("fetch-model", "bogus", "--gguf", str(bogus))
    assert result.exit_code == 2
    assert "not a GGUF file" in result.stderr


def test_registering_a_local_gguf_under_a_given_name(model, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path))
    result = invoke("fetch-model", "my-edge-model", "--gguf", str(model.record.gguf_path))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("my-edge-model: ")
    assert json.loads(invoke("info", "--model", "my-edge-model").stdout)["model"]["source"].startswith("local:")
