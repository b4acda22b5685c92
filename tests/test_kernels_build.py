"""`pip install` builds the kernels library when it can and still installs when it cannot (setup.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _wheel_builder() -> bool:
    """Whether this environment's setuptools builds wheels by itself (70.1 on; [test] requires it) or has `wheel`."""
    try:
        major, minor = (int(part) for part in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


pytestmark = pytest.mark.skipif(
    not _wheel_builder() or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="needs a setuptools that builds wheels (>= 70.1, in [test]; the install runs offline, without build "
    "isolation) and a C compiler",
)


def install(tmp_path: Path, compiler: str | None) -> Path:
    """`pip install --target` of a copy of this checkout, with CC set to `compiler` if given."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "edgedecode", source / "edgedecode", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = tmp_path / "site"
    env = {**os.environ, **({"CC": compiler} if compiler else {})}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "--target", str(target), str(source)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def load_there(target: Path) -> str:
    """What edgedecode.kernels.load() says in a process that imports edgedecode from `target`."""
    probe = "from edgedecode import kernels; k = kernels.load(); print(k.available, k.path, k.reason, sep='|')"
    env = {**os.environ, "PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=target, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_install_without_a_working_compiler_succeeds_without_the_library(tmp_path):
    target = install(tmp_path, "/bin/false")
    assert not list((target / "edgedecode" / "kernels").glob("*.so"))
    available, _path, reason = load_there(target).split("|")
    assert available == "False" and reason.startswith("not built:")


def test_an_install_with_a_compiler_builds_and_loads_the_library(tmp_path):
    target = install(tmp_path, None)
    library = target / "edgedecode" / "kernels" / "libedgedecode_kernels.so"
    assert library.is_file()
    available, path, reason = load_there(target).split("|")
    if importlib.util.find_spec("onnxruntime") is not None:
        assert (available, reason, Path(path)) == ("True", "", library)
    else:  # the library is there; without onnxruntime nothing can host it
        assert reason == "onnxruntime is not installed"
