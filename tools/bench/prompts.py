"""The prompts the benchmarks feed both engines: the first N tokens of CPython's bundled documentation prose."""

from __future__ import annotations

from pydoc_data.topics import topics

import numpy as np


def prompt_tokens(tokenizer, n: int) -> np.ndarray:
    """The first n tokens of CPython's bundled documentation prose."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer.encode(text[: n * 8])
    if len(ids) < n:
        raise SystemExit(f"not enough prose for a {n}-token prompt")
    return np.asarray(ids[:n], np.int64)
