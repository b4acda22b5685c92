"""The serving building blocks on their own: config, prefix cache, circuit breaker, slot queue,
stop strings and request validation (no model, no network)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgedecode.config import ConfigError, load_config
from edgedecode.daemon.openai_responses import StopText
from edgedecode.daemon.pull.breaker import CircuitBreaker
from edgedecode.daemon.slots import QueueFullError, SlotPool
from edgedecode.kv.prefix import block_chain, chain_from_hex, chain_to_hex
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.model.spec import DECODER_KV_LAYOUT, KVContract
from edgedecode.prefill.prefix_cache import PrefixCache

CONTRACT = KVContract("llama", 2, 1, 4, 10000.0, DECODER_KV_LAYOUT, "t")
PRODUCER = KVProducer("m", "0" * 64, "test")


# --- config -------------------------------------------------------------------------------------


def test_config_layers_file_env_and_flags(tmp_path):
    path = tmp_path / "edgedecode.toml"
    path.write_text("[daemon]\nport = 9000\nbudget = 0.5\nslots = 3\n[prefill]\nprefix_cache_mb = 64\n")
    config = load_config(
        path,
        env={"EDGEDECODE_DAEMON_BUDGET": "0.25", "EDGEDECODE_MODEL_THREADS": "1", "UNRELATED": "x"},
        overrides={"daemon": {"port": 9100, "host": None}},
    )
    assert (config.daemon.port, config.daemon.budget, config.daemon.slots) == (9100, 0.25, 3)
    assert config.daemon.host == "127.0.0.1"  # a None flag leaves the default
    assert (config.prefill.prefix_cache_mb, config.model.threads) == (64, 1)


@pytest.mark.parametrize(
    "text, env, message",
    [
        ("[daemon]\nprot = 1\n", {}, "unknown key daemon.prot (did you mean 'port'?)"),
        ("[deamon]\n", {}, "unknown section [deamon]"),
        ("[daemon]\nport = 'x'\n", {}, "expected int, got 'x'"),
        ("", {"EDGEDECODE_DAEMON_BUDGET": "lots"}, "environment variable EDGEDECODE_DAEMON_BUDGET: expected float"),
        ("[daemon]\nbudget = 1.5\n", {}, "daemon.budget must be in [0, 1]"),
        ("[daemon]\nhost = '0.0.0.0'\n", {}, "set daemon.auth_token"),
        ("[daemon]\npolicy = 'best'\n", {}, "daemon.policy must be one of"),
        ("[daemon]\nprefill_url = 'ftp://x'\n", {}, "daemon.prefill_url must be an http(s) URL"),
        ("[daemon\n", {}, "is not valid TOML"),
        ("", {"EDGEDECODE_DAEMON_LINK_STALE_MARGIN": "0.5"}, "daemon.link_stale_margin must be in [1, 100]"),
        ("[daemon]\nlink_reprobe_s = -1\n", {}, "daemon.link_reprobe_s must be >= 0"),
        (
            "[daemon]\nstate_dir = '/nonexistent/state'\n",
            {},
            "daemon.state_dir (/nonexistent/state) must be a directory",
        ),
        ("[fleet]\nrouting = 'random'\n", {}, "fleet.routing must be one of affinity, round_robin"),
        ("[fleet]\nreplicas = 4\nmax_replicas = 3\n", {}, "autoscaling needs 0 <= fleet.min_replicas"),
    ],
)
def test_config_errors_name_the_key_and_source(tmp_path, text, env, message):
    path = tmp_path / "edgedecode.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path, env=env)
    assert message in str(error.value)


def test_config_non_loopback_bind_with_token_and_missing_file(tmp_path):
    config = load_config(None, env={"EDGEDECODE_PREFILL_HOST": "0.0.0.0", "EDGEDECODE_PREFILL_AUTH_TOKEN": "s"})
    assert config.prefill.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})


# --- prefix cache -------------------------------------------------------------------------------


def _snapshot(tokens) -> KVSnapshot:
    n = len(tokens)
    keys = np.arange(2 * n * 4, dtype=np.float32).reshape(2, 1, n, 4)
    return KVSnapshot(CONTRACT, np.asarray(tokens, np.int64), np.arange(n), keys, -keys, PRODUCER)


def test_prefix_cache_finds_the_longest_block_aligned_shared_prefix():
    cache = PrefixCache(1 << 20, block_tokens=4)
    first = _snapshot(range(10))
    assert cache.store(first)
    hit = cache.lookup(np.array([0, 1, 2, 3, 4, 5, 6, 7, 99, 100]))
    assert hit.n_tokens == 8
    np.testing.assert_array_equal(hit.kv.keys, first.keys[:, :, :8])
    assert cache.lookup(np.array([0, 1, 2, 99, 4])) is None  # differs inside the first block
    assert cache.lookup(np.array([0, 1, 2])) is None  # no complete block
    first.keys[:] = -1  # the cache holds its own copy
    assert cache.lookup(np.arange(9)).kv.keys.min() >= 0


def test_prefix_cache_counts_the_leading_blocks_of_a_chain_it_holds():
    cache = PrefixCache(1 << 20, block_tokens=4)
    cache.store(_snapshot(range(10)))
    assert cache.held_blocks(block_chain(np.arange(10), 4)) == 2
    assert cache.held_blocks(block_chain(np.array([0, 1, 2, 3, 9, 9, 9, 9, 9]), 4)) == 1
    assert cache.held_blocks(block_chain(np.arange(100, 110), 4)) == 0
    assert cache.held_blocks([]) == 0


def test_a_block_chain_travels_as_hex_and_anything_else_is_refused():
    chain = block_chain(np.arange(300), 64)
    assert chain_from_hex(chain_to_hex(chain), max_blocks=4) == chain
    for bad, message in (
        ("ab", "a list"),
        (["ab"], "hex digits"),
        (["g" * 32], "hex digits"),
        ([7], "hex digits"),
        (chain_to_hex(chain) * 2, "at most 4"),
    ):
        with pytest.raises(ValueError, match=message):
            chain_from_hex(bad, max_blocks=4)


def test_prefix_cache_evicts_least_recently_used_within_its_bytes():
    one = _snapshot(range(8)).nbytes
    cache = PrefixCache(2 * one, block_tokens=4)
    a, b, c = _snapshot(range(8)), _snapshot(range(100, 108)), _snapshot(range(200, 208))
    cache.store(a)
    cache.store(b)
    assert cache.lookup(np.arange(8)) is not None  # a is now the most recently used
    cache.store(c)  # evicts b
    assert cache.nbytes <= 2 * one and len(cache) == 2
    assert cache.lookup(np.arange(100, 108)) is None
    assert cache.lookup(np.arange(8)) is not None and cache.lookup(np.arange(200, 208)) is not None
    assert not PrefixCache(one - 1, block_tokens=4).store(a)  # larger than the whole cache


def test_prefix_cache_keeps_a_shared_prefix_when_one_holder_is_evicted():
    shared = list(range(8))
    cache = PrefixCache(2 * _snapshot(range(12)).nbytes, block_tokens=4)
    cache.store(_snapshot(shared + [50, 51, 52, 53]))
    cache.store(_snapshot(shared + [60, 61, 62, 63]))
    cache.store(_snapshot(range(300, 312)))  # evicts the first; the second still holds the shared blocks
    assert cache.lookup(np.array(shared + [70])).n_tokens == 8


# --- circuit breaker ----------------------------------------------------------------------------


def test_breaker_opens_after_failures_and_half_opens_after_the_reset_time():
    now = [0.0]
    breaker = CircuitBreaker(2, 10.0, clock=lambda: now[0])
    breaker.record_failure()
    assert breaker.allow() and breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 10.5
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    breaker.record_failure()  # the trial failed: open again
    assert breaker.state == "open"
    now[0] = 21.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


def test_a_trial_whose_outcome_never_comes_is_given_up_and_transitions_are_told():
    """A turn let through as the half-open trial that then prefills locally by plan, or whose
    client goes away mid-pull, records nothing: the breaker used to stay half-open, refusing every
    call, for good."""
    now, told = [0.0], []
    breaker = CircuitBreaker(1, 10.0, clock=lambda: now[0], on_transition=told.append)
    breaker.record_failure()
    now[0] = 10.0
    assert breaker.allow()  # the trial, never recorded
    now[0] = 19.9
    assert not breaker.allow()
    now[0] = 20.0
    assert breaker.allow()  # given up: a new trial
    breaker.record_failure()  # it failed: open again
    now[0] = 30.0
    assert breaker.allow()
    breaker.record_success()
    breaker.record_success()  # closed already: no transition
    assert told == ["open", "open", "closed"] and breaker.state == "closed"


# --- slot pool ----------------------------------------------------------------------------------


class _FakeEngine:  # the pool never touches its engines
    pass


def test_waiting_requests_are_served_round_robin_across_clients():
    async def scenario():
        pool = SlotPool([_FakeEngine()], max_queue=4)
        held = await pool.acquire("x", None)
        order = []

        async def request(name):
            slot = await pool.acquire(name[0], None)
            order.append(name)
            await asyncio.sleep(0)
            pool.release(slot)

        tasks = [asyncio.create_task(request(name)) for name in ("a1", "a2", "a3", "c1")]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await pool.acquire("d", None)
        pool.release(held)
        await asyncio.gather(*tasks)
        assert order == ["a1", "c1", "a2", "a3"]  # c does not wait behind all of a's requests

    asyncio.run(scenario())


def test_a_conversation_gets_its_own_idle_slot_back():
    async def scenario():
        pool = SlotPool([_FakeEngine(), _FakeEngine()], max_queue=4)
        mine = await pool.acquire("a", "conv-a")
        other = await pool.acquire("b", "conv-b")
        pool.release(mine)
        pool.release(other)
        anonymous = await pool.acquire("c", None)  # takes the least recently used: conv-a's
        assert anonymous is mine
        assert await pool.acquire("b", "conv-b") is other

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue():
    async def scenario():
        pool = SlotPool([_FakeEngine()], max_queue=1)
        held = await pool.acquire("a", None)
        waiter = asyncio.create_task(pool.acquire("b", None))
        await asyncio.sleep(0)
        assert pool.queued == 1
        waiter.cancel()
        await asyncio.sleep(0)
        assert pool.queued == 0
        pool.release(held)
        assert not pool.slots[0].busy

    asyncio.run(scenario())


# --- stop strings -------------------------------------------------------------------------------


def test_stop_text_cuts_at_a_stop_string_split_across_pieces():
    stop = StopText(("END",))
    out = "".join(stop.feed(piece) for piece in ["Hello E", "N", "D world"])
    assert out == "Hello " and stop.stopped and stop.flush() == ""
    keep = StopText(("END",))
    assert "".join(keep.feed(p) for p in ["a E", "b"]) + keep.flush() == "a Eb" and not keep.stopped


# --- decode worker ------------------------------------------------------------------------------


def test_worker_interleaves_generations_and_releases_before_the_end_is_seen():
    import threading

    from edgedecode.daemon.worker import DecodeWorker

    trace, both_submitted = [], threading.Event()

    def steps(name, n):
        both_submitted.wait(5)  # a's first step waits until b is queued too
        for i in range(n):
            trace.append(name)
            yield f"{name}{i}"

    async def scenario():
        worker = DecodeWorker()
        released = []
        a = worker.submit(steps("a", 3), on_done=lambda: released.append("a"))
        b = worker.submit(steps("b", 3), on_done=lambda: released.append("b"))
        both_submitted.set()
        got_a = [item async for item in a]
        assert "a" in released  # on_done ran before the consumer saw the end
        got_b = [item async for item in b]
        assert released == ["a", "b"] or released == ["b", "a"]
        worker.stop()
        return got_a, got_b

    got_a, got_b = asyncio.run(scenario())
    assert (got_a, got_b) == (["a0", "a1", "a2"], ["b0", "b1", "b2"])
    # one step each in turn once b has joined (before a's first step, or right after it)
    assert "".join(trace) in ("ababab", "aababb")


def test_worker_delivers_errors_and_closes_cancelled_generations():
    from edgedecode.daemon.worker import DecodeWorker

    closed = []

    def failing():
        yield 1
        raise ValueError("boom")

    def endless():
        try:
            while True:
                yield 0
        finally:
            closed.append(True)

    async def scenario():
        worker = DecodeWorker()
        with pytest.raises(ValueError, match="boom"):
            async for _ in worker.submit(failing()):
                pass
        done = asyncio.Event()
        endless_run = worker.submit(endless(), on_done=done.set)
        async for _ in endless_run:
            endless_run.cancel()
        await asyncio.wait_for(done.wait(), 5)
        assert worker.healthy(60)
        worker.stop()
        assert not worker.healthy(60)

    asyncio.run(scenario())
    assert closed == [True]


def test_a_waiting_generation_delivers_nothing_and_lets_the_others_run():
    import threading

    from edgedecode.daemon.worker import DecodeWorker

    ready, spins = threading.Event(), []

    def waiting():
        while not ready.is_set():
            spins.append(1)
            yield None  # its KV is still arriving
        yield "w0"

    def running():
        for i in range(5):
            yield f"r{i}"
        ready.set()

    async def scenario():
        worker = DecodeWorker()
        w, r = worker.submit(waiting()), worker.submit(running())
        got_r = [item async for item in r]
        got_w = [item async for item in w]
        worker.stop()
        return got_w, got_r

    got_w, got_r = asyncio.run(scenario())
    assert got_r == ["r0", "r1", "r2", "r3", "r4"] and got_w == ["w0"]  # no None delivered
    assert 0 < len(spins) < 100  # it waited in turns, not in a spin or a block


def test_a_generation_waiting_alone_sleeps_between_its_turns():
    import time

    from edgedecode.daemon.worker import PENDING_SLEEP_S, DecodeWorker

    spins = []

    def waiting(until: float):
        while time.monotonic() < until:
            spins.append(1)
            yield None
        yield "done"

    async def scenario():
        worker = DecodeWorker()
        got = [item async for item in worker.submit(waiting(time.monotonic() + 0.2))]
        worker.stop()
        return got

    assert asyncio.run(scenario()) == ["done"]
    assert len(spins) <= 0.2 / PENDING_SLEEP_S + 5  # about one turn per sleep, not a busy loop
