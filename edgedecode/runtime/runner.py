"""Runs a built graph over one sequence's KV cache: the onnxruntime session, its IO binding, the CUDA-graph step.

A ``GraphSession`` is one onnxruntime session of a built graph on a device; engines of the same model
share it (the weights loaded once), each with its own ``ModelRunner``: the session's IO binding over
that engine's KV buffers (bound as both past and present, so attention appends in place) and, where
onnxruntime captures CUDA graphs, its own captured decode step.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.cuda_graph import CAPTURED_GRAPH_ID, UNCAPTURED_GRAPH_ID, CudaGraphStep
from edgedecode.runtime.sequence import Sequence
from edgedecode.runtime.session import create_session, graph_run_options

logger = logging.getLogger(__name__)


class CudaGraphError(EdgeDecodeError):
    """The decode step could not be captured as a CUDA graph (construct the Engine with cuda_graph=False)."""


@dataclass
class GraphSession:
    """One onnxruntime session of a built graph on a device, shared by the runners of engines of one model."""

    session: Any  # onnxruntime.InferenceSession
    options: GraphOptions
    device: str
    cuda_graph: bool  # single-token steps replay a captured CUDA graph (one capture per runner)
    graph_ids: Iterator[int]  # the next runner's capture id in this session

    @classmethod
    def open(
        cls,
        model: LoadedModel,
        options: GraphOptions,
        device: str,
        threads: int | None,
        profile: bool,
        cuda_graph: bool,
    ) -> GraphSession:
        """The session of ``model``'s graph for ``options``, capturing CUDA graphs where asked for and
        onnxruntime accepts it (else without, with a logged reason)."""
        path = model.graph(options)
        ids = itertools.count(CAPTURED_GRAPH_ID)
        own = options.kernels == "gguf"  # the graph has edgedecode's own ops: register their library
        if cuda_graph and device == "cuda" and not options.emit_queries and not profile:
            try:
                session = create_session(
                    path, device=device, threads=threads, profile=profile, cuda_graph=True, own_kernels=own
                )
                return cls(session, options, device, True, ids)
            except Exception as exc:  # onnxruntime refuses capture, e.g. a compute node left on the CPU
                logger.warning("decoding without CUDA graphs: onnxruntime refused capture (%s)", exc)
        session = create_session(path, device=device, threads=threads, profile=profile, own_kernels=own)
        return cls(session, options, device, False, ids)


class ModelRunner:
    """Runs tokens staged in a ``Sequence`` through a graph session, appending their KV to the sequence's cache."""

    queries: np.ndarray  # the last run's queries output (graphs built with emit_queries)

    def __init__(self, graph: GraphSession, sequence: Sequence) -> None:
        spec, options, cache = sequence.spec, graph.options, sequence.cache
        self.graph = graph
        self.sequence = sequence
        self._session = graph.session
        self._spec = spec
        self._emit_queries = options.emit_queries
        self._mask = np.ones((1, cache.max_context), np.int64)
        self._last_position = np.array([-1], np.int64)
        self._logits = np.empty((1, 1, spec.vocab_size), options.np_dtype)
        self._io = graph.session.io_binding()
        for layer, pair in enumerate(cache.ortvalues):
            for name, buffer in zip(("key", "value"), pair):
                self._io.bind_ortvalue_input(f"past_key_values.{layer}.{name}", buffer)
                self._io.bind_ortvalue_output(f"present.{layer}.{name}", buffer)
        # With CUDA graphs, runs other than the captured decode step are tagged "not captured".
        self._run_options = graph_run_options(UNCAPTURED_GRAPH_ID) if graph.cuda_graph else None
        self._graph_step = (
            CudaGraphStep(graph.session, cache, spec.vocab_size, options.np_dtype, next(graph.graph_ids))
            if graph.cuda_graph
            else None
        )

    def warm_up(self, token: int) -> None:
        """Run ``token`` once, then forget it: the first run allocates onnxruntime's arenas (and captures
        the CUDA graph)."""
        self.sequence.stage(np.array([token], np.int64))
        try:
            self.run(1, False)
        except Exception as exc:
            if not self.graph.cuda_graph:
                raise
            raise CudaGraphError(f"capturing the decode step as a CUDA graph failed: {exc}") from exc
        self.sequence.reset()

    def step(self, token: int) -> np.ndarray:
        """Append ``token`` after the held slots and run it (a decode step; the caller checked there is
        room); returns its logits [vocab], a view the next run overwrites."""
        sequence = self.sequence
        sequence.tokens[sequence.length] = token
        return self.run(1, False)

    def run(self, n: int, all_logits: bool) -> np.ndarray:
        """Run the ``n`` tokens staged after the held slots through the graph in one run, appending their
        KV; returns every row's logits [n, vocab] (``all_logits``) or the last row's [vocab], a view into a
        buffer the next run overwrites. One token for its last logits replays the captured CUDA graph
        where there is one."""
        sequence = self.sequence
        start = sequence.length
        position = sequence.advance(n)
        graph_step = self._graph_step
        if graph_step is not None and n == 1 and not all_logits:
            logits = graph_step.run(int(sequence.tokens[start]), start, position)
        else:
            logits = self._run_bound(start, n, all_logits)
        sequence.length = start + n
        return logits

    def _run_bound(self, start: int, n: int, all_logits: bool) -> np.ndarray:
        """One run through the IO binding: the slots [start, start + n) as inputs, logits (and queries) out."""
        sequence, io = self.sequence, self._io
        io.bind_cpu_input("input_ids", sequence.tokens[None, start : start + n])
        io.bind_cpu_input("attention_mask", self._mask[:, : start + n])
        io.bind_cpu_input("position_ids", sequence.positions[:, start : start + n])
        if all_logits:
            positions = np.arange(n, dtype=np.int64)
            logits = np.empty((1, n, self._spec.vocab_size), self._logits.dtype)
        else:
            positions, logits = self._last_position, self._logits
        io.bind_cpu_input("logits_positions", positions)
        io.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        if self._emit_queries:
            s = self._spec
            self.queries = np.empty((s.n_layers, 1, len(positions), s.n_heads * s.head_dim), logits.dtype)
            for layer, rows in enumerate(self.queries):
                io.bind_output(f"queries.{layer}", "cpu", 0, rows.dtype, rows.shape, rows.ctypes.data)
        self._session.run_with_iobinding(io, self._run_options)
        return logits[0] if all_logits else logits[0, 0]
