"""Prefix-cache affinity routing for the engine replicas (Ray Serve's request-router API).

The router runs inside each process that holds a handle to the engine deployment (the
ingress), and sees the arguments of every handle call: the ingress passes a
`ReplicaRequest` whose `prefix_hashes` are the chained hashes of the prompt's leading
blocks (prefix.py). The router remembers, in a bounded LRU map, which replica each hash
was last sent to, and for a new request:

1. takes the replica of the longest run of leading hashes it has seen (the affine
   replica: the one most likely to hold that prefix in its KV cache), unless that replica
   is busy: its queue is full, or longer than the shorter queue of two random replicas by
   more than `max_imbalance` requests;
2. otherwise (no affine replica, or a busy one) falls back to power of two choices on
   queue length, as Ray's default router does.

A retry after a dead engine answered lists that replica in `avoid_replicas`, which are no
candidates then (unless nothing else is left). Every hash of a routed request then points
at the replica it went to. A dead or removed
replica's entries are skipped (it is no candidate) and age out of the LRU map.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (PendingRequest, ReplicaID, ReplicaResult, RequestRouter,
                                      RunningReplica)

from aioengine.ray_serve.options import DEFAULT_MAX_IMBALANCE
DEFAULT_MAX_ENTRIES = 1 << 16


class PrefixAffinityMap:
    """prefix hash -> the replica it was last routed to; least recently used dropped."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._replicas: OrderedDict[int, ReplicaID] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def longest_match(self, hashes: tuple[int, ...],
                      candidates: dict[ReplicaID, RunningReplica]) -> RunningReplica | None:
        """The candidate that served the longest leading run of `hashes`."""
        for h in reversed(hashes):
            replica_id = self._replicas.get(h)
            if replica_id is not None and replica_id in candidates:
                return candidates[replica_id]
        return None

    def record(self, hashes: tuple[int, ...], replica_id: ReplicaID) -> None:
        for h in hashes:
            self._replicas[h] = replica_id
            self._replicas.move_to_end(h)
        while len(self._replicas) > self.max_entries:
            self._replicas.popitem(last=False)


def request_field(pending_request: PendingRequest | None, name: str) -> tuple:
    """Field `name` (prefix_hashes, avoid_replicas) of the call's first argument that has
    it (a ReplicaRequest); () when none does."""
    if pending_request is None:
        return ()
    for arg in pending_request.args:
        value = getattr(arg, name, None)
        if value is not None:
            return tuple(value)
    return ()


class PrefixAffinityRouter(RequestRouter):
    """Prefix-cache affinity with power-of-two-choices fallback (module docstring)."""

    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                         max_entries: int = DEFAULT_MAX_ENTRIES, **kwargs: Any) -> None:
        """`request_router_kwargs` of the deployment's RequestRouterConfig."""
        self.max_imbalance = max_imbalance
        self.affinity = PrefixAffinityMap(max_entries)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        """Ranks to try in order: [[affine], two random] or [two random]; Ray's base
        router takes the shorter queue within a rank and moves on when all are full."""
        avoid = request_field(pending_request, "avoid_replicas")
        if avoid:
            candidate_replicas = [r for r in candidate_replicas
                                  if r.replica_id.unique_id not in avoid] or candidate_replicas
        if not candidate_replicas:
            return []
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        hashes = request_field(pending_request, "prefix_hashes")
        if not hashes:
            return [two]
        by_id = {r.replica_id: r for r in candidate_replicas}
        affine = self.affinity.longest_match(hashes, by_id)
        if affine is None or self._busy(affine, two):
            return [two]
        return [[affine], [r for r in two if r.replica_id != affine.replica_id] or two]

    def _busy(self, affine: RunningReplica, others: list[RunningReplica]) -> bool:
        """Full, or more than max_imbalance requests behind the least loaded of `others`
        (queue lengths as the router last heard them; unknown ones do not count)."""
        cache = self.replica_queue_len_cache
        queue_len = cache.get(affine.replica_id)
        if queue_len is None:
            return False
        if queue_len >= affine.max_ongoing_requests:
            return True
        known = [q for q in (cache.get(r.replica_id) for r in others
                             if r.replica_id != affine.replica_id) if q is not None]
        return bool(known) and queue_len - min(known) > self.max_imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hashes = request_field(pending_request, "prefix_hashes")
        if hashes:
            self.affinity.record(hashes, replica_id)
