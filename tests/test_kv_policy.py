"""The tier allocator and the named policies: budgets hold, DROP only when needed, importance decides."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgedecode.kv.policy import (
    POLICIES,
    BudgetError,
    TierProfile,
    allocate,
    pdtrim_tiers,
    pin_priority,
    pinned_mask,
    policy_tiers,
)
from edgedecode.kv.quant import token_nbytes
from edgedecode.kv.tiers import Tier
from edgedecode.kv.value_range import KVValueRange

COSTS = {tier: 30 * token_nbytes(tier, 3, 64) for tier in Tier}


def _cost(tiers: np.ndarray) -> float:
    return sum(COSTS[Tier(t)] for t in tiers) / (len(tiers) * COSTS[Tier.FP16])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), budget=st.floats(0.0, 1.2), seed=st.integers(0, 2**16))
def test_allocation_fits_the_budget_and_drops_only_when_required(n, budget, seed):
    importance = np.random.default_rng(seed).pareto(1.5, n)
    tiers = allocate(importance, budget, COSTS, TierProfile(), pinned_mask(np.arange(n)))
    assert _cost(tiers) <= budget + 1e-9
    all_int4 = COSTS[Tier.INT4] / COSTS[Tier.FP16]
    if budget >= all_int4:
        assert not np.any(tiers == Tier.DROP)
    else:
        kept = tiers != Tier.DROP
        assert kept.sum() == min(int(budget * n * COSTS[Tier.FP16] // COSTS[Tier.INT4]), n)
        # The least important tokens are the dropped ones (pinned ones last).
        if kept.any() and (~kept).any():
            weight = np.where(pinned_mask(np.arange(n)), np.inf, importance)
            assert weight[kept].min() >= weight[~kept].max()


def test_upgrades_go_to_pinned_then_most_important_tokens():
    n = 1000
    importance = np.ones(n)
    importance[[100, 200]] = 50.0
    pinned = pinned_mask(np.arange(n))
    step = COSTS[Tier.INT8] - COSTS[Tier.INT4]
    budget = (n * COSTS[Tier.INT4] + (pinned.sum() + 2.5) * step) / (n * COSTS[Tier.FP16])  # 70.5 upgrades
    tiers = allocate(importance, budget, COSTS, TierProfile(), pinned)
    assert np.all(tiers[pinned] == Tier.INT8)  # sinks and the recent window first
    assert tiers[100] == Tier.INT8 and tiers[200] == Tier.INT8  # then the most attended
    assert np.all(tiers[~pinned & (importance == 1)] == Tier.INT4)


def test_full_budget_sends_everything_at_fp16_and_a_tier_profile_restricts_tiers():
    assert np.all(allocate(np.ones(64), 1.0, COSTS, TierProfile()) == Tier.FP16)
    only_int8 = TierProfile((Tier.FP16, Tier.INT8), TierProfile().distortion)
    assert np.all(allocate(np.ones(64), 0.535, COSTS, only_int8) == Tier.INT8)  # INT8 is 0.531
    with pytest.raises(BudgetError, match="DROP is not allowed"):
        allocate(np.ones(64), 0.3, COSTS, only_int8)


def test_a_tier_worse_than_dropping_is_never_used():
    profile = TierProfile((Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT2, Tier.DROP))  # INT2 distortion 3 > DROP's 1
    tiers = allocate(np.random.default_rng(0).random(500), 0.25, COSTS, profile)
    assert not np.any(tiers == Tier.INT2)


@pytest.mark.parametrize("int3_distortion, kept_tier, dropped", [(0.2, Tier.INT3, 0), (0.43, Tier.INT4, 100)])
def test_int3_is_used_where_it_sits_on_the_hull_between_drop_and_int4(int3_distortion, kept_tier, dropped):
    """At b = INT3's cost (0.25): every token at INT3 when INT3 is worth its bytes; when it loses too much (the
    probe's 0.43 on SmolLM2: a DROP -> INT3 step buys less per byte than DROP -> INT4), INT4 and drops instead."""
    distortion = {**TierProfile().distortion, Tier.INT3: int3_distortion}
    profile = TierProfile((Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.DROP), distortion)
    tiers = allocate(np.random.default_rng(1).random(500), 0.25, COSTS, profile)
    assert _cost(tiers) <= 0.25 + 1e-9
    assert int((tiers == Tier.DROP).sum()) == dropped
    assert set(np.unique(tiers)) - {Tier.DROP} == {kept_tier}


def test_a_profile_names_the_tiers_its_model_wants_rotated(tmp_path):
    """The probe keeps a rotation per tier where it measured lower KL; the profile carries it to the sender."""
    assert TierProfile().rotation() is None
    profile = TierProfile(rotated=(Tier.INT4, Tier.INT3))
    rotation = profile.rotation()
    assert rotation is not None and rotation.tiers == (Tier.INT4, Tier.INT3) and rotation.rotates(Tier.INT3)
    assert not rotation.rotates(Tier.INT2)
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert TierProfile.load(path) == profile
    legacy = {"allowed": ["FP16", "INT4", "DROP"], "distortion": {"FP16": 0.0, "INT4": 0.05, "DROP": 1.0}}
    path.write_text(json.dumps(legacy))  # a profile saved before EDKV 1.3: nothing rotated
    assert TierProfile.load(path).rotated == ()


def test_profile_round_trips_through_json(tmp_path):
    profile = TierProfile((Tier.FP16, Tier.INT4, Tier.DROP), {Tier.FP16: 0.0, Tier.INT4: 0.05, Tier.DROP: 1.0}, "probe")
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert TierProfile.load(path) == profile
    assert TierProfile.load(tmp_path / "missing.json") == TierProfile()


def test_limiting_a_profile_to_a_receivers_tiers_keeps_every_other_field():
    """The prefill server and the quality study narrow a profile to what a receiver reads: a field left
    behind (the rotation, the measured value range) would silently fall back to its default."""
    full = TierProfile(
        (Tier.FP16, Tier.INT8, Tier.INT4, Tier.INT3, Tier.DROP),
        {**TierProfile().distortion, Tier.INT3: 0.25},
        "probe",
        (Tier.INT4, Tier.INT3),
        KVValueRange(((1.0, 2.0), (3.0, 4.5)), "probe"),
    )
    default = TierProfile()
    assert all(getattr(full, f.name) != getattr(default, f.name) for f in fields(TierProfile))  # a drop would show
    limited = full.limited_to(set(Tier) - {Tier.INT3})
    assert limited.allowed == (Tier.FP16, Tier.INT8, Tier.INT4, Tier.DROP)
    for name in (f.name for f in fields(TierProfile) if f.name != "allowed"):
        assert getattr(limited, name) == getattr(full, name), name


@pytest.mark.parametrize("budget", [0.5, 0.3, 0.2, 0.1])
def test_every_policy_meets_the_budget(budget):
    n = 600
    positions = np.arange(n)
    attention = np.random.default_rng(1).pareto(1.2, n)
    for policy in POLICIES:
        tiers = policy_tiers(policy, budget, positions, COSTS, attention=attention)
        assert _cost(tiers) <= budget + 1e-9, policy


def test_pdtrim_keeps_head_and_tail_at_fp16():
    tiers = pdtrim_tiers(100, 0.3, 0.25)
    kept = np.flatnonzero(tiers == Tier.FP16)
    assert list(kept) == list(range(8)) + list(range(78, 100))
    assert np.all(tiers[8:78] == Tier.DROP)


def test_unknown_policy_is_named():
    with pytest.raises(BudgetError, match="unknown KV policy 'best'"):
        policy_tiers("best", 0.3, np.arange(10), COSTS)


@pytest.mark.parametrize("n", [5, 24, 68])
def test_a_short_prompt_too_big_for_its_budget_keeps_its_newest_tokens(n):
    """Every token of a short prompt is pinned; when some must go, the recent window's oldest go
    first — never the last tokens (a chat's generation prompt) nor the attention sinks."""
    positions = np.arange(n)
    attention = np.random.default_rng(n).pareto(1.5, n)
    int4_share = COSTS[Tier.INT4] / COSTS[Tier.FP16]
    budget = int4_share * (n - 2) / n  # room for all but two tokens at INT4
    tiers = policy_tiers("ours", budget, positions, COSTS, attention=attention)
    dropped = np.flatnonzero(tiers == Tier.DROP)
    assert len(dropped) == 2 and np.all(tiers[-min(4, n - 2) :] != Tier.DROP)
    if n > 8:
        assert list(dropped) == [4, 5]  # the oldest of the recent window after the four sinks


def test_pin_priority_ranks_sinks_and_the_newest_first():
    priority = pin_priority(np.arange(200))
    assert np.all(priority[4:136] == 0) and priority[-1] == 1.0
    assert np.all(np.diff(priority[136:]) > 0)  # the window's oldest ranks lowest
    assert priority[-5] < priority[0] < priority[-4]  # the sinks come right after the four newest
