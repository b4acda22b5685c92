"""systemd integration over the sd_notify datagram protocol: readiness, status and watchdog pings.

The protocol is one AF_UNIX datagram of newline-separated ``KEY=VALUE`` lines sent to
``$NOTIFY_SOCKET`` (sd_notify(3)), so this speaks it directly rather than adding a dependency:
systemd-python needs the libsystemd headers to build and ``sdnotify`` is unmaintained.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0  # a stalled service manager holds the caller (often the event loop) this long at most
_failed_sockets: set[str] = set()  # NOTIFY_SOCKET values whose send failure was already logged


def _socket_address(raw: str) -> str:
    """A NOTIFY_SOCKET value as a socket address: a leading '@' names the abstract namespace."""
    return "\0" + raw[1:] if raw.startswith("@") else raw


def notify(*states: str) -> bool:
    """Send service states ("READY=1", "STATUS=...", "WATCHDOG=1", "STOPPING=1") to systemd.

    The states travel newline-joined in one datagram to ``$NOTIFY_SOCKET``. A failed or timed-out
    send is logged once per socket and otherwise ignored: a daemon must not die, or hang, because the
    notify socket went away.

    Returns:
        True when the datagram was sent; False when NOTIFY_SOCKET is unset (not run by systemd,
        or a Type= that does not listen) or the send failed.
    """
    raw = os.environ.get("NOTIFY_SOCKET")
    if not raw:
        return False
    message = "\n".join(states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            # Connected, so a full receive queue blocks (at most the timeout) instead of failing at once.
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(_socket_address(raw))
            sock.send(message)
    except OSError as exc:
        if raw not in _failed_sockets:
            _failed_sockets.add(raw)
            logger.warning("sd_notify to %s failed (%s); further failures are not logged", raw, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings: half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises.

    Returns:
        None when WatchdogSec= is not set for this service, when ``$WATCHDOG_PID`` names another
        process (the watchdog is meant for it, not for us), or when either value is malformed.
    """
    usec_raw = os.environ.get("WATCHDOG_USEC")
    if not usec_raw:
        return None
    pid_raw = os.environ.get("WATCHDOG_PID")
    try:
        usec = int(usec_raw)
        pid = int(pid_raw) if pid_raw else None
    except ValueError:
        logger.warning("ignoring malformed watchdog settings WATCHDOG_USEC=%r WATCHDOG_PID=%r", usec_raw, pid_raw)
        return None
    if usec <= 0:
        logger.warning("ignoring non-positive WATCHDOG_USEC=%r", usec_raw)
        return None
    if pid is not None and pid != os.getpid():
        return None
    return usec / 2 / 1_000_000


async def run_watchdog(healthy: Callable[[], bool], interval: float) -> None:
    """Ping the systemd watchdog every ``interval`` seconds while ``healthy()`` holds; runs until cancelled.

    An unhealthy check withholds the ping, so a stuck worker (e.g. a decode thread that stopped
    making progress) lets WatchdogSec= expire and systemd restarts the service. A check that raises
    counts as unhealthy. Cancellation propagates out of the sleep; nothing is sent after it.

    Args:
        healthy: called on the event loop before each ping; must be quick and must not block.
        interval: seconds between checks, normally ``watchdog_interval()``.
    """
    while True:
        await asyncio.sleep(interval)
        try:
            ok = healthy()
        except Exception:
            logger.warning("health check raised; treating the service as unhealthy", exc_info=True)
            ok = False
        if ok:
            notify("WATCHDOG=1")
        else:
            logger.warning("service unhealthy: watchdog ping withheld, systemd restarts it when WatchdogSec expires")
