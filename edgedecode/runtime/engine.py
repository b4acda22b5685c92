"""The token-by-token engine: one onnxruntime session, its KV buffers, prompt processing and decoding.

An Engine runs either built graph (the INT4 decode graph on the edge, or the higher-precision
prefill graph), so KV exported from one engine can be injected into another of the same model.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.window import tail_tokens, window_covers
from edgedecode.kv.wire import EDKVHeader, EDKVReader
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.cuda_graph import CAPTURED_GRAPH_ID, UNCAPTURED_GRAPH_ID, CudaGraphStep
from edgedecode.runtime.handoff import KVSource, StreamedKV
from edgedecode.runtime.kvcache import KVCache, KVInjectionError
from edgedecode.runtime.logprobs import LogprobScorer, ScoredRun, ScoredToken
from edgedecode.runtime.sampler import Sampler, SamplingParams
from edgedecode.runtime.session import create_session, graph_run_options

logger = logging.getLogger(__name__)
# Rows of one prompt run. onnxruntime's working memory for a run grows with its rows (attention scores
# rows x heads x past, the MLP's activations) and its arena keeps the largest: on the 0.5B shape, a
# 2048-token prompt peaks 74 MiB lower in runs of 256 than of 512, at the same prefill CPU time
# (docs/performance.md, tools/rss_breakdown.py).
PREFILL_CHUNK_TOKENS = 256


# onnxruntime's CPU GroupQueryAttention handles a run's query rows in tiles of this many; a tile of one
# row (the last row of a run of 1, 129, 257, ... rows) takes a single-row path that rounds differently.
GQA_ROW_TILE = 128


def chunk_sizes(n: int) -> list[int]:
    """Row counts of the graph runs that process ``n`` tokens in a row: at most PREFILL_CHUNK_TOKENS
    each, none of them 1 (mod GQA_ROW_TILE) unless ``n`` is 1.

    On onnxruntime's CPU provider a token's KV, queries and logits are bitwise the same in any run
    (whatever its size and start) except as the lone last row of a run of 1, 129, 257, ... rows:
    attention then takes another path for that row and rounds differently (measured with
    onnxruntime 1.31, 1 to 8 threads; tests/test_prefill_reproducible.py). In the fp32 prefill graph
    that is ~1e-5 in the KV; in the INT4 decode graph (int8 activations) ~0.5 in the logits.
    Avoiding such runs makes a position's KV independent of how the prompt was split, prefix-cache
    reuse included.
    """
    sizes = []
    while n > 0:
        size = min(PREFILL_CHUNK_TOKENS, n)
        while size > 1 and (size % GQA_ROW_TILE == 1 or n - size == 1):
            size -= 1
        sizes.append(size)
        n -= size
    return sizes


def lone_row_free(n: int) -> bool:
    """Whether one run of ``n`` rows computes every row as any other run would (see chunk_sizes)."""
    return n % GQA_ROW_TILE != 1


class ContextOverflowError(EdgeDecodeError):
    """The prompt does not fit the context window."""

    http_status = 422
    http_type = "invalid_request_error"
    http_code = "unprocessable"


class CudaGraphError(EdgeDecodeError):
    """The decode step could not be captured as a CUDA graph (construct the Engine with cuda_graph=False)."""


@dataclass
class GenerationStats:
    """What the last generate() call did and how long it took."""

    prompt_tokens: int = 0
    injected_tokens: int = 0  # prompt tokens whose KV came from elsewhere
    reused_tokens: int = 0  # leading prompt positions whose KV this engine still held from its last use
    computed_tokens: int = 0  # prompt positions run through the graph (the rest were reused or injected)
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

    session: Any  # onnxruntime.InferenceSession
    cuda_graph: bool  # single-token steps replay a captured CUDA graph
    cache: KVCache
    _graph_ids: Iterator[int]
    _queries: np.ndarray  # the last run's queries output (graphs built with emit_queries)

    def __init__(
        self,
        model: LoadedModel,
        options: GraphOptions,
        *,
        max_context: int | None = None,
        device: str = "cpu",
        threads: int | None = None,
        profile: bool = False,
        cuda_graph: bool = True,
        share: Engine | None = None,
    ) -> None:
        """``cuda_graph`` (device cuda only, not with ``profile``: replays have no per-operator timings):
        replay single-token decode steps through a captured CUDA graph; falls back to plain runs, with
        a logged reason, where onnxruntime refuses capture.

        ``share``: run on that engine's onnxruntime session (same model, graph and device) instead of
        creating one; this engine gets its own KV buffers. A server holds one engine per resident
        conversation this way, with the weights loaded once.
        """
        self.spec = model.spec
        self.options = options
        weights = f"weights {options.weights}" if options.kind == "decode" else "dense weights"
        precision = f"{options.kind} graph, {options.dtype}, {weights}"
        self.producer = KVProducer(model.record.name, model.record.sha256, precision)
        self.max_context = min(max_context or self.spec.context_length, self.spec.context_length)
        if share is not None:
            if share.options != options or share.cache.device != device:
                raise EdgeDecodeError("a shared session must run the same graph on the same device")
            self.session, self.cuda_graph, self._graph_ids = share.session, share.cuda_graph, share._graph_ids
        else:
            self.session, self.cuda_graph = self._create_session(model, options, device, threads, profile, cuda_graph)
            self._graph_ids = itertools.count(CAPTURED_GRAPH_ID)  # one CUDA graph capture per engine on the session
        self.cache = KVCache(self.spec, self.max_context, options.kv_np_dtype, device)
        self.stats = GenerationStats()
        self._tokens = np.zeros(self.max_context, np.int64)  # token id held by each cache slot
        self._positions = np.zeros((1, self.max_context), np.int64)  # its true position (RoPE)
        self._history = np.zeros(self.spec.context_length, np.int64)  # token id at every position before next_position
        # the importance that came with each position's KV (EDKV 1.2), NaN where none came: the memory ladder's ranking
        self._importance = np.full(self.spec.context_length, np.nan, np.float32)
        # first cache slot whose windowed (sliding-window) layers hold KV: pulls and restores with an EDKV window
        # bring those layers only for their tail (kv.window); a token runs only where its window lies after it
        self._window_from = 0
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
        self._graph_step = (
            CudaGraphStep(self.session, self.cache, self.spec.vocab_size, options.np_dtype, next(self._graph_ids))
            if self.cuda_graph
            else None
        )
        try:  # warm-up: the first run allocates ORT's arenas (and captures the CUDA graph)
            self.forward(np.array([self.spec.eos_token_id]))
        except Exception as exc:
            if not self.cuda_graph:
                raise
            raise CudaGraphError(f"capturing the decode step as a CUDA graph failed: {exc}") from exc
        self.reset()

    def _create_session(
        self,
        model: LoadedModel,
        options: GraphOptions,
        device: str,
        threads: int | None,
        profile: bool,
        cuda_graph: bool,
    ):
        """(session, whether it captures CUDA graphs): capture where asked for and onnxruntime accepts it."""
        path = model.graph(options)
        own = options.kernels == "gguf"
        if cuda_graph and device == "cuda" and not options.emit_queries and not profile:
            try:
                session = create_session(
                    path, device=device, threads=threads, profile=profile, cuda_graph=True, own_kernels=own
                )
                return session, True
            except Exception as exc:  # onnxruntime refuses capture, e.g. a compute node left on the CPU
                logger.warning("decoding without CUDA graphs: onnxruntime refused capture (%s)", exc)
        return create_session(path, device=device, threads=threads, profile=profile, own_kernels=own), False

    @property
    def length(self) -> int:
        """Number of cache slots in use (tokens whose KV is held; dropped tokens hold none)."""
        return self.cache.length

    @property
    def kv_bytes_per_slot(self) -> int:
        """Bytes of KV one cache slot holds (K and V of every layer)."""
        s = self.spec
        return self.cache.dtype.itemsize * 2 * s.n_layers * s.n_kv_heads * s.head_dim

    @property
    def next_position(self) -> int:
        """True position of the next token appended."""
        return int(self._positions[0, self.length - 1]) + 1 if self.length else 0

    def reset(self) -> None:
        """Forget the cached context (the buffers are overwritten, not freed)."""
        self.cache.length = 0
        self._window_from = 0

    def _window_covers(self, slot: int) -> bool:
        """Whether a token run at cache ``slot`` finds KV in its windowed layers for every slot its window spans."""
        return window_covers(self._window_from, slot, self.spec.kv_contract)

    @property
    def kv_preallocated(self) -> bool:
        """Whether the KV buffers take their whole size from the start (CUDA), not as they fill (CPU)."""
        return self.cache.device != "cpu"

    @property
    def held_positions(self) -> np.ndarray:
        """The true position of each cache slot's token, [length], increasing (a read-only view)."""
        view = self._positions[0, : self.length]
        view.flags.writeable = False
        return view

    def evict(self, positions: np.ndarray) -> None:
        """Drop the KV of the held tokens at ``positions`` (the others move down, in order): the
        context decodes on as after any dropped token, one slot per token lighter."""
        held = self._positions[0, : self.length]
        kept = ~np.isin(held, positions)
        if len(held) - np.count_nonzero(kept) != len(np.unique(positions)):
            raise KVInjectionError("only positions whose KV is held can be evicted")
        n = int(np.count_nonzero(kept))
        self._tokens[:n] = self._tokens[: self.length][kept]
        self._positions[0, :n] = held[kept]
        self._window_from = int(np.count_nonzero(kept[: self._window_from]))
        self.cache.compact(kept)

    def release_unused(self) -> None:
        """Give the memory of the KV buffer's slots past ``length`` back (CPU; see KVCache)."""
        self.cache.release_unused()

    def reusable_prefix(self, prompt_ids) -> int:
        """How many leading positions of ``prompt_ids`` this engine can keep from what it last processed.

        That is the prompt's common prefix with the tokens at positions before ``next_position``
        (prompt, KV received, tokens generated and run), cut back to end at a held slot (a dropped
        token at the end of the prefix is processed again) and to leave the prompt's last token to
        run here. Pass it as ``keep`` to ``open_kv_stream``/``prefill``/``generate``.
        """
        prompt_ids = np.asarray(prompt_ids, np.int64)
        common = min(self.next_position, len(prompt_ids) - 1)
        if common <= 0:
            return 0
        differ = np.flatnonzero(self._history[:common] != prompt_ids[:common])
        common = int(differ[0]) if len(differ) else common
        slots = int(np.searchsorted(self._positions[0, : self.length], common))
        if not self._window_covers(slots):  # its windowed layers hold too little of the prefix's tail to go on from
            return 0
        return int(self._positions[0, slots - 1]) + 1 if slots else 0

    def _keep(self, prompt_ids: np.ndarray, keep: int) -> int:
        """Truncate the cache to the slots of positions [0, keep); returns how many slots stay."""
        if keep == 0:
            self.reset()
            return 0
        reusable = self.reusable_prefix(prompt_ids)
        if not 0 < keep <= reusable:
            raise KVInjectionError(f"cannot keep {keep} positions: this engine holds {reusable} of this prompt")
        slots = int(np.searchsorted(self._positions[0, : self.length], keep))
        if int(self._positions[0, slots - 1]) + 1 != keep:
            raise KVInjectionError(f"keep={keep} does not end at a held token (use reusable_prefix)")
        self.cache.length = slots
        return slots

    def forward(self, token_ids: np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Append tokens at the current position; returns the last logits [vocab] or all of them [n, vocab].

        The last-logits row is a view into a buffer the next call overwrites.
        """
        token_ids = np.asarray(token_ids, np.int64)
        start, n = self.length, len(token_ids)
        self._check_room(n)
        self._tokens[start : start + n] = token_ids
        outputs = [self._run(size, all_logits) for size in chunk_sizes(n)]
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def run_with_queries(self, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append tokens at the current position in one graph run that also outputs their queries;
        returns the pre-RoPE queries [layers, n, heads*head_dim] and the tokens' positions [n].

        Needs a graph built with ``emit_queries``. One run of 1..PREFILL_CHUNK_TOKENS rows, as given:
        its rows are computed as in any other run unless it leaves its last row alone in an attention
        tile (see ``lone_row_free``), which the caller avoids by choosing the tokens.
        """
        if not self.options.emit_queries:
            raise EdgeDecodeError("this engine's graph was built without emit_queries")
        token_ids = np.asarray(token_ids, np.int64)
        start, n = self.length, len(token_ids)
        if not 0 < n <= PREFILL_CHUNK_TOKENS:
            raise ValueError(f"one run takes 1..{PREFILL_CHUNK_TOKENS} tokens, not {n}")
        self._check_room(n)
        self._tokens[start : start + n] = token_ids
        self._run(n, True)  # every row's logits: the queries output has a row for each logits row
        return self._queries[:, 0], self._positions[0, start : start + n].copy()

    def _check_room(self, n: int) -> None:
        """Raise ContextOverflowError unless ``n`` more tokens fit the cache and the model's positions."""
        if self.length + n > self.max_context:
            raise ContextOverflowError(f"{self.length + n} tokens exceed the context of {self.max_context}")
        if self.next_position + n > self.spec.context_length:
            raise ContextOverflowError(
                f"position {self.next_position + n} exceeds the model's {self.spec.context_length}"
            )

    def _run(self, n: int, all_logits: bool) -> np.ndarray:
        """Run the n tokens already written at ``_tokens[length:length + n]`` through the graph."""
        start = self.length
        graph_step = self._graph_step
        if graph_step is not None and n == 1 and not all_logits:
            return self._replay_step(graph_step, start)
        io = self._io
        position = self.next_position
        np.add(self._ramp[:n], position, out=self._positions[0, start : start + n])
        self._history[position : position + n] = self._tokens[start : start + n]
        self._importance[position : position + n] = np.nan
        io.bind_cpu_input("input_ids", self._tokens[None, start : start + n])
        io.bind_cpu_input("attention_mask", self._mask[:, : start + n])
        io.bind_cpu_input("position_ids", self._positions[:, start : start + n])
        if all_logits:
            positions = np.arange(n, dtype=np.int64)
            logits = np.empty((1, n, self.spec.vocab_size), self._logits.dtype)
        else:
            positions, logits = self._last_position, self._logits
        io.bind_cpu_input("logits_positions", positions)
        io.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        if self.options.emit_queries:
            self._queries = np.empty(
                (self.spec.n_layers, 1, len(positions), self.spec.n_heads * self.spec.head_dim), logits.dtype
            )
            for layer, rows in enumerate(self._queries):
                io.bind_output(f"queries.{layer}", "cpu", 0, rows.dtype, rows.shape, rows.ctypes.data)
        self.session.run_with_iobinding(io, self._run_options)
        self.cache.length = start + n
        return logits[0] if all_logits else logits[0, 0]

    def _replay_step(self, graph_step: CudaGraphStep, slot: int) -> np.ndarray:
        """The token at ``_tokens[slot]`` through the captured CUDA graph; returns its logits [vocab]."""
        position = self.next_position
        self._positions[0, slot] = position
        self._history[position] = self._tokens[slot]
        self._importance[position] = np.nan
        logits = graph_step.run(int(self._tokens[slot]), slot, position)
        self.cache.length = slot + 1
        return logits

    @property
    def full(self) -> bool:
        """Whether no further token fits: the cache is full, or the next position is past the model's
        (dropped tokens advance positions without taking slots)."""
        return self.length >= self.max_context or self.next_position >= self.spec.context_length

    def step(self, token: int) -> np.ndarray:
        """Append ``token`` after what is cached and run it (a decode step: through the captured CUDA
        graph where there is one); returns its logits [vocab], a view the next run overwrites.

        Raises:
            ContextOverflowError: the engine is ``full``.
        """
        if self.full:
            raise ContextOverflowError(
                f"no room for a token after {self.length} cached (context {self.max_context}) at position "
                f"{self.next_position} (the model's {self.spec.context_length})"
            )
        return self._step(token)

    def _step(self, token: int) -> np.ndarray:
        self._tokens[self.length] = token
        return self._run(1, False)

    def prefill(self, prompt_ids: np.ndarray, kv: KVSource = None, keep: int = 0) -> np.ndarray:
        """Process the prompt, its KV taken from ``kv`` for (part of) it; returns the next-token logits [vocab].

        ``kv`` (a ``KVSource``): None computes the whole prompt here; a ``KVSnapshot`` is injected; a
        ``StreamedKV`` from this engine's ``open_kv_stream`` has its stream confirmed complete and what
        it wrote adopted. ``keep`` leading positions are kept from this engine's previous use (at
        most ``reusable_prefix(prompt_ids)``; 0 starts afresh); ``kv`` then holds KV of positions
        after them. A stream brings the ``keep`` it was opened with (``keep`` here is 0 or that).
        At least the last prompt token is always run through this engine's graph, so the returned
        logits are this graph's own.
        """
        prompt_ids = self._checked_prompt(prompt_ids)
        if isinstance(kv, StreamedKV):
            return self._adopt_stream(prompt_ids, kv, keep)
        kept = self._keep(prompt_ids, keep)
        if kv is None:
            return self._process_prompt(prompt_ids, kept, keep, np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.cache.check_injectable(kv, prompt_ids)
        self._check_after_kept(kv.positions, keep, kept)
        injected = self._injectable_count(kv.positions, prompt_ids)
        self.cache.update(kept, kv.keys[:, :, :injected], kv.values[:, :, :injected])
        return self._process_prompt(prompt_ids, kept, keep, kv.token_ids[:injected], kv.positions[:injected])

    def start(self, prompt_ids: np.ndarray, kv: KVSnapshot | None = None, injected: int = 0) -> None:
        """Begin ``prompt_ids`` afresh: forget the cached context and take the KV of its first
        ``injected`` positions from the first slots of ``kv`` (which must hold positions 0, 1, 2, ...
        there, e.g. a prefix cache's); run the rest of the prompt with ``forward`` or
        ``run_with_queries``. ``stats`` count the prompt and the injected tokens.

        ``kv``, when given, must fit the prompt (KVInjectionError otherwise), even with ``injected`` 0.
        At least the prompt's last token is left to run here.
        """
        prompt_ids = self._checked_prompt(prompt_ids)
        if kv is not None:
            self.cache.check_injectable(kv, prompt_ids)
        if not 0 <= injected < len(prompt_ids):
            raise ValueError(f"injected must be in 0..{len(prompt_ids) - 1}, not {injected}")
        if injected and (kv is None or not np.array_equal(kv.positions[:injected], self._ramp[:injected])):
            raise KVInjectionError(f"the KV does not hold positions 0..{injected - 1} in its first slots")
        self.reset()
        if injected and kv is not None:
            self.cache.update(0, kv.keys[:, :, :injected], kv.values[:, :, :injected])
        self._tokens[:injected] = prompt_ids[:injected]
        self._positions[0, :injected] = self._ramp[:injected]
        self._history[: len(prompt_ids)] = prompt_ids
        self._importance[:injected] = np.nan
        self.cache.length = injected
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), injected_tokens=injected)

    def open_kv_stream(self, prompt_ids: np.ndarray, keep: int = 0, head: int = 0) -> StreamedKV:
        """The handoff of EDKV streams holding KV of (part of) ``prompt_ids`` after the ``keep``
        positions kept from this engine's previous use (see ``prefill``); those are kept from now on.

        Feed it the streams as they arrive (``runtime.handoff``: segments, each complete or cut):
        each chunk is verified, then dequantized straight into this engine's KV buffers (on CUDA,
        into a host staging buffer uploaded at the end). Then pass it as ``kv`` to ``prefill`` or
        ``generate`` with the same prompt. A segment for another model, another prompt, positions
        already covered or too many tokens fails with a typed error at its header, before anything
        is written.

        ``head``: positions after the kept ones that this engine computes itself (``compute_head``,
        e.g. on another thread while the segments arrive; else when the stream is adopted): the
        segments hold KV of positions after them, landing in the slots after theirs.
        """
        prompt_ids = self._checked_prompt(prompt_ids)
        if not 0 <= head < len(prompt_ids) - keep:
            raise ValueError(f"head must be in [0, {len(prompt_ids) - keep}) for this prompt and keep, not {head}")
        kept = self._keep(prompt_ids, keep)
        self._check_room(head)

        def open_reader(first_position: int, first_slot: int) -> EDKVReader:
            def target(header: EDKVHeader) -> np.ndarray:
                self.cache.check_prompt_match(header.token_ids, header.positions, prompt_ids)
                self._check_after_kept(header.positions, first_position, first_slot)
                return self.cache.ingest_target(first_slot, header.n_kept)

            return EDKVReader(self.spec.kv_contract, max_tokens=self.max_context - first_slot, target_factory=target)

        return StreamedKV(open_reader, prompt_ids, keep, kept, owner=self, head=head)

    def compute_head(self, stream: StreamedKV) -> None:
        """Run the stream's head positions (``open_kv_stream(head=...)``) through the graph, into
        the slots before the segments'; the segments may be arriving meanwhile. Once per stream."""
        if stream.owner is not self:
            raise KVInjectionError("the KV stream was opened by another engine")
        if self.length != stream.kept_slots:
            raise KVInjectionError("the stream's head was computed already, or the cache changed since it was opened")
        if stream.head:
            self.forward(stream.prompt_ids[stream.keep : stream.keep + stream.head])

    def restore(self, prompt_ids: np.ndarray, payload: bytes | bytearray | memoryview) -> int:
        """Take back a conversation's KV kept as one EDKV payload (e.g. compressed while its slot held
        another conversation) for the leading positions where it matches ``prompt_ids``; returns how
        many leading positions of the prompt this engine can now keep (``reusable_prefix``: pass it as
        ``keep``). The payload's tokens must hold positions 0, 1, 2, ... (dropped ones included).

        Raises:
            KVFormatError: the payload is refused (contract, integrity, size): nothing is kept.
        """
        prompt_ids = self._checked_prompt(prompt_ids)
        self.reset()
        reader = EDKVReader(
            self.spec.kv_contract,
            max_tokens=self.spec.context_length,
            target_factory=self._restore_target,
        )
        reader.feed(payload)
        header = reader.finish()
        n = min(header.n_tokens, len(prompt_ids))
        matches = (header.positions[:n] == np.arange(n)) & (header.token_ids[:n] == prompt_ids[:n])
        common = int(np.argmin(matches)) if not matches.all() else n
        slots = int(header.slots_before[common])
        self.cache.commit_ingest([(0, slots)], slots)
        kept = header.kept[:common]
        self._tokens[:slots] = header.token_ids[:common][kept]
        self._positions[0, :slots] = header.positions[:common][kept]
        self._history[:common] = prompt_ids[:common]
        self._importance[:common] = np.nan if header.importance is None else header.importance[:common]
        self.cache.length = slots
        self._window_from = header.windowed_slot(common)
        return self.reusable_prefix(prompt_ids)

    def _restore_target(self, header: EDKVHeader) -> np.ndarray:
        if header.n_kept > self.max_context:
            raise KVInjectionError(f"{header.n_kept} kept tokens exceed the context buffer of {self.max_context}")
        return self.cache.ingest_target(0, header.n_kept)

    def _adopt_stream(self, prompt_ids: np.ndarray, stream: StreamedKV, keep: int) -> np.ndarray:
        """Adopt what the stream's segments wrote (the current one must be complete unless it was
        cut) and process the rest of the prompt."""
        if stream.owner is not self:
            raise KVInjectionError("the KV stream was opened by another engine")
        if keep not in (0, stream.keep):
            raise KVInjectionError(f"the KV stream was opened keeping {stream.keep} positions, not {keep}")
        if not np.array_equal(prompt_ids, stream.prompt_ids):
            raise KVInjectionError("the KV stream was opened for another prompt")
        if self.length == stream.kept_slots and stream.head:
            self.compute_head(stream)
        if not stream.ended:
            stream.finish()
        token_ids, positions, importance = stream.adopted()
        injected = self._injectable_count(positions, prompt_ids)
        after_head = stream.kept_slots + stream.head
        if stream.local_from < stream.covered:
            logger.warning(
                "the KV pulled for positions %d..%d ends before its window does: computing them here instead",
                stream.keep + stream.head,
                stream.covered,
            )
            injected = 0
        elif stream.window_from:
            self._window_from = stream.window_from
        spans = [(segment.first_slot, segment.slots) for segment in stream.segments] if injected else []
        self.cache.commit_ingest(spans, after_head + injected)
        logits = self._process_prompt(
            prompt_ids,
            after_head,
            stream.keep + stream.head,
            token_ids[:injected],
            positions[:injected],
            importance[:injected],
        )
        self.stats.reused_tokens = stream.keep
        self.stats.computed_tokens += stream.head
        return logits

    def _check_after_kept(self, positions: np.ndarray, keep: int, kept_slots: int) -> None:
        """Received KV must start after the kept positions and fit the slots left after them."""
        if len(positions) and positions[0] < keep:
            raise KVInjectionError(
                f"the KV starts at position {int(positions[0])}, inside the {keep} positions this engine already holds"
            )
        if kept_slots + len(positions) > self.max_context:
            raise KVInjectionError(
                f"KV of {len(positions)} tokens after {kept_slots} kept slots exceeds the "
                f"context buffer of {self.max_context}"
            )

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

    def _process_prompt(
        self,
        prompt_ids: np.ndarray,
        kept_slots: int,
        keep: int,
        token_ids: np.ndarray,
        positions: np.ndarray,
        importance: np.ndarray | None = None,
    ) -> np.ndarray:
        """Record the injected slots (already in the cache after the kept ones) and the importance
        that came with them (None: none), then run the prompt from just after them."""
        injected = len(token_ids)
        end = kept_slots + injected
        self._tokens[kept_slots:end] = token_ids
        self._positions[0, kept_slots:end] = positions
        self._history[: len(prompt_ids)] = prompt_ids
        self._importance[positions] = np.nan if importance is None else importance
        self.cache.length = end
        if not self._window_covers(end):
            raise KVInjectionError(
                f"the windowed layers hold KV from slot {self._window_from} on; the token at slot {end} attends to "
                f"the last {self.spec.sliding_window} slots (the KV's window left out too much of the prompt's tail)"
            )
        resume = int(positions[-1]) + 1 if injected else keep
        self.stats = GenerationStats(
            prompt_tokens=len(prompt_ids),
            injected_tokens=injected,
            reused_tokens=keep,
            computed_tokens=len(prompt_ids) - resume,
        )
        if len(prompt_ids) - resume > 1:
            self.forward(prompt_ids[resume:-1])
        # The last prompt token runs alone, as every decode step does, so its logits and KV are the same
        # whatever ran before it: a conversation that resends a prompt it holds all but that token of
        # gets the same answer (a run's lone last row rounds differently, see chunk_sizes).
        return self.forward(prompt_ids[-1:])

    def export_positions(self) -> tuple[KVSnapshot, np.ndarray]:
        """The cached KV laid out over every position before ``next_position`` (the whole
        conversation, for ``restore``), and bool [n]: whether a position's KV is held (False: the
        token was dropped; its KV here is zeros, its id the one processed)."""
        if self.length == 0:
            raise KVInjectionError("nothing to export: no prompt has been processed")
        n = self.next_position
        held = np.zeros(n, bool)
        held[self._positions[0, : self.length]] = True
        held_kv = self.export_kv()
        keys, values = held_kv.keys, held_kv.values
        if not held.all():  # spread over every position (a second copy only where tokens were dropped)
            s = self.spec
            keys = np.zeros((s.n_layers, s.n_kv_heads, n, s.head_dim), held_kv.keys.dtype)
            values = np.zeros_like(keys)
            keys[:, :, held] = held_kv.keys
            values[:, :, held] = held_kv.values
        snapshot = KVSnapshot(
            held_kv.contract, self._history[:n].copy(), np.arange(n, dtype=np.int64), keys, values, held_kv.producer
        )
        return snapshot, held

    @property
    def windowed_from(self) -> int:
        """The first position whose KV this engine holds in its windowed (sliding-window) layers too: 0, or the
        start of a pulled or restored KV's window (the positions before it hold KV in the global layers only);
        ``next_position`` when no slot holds any (a restore cut before its window: nothing here can go on)."""
        if self._window_from == 0:
            return 0
        return int(self._positions[0, self._window_from]) if self._window_from < self.length else self.next_position

    @property
    def windowed_tail(self) -> int:
        """Tokens at the end of a held context that no memory rung may drop: the windowed layers' tail
        (``kv.window``); 0 for a model without sliding windows."""
        return tail_tokens(self.spec.kv_contract)

    def given_importance(self) -> np.ndarray:
        """float32 [next_position]: the importance that came with each position's KV (a pull's or a
        restored payload's EDKV ``importance``), NaN where none came (computed or generated here)."""
        return self._importance[: self.next_position].copy()

    def export_kv(self) -> KVSnapshot:
        """A copy of the cached KV with its token ids, positions, layout contract and producer."""
        if self.length == 0:
            raise KVInjectionError("nothing to export: no prompt has been processed")
        return self.cache.snapshot(self._tokens[: self.length], self._positions[0, : self.length], self.producer)

    def generate(self, prompt_ids, params: SamplingParams, kv: KVSource = None, keep: int = 0) -> Iterator[int]:
        """Process the prompt as ``prefill`` does (its KV from ``kv``: computed here, a snapshot, or a
        stream from ``open_kv_stream``, which brings its own ``keep``) and yield generated token ids
        one by one.

        Stop tokens end the generation and are not yielded; ``self.stats`` is complete once the
        iterator is exhausted.
        """
        return self._generate(prompt_ids, params, kv, keep, None)

    def generate_scored(
        self, prompt_ids, params: SamplingParams, kv: KVSource = None, keep: int = 0, *, top: int = 0
    ) -> Iterator[ScoredToken]:
        """``generate``, each token yielded with its log-probability under the model's own
        distribution (the raw logits, before temperature and top-k/top-p) and the ``top`` most
        likely tokens' (``runtime.logprobs``)."""
        return self._generate(prompt_ids, params, kv, keep, LogprobScorer(top, self.spec.vocab_size).token)

    def _generate(
        self,
        prompt_ids,
        params: SamplingParams,
        kv: KVSource,
        keep: int,
        score: Callable[[np.ndarray, int], ScoredToken] | None,
    ) -> Iterator[Any]:
        """The generation loop of ``generate`` (``score`` None: bare token ids, nothing computed
        beyond sampling) and ``generate_scored`` (each token as ``score`` makes it of its logits)."""
        started = time.perf_counter()
        logits = self.prefill(prompt_ids, kv, keep)
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
            yield token if score is None else score(logits, token)
            if stats.generated_tokens == params.max_tokens:
                break
            if self.full:
                stats.finish_reason = "context"
                break
            logits = self._step(token)  # room checked just above
            stats.decode_steps += 1
        stats.decode_seconds = time.perf_counter() - first_token_at

    def score_prompt(self, prompt_ids, top: int = 0) -> Iterator[ScoredRun]:
        """Run ``prompt_ids`` but its last token through this graph afresh, every row's logits out,
        and yield, a graph run at a time, the log-probabilities of the prompt tokens those rows
        predict (positions 1 .. n-1; position 0 has none) with the ``top`` most likely tokens'.

        Each run's [rows, vocab] logits are reduced to that and dropped: a long prompt never holds
        its whole logits. Nothing is injected (a pulled KV brings no logits). The engine then holds
        positions 0 .. n-2: ``generate(prompt_ids, ..., keep=reusable_prefix(prompt_ids))`` runs the
        last token and goes on. A prompt may fill the whole context (nothing generated after it).
        """
        prompt_ids = np.asarray(prompt_ids, np.int64)
        if not 0 < len(prompt_ids) <= self.max_context:
            raise ContextOverflowError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}")
        scorer = LogprobScorer(top, self.spec.vocab_size)
        started = time.perf_counter()
        self.reset()
        body = prompt_ids[:-1]
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), computed_tokens=len(body))
        self._check_room(len(body))
        self._tokens[: len(body)] = body
        done = 0
        for size in chunk_sizes(len(body)):
            logits = self._run(size, True)
            yield scorer.run(logits, prompt_ids[done + 1 : done + size + 1], done + 1)
            done += size
        self.stats.prefill_seconds = time.perf_counter() - started
