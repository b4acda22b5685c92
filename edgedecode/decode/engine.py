"""The token-by-token engine: one onnxruntime session, its KV buffers, prompt processing and decoding.

An Engine runs either built graph (the INT4 decode graph on the edge, or the higher-precision
prefill graph), so KV exported from one engine can be injected into another of the same model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edgedecode.decode.kvcache import KVCache, KVInjectionError, KVSnapshot
from edgedecode.decode.sampler import Sampler, SamplingParams
from edgedecode.errors import EdgeDecodeError
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.model.session import create_session

PREFILL_CHUNK_TOKENS = 512


class ContextOverflowError(EdgeDecodeError):
    """The prompt does not fit the context window."""


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
                 device: str = "cpu", threads: int | None = None, profile: bool = False) -> None:
        self.spec = model.spec
        self.options = options
        self.producer = f"{model.record.name} {options.kind} {options.dtype} gguf:{model.record.sha256[:16]}"
        self.max_context = min(max_context or self.spec.context_length, self.spec.context_length)
        self.session = create_session(model.graph(options), device=device, threads=threads, profile=profile)
        self.cache = KVCache(self.spec, self.max_context, options.np_dtype, device)
        self.stats = GenerationStats()
        self._tokens = np.zeros(self.max_context, np.int64)  # ids of the positions in the cache
        self._mask = np.ones((1, self.max_context), np.int64)
        self._last_position = np.array([-1], np.int64)
        self._logits = np.empty((1, 1, self.spec.vocab_size), options.np_dtype)
        self._io = self.session.io_binding()
        for layer, pair in enumerate(self.cache.ortvalues):
            for name, buffer in zip(("key", "value"), pair):
                self._io.bind_ortvalue_input(f"past_key_values.{layer}.{name}", buffer)
                self._io.bind_ortvalue_output(f"present.{layer}.{name}", buffer)
        self.forward(np.array([self.spec.eos_token_id]))  # warm-up: the first run allocates ORT's arenas
        self.reset()

    @property
    def length(self) -> int:
        """Number of positions whose KV is in the cache."""
        return self.cache.length

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
        self._tokens[start:start + n] = token_ids
        outputs = [self._run(min(PREFILL_CHUNK_TOKENS, n - offset), all_logits)
                   for offset in range(0, n, PREFILL_CHUNK_TOKENS)]
        return np.concatenate(outputs) if all_logits else outputs[-1]

    def _run(self, n: int, all_logits: bool) -> np.ndarray:
        """Run the n tokens already written at ``_tokens[length:length + n]`` through the graph."""
        start = self.length
        io = self._io
        io.bind_cpu_input("input_ids", self._tokens[None, start:start + n])
        io.bind_cpu_input("attention_mask", self._mask[:, :start + n])
        if all_logits:
            positions = np.arange(n, dtype=np.int64)
            logits = np.empty((1, n, self.spec.vocab_size), self._logits.dtype)
        else:
            positions, logits = self._last_position, self._logits
        io.bind_cpu_input("logits_positions", positions)
        io.bind_output("logits", "cpu", 0, logits.dtype, logits.shape, logits.ctypes.data)
        self.session.run_with_iobinding(io)
        self.cache.length = start + n
        return logits[0] if all_logits else logits[0, 0]

    def prefill(self, prompt_ids: np.ndarray, kv: KVSnapshot | None = None) -> np.ndarray:
        """Reset, inject ``kv`` for a prefix of the prompt if given, and process the rest.

        At least the last prompt token is always run through this engine's graph, so the returned
        next-token logits [vocab] are this graph's own.
        """
        prompt_ids = np.asarray(prompt_ids, np.int64)
        if len(prompt_ids) == 0:
            raise ContextOverflowError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context} "
                "including at least one generated token"
            )
        self.reset()
        injected = 0
        if kv is not None:
            self.cache.check_injectable(kv, prompt_ids)
            injected = min(kv.n_tokens, len(prompt_ids) - 1)
            self.cache.update(0, kv.keys[:, :, :injected], kv.values[:, :, :injected])
            self._tokens[:injected] = prompt_ids[:injected]
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), injected_tokens=injected)
        return self.forward(prompt_ids[injected:])

    def export_kv(self) -> KVSnapshot:
        """A copy of the cached KV with its token ids, positions, layout contract and producer."""
        if self.length == 0:
            raise KVInjectionError("nothing to export: no prompt has been processed")
        return self.cache.snapshot(self._tokens[:self.length], self.producer)

    def generate(self, prompt_ids, params: SamplingParams, kv: KVSnapshot | None = None) -> Iterator[int]:
        """Process the prompt (optionally from injected KV) and yield generated token ids one by one.

        Stop tokens end the generation and are not yielded; ``self.stats`` is complete once the
        iterator is exhausted.
        """
        started = time.perf_counter()
        logits = self.prefill(prompt_ids, kv)
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
