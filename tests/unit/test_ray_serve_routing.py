"""Prefix-cache affinity routing without a cluster: the prompt's block hashes (prefix.py)
and PrefixAffinityRouter's choices on fake replicas and queue lengths (router.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from aioengine.ray_serve.prefix import prefix_hashes, prompt_text

pytest.importorskip("ray.serve")

from ray.serve._private.common import (DeploymentHandleSource, DeploymentID,  # noqa: E402
                                       ReplicaID)

from aioengine.ray_serve.deployments import ReplicaRequest  # noqa: E402
from aioengine.ray_serve.router import PrefixAffinityMap, PrefixAffinityRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="aioengine")


def test_prompt_text_of_each_api() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}) == [1, 2, 3]
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prompt_text(chat) == "system\nBe brief.\nuser\nHi\n"
    assert prompt_text({"input": "Hello", "instructions": "Be brief. "}) == "Be brief. Hello"
    assert prompt_text({"kind": "loop"}) is None


def test_prefix_hashes_are_chained_over_full_blocks_only() -> None:
    a = prefix_hashes("x" * 100 + "a" * 100, block_chars=50)
    b = prefix_hashes("x" * 100 + "b" * 100, block_chars=50)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_hashes("x" * 49, block_chars=50) == ()
    assert len(prefix_hashes("x" * 1000, block_chars=50, max_blocks=3)) == 3
    # Token ids: a block is block_chars / 4 ids.
    assert len(prefix_hashes(list(range(40)), block_chars=40)) == 4
    assert prefix_hashes([2 ** 70], block_chars=4) == ()


def test_affinity_map_longest_match_and_lru_bound() -> None:
    r1, r2 = FakeReplica("r1"), FakeReplica("r2")
    candidates = {r.replica_id: r for r in (r1, r2)}
    m = PrefixAffinityMap(max_entries=3)
    m.record((1, 2), r1.replica_id)
    m.record((1, 2, 3), r2.replica_id)  # the longer run, now on r2
    assert m.longest_match((1, 2, 3, 4), candidates) is r2
    assert m.longest_match((9,), candidates) is None
    m.record((7,), r1.replica_id)
    assert len(m) == 3 and m.longest_match((1,), candidates) is None  # 1 was evicted
    assert m.longest_match((1, 2, 3), {r1.replica_id: r1}) is None  # r2 is gone


@dataclass
class FakeReplica:
    """What the router reads of a RunningReplica."""
    name: str
    max_ongoing_requests: int = 8

    @property
    def replica_id(self) -> ReplicaID:
        return ReplicaID(unique_id=self.name, deployment_id=DEPLOYMENT)


@dataclass
class FakePending:
    args: list


def call(prompt: str, avoid: tuple[str, ...] = ()) -> FakePending:
    return FakePending([ReplicaRequest("POST", "/v1/completions", (), b"",
                                       prefix_hashes(prompt, block_chars=8), avoid)])


@pytest.fixture
async def router() -> PrefixAffinityRouter:
    r = PrefixAffinityRouter(deployment_id=DEPLOYMENT,
                             handle_source=DeploymentHandleSource.UNKNOWN,
                             use_replica_queue_len_cache=True)
    r.initialize_state(max_imbalance=2)
    return r


async def test_router_prefers_the_affine_replica_until_it_is_busy(router) -> None:
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    a = replicas[0]
    prompt = "shared prefix " * 4
    first = await router.choose_replicas(replicas, call(prompt))
    assert len(first) == 1 and len(first[0]) == 2  # nothing known: two random ones
    router.on_request_routed(call(prompt), a.replica_id, None)
    ranks = await router.choose_replicas(replicas, call(prompt + "and more"))
    assert ranks[0] == [a] and a not in ranks[1]
    # Busy: its queue is more than max_imbalance longer than another's...
    cache = router.replica_queue_len_cache
    for r, q in zip(replicas, (5, 1, 1)):
        cache.update(r.replica_id, q)
    ranks = await router.choose_replicas(replicas, call(prompt))
    assert len(ranks) == 1 and len(ranks[0]) == 2  # power of two choices
    # ... or full.
    for r, q in zip(replicas, (8, 7, 7)):
        cache.update(r.replica_id, q)
    ranks = await router.choose_replicas(replicas, call(prompt))
    assert len(ranks) == 1 and len(ranks[0]) == 2
    cache.update(a.replica_id, 3)  # 3 - 1 = 2: within max_imbalance
    cache.update(replicas[1].replica_id, 1)
    assert (await router.choose_replicas(replicas, call(prompt)))[0] == [a]


async def test_router_passes_over_avoided_replicas(router) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router.on_request_routed(call("x" * 32), a.replica_id, None)
    for _ in range(10):
        assert await router.choose_replicas([a, b], call("x" * 32, avoid=("a",))) == [[b]]
    # Nothing else left: the avoided one still serves.
    assert await router.choose_replicas([a], call("y" * 32, avoid=("a",))) == [[a]]
