"""Sampling on synthetic logits: the parameters mean what they say."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgedecode.runtime.sampler import Sampler, SamplingError, SamplingParams

logit_rows = st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=64).map(
    lambda xs: np.array(xs, np.float32)
)


@given(logit_rows)
def test_temperature_zero_is_argmax(logits):
    assert Sampler(SamplingParams()).pick(logits) == int(np.argmax(logits))


@given(logit_rows, st.integers(0, 2**31))
@settings(max_examples=50)
def test_top_k_one_picks_a_maximum_whatever_the_temperature(logits, seed):
    assert logits[Sampler(SamplingParams(temperature=5.0, top_k=1, seed=seed)).pick(logits)] == logits.max()


@given(logit_rows, st.integers(1, 8), st.integers(0, 2**31))
@settings(max_examples=50)
def test_top_k_only_returns_the_k_highest(logits, k, seed):
    k = min(k, len(logits))
    threshold = np.sort(logits)[-k]
    assert logits[Sampler(SamplingParams(temperature=2.0, top_k=k, seed=seed)).pick(logits)] >= threshold


def test_top_p_keeps_the_smallest_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    picks = {sampler.pick(logits) for _ in range(300)}
    assert picks == {0, 1}


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    counts = np.bincount([sampler.pick(np.log(probs)) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, probs, atol=0.03)


def test_same_seed_same_sequence():
    logits = np.zeros(100, np.float32)
    first, second = (Sampler(SamplingParams(temperature=1.0, seed=3)) for _ in range(2))
    picks = [first.pick(logits) for _ in range(20)]
    assert picks == [second.pick(logits) for _ in range(20)]
    assert len(set(picks)) > 5


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=-1)]
)
def test_invalid_parameters_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def test_greedy_over_float16_picks_what_float32_argmax_picks():
    from edgedecode.runtime.sampler import greedy

    rng = np.random.default_rng(3)
    for _ in range(50):
        logits = (rng.standard_normal(4096) * rng.choice([0.01, 1.0, 300.0])).astype(np.float16)
        assert greedy(logits) == int(np.argmax(logits.astype(np.float32)))
    negative = -np.abs(rng.standard_normal(100)).astype(np.float16) - 1
    assert greedy(negative) == int(np.argmax(negative.astype(np.float32)))


@given(logit_rows, st.sampled_from([1e-308, 5e-324, 1e-30, 1e308]), st.integers(0, 2**31))
@settings(max_examples=50)
def test_extreme_temperatures_give_a_token_never_nan(logits, temperature, seed):
    """A temperature near 0 picks a maximum (as greedy would) and a huge one any token: dividing the
    logits first overflowed to inf, and the probabilities to NaN (a 500 from the daemon)."""
    picked = Sampler(SamplingParams(temperature=temperature, seed=seed)).pick(logits)
    assert 0 <= picked < len(logits)
    if temperature < 1e-30:
        assert logits[picked] == logits.max()
