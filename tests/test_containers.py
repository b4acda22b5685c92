"""The container recipes in docker/: checked statically always, built where podman works when asked to.

The static checks fail on what would break a build or a container, without building: a COPY source
missing from the repo or left out of the build context by .dockerignore, an extra pyproject.toml
does not define, an entrypoint that is no `edgedecode` command, a health check on a path the daemon
does not serve, ENV settings the configuration refuses, a root user, a model cache outside the volume.
The health check script itself runs against a stand-in daemon. The builds are opt-in (EDGEDECODE_TEST_DEPLOY=1,
tests/container_engine.py): they take minutes, and the CUDA image pulls gigabytes of wheels.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import typer.main
from container_engine import base_image_or_skip, build
from dockerfile_parse import DockerfileParser

from edgedecode.cli import app
from edgedecode.config import Config, ConfigError, DaemonConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
RECIPES = {"Dockerfile.cpu": ("cpu", "cpu"), "Dockerfile.cuda": ("gpu", "cuda")}  # file: (extra, model.device)
HEALTHCHECK_SCRIPT = ROOT / "docker/healthcheck.py"


@dataclass
class Instruction:
    name: str
    value: str
    stage: int


def instructions(recipe: str) -> list[Instruction]:
    """The recipe's instructions, continuation lines joined, ARGs not substituted, with their stage's index."""
    parser = DockerfileParser(fileobj=(ROOT / "docker" / recipe).open("rb"), env_replace=False)
    out, stage = [], -1
    for item in parser.structure:
        name = item["instruction"].upper()
        stage += name == "FROM"
        if name != "COMMENT":
            out.append(Instruction(name, item["value"], stage))
    return out


def one(recipe: str, name: str) -> Instruction:
    found = [i for i in instructions(recipe) if i.name == name]
    assert len(found) == 1, f"{recipe}: {len(found)} {name} instructions"
    return found[0]


def image_env(recipe: str) -> dict[str, str]:
    """ENV of the final stage (KEY=VALUE pairs; ${PATH}-style references left as written)."""
    final = max(i.stage for i in instructions(recipe))
    env = {}
    for instruction in instructions(recipe):
        if instruction.name == "ENV" and instruction.stage == final:
            env.update(dict(pair.split("=", 1) for pair in instruction.value.split()))
    return env


def exec_form(value: str) -> list[str]:
    """An instruction's JSON (exec) form; shell forms are refused (no signal reaches a shell-wrapped daemon)."""
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(word, str) for word in parsed), value
    return parsed


# ---- .dockerignore: Docker's rules (last matching line wins, "!" re-includes, a match covers the
# paths under it, "**" spans folders) for the patterns this repo uses ---------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        patterns.append((negated, _pattern_regex(line.lstrip("!").strip("/"))))
    return patterns


def ignored(path: str) -> bool:
    """Whether .dockerignore leaves ``path`` (relative to the repository root) out of the build context."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, regex in ignore_patterns():
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def test_the_dockerignore_reading_follows_dockers_rules():
    assert ignored("models/README.md") and ignored(".git/config") and ignored("docs/deploy.md")
    assert not any(
        ignored(path) for path in ("pyproject.toml", "README.md", "edgedecode/cli.py", "edgedecode/model/fetch.py")
    )
    assert ignored("edgedecode/__pycache__/cli.cpython-312.pyc") and ignored("docker/Dockerfile.cpu")
    assert not ignored("docker/healthcheck.py")


# ---- the static checks ------------------------------------------------------------------------------


def copies(recipe: str) -> Iterator[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context (not --from another stage)."""
    for instruction in instructions(recipe):
        if instruction.name == "COPY" and "--from=" not in instruction.value:
            words = instruction.value.split()
            assert not any(w.startswith("--") for w in words), instruction.value
            yield words[:-1], words[-1]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_copied_path_exists_and_is_in_the_build_context(recipe):
    sources = [source for sources, _ in copies(recipe) for source in sources]
    assert sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"{recipe}: COPY {source}: not in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py")]
        assert files and not any(ignored(str(f.relative_to(ROOT))) for f in files), (
            f"{recipe}: COPY {source}: .dockerignore leaves it out of the build context"
        )
    readme = PYPROJECT["project"]["readme"]  # setuptools reads it to build the package
    assert readme in sources and "pyproject.toml" in sources and "edgedecode" in sources


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_installed_extra_exists_and_matches_the_device(recipe):
    extra, device = RECIPES[recipe]
    installs = [i.value for i in instructions(recipe) if i.name == "RUN" and "pip install" in i.value]
    extras = {name for run in installs for group in re.findall(r"/src\[([\w,-]+)\]", run) for name in group.split(",")}
    assert extras == {extra}
    assert set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    assert image_env(recipe)["EDGEDECODE_MODEL_DEVICE"] == device


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_entrypoint_is_the_daemon(recipe):
    command = exec_form(one(recipe, "ENTRYPOINT").value) + exec_form(one(recipe, "CMD").value)
    assert command == ["edgedecode", "serve"]
    assert PYPROJECT["project"]["scripts"]["edgedecode"] == "edgedecode.cli:app"
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert command[1] in commands


def daemon_get_routes() -> set[str]:
    """Paths the decode daemon's app and the shared routes register with router.add_get (read from the source)."""
    paths = set()
    for source in ("edgedecode/daemon/app.py", "edgedecode/serving/http.py"):
        for node in ast.walk(ast.parse((ROOT / source).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_get":
                first = node.args[0] if node.args else None
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    paths.add(first.value)
    return paths


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_health_check_asks_readyz_of_this_daemon(recipe):
    check = one(recipe, "HEALTHCHECK").value
    command = exec_form(check[check.index("CMD") + 3 :].strip())
    assert command[0] == "python" and len(command) == 2
    assert any(HEALTHCHECK_SCRIPT.relative_to(ROOT).as_posix() in sources and dest == command[1]
               for sources, dest in copies(recipe))  # fmt: skip
    assert re.search(r"--start-period=(\d+)m", check) and int(re.search(r"--start-period=(\d+)m", check)[1]) >= 10
    assert healthcheck_paths() == {"/readyz"} and "/readyz" in daemon_get_routes()


def healthcheck_paths() -> set[str]:
    """The URL paths written in the health check script (string pieces such as "/readyz")."""
    tree = ast.parse(HEALTHCHECK_SCRIPT.read_text())
    pieces = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {piece for piece in pieces if re.fullmatch(r"/[a-z][a-z/]*", piece)}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_image_runs_as_a_user_with_its_cache_on_the_volume(recipe):
    env = image_env(recipe)
    uid = next(i.value.split("=")[1] for i in instructions(recipe) if i.name == "ARG" and i.value.startswith("UID="))
    user = one(recipe, "USER").value.replace("${UID}", uid)
    assert user.split(":")[0] not in ("0", "root") and user.split(":")[0].isdigit()
    assert exec_form(one(recipe, "VOLUME").value) == [env["EDGEDECODE_HOME"]]
    exposed = one(recipe, "EXPOSE").value
    assert exposed == env["EDGEDECODE_DAEMON_PORT"] == str(DaemonConfig.port)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_images_settings_are_a_configuration_the_daemon_accepts(recipe, tmp_path):
    env = {k: v for k, v in image_env(recipe).items() if k.startswith("EDGEDECODE_")}
    # the state directory must exist and be the user's: it is the home useradd creates
    useradd = next(i.value for i in instructions(recipe) if i.name == "RUN" and "useradd" in i.value)
    assert f"--home-dir {env['EDGEDECODE_DAEMON_STATE_DIR']} --create-home" in " ".join(useradd.split())
    env["EDGEDECODE_DAEMON_STATE_DIR"] = str(tmp_path)  # (load_config checks that it is writable)
    # load_config refuses an unknown key of a known section, and ignores a variable of no section at all
    sections = tuple(f"EDGEDECODE_{f.name.upper()}_" for f in dataclasses.fields(Config) if f.name != "source")
    others = {"EDGEDECODE_HOME", "EDGEDECODE_PROGRESS"}  # the model cache; bars off (edgedecode.progress)
    unknown = sorted(name for name in env if name not in others and not name.startswith(sections))
    assert not unknown, f"{recipe}: ENV names no configuration section: {unknown}"
    # 0.0.0.0 without a token is refused: the image needs one at `docker run -e`
    with pytest.raises(ConfigError, match="auth_token"):
        load_config(Path(os.devnull), env=env, server="daemon")
    config = load_config(Path(os.devnull), env=env | {"EDGEDECODE_DAEMON_AUTH_TOKEN": "t"}, server="daemon")
    assert config.daemon.host == "0.0.0.0" and config.model.device == RECIPES[recipe][1]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_base_image_has_a_python_the_package_supports(recipe):
    default = next(i.value for i in instructions(recipe) if i.name == "ARG" and i.value.startswith("PYTHON_IMAGE="))
    version = re.fullmatch(r"PYTHON_IMAGE=python:(\d+)\.(\d+)-slim-\w+", default)
    assert version, default
    minimum = re.fullmatch(r">=(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minimum and tuple(map(int, version.groups())) >= tuple(map(int, minimum.groups()))
    froms = [i.value for i in instructions(recipe) if i.name == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]


# ---- the health check script against a stand-in daemon ----------------------------------------------


class _Readyz(BaseHTTPRequestHandler):
    status = 200
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self):
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in_daemon() -> Iterator[HTTPServer]:
    server = HTTPServer(("127.0.0.1", 0), _Readyz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    _Readyz.seen.clear()


def run_healthcheck(port: int, token: str = "secret") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGEDECODE_DAEMON_HOST="0.0.0.0", EDGEDECODE_DAEMON_PORT=str(port))
    env["EDGEDECODE_DAEMON_AUTH_TOKEN"] = token
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_health_check_passes_on_200_and_fails_otherwise(stand_in_daemon, monkeypatch):
    port = stand_in_daemon.server_address[1]
    result = run_healthcheck(port)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _Readyz.seen == [("/readyz", "Bearer secret")]

    monkeypatch.setattr(_Readyz, "status", 503)  # the decode worker unhealthy
    result = run_healthcheck(port)
    assert result.returncode == 1 and "503" in result.stdout

    stand_in_daemon.shutdown()
    stand_in_daemon.server_close()
    result = run_healthcheck(port)  # nothing listening yet (the model still loading)
    assert result.returncode == 1 and "unhealthy" in result.stdout


# ---- a real build, where podman works and the tests are asked to (tests/container_engine.py) -----------


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_recipe_builds(recipe):
    build(ROOT / "docker" / recipe, f"localhost/edgedecode-test:{recipe.split('.')[-1]}", base_image_or_skip())
