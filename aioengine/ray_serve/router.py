"""Prefix-cache affinity routing for the engine replicas (Ray Serve's request-router API).

The router runs inside each process that holds a handle to the engine deployment (the
ingress), and sees the arguments of every handle call: the ingress passes a
`ReplicaRequest` whose `prefix_hashes` are the chained hashes of the prompt's leading
blocks (prefix.py). The router remembers, in a bounded LRU map, which replicas each hash
was last sent to, and for a new request:

1. takes the replicas that were sent the longest run of leading hashes it has seen (the
   affine replicas, up to MAX_HOLDERS: the ones most likely to hold that prefix in their
   KV cache; Ray picks the one with the shorter queue), unless they are busy: all full,
   or the least loaded of them more than `max_imbalance` requests behind the shorter
   queue of two random replicas. A prefix sent elsewhere then has two holders, so a hot
   prefix spreads over replicas while a cold one stays on one;
2. a prompt whose first block it has never seen goes to the replica of two random ones
   that owns fewer hashes in the map (so new prefixes spread evenly, and affinity later
   has no skew to undo), and its hashes point there at once: requests of the same new
   prefix that are routed before the first one has left the router follow it;
3. otherwise (busy affine replicas) falls back to power of two choices on queue length,
   as Ray's default router does.

With LoRA adapters served through Ray Serve's model multiplexing, a request for an
adapter is routed among the replicas Ray's multiplexing ranks first (those that hold the
adapter; then those that hold the fewest), by the same rules.

A request that reads or continues a stored response (`prefer_replica`, from the tag in
the response id) goes to the replica that stores it, while that one lives. A retry after
a dead engine answered lists that replica in `avoid_replicas`, which are no candidates
then (unless nothing else is left). Every hash of a routed request then also points at
the replica it went to. A dead or removed replica's entries are skipped (it is no
candidate) and age out of the LRU map.
"""
from __future__ import annotations

import random
from collections import Counter, OrderedDict
from typing import Any

from ray.serve.request_router import (MultiplexMixin, PendingRequest, ReplicaID, ReplicaResult,
                                      RequestRouter, RunningReplica)

from aioengine.ray_serve.options import DEFAULT_MAX_IMBALANCE

DEFAULT_MAX_ENTRIES = 1 << 16
MAX_HOLDERS = 4  # replicas remembered per prefix hash, most recent last


class PrefixAffinityMap:
    """prefix hash -> the replicas it was routed to most recently (at most MAX_HOLDERS);
    least recently used hashes dropped. Also counts the hashes each replica holds (how
    much cached prefix it is credited with)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._holders: OrderedDict[int, list[ReplicaID]] = OrderedDict()
        self._owned: Counter[ReplicaID] = Counter()

    def __len__(self) -> int:
        return len(self._holders)

    def owned(self, replica_id: ReplicaID) -> int:
        return self._owned[replica_id]

    def longest_match(self, hashes: tuple[int, ...], candidates: dict[ReplicaID, RunningReplica],
                      ) -> list[RunningReplica]:
        """The candidates that were sent the longest leading run of `hashes` any candidate
        was sent (most recent last); [] for none."""
        for h in reversed(hashes):
            holders = [candidates[r] for r in self._holders.get(h, ()) if r in candidates]
            if holders:
                return holders
        return []

    def record(self, hashes: tuple[int, ...], replica_id: ReplicaID) -> None:
        for h in hashes:
            holders = self._holders.setdefault(h, [])
            if replica_id in holders:
                holders.remove(replica_id)
            else:
                self._owned[replica_id] += 1
            holders.append(replica_id)
            if len(holders) > MAX_HOLDERS:
                self._disown(holders.pop(0))
            self._holders.move_to_end(h)
        while len(self._holders) > self.max_entries:
            for old in self._holders.popitem(last=False)[1]:
                self._disown(old)

    def _disown(self, replica_id: ReplicaID) -> None:
        self._owned[replica_id] -= 1
        if self._owned[replica_id] <= 0:
            del self._owned[replica_id]


def request_field(pending_request: PendingRequest | None, name: str) -> Any:
    """Field `name` (prefix_hashes, avoid_replicas, prefer_replica) of the call's first
    argument that has it (a ReplicaRequest); None when none does."""
    if pending_request is None:
        return None
    for arg in pending_request.args:
        value = getattr(arg, name, None)
        if value is not None:
            return value
    return None


class PrefixAffinityRouter(MultiplexMixin, RequestRouter):
    """Prefix-cache affinity with power-of-two-choices fallback (module docstring)."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                         max_entries: int = DEFAULT_MAX_ENTRIES, **kwargs: Any) -> None:
        """`request_router_kwargs` of the deployment's RequestRouterConfig."""
        self.max_imbalance = max_imbalance
        self.affinity = PrefixAffinityMap(max_entries)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """Ranks to try in order: [the replica storing the response], [the prefix's
        holders (or the new prefix's replica), the rest of two random] or [two random];
        Ray's base router takes the shorter queue within a rank and moves on when all are
        full."""
        metadata = getattr(pending_request, "metadata", None)
        if metadata is not None and metadata.multiplexed_model_id:
            ranked = self.apply_multiplex_routing(pending_request)
            candidate_replicas = [r for r in candidate_replicas if r.replica_id in ranked]
        avoid = request_field(pending_request, "avoid_replicas") or ()
        if avoid:
            candidate_replicas = [r for r in candidate_replicas
                                  if r.replica_id.unique_id not in avoid] or candidate_replicas
        if not candidate_replicas:
            return []
        stored_on = request_field(pending_request, "prefer_replica")
        owner = [r for r in candidate_replicas if r.replica_id.unique_id == stored_on]
        if owner:  # it alone has the response; gone: any replica answers the 404
            return [owner]
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        hashes = tuple(request_field(pending_request, "prefix_hashes") or ())
        if not hashes:
            return [two]
        by_id = {r.replica_id: r for r in candidate_replicas}
        holders = self.affinity.longest_match(hashes, by_id)
        if not holders:  # a new prefix: to the one that owns less, and remembered now
            chosen = min(two, key=lambda r: self.affinity.owned(r.replica_id))
            self.affinity.record(hashes, chosen.replica_id)
            holders = [chosen]
        elif self._busy(holders, two):
            return [two]
        rest = [r for r in two if r not in holders]
        return [holders, rest] if rest else [holders]

    def _busy(self, holders: list[RunningReplica], others: list[RunningReplica]) -> bool:
        """Each holder full, or the least loaded holder more than max_imbalance requests
        behind the least loaded of `others` (queue lengths as the router last heard them;
        an unknown one counts as free)."""
        cache = self.replica_queue_len_cache
        lengths = [cache.get(r.replica_id) for r in holders]
        if any(q is None for q in lengths):
            return False
        if all(q >= r.max_ongoing_requests for q, r in zip(lengths, holders)):
            return True
        known = [q for q in (cache.get(r.replica_id) for r in others if r not in holders)
                 if q is not None]
        return bool(known) and min(lengths) - min(known) > self.max_imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hashes = request_field(pending_request, "prefix_hashes")
        if hashes:
            self.affinity.record(tuple(hashes), replica_id)
