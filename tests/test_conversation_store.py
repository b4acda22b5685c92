"""The conversation store: idle conversations' KV kept as EDKV payloads, and the memory ledger's
budget over it: the pressure ladder's rungs over stored conversations (re-tier, drop, evict), its
metrics and config keys, and rehydration into the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
from greedy_helpers import TOP, first_divergence, step_margin
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from edgedecode.config import ConfigError, load_config
from edgedecode.daemon.memory.conversation import RETIER_TIERS, StoredConversation, store_pins
from edgedecode.daemon.memory.ledger import KVMemoryError, MemoryLedger
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.daemon.metrics import ConversationMetrics, DaemonMetrics
from edgedecode.daemon.slots import SlotPool
from edgedecode.evaluation.texts import pydoc_corpus, token_windows
from edgedecode.kv.policy import RECENT_TOKENS, SINK_TOKENS
from edgedecode.kv.snapshot import KVProducer, KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.kv.wire import EDKVHeader, EDKVReader, decode_snapshot
from edgedecode.model.spec import KVContract, KVLayout
from edgedecode.runtime.sampler import SamplingParams

LAYERS, HEADS, HEAD_DIM = 3, 2, 64  # head_dim 64: the default INT8 and INT4 layouts apply
CONTRACT = KVContract("llama", LAYERS, HEADS, HEAD_DIM, 10000.0, KVLayout(), "tok-hash")
BIG = 1 << 30
GREEDY_32 = SamplingParams(max_tokens=32)
NEAR_TIE = 0.5
SLOT = 0  # whose reservations the tests make (a ledger over no slots)


def snapshot(n: int, seed: int = 0, first_position: int = 0) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32)
    keys[..., 1] *= 10  # a key outlier channel
    values = rng.standard_normal((LAYERS, HEADS, n, HEAD_DIM)).astype(np.float32)
    return KVSnapshot(
        CONTRACT,
        rng.integers(0, 50000, n),
        np.arange(first_position, first_position + n),
        keys,
        values,
        KVProducer("test-model", "ab" * 32, "float32"),
    )


def header_of(entry: StoredConversation) -> EDKVHeader:
    """The payload's header, after the whole payload was verified."""
    reader = EDKVReader(
        entry.contract,
        max_tokens=entry.n_tokens,
        target_factory=lambda h: np.zeros((LAYERS, 2, HEADS, h.n_kept, HEAD_DIM), np.float32),
    )
    reader.feed(entry.payload)
    return reader.finish()


def budgeted(store: ConversationStore, budget_bytes: int) -> MemoryLedger:
    """The memory ledger over ``store`` alone (no slots), under ``budget_bytes``."""
    return MemoryLedger(store, SlotPool([], 1), budget_bytes=budget_bytes)


def stored(store: ConversationStore, session_id: str) -> StoredConversation:
    entry = store.peek(session_id)
    assert entry is not None
    return entry


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# --- compress and take ----------------------------------------------------------------------------


def test_put_then_take_round_trips_at_int8_within_the_quantizer_bound():
    store = ConversationStore(4)
    ledger = budgeted(store, BIG)
    snap = snapshot(300, first_position=7)
    assert store.add(store.compress("a", snap)) == []
    assert "a" in store and len(store) == 1 and ledger.nbytes == ledger.compressed_nbytes > 0

    entry = store.take("a")

    assert entry is not None and ledger.nbytes == 0 and len(store) == 0
    assert (entry.tiers == Tier.INT8).all() and entry.n_kept == entry.n_tokens == 300
    kv = decode_snapshot(entry.payload, CONTRACT)
    np.testing.assert_array_equal(kv.token_ids, snap.token_ids)
    np.testing.assert_array_equal(kv.positions, snap.positions)
    for got, sent in ((kv.keys, snap.keys), (kv.values, snap.values)):
        span = sent.max(axis=-1, keepdims=True) - sent.min(axis=-1, keepdims=True)  # one group per head row
        assert (np.abs(got - sent) <= span / 255 / 2 * 1.01 + 1e-5).all()


def test_take_of_a_conversation_the_store_does_not_hold_is_none():
    assert ConversationStore(1).take("nobody") is None


def test_put_again_replaces_the_conversations_kv():
    store = ConversationStore(4)
    store.add(store.compress("a", snapshot(100)))
    store.add(store.compress("a", snapshot(40, seed=1)))
    entry = store.take("a")
    assert entry is not None and entry.n_tokens == 40 and len(store) == 0 and store.nbytes == 0


def test_put_with_a_misshapen_tier_map_or_importance_is_refused():
    store = ConversationStore(1)
    with pytest.raises(ValueError, match=r"one code per token \[10\]"):
        store.add(store.compress("a", snapshot(10), tiers=np.full((LAYERS, 10), Tier.INT8, np.uint8)))
    with pytest.raises(ValueError, match=r"importance must be float \[10\], >= 0 or NaN"):
        store.add(store.compress("a", snapshot(10), importance=np.ones(9)))
    with pytest.raises(ValueError, match=r"importance must be float \[10\], >= 0 or NaN"):
        store.add(store.compress("a", snapshot(10), importance=np.full(10, -1.0)))
    with pytest.raises(ValueError, match="holds no tokens"):
        store.add(store.compress("a", snapshot(0)))
    assert len(store) == 0


# --- max_sessions and the pressure ladder -----------------------------------------------------------


def test_put_beyond_max_sessions_evicts_the_least_recently_put_and_counts_it():
    registry = CollectorRegistry()
    store = ConversationStore(2, ConversationMetrics(registry))
    store.add(store.compress("a", snapshot(20)))
    store.add(store.compress("b", snapshot(20)))
    steps = store.add(store.compress("c", snapshot(20)))
    assert [(s.action, s.session_id, s.reason) for s in steps] == [("evict", "a", "max_sessions")]
    store.add(store.compress("b", snapshot(30)))  # b is now the most recent
    assert [s.session_id for s in store.add(store.compress("d", snapshot(20)))] == ["c"]
    assert "b" in store and "d" in store and len(store) == 2
    assert sample(registry, "edgedecode_session_evictions_total", reason="max_sessions") == 2
    assert sample(registry, "edgedecode_session_evictions_total", reason="memory") == 0


def test_the_ladder_re_tiers_the_least_recently_put_first_and_only_as_far_as_needed():
    registry = CollectorRegistry()
    store = ConversationStore(4, ConversationMetrics(registry))
    ledger = budgeted(store, BIG)
    store.add(store.compress("a", snapshot(300)))
    store.add(store.compress("b", snapshot(300, seed=1)))
    before = store.nbytes

    steps = ledger.make_room(BIG - before + 1)

    assert [(s.action, s.session_id) for s in steps] == [("retier", "a")]
    assert store.nbytes == before - steps[0].freed_nbytes and store.nbytes + BIG - before + 1 <= BIG
    a, b = stored(store, "a"), stored(store, "b")
    pinned = np.zeros(300, bool)
    pinned[:SINK_TOKENS] = pinned[-RECENT_TOKENS:] = True  # 64 of 300: within a quarter
    np.testing.assert_array_equal(a.pinned, pinned)
    np.testing.assert_array_equal(a.tiers, np.where(pinned, Tier.INT8, Tier.INT4))
    assert (b.tiers == Tier.INT8).all()
    assert steps[0].tokens == 300 - pinned.sum()
    assert sample(registry, "edgedecode_kv_retier_total", **{"from": "INT8", "to": "INT4"}) == steps[0].tokens
    assert sample(registry, "edgedecode_kv_memory_bytes", state="compressed") == ledger.compressed_nbytes
    assert decode_snapshot(a.payload, CONTRACT).n_tokens == 300


def retiered_fully(store: ConversationStore, session_id: str) -> int:
    """Take the stored conversation through both re-tier rungs (INT4, then INT3); its bytes then."""
    for tier in RETIER_TIERS:
        assert store.retier(session_id, tier) is not None
    return store.nbytes


def test_the_int3_rung_comes_after_int4_over_every_conversation_and_before_any_drop():
    registry = CollectorRegistry()
    store = ConversationStore(4, ConversationMetrics(registry))
    ledger = budgeted(store, BIG)
    originals = {"a": snapshot(300), "b": snapshot(300, seed=1)}
    for session, kv in originals.items():
        store.add(store.compress(session, kv))
    for session in originals:
        store.retier(session, Tier.INT4)
    at_int4 = {session: stored(store, session) for session in originals}

    steps = ledger.make_room(BIG - store.nbytes * 9 // 10)  # 10 %: less than INT4 -> INT3 frees over both

    assert [(s.action, s.session_id) for s in steps] in ([("retier", "a")], [("retier", "a"), ("retier", "b")])
    a = stored(store, "a")
    np.testing.assert_array_equal(a.tiers, np.where(a.pinned, Tier.INT8, Tier.INT3))  # the pins keep INT8
    assert steps[0].freed_nbytes > 0.1 * at_int4["a"].nbytes  # INT3's codes: 3 bits where INT4 had 4
    assert sample(registry, "edgedecode_kv_retier_total", **{"from": "INT4", "to": "INT3"}) == sum(
        s.tokens for s in steps
    )
    header = header_of(a)
    assert (header.major, header.minor) == (1, 3) and header.rotation is not None
    assert header.rotation.tiers == (Tier.INT3,)  # rotated before quantizing, undone by the reader
    held, before = decode_snapshot(a.payload, CONTRACT), decode_snapshot(at_int4["a"].payload, CONTRACT)
    unpinned = ~a.pinned
    for kv in ("keys", "values"):
        exact = getattr(originals["a"], kv)[:, :, unpinned]
        int3_error = np.abs(getattr(held, kv)[:, :, unpinned] - exact).mean()
        int4_error = np.abs(getattr(before, kv)[:, :, unpinned] - exact).mean()
        assert int4_error < int3_error < 3 * int4_error  # INT3 of what INT4 held (steps 15/7 as wide), not noise
        np.testing.assert_array_equal(getattr(held, kv)[:, :, a.pinned], getattr(before, kv)[:, :, a.pinned])

    store.retier("b", Tier.INT3)  # (None if the ladder took it already)
    steps = ledger.make_room(BIG - store.nbytes * 9 // 10)
    assert steps and {s.action for s in steps} == {"drop"}  # both at INT3: dropping is next


def test_the_drop_rung_keeps_the_pins_and_the_most_important_tokens_and_every_position():
    importance = np.random.default_rng(5).random(400).astype(np.float32)
    store = ConversationStore(4)
    ledger = budgeted(store, BIG)
    store.add(store.compress("a", snapshot(400, first_position=3), importance))
    retiered = retiered_fully(store, "a")

    steps = ledger.make_room(BIG - retiered * 3 // 4)

    assert {s.action for s in steps} == {"drop"} and store.nbytes <= retiered * 3 // 4
    entry = stored(store, "a")
    dropped = entry.tiers == Tier.DROP
    assert steps[0].tokens == dropped.sum() > 0 and not (dropped & entry.pinned).any()
    assert importance[dropped].max() <= importance[~dropped & ~entry.pinned].min()
    header = header_of(entry)  # the header still lists every token, the dropped ones as DROP
    np.testing.assert_array_equal(header.positions, np.arange(3, 403))
    np.testing.assert_array_equal(header.tiers[0], entry.tiers)
    np.testing.assert_array_equal(decode_snapshot(entry.payload, CONTRACT).positions, np.arange(3, 403)[~dropped])


def test_without_importance_the_oldest_tokens_after_the_sinks_are_dropped_first():
    store = ConversationStore(4)
    ledger = budgeted(store, BIG)
    store.add(store.compress("a", snapshot(400)))
    retiered = retiered_fully(store, "a")
    ledger.make_room(BIG - retiered * 3 // 4)
    dropped = np.flatnonzero(stored(store, "a").tiers == Tier.DROP)
    assert len(dropped) > 0
    np.testing.assert_array_equal(dropped, np.arange(SINK_TOKENS, SINK_TOKENS + len(dropped)))


def test_rungs_go_in_order_over_all_conversations_and_eviction_takes_the_least_recently_put():
    registry = CollectorRegistry()
    store = ConversationStore(4, ConversationMetrics(registry), min_kept_fraction=0.5)
    ledger = budgeted(store, BIG)
    store.add(store.compress("a", snapshot(300)))
    store.add(store.compress("b", snapshot(300, seed=1)))

    steps = ledger.make_room(BIG - store.nbytes // 4)

    rungs = [s.action for s in steps]
    assert rungs == sorted(rungs, key=["retier", "drop", "evict"].index)
    assert [s.session_id for s in steps if s.action == "retier"] == ["a", "b", "a", "b"]  # INT4, then INT3
    assert [s.session_id for s in steps if s.action == "evict"] == ["a"]
    b = stored(store, "b")
    assert b.n_kept == math.ceil(0.5 * 300) and len(store) == 1
    assert sample(registry, "edgedecode_session_evictions_total", reason="memory") == 1
    assert sample(registry, "edgedecode_kv_retier_total", **{"from": "INT3", "to": "DROP"}) == sum(
        s.tokens for s in steps if s.action == "drop"
    )
    assert sample(registry, "edgedecode_sessions", state="compressed") == 1


def test_a_conversation_that_cannot_fit_is_evicted_last_and_counted():
    registry = CollectorRegistry()
    store = ConversationStore(4, ConversationMetrics(registry))
    ledger = budgeted(store, 50_000)
    ledger.put("a", snapshot(20))
    steps = ledger.put("b", snapshot(500, seed=1))
    assert [s.session_id for s in steps if s.action == "evict"] == ["a", "b"]  # b is the last resort
    assert len(store) == 0 and ledger.nbytes == 0
    assert sample(registry, "edgedecode_session_evictions_total", reason="memory") == 2


def test_make_room_beyond_what_eviction_can_free_is_a_503_naming_the_budget_and_changes_nothing():
    store = ConversationStore(4)
    ledger = budgeted(store, 1 << 20)
    ledger.reserve(SLOT, 600_000)
    ledger.put("a", snapshot(50))
    before = ledger.nbytes

    with pytest.raises(KVMemoryError) as error:
        ledger.make_room((1 << 20) - 600_000 + 1)

    assert error.value.http_status == 503 and "1.0 MiB (daemon.kv_memory_mb)" in str(error.value)
    assert "a" in store and ledger.nbytes == before


def test_reservations_count_against_the_budget_until_released():
    store = ConversationStore(4)
    ledger = budgeted(store, 400_000)
    ledger.put("a", snapshot(100))
    held = ledger.compressed_nbytes
    steps = ledger.reserve(SLOT, 400_000 - held // 2)
    assert steps and ledger.nbytes <= 400_000 and ledger.reserved_nbytes == 400_000 - held // 2
    ledger.release(SLOT, ledger.reserved_nbytes)
    assert ledger.nbytes == ledger.compressed_nbytes
    with pytest.raises(ValueError, match="cannot release 1 bytes: 0 are reserved"):
        ledger.release(SLOT, 1)


def test_a_re_tier_whose_conversation_was_taken_while_it_encoded_changes_nothing(monkeypatch):
    """The store encodes outside its lock (the event loop may take a conversation meanwhile): a re-tier
    that finishes after its conversation left the store neither puts it back nor counts bytes freed."""
    import edgedecode.daemon.memory.store as store_module

    registry = CollectorRegistry()
    store = ConversationStore(4, ConversationMetrics(registry))
    store.add(store.compress("a", snapshot(300)))
    store.add(store.compress("b", snapshot(300, seed=1)))
    encode = store_module.retiered

    def taken_meanwhile(entry, tier, *, workers):
        smaller = encode(entry, tier, workers=workers)
        store.take(entry.session_id)
        return smaller

    monkeypatch.setattr(store_module, "retiered", taken_meanwhile)
    b = stored(store, "b")

    assert store.retier("a") is None
    assert "a" not in store and store.nbytes == b.nbytes and stored(store, "b") is b
    assert sample(registry, "edgedecode_kv_retier_total", **{"from": "INT8", "to": "INT4"}) == 0
    assert sample(registry, "edgedecode_kv_memory_bytes", state="compressed") == store.nbytes


# --- the invariant --------------------------------------------------------------------------------

SNAPSHOTS = [snapshot(n, seed=n) for n in (1, 70, 160, 300)]
SESSIONS = st.sampled_from("abcd")
OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            SESSIONS,
            st.integers(0, len(SNAPSHOTS) - 1),
            st.sampled_from([Tier.FP16, Tier.INT8]),
            st.booleans(),
        ),
        st.tuples(st.just("take"), SESSIONS),
        st.tuples(st.just("make_room"), st.integers(0, 400_000)),
        st.tuples(st.just("reserve"), st.integers(0, 200_000)),
        st.tuples(st.just("release"), st.integers(0, 200_000)),
    ),
    max_size=12,
)


@settings(max_examples=100, deadline=None)
@given(budget=st.integers(0, 1_000_000), max_sessions=st.integers(1, 3), operations=OPERATIONS)
def test_the_store_never_holds_more_than_its_budget_or_max_sessions_and_reports_what_it_holds(
    budget, max_sessions, operations
):
    registry = CollectorRegistry()
    store = ConversationStore(max_sessions, ConversationMetrics(registry), min_kept_fraction=0.25)
    ledger = budgeted(store, budget)
    for operation in operations:
        reserved, nbytes = ledger.reserved_nbytes, ledger.nbytes
        match operation:
            case ("put", session_id, index, tier, with_importance):
                snap = SNAPSHOTS[index]
                importance = np.linspace(1, 0, snap.n_tokens) if with_importance else None
                ledger.put(session_id, snap, importance, tier)
            case ("take", session_id):
                store.take(session_id)
            case ("make_room" | "reserve" as name, amount):
                try:
                    ledger.make_room(amount) if name == "make_room" else ledger.reserve(SLOT, amount)
                except KVMemoryError:
                    assert reserved + amount > budget and ledger.nbytes == nbytes
                else:
                    assert ledger.nbytes + (0 if name == "reserve" else amount) <= budget
            case ("release", amount):
                ledger.release(SLOT, min(amount, reserved))
        assert ledger.nbytes <= budget and len(store) <= max_sessions
        assert sample(registry, "edgedecode_kv_memory_bytes", state="compressed") == ledger.compressed_nbytes
        assert sample(registry, "edgedecode_sessions", state="compressed") == len(store)
    held = ledger.compressed_nbytes
    taken = [store.take(session_id) for session_id in "abcd"]
    assert sum(entry.nbytes for entry in taken if entry is not None) == held and ledger.nbytes == ledger.reserved_nbytes


# --- metrics and config ---------------------------------------------------------------------------


def test_metrics_are_declared_with_every_state_on_the_daemon_registry():
    metrics = DaemonMetrics()
    store = ConversationStore(2, metrics.conversations)
    store.add(store.compress("a", snapshot(10)))
    for state in ("active", "resident"):
        assert sample(metrics.registry, "edgedecode_sessions", state=state) == 0
        assert sample(metrics.registry, "edgedecode_kv_memory_bytes", state=state) == 0
    assert sample(metrics.registry, "edgedecode_sessions", state="compressed") == 1
    assert sample(metrics.registry, "edgedecode_kv_memory_bytes", state="compressed") == store.nbytes
    assert sample(metrics.registry, "edgedecode_kv_retier_total", **{"from": "FP16", "to": "INT4"}) == 0
    assert sample(metrics.registry, "edgedecode_session_evictions_total", reason="memory") == 0


def test_config_kv_memory_and_max_sessions_defaults_env_and_validation():
    daemon = load_config(None, env={}).daemon
    assert (daemon.kv_memory_mb, daemon.max_sessions) == (512, 16)
    env = {"EDGEDECODE_DAEMON_KV_MEMORY_MB": "64", "EDGEDECODE_DAEMON_MAX_SESSIONS": "3"}
    daemon = load_config(None, env=env).daemon
    assert (daemon.kv_memory_mb, daemon.max_sessions) == (64, 3)
    with pytest.raises(ConfigError, match=r"daemon.max_sessions \(1\) must be >= daemon.slots \(2\)"):
        load_config(None, env={"EDGEDECODE_DAEMON_MAX_SESSIONS": "1"})
    with pytest.raises(ConfigError, match=r"daemon\.kv_memory_mb must be >= 1"):
        load_config(None, env={"EDGEDECODE_DAEMON_KV_MEMORY_MB": "0"})


# --- rehydration into the engine (real model) -----------------------------------------------------


@pytest.fixture(scope="module")
def second_turn(decoder, smollm2_model) -> tuple[KVSnapshot, np.ndarray]:
    """A first turn's KV (a 400-token pydoc prompt and its answer) and the second turn's prompt, which extends it."""
    tokenizer = smollm2_model.tokenizer
    first = token_windows(tokenizer, pydoc_corpus(), 400, 1)[0]
    answer = list(decoder.generate(first, GREEDY_32))
    kv = decoder.export_kv()
    follow_up = tokenizer.encode(" In one sentence, what was that about?", parse_special=False)
    return kv, np.concatenate([first, answer, follow_up]).astype(np.int64)


def _rehydrated(decoder, entry: StoredConversation, prompt: np.ndarray):
    stream = decoder.open_kv_stream(prompt)
    stream.feed(entry.payload)
    return stream


def test_a_conversation_kept_at_int8_continues_as_with_its_uncompressed_kv(decoder, second_turn):
    """Greedy tokens after rehydrating the INT8 payload through the engine's EDKV reader are those
    after injecting the float32 KV it was made from, except past a near-tie (top-2 margin < 0.5; each
    margin read from the step that chose the token, tests/greedy_helpers.py)."""
    kv, prompt = second_turn
    store = ConversationStore(1)
    store.add(store.compress("s", kv))
    entry = store.take("s")
    assert entry is not None

    uncompressed = list(decoder.generate_scored(prompt, GREEDY_32, kv=kv, top=TOP))
    rehydrated = list(decoder.generate_scored(prompt, GREEDY_32, kv=_rehydrated(decoder, entry, prompt), top=TOP))

    assert decoder.stats.injected_tokens == kv.n_tokens
    split = first_divergence([s.token for s in uncompressed], [s.token for s in rehydrated])
    if split is None:
        assert [s.token for s in uncompressed] == [s.token for s in rehydrated]
        return
    exact, compressed = uncompressed[split], rehydrated[split]
    exact_margin, compressed_margin = step_margin(exact, compressed.token), step_margin(compressed, exact.token)
    print(
        f"diverge at token {split}: float32 KV picks {exact.token} by {exact_margin:.3f}, "
        f"INT8 picks {compressed.token} by {compressed_margin:.3f}"
    )
    assert 0 <= exact_margin < NEAR_TIE and 0 <= compressed_margin < NEAR_TIE


def test_a_trimmed_conversation_rehydrates_with_its_true_positions(decoder, second_turn):
    kv, prompt = second_turn
    store = ConversationStore(1)
    ledger = budgeted(store, BIG)
    store.add(store.compress("s", kv))
    actions = [s.action for s in ledger.make_room(BIG - store.nbytes // 2)]
    assert actions[:2] == ["retier", "retier"] and set(actions[2:]) == {"drop"}  # INT4, INT3, then drops
    entry = store.take("s")
    assert entry is not None and 0 < entry.n_kept < entry.n_tokens == kv.n_tokens

    answer = list(decoder.generate(prompt, SamplingParams(max_tokens=4), kv=_rehydrated(decoder, entry, prompt)))

    assert len(answer) > 0 and decoder.stats.injected_tokens == entry.n_kept
    new_tokens = len(prompt) - kv.n_tokens
    assert decoder.next_position == len(prompt) + len(answer) - (decoder.stats.finish_reason != "stop")
    assert decoder.length == entry.n_kept + new_tokens + len(answer) - (decoder.stats.finish_reason != "stop")


def test_a_short_conversation_pins_at_most_a_quarter_of_its_tokens():
    short = store_pins(np.arange(48))
    assert short[:SINK_TOKENS].all() and short[-12:].all() and np.count_nonzero(short) == SINK_TOKENS + 12
    assert np.count_nonzero(store_pins(np.arange(2048))) == SINK_TOKENS + RECENT_TOKENS
