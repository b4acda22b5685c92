"""Configuration of the servers: one TOML file, ``EDGEDECODE_<SECTION>_<KEY>`` environment overrides,
then command-line flags, validated once at start with errors that name the key and the source.

Sections: ``[model]`` (which model, on which device), ``[daemon]`` (``edgedecode serve``),
``[prefill]`` (``edgedecode prefill-server``) and ``[fleet]`` (its replicas on Ray Serve, ``--ray``).
Every key has a default, so an empty file (or none) is a valid configuration: loopback-only servers
with an embedded prefill endpoint.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.policy import POLICIES
from edgedecode.kv.wire.frames import MAX_TRANSFER_TTL_S
from edgedecode.tls import client_tls, server_tls

DEFAULT_CONFIG_PATH = Path("/etc/edgedecode/edgedecode.toml")
ENV_PREFIX = "EDGEDECODE_"


class ConfigError(EdgeDecodeError):
    """The configuration is unreadable or holds an invalid value."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model the servers run, and where."""

    name: str = "smollm2-135m-instruct"
    device: str = "cpu"  # cpu or cuda
    threads: int = 0  # onnxruntime intra-op threads; 0: one per physical core


@dataclass(frozen=True)
class DaemonConfig:
    """The edge decode daemon (``edgedecode serve``)."""

    host: str = "127.0.0.1"
    port: int = 8088
    auth_token: str = ""  # bearer token clients must send; required when host is not loopback
    previous_auth_token: str = ""  # also accepted while clients move to a new auth_token (rotation)
    tls_cert_file: str = ""  # PEM certificate (chain) to serve HTTPS with, with tls_key_file; empty: plain HTTP
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    prefill_url: str = ""  # empty: start an embedded prefill server on 127.0.0.1
    prefill_ca_file: str = ""  # PEM CA certificates that verify an https prefill_url; empty: the system's
    local_prefill_only: bool = False  # never ask a prefill server: prefill every prompt on this box
    prefill_token: str = ""  # bearer token sent to the prefill server
    slots: int = 2  # conversations whose KV stays resident at once
    # All KV on the box: the slots' buffers and the idle conversations kept compressed. SmolLM2-135M: 2 slots
    # of 4096 tokens hold 360 MiB (FP32); the other 152 MiB keep ~14k tokens at INT8 (11.5 KB a token).
    kv_memory_mb: int = 512
    max_sessions: int = 16  # conversations whose KV is kept between turns, in a slot or compressed (>= slots)
    max_context: int = 4096  # KV buffer length per slot, tokens
    max_queue: int = 32  # requests waiting for a slot; more are refused with 429
    # KV wire bytes / FP16 bytes asked of the prefill server while no TTFT target applies: pinned, every turn asks
    # it; 0 (not pinned): every turn is planned (the best quality within 1.1x or 0.1 s of the fastest way to the KV)
    budget: float = 0.0
    ttft_target_ms: float = 0.0  # time-to-first-token target the KV plan adapts to; 0: none (see budget)
    min_budget: float = 0.0  # quality floor of planned budgets; 0: the model's calibration's (docs/adaptive.md)
    local_dppl_pct: float = 0.0  # extra quality cost charged to prefilling here, above the calibration's measured one
    local_prefill_tokens_per_s: float = 0.0  # this box's prefill speed, pinned; 0: measured at start and as it serves
    split_slowdown: float = 1.5  # prior of a split's pull vs alone, until measured here (H100 host's 2 cores: 1.28)
    link_stale_margin: float = 1.5  # a link estimate idle past its lapse plans this many times slower than it was
    link_reprobe_s: float = 3600.0  # a link planned local whose last measure is this old is pulled from once; 0: never
    state_dir: str = ""  # directory kept across restarts (the link estimates); empty: nothing is kept
    min_wire_bytes: int = 64 << 10  # a payload this small is never squeezed below it (short prompts keep their tokens)
    policy: str = "ours"
    max_tokens: int = 256  # completion length when a request gives none
    max_body_bytes: int = 1 << 20  # request body limit (413 above it)
    max_payload_bytes: int = 256 << 20  # EDKV payload limit (a larger payload is refused)
    connect_timeout_s: float = 3.0  # to the prefill server
    fetch_timeout_s: float = 60.0  # the whole KV pull, headers to trailer
    idle_read_timeout_s: float = 10.0  # longest silence while the KV streams in
    breaker_failures: int = 3  # consecutive prefill failures that open the circuit breaker
    breaker_reset_s: float = 30.0  # how long an open breaker skips the prefill server
    memory_reserve_mb: int = 256  # admission keeps this much system memory available
    # Memory the daemon may use beyond kv_memory_mb for the work of turns, transient: onnxruntime's working memory
    # for their prompt runs and the ingest thread's scratch (copies and decodes of a conversation's KV). 0: sized at
    # start for every slot's prompt runs at max_context, one float32 copy of a max_context conversation's KV and 32 MiB
    # of residue (SmolLM2, 2 slots of 4096: 2 x 49 + 180 + 32 = 310 MiB; logged). docs/serving.md, "Working memory".
    working_memory_mb: int = 0
    client_timeout_s: float = 30.0  # longest wait for a client to send its body or accept more of the answer
    header_timeout_s: float = 10.0  # longest a connection may take to send a request's headers
    allow_special_tokens: bool = False  # client text may spell control tokens (<|im_start|>...); off: plain text


@dataclass(frozen=True)
class PrefillConfig:
    """The prefill server (``edgedecode prefill-server``)."""

    host: str = "127.0.0.1"
    port: int = 8089
    auth_token: str = ""  # bearer token clients must send; required when host is not loopback
    previous_auth_token: str = ""  # also accepted while clients move to a new auth_token (rotation)
    tls_cert_file: str = ""  # PEM certificate (chain) to serve HTTPS with, with tls_key_file; empty: plain HTTP
    tls_key_file: str = ""  # PEM private key of tls_cert_file
    prefix_cache_mb: int = 256  # prompt KV kept for the next turns of conversations
    transfer_cache_mb: int = 512  # prefill KV kept for receivers to resume a cut pull; 0: none
    transfer_ttl_s: float = 30.0  # how long a transfer is kept after its last payload
    encode_threads: int = 0  # threads quantizing and compressing EDKV chunks; 0: one per CPU
    max_prompt_tokens: int = 8192
    max_body_bytes: int = 4 << 20
    max_queue: int = 16  # prefill requests waiting; more are refused with 429
    client_timeout_s: float = 30.0  # longest wait for a client to send its body or accept more of the payload
    header_timeout_s: float = 10.0  # longest a connection may take to send a request's headers
    allow_special_tokens: bool = False  # client text may spell control tokens (<|im_start|>...); off: plain text


@dataclass(frozen=True)
class FleetConfig:
    """The prefill tier on Ray Serve (``edgedecode prefill-server --ray``): replicas of the prefill
    server behind one HTTP endpoint (``prefill.host``/``prefill.port``), docs/scale.md."""

    ray_address: str = ""  # "": start Ray on this machine; "auto" or host:port: join that cluster
    replicas: int = 2  # replicas at start (the count when min_replicas = max_replicas = 0)
    min_replicas: int = 0  # autoscaling bounds; both 0: a fixed count of `replicas`
    max_replicas: int = 0
    target_ongoing_requests: float = 2.0  # autoscaling keeps this many requests per replica
    replica_cpus: float = 1.0  # CPUs Ray reserves per replica (set model.threads to match)
    replica_gpus: float = 0.0  # GPUs per replica (1 with model.device = "cuda")
    max_ongoing_requests: int = 4  # requests a replica takes at once; more wait in the router
    max_queued_requests: int = 64  # requests waiting for a replica; more are refused (503)
    routing: str = "affinity"  # affinity (prefix cache, else least loaded) or round_robin
    affinity_imbalance: int = 2  # the replica holding a prefix is passed over when this many requests busier
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_s: float = 60.0  # a replica leaving finishes its requests within this


FLEET_ROUTING = ("affinity", "round_robin")


@dataclass(frozen=True)
class Config:
    """The whole configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    source: str = "defaults"  # where it was read from, for messages


_SECTION_TYPES = {"model": ModelConfig, "daemon": DaemonConfig, "prefill": PrefillConfig, "fleet": FleetConfig}


def load_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    server: Literal["daemon", "prefill"] | None = None,
) -> Config:
    """The configuration from ``path`` (default: /etc/edgedecode/edgedecode.toml when it exists),
    then ``EDGEDECODE_<SECTION>_<KEY>`` variables of ``env`` (default: the process environment),
    then ``overrides`` (command-line flags; None values are ignored), validated.

    ``server`` ("daemon" or "prefill") is the section whose server is about to run: only its TLS
    files are read (one file may serve two units on a host, each of which can read only its own
    key); None reads both sections' files.

    Raises:
        ConfigError: naming the file, variable or flag and the key at fault.
    """
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_TYPES}
    source = "defaults"
    if path is None and DEFAULT_CONFIG_PATH.exists():
        path = DEFAULT_CONFIG_PATH
    if path is not None:
        source = str(path)
        for section, items in _read_toml(path).items():
            values[section].update({key: (value, f"{path}: [{section}] {key}") for key, value in items.items()})
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        if section in _SECTION_TYPES and key:
            values[section][key] = (raw, f"environment variable {name}")
    for section, flags in (overrides or {}).items():
        values[section].update(
            {key: (value, f"option --{key.replace('_', '-')}") for key, value in flags.items() if value is not None}
        )
    sections = {section: _build(_SECTION_TYPES[section], section, items) for section, items in values.items()}
    config = Config(**sections, source=source)
    _validate(config, server)
    return config


def _read_toml(path: Path) -> dict[str, dict[str, Any]]:
    try:
        document = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for section, items in document.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(
                f"{path}: unknown section [{section}]{_suggest(section, _SECTION_TYPES)}; "
                f"sections are {', '.join(f'[{s}]' for s in _SECTION_TYPES)}"
            )
        if not isinstance(items, dict):
            raise ConfigError(f"{path}: {section} must be a [{section}] table")
    return document


def _suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build(cls, section: str, items: dict[str, tuple[Any, str]]):
    """An instance of the section dataclass from (value, where) pairs, each coerced to its field's type."""
    types = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(cls)}
    kwargs = {}
    for key, (value, where) in items.items():
        if key not in types:
            raise ConfigError(f"{where}: unknown key {section}.{key}{_suggest(key, types)}")
        kwargs[key] = _coerce(value, types[key], where)
    return cls(**kwargs)


def _coerce(value: Any, type_name: str, where: str) -> Any:
    """``value`` (from TOML, or a string from the environment or a flag) as ``type_name``."""
    kind = {"str": str, "int": int, "float": float, "bool": bool}[type_name]
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        try:
            if kind is bool:
                if text.lower() in ("1", "true", "yes", "on"):
                    return True
                if text.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            return kind(text)
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected {type_name}, got {value!r}")


def _validate(config: Config, server: Literal["daemon", "prefill"] | None) -> None:
    m, d, p = config.model, config.daemon, config.prefill
    problems = []
    if m.device not in ("cpu", "cuda"):
        problems.append(f"model.device must be cpu or cuda, not {m.device!r}")
    if m.threads < 0:
        problems.append("model.threads must be >= 0 (0: one per physical core)")
    for section, listener in (("daemon", d), ("prefill", p)):
        if not 0 <= listener.port <= 65535:
            problems.append(f"{section}.port must be in 0..65535 (0: any free port)")
        if not is_loopback(listener.host) and not listener.auth_token:
            problems.append(
                f"{section}.host is {listener.host!r}, not loopback: set {section}.auth_token "
                f"(or {ENV_PREFIX}{section.upper()}_AUTH_TOKEN) so clients must authenticate"
            )
        if listener.max_body_bytes < 1024:
            problems.append(f"{section}.max_body_bytes must be >= 1024")
        if listener.max_queue < 1:
            problems.append(f"{section}.max_queue must be >= 1")
        for name in ("client_timeout_s", "header_timeout_s"):
            if getattr(listener, name) <= 0:
                problems.append(f"{section}.{name} must be > 0")
        if listener.previous_auth_token and not listener.auth_token:
            problems.append(f"{section}.previous_auth_token needs {section}.auth_token (the token that replaces it)")
        problems += _server_tls_problems(section, listener, read=server in (None, section))
    if d.prefill_url and d.local_prefill_only:
        problems.append("daemon.prefill_url and daemon.local_prefill_only exclude each other")
    if d.prefill_url:
        parsed = urlparse(d.prefill_url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            problems.append(f"daemon.prefill_url must be an http(s) URL, not {d.prefill_url!r}")
    problems += _prefill_tls_problems(d, read=server in (None, "daemon"))
    if d.slots < 1:
        problems.append("daemon.slots must be >= 1")
    if d.kv_memory_mb < 1:
        problems.append("daemon.kv_memory_mb must be >= 1 (MiB of KV: the slots' and the compressed conversations')")
    if d.max_sessions < d.slots:
        problems.append(
            f"daemon.max_sessions ({d.max_sessions}) must be >= daemon.slots ({d.slots}): a conversation resident "
            "in a slot counts too (equal: none is kept compressed)"
        )
    if d.max_context < 64:
        problems.append("daemon.max_context must be >= 64 tokens")
    if not 0 <= d.budget <= 1:
        problems.append(f"daemon.budget must be in [0, 1] (wire bytes / FP16 bytes; 0: planned), not {d.budget}")
    if d.ttft_target_ms < 0:
        problems.append("daemon.ttft_target_ms must be >= 0 (0: no target)")
    if d.local_prefill_tokens_per_s < 0:
        problems.append(
            f"daemon.local_prefill_tokens_per_s must be >= 0 (0: measured), not {d.local_prefill_tokens_per_s}"
        )
    if not 1 <= d.split_slowdown <= 10:
        problems.append(f"daemon.split_slowdown must be in [1, 10], not {d.split_slowdown}")
    if not 1 <= d.link_stale_margin <= 100:
        problems.append(
            f"daemon.link_stale_margin must be in [1, 100] (a stale link is no faster), not {d.link_stale_margin}"
        )
    if d.link_reprobe_s < 0:
        problems.append(f"daemon.link_reprobe_s must be >= 0 (0: never re-probe), not {d.link_reprobe_s}")
    if d.state_dir and server in (None, "daemon") and not _writable_dir(d.state_dir):
        problems.append(f"daemon.state_dir ({d.state_dir}) must be a directory this process can write to")
    if not 0 <= d.local_dppl_pct < 1000:
        problems.append(f"daemon.local_dppl_pct must be in [0, 1000) (Δ perplexity, %), not {d.local_dppl_pct}")
    if not 0 <= d.min_budget <= 1:
        problems.append(f"daemon.min_budget must be in [0, 1] (0: the model's calibration's), not {d.min_budget}")
    if d.policy not in POLICIES:
        problems.append(f"daemon.policy must be one of {', '.join(POLICIES)}, not {d.policy!r}")
    if d.min_wire_bytes < 0:
        problems.append("daemon.min_wire_bytes must be >= 0")
    if d.max_tokens < 1:
        problems.append("daemon.max_tokens must be >= 1")
    for name in ("connect_timeout_s", "fetch_timeout_s", "idle_read_timeout_s", "breaker_reset_s"):
        if getattr(d, name) <= 0:
            problems.append(f"daemon.{name} must be > 0")
    if d.breaker_failures < 1:
        problems.append("daemon.breaker_failures must be >= 1")
    if p.encode_threads < 0:
        problems.append("prefill.encode_threads must be >= 0 (0: one per CPU)")
    if p.transfer_cache_mb < 0 or not 0 < p.transfer_ttl_s <= MAX_TRANSFER_TTL_S:
        problems.append(
            f"prefill.transfer_cache_mb must be >= 0 and prefill.transfer_ttl_s in (0, {MAX_TRANSFER_TTL_S:g}]"
        )
    if (
        d.max_payload_bytes < 1024
        or min(d.memory_reserve_mb, d.working_memory_mb, p.prefix_cache_mb) < 0
        or (p.max_prompt_tokens < 2)
    ):
        problems.append(
            "daemon.max_payload_bytes >= 1024, daemon.memory_reserve_mb >= 0, daemon.working_memory_mb >= 0, "
            "prefill.prefix_cache_mb >= 0 and prefill.max_prompt_tokens >= 2 are required"
        )
    problems += _fleet_problems(config.fleet)
    if problems:
        raise ConfigError(f"invalid configuration ({config.source}): " + "; ".join(problems))


def _server_tls_problems(section: str, listener: DaemonConfig | PrefillConfig, read: bool) -> list[str]:
    """What keeps ``listener``'s certificate and key from serving HTTPS: both or neither, and with
    ``read``, readable files of a PEM certificate and its key."""
    cert, key = listener.tls_cert_file, listener.tls_key_file
    if not cert and not key:
        return []
    if not cert or not key:
        return [f"{section}.tls_cert_file and {section}.tls_key_file go together: set both (HTTPS) or neither (HTTP)"]
    if not read:
        return []
    unreadable = _unreadable(section, "tls_cert_file", cert) + _unreadable(section, "tls_key_file", key)
    if unreadable:
        return unreadable
    try:
        server_tls(cert, key)
    except ssl.SSLError as exc:
        return [
            f"{section}.tls_cert_file ({cert}) and {section}.tls_key_file ({key}) are not a PEM certificate "
            f"and its private key: {exc}"
        ]
    return []


def _prefill_tls_problems(d: DaemonConfig, read: bool) -> list[str]:
    """Whether the daemon can verify the prefill server's certificate (with ``read``, its CA file's
    or the system's CAs): never pull KV over unverified TLS."""
    https = urlparse(d.prefill_url).scheme == "https"
    if d.prefill_ca_file:
        if not https:
            return [f"daemon.prefill_ca_file is set, but daemon.prefill_url ({d.prefill_url!r}) is not an https URL"]
        if not read:
            return []
        unreadable = _unreadable("daemon", "prefill_ca_file", d.prefill_ca_file)
        if unreadable:
            return unreadable
        try:
            client_tls(d.prefill_ca_file)
        except ssl.SSLError as exc:
            return [f"daemon.prefill_ca_file ({d.prefill_ca_file}) holds no PEM CA certificate: {exc}"]
    elif https and read:
        paths = ssl.get_default_verify_paths()
        if paths.cafile is None and paths.capath is None:
            return [
                "daemon.prefill_url is https, but this system has no CA certificates to verify it with: "
                "set daemon.prefill_ca_file"
            ]
    return []


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _unreadable(section: str, key: str, path: str) -> list[str]:
    try:
        with open(path, "rb"):
            return []
    except OSError as exc:
        return [f"{section}.{key}: cannot read {path}: {exc.strerror or exc}"]


def _fleet_problems(f: FleetConfig) -> list[str]:
    problems = []
    if f.replicas < 1:
        problems.append("fleet.replicas must be >= 1")
    if (f.min_replicas or f.max_replicas) and not 0 <= f.min_replicas <= f.replicas <= f.max_replicas:
        problems.append(
            "autoscaling needs 0 <= fleet.min_replicas <= fleet.replicas <= fleet.max_replicas "
            f"(got {f.min_replicas}, {f.replicas}, {f.max_replicas}); both 0 keeps fleet.replicas fixed"
        )
    if f.routing not in FLEET_ROUTING:
        problems.append(f"fleet.routing must be one of {', '.join(FLEET_ROUTING)}, not {f.routing!r}")
    if f.replica_cpus < 0 or f.replica_gpus < 0 or f.affinity_imbalance < 0:
        problems.append("fleet.replica_cpus, fleet.replica_gpus and fleet.affinity_imbalance must be >= 0")
    if f.max_ongoing_requests < 1 or f.max_queued_requests < 1:
        problems.append("fleet.max_ongoing_requests and fleet.max_queued_requests must be >= 1")
    for name in ("target_ongoing_requests", "health_check_period_s", "health_check_timeout_s", "graceful_shutdown_s"):
        if getattr(f, name) <= 0:
            problems.append(f"fleet.{name} must be > 0")
    return problems


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
