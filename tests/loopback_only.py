"""Keep a client library on 127.0.0.1: every name lookup for a host outside the loopback range is
refused at once (an ``OSError`` naming the host) and recorded, so a library that phones home (a
model-cost map, a tokenizer download, telemetry) fails the test instead of hanging on DNS where
there is no network, or passing here and hanging in CI.

In process, ``LoopbackOnly`` patches ``socket.getaddrinfo`` (every client here, httpx, aiohttp,
urllib3 and urllib, resolves through it, IP literals included) until ``restore``. A subprocess (the
``llm`` command line) gets the same guard from ``sitecustomize_dir``: a ``sitecustomize`` module that
Python imports at start when its folder is on ``PYTHONPATH``; refused hosts go to stderr, each line
starting with ``REFUSED``.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
from pathlib import Path

REFUSED = "loopback-only: refused a lookup of"


def is_loopback(host: object) -> bool:
    """Whether ``host`` (a name or address as ``getaddrinfo`` takes it) stays on this machine."""
    if host is None:  # getaddrinfo(None, port): a local address to bind
        return True
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0]).is_loopback
    except ValueError:
        return False


class LoopbackOnly:
    """Refuses (and records in ``refused``) every lookup of a host beyond loopback until ``restore``."""

    def __init__(self, stream=None) -> None:
        self.refused: list[str] = []
        self._stream = stream  # where each refusal is also written (a subprocess's stderr), or None
        self._real = socket.getaddrinfo
        socket.getaddrinfo = self._getaddrinfo  # type: ignore[assignment]

    def _getaddrinfo(self, host, *args, **kwargs):
        if is_loopback(host):
            return self._real(host, *args, **kwargs)
        self.refused.append(str(host))
        if self._stream is not None:
            self._stream.write(f"{REFUSED} {host!r}\n")
            self._stream.flush()
        raise OSError(f"{REFUSED} {host!r}: the client-library tests reach only 127.0.0.1")

    def restore(self) -> None:
        socket.getaddrinfo = self._real


def sitecustomize_dir(directory: Path) -> Path:
    """``directory`` holding this module and a ``sitecustomize.py`` that installs the guard (refusals
    on stderr) in any Python started with ``directory`` on ``PYTHONPATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, directory / "loopback_only.py")
    (directory / "sitecustomize.py").write_text(
        "import sys\n\nimport loopback_only\n\n_guard = loopback_only.LoopbackOnly(sys.stderr)\n"
    )
    return directory
