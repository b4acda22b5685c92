"""The link models' memory across restarts: one small JSON file per prefill endpoint in the daemon's
state directory (``daemon.state_dir``), holding what ``LinkModel.state()`` remembers.

A file is written after every pull that taught its model, atomically (a temporary file in the same
directory, then renamed over the old one; not fsynced: a file lost to a power cut costs only the
estimate). It is read once, when the daemon first uses the endpoint, and only if it names that
endpoint and holds finite, non-negative numbers (a positive time per byte); anything else is
ignored with a warning and the link starts unknown. A restored estimate is stale (see
``pull.link``): the daemon cannot tell how long it was down.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from edgedecode.daemon.pull.link import STATE_KEYS

logger = logging.getLogger(__name__)
VERSION = 1


class LinkStore:
    """Link estimates kept in ``directory`` (it must exist and be writable by the daemon)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, endpoint: str) -> Path:
        """The file of ``endpoint`` (a hash of its URL: any URL makes a safe file name)."""
        return self.directory / f"link-{hashlib.sha256(endpoint.encode()).hexdigest()[:16]}.json"

    def load(self, endpoint: str) -> dict[str, float | None] | None:
        """The state stored for ``endpoint``; None when there is none or it is not valid (logged)."""
        path = self.path(endpoint)
        try:
            document = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the link estimate in %s: %s", path, exc)
            return None
        problem = _problem(document, endpoint)
        if problem:
            logger.warning("ignoring the link estimate in %s: %s", path, problem)
            return None
        return {key: document.get(key) for key in STATE_KEYS}  # a key added since the file was written: None

    def save(self, endpoint: str, state: Mapping[str, float | None]) -> None:
        """Store ``state`` for ``endpoint``, replacing the file atomically; a failure is logged, not raised."""
        path = self.path(endpoint)
        document = {"version": VERSION, "endpoint": endpoint, **{key: state.get(key) for key in STATE_KEYS}}
        try:
            _write_atomically(path, json.dumps(document))
        except OSError as exc:
            logger.warning("cannot store the link estimate of %s in %s: %s", endpoint, path, exc)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory renamed over it."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".link-", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _problem(document: object, endpoint: str) -> str | None:
    """What makes ``document`` unusable as ``endpoint``'s stored state, None if nothing does."""
    if not isinstance(document, dict) or document.get("version") != VERSION:
        return f"not a version {VERSION} link estimate"
    if document.get("endpoint") != endpoint:
        return f"it is {document.get('endpoint')!r}'s, not {endpoint!r}'s"
    for key in STATE_KEYS:
        value = document.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            return f"{key} is {value!r}, not a finite number >= 0"
        if key == "seconds_per_byte" and value == 0:
            return "seconds_per_byte is 0"
    return None
