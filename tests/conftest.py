"""Shared fixtures: the real default model, fetched once per test session.

Set EDGEDECODE_TEST_GGUF to a local copy of SmolLM2-135M-Instruct.Q4_1.gguf to skip the download;
otherwise the model is fetched into EDGEDECODE_HOME (or the user cache) exactly as `edgedecode
fetch-model` does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

VECTORS_DIR = Path(__file__).parent / "vectors" / "smollm2-135m-instruct"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the real model (any fixture chain reaching ``smollm2_gguf``) with
    ``model``, so ``pytest -m "not model"`` runs the fast half."""
    for item in items:
        if "smollm2_gguf" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)


TEST_THREADS = 2
TEST_CONTEXT = 2048


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the real default model's GGUF (SHA-256 verified)."""
    override = os.environ.get("EDGEDECODE_TEST_GGUF")
    if override:
        return Path(override)
    from edgedecode.model.fetch import fetch_model
    from edgedecode.model.registry import DEFAULT_MODEL

    return fetch_model(DEFAULT_MODEL).gguf_path


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
    from edgedecode.model.graph import GraphOptions
    from edgedecode.runtime.engine import Engine

    return Engine(model, GraphOptions(kind, "float32", accuracy_level), max_context=TEST_CONTEXT, threads=TEST_THREADS)


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
