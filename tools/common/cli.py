"""The skeleton every tool's ``main()`` is built on: its parser (``--help`` shows the tool's docstring), the
options many tools share, logging, the JSON a tool writes, and the record of what ran where.

A tool is a script under ``tools/<group>/``, run as a file from the repo root
(``python tools/bench/decode.py --runs 3``). Its first lines put the repo root first on the path when it
runs as a file, so tools import each other and this package as ``tools.<group>.<module>``, exactly as
``python -m tools.bench.decode`` or a test (``tests/tool_modules.py``) imports them::

    if not __package__:  # run as a file: import tools.* (and edgedecode) from the repo root, as `python -m` would
        sys.path[0] = str(Path(__file__).resolve().parents[2])

    from tools.common import cli

    def main(argv: list[str] | None = None) -> int | None:
        p = cli.parser(__doc__)
        cli.add_model(p)
        cli.add_json_file(p, "--json-out")
        args = p.parse_args(argv)
        ...

    if __name__ == "__main__":
        cli.run(main)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[2]  # the repo root


def run(main: Callable[[list[str] | None], int | None]) -> NoReturn:
    """A tool's entry point: log to stderr (the tool's own INFO lines, the library's warnings), run
    ``main`` on the command line's arguments and exit with its status (None: 0)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    for name in ("__main__", "tools"):
        logging.getLogger(name).setLevel(logging.INFO)
    sys.exit(main(None))


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A tool's argument parser: its description is the tool's docstring, line breaks kept."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(p: argparse.ArgumentParser, default: str | None = None, help: str | None = None) -> None:
    """``--model NAME``: a registered model (None: the default model)."""
    p.add_argument("--model", default=default, help=help or "a registered model (default: the default model)")


def add_threads(p: argparse.ArgumentParser, default: int | None = 2, help: str = "onnxruntime threads") -> None:
    """``--threads N``: the onnxruntime threads of each engine or server the tool runs."""
    p.add_argument("--threads", type=int, default=default, help=help)


def add_runs(p: argparse.ArgumentParser, default: int, help: str = "measured runs (the tool reports medians)") -> None:
    """``--runs N``: how many times each measurement is repeated."""
    p.add_argument("--runs", type=int, default=default, help=help)


def add_past(p: argparse.ArgumentParser, default: list[int]) -> None:
    """``--past N [N ...]``: tokens already in the KV cache when the measured decode steps start."""
    p.add_argument("--past", type=int, nargs="+", default=default, help="past lengths (tokens in the KV)")


def add_accuracy_level(
    p: argparse.ArgumentParser, default: int = 4, help: str = "the decode graph's MatMulNBits accuracy_level"
) -> None:
    """``--accuracy-level N``: 4 as shipped (int8 activations), 0 for exact float32 arithmetic."""
    p.add_argument("--accuracy-level", type=int, default=default, help=help)


def add_json_flag(p: argparse.ArgumentParser, help: str = "print the results as JSON instead of the table") -> None:
    """``--json`` (a switch): the results go to stdout as JSON (``print_json``)."""
    p.add_argument("--json", action="store_true", help=help)


def add_json_file(p: argparse.ArgumentParser, flag: str = "--json", help: str = "write the results here") -> None:
    """``--json PATH`` or ``--json-out PATH``: the results are also written to a file (``write_json``)."""
    p.add_argument(flag, type=Path, default=None, metavar="PATH", help=help)


def to_json(obj: Any, indent: int | None = 1) -> str:
    """``obj`` as the JSON every tool writes: ``indent`` spaces (None: one line), paths as strings."""
    return json.dumps(obj, indent=indent, default=_json_default)


def print_json(obj: Any, indent: int | None = 1) -> None:
    """``obj`` as JSON on stdout."""
    print(to_json(obj, indent))


def write_json(obj: Any, path: Path, indent: int | None = 1) -> None:
    """``obj`` as JSON at ``path`` (its directory made), ending in a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(obj, indent) + "\n")


def saved_or_measured(args: argparse.Namespace, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The run a tool reports: the saved one ``--report PATH`` names (e.g. made on another machine), or a new
    one from ``measure()``, which is written to ``--json PATH`` when given."""
    if args.report is not None:
        return json.loads(args.report.read_text())
    run = measure()
    if args.json:
        write_json(run, args.json)
    return run


def settings(args: argparse.Namespace, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """The parsed arguments as a JSON-ready dict (paths as strings), without ``leave_out``."""
    return {key: str(v) if isinstance(v, Path) else v for key, v in vars(args).items() if key not in leave_out}


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line that ran the tool at ``script`` (its ``__file__``), as typed at the repo root."""
    path = Path(script).resolve().relative_to(ROOT).as_posix()
    return " ".join(["python", path, *(sys.argv[1:] if argv is None else argv)])


def record(script: str, argv: Sequence[str] | None, started_s: float) -> dict[str, Any]:
    """The head of a run's record: the command line that ran it (``command``), when it started (``started_s``,
    ``time.time()``) and the machine."""
    date = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started_s))
    return {"command": command(script, argv), "date": date, "machine": machine(), "code": git_state()}


def git_state() -> dict[str, Any]:
    """The code a run measured: the checkout's commit and whether tracked files differed from it (``dirty``);
    None for each where git cannot say (not a checkout)."""

    def git(*args: str) -> str | None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return out.stdout.strip()
        return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def cpu_name() -> str:
    """The processor as ``platform`` names it (the machine type where it cannot)."""
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Platform, CPU model, the CPUs this process may use and the GPU's name (None without nvidia-smi)."""
    cpu = cpu_name()
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    gpu = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        gpu = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return {"platform": platform.platform(), "cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "gpu": gpu}


def _json_default(value: Any) -> str:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
