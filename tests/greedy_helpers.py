"""Comparing two greedy runs "up to the first near-tie": where they part, and by how much each step led.

A margin is read from the step that chose the token (``Engine.generate_scored`` with ``top``): recomputing
that position in one batched pass is a different computation at int8 activations, where a last-bit
difference can move an activation's code, and can even reverse a step's own pick.
"""

from __future__ import annotations

TOP = 5  # the most likely tokens each scored step reports


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (over their common length); None if they never do."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def step_margin(step, other: int) -> float:
    """How far a greedy step's pick led ``other`` in its own logits (log-probabilities differ as logits do);
    infinite where ``other`` was not among the step's top tokens."""
    ranked = dict(zip(step.top_ids.tolist(), step.top_logprobs.tolist()))
    return step.logprob - ranked[other] if other in ranked else float("inf")


def logprob_margin(step, other: str) -> float:
    """How far an OpenAI ``logprobs.content`` step's token led ``other`` in its own log-probabilities (the
    server's reading of the step that chose it); infinite where ``other`` is not among its top tokens."""
    ranked = {top.token: top.logprob for top in step.top_logprobs}
    return step.logprob - ranked[other] if other in ranked else float("inf")


def assert_same_answer_up_to_a_near_tie(ours: list, theirs: list, label: str, near_tie: float) -> None:
    """Two greedy answers (OpenAI ``logprobs.content`` steps) are the same tokens, or part only where each step
    led the other's token by less than ``near_tie`` (logits)."""
    tokens, other_tokens = [step.token for step in ours], [step.token for step in theirs]
    split = first_divergence(tokens, other_tokens)
    if split is None:
        assert tokens == other_tokens, label
        return
    a, b = ours[split], theirs[split]
    margins = logprob_margin(a, b.token), logprob_margin(b, a.token)
    print(f"{label}: diverge at token {split}: {a.token!r} by {margins[0]:.3f}, {b.token!r} by {margins[1]:.3f}")
    assert 0 <= margins[0] < near_tie and 0 <= margins[1] < near_tie, label
