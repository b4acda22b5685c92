"""An answer's text, as it comes, read back as content or as OpenAI ``tool_calls``.

Under a tools grammar (``output_rules``) the text is either content, which never starts with the
format's call marker, or calls, each exactly ``ToolFormat.header(name)`` + arguments JSON +
``ToolFormat.tail()``, separated by the format's separator. ``ToolCallReader`` decides which from
the first characters and hands out deltas the way OpenAI streams them: a call's first delta has its
``id``, ``type`` and function ``name`` (arguments empty), the next ones pieces of its ``arguments``
text; the official client concatenates them per ``index``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from edgedecode.daemon.output_rules import call_marker
from edgedecode.daemon.tool_prompt import ToolFormat


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: its start (``id`` and ``name`` set) or more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict:
        """The delta's entry in a chunk's ``delta.tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


class ToolCallReader:
    """One choice's text under a tools grammar: ``feed`` it as it comes, each call returning the
    content to send and the call deltas; ``calls`` holds the calls read so far in OpenAI's shape."""

    def __init__(self, form: ToolFormat, names: Sequence[str]) -> None:
        self._form = form
        self._marker = call_marker(form)
        self._headers = {form.header(name): name for name in names}
        self._buffer = ""  # text not handed out yet
        self._mode: str | None = None  # None until the first characters decide: "content" or "calls"
        self._phase = "header"  # within calls: "header", "arguments", "tail", "between"
        self._depth, self._in_string, self._escaped = 0, False, False
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """Add text; the content to send now and the calls' deltas it completes."""
        self._buffer += text
        if self._mode is None:
            if self._buffer.startswith(self._marker):
                self._mode = "calls"
            elif self._marker.startswith(self._buffer):
                return "", []  # could still be the start of a call
            else:
                self._mode = "content"
        if self._mode == "content":
            out, self._buffer = self._buffer, ""
            return out, []
        return "", self._read_calls()

    def finish(self) -> str:
        """The content held back at the end (text too short to tell from a call's start)."""
        out = self._buffer if self._mode != "calls" else ""
        self._buffer = ""
        return out

    def _read_calls(self) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        while self._buffer:
            if self._phase == "header":
                name = next((n for h, n in self._headers.items() if self._buffer.startswith(h)), None)
                if name is None:
                    break  # the header is not complete yet
                self._buffer = self._buffer[len(self._form.header(name)) :]
                call_id = f"call_{secrets.token_hex(12)}"
                self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
                deltas.append(CallDelta(len(self.calls) - 1, "", call_id, name))
                self._phase, self._depth = "arguments", 0
            elif self._phase == "arguments":
                taken = self._arguments_end()
                piece, self._buffer = self._buffer[:taken], self._buffer[taken:]
                self.calls[-1]["function"]["arguments"] += piece
                index = len(self.calls) - 1
                if deltas and deltas[-1].index == index:  # one delta per call and chunk
                    last = deltas.pop()
                    deltas.append(CallDelta(index, last.arguments + piece, last.id, last.name))
                else:
                    deltas.append(CallDelta(index, piece))
                if self._depth > 0 or not piece:
                    break
                self._phase = "tail"
            elif self._phase == "tail":
                tail = self._form.tail()
                if len(self._buffer) < len(tail):
                    break
                self._buffer, self._phase = self._buffer[len(tail) :], "between"
            else:
                separator = self._form.separator
                if len(self._buffer) < len(separator):
                    break
                self._buffer, self._phase = self._buffer[len(separator) :], "header"
        return deltas

    def _arguments_end(self) -> int:
        """How much of the buffer is arguments: all of it, or up to the end of the arguments object."""
        for i, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(self._buffer)
