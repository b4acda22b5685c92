"""Progress of long work, reported by library code and shown only on an interactive terminal.

Fetching a model (bytes), building a graph (layers, then bytes written) and a probe (contexts, needle
trials) take seconds to minutes. Library code takes a :class:`Progress` (default
:data:`NO_PROGRESS`: shows nothing, costs nothing) and reports counted work through
:meth:`Progress.task`; it never draws anything itself. The command line passes :func:`for_terminal`:
tqdm bars on stderr when stderr is a terminal, and :data:`NO_PROGRESS` when it is not (a pipe, a
file, systemd's journal), so logs and captured output never hold bar frames. ``EDGEDECODE_PROGRESS=off``
turns bars off on a terminal too: a service whose output is a terminal all the same (``docker run -t``;
the container images set it). Nothing here writes to stdout, which carries the answers of ``generate``
and ``chat``.

This module sits in the lowest import layer, beside ``errors``, so that every layer can take one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TextIO

Advance = Callable[[int], None]
"""Reports ``n`` more units of a task done."""


def _ignore(_: int) -> None:
    pass


class Progress:
    """Shows nothing: the default wherever library code reports progress."""

    shows_bars = False

    @contextmanager
    def task(self, description: str, total: int | None, unit: str = "it") -> Iterator[Advance]:
        """A counted piece of work: call the yielded ``advance(n)`` as ``n`` more of ``total`` units
        (``"B"``: bytes) are done. ``total`` None: unknown."""
        yield _ignore

    def write(self, text: str) -> None:
        """Text for stderr that leaves any bar on screen whole (it is redrawn below the text)."""
        sys.stderr.write(text)
        sys.stderr.flush()


NO_PROGRESS = Progress()


class TerminalProgress(Progress):
    """tqdm bars on a terminal stream; a finished bar stays on screen as one line."""

    shows_bars = True

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    @contextmanager
    def task(self, description: str, total: int | None, unit: str = "it") -> Iterator[Advance]:
        from tqdm import tqdm

        with tqdm(
            total=total,
            desc=description,
            unit=unit,
            unit_scale=unit == "B",  # 98.4MB, 1.2GB (SI, as pip counts)
            file=self.stream,
            dynamic_ncols=True,
            mininterval=0.2,
            leave=True,
        ) as bar:
            yield bar.update

    def write(self, text: str) -> None:
        from tqdm import tqdm

        for line in text.splitlines():
            tqdm.write(line, file=self.stream)


def interactive(stream: TextIO | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` (default stderr) is a terminal a person watches: a TTY, not a ``dumb`` one,
    not systemd's journal (``$JOURNAL_STREAM`` names the journal's stream; a terminal started from a
    systemd user service inherits the variable, so the stream itself is compared), and bars are not
    turned off (``EDGEDECODE_PROGRESS=off``)."""
    stream = sys.stderr if stream is None else stream
    env = os.environ if environ is None else environ
    if env.get("TERM") == "dumb" or env.get("EDGEDECODE_PROGRESS", "").lower() in ("0", "off", "no", "false"):
        return False
    try:
        if not stream.isatty():
            return False
        fd = stream.fileno()
    except (AttributeError, ValueError, OSError):  # closed, or a stand-in without a descriptor
        return False
    journal = env.get("JOURNAL_STREAM", "")
    if journal:
        stat = os.fstat(fd)
        if journal == f"{stat.st_dev}:{stat.st_ino}":
            return False
    return True


def for_terminal(stream: TextIO | None = None) -> Progress:
    """Bars on ``stream`` (default stderr) when a person watches it (:func:`interactive`), else nothing."""
    stream = sys.stderr if stream is None else stream
    return TerminalProgress(stream) if interactive(stream) else NO_PROGRESS
