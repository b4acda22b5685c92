"""The KV planner on its own: the fastest of the best-quality options (remote budgets, local prefill)
that meet the target, the fastest of all when none does, never below the quality floor, the
configured budget without a target or while the link is unknown."""

from __future__ import annotations

import dataclasses
import math

import pytest

from edgedecode.daemon.pull.adaptive import BUDGET_LADDER, QUALITY_TIE_PCT, PlanInputs, QualityCosts, plan_kv
from edgedecode.daemon.pull.calibration import shipped
from edgedecode.daemon.pull.planner import NEAR_FASTEST, NEAR_FASTEST_S

FP16_BYTES = 2048 * 23040  # a 2k-token prompt of SmolLM2
SMOLLM2 = shipped()["smollm2-135m-instruct"]  # its measured quality costs


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
        quality=SMOLLM2.quality(),
    )


def test_without_a_target_or_a_known_link_the_configured_budget_is_asked():
    assert plan_kv(_inputs(None, 1e9)).budget == 0.3
    plan = plan_kv(_inputs(1.0, None))
    assert (plan.decision, plan.budget, plan.predicted_s) == ("remote", 0.3, None)


@pytest.mark.parametrize("mbit", [5, 20, 50, 100, 1000])
@pytest.mark.parametrize("local_s", [0.5, 5.0])
def test_the_plan_is_the_fastest_of_the_best_quality_that_arrives_in_time(mbit, local_s):
    goodput = mbit * 1e6 / 8
    costs = SMOLLM2.quality()
    plan = plan_kv(_inputs(2.0, goodput, local_s=local_s))
    options = {b: 0.02 + b * FP16_BYTES / goodput for b in BUDGET_LADDER if b >= 0.2}
    options[None] = local_s  # local prefill

    def cost(budget):
        return costs.local if budget is None else costs.of_budget(budget)

    meeting = {b: t for b, t in options.items() if t <= 2.0}
    chosen_s = options[plan.budget]
    assert plan.predicted_s == pytest.approx(chosen_s)
    if not meeting:  # the fastest of all
        assert chosen_s == min(options.values())
        return
    assert plan.budget in meeting
    best = min(cost(b) for b in meeting)
    assert cost(plan.budget) <= best + QUALITY_TIE_PCT  # no option in time is clearly better
    assert all(t >= chosen_s for b, t in meeting.items() if cost(b) <= best + QUALITY_TIE_PCT)  # the fastest of those


def test_a_slower_link_gets_a_lower_budget():
    fast, slow = plan_kv(_inputs(2.0, 100e6 / 8)), plan_kv(_inputs(2.0, 40e6 / 8))
    assert fast.decision == slow.decision == "remote" and slow.budget < fast.budget


def test_lossless_options_are_told_apart_by_speed_and_a_costly_local_loses_to_them():
    fast_link = _inputs(2.0, 1e9 / 8, local_s=0.8)  # b 0.5 in ~0.2 s and b 1.0 in ~0.4 s: both lossless
    assert (plan_kv(fast_link).decision, plan_kv(fast_link).budget) == ("remote", 0.5)
    slower_link = _inputs(2.0, 100e6 / 8, local_s=0.8)  # b 0.5 in ~1.9 s; local in 0.8 s at no cost
    assert plan_kv(slower_link).decision == "local"
    costly_local = dataclasses.replace(slower_link, quality=SMOLLM2.quality(1.0))
    assert (plan_kv(costly_local).decision, plan_kv(costly_local).budget) == ("remote", 0.5)


def test_measured_costs_are_interpolated_between_budgets_and_lengths():
    costs = QualityCosts(
        {1024: {1.0: 0.0, 0.5: 0.0, 0.3: 0.3, 0.2: 1.5}, 4096: {1.0: 0.0, 0.3: 0.7, 0.2: 3.5, 0.15: 3.0}}
    )
    assert costs.of_budget(0.4) == pytest.approx(0.15) and costs.of_budget(0.25) == pytest.approx(0.9)
    assert costs.of_budget(0.75) == 0.0
    assert costs.of_budget(0.1) == math.inf  # below every measured budget: unknown, never assumed cheap
    assert costs.of_budget(0.15, 2048) == math.inf  # b 0.15 measured at 4k only: unknown between 1k and 4k
    assert costs.of_budget(0.2, 2048) == pytest.approx(2.5)  # halfway between 1k and 4k in log2 of the length
    assert costs.of_budget(0.15, 4096) == 3.5  # never cheaper at a lower budget (a noisy measured mean)
    assert costs.of_budget(0.2, 8192) == 3.5 and costs.of_budget(0.2, 100) == 1.5


def test_the_quality_floor_holds_at_the_prompt_s_length():
    """Nothing meets the target, local is slow: the fastest pull allowed, which at 1k tokens may be
    b 0.2 (+1.53 %) but at 4k tokens must cost no more than +2 % there (b 0.2 is +3.62 %)."""

    def plan_for(length: int):
        inputs = dataclasses.replace(_inputs(0.5, 20e6 / 8, local_s=60.0, min_budget=0.1), context_tokens=length)
        return plan_kv(inputs)

    short, long = plan_for(1024), plan_for(4096)
    assert (short.decision, short.budget) == ("remote", 0.2)
    costs = SMOLLM2.quality()
    assert long.decision == "remote" and long.budget is not None and long.budget > 0.2
    assert costs.of_budget(long.budget, 4096) <= 2.0 < costs.of_budget(0.2, 4096)


def test_when_no_budget_meets_the_target_local_does_if_it_can():
    plan = plan_kv(_inputs(1.0, 1e6 / 8, local_s=0.8))  # 1 Mbit/s: even b 0.2 takes ~75 s
    assert (plan.decision, plan.budget) == ("local", None)


def test_when_nothing_meets_the_target_the_fastest_is_chosen_and_the_floor_holds():
    slow_local = plan_kv(_inputs(0.5, 20e6 / 8, local_s=60.0, min_budget=0.25))
    assert (slow_local.decision, slow_local.budget) == ("remote", 0.25)  # the floor, never below it
    slow_link = plan_kv(_inputs(0.5, 1e6 / 8, local_s=10.0))
    assert slow_link.decision == "local"


def _split_inputs(target_s: float, local_dppl: float = 0.0) -> PlanInputs:
    tokens = 2048
    return dataclasses.replace(
        _inputs(target_s, 100e6 / 8, rtt_s=0.3, local_s=tokens / 1000),  # 100 Mbit/s; round trip + server 0.3 s
        quality=SMOLLM2.quality(local_dppl),
        tokens=tokens,
        local_head_s=lambda head: head / 1000,  # 1000 tokens/s here
    )


def test_a_split_meets_a_target_neither_local_nor_a_pull_alone_can():
    plan = plan_kv(_split_inputs(1.5))  # local 2.05 s, b 0.5 ~2.2 s; half here and half pulled ~1.25 s
    assert plan.decision == "split" and plan.head == 1024 and plan.budget is not None, plan
    assert 0.5 * SMOLLM2.quality().of_budget(plan.budget) <= QUALITY_TIE_PCT  # as good as lossless
    tail_s = 0.3 + plan.budget * FP16_BYTES / 2 / (100e6 / 8)
    assert plan.predicted_s == pytest.approx(max(1024 / 1000, tail_s)) and plan.predicted_s <= 1.5


def test_a_split_costs_its_head_s_share_of_local_quality():
    plan = plan_kv(_split_inputs(1.5, local_dppl=5.0))  # the head's cost now outweighs b 0.2's +1.53 %
    assert (plan.decision, plan.head) == ("remote", 0) and plan.budget is not None and plan.budget < 0.5, plan


def test_a_split_whose_pull_is_slowed_by_sharing_the_cores_takes_a_larger_head():
    alone = plan_kv(_split_inputs(1.5))
    slowed = plan_kv(dataclasses.replace(_split_inputs(1.5), split_slowdown=1.3))
    assert alone.decision == slowed.decision == "split" and alone.pull_s is not None
    # the tail slowed by 1.3 moves the balance: more here, less pulled
    assert slowed.head > alone.head and slowed.predicted_s is not None and slowed.predicted_s <= 1.5  # a larger head
    assert slowed.pull_s is not None and slowed.predicted_s >= 1.3 * slowed.pull_s - 1e-9


# --- the default objective: no target, budget not pinned ---------------------------------------------


def _default(
    goodput_bps, *, local_s, rtt_s=0.02, correction=1.0, tokens=0, min_budget=0.2, near_s=NEAR_FASTEST_S
) -> PlanInputs:
    inputs = _inputs(None, goodput_bps, rtt_s=rtt_s, local_s=local_s, min_budget=min_budget)
    return dataclasses.replace(
        inputs,
        near_fastest=NEAR_FASTEST,
        near_fastest_s=near_s,
        remote_correction=correction,
        tokens=tokens,
        context_tokens=2048,
    )


def _slack(seconds: float) -> float:
    """The latest the default objective accepts when the fastest option takes ``seconds``."""
    return max(NEAR_FASTEST * seconds, seconds + NEAR_FASTEST_S)


def _cost(budget: float | None) -> float:
    costs = SMOLLM2.quality()
    return costs.local if budget is None else costs.of_budget(budget, 2048)


@pytest.mark.parametrize("mbit", [1, 10, 50, 100, 1000])
@pytest.mark.parametrize("local_s", [0.3, 2.8, 30.0])
def test_without_a_target_the_plan_is_the_best_quality_within_a_tenth_of_the_fastest(mbit, local_s):
    goodput = mbit * 1e6 / 8
    plan = plan_kv(_default(goodput, local_s=local_s))
    options = {b: 0.02 + b * FP16_BYTES / goodput for b in BUDGET_LADDER if b >= 0.2}
    options[None] = local_s
    fastest = min(t for b, t in options.items() if b is None or _cost(b) <= 2.0)
    assert plan.predicted_s is not None and plan.predicted_s <= _slack(fastest) + 1e-9
    assert plan.predicted_s <= _slack(local_s) + 1e-9  # never a pull much slower than computing here
    assert plan.deadline_s == pytest.approx(_slack(fastest))  # the segment watch's, for a pull
    near = [b for b, t in options.items() if t <= _slack(fastest) and _cost(b) <= 2.0]
    assert _cost(plan.budget) <= min(_cost(b) for b in near) + QUALITY_TIE_PCT


def test_a_turn_of_a_fraction_of_a_second_does_not_trade_quality_for_tens_of_milliseconds():
    # 1000 Mbit/s, 2k tokens: b 0.2 in ~0.1 s is the fastest; a tenth more would leave only it
    by_factor = plan_kv(_default(1e9 / 8, local_s=30.0, near_s=0.0))
    graced = plan_kv(_default(1e9 / 8, local_s=30.0))
    assert by_factor.budget is not None and graced.budget is not None and graced.budget > by_factor.budget
    assert _cost(graced.budget) < _cost(by_factor.budget) - QUALITY_TIE_PCT
    assert by_factor.predicted_s is not None and graced.predicted_s is not None
    assert graced.predicted_s <= by_factor.predicted_s + NEAR_FASTEST_S + 1e-9


def test_without_a_target_a_fast_link_pulls_and_a_slow_one_computes_here():
    assert plan_kv(_default(1e9 / 8, local_s=2.8)).decision == "remote"  # b 0.5 in ~0.4 s
    assert plan_kv(_default(10e6 / 8, local_s=2.8)).decision == "local"  # b 0.3 in ~11 s


def test_without_a_target_an_unknown_link_is_pulled_at_the_default_budget_under_a_watch():
    plan = plan_kv(_default(None, local_s=2.8))
    assert (plan.decision, plan.budget) == ("remote", 0.3)
    assert plan.deadline_s == pytest.approx(_slack(2.8))  # cut and computed here if it would end later than that


def test_a_learned_optimism_of_the_link_model_moves_a_near_tie_to_local():
    # b 0.5 (the floor here) predicted 1.0 s, local 1.05 s: a pull; pulls measured 1.3x slower than predicted: local
    goodput = 0.5 * FP16_BYTES / 0.98
    assert plan_kv(_default(goodput, local_s=1.05, min_budget=0.5)).decision == "remote"
    corrected = plan_kv(_default(goodput, local_s=1.05, correction=1.3, min_budget=0.5))
    assert corrected.decision == "local"
    fast = plan_kv(_default(goodput, local_s=30.0, correction=1.3, min_budget=0.5))
    assert fast.decision == "remote" and fast.pull_s is not None
    assert fast.predicted_s == pytest.approx(1.3 * fast.pull_s)  # the correction is what it learns against


def test_with_a_pinned_budget_and_no_target_the_budget_is_asked_as_before():
    plan = plan_kv(_inputs(None, 10e6 / 8, local_s=0.1, fixed=0.75))
    assert (plan.decision, plan.budget, plan.deadline_s) == ("remote", 0.75, None)
