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
    # An adapter's name salts the chain: the same prompt on it shares no block.
    salted = prefix_hashes("x" * 100 + "a" * 100, block_chars=50, salt="alpha")
    assert len(salted) == 4 and not set(salted) & set(a)
    assert salted == prefix_hashes("x" * 100 + "a" * 100, block_chars=50, salt="alpha")


def test_affinity_map_longest_match_and_lru_bound() -> None:
    r1, r2 = FakeReplica("r1"), FakeReplica("r2")
    candidates = {r.replica_id: r for r in (r1, r2)}
    m = PrefixAffinityMap(max_entries=3)
    m.record((1, 2), r1.replica_id)
    m.record((1, 2, 3), r2.replica_id)  # the longer run, on r2 only
    assert m.longest_match((1, 2, 3, 4), candidates) == [r2]
    assert m.longest_match((1, 2), candidates) == [r1, r2]  # both hold it, r2 the latest
    assert m.longest_match((9,), candidates) == []
    m.record((7,), r1.replica_id)
    assert len(m) == 3 and m.longest_match((1,), candidates) == []  # 1 was evicted
    assert m.longest_match((2, 3), {r1.replica_id: r1}) == [r1]  # r2 is gone


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


async def test_a_new_prefix_goes_to_the_replica_that_owns_less_and_is_remembered_at_once(
        router) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router.on_request_routed(call("p" * 64), a.replica_id, None)  # a owns 8 hashes
    for i in range(10):
        prompt = f"{i:02d}" + "n" * 62  # a new first block each time
        ranks = await router.choose_replicas([a, b], call(prompt))
        first = ranks[0][0]
        assert ranks == [[first], [a if first is b else b]]
        # Remembered before it is routed: the next request of that prefix follows it.
        again = await router.choose_replicas([a, b], call(prompt + "more"))
        assert again[0] == [first]
    # New prefixes went to the one that owned less each time: the hash counts are even.
    owned = router.affinity.owned
    assert abs(owned(a.replica_id) - owned(b.replica_id)) <= 8
    assert owned(b.replica_id) > 0


async def test_affinity_map_counts_what_each_replica_holds() -> None:
    a, b = FakeReplica("a").replica_id, FakeReplica("b").replica_id
    m = PrefixAffinityMap(max_entries=4)
    m.record((1, 2, 3), a)
    m.record((1, 2), b)  # now on both
    m.record((1, 2), b)  # counted once
    assert (m.owned(a), m.owned(b)) == (3, 2)
    m.record((7, 8), b)  # evicts 3, a's only
    assert len(m) == 4 and (m.owned(a), m.owned(b)) == (2, 4)


async def test_router_passes_over_avoided_replicas(router) -> None:
    a, b = FakeReplica("a"), FakeReplica("b")
    router.on_request_routed(call("x" * 32), a.replica_id, None)
    for _ in range(10):
        assert await router.choose_replicas([a, b], call("x" * 32, avoid=("a",))) == [[b]]
    # Nothing else left: the avoided one still serves.
    assert await router.choose_replicas([a], call("y" * 32, avoid=("a",))) == [[a]]


async def test_a_stored_responses_follow_ups_go_to_the_replica_that_stores_it(router) -> None:
    from aioengine.ray_serve.deployments import _stored_on

    assert _stored_on("/v1/responses/resp_ab12_0f9e", {}) == "ab12"
    assert _stored_on("/v1/responses/resp_ab12_0f9e/cancel", {}) == "ab12"
    assert _stored_on("/v1/responses", {"previous_response_id": "resp_cd34_77"}) == "cd34"
    assert _stored_on("/v1/responses", {"previous_response_id": "resp_0f9e"}) == ""  # untagged
    assert _stored_on("/v1/responses", {"previous_response_id": 7}) == ""
    assert _stored_on("/v1/chat/completions", {}) == ""
    from aioengine.server.serving_responses import new_response_id  # the server's own ids
    assert _stored_on(f"/v1/responses/{new_response_id('x7k2p9qa')}", {}) == "x7k2p9qa"
    assert _stored_on(f"/v1/responses/{new_response_id()}", {}) == ""
    a, b = FakeReplica("a"), FakeReplica("b")
    router.on_request_routed(call("x" * 32), a.replica_id, None)  # affinity says a
    follow_up = FakePending([ReplicaRequest("POST", "/v1/responses", (), b"",
                                            prefix_hashes("x" * 32, block_chars=8),
                                            prefer_replica="b")])
    for _ in range(5):
        assert await router.choose_replicas([a, b], follow_up) == [[b]]
    # The replica that stored it is gone: routed as any request (its 404 comes from there).
    assert (await router.choose_replicas([a], follow_up))[0] == [a]
