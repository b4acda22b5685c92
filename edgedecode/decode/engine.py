"""The token-by-token engine: one onnxruntime session, its KV buffers, prompt processing and decoding.

An Engine runs either built graph (the INT4 decode graph on the edge, or the higher-precision
prefill graph), so KV exported from one engine can be injected into another of the same model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edgedecode.decode.cuda_graph import UNCAPTURED_GRAPH_ID, CudaGraphStep
from edgedecode.decode.kvcache import KVCache, KVInjectionError
from edgedecode.decode.sampler import Sampler, SamplingParams
from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.wire import EDKVHeader, EDKVReader
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.model.session import create_session, graph_run_options

logger = logging.getLogger(__name__)
PREFILL_CHUNK_TOKENS = 512


class ContextOverflowError(EdgeDecodeError):
    """The prompt does not fit the context window."""


class CudaGraphError(EdgeDecodeError):
    """The decode step could not be captured as a CUDA graph (construct the Engine with cuda_graph=False)."""


@dataclass
class GenerationStats:
    """What the last generate() call did and how long it took."""

    prompt_tokens: int = 0
    injected_tokens: int = 0  # prompt tokens whose KV came from elsewhere
    generated_tokens: int = 0
    decode_steps: int = 0  # single-token graph runs after the prompt
    prefill_seconds: float = 0.0  # prompt processing up to the first token's logits
    decode_seconds: float = 0.0  # from the first token's logits to the end of generation
    finish_reason: str = ""  # "stop", "length" or "context"

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_steps and self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        computed = self.prompt_tokens - self.injected_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


class Engine:
    """Runs one built graph over a preallocated KV cache (batch 1)."""

    def __init__(self, model: LoadedModel, options: GraphOptions, *, max_context: int | None = None,
                 device: str = "cpu", threads: int | None = None, profile: bool = False,
                 cuda_graph: bool = True) -> None:
        """``cuda_graph`` (device cuda only, not with ``profile``: replays have no per-operator timings):
        replay single-token decode steps through a captured CUDA graph; falls back to plain runs, with
        a logged reason, where onnxruntime refuses capture."""
        self.spec = model.spec
        self.options = options
        weights = f"weights {options.weights}" if options.kind == "decode" else "dense weights"
        precision = f"{options.kind} graph, {options.dtype}, {weights}"
        self.producer = KVProducer(model.record.name, model.record.sha256, precision)
        self.max_context = min(max_context or self.spec.context_length, self.spec.context_length)
        self.session, self.cuda_graph = self._create_session(model, options, device, threads, profile, cuda_graph)
        self.cache = KVCache(self.spec, self.max_context, options.np_dtype, device)
        self.stats = GenerationStats()
        self._tokens = np.zeros(self.max_context, np.int64)  # token id held by each cache slot
        self._positions = np.zeros((1, self.max_context), np.int64)  # its true position (RoPE)
        self._ramp = np.arange(self.max_context, dtype=np.int64)
        self._mask = np.ones((1, self.max_context), np.int64)
        self._last_position = np.array([-1], np.int64)
        self._logits = np.empty((1, 1, self.spec.vocab_size), options.np_dtype)
        self._io = self.session.io_binding()
        for layer, pair in enumerate(self.cache.ortvalues):
            for name, buffer in zip(("key", "value"), pair):
                self._io.bind_ortvalue_input(f"past_key_values.{layer}.{name}", buffer)
                self._io.bind_ortvalue_output(f"present.{layer}.{name}", buffer)
        # With CUDA graphs, runs other than the captured decode step are tagged "not captured".
        self._run_options = graph_run_options(UNCAPTURED_GRAPH_ID) if self.cuda_graph else None
        self._graph_step = (CudaGraphStep(self.session, self.cache, self.spec.vocab_size, options.np_dtype)
                            if self.cuda_graph else None)
        try:  # warm-up: the first run allocates ORT's arenas (and captures the CUDA graph)
            self.forward(np.array([self.spec.eos_token_id]))
        except Exception as exc:
            if not self.cuda_graph:
                raise
            raise CudaGraphError(f"capturing the decode step as a CUDA graph failed: {exc}") from exc
        self.reset()

    def _create_session(self, model: LoadedModel, options: GraphOptions, device: str, threads: int | None,
                        profile: bool, cuda_graph: bool):
        """(session, whether it captures CUDA graphs): capture where asked for and onnxruntime accepts it."""
        path = model.graph(options)
        if cuda_graph and device == "cuda" and not options.emit_queries and not profile:
            try:
                return create_session(path, device=device, threads=threads, profile=profile, cuda_graph=True), True
            except Exception as exc:  # onnxruntime refuses capture, e.g. a compute node left on the CPU
                logger.warning("decoding without CUDA graphs: onnxruntime refused capture (%s)", exc)
        return create_session(path, device=device, threads=threads, profile=profile), False

    @property
    def length(self) -> int:
        """Number of cache slots in use (tokens whose KV is held; dropped tokens hold none)."""
        return self.cache.length

    @property
    def next_position(self) -> int:
        """True position of the next token appended."""
        return int(self._positions[0, self.length - 1]) + 1 if self.length else 0

    def reset(self) -> None:
        """Forget the cached context (the buffers are overwritten, not freed)."""
        self.cache.length = 0

    def forward(self, token_ids: np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Append tokens at the current position; returns the last logits [vocab] or all of them [n, vocab].

        The last-logits row is a view into a buffer the next call overwrites.
        """
        token_ids = np.asarray(token_ids, np.int64)
        start, n = self.length, len(token_ids)
        if start + n > self.max_context:
            raise ContextOverflowError(f"{start + n} tokens exceed the context of {self.max_context}")
        if self.next_position + n > self.spec.context_length:
            raise ContextOverflowError(f"position {self.next_position + n} exceeds the model's {self.spec.context_length}")
        self._tokens[start:start + n] = token_ids
        outputs = [self._run(min(PREFILL_CHUNK_TOKENS, n - offset), all_logits)
                   for offset in range(0, n, PREFILL_CHUNK_TOKENS)]
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def _run(self, n: int, all_logits: bool) -> np.ndarray:
        """Run the n tokens already written at ``_tokens[length:length + n]`` through the graph."""
        start = self.length
        if self._graph_step is not None and n == 1 and not all_logits:
            return self._replay_step(start)
        io = self._io
        np.add(self._ramp[:n], self.next_position, out=self._positions[0, start:start + n])
        io.bind_cpu_input("input_ids", self._tokens[None, start:start + n])
        io.bind_cpu_input("attention_mask", self._mask[:, :start + n])
        io.bind_cpu_input("position_ids", self._positions[:, start:start + n])
        if all_logits:
            positions = np.arange(n, dtype=np.int64)
            logits = np.empty((1, n, self.spec.vocab_size), self._logits.dtype)
        else:
            positions, logits = self._last_position, self._logits
        io.bind_cpu_input("logits_positions", positions)
        io.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        if self.options.emit_queries:
            self._queries = np.empty((self.spec.n_layers, 1, len(positions), self.spec.n_heads * self.spec.head_dim),
                                     logits.dtype)
            for layer, rows in enumerate(self._queries):
                io.bind_output(f"queries.{layer}", "cpu", 0, rows.dtype, rows.shape, rows.ctypes.data)
        self.session.run_with_iobinding(io, self._run_options)
        self.cache.length = start + n
        return logits[0] if all_logits else logits[0, 0]

    def _replay_step(self, slot: int) -> np.ndarray:
        """The token at ``_tokens[slot]`` through the captured CUDA graph; returns its logits [vocab]."""
        position = self.next_position
        self._positions[0, slot] = position
        logits = self._graph_step.run(int(self._tokens[slot]), slot, position)
        self.cache.length = slot + 1
        return logits

    def prefill(self, prompt_ids: np.ndarray, kv: KVSnapshot | None = None) -> np.ndarray:
        """Reset, inject ``kv`` for a prefix of the prompt if given, and process the rest.

        At least the last prompt token is always run through this engine's graph, so the returned
        next-token logits [vocab] are this graph's own.
        """
        prompt_ids = self._checked_prompt(prompt_ids)
        self.reset()
        if kv is None:
            return self._process_prompt(prompt_ids, np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.cache.check_injectable(kv, prompt_ids)
        injected = self._injectable_count(kv.positions, prompt_ids)
        self.cache.update(0, kv.keys[:, :, :injected], kv.values[:, :, :injected])
        return self._process_prompt(prompt_ids, kv.token_ids[:injected], kv.positions[:injected])

    def open_kv_stream(self, prompt_ids: np.ndarray) -> EDKVReader:
        """A reader for an EDKV stream holding KV of (part of) ``prompt_ids``.

        Feed it the stream as it arrives: each chunk is verified, then dequantized straight into this
        engine's KV buffers (on CUDA, into a host staging buffer uploaded at the end). Then call
        ``prefill_streamed``. A stream for another model, another prompt or too many tokens fails
        with a typed error at its header, before anything is written.
        """
        prompt_ids = self._checked_prompt(prompt_ids)
        self.reset()

        def target(header: EDKVHeader) -> np.ndarray:
            self.cache.check_prompt_match(header.token_ids, header.positions, prompt_ids)
            return self.cache.ingest_target(header.n_kept)

        return EDKVReader(self.spec.kv_contract, max_tokens=self.max_context, target_factory=target)

    def prefill_streamed(self, prompt_ids: np.ndarray, reader: EDKVReader) -> np.ndarray:
        """Adopt what ``reader`` (from ``open_kv_stream``) wrote, once its stream is complete, and
        process the rest of the prompt; returns the next-token logits like ``prefill``."""
        prompt_ids = self._checked_prompt(prompt_ids)
        header = reader.finish()
        kept = header.kept
        token_ids, positions = header.token_ids[kept], header.positions[kept]
        injected = self._injectable_count(positions, prompt_ids)
        self.cache.commit_ingest(injected)
        return self._process_prompt(prompt_ids, token_ids[:injected], positions[:injected])

    def _checked_prompt(self, prompt_ids) -> np.ndarray:
        prompt_ids = np.asarray(prompt_ids, np.int64)
        if len(prompt_ids) == 0:
            raise ContextOverflowError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context} "
                "including at least one generated token"
            )
        return prompt_ids

    @staticmethod
    def _injectable_count(positions: np.ndarray, prompt_ids: np.ndarray) -> int:
        """Tokens of injected KV used: everything before the prompt's last token, which runs here."""
        return int(np.searchsorted(positions, len(prompt_ids) - 1))

    def _process_prompt(self, prompt_ids: np.ndarray, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Record the injected slots (already in the cache), then run the prompt from just after them."""
        injected = len(token_ids)
        self._tokens[:injected] = token_ids
        self._positions[0, :injected] = positions
        self.cache.length = injected
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), injected_tokens=injected)
        resume = int(positions[-1]) + 1 if injected else 0
        return self.forward(prompt_ids[resume:])

    def observe(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Pre-RoPE queries [layers, w, heads*head_dim] of the last w cached tokens, and their positions.

        Runs those tokens again over the same past (their KV is rewritten with what it was); needs a
        graph built with ``emit_queries``. The prefill side scores token importance from these.
        """
        if not self.options.emit_queries:
            raise EdgeDecodeError("this engine's graph was built without emit_queries")
        w = min(window, self.length)
        if w == 0:
            raise KVInjectionError("nothing to observe: no prompt has been processed")
        self.cache.length -= w
        self._run(w, True)
        return self._queries[:, 0], self._positions[0, self.length - w:self.length].copy()

    def export_kv(self) -> KVSnapshot:
        """A copy of the cached KV with its token ids, positions, layout contract and producer."""
        if self.length == 0:
            raise KVInjectionError("nothing to export: no prompt has been processed")
        return self.cache.snapshot(self._tokens[:self.length], self._positions[0, :self.length], self.producer)

    def generate(self, prompt_ids, params: SamplingParams, kv: KVSnapshot | EDKVReader | None = None) -> Iterator[int]:
        """Process the prompt (optionally from injected KV: a snapshot, or a reader from
        ``open_kv_stream`` whose stream is complete) and yield generated token ids one by one.

        Stop tokens end the generation and are not yielded; ``self.stats`` is complete once the
        iterator is exhausted.
        """
        started = time.perf_counter()
        logits = self.prefill_streamed(prompt_ids, kv) if isinstance(kv, EDKVReader) else self.prefill(prompt_ids, kv)
        stats = self.stats
        stops = frozenset(self.spec.stop_token_ids if params.stop_token_ids is None else params.stop_token_ids)
        sampler = Sampler(params)
        first_token_at = time.perf_counter()
        stats.prefill_seconds = first_token_at - started
        stats.finish_reason = "length"
        for _ in range(params.max_tokens):
            token = sampler.pick(logits)
            if token in stops:
                stats.finish_reason = "stop"
                break
            stats.generated_tokens += 1
            yield token
            if stats.generated_tokens == params.max_tokens:
                break
            if self.length >= self.max_context:
                stats.finish_reason = "context"
                break
            self._tokens[self.length] = token
            logits = self._run(1, False)
            stats.decode_steps += 1
        stats.decode_seconds = time.perf_counter() - first_token_at
