"""systemd integration: sd_notify datagrams on real AF_UNIX sockets, watchdog pings, and the shipped units."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from edgedecode.serving import systemd
from edgedecode.serving.systemd import notify, run_watchdog, watchdog_interval

UNITS_DIR = Path(__file__).resolve().parents[1] / "systemd"
UNITS = ("edgedecode.service", "edgedecode-prefill.service")
SYSTEM_UNITS_DIR = next(
    (p for p in map(Path, ("/usr/lib/systemd/system", "/lib/systemd/system")) if p.is_dir()),
    Path("/usr/lib/systemd/system"),
)


@pytest.fixture
def manager(tmp_path, monkeypatch) -> socket.socket:
    """A datagram socket standing in for systemd's notify socket, named by $NOTIFY_SOCKET."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def received(sock: socket.socket) -> list[bytes]:
    """Every datagram queued on sock, without waiting."""
    out = []
    while True:
        try:
            out.append(sock.recv(4096))
        except BlockingIOError:
            return out


def test_notify_sends_states_as_one_newline_joined_datagram(manager):
    assert notify("READY=1", "STATUS=model loaded")
    assert received(manager) == [b"READY=1\nSTATUS=model loaded"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract AF_UNIX addresses are Linux-only")
def test_notify_reaches_an_abstract_socket(monkeypatch):
    name = f"edgedecode-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1")
        assert received(sock) == [b"STOPPING=1"]


@pytest.mark.parametrize("value", [None, ""])
def test_notify_without_a_socket_does_nothing(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert notify("READY=1") is False


def test_notify_to_a_vanished_socket_returns_false_and_warns_once(manager, caplog):
    path = Path(os.environ["NOTIFY_SOCKET"])
    manager.close()
    path.unlink()
    with caplog.at_level(logging.WARNING, logger=systemd.__name__):
        assert notify("WATCHDOG=1") is False
        assert notify("WATCHDOG=1") is False
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()


def test_notify_gives_up_on_a_stalled_manager(manager, monkeypatch):
    monkeypatch.setattr(systemd, "SEND_TIMEOUT_S", 0.05)
    sent = 0
    while notify("WATCHDOG=1"):  # nobody reads: the receive queue fills, then the send times out
        sent += 1
        assert sent < 100_000
    assert sent > 0 and len(received(manager)) == sent


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("1000", None, 0.0005),
        ("30000000", "other", None),
        (None, None, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_this_process(monkeypatch, usec, pid, expected):
    pids = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pids.get(pid, pid))):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert watchdog_interval() == expected


@pytest.mark.parametrize(("usec", "pid"), [("thirty", None), ("0", None), ("-5", None), ("30000000", "pid1")])
def test_malformed_watchdog_settings_disable_the_watchdog_with_a_warning(monkeypatch, caplog, usec, pid):
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    if pid is None:
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
    else:
        monkeypatch.setenv("WATCHDOG_PID", pid)
    with caplog.at_level(logging.WARNING, logger=systemd.__name__):
        assert watchdog_interval() is None
    assert len(caplog.records) == 1


async def watch(sock: socket.socket, healthy, seconds: float) -> list[bytes]:
    """Run the watchdog at a 10 ms interval for `seconds` while reading what it sends; then cancel it."""
    loop = asyncio.get_running_loop()
    pings: list[bytes] = []

    async def read():
        while True:
            pings.append(await loop.sock_recv(sock, 4096))

    reader = asyncio.create_task(read())
    dog = asyncio.create_task(run_watchdog(healthy, 0.01))
    await asyncio.sleep(seconds)
    dog.cancel()
    with pytest.raises(asyncio.CancelledError):
        await dog
    await asyncio.sleep(0.03)  # three intervals: a watchdog that survived cancellation would ping now
    reader.cancel()
    return pings


def test_run_watchdog_pings_while_healthy_and_stops_on_cancel(manager):
    pings = asyncio.run(watch(manager, lambda: True, 0.1))
    assert len(pings) >= 3 and set(pings) == {b"WATCHDOG=1"}
    assert received(manager) == []


def test_run_watchdog_withholds_pings_while_unhealthy(manager, caplog):
    with caplog.at_level(logging.WARNING, logger=systemd.__name__):
        pings = asyncio.run(watch(manager, lambda: False, 0.1))
    assert pings == []
    assert any("withheld" in r.getMessage() for r in caplog.records)


def test_run_watchdog_resumes_when_the_service_recovers(manager):
    state = {"checks": 0}

    def healthy() -> bool:  # stuck for the first five checks, then fine
        state["checks"] += 1
        return state["checks"] > 5

    pings = asyncio.run(watch(manager, healthy, 0.15))
    assert len(pings) == state["checks"] - 5 >= 1


def test_run_watchdog_treats_a_raising_health_check_as_unhealthy(manager, caplog):
    def healthy() -> bool:
        raise RuntimeError("worker state unreadable")

    with caplog.at_level(logging.WARNING, logger=systemd.__name__):
        pings = asyncio.run(watch(manager, healthy, 0.05))
    assert pings == []
    assert any(r.exc_info for r in caplog.records)


# The units as shipped, checked by systemd-analyze verify. It fails a unit whose ExecStart= binary is
# missing, and the units point at the install location (/opt/edgedecode/venv). Rather than editing
# the units, verify them byte for byte under --root: an alternate root holding the host's system
# units (the targets they order against), the two units in /etc/systemd/system and an executable
# stand-in at the ExecStart path. verify resolves units and executables inside that root. Unknown
# keys, unparsable values and unknown sections only print warnings (exit 0), so any output line
# naming one of our units fails the test too.


def verify_units(units_dir: Path, root: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify of the UNITS in units_dir, inside an alternate root laid out as installed.

    The executable stand-ins go where the shipped units' ExecStart= points, whatever units_dir holds.
    """
    shutil.copytree(SYSTEM_UNITS_DIR, root / SYSTEM_UNITS_DIR.relative_to("/"), symlinks=True)
    etc_units = root / "etc/systemd/system"
    etc_units.mkdir(parents=True)
    for unit in UNITS:
        shutil.copyfile(units_dir / unit, etc_units / unit)
        for line in (UNITS_DIR / unit).read_text().splitlines():
            if line.startswith("ExecStart="):
                binary = root / line.removeprefix("ExecStart=").lstrip("-@:+!").split()[0].lstrip("/")
                binary.parent.mkdir(parents=True, exist_ok=True)
                binary.write_text("#!/bin/sh\n")
                binary.chmod(0o755)
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no", "--recursive-errors=no", f"--root={root}", *UNITS],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def unit_problems(result: subprocess.CompletedProcess) -> list[str]:
    """Output lines of a verify run that are about our units (others may concern the host's units)."""
    return [line for line in (result.stdout + result.stderr).splitlines() if any(unit in line for unit in UNITS)]


needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or not SYSTEM_UNITS_DIR.is_dir(),
    reason="systemd-analyze and the system's unit directory are needed (CI installs the systemd package)",
)


@needs_systemd_analyze
def test_units_pass_systemd_analyze_verify(tmp_path):
    result = verify_units(UNITS_DIR, tmp_path / "root")
    assert unit_problems(result) == []
    assert result.returncode == 0, result.stdout + result.stderr


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (("[Service]\n", "[Service]\nRestartOnTuesdays=yes\n"), "Unknown key"),
        (("RestartSec=", "RestartSec=banana\n#"), "Failed to parse"),
        (("[Install]", "[Instal]"), "Unknown section"),
        (
            ("ExecStart=/opt/edgedecode/venv/bin/edgedecode", "ExecStart=/opt/edgedecode/venv/bin/missing"),
            "not executable",
        ),
    ],
    ids=["unknown-key", "bad-value", "unknown-section", "missing-binary"],
)
def test_verify_check_catches_broken_units(tmp_path, breakage, expected):
    broken = tmp_path / "units"
    broken.mkdir()
    for unit in UNITS:
        shutil.copyfile(UNITS_DIR / unit, broken / unit)
    old, new = breakage
    text = (broken / UNITS[0]).read_text()
    assert old in text
    (broken / UNITS[0]).write_text(text.replace(old, new, 1))
    result = verify_units(broken, tmp_path / "root")
    problems = unit_problems(result)
    assert any(expected in line and UNITS[0] in line for line in problems), result.stdout + result.stderr


# What systemd-analyze security finds open in the shipped units, each on purpose (docs/security.md
# says why); every other exposure it checks is closed. Adding or dropping a restriction changes
# this set: review the sandbox and docs/security.md with it.
OPEN_BY_DESIGN = {
    "PrivateNetwork=",  # both serve and pull over TCP
    "RestrictAddressFamilies=~AF_(INET|INET6)",
    "IPAddressDeny=",  # which peers may connect is the deployment's: a drop-in (docs/security.md)
    "RestrictAddressFamilies=~AF_UNIX",  # sd_notify; the embedded prefill child's pipes
    "PrivateUsers=",  # would map the GPU device nodes' groups (video on Jetson) to nobody
    "ProcSubset=",  # admission reads /proc/meminfo (psutil)
    "SystemCallFilter=~@resources",  # onnxruntime/CUDA thread affinity and NUMA calls: not checked under a filter
    "SystemCallFilter=~@privileged",  # the empty CapabilityBoundingSet= already denies what they need caps for
    "RootDirectory=/RootImage=",  # runs the host's /opt/edgedecode/venv
    "DeviceAllow=",  # char-rtc read-only, which ProtectClock= itself adds
}
DEVICES_OPEN = {"edgedecode.service": {"PrivateDevices="}, "edgedecode-prefill.service": set()}  # GPU drop-in


@needs_systemd_analyze
@pytest.mark.parametrize("unit", UNITS)
def test_units_leave_open_only_what_they_need(unit):
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--json=short", "--threshold=16", str(UNITS_DIR / unit)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    checks = json.loads(result.stdout)
    assert {check["name"] for check in checks if check["set"] is False} == OPEN_BY_DESIGN | DEVICES_OPEN[unit]
    assert result.returncode == 0, f"{unit}: overall exposure above 1.6 ({result.stderr})"
