"""The prefill tier's affinity rule (prefill/fleet/affinity.py) and the speeds a replica reports for it
(prefill/speed.py): a prompt waits for the replica holding its prefix only while the hit saves more than the wait."""

from __future__ import annotations

import pytest

from edgedecode.prefill.fleet.affinity import prefer_holder
from edgedecode.prefill.speed import SPEED_WEIGHT, ServerSpeed, SpeedMeter


def test_an_idle_holder_is_always_preferred():
    assert prefer_holder(0, 2, None, None)
    assert prefer_holder(0, 2, 0.5, 0.0)  # no queue to wait in: a hit costs nothing
    assert prefer_holder(0, 0, 0.5, 0.001)


def test_without_known_speeds_the_request_count_alone_decides():
    assert prefer_holder(2, 2, None, None) and not prefer_holder(3, 2, None, None)
    assert prefer_holder(2, 2, 0.25, None) and prefer_holder(2, 2, None, 1.0)


@pytest.mark.parametrize(
    ("extra", "request_s", "saved_s", "preferred"),
    [
        (1, 0.25, 0.30, True),  # one request of queue, 0.25 s, for a hit that saves 0.3 s: worth it
        (1, 0.25, 0.20, False),  # the hit saves less than the queue adds: the least busy
        (2, 0.10, 0.20, True),
        (2, 0.11, 0.20, False),
        (3, 0.01, 9.00, False),  # past the imbalance bound whatever the speeds
    ],
)
def test_a_busier_holder_is_preferred_while_the_hit_saves_more_than_its_queue_adds(
    extra, request_s, saved_s, preferred
):
    assert prefer_holder(extra, 2, request_s, saved_s) is preferred


def test_a_replica_reports_its_speeds_once_a_request_computed_tokens():
    meter = SpeedMeter()
    assert meter.speed() is None
    meter.add(0.2, 0.0, 0)  # a request that computed nothing (a full cache hit): no per-token figure yet
    assert meter.speed() is None
    meter.add(0.4, 0.05, 500)
    speed = meter.speed()
    assert speed is not None
    assert speed.request_s == pytest.approx((1 - SPEED_WEIGHT) * 0.2 + SPEED_WEIGHT * 0.4)
    assert speed.prefill_s_per_token == pytest.approx(0.05 / 500)
    for _ in range(200):  # a running mean: it follows a change of speed
        meter.add(1.0, 0.2, 1000)
    assert meter.speed() == ServerSpeed(pytest.approx(1.0), pytest.approx(0.2 / 1000))
