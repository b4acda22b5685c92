"""Needle-in-a-haystack: a 4-digit code hidden at a depth of a long prose prompt, asked for at the end."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.model.tokenizer import Tokenizer
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams

NEEDLE = "\nThe secret code is {code}.\n"
QUESTION = "\n\nWhat is the secret code? Reply with the four digits."
HAYSTACK_TOPICS = ("specialnames", "compound", "types")
ANSWER_TOKENS = 24  # digits tokenize one per token and the model answers in a sentence


@dataclass(frozen=True)
class NeedleTrial:
    depth: float
    code: str
    prompt_ids: np.ndarray


def pydoc_haystack() -> str:
    """The haystack of research/niah.md's FP16 baseline: three long CPython help topics."""
    from pydoc_data.topics import topics

    return "\n".join(topics[name] for name in HAYSTACK_TOPICS)


def needle_trials(
    tokenizer: Tokenizer,
    *,
    context_tokens: int,
    depth_count: int,
    trials_per_depth: int,
    seed: int = 0,
    haystack: str | None = None,
) -> list[NeedleTrial]:
    """Chat prompts of about ``context_tokens`` haystack tokens (default: ``pydoc_haystack``) with the
    needle at ``depth_count`` depths spread evenly over the prompt, ``trials_per_depth`` codes each."""
    depths = [round((i + 0.5) / depth_count, 3) for i in range(depth_count)]
    haystack = pydoc_haystack() if haystack is None else haystack
    rng = np.random.default_rng(seed)
    filler = tokenizer.encode(haystack, parse_special=False)
    trials = []
    for depth in depths:
        for t in range(trials_per_depth):
            code = f"{rng.integers(1000, 10000)}"
            start = (t * 997) % max(len(filler) - context_tokens, 1)  # a different stretch of text per trial
            window = filler[start : start + context_tokens]
            cut = int(depth * len(window))
            text = tokenizer.decode(window[:cut]) + NEEDLE.format(code=code) + tokenizer.decode(window[cut:])
            ids = tokenizer.encode_chat([{"role": "user", "content": text + QUESTION}])
            trials.append(NeedleTrial(depth, code, np.asarray(ids, np.int64)))
    return trials


def answer(engine: Engine, tokenizer: Tokenizer, trial: NeedleTrial, kv: KVSnapshot | None) -> bool:
    """Whether greedy decoding (after ``kv`` for the prompt, if given) states the code."""
    tokens = list(engine.generate(trial.prompt_ids, SamplingParams(max_tokens=ANSWER_TOKENS), kv=kv))
    return trial.code in tokenizer.decode(tokens)
