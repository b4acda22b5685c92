"""The benchmark and report tools under tools/ are scripts, not a package: tests import them by name."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def import_tools(*names: str) -> tuple[ModuleType, ...]:
    """The modules ``tools/<name>.py``, imported with tools/ on the path (where they find each other)."""
    sys.path.insert(0, str(TOOLS))
    try:
        return tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(str(TOOLS))
