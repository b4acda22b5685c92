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

from edgedecode.config import load_config
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


def install_root(units_dir: Path, root: Path, drop_ins: dict[str, dict[str, str]] | None = None) -> Path:
    """An alternate root laid out as installed: the host's system units, the UNITS of units_dir and their
    drop-ins (unit -> {file name: text}, in /etc/systemd/system/UNIT.d/, where `systemctl edit` puts them)
    in /etc/systemd/system, and executable stand-ins where the shipped units' ExecStart= points."""
    shutil.copytree(SYSTEM_UNITS_DIR, root / SYSTEM_UNITS_DIR.relative_to("/"), symlinks=True)
    etc_units = root / "etc/systemd/system"
    etc_units.mkdir(parents=True)
    for unit, files in (drop_ins or {}).items():
        (etc_units / f"{unit}.d").mkdir()
        for name, text in files.items():
            (etc_units / f"{unit}.d" / name).write_text(text)
    for unit in UNITS:
        shutil.copyfile(units_dir / unit, etc_units / unit)
        for line in (UNITS_DIR / unit).read_text().splitlines():
            if line.startswith("ExecStart="):
                binary = root / line.removeprefix("ExecStart=").lstrip("-@:+!").split()[0].lstrip("/")
                binary.parent.mkdir(parents=True, exist_ok=True)
                binary.write_text("#!/bin/sh\n")
                binary.chmod(0o755)
    return root


def verify_units(
    units_dir: Path, root: Path, drop_ins: dict[str, dict[str, str]] | None = None
) -> subprocess.CompletedProcess:
    """systemd-analyze verify of the UNITS in units_dir (with their drop-ins) inside an alternate root
    laid out as installed (:func:`install_root`)."""
    install_root(units_dir, root, drop_ins)
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


# Example drop-ins (systemd/examples/): local settings that upgrades keep, since copying new units into
# /etc/systemd/system/ leaves UNIT.d/ alone. Each must verify on top of the units it is for, and change
# what it says it changes, as systemd reads it: `systemd-analyze security` inside the same root reports
# the unit with its drop-ins merged (the Environment= lines it cannot show are checked as text).
EXAMPLES_DIR = UNITS_DIR / "examples"
EXAMPLE_UNITS = {
    "gpu.conf": ("edgedecode.service",),
    "prefill-gpu.conf": ("edgedecode-prefill.service",),
    "jetson.conf": UNITS,
    "same-host.conf": ("edgedecode.service",),
}


def test_every_example_drop_in_is_checked():
    assert {path.name for path in EXAMPLES_DIR.glob("*")} == set(EXAMPLE_UNITS)


def example_drop_ins(example: str) -> dict[str, dict[str, str]]:
    return {unit: {example: (EXAMPLES_DIR / example).read_text()} for unit in EXAMPLE_UNITS[example]}


def security_in_root(root: Path, unit: str) -> dict[str, dict]:
    """systemd-analyze security's checks of ``unit`` as installed in ``root`` (drop-ins merged), by name."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--json=short", "--threshold=100", unit],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout, result.stderr
    return {check["name"]: check for check in json.loads(result.stdout)}


@needs_systemd_analyze
@pytest.mark.parametrize("example", sorted(EXAMPLE_UNITS))
def test_example_drop_ins_verify_on_top_of_their_units(tmp_path, example):
    result = verify_units(UNITS_DIR, tmp_path / "root", example_drop_ins(example))
    assert unit_problems(result) == []
    assert result.returncode == 0, result.stdout + result.stderr


@needs_systemd_analyze
def test_verify_reads_the_drop_ins(tmp_path):
    broken = {"edgedecode.service": {"local.conf": "[Service]\nRestartOnTuesdays=yes\n"}}
    problems = unit_problems(verify_units(UNITS_DIR, tmp_path / "root", broken))
    assert any("Unknown key" in line and "edgedecode.service.d/local.conf" in line for line in problems), problems


# What each example changes in systemd-analyze security's view of its units: check -> its new description.
NVIDIA_ACL = "Service has a device ACL with some special devices: char-rtc:r char-nvidia*:rw"
HARDWARE = {"PrivateDevices=": "Service potentially has access to hardware devices"}
JETSON = {
    "DeviceAllow=": "Service has no device ACL",  # ProtectClock=no too: its char-rtc entry would keep the ACL
    "ProtectClock=": "Service may write to the hardware clock or system clock",
    "SupplementaryGroups=": "Service runs with supplementary groups",
}
EXAMPLE_EFFECTS = {
    ("gpu.conf", "edgedecode.service"): {"DeviceAllow=": NVIDIA_ACL},
    ("prefill-gpu.conf", "edgedecode-prefill.service"): {"DeviceAllow=": NVIDIA_ACL} | HARDWARE,
    ("jetson.conf", "edgedecode.service"): JETSON,
    ("jetson.conf", "edgedecode-prefill.service"): JETSON | HARDWARE,  # the daemon has no PrivateDevices= to lift
    ("same-host.conf", "edgedecode.service"): {},  # ordering and an Environment= line, checked as text
}
EXAMPLE_ENVIRONMENT = {
    "gpu.conf": "EDGEDECODE_MODEL_DEVICE=cuda",
    "prefill-gpu.conf": "EDGEDECODE_MODEL_DEVICE=cuda",
    "jetson.conf": "EDGEDECODE_MODEL_DEVICE=cuda",
    "same-host.conf": "EDGEDECODE_DAEMON_PREFILL_URL=http://127.0.0.1:8089",
}


@needs_systemd_analyze
@pytest.mark.parametrize("example", sorted(EXAMPLE_UNITS))
def test_example_drop_ins_override_the_units(tmp_path, example):
    shipped = install_root(UNITS_DIR, tmp_path / "shipped")
    local = install_root(UNITS_DIR, tmp_path / "local", example_drop_ins(example))
    for unit in EXAMPLE_UNITS[example]:
        before, after = security_in_root(shipped, unit), security_in_root(local, unit)
        changed = {name: after[name]["description"] for name in before if after[name] != before[name]}
        assert changed == EXAMPLE_EFFECTS[example, unit], unit
    lines = (EXAMPLES_DIR / example).read_text().splitlines()
    assert f"Environment={EXAMPLE_ENVIRONMENT[example]}" in lines
    env = dict(line.removeprefix("Environment=").split("=", 1) for line in lines if line.startswith("Environment="))
    load_config(Path(os.devnull), env=env)  # settings the configuration knows, with values it accepts
