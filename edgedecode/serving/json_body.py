"""Request bodies as JSON objects that handlers can take at face value.

Python's ``json`` module accepts what no handler should see and fails in ways that are not the
client's error message: ``NaN`` and ``Infinity`` literals, floats that overflow to infinity
(``1e400``), integers of thousands of digits (``ValueError`` from the int-string limit, or an
``OverflowError`` later), strings holding lone UTF-16 surrogates (``"\\ud800"``, which no UTF-8
consumer such as the tokenizer accepts) and nesting deep enough to exhaust the interpreter's stack.
``parse_json_object`` refuses each of them with a ``BodyError`` that names the field at fault.
"""

from __future__ import annotations

import json
import math
from typing import Any

from edgedecode.errors import RequestError

MAX_DEPTH = 32  # nesting levels of objects and arrays; OpenAI-style bodies need 4 or 5
MAX_INT_DIGITS = 20  # enough for any 64-bit integer, signed or not


class BodyError(RequestError):
    """A request body that is not a JSON object of plain values; ``param`` names the field."""


class _Refused:
    """A value the parser met and refused; reported with its place once the document is walked."""

    def __init__(self, why: str) -> None:
        self.why = why


def _parse_int(text: str) -> int | _Refused:
    digits = len(text) - text.startswith("-")
    return int(text) if digits <= MAX_INT_DIGITS else _Refused(f"an integer of {digits} digits")


def _parse_float(text: str) -> float | _Refused:
    value = float(text)
    return value if math.isfinite(value) else _Refused(f"{text[:24]} is beyond the range of a float")


def _parse_constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a JSON number")


_NEEDS_A_LOOK = (str, dict, list, _Refused)  # numbers, booleans and null are fine once parsed


def parse_json_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object of finite numbers, integers of at most MAX_INT_DIGITS digits and
    valid Unicode strings, nested at most MAX_DEPTH deep; a BodyError naming the field otherwise."""
    try:
        document = json.loads(body, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise BodyError(
            f"the body is nested deeper than the parser allows (this server takes {MAX_DEPTH} levels)"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise BodyError(f"the body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise BodyError("the body must be a JSON object")
    _check_values(document)
    return document


def _check_values(document: dict[str, Any]) -> None:
    """Walk the document (iteratively: its depth is the client's) and refuse the first bad value."""
    stack: list[tuple[Any, str, int]] = [(document, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _Refused):
            raise BodyError(f"{path or 'the body'}: {value.why}", _param(path))
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise BodyError(f"{path or 'the body'} is nested more than {MAX_DEPTH} levels deep", _param(path))
            if isinstance(value, dict):
                for key, item in value.items():
                    child = f"{path}.{key}" if path else key
                    _check_text(key, child)
                    stack.append((item, child, depth + 1))
            else:
                stack.extend(
                    (item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value) if isinstance(item, _NEEDS_A_LOOK)
                )


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BodyError(
            f"{path or 'the body'} holds a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at "
            f"character {exc.start}: not valid Unicode text",
            _param(path),
        ) from None


def _param(path: str) -> str | None:
    """The field at fault (``messages[0].content``), or None for the body itself."""
    return path or None
