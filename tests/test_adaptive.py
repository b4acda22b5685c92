"""The KV planner on its own: the best budget the link delivers in time, local when that is what
meets the target or is fastest, never below the quality floor, the configured budget without a
target or while the link is unknown."""

from __future__ import annotations

import pytest

from edgedecode.daemon.adaptive import BUDGET_LADDER, PlanInputs, plan_kv

FP16_BYTES = 2048 * 23040  # a 2k-token prompt of SmolLM2


def _inputs(target_s, goodput_bps, *, rtt_s=0.02, local_s=5.0, min_budget=0.2, fixed=0.3) -> PlanInputs:
    def predict(wire_bytes: int) -> float | None:
        return None if goodput_bps is None else rtt_s + wire_bytes / goodput_bps

    return PlanInputs(
        target_s=target_s,
        fixed_budget=fixed,
        wire_bytes=lambda budget: int(budget * FP16_BYTES),
        predict_remote_s=predict,
        local_s=local_s,
        min_budget=min_budget,
    )


def test_without_a_target_or_a_known_link_the_configured_budget_is_asked():
    assert plan_kv(_inputs(None, 1e9)).budget == 0.3
    plan = plan_kv(_inputs(1.0, None))
    assert (plan.decision, plan.budget, plan.predicted_s) == ("remote", 0.3, None)


@pytest.mark.parametrize("mbit", [5, 20, 50, 100, 1000])
def test_the_best_budget_that_arrives_in_time_is_chosen(mbit):
    goodput = mbit * 1e6 / 8
    plan = plan_kv(_inputs(2.0, goodput))
    floor_s = 0.02 + 0.2 * FP16_BYTES / goodput
    if plan.decision == "local":  # nothing makes it and computing here (5 s) beats the floor's pull
        assert floor_s > 5.0
        return
    assert plan.predicted_s is not None and plan.budget is not None
    if plan.predicted_s <= 2.0:
        better = [b for b in BUDGET_LADDER if b > plan.budget]
        assert all(0.02 + b * FP16_BYTES / goodput > 2.0 for b in better)  # nothing better would make it
    else:  # nothing makes it (local takes 5 s): the fastest pull, at the floor
        assert plan.budget == 0.2 and plan.predicted_s < 5.0


def test_a_slower_link_gets_a_lower_budget():
    fast, slow = plan_kv(_inputs(2.0, 100e6 / 8)), plan_kv(_inputs(2.0, 40e6 / 8))
    assert fast.decision == slow.decision == "remote" and slow.budget < fast.budget


def test_when_no_budget_meets_the_target_local_does_if_it_can():
    plan = plan_kv(_inputs(1.0, 1e6 / 8, local_s=0.8))  # 1 Mbit/s: even b 0.2 takes ~75 s
    assert (plan.decision, plan.budget) == ("local", None)


def test_when_nothing_meets_the_target_the_fastest_is_chosen_and_the_floor_holds():
    slow_local = plan_kv(_inputs(0.5, 20e6 / 8, local_s=60.0, min_budget=0.25))
    assert (slow_local.decision, slow_local.budget) == ("remote", 0.25)  # the floor, never below it
    slow_link = plan_kv(_inputs(0.5, 1e6 / 8, local_s=10.0))
    assert slow_link.decision == "local"
