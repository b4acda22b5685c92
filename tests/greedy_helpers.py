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
