"""Constrained decoding: a grammar compiled against the model's tokenizer once, and per generation
a token mask that sets every token the grammar forbids next to -inf before the sampler picks.

The grammars are llguidance's (a JSON schema, or a Lark grammar that may embed JSON schemas):
``GrammarCompiler`` builds the model's llguidance tokenizer on first use and caches each compiled
grammar by its text; ``Grammar.start`` gives a generation its own ``TokenMask``, a copy of the
compiled matcher. Each step, the matcher writes the allowed tokens as a bitmask (one bit per token,
computed in Rust without the GIL), and the mask is applied to the logits row with integer numpy ops
on its bit patterns: two table lookups widen each bitmask byte to 8 lanes (keep all bits / the bits
of -inf), then an AND and an OR into a scratch row. No Python runs per vocabulary element, and
nothing is allocated per token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from edgedecode.errors import RequestError
from edgedecode.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# How JSON is laid out under a grammar: the separators json.dumps writes by default (and chat models
# read in their training data), no free whitespace (the model cannot pad its answer with newlines).
JSON_LAYOUT: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}
MAX_CACHED_GRAMMARS = 64  # compiled grammars kept per model, least recently used dropped first

_LANES = 8  # bits per byte of the bitmask, widened to one lane each


class GrammarError(RequestError):
    """A grammar (a JSON schema, a tool's parameters) that cannot be compiled: the message names what (400)."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar text for a JSON schema, laid out as ``JSON_LAYOUT`` says."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)
    except ValueError as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from exc


def lark_grammar(lark: str) -> str:
    """llguidance's grammar text for a Lark grammar (which may embed JSON schemas with ``%json``)."""
    return llguidance.LLMatcher.grammar_from_lark(lark)


class TokenMask:
    """One generation's constraint: ``apply`` the grammar's mask to a logits row, ``accept`` the token
    picked from it; ``finished`` once the grammar admits nothing more (the generation then ends)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        words = (vocab_size + 31) // 32
        self._bitmask = np.full(words, -1, np.int32)
        self._bytes = self._bitmask.view(np.uint8)
        self._keep: np.ndarray | None = None  # [words * 4, 8] lanes, of the logits' integer width
        self._fill: np.ndarray | None = None
        self._row: np.ndarray | None = None  # the masked row handed to the sampler

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` [vocab] with every token the grammar forbids next at -inf: a scratch row, valid
        until the next call (``logits`` itself is left as it is, for the log-probabilities)."""
        matcher = self._matcher
        matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        if matcher.is_error():
            raise GrammarError(f"the grammar admits no next token: {matcher.get_error()}")
        if self._row is None or self._row.dtype != logits.dtype:
            self._allocate(logits.dtype)
        assert self._keep is not None and self._fill is not None and self._row is not None
        table_keep, table_fill = _tables(logits.dtype)
        np.take(table_keep, self._bytes, axis=0, out=self._keep)
        np.take(table_fill, self._bytes, axis=0, out=self._fill)
        n = self._vocab_size
        lanes = self._row.view(table_keep.dtype)
        np.bitwise_and(logits.view(table_keep.dtype), self._keep.reshape(-1)[:n], out=lanes)
        np.bitwise_or(lanes, self._fill.reshape(-1)[:n], out=lanes)
        return self._row

    def _allocate(self, dtype: np.dtype) -> None:
        """The scratch buffers for logits of ``dtype`` (once per generation)."""
        lanes = _tables(dtype)[0].dtype
        self._keep = np.empty((len(self._bytes), _LANES), lanes)
        self._fill = np.empty((len(self._bytes), _LANES), lanes)
        self._row = np.empty(self._vocab_size, dtype)

    def accept(self, token: int) -> None:
        """Advance the grammar by ``token`` (one ``apply`` allowed)."""
        if not self._matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar admits no further text: only an end-of-turn token could follow."""
        return self._matcher.is_stopped()


_TABLES: dict[np.dtype, tuple[np.ndarray, np.ndarray]] = {}


def _tables(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """For logits of ``dtype``: per bitmask byte value, its 8 tokens' lanes to AND with (all bits set
    where allowed) and to OR with (-inf's bits where forbidden), as integers of the same width."""
    tables = _TABLES.get(dtype)
    if tables is None:
        lanes = np.dtype(f"int{8 * dtype.itemsize}")
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool)
        minus_infinity = np.array(-np.inf, dtype).view(lanes)
        keep = np.where(bits, lanes.type(-1), lanes.type(0)).astype(lanes)
        fill = np.where(bits, lanes.type(0), minus_infinity).astype(lanes)
        tables = _TABLES[dtype] = (keep, fill)
    return tables


class Grammar:
    """A grammar compiled against one model's tokenizer; ``start`` for each generation under it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def start(self) -> TokenMask:
        """A fresh constraint at the grammar's start (a copy of the compiled matcher)."""
        return TokenMask(self._matcher.deep_copy(), self._vocab_size)


class _Vocabulary:
    """The model's tokenizer as llguidance's ``TokenizerWrapper`` reads it: each token's bytes, the
    special tokens (llguidance marks them; they never match grammar text), and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = stop_token_ids[0]
        self.bos_token_id = tokenizer.spec.bos_token_id
        padding = range(tokenizer.vocab_size, vocab_size)  # logits beyond the vocabulary: never allowed
        self.tokens = [tokenizer.token_bytes(i, skip_special=False) for i in range(tokenizer.vocab_size)]
        self.tokens += [f"<pad{i}>".encode() for i in padding]
        self.special_token_ids = sorted(tokenizer.special_ids | set(padding))

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, parse_special=False, add_bos=False)


class GrammarCompiler:
    """One model's grammars: its llguidance tokenizer (built on first use: a pass over the vocabulary,
    ~0.2 s at 49k tokens) and the grammars compiled against it, cached by their text. Thread-safe:
    the daemon compiles off its event loop."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Grammar:
        """``grammar`` (``json_schema_grammar`` or ``lark_grammar`` text) compiled, or from the cache;
        GrammarError names what llguidance could not compile (an unsupported schema keyword, say)."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled
            lltokenizer = self._llguidance_tokenizer()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltokenizer)
        if failed:
            raise GrammarError("; ".join(messages))
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        compiled = Grammar(matcher, self._vocab_size)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            vocabulary = _Vocabulary(self._tokenizer, self._vocab_size, self._stop_token_ids)
            wrapper = llguidance.TokenizerWrapper(vocabulary)
            self._lltokenizer = llguidance.LLTokenizer(
                wrapper, n_vocab=self._vocab_size, eos_token=list(self._stop_token_ids)
            )
        return self._lltokenizer
