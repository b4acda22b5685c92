"""The prefill tier's Ray Serve request router: a prompt goes to the replica whose prefix cache
holds most of it, unless that replica is much busier than the least busy one.

Ray Serve calls ``choose_replicas`` for each request to the replicas deployment (the ingress's
handle calls), with the request's ``Route`` as its first argument. What a replica holds is known
two ways, merged: the prefixes this router sent it (recorded as each request is routed, so a
conversation's next turn a second later already finds its replica) and the block hashes the
replica reports of its own prefix cache (``record_routing_stats``, every few seconds: what other
routers sent it, minus what it evicted).

The answer is Serve's ranking: ``[[preferred], [the others]]`` when a replica holds a prefix of
the prompt and is at most ``imbalance`` requests busier than the least busy (Serve then takes the
preferred one unless its queue is full, in which case the next rank), otherwise every replica in
one rank (Serve takes the least busy). ``policy="round_robin"`` is the baseline the affinity is
measured against: replicas in turn, whatever they hold.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from edgedecode.prefill.fleet.route import Route

ROUTED_BLOCKS_PER_REPLICA = 1 << 16  # block hashes remembered per replica from routing (LRU)
STATS_BLOCKS_KEY = "prefix_blocks"  # the replicas' routing stats: their cache's block hashes


class PrefixAffinityRouter(RequestRouter):
    """Prefix-cache affinity with a load bound (see the module docstring)."""

    def initialize_state(self, *, policy: str = "affinity", imbalance: int = 2, **_: Any) -> None:
        """Set by Serve from ``RequestRouterConfig.request_router_kwargs``."""
        if policy not in ("affinity", "round_robin"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.imbalance = imbalance
        self._routed: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        self._turns = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Serve's ranking of ``candidate_replicas`` for ``pending_request`` (see the module docstring)."""
        route = _route_of(pending_request)
        if route.replica:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == route.replica]
            if named:
                return [named]  # gone: any other answers (a resume: 404, the receiver computes the rest)
        if self.policy == "round_robin":
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            turn = next(self._turns) % len(ordered)
            return [[ordered[turn]], ordered]
        if route.blocks:
            held = {r.replica_id: self.held_blocks(r, route.blocks) for r in candidate_replicas}
            best = max(candidate_replicas, key=lambda r: (held[r.replica_id], -self._load(r)))
            least = min(self._load(r) for r in candidate_replicas)
            if held[best.replica_id] and self._load(best) - least <= self.imbalance:
                return [[best], [r for r in candidate_replicas if r is not best]]
        return [candidate_replicas]

    def held_blocks(self, replica: RunningReplica, blocks: tuple[bytes, ...]) -> int:
        """How many leading blocks of a prompt ``replica`` is known to hold."""
        routed: Mapping[bytes, None] = self._routed.get(replica.replica_id, {})
        reported = replica.routing_stats.get(STATS_BLOCKS_KEY) or ()
        count = 0
        for block in blocks:
            if block not in routed and block not in reported:
                break
            count += 1
        return count

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        """Remember that ``replica_id`` now holds the routed prompt's blocks (not for a held query's)."""
        route = _route_of(pending_request)
        blocks = route.blocks
        if not blocks or route.query_only:
            return
        routed = self._routed.setdefault(replica_id, OrderedDict())
        for block in blocks:
            routed[block] = None
            routed.move_to_end(block)
        while len(routed) > ROUTED_BLOCKS_PER_REPLICA:
            routed.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget what a dead replica held (its restart starts empty)."""
        super().on_replica_actor_died(replica_id)
        self._routed.pop(replica_id, None)

    def _load(self, replica: RunningReplica) -> int:
        """Requests ``replica`` has in hand, as last seen (0 when not known yet)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def _route_of(pending_request: PendingRequest | None) -> Route:
    if pending_request is not None and pending_request.args and isinstance(pending_request.args[0], Route):
        return pending_request.args[0]
    return Route()
