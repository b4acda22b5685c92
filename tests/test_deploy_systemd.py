"""The units of systemd/ under a real systemd: a container whose PID 1 is systemd (``podman run
--systemd=always``) with the units, the same-host drop-in, a local drop-in, the TOML file and the env file
installed as docs/deploy.md says. Observed: ``Type=notify`` readiness (the unit turns active only on
``READY=1``, and its status line is the service's ``STATUS=``), the drop-ins applied, the dynamic user, a
chat through the pair, and a restart by systemd after ``kill -9`` of the daemon's main process.

Opt-in and probed (tests/container_engine.py): EDGEDECODE_TEST_DEPLOY=1. The venv is the CPU image's
(tests/test_deploy_container.py builds it); the systemd base is ``EDGEDECODE_TEST_SYSTEMD_IMAGE``
(default ``localhost/edgedecode-systemd-base:bookworm``, made by ``tools/deploy/base_image.py --systemd``).
The model comes from PyPI, or from the wheel folder EDGEDECODE_WHEEL_DIR names on the host.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from container_engine import ROOT, base_image_or_skip, build, podman
from test_deploy_container import TAG as CPU_TAG

SYSTEMD_BASE = os.environ.get("EDGEDECODE_TEST_SYSTEMD_IMAGE", "localhost/edgedecode-systemd-base:bookworm")
TAG = "localhost/edgedecode-test:systemd"
CACHE_VOLUME = "edgedecode-test-systemd-cache"
START_S = 15 * 60  # the units' TimeoutStartSec
UNITS = ("edgedecode-prefill.service", "edgedecode.service")

RECIPE = """\
ARG PYTHON_IMAGE
FROM ${PYTHON_IMAGE} AS app
FROM %(base)s
COPY --from=app /opt/edgedecode/venv /opt/edgedecode/venv
COPY edgedecode.service edgedecode-prefill.service /etc/systemd/system/
COPY same-host.conf /etc/systemd/system/edgedecode.service.d/same-host.conf
COPY local.conf /etc/systemd/system/edgedecode.service.d/local.conf
COPY local.conf /etc/systemd/system/edgedecode-prefill.service.d/local.conf
COPY edgedecode.toml /etc/edgedecode/edgedecode.toml
COPY edgedecode.env /etc/edgedecode/edgedecode.env
RUN chmod 0600 /etc/edgedecode/edgedecode.env && systemctl enable edgedecode-prefill.service edgedecode.service
"""
LOCAL_DROP_IN = """\
[Service]
Environment=EDGEDECODE_WHEEL_DIR=/etc/edgedecode/wheels
Environment=EDGEDECODE_MODEL_THREADS=1
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """The systemd base with the CPU image's venv and the units installed as docs/deploy.md says."""
    base = base_image_or_skip()
    if podman("image", "exists", SYSTEMD_BASE, check=False).returncode != 0:
        made_by = f"python tools/deploy/base_image.py --systemd --tag {SYSTEMD_BASE}"
        pytest.skip(f"no {SYSTEMD_BASE}: make it with `{made_by}`")
    build(ROOT / "docker/Dockerfile.cpu", CPU_TAG, base)
    context = tmp_path_factory.mktemp("systemd-image")
    for unit in UNITS:
        shutil.copy(ROOT / "systemd" / unit, context)
    shutil.copy(ROOT / "systemd/examples/same-host.conf", context)
    (context / "local.conf").write_text(LOCAL_DROP_IN)
    (context / "edgedecode.toml").write_text('[model]\nname = "smollm2-135m-instruct"\ndevice = "cpu"\n')
    token, prefill_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    (context / "edgedecode.env").write_text(
        f"EDGEDECODE_DAEMON_AUTH_TOKEN={token}\nEDGEDECODE_DAEMON_PREFILL_TOKEN={prefill_token}\n"
        f"EDGEDECODE_PREFILL_AUTH_TOKEN={prefill_token}\n"
    )
    (context / "Containerfile").write_text(RECIPE % {"base": SYSTEMD_BASE})
    build(context / "Containerfile", TAG, CPU_TAG, context)
    return token


@pytest.fixture(scope="module")
def machine(image) -> Iterator[tuple[str, str]]:
    """(container name, daemon token) of the booted systemd container; systemd is its PID 1."""
    name = f"edgedecode-systemd-{secrets.token_hex(4)}"
    args = ["run", "-d", "--name", name, "--systemd=always", "--cap-add=SYS_ADMIN"]
    args += ["-v", f"{CACHE_VOLUME}:/var/cache/private/edgedecode"]
    if wheels := os.environ.get("EDGEDECODE_WHEEL_DIR"):
        args += ["-v", f"{Path(wheels).resolve()}:/etc/edgedecode/wheels:ro"]
    podman(*args, TAG, "/sbin/init")
    try:
        yield name, image
    finally:
        print(sh(name, "journalctl", "--no-pager", "-n", "60", check=False).stdout[-6000:])
        podman("rm", "-f", "-t", "10", name, check=False)


def sh(name: str, *command: str, check: bool = True, timeout: float = 120):
    return podman("exec", name, *command, check=check, timeout=timeout)


def show(name: str, unit: str, *props: str) -> dict[str, str]:
    out = sh(name, "systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_active(name: str, unit: str, not_pid: str = "") -> dict[str, str]:
    """The unit's state once active with a main PID other than ``not_pid``; fails if it fails first."""
    deadline = time.monotonic() + START_S
    props = ("ActiveState", "SubState", "MainPID", "StatusText", "NRestarts", "Result")
    while time.monotonic() < deadline:
        state = show(name, unit, *props)
        if state["ActiveState"] == "active" and state["MainPID"] not in ("0", not_pid):
            return state
        assert state["ActiveState"] != "failed", f"{unit} failed: {state}"
        time.sleep(3)
    pytest.fail(f"{unit} not active within {START_S} s: {show(name, unit, *props)}")


def test_pid_1_is_systemd(machine):
    name, _ = machine
    assert sh(name, "cat", "/proc/1/comm").stdout.strip() == "systemd"


def test_units_turn_ready_by_sd_notify_with_their_drop_ins(machine):
    name, token = machine
    for unit in UNITS:
        state = wait_active(name, unit)
        assert state["SubState"] == "running"
        assert "smollm2-135m-instruct at http://127.0.0.1:" in state["StatusText"], state  # the service's STATUS=
        unit_state = show(name, unit, "Type", "NotifyAccess", "DropInPaths", "User", "DynamicUser")
        assert (unit_state["Type"], unit_state["NotifyAccess"], unit_state["DynamicUser"]) == ("notify", "main", "yes")
        assert "/local.conf" in unit_state["DropInPaths"]
        uid = sh(name, "awk", "/^Uid:/ {print $2}", f"/proc/{state['MainPID']}/status").stdout.strip()
        assert sh(name, "getent", "passwd", uid).stdout.startswith("edgedecode:"), uid  # the dynamic user
    daemon = show(name, "edgedecode.service", "DropInPaths", "Environment", "After")
    assert "/same-host.conf" in daemon["DropInPaths"]
    assert "EDGEDECODE_DAEMON_PREFILL_URL=http://127.0.0.1:8089" in daemon["Environment"]
    assert "edgedecode-prefill.service" in daemon["After"]
    answer = sh(name, "/opt/edgedecode/venv/bin/python", "-c", CHAT % {"token": token}, timeout=300).stdout
    assert answer.strip(), "an empty answer"


CHAT = """\
import json, urllib.request
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}
req = urllib.request.Request("http://127.0.0.1:8088/v1/chat/completions", data=json.dumps(body).encode(),
    headers={"Authorization": "Bearer %(token)s", "Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=280))["choices"][0]["message"]["content"])
"""


def test_systemd_restarts_the_daemon_after_kill_9(machine):
    name, _ = machine
    before = wait_active(name, "edgedecode.service")
    sh(name, "sh", "-c", f"kill -9 {before['MainPID']}")  # the image has no procps: the shell's kill
    after = wait_active(name, "edgedecode.service", not_pid=before["MainPID"])
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1, (before, after)
    journal = sh(name, "journalctl", "--no-pager", "-u", "edgedecode.service").stdout
    assert "status=9/KILL" in journal
