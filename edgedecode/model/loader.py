"""A registered model, opened: its GGUF, spec, tokenizer, and built graphs (cached on disk).

Built graphs live beside the model under ``graphs/`` and are keyed by the GGUF's SHA-256, the
builder version and the graph options, so a new GGUF, a builder change or another option never
reuses a stale graph.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import onnx
from onnx.external_data_helper import set_external_data

from edgedecode.model.gguf_file import open_gguf
from edgedecode.model.graph import GraphOptions, build_graph
from edgedecode.model.registry import ModelRecord, model_dir, resolve_model
from edgedecode.model.requant import NATIVE
from edgedecode.model.spec import ModelSpec
from edgedecode.model.tokenizer import Tokenizer
from edgedecode.model.weights import load_tensors
from edgedecode.progress import NO_PROGRESS, Progress

logger = logging.getLogger(__name__)
# Bump whenever graph.py, weights.py or onnx_builder.py change what they emit (6: the architectures of
# ARCHITECTURES, and initializers in a side file; 7: a tied LM head's own initializer, stored once;
# 8: the "gguf" kernel form, edgedecode's own ops over the GGUF's blocks; 9: its CUDA form fused, FusedMatMulGGUF).
BUILDER_VERSION = 10
# Initializers of at least this many bytes go to the side file (onnx's default threshold), each at an
# offset aligned to the page size, which onnxruntime needs to map them.
SIDE_FILE_MIN_BYTES = 1024
SIDE_FILE_ALIGNMENT = 4096


def side_file(graph: Path) -> Path:
    """The file beside a built graph that holds its initializers."""
    return graph.with_name(f"{graph.name}.data")


def write_graph(model: onnx.ModelProto, graph: Path, side: Path, advance: Callable[[int], None] | None = None) -> None:
    """Save ``model`` to ``graph`` with its initializers in ``side`` (a name in the same folder).

    Initializers with the same bytes are stored once and all point to them (a tied LM head and
    the embedding): onnxruntime maps each initializer on its own, so each keeps its own resident
    pages, while the file holds the bytes once. ``model``'s initializers are left pointing to ``side``.

    Both files are written under names of this process's own and renamed into place, the side file
    first: two processes building the same graph at once each leave whole files, and one that has
    mapped an earlier side file keeps it (rewriting it in place under a live mapping is a SIGBUS).

    ``advance(n)`` is called with each side-file initializer's bytes (:func:`side_file_bytes` in all).
    """
    partial = f"partial-{os.getpid()}"
    partial_side, partial_graph = side.with_name(f"{side.name}.{partial}"), graph.with_name(f"{graph.name}.{partial}")
    stored: dict[bytes, tuple[int, int]] = {}
    with partial_side.open("wb") as out:
        for tensor in model.graph.initializer:
            data = tensor.raw_data
            if len(data) < SIDE_FILE_MIN_BYTES:
                continue
            digest = hashlib.blake2b(data, digest_size=32).digest()
            if digest not in stored:
                offset = -(-out.tell() // SIDE_FILE_ALIGNMENT) * SIDE_FILE_ALIGNMENT
                out.seek(offset)
                out.write(data)
                stored[digest] = (offset, len(data))
            offset, length = stored[digest]
            set_external_data(tensor, side.name, offset, length)
            tensor.ClearField("raw_data")
            if advance is not None:
                advance(len(data))
    onnx.save(model, partial_graph)
    os.replace(partial_side, side)
    os.replace(partial_graph, graph)


def side_file_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers that :func:`write_graph` moves to the side file (before it stores
    identical ones once)."""
    return sum(len(t.raw_data) for t in model.graph.initializer if len(t.raw_data) >= SIDE_FILE_MIN_BYTES)


def graph_bytes(graph: Path) -> int:
    """Bytes on disk of a built graph: the graph file and its side file."""
    side = side_file(graph)
    return graph.stat().st_size + (side.stat().st_size if side.exists() else 0)


def graph_key(gguf_sha256: str, options: GraphOptions) -> str:
    """Cache key of a built graph."""
    payload = json.dumps({"gguf": gguf_sha256, "builder": BUILDER_VERSION, **asdict(options)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class LoadedModel:
    """One model's metadata and tokenizer; graphs are built on first request.

    The GGUF reader is not kept: its parsed fields and mapped pages cost ~170 MB of RSS, and it is
    only needed again to build a graph that is not cached yet.
    """

    record: ModelRecord
    spec: ModelSpec
    tokenizer: Tokenizer

    def graph_path(self, options: GraphOptions) -> Path:
        """Where the graph for these options lives (whether or not it is built yet)."""
        key = graph_key(self.record.sha256, options)
        parts = [options.kind, options.dtype, f"acc{options.accuracy_level}"]
        parts += [] if options.weights == NATIVE else [options.weights]
        parts += [] if options.kernels == "stock" else [options.kernels]
        parts += ["queries"] if options.emit_queries else []
        return model_dir(self.record.name) / "graphs" / f"{'-'.join(parts)}-{key}.onnx"

    def graph(self, options: GraphOptions, tracker: Progress = NO_PROGRESS) -> Path:
        """Path of the built graph for these options, building and caching it if needed.

        A build reports to ``tracker``: the layers read from the GGUF, the layers emitted, the bytes written.
        """
        path = self.graph_path(options)
        if not path.exists():
            logger.info("building %s graph for %s (%s)", options.kind, self.record.name, options)
            layers = self.spec.n_layers
            with tracker.task("reading weights", layers, "layer") as advance:
                reader = open_gguf(self.record.gguf_path)  # not kept: its parsed fields cost RSS (see above)
                tensors = load_tensors(
                    reader,
                    self.spec,
                    dense=options.kind == "prefill",
                    advance=advance,
                    as_stored=options.kernels == "gguf",
                )
                del reader
            with tracker.task(f"building the {options.kind} graph", layers, "layer") as advance:
                model = build_graph(self.spec, tensors, options, advance=advance)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Initializers in a side file: onnxruntime maps it instead of copying it to the heap, which holds
            # ~75 MiB less for SmolLM2 and ~130 MiB less for the 0.5B shape (docs/performance.md), and
            # protobuf refuses a graph over 2 GiB (3B-class models) in one message.
            with tracker.task(f"writing {path.name}", side_file_bytes(model), "B") as advance:
                write_graph(model, path, side_file(path), advance=advance)
        return path


def load_model(name: str | None = None) -> LoadedModel:
    """Open a registered model (the default one when name is None)."""
    record = resolve_model(name)
    reader = open_gguf(record.gguf_path)
    spec = ModelSpec.from_gguf(reader, record.name)
    return LoadedModel(record, spec, Tokenizer.from_gguf(reader, spec))
