"""The GGUF a benchmark runs: a registered model, a file given by path, or a synthetic file of a real
model's shape (tools/bench/synth_gguf.py), written once into ``$EDGEDECODE_HOME/synth/`` and reused.

Each is registered with edgedecode (its graphs are then cached beside it) and handed to both engines
by name, so edgedecode and llama.cpp read the same file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from edgedecode.model.fetch import register_gguf
from edgedecode.model.gguf_file import ModelFileError
from edgedecode.model.registry import UnknownModelError, model_home, resolve_model
from tools.bench.synth_gguf import SHAPES, write_synthetic


def synthetic_path(shape: str, weight_type: str) -> Path:
    """Where the synthetic file of ``shape`` in ``weight_type`` is cached."""
    return model_home() / "synth" / f"{shape}-{weight_type.lower()}.gguf"


def synthetic_model(shape: str, weight_type: str) -> str:
    """The registered name of the synthetic ``shape`` file in ``weight_type``, writing it first if needed."""
    path = synthetic_path(shape, weight_type)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".partial-{os.getpid()}")
        write_synthetic(partial, SHAPES[shape], weight_type, resolve_model(None).gguf_path)
        os.replace(partial, path)
    return gguf_model(path, f"synth-{shape}-{weight_type.lower()}")


def gguf_model(path: Path, name: str | None = None) -> str:
    """The registered name of the GGUF at ``path`` (registered under ``name``, default its stem, unless
    a record of that name already holds this very file unchanged)."""
    name = name or re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._")
    try:
        if resolve_model(name).gguf_path == path.resolve():
            return name
    except (UnknownModelError, ModelFileError):
        pass
    return register_gguf(path, name).name
