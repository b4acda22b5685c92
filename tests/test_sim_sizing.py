"""The fleet simulation's model sizes and the sizing search (tools/sim/sizes.py, tools/sim/sizing.py)."""

from __future__ import annotations

import pytest
from tool_modules import import_tools

fleet, sizes_module, sizing = import_tools("sim.fleet", "sim.sizes", "sim.sizing")
SIZES = sizes_module.sizes()


@pytest.mark.parametrize("threshold", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("guess", [1, 5, 16, 40])
def test_the_search_finds_the_fewest_replicas_that_meet_it_from_any_guess(threshold: int, guess: int) -> None:
    asked: list[int] = []

    def meets(replicas: int) -> bool:
        asked.append(replicas)
        return replicas >= threshold

    assert sizing.fewest_replicas(meets, guess) == threshold
    assert len(asked) <= 2 * max(threshold, guess).bit_length() + 2  # doubling, then bisecting: logarithmic
    assert 0 not in asked  # no tier without a replica is ever simulated


def test_each_size_reads_its_measured_figures_and_a_larger_model_costs_more_everywhere() -> None:
    smollm2, one_b, three_b, eight_b = (SIZES[name] for name in ("135m", "1b", "3b", "8b"))
    assert (smollm2.kv_bytes_per_token, one_b.kv_bytes_per_token, three_b.kv_bytes_per_token) == (
        23040,  # 30 layers x 3 KV heads x 64 x K,V x 2 bytes
        16 * 8 * 64 * 2 * 2,
        28 * 8 * 128 * 2 * 2,
    )
    assert smollm2.calibrated and not one_b.calibrated and one_b.calibration.model == "generic"
    measured = fleet.ServiceModel.from_bench(fleet.BENCH["gpu"]).points
    assert fleet.ServiceModel.from_bench(fleet.BENCH["gpu"], smollm2).points == measured  # the real model: as measured
    by_size = [fleet.ServiceModel.from_bench(fleet.BENCH["gpu"], size) for size in (one_b, three_b, eight_b)]
    for budget, rows in measured.items():
        for n, seconds in rows:
            bare = sizes_module.smollm2_bare_prefill_s(n)
            expected = (seconds - bare) * three_b.kv_ratio + n / three_b.replica_rate(n)
            assert by_size[1].seconds(n, budget) == pytest.approx(expected)
            times = [service.seconds(n, budget) for service in by_size]
            assert times == sorted(times) and times[0] < times[1] < times[2]
    for tokens in (60, 316, 2048):  # the edge box: local prefill slower with every size
        local = [size.local_model().predict_seconds(tokens) for size in (smollm2, one_b, three_b, eight_b)]
        assert local == sorted(local) and local[0] < local[-1]
    assert eight_b.edge_decode_tok_s < three_b.edge_decode_tok_s < one_b.edge_decode_tok_s


def _fixed(size_name: str, relay_ms_per_mb: float = 0.0) -> dict:
    size = SIZES[size_name]
    workload = fleet.Workload(boxes=200)
    service = fleet.ServiceModel.from_bench(fleet.BENCH["gpu"], size)
    return fleet.simulate(
        workload,
        service,
        50,  # never busy: the turns' times are the links' and the service's
        "fixed-0.3",
        sim_s=120.0,
        warmup_s=30.0,
        seed=3,
        size=size,
        relay_s_per_mb=relay_ms_per_mb / 1e3,
    )


def test_a_larger_model_sends_its_kv_bytes_and_a_slow_relay_is_what_the_payload_waits_for() -> None:
    small, large = _fixed("135m"), _fixed("3b")
    bytes_per_request = [run["egress_gbit_s"] / run["requests_per_s"] for run in (small, large)]
    ratio = SIZES["3b"].kv_bytes_per_token / SIZES["135m"].kv_bytes_per_token
    assert bytes_per_request[1] / bytes_per_request[0] == pytest.approx(ratio, rel=0.25)  # the same workload's turns
    relayed = _fixed("135m", relay_ms_per_mb=2000.0)  # 4 Mbit/s: slower than every link of the mix
    assert relayed["ttft_p50_s"] > small["ttft_p50_s"] + 0.5
    assert min(relayed["ttft_p95_by_link_s"].values()) > max(small["ttft_p95_by_link_s"].values())
