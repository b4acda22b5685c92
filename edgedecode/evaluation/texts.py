"""Evaluation text that needs no download: CPython's `pydoc_data.topics` prose, or any UTF-8 file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgedecode.model.tokenizer import Tokenizer


def pydoc_corpus() -> list[str]:
    """The help topics shipped with CPython, in a fixed order (by topic name)."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def token_windows(tokenizer: Tokenizer, texts: list[str], length: int, count: int) -> list[np.ndarray]:
    """``count`` windows of ``length`` token ids: each from its own text when texts are long enough
    (the longest texts, spread over the corpus), else consecutive windows of the concatenation."""
    encoded = [np.asarray(tokenizer.encode(t, parse_special=False), np.int64) for t in texts]
    long_enough = [i for i, ids in enumerate(encoded) if len(ids) >= length]
    if len(long_enough) >= count:
        picks = np.linspace(0, len(long_enough) - 1, count).round().astype(int)
        return [encoded[long_enough[i]][:length] for i in picks]
    joined = np.concatenate(encoded)
    if len(joined) < count * length:
        raise ValueError(f"the text has {len(joined)} tokens; {count} windows of {length} need {count * length}")
    return [joined[i * length : (i + 1) * length] for i in range(count)]


def read_text_file(path: Path) -> list[str]:
    """One UTF-8 file as a single text (a clear error for anything else)."""
    try:
        return [path.read_text(encoding="utf-8")]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path} as UTF-8 text: {exc}") from exc
