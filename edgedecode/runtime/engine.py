"""The token-by-token engine: prompt processing and decoding over one preallocated KV cache.

An Engine runs either built graph (the INT4 decode graph on the edge, or the higher-precision
prefill graph), so KV exported from one engine can be injected into another of the same model.
It holds the prompt entry points and wires the owners of the rest: a ``ModelRunner`` (session, IO
binding, one run, the CUDA-graph step), a ``Sequence`` (what the cache's slots hold) and the
``KVCache`` both write into. A prompt's tokens are **kept** from the engine's last use
(``Sequence.keep``), **received** (``runtime.ingest``: a snapshot, EDKV streams, a stored payload)
or **computed** here (``ModelRunner.run``); the decode loop is ``generation.decode``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.policy import profile_path
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.value_range import load_value_range
from edgedecode.kv.window import tail_tokens
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.generation import GenerationStats, Score, decode
from edgedecode.runtime.handoff import KVSource, StreamedKV
from edgedecode.runtime.ingest import adopt_segments, inject_snapshot, injectable_count, restore_payload, segment_reader
from edgedecode.runtime.kvcache import KVCache, KVInjectionError
from edgedecode.runtime.logprobs import LogprobScorer, ScoredRun, ScoredToken
from edgedecode.runtime.runner import GraphSession, ModelRunner
from edgedecode.runtime.sampler import SamplingParams
from edgedecode.runtime.sequence import ContextOverflowError, Sequence

if TYPE_CHECKING:  # the type only: llguidance is imported where grammars are made
    from edgedecode.runtime.constraint import TokenMask

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


class Engine:
    """Runs one built graph over a preallocated KV cache (batch 1)."""

    session: Any  # onnxruntime.InferenceSession (shared with the engines made with ``share``)
    cuda_graph: bool  # single-token steps replay a captured CUDA graph
    cache: KVCache
    sequence: Sequence  # what the cache's slots hold
    runner: ModelRunner  # runs the sequence's tokens through the graph

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
            graph = share.runner.graph
        else:
            graph = GraphSession.open(model, options, device, threads, profile, cuda_graph)
        self.session, self.cuda_graph = graph.session, graph.cuda_graph
        limits = share.cache.value_limits if share is not None else _value_limits(model)
        self.cache = KVCache(self.spec, self.max_context, options.kv_np_dtype, device, limits)
        self.sequence = Sequence(self.cache, self.spec)
        self.runner = ModelRunner(graph, self.sequence)
        self.runner.warm_up(self.spec.eos_token_id)
        self.stats = GenerationStats()

    # -- what the cache holds (the sequence's)

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
    def kv_preallocated(self) -> bool:
        """Whether the KV buffers take their whole size from the start (CUDA), not as they fill (CPU)."""
        return self.cache.device != "cpu"

    @property
    def next_position(self) -> int:
        """True position of the next token appended."""
        return self.sequence.next_position

    @property
    def full(self) -> bool:
        """Whether no further token fits (``Sequence.full``)."""
        return self.sequence.full

    @property
    def held_positions(self) -> np.ndarray:
        """The true position of each cache slot's token, [length], increasing (a read-only view)."""
        return self.sequence.held_positions

    @property
    def windowed_from(self) -> int:
        """The first position whose KV the windowed layers hold too (``Sequence.windowed_from``)."""
        return self.sequence.windowed_from

    @property
    def windowed_tail(self) -> int:
        """Tokens at the end of a held context that no memory rung may drop: the windowed layers' tail
        (``kv.window``); 0 for a model without sliding windows."""
        return tail_tokens(self.spec.kv_contract)

    def given_importance(self) -> np.ndarray:
        """float32 [next_position]: the importance that came with each position's KV, NaN where none came."""
        return self.sequence.given_importance()

    def reset(self) -> None:
        """Forget the cached context (the buffers are overwritten, not freed)."""
        self.sequence.reset()

    def evict(self, positions: np.ndarray) -> None:
        """Drop the KV of the held tokens at ``positions`` (``Sequence.evict``)."""
        self.sequence.evict(positions)

    def release_unused(self) -> None:
        """Give the memory of the KV buffer's slots past ``length`` back (CPU; see KVCache)."""
        self.cache.release_unused()

    def reusable_prefix(self, prompt_ids) -> int:
        """How many leading positions of ``prompt_ids`` this engine can keep from what it last processed
        (``Sequence.reusable_prefix``); pass it as ``keep`` to ``open_kv_stream``/``prefill``/``generate``."""
        return self.sequence.reusable_prefix(np.asarray(prompt_ids, np.int64))

    def export_kv(self) -> KVSnapshot:
        """A copy of the cached KV with its token ids, positions, layout contract and producer."""
        return self.sequence.snapshot(self.producer)

    def export_positions(self) -> tuple[KVSnapshot, np.ndarray]:
        """The cached KV over every position processed, for ``restore``, and which positions it holds
        (``Sequence.snapshot_positions``)."""
        return self.sequence.snapshot_positions(self.producer)

    # -- computed: tokens run through the graph after the held ones

    def forward(self, token_ids: np.ndarray, *, all_logits: bool = False) -> np.ndarray:
        """Append tokens at the current position; returns the last logits [vocab] or all of them [n, vocab].

        The last-logits row is a view into a buffer the next call overwrites.
        """
        outputs = list(self._runs(np.asarray(token_ids, np.int64), all_logits))
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def _runs(self, token_ids: np.ndarray, all_logits: bool) -> Iterator[np.ndarray]:
        """Run ``token_ids`` after the held tokens in runs of ``chunk_sizes``, yielding each run's logits."""
        self.sequence.stage(token_ids)
        for size in chunk_sizes(len(token_ids)):
            yield self.runner.run(size, all_logits)

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
        self.sequence.stage(token_ids)
        self.runner.run(n, True)  # every row's logits: the queries output has a row for each logits row
        return self.runner.queries[:, 0], self.sequence.positions[0, start : start + n].copy()

    def step(self, token: int) -> np.ndarray:
        """Append ``token`` after what is cached and run it (a decode step: through the captured CUDA
        graph where there is one); returns its logits [vocab], a view the next run overwrites.

        Raises:
            ContextOverflowError: the engine is ``full``.
        """
        if self.sequence.full:
            raise ContextOverflowError(
                f"no room for a token after {self.length} cached (context {self.max_context}) at position "
                f"{self.next_position} (the model's {self.spec.context_length})"
            )
        return self.runner.step(token)

    # -- a prompt: kept, received, computed

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
        prompt_ids = self.sequence.checked_prompt(prompt_ids)
        if isinstance(kv, StreamedKV):
            return self._adopt_stream(prompt_ids, kv, keep)
        kept = self.sequence.keep(prompt_ids, keep)
        injected = 0
        if kv is not None:
            self.cache.check_injectable(kv, prompt_ids)
            self.sequence.check_receivable(kv.positions, keep, kept)
            injected = injectable_count(kv.positions, prompt_ids)
            inject_snapshot(self.sequence, prompt_ids, kv, kept, injected)
        return self._run_prompt(prompt_ids, keep, injected)

    def _adopt_stream(self, prompt_ids: np.ndarray, stream: StreamedKV, keep: int) -> np.ndarray:
        """Adopt what the stream's segments wrote (the current one complete unless cut); run the rest."""
        stream.check_opened(self, prompt_ids, keep)
        if self.length == stream.kept_slots and stream.head:
            self.compute_head(stream)
        if not stream.ended:
            stream.finish()
        injected = adopt_segments(self.sequence, stream, prompt_ids)
        return self._run_prompt(prompt_ids, stream.keep, injected, stream.head)

    def _run_prompt(self, prompt_ids: np.ndarray, reused: int, injected: int, head: int = 0) -> np.ndarray:
        """Run the prompt from the position after what the cache holds of it (``reused`` positions kept,
        ``injected`` received, a stream's ``head`` computed); returns its last token's logits [vocab]."""
        self.sequence.check_window()
        resume = self.sequence.next_position
        self.stats = GenerationStats(
            prompt_tokens=len(prompt_ids),
            injected_tokens=injected,
            reused_tokens=reused,
            computed_tokens=head + len(prompt_ids) - resume,
        )
        if len(prompt_ids) - resume > 1:
            self.forward(prompt_ids[resume:-1])
        # The last prompt token runs alone, as every decode step does, so its logits and KV are the same
        # whatever ran before it: a conversation that resends a prompt it holds all but that token of
        # gets the same answer (a run's lone last row rounds differently, see chunk_sizes).
        return self.forward(prompt_ids[-1:])

    def start(self, prompt_ids: np.ndarray, kv: KVSnapshot | None = None, injected: int = 0) -> None:
        """Begin ``prompt_ids`` afresh: forget the cached context and take the KV of its first
        ``injected`` positions from the first slots of ``kv`` (which must hold positions 0, 1, 2, ...
        there, e.g. a prefix cache's); run the rest of the prompt with ``forward`` or
        ``run_with_queries``. ``stats`` count the prompt and the injected tokens.

        ``kv``, when given, must fit the prompt (KVInjectionError otherwise), even with ``injected`` 0.
        At least the prompt's last token is left to run here.
        """
        prompt_ids = self.sequence.checked_prompt(prompt_ids)
        if kv is not None:
            self.cache.check_injectable(kv, prompt_ids)
        if not 0 <= injected < len(prompt_ids):
            raise ValueError(f"injected must be in 0..{len(prompt_ids) - 1}, not {injected}")
        if injected and (kv is None or not np.array_equal(kv.positions[:injected], np.arange(injected))):
            raise KVInjectionError(f"the KV does not hold positions 0..{injected - 1} in its first slots")
        self.reset()
        if kv is not None:
            inject_snapshot(self.sequence, prompt_ids, kv, 0, injected)
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
        prompt_ids = self.sequence.checked_prompt(prompt_ids)
        if not 0 <= head < len(prompt_ids) - keep:
            raise ValueError(f"head must be in [0, {len(prompt_ids) - keep}) for this prompt and keep, not {head}")
        kept = self.sequence.keep(prompt_ids, keep)
        self.sequence.check_room(head)
        return StreamedKV(segment_reader(self.sequence, prompt_ids), prompt_ids, keep, kept, owner=self, head=head)

    def compute_head(self, stream: StreamedKV) -> None:
        """Run the stream's head positions (``open_kv_stream(head=...)``) through the graph, into
        the slots before the segments'; the segments may be arriving meanwhile. Once per stream."""
        stream.check_opened(self)
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
        prompt_ids = self.sequence.checked_prompt(prompt_ids)
        self.reset()
        restore_payload(self.sequence, prompt_ids, payload)
        return self.reusable_prefix(prompt_ids)

    # -- generation

    def generate(
        self,
        prompt_ids,
        params: SamplingParams,
        kv: KVSource = None,
        keep: int = 0,
        *,
        constraint: TokenMask | None = None,
    ) -> Iterator[int]:
        """Process the prompt as ``prefill`` does (its KV from ``kv``: computed here, a snapshot, or a
        stream from ``open_kv_stream``, which brings its own ``keep``) and yield generated token ids
        one by one.

        Stop tokens end the generation and are not yielded; ``self.stats`` is complete once the
        iterator is exhausted. ``constraint`` (``runtime.constraint``) keeps the tokens to a grammar.
        """
        return self._generate(prompt_ids, params, kv, keep, None, constraint)

    def generate_scored(
        self,
        prompt_ids,
        params: SamplingParams,
        kv: KVSource = None,
        keep: int = 0,
        *,
        top: int = 0,
        constraint: TokenMask | None = None,
    ) -> Iterator[ScoredToken]:
        """``generate``, each token yielded with its log-probability under the model's own
        distribution (the raw logits, before temperature and top-k/top-p) and the ``top`` most
        likely tokens' (``runtime.logprobs``)."""
        scorer = LogprobScorer(top, self.spec.vocab_size)
        return self._generate(prompt_ids, params, kv, keep, scorer.token, constraint)

    def _generate(
        self,
        prompt_ids,
        params: SamplingParams,
        kv: KVSource,
        keep: int,
        score: Score,
        constraint: TokenMask | None,
    ) -> Iterator[Any]:
        """``generate`` (``score`` None) and ``generate_scored``: the prompt, then ``generation.decode``."""
        started = time.perf_counter()
        logits = self.prefill(prompt_ids, kv, keep)
        self.stats.prefill_seconds = time.perf_counter() - started
        stops = frozenset(self.spec.stop_token_ids if params.stop_token_ids is None else params.stop_token_ids)
        yield from decode(self.runner, logits, params, stops, self.stats, score, constraint)

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
        done = 0
        for logits in self._runs(body, True):
            yield scorer.run(logits, prompt_ids[done + 1 : done + len(logits) + 1], done + 1)
            done += len(logits)
        self.stats.prefill_seconds = time.perf_counter() - started


def _value_limits(model: LoadedModel) -> np.ndarray | None:
    """The largest |key| and |value| per layer that KV received for ``model`` may hold: its measured range
    (``kv.value_range``) times the multiple, or None where it was never measured."""
    value_range = load_value_range(model.record.name, profile_path(model))
    if value_range is None:
        logger.info("no KV value range measured for %s: received KV is checked finite only", model.record.name)
        return None
    return value_range.limits()
