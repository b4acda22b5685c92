"""What an engine's KV cache holds for the conversation it serves: one sequence of tokens.

A ``Sequence`` describes the cache's slots and the positions behind them. Slots hold the KV of tokens
in position order but not every position has one: tokens dropped on the way (by a prefill server's
budget, the daemon's memory ladder) advance positions without taking a slot. So the sequence keeps,
by slot, the token id and its true position (RoPE), and by position, the token id (``history``: what
a later prompt must repeat to reuse the KV) and the importance that came with its KV.

A prompt's tokens come to be in the slots in three ways, which every entry point of the engine combines:

* **kept** from the sequence's last prompt: ``reusable_prefix`` says how many positions, ``keep``
  truncates the slots to them;
* **received**: KV written into the slots from elsewhere (``runtime.ingest``: a snapshot, EDKV
  streams, a stored payload); ``receive`` records which of the prompt's tokens it holds;
* **computed**: staged after the held slots (``stage``) and run through the graph, which appends
  their KV (``ModelRunner.run``); ``advance`` gives them their positions as the run starts.

``evict`` drops chosen tokens and ``reset`` all. The KV buffers follow: ``cache.length`` is the
number of slots in use.
"""

from __future__ import annotations

import numpy as np

from edgedecode.errors import EdgeDecodeError
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.window import window_covers
from edgedecode.model.spec import ModelSpec
from edgedecode.runtime.kvcache import KVCache, KVInjectionError


class ContextOverflowError(EdgeDecodeError):
    """The prompt does not fit the context window."""

    http_status = 422
    http_type = "invalid_request_error"
    http_code = "unprocessable"


class Sequence:
    """The tokens, positions, history, importance and window of one cache's slots, and the operations
    that keep, evict and forget them (batch 1: one sequence per cache)."""

    def __init__(self, cache: KVCache, spec: ModelSpec) -> None:
        self.cache = cache
        self.spec = spec
        self.max_context = cache.max_context
        self.tokens = np.zeros(self.max_context, np.int64)  # token id held by each cache slot
        self.positions = np.zeros((1, self.max_context), np.int64)  # its true position (RoPE), batch 1 as bound
        self.history = np.zeros(spec.context_length, np.int64)  # token id at every position before next_position
        # the importance that came with each position's KV (EDKV 1.2), NaN where none came: the memory ladder's ranking
        self.importance = np.full(spec.context_length, np.nan, np.float32)
        # first cache slot whose windowed (sliding-window) layers hold KV: pulls and restores with an EDKV window
        # bring those layers only for their tail (kv.window); a token runs only where its window lies after it
        self.window_from = 0
        self._ramp = np.arange(self.max_context, dtype=np.int64)

    @property
    def length(self) -> int:
        """Number of cache slots in use (tokens whose KV is held; dropped tokens hold none)."""
        return self.cache.length

    @length.setter
    def length(self, slots: int) -> None:
        self.cache.length = slots

    @property
    def next_position(self) -> int:
        """True position of the next token appended."""
        length = self.cache.length
        return int(self.positions[0, length - 1]) + 1 if length else 0

    @property
    def full(self) -> bool:
        """Whether no further token fits: the cache is full, or the next position is past the model's
        (dropped tokens advance positions without taking slots)."""
        return self.cache.length >= self.max_context or self.next_position >= self.spec.context_length

    @property
    def held_positions(self) -> np.ndarray:
        """The true position of each cache slot's token, [length], increasing (a read-only view)."""
        view = self.positions[0, : self.length]
        view.flags.writeable = False
        return view

    @property
    def windowed_from(self) -> int:
        """The first position whose KV the windowed (sliding-window) layers hold too: 0, or the start of a
        pulled or restored KV's window (the positions before it hold KV in the global layers only);
        ``next_position`` when no slot holds any (a restore cut before its window: nothing here can go on)."""
        if self.window_from == 0:
            return 0
        return int(self.positions[0, self.window_from]) if self.window_from < self.length else self.next_position

    def given_importance(self) -> np.ndarray:
        """float32 [next_position]: the importance that came with each position's KV (a pull's or a
        restored payload's EDKV ``importance``), NaN where none came (computed or generated here)."""
        return self.importance[: self.next_position].copy()

    def reset(self) -> None:
        """Forget every slot (the buffers are overwritten, not freed)."""
        self.cache.length = 0
        self.window_from = 0

    def check_room(self, n: int) -> None:
        """Raise ContextOverflowError unless ``n`` more tokens fit the cache and the model's positions."""
        if self.length + n > self.max_context:
            raise ContextOverflowError(f"{self.length + n} tokens exceed the context of {self.max_context}")
        if self.next_position + n > self.spec.context_length:
            raise ContextOverflowError(
                f"position {self.next_position + n} exceeds the model's {self.spec.context_length}"
            )

    def checked_prompt(self, prompt_ids) -> np.ndarray:
        """``prompt_ids`` as int64, if it leaves room in the cache for at least one generated token."""
        prompt_ids = np.asarray(prompt_ids, np.int64)
        if len(prompt_ids) == 0:
            raise ContextOverflowError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context} "
                "including at least one generated token"
            )
        return prompt_ids

    def window_covers(self, slot: int) -> bool:
        """Whether a token run at cache ``slot`` finds KV in its windowed layers for every slot its window spans."""
        return window_covers(self.window_from, slot, self.spec.kv_contract)

    def check_window(self) -> None:
        """Raise KVInjectionError unless the next token finds KV in its windowed layers for its whole window."""
        if not self.window_covers(self.length):
            raise KVInjectionError(
                f"the windowed layers hold KV from slot {self.window_from} on; the token at slot {self.length} "
                f"attends to the last {self.spec.sliding_window} slots (the KV's window left out too much of the "
                "prompt's tail)"
            )

    # -- reuse: what the slots still hold of a new prompt

    def reusable_prefix(self, prompt_ids: np.ndarray) -> int:
        """How many leading positions of ``prompt_ids`` (int64) the slots can keep.

        That is the prompt's common prefix with the tokens at positions before ``next_position``
        (prompt, KV received, tokens generated and run), cut back to end at a held slot (a dropped
        token at the end of the prefix is processed again) and to leave the prompt's last token to
        run here; 0 where the windowed layers hold too little of that prefix's tail to go on from.
        """
        common = min(self.next_position, len(prompt_ids) - 1)
        if common <= 0:
            return 0
        differ = np.flatnonzero(self.history[:common] != prompt_ids[:common])
        common = int(differ[0]) if len(differ) else common
        slots = int(np.searchsorted(self.positions[0, : self.length], common))
        if not self.window_covers(slots):
            return 0
        return int(self.positions[0, slots - 1]) + 1 if slots else 0

    def keep(self, prompt_ids: np.ndarray, keep: int) -> int:
        """Truncate the slots to those of positions [0, keep) of ``prompt_ids`` (0: forget all); returns
        how many slots stay."""
        if keep == 0:
            self.reset()
            return 0
        reusable = self.reusable_prefix(prompt_ids)
        if not 0 < keep <= reusable:
            raise KVInjectionError(f"cannot keep {keep} positions: this engine holds {reusable} of this prompt")
        slots = int(np.searchsorted(self.positions[0, : self.length], keep))
        if int(self.positions[0, slots - 1]) + 1 != keep:
            raise KVInjectionError(f"keep={keep} does not end at a held token (use reusable_prefix)")
        self.length = slots
        return slots

    def evict(self, positions: np.ndarray) -> None:
        """Drop the KV of the held tokens at ``positions`` (the others move down, in order): the
        context decodes on as after any dropped token, one slot per token lighter."""
        held = self.positions[0, : self.length]
        kept = ~np.isin(held, positions)
        if len(held) - np.count_nonzero(kept) != len(np.unique(positions)):
            raise KVInjectionError("only positions whose KV is held can be evicted")
        n = int(np.count_nonzero(kept))
        self.tokens[:n] = self.tokens[: self.length][kept]
        self.positions[0, :n] = held[kept]
        self.window_from = int(np.count_nonzero(kept[: self.window_from]))
        self.cache.compact(kept)

    # -- computed: tokens run through the graph after the held slots

    def stage(self, token_ids: np.ndarray) -> None:
        """Write ``token_ids`` into the slots after the held ones, for runs (``advance``) to process."""
        start, n = self.length, len(token_ids)
        self.check_room(n)
        self.tokens[start : start + n] = token_ids

    def advance(self, n: int) -> int:
        """Give the ``n`` tokens staged after the held slots the next positions (and their history; no
        importance came with them) as a graph run appends their KV; returns the first one's position.
        The caller sets ``length`` once the run is done."""
        start, position = self.length, self.next_position
        if n == 1:  # a decode step: scalar writes, no views
            self.positions[0, start] = position
            self.history[position] = self.tokens[start]
            self.importance[position] = np.nan
        else:
            np.add(self._ramp[:n], position, out=self.positions[0, start : start + n])
            self.history[position : position + n] = self.tokens[start : start + n]
            self.importance[position : position + n] = np.nan
        return position

    # -- received: KV written into the slots from elsewhere

    def check_receivable(self, positions: np.ndarray, first_position: int, first_slot: int) -> None:
        """Received KV must start at ``first_position`` or later and fit the slots from ``first_slot`` on."""
        if len(positions) and positions[0] < first_position:
            raise KVInjectionError(
                f"the KV starts at position {int(positions[0])}, inside the {first_position} positions this engine "
                "already holds"
            )
        if first_slot + len(positions) > self.max_context:
            raise KVInjectionError(
                f"KV of {len(positions)} tokens after {first_slot} kept slots exceeds the "
                f"context buffer of {self.max_context}"
            )

    def receive(
        self,
        prompt_ids: np.ndarray,
        first_slot: int,
        positions: np.ndarray,
        importance: np.ndarray | None = None,
        *,
        kept: np.ndarray | None = None,
        window_from: int = 0,
    ) -> None:
        """Record KV received for the tokens of ``prompt_ids`` at ``positions`` [n] (increasing, checked to be
        the prompt's by the caller, who wrote their KV into the slots from ``first_slot`` on): ``length``
        becomes the slot after them and the prompt is the history.

        Args:
            importance: float [n], the importance that came with their KV; None: none came (NaN).
            kept: bool [n], the tokens whose KV came (the others were dropped: they take no slot, but
                their importance is recorded); None: all of them.
            window_from: the first slot from which the received KV's windowed layers hold any (0: all, or
                no window: unchanged).
        """
        held = positions if kept is None else positions[kept]
        end = first_slot + len(held)
        self.tokens[first_slot:end] = prompt_ids[held]
        self.positions[0, first_slot:end] = held
        self.history[: len(prompt_ids)] = prompt_ids
        self.importance[positions] = np.nan if importance is None else importance
        if window_from:
            self.window_from = window_from
        self.length = end

    # -- export

    def snapshot(self, producer: KVProducer) -> KVSnapshot:
        """A copy of the held KV with its token ids, positions, layout contract and ``producer``."""
        if self.length == 0:
            raise KVInjectionError("nothing to export: no prompt has been processed")
        return self.cache.snapshot(self.tokens[: self.length], self.positions[0, : self.length], producer)

    @property
    def exports_views(self) -> bool:
        """Whether ``snapshot_positions(view=True)`` copies no KV: it is on the host and no token was dropped."""
        return self.cache.device == "cpu" and self.length == self.next_position

    def snapshot_positions(self, producer: KVProducer, view: bool = False) -> tuple[KVSnapshot, np.ndarray]:
        """The held KV laid out over every position before ``next_position`` (the whole conversation,
        for ``Engine.restore``), and bool [n]: whether a position's KV is held (False: the token was
        dropped; its KV here is zeros, its id the one processed).

        ``view``: where the KV is on the host and no token was dropped (``exports_views``), its keys and
        values are views of the cache, no copy: valid until the sequence runs, is reset or evicts."""
        if self.length == 0:
            raise KVInjectionError("nothing to export: no prompt has been processed")
        n = self.next_position
        if view and self.exports_views:
            host, ids, positions = self.cache.host, self.history[:n].copy(), np.arange(n, dtype=np.int64)
            keys, values = host[:, 0, 0, :, :n], host[:, 1, 0, :, :n]
            return KVSnapshot(self.spec.kv_contract, ids, positions, keys, values, producer), np.ones(n, bool)
        held = np.zeros(n, bool)
        held[self.positions[0, : self.length]] = True
        held_kv = self.snapshot(producer)
        keys, values = held_kv.keys, held_kv.values
        if not held.all():  # spread over every position (a second copy only where tokens were dropped)
            s = self.spec
            keys = np.zeros((s.n_layers, s.n_kv_heads, n, s.head_dim), held_kv.keys.dtype)
            values = np.zeros_like(keys)
            keys[:, :, held] = held_kv.keys
            values[:, :, held] = held_kv.values
        snapshot = KVSnapshot(
            held_kv.contract, self.history[:n].copy(), np.arange(n, dtype=np.int64), keys, values, held_kv.producer
        )
        return snapshot, held
