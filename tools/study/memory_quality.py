"""The quality cost of conversations resumed from the compressed store (tools/bench/memory.py).

A conversation is replayed in process, turn by turn, as the daemon served it: its turn reports say
how each turn resumed. The replay's engine keeps its KV between turns where the daemon's slot did
("resident"), starts again where the daemon had evicted it ("new", "evicted"), and where it came
back from the store ("compressed") it goes through the store as the daemon's did: the slot's KV
exported over every position (``Engine.export_positions``), compressed at the tiers the daemon's
store held it at (``stored_tiers``, from the turn's ``kv.restored_tiers``), and restored
(``Engine.restore``). Its earlier compressions stay in the KV, as they did in the daemon. Beside it,
the same turns run on an engine whose KV never leaves it: the uncompressed resume.

At each compressed resume, the turn's new text is teacher-forced after the kept context twice, the
context's KV from either engine (``evaluation.scoring``): Δ perplexity (%) and mean KL (nats) of the
compressed resume against the uncompressed one. Both engines run the daemon's INT4 decode graph on
the CPU as shipped (their KV is the daemon's); the scorer runs it at accuracy level 0 (exact float32
arithmetic, as the quality harness scores, tools/study/kv_quality.py): the shipped graph's int8
activations put a noise floor of KL ~3e-3 under any change of the KV (docs/serving.md), which
would swamp the differences a +0.5 % goal is about. Conversations whose own kept tokens were
evicted by the ladder's last rung (``kv.evicted_tokens``) are not replayed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import numpy as np

from edgedecode.daemon.memory.conversation import store_pins
from edgedecode.daemon.memory.store import ConversationStore
from edgedecode.evaluation.scoring import mean_kl, score_continuation, top1_agreement
from edgedecode.kv.importance import position_importance
from edgedecode.kv.snapshot import KVSnapshot
from edgedecode.kv.tiers import Tier
from edgedecode.model.graph import GraphOptions
from edgedecode.model.loader import LoadedModel
from edgedecode.runtime.engine import Engine
from edgedecode.runtime.sampler import SamplingParams
from tools.bench.memory_workload import Conversation

TIER_CLASSES = ("INT8", "INT4", "INT3", "dropped")  # how a compressed resume came back: its lowest tier


def tier_class(tiers: dict[str, int]) -> str:
    """``dropped`` when some tokens were dropped, else the lowest tier some were re-tiered to (``INT3``, ``INT4``),
    else ``INT8``."""
    if tiers.get(Tier.DROP.name):
        return "dropped"
    return next((tier.name for tier in (Tier.INT3, Tier.INT4) if tiers.get(tier.name)), "INT8")


def stored_tiers(positions: np.ndarray, held: np.ndarray, restored: dict[str, int]) -> np.ndarray:
    """uint8 [n]: each token's tier as the daemon's store held the conversation when it came back,
    from the turn's ``kv.restored_tiers`` counts: INT8 as put (DROP where the slot held none); every
    token but the store's pins at INT4 when it shows INT4 (the re-tier rung), or at INT3 when it shows INT3 (the
    second re-tier rung; the replay encodes them at INT3 from the float KV in one step, where the rung re-quantizes
    what INT4 held: tools/study/drop_quality.py measures that); and as many more dropped as it shows, least
    important first (the drop rung's order without importance from the prefill side: position importance, the
    oldest after the sinks first)."""
    tiers = np.where(held, Tier.INT8, Tier.DROP).astype(np.uint8)
    pins = store_pins(positions)
    for tier in (Tier.INT4, Tier.INT3):
        if restored.get(tier.name):
            tiers[~pins & (tiers < tier)] = tier
    more = restored.get(Tier.DROP.name, 0) - int(np.count_nonzero(tiers == Tier.DROP))
    if more > 0:
        droppable = np.flatnonzero((tiers != Tier.DROP) & ~pins)
        order = droppable[np.argsort(position_importance(positions)[droppable], kind="stable")]
        tiers[order[:more]] = Tier.DROP
    return tiers


def tier_counts(tiers: np.ndarray) -> dict[str, int]:
    counts = np.bincount(tiers, minlength=len(Tier))
    return {tier.name: int(counts[tier]) for tier in Tier if counts[tier]}


def pick_conversations(records: list[dict], per_class: int, seed: int) -> list[tuple[str, int]]:
    """(cell, conversation) pairs to replay: up to ``per_class`` with a compressed resume of each tier
    class, seeded; none with a failed turn or own tokens evicted."""
    by_conversation: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        by_conversation.setdefault((r["cell"], r["conversation"]), []).append(r)
    classes: dict[tuple[str, int], set[str]] = {}
    for key, turns in by_conversation.items():
        if any(t["error"] or (t["report"]["kv"].get("evicted_tokens") or 0) for t in turns):
            continue
        resumed = {tier_class(t["report"]["kv"]["restored_tiers"]) for t in turns if _compressed(t)}
        if resumed:
            classes[key] = resumed
    candidates = sorted(classes)
    random.Random(seed).shuffle(candidates)
    picked: list[tuple[str, int]] = []
    for name in TIER_CLASSES:
        having = [key for key in candidates if name in classes[key]]
        have = sum(name in classes[key] for key in picked)
        picked += [key for key in having if key not in picked][: max(per_class - have, 0)]
    return picked


def _compressed(record: dict) -> bool:
    return record["resume"] == "compressed" and record["report"]["kv"]["reused_tokens"] > 0


class Replayer:
    """Replays conversations as the daemon served them and scores their compressed resumes."""

    def __init__(self, model: LoadedModel, max_context: int, max_tokens: int, threads: int) -> None:
        options = GraphOptions.for_device("decode", "cpu")
        self.served = Engine(model, options, max_context=max_context, threads=threads)
        self.uncompressed = Engine(model, options, max_context=max_context, threads=threads, share=self.served)
        exact = GraphOptions.for_device("decode", "cpu", accuracy_level=0)
        self.scorer = Engine(model, exact, max_context=max_context, threads=threads)
        self.store = ConversationStore(1)  # only its encoder: nothing is kept
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0)

    def replay(self, conversation: Conversation, turns: list[dict]) -> list[dict]:
        """The scores of every compressed resume of ``turns`` (one conversation's records, in turn order)."""
        self.served.reset()
        self.uncompressed.reset()
        scores = []
        for record in turns:
            prompt = conversation.prompt(record["turn"])
            kv = record["report"]["kv"]
            keep, replayed_tiers = self._resume(conversation.session, prompt, record["resume"], kv)
            uncompressed_keep = self.uncompressed.reusable_prefix(prompt)  # less where its last answer differed
            if _compressed(record) and keep > 0:
                score = self._score(prompt, min(keep, uncompressed_keep))
                scores.append(
                    {
                        "turn": record["turn"],
                        "tier_class": tier_class(kv["restored_tiers"]),
                        "daemon_tiers": kv["restored_tiers"],
                        "replayed_tiers": replayed_tiers,
                        "tiers_match": replayed_tiers == kv["restored_tiers"],
                        "kept": keep,
                        "kept_match": keep == kv["reused_tokens"],
                        **score,
                    }
                )
            _drain(self.served.generate(prompt, self.params, keep=keep))
            _drain(self.uncompressed.generate(prompt, self.params, keep=uncompressed_keep))
        return scores

    def _resume(self, session: str, prompt: np.ndarray, resume: str, kv: dict) -> tuple[int, dict[str, int]]:
        """The served engine's KV as the daemon's slot held it for this turn: (positions kept, tiers
        it came back at)."""
        if resume == "resident":
            return self.served.reusable_prefix(prompt), {}
        if resume != "compressed":
            return 0, {}
        snapshot, held = self.served.export_positions()
        tiers = stored_tiers(snapshot.positions, held, kv["restored_tiers"])
        entry = self.store.compress(session, snapshot, None, tiers)
        return self.served.restore(prompt, entry.payload), tier_counts(tiers)

    def _score(self, prompt: np.ndarray, keep: int) -> dict:
        """The turn's new text after the first ``keep`` positions, served KV against uncompressed."""
        context, continuation = prompt[:keep], prompt[keep:]
        reference = score_continuation(self.scorer, context, continuation, _before(self.uncompressed, keep))
        served = score_continuation(self.scorer, context, continuation, _before(self.served, keep))
        return {
            "continuation_tokens": len(continuation) - 1,
            "dppl_pct": 100 * math.expm1(served.mean_nll - reference.mean_nll),
            "kl": mean_kl(reference, served),
            "top1": top1_agreement(reference, served),
        }


def _before(engine: Engine, position: int) -> KVSnapshot:
    """The engine's KV of the positions before ``position``."""
    kv = engine.export_kv()
    return kv.slots(0, int(np.searchsorted(kv.positions, position)))


def _drain(tokens: Iterable[int]) -> None:
    for _ in tokens:
        pass


def quality(
    model: LoadedModel,
    conversations: dict[str, list[Conversation]],
    records: list[dict],
    per_class: int,
    max_tokens: int,
    threads: int,
    seed: int,
) -> list[dict]:
    """Scores of the compressed resumes of the picked conversations (``pick_conversations``), each
    with its cell and conversation. ``conversations``: each cell's, by the cell's label."""
    picked = pick_conversations(records, per_class, seed)
    if not picked:
        return []
    longest = max(len(conversations[cell][index].ids) for cell, index in picked)
    replayer = Replayer(model, longest + max_tokens + 8, max_tokens, threads)
    results = []
    for cell, index in picked:
        turns = sorted(
            (r for r in records if r["cell"] == cell and r["conversation"] == index), key=lambda r: r["turn"]
        )
        for score in replayer.replay(conversations[cell][index], turns):
            results.append({"cell": cell, "conversation": index, **score})
    return results
