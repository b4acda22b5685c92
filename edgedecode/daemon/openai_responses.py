"""The text and JSON of the decode daemon's OpenAI-compatible answers.

A choice's generated tokens become text through ``TokenText`` (UTF-8 completed, stop strings cut by
``StopText``, each token's log-probability entry handed out with the text that completes it);
``ResponseShape`` builds the chat or text completion objects, streamed chunks or whole, in OpenAI's
shapes; ``usage`` the usage object.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from edgedecode.runtime.logprobs import ScoredToken


class StopText:
    """Cuts generated text at the first stop string, holding back a tail that could start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text safe to emit now; after a stop string, nothing more."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        keep = len(self._pending) - self._hold
        out, self._pending = self._pending[: max(keep, 0)], self._pending[max(keep, 0) :]
        return out

    def flush(self) -> str:
        """What is held back, once generation has ended."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


# A token's entry in a response's log-probabilities: (characters of its choice's text before the
# token's, the token scored, or a bare token id for the prompt's first token, which has no log-probability)
Entry = tuple[int, ScoredToken | int]
_NO_ENTRIES: list[Entry] = []  # what an untracked TokenText hands out (never appended to)


class TokenDecoder(Protocol):
    """``model.tokenizer.StreamDecoder`` as TokenText uses it."""

    def feed(self, token_id: int) -> str: ...

    def flush(self) -> str: ...

    @property
    def held(self) -> int: ...


class TokenText:
    """One choice's tokens to the text sent: UTF-8 sequences completed (the tokenizer's stream
    decoder), stop strings cut (StopText); with ``tracked``, each token's entry is handed out with
    the text that completes the token's text, so that a stream's log-probabilities line up with its
    text.

    A token's text runs from the first character its bytes contribute to, to the end of the character
    its last byte completes: a token that starts a multi-byte character goes out with the token that
    ends it. Text held back because it could start a stop string holds its tokens' entries back with
    it. A stop string cuts the tokens whose text is wholly in it (or after it); a token whose text
    starts before the cut and runs into it goes out with the text sent of it. Untracked, a token costs
    what the text alone costs.
    """

    def __init__(self, decoder: TokenDecoder, stops: tuple[str, ...], *, base: int = 0, tracked: bool = False) -> None:
        self._decoder = decoder
        self._stop = StopText(stops)
        self._base = base  # characters before this text in the choice's (the echoed prompt's)
        self._tracked = tracked
        self._decoded = 0  # characters decoded so far
        self._sent = 0  # characters handed out so far
        self._waiting: deque[list] = deque()  # [entry payload, start, end (None: the decoder holds part of it)]

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def feed(self, token: int, payload: ScoredToken | int | None = None) -> tuple[str, list[Entry]]:
        """Add one token (``payload``: its entry, when tracked); the text to send now and the
        entries of the tokens that text completes."""
        text = self._decoder.feed(token)
        if not self._tracked:
            return self._stop.feed(text), _NO_ENTRIES
        start = self._decoded
        self._decoded += len(text)
        if text:  # the tokens whose character this one completed
            for waiting in self._waiting:
                if waiting[2] is None:
                    waiting[2] = self._decoded
        end = None if self._decoder.held else self._decoded
        self._waiting.append([token if payload is None else payload, start, end])
        return self._send(self._stop.feed(text))

    def finish(self) -> tuple[str, list[Entry]]:
        """The rest, once the choice's tokens have all been fed."""
        text = self._decoder.flush()
        if not self._tracked:
            return self._stop.feed(text) + self._stop.flush(), _NO_ENTRIES
        self._decoded += len(text)
        for waiting in self._waiting:
            if waiting[2] is None:
                waiting[2] = self._decoded
        return self._send(self._stop.feed(text) + self._stop.flush())

    def _send(self, out: str) -> tuple[str, list[Entry]]:
        self._sent += len(out)
        waiting, entries = self._waiting, []
        while waiting and waiting[0][2] is not None and waiting[0][2] <= self._sent:
            payload, start, _ = waiting.popleft()
            entries.append((self._base + start, payload))
        if self._stop.stopped:  # the cut: what starts before it goes with it, the rest never goes
            while waiting and waiting[0][1] < self._sent:
                payload, start, _ = waiting.popleft()
                entries.append((self._base + start, payload))
            waiting.clear()
        return out, entries


class TokenSpelling(Protocol):
    """What ResponseShape needs of the tokenizer: a token's bytes."""

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes: ...


@dataclass(frozen=True)
class ChoiceResult:
    """One whole choice: its text, why it ended, its tokens' entries (None: none asked for)."""

    text: str
    finish_reason: str
    entries: list[Entry] | None = None
    tool_calls: list[dict] | None = None  # chat: the calls the answer made (None: it is text)


@dataclass
class ResponseShape:
    """Builds the JSON objects of one response (chat or text, streamed or whole).

    ``tokenizer`` spells the tokens of log-probabilities: a token's ``bytes`` are its raw bytes
    (special tokens' literal text included); its ``token`` string is those bytes as UTF-8, or, where
    they are not valid UTF-8 on their own (part of a character), ``bytes:\\xe2\\x80`` as OpenAI spells them.
    """

    kind: str
    model: str
    tokenizer: TokenSpelling | None = None

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self._spellings: dict[int, tuple[str, list[int]]] = {}

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str | None = None,
        *,
        index: int = 0,
        first: bool = False,
        finish_reason: str | None = None,
        entries: list[Entry] | None = None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        """One streamed chunk of choice ``index``: a text delta with the entries of the tokens it
        completes (None: no log-probabilities asked for), chat's ``tool_calls`` deltas, or the final
        one with its finish reason."""
        logprobs = None if entries is None else self.logprobs(entries)
        if self.kind == "chat":
            delta: dict[str, object] = (
                {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            )
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._envelope("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk of a stream asked to include usage: no choices, the counts."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage}

    def whole(self, choices: Sequence[ChoiceResult], usage: dict) -> dict:
        """The non-streamed response."""
        shaped = []
        for index, choice in enumerate(choices):
            logprobs = None if choice.entries is None else self.logprobs(choice.entries)
            if self.kind == "chat":
                message: dict = {"role": "assistant", "content": choice.text}
                if choice.tool_calls:
                    message = {"role": "assistant", "content": choice.text or None, "tool_calls": choice.tool_calls}
                shaped.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish_reason,
                    }
                )
            else:
                shaped.append(
                    {"index": index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
                )
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": shaped, "usage": usage}

    def logprobs(self, entries: list[Entry]) -> dict:
        """A choice's ``logprobs`` object for ``entries``: chat's ``{"content": [...], "refusal":
        null}``, or completions' ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
        if self.kind == "chat":
            content = []
            for _, scored in entries:
                assert isinstance(scored, ScoredToken)  # chat scores generated tokens only
                token, data = self._spell(scored.token)
                alternatives = [
                    self._alternative(int(t), float(v)) for t, v in zip(scored.top_ids, scored.top_logprobs)
                ]
                content.append({"token": token, "logprob": scored.logprob, "bytes": data, "top_logprobs": alternatives})
            return {"content": content, "refusal": None}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for offset, scored in entries:
            offsets.append(offset)
            if isinstance(scored, int):  # the prompt's first token: nothing before it to be scored on
                tokens.append(self._spell(scored)[0])
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            tokens.append(self._spell(scored.token)[0])
            token_logprobs.append(scored.logprob)
            # the most likely tokens, and the chosen one where it is not among them (as OpenAI does)
            top = {self._spell(int(t))[0]: float(v) for t, v in zip(scored.top_ids, scored.top_logprobs)}
            top.setdefault(tokens[-1], scored.logprob)
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _alternative(self, token_id: int, logprob: float) -> dict:
        token, data = self._spell(token_id)
        return {"token": token, "logprob": logprob, "bytes": data}

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        """A token's string and bytes (cached: the same alternatives come back at many positions)."""
        spelled = self._spellings.get(token_id)
        if spelled is None:
            if self.tokenizer is None:
                raise RuntimeError("a response with log-probabilities needs the tokenizer to spell its tokens")
            data = self.tokenizer.token_bytes(token_id, skip_special=False)
            try:
                token = data.decode("utf-8")
            except UnicodeDecodeError:
                token = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            spelled = self._spellings[token_id] = (token, list(data))
        return spelled


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The OpenAI usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
