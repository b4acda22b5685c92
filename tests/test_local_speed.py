"""The local prefill model: its fit on synthetic samples, its updates, and a calibration on the real model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgedecode.daemon.pull.local_speed import LocalPrefillModel

GRID = np.unique(np.geomspace(1, 20000, 400).astype(int))


def _quadratic(n: float) -> float:
    return 0.004 + 7e-4 * n + 6e-8 * n * n  # fixed overhead, per token, attention


def _predictions(model: LocalPrefillModel) -> np.ndarray:
    return np.array([model.predict_seconds(int(n)) for n in GRID])


def test_power_law_is_recovered_exactly_between_and_above_the_points():
    """Three samples of s = k·n^p (1 <= p <= 2) pin the curve between and above them; below the first,
    the slope is at most 1 (a fixed overhead), so the prediction is at least the power law's."""
    model = LocalPrefillModel([(n, 2e-4 * n**1.2) for n in (16, 128, 512)])
    for n in (16, 50, 300, 512, 1000, 4096, 20000):
        assert model.predict_seconds(n) == pytest.approx(2e-4 * n**1.2, rel=1e-9)
    for n in (1, 7):
        assert model.predict_seconds(n) == pytest.approx(2e-4 * 16**1.2 * (n / 16), rel=1e-9)


def test_known_quadratic_is_recovered_at_its_points_and_closely_between_them():
    """Samples of a + b·n + c·n² at every half octave from 16 to 2048: exact at the samples, within 3 %
    between them and within 10 % an octave beyond them."""
    lengths = np.unique(np.geomspace(16, 2048, 15).astype(int))
    model = LocalPrefillModel([(int(n), _quadratic(n)) for n in lengths])
    for n in lengths:
        assert model.predict_seconds(int(n)) == pytest.approx(_quadratic(n), rel=1e-9)
    for n in (20, 100, 300, 700, 1500):
        assert model.predict_seconds(n) == pytest.approx(_quadratic(n), rel=0.03)
    assert model.predict_seconds(4096) == pytest.approx(_quadratic(4096), rel=0.10)


@pytest.mark.parametrize("seed", range(8))
def test_predictions_are_monotone_and_never_negative_even_from_noisy_samples(seed):
    """Samples with 40 % noise (often decreasing in n): predictions still never decrease with n,
    are 0 for no tokens and positive otherwise."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 3000, 12)
    model = LocalPrefillModel(
        [(int(n), _quadratic(n) * rng.uniform(0.6, 1.4)) for n in lengths], smoothing=float(rng.uniform(0.1, 1))
    )
    for n, seconds in zip(rng.integers(1, 3000, 30), rng.uniform(1e-3, 3.0, 30)):
        model.observe(int(n), float(seconds))
    predicted = _predictions(model)
    assert np.all(np.diff(predicted) >= 0)
    assert np.all(predicted > 0)
    assert model.predict_seconds(0) == 0.0 and model.predict_seconds(-5) == 0.0


def test_past_the_last_point_time_grows_at_least_in_proportion():
    """A noisy last point (512 tokens barely slower than 128) does not make long prompts look cheap:
    past the last point each further token costs at least its average, at most quadratically more."""
    model = LocalPrefillModel([(16, 0.02), (128, 0.1), (512, 0.12)])
    assert model.predict_seconds(2048) == pytest.approx(4 * 0.12)
    steep = LocalPrefillModel([(128, 0.1), (512, 10.0)])
    assert steep.predict_seconds(1024) == pytest.approx(4 * 10.0)


def test_observe_moves_the_prediction_toward_recent_samples():
    """Real prefills twice as slow as calibrated pull the prediction at their length (a calibrated one
    or a new one) up step by step until it is within 2 % of them; newer samples weigh more than older
    ones; predictions stay monotone."""
    model = LocalPrefillModel([(n, _quadratic(n)) for n in (16, 128, 512)], smoothing=0.3)
    for n in (1500, 512):
        slow = 2 * _quadratic(n)
        history = [model.predict_seconds(n)]
        assert history[0] < 0.6 * slow
        for _ in range(12):
            model.observe(n, slow)
            history.append(model.predict_seconds(n))
        assert np.all(np.diff(history) > 0)
        assert history[-1] == pytest.approx(slow, rel=0.02)
        assert np.all(np.diff(_predictions(model)) >= 0)
    # the machine speeds up again: a few recent samples outweigh the many older ones
    for _ in range(3):
        model.observe(512, _quadratic(512))
    assert abs(model.predict_seconds(512) - _quadratic(512)) < abs(model.predict_seconds(512) - 2 * _quadratic(512))


def test_memory_is_bounded_by_length_bands():
    """Thousands of observations at every length keep one point per half-octave band."""
    model = LocalPrefillModel()
    for n in range(1, 5000):
        model.observe(n, _quadratic(n))
    assert len(model.points()) <= 2 * np.log2(5000) + 2
    assert model.predict_seconds(1000) == pytest.approx(_quadratic(1000), rel=0.05)


def test_model_without_samples_predicts_infinity_and_ignores_bad_samples():
    """Before any point local prefill is not to be counted on (infinite seconds; none for no tokens)."""
    model = LocalPrefillModel([(0, 1.0), (100, 0.0), (100, float("nan")), (100, -1.0), (100, float("inf"))])
    assert not model.ready
    assert model.predict_seconds(100) == float("inf") and model.predict_seconds(0) == 0.0
    assert model.tokens_per_second(100) == 0.0
    model.observe(100, 0.05)
    assert model.ready and model.predict_seconds(100) == pytest.approx(0.05)
    assert model.predict_seconds(200) == pytest.approx(0.1)  # one point: proportional


class _FakeEngine:
    """Prefills by sleeping 20 µs a token; records prompts; 'spec.vocab_size' as an Engine has it."""

    class spec:  # mirrors Engine.spec
        vocab_size = 1000

    def __init__(self, max_context: int = 4096) -> None:
        self.prompts: list[np.ndarray] = []
        self.length = 0
        self.max_context = max_context

    def prefill(self, prompt_ids: np.ndarray) -> np.ndarray:
        self.prompts.append(np.array(prompt_ids))
        self.length = len(prompt_ids)
        time.sleep(2e-5 * len(prompt_ids))
        return np.zeros(self.spec.vocab_size, np.float32)

    def reset(self) -> None:
        self.length = 0


def test_calibrate_measures_each_length_and_leaves_the_engine_reset():
    """A median of 3 runs per length after one warm-up, ordinary ids, the engine reset, earlier points
    replaced, the model itself returned."""
    engine = _FakeEngine()
    model = LocalPrefillModel([(2000, 100.0)])
    assert model.calibrate(engine, (512, 16, 128), runs=3) is model  # type: ignore[arg-type]
    sizes = [len(p) for p in engine.prompts]
    assert sizes == [1] + [16] * 3 + [128] * 3 + [512] * 3
    ids = np.concatenate(engine.prompts)
    assert ids.min() >= 0 and ids.max() < engine.spec.vocab_size and len(np.unique(ids)) > 16
    assert engine.length == 0
    assert [round(n) for n, _ in model.points()] == [16, 128, 512]
    assert model.predict_seconds(512) == pytest.approx(2e-5 * 512, rel=0.5)
    assert 0 < model.calibration_seconds < 1.0


def test_calibrate_keeps_to_the_engine_s_context():
    """A context shorter than a calibration length (daemon.max_context may be 64): the longest prompt
    it takes is measured instead, once, and the daemon starts."""
    engine = _FakeEngine(max_context=100)
    LocalPrefillModel().calibrate(engine, (16, 128, 512), runs=1)  # type: ignore[arg-type]
    assert [len(p) for p in engine.prompts] == [1, 16, 99]


def test_calibrate_real_model_predicts_a_real_prefill(decoder):
    """Calibration on the INT4 decode graph (2 threads) leaves the engine reset, its predictions positive and
    monotone, and within a factor of 2 of a real 300-token prefill measured right after. Both count the process's
    CPU time (the injected clock), which neighbours on a loaded machine inflate far less than the wall clock: on
    the GPU host's 16 cores beside five other test workers, a wall-clock calibration predicted half the
    prefill measured a moment later."""
    model = LocalPrefillModel().calibrate(decoder, clock=time.process_time)
    assert decoder.length == 0 and model.calibration_seconds > 0
    predicted = [model.predict_seconds(n) for n in (1, 16, 100, 300, 512, 1000, 2000)]
    assert all(p > 0 for p in predicted)
    assert predicted == sorted(predicted)
    prompt = np.resize(np.arange(500, 800, dtype=np.int64), 300)
    times = []
    for _ in range(3):
        tic = time.process_time()
        decoder.prefill(prompt)
        times.append(time.process_time() - tic)
    decoder.reset()
    actual = float(np.median(times))
    assert 0.5 * actual <= model.predict_seconds(300) <= 2.0 * actual


def test_a_range_of_positions_costs_the_difference_and_infinity_before_any_point():
    """What a split's head or a cut pull's rest costs here: never NaN, never negative."""
    assert LocalPrefillModel().predict_between(100, 400) == float("inf")
    assert LocalPrefillModel().predict_between(400, 400) == 0.0
    model = LocalPrefillModel([(100, 0.1), (400, 0.5)])
    assert model.predict_between(100, 400) == pytest.approx(0.4)
    assert model.predict_between(0, 100) == pytest.approx(model.predict_seconds(100))
