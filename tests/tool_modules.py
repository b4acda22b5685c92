"""The benchmark and report tools under tools/ are scripts, not part of the package: tests import them as
``tools.<group>.<module>`` from the repo root, as the tools import each other (tools/common/cli.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def import_tools(*names: str) -> tuple[ModuleType, ...]:
    """The modules ``tools/<group>/<name>.py``, each named ``"<group>.<name>"`` (``"bench.decode"``)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    return tuple(importlib.import_module(f"tools.{name}") for name in names)
