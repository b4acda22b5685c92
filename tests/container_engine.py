"""podman for the deploy tests: whether these tests may build and run images here, and the calls they make.

Building an image takes minutes (vfs storage copies every layer), so the tests that build or run one are
opt-in: ``EDGEDECODE_TEST_DEPLOY=1``. Then each capability is probed, and a test that lacks one is skipped
with the probe's own error: podman present and its storage usable (``podman info``), the base image
present or pullable (``EDGEDECODE_TEST_PYTHON_IMAGE``, default the recipes' ``python:3.12-slim-bookworm``;
on a host without a registry, make one with ``tools/deploy/base_image.py``), a container able to run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPT_IN = "EDGEDECODE_TEST_DEPLOY"
DEFAULT_BASE = "python:3.12-slim-bookworm"  # docker/Dockerfile.*'s PYTHON_IMAGE default
BUILD_TIMEOUT_S = 3600


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``podman ARGS``; with ``check``, a failure raises with podman's own error in the message."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: {last_line(done)}")
    return done


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1][:300] if lines else "no output"


def base_image_or_skip() -> str:
    """The base image the recipes build on here, after checking podman can store and run it; else a skip."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"builds and runs container images (minutes): set {OPT_IN}=1")
    if shutil.which("podman") is None:
        pytest.skip("no podman (apt-get install podman buildah)")
    info = podman("info", check=False)
    if info.returncode != 0:
        pytest.skip(f"`podman info` failed: {last_line(info)}")
    base = os.environ.get("EDGEDECODE_TEST_PYTHON_IMAGE", DEFAULT_BASE)
    if podman("image", "exists", base, check=False).returncode != 0:
        pulled = podman("pull", base, timeout=1800, check=False)
        if pulled.returncode != 0:
            pytest.skip(
                f"base image {base} cannot be pulled ({last_line(pulled)}); without a registry, make one with "
                "`python tools/deploy/base_image.py` and set "
                "EDGEDECODE_TEST_PYTHON_IMAGE=localhost/edgedecode-base:bookworm"
            )
    ran = podman("run", "--rm", "--network=none", base, "python3", "-c", "pass", check=False)
    if ran.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {last_line(ran)}")
    return base


def build(recipe: Path, tag: str, base: str, context: Path = ROOT) -> None:
    """Build ``recipe`` as ``tag`` on ``base``, in docker format (OCI images drop HEALTHCHECK)."""
    podman(
        "build", "--format=docker", f"--build-arg=PYTHON_IMAGE={base}", "-f", str(recipe), "-t", tag, str(context),
        timeout=BUILD_TIMEOUT_S,
    )  # fmt: skip
