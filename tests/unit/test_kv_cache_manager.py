"""KVCacheManager: exact block tables, prefix hits, eviction order, fork + copy-on-write.

Every test calls check_integrity() after each operation. The property test at the end
also simulates the KV contents of every slot, so a wrong hit, a missed copy or a write
into a shared block shows up as a request reading KV that is not its own.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine.core.block_pool import hash_block_tokens
from aioengine.core.kv_cache_manager import KVCacheManager
from aioengine.request import Request
from aioengine.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: tuple | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(), cache_salt=salt)


def admit(mgr: KVCacheManager, req: Request, num_new: int | None = None) -> list[int]:
    """Prefix lookup + allocation + "forward" of `num_new` tokens (default: all)."""
    hits, num_hit = mgr.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new = mgr.allocate_slots(req, num_new, hits)
    assert new is not None
    req.num_computed_tokens = num_hit + num_new
    mgr.check_integrity()
    return [b.block_id for b in new]


def decode(mgr: KVCacheManager, req: Request, token: int) -> list[int] | None:
    req.append_output_token_ids([token])
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    mgr.check_integrity()
    return None if new is None else [b.block_id for b in new]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(mgr: KVCacheManager, req: Request) -> tuple:
    pool = mgr.block_pool
    return (free_ids(mgr), [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
            {rid: [b.block_id for b in bl] for rid, bl in mgr.req_to_blocks.items()},
            dict(mgr.num_cached_block), list(mgr._copy_ops), list(req.block_hashes),
            req.num_computed_tokens)


def test_allocate_hashes_full_blocks_as_they_fill() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))
    assert mgr.get_computed_blocks(req) == ([], 0)
    assert admit(mgr, req) == [0, 1, 2]
    assert mgr.get_block_ids("a") == [0, 1, 2]
    h0 = hash_block_tokens(None, [0, 1, 2, 3], None)
    h1 = hash_block_tokens(h0, [4, 5, 6, 7], None)
    assert req.block_hashes == [h0, h1]
    blocks = mgr.block_pool.blocks
    assert [blocks[i].block_hash for i in range(3)] == [h0, h1, None]
    assert decode(mgr, req, 10) == []  # 11 tokens fit in 3 blocks
    assert decode(mgr, req, 11) == []
    assert blocks[2].block_hash == hash_block_tokens(h1, [8, 9, 10, 11], None)
    assert decode(mgr, req, 12) == [3]
    assert mgr.get_block_ids("a") == [0, 1, 2, 3]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9]


def test_chunked_prefill_hashes_only_computed_full_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(10)))
    assert admit(mgr, req, 6) == [0, 1]
    assert mgr.block_pool.blocks[1].block_hash is None and mgr.num_cached_block["a"] == 1
    assert mgr.allocate_slots(req, 4) is not None
    assert mgr.get_block_ids("a") == [0, 1, 2]
    assert mgr.block_pool.blocks[1].block_hash == req.block_hashes[1]
    mgr.check_integrity()


def test_free_releases_in_reverse_to_the_tail() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = make_request("a", list(range(10))), make_request("b", [7] * 5)
    assert admit(mgr, a) == [0, 1, 2]
    assert admit(mgr, b) == [3, 4]
    mgr.free(a)
    mgr.check_integrity()
    assert free_ids(mgr) == [5, 2, 1, 0] and mgr.get_block_ids("a") == []
    mgr.free(b)
    mgr.check_integrity()
    assert free_ids(mgr) == [5, 2, 1, 0, 4, 3]


def test_prefix_hits_cover_full_blocks_but_never_the_last_token() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(mgr, a)
    mgr.free(a)
    blocks = mgr.block_pool.blocks
    cases = {12: 8, 13: 12, 9: 8, 8: 4, 5: 4, 4: 0, 1: 0}
    for n, expected in cases.items():
        req = make_request(f"r{n}", list(range(n)))
        hits, num_hit = mgr.get_computed_blocks(req)
        assert num_hit == expected, n
        assert hits == blocks[:expected // BS]
    # A different token inside block 1 breaks the chain there.
    hits, num_hit = mgr.get_computed_blocks(make_request("x", [0, 1, 2, 3, 4, 99, 6, 7, 8]))
    assert (hits, num_hit) == ([blocks[0]], 4)
    # A different salt (LoRA adapter, ...) is a separate cache.
    salted = make_request("s", list(range(12)), salt=("lora", 1))
    assert mgr.get_computed_blocks(salted) == ([], 0)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]  # lookups change nothing
    mgr.check_integrity()


def test_hit_on_free_cached_blocks_takes_them_out_of_the_free_queue() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    mgr.free(a)
    assert free_ids(mgr) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    b = make_request("b", list(range(10)))
    assert admit(mgr, b) == [3]
    assert b.num_computed_tokens == 10
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 2]
    # The hit blocks are shared with the next identical request.
    c = make_request("c", list(range(10)))
    assert admit(mgr, c) == [4]
    assert mgr.get_block_ids("c") == [0, 1, 4]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (0, 1, 3, 4)] == [2, 2, 1, 1]


def test_cached_blocks_are_evicted_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)))
    admit(mgr, a)
    mgr.free(a)
    assert free_ids(mgr) == [3, 4, 5, 2, 1, 0]
    b = make_request("b", [50] * 17)
    assert admit(mgr, b, 16) == [3, 4, 5, 2]  # evicts a's last block first
    hits, num_hit = mgr.get_computed_blocks(make_request("a2", list(range(12))))
    assert num_hit == 8 and [h.block_id for h in hits] == [0, 1]
    new = mgr.allocate_slots(b, 1)  # b's 5th block: evicts a's block 1
    assert new is not None and [blk.block_id for blk in new] == [1]
    mgr.check_integrity()
    hits, num_hit = mgr.get_computed_blocks(make_request("a3", list(range(12))))
    assert num_hit == 4 and [h.block_id for h in hits] == [0]
    assert len(mgr.block_pool.cached_block_hash_to_block) == 5  # a's block 0 + b's 4


def test_allocate_failure_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    mgr.free(a)  # blocks 0, 1 free but cached
    c = make_request("c", [9] * 8)
    assert admit(mgr, c) == [2, 3]
    assert free_ids(mgr) == [4, 1, 0]
    # b hits blocks 0, 1 and needs 2 more. Three blocks are free, but touching the two
    # hits takes them out of the queue, leaving one.
    b = make_request("b", list(range(16)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    before = snapshot(mgr, b)
    assert mgr.allocate_slots(b, 8, hits) is None
    assert snapshot(mgr, b) == before
    mgr.check_integrity()
    # With one block fewer needed, it fits exactly.
    b2 = make_request("b2", list(range(12)))
    assert admit(mgr, b2) == [4]
    assert mgr.get_block_ids("b2") == [0, 1, 4] and free_ids(mgr) == []
    # A running request that needs a new block fails cleanly too.
    before = snapshot(mgr, c)
    c.append_output_token_ids([9])
    assert mgr.allocate_slots(c, 1) is None
    c.all_token_ids.pop()
    c.output_token_ids.pop()
    assert snapshot(mgr, c) == before
    mgr.check_integrity()


def test_fork_copy_on_write_makes_n_minus_1_copies() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    parent = make_request("p", list(range(6)))
    admit(mgr, parent)
    children = [make_request(f"c{i}", list(range(6))) for i in range(2)]
    for child in children:
        mgr.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        mgr.check_integrity()
        assert mgr.get_block_ids(child.request_id) == [0, 1]
    blocks = mgr.block_pool.blocks
    assert (blocks[0].ref_cnt, blocks[1].ref_cnt) == (3, 3)
    assert children[0].block_hashes == parent.block_hashes
    assert decode(mgr, parent, 100) == [2]  # block 1 is shared and half full: copy
    assert mgr.get_block_ids("p") == [0, 2] and blocks[1].ref_cnt == 2
    assert decode(mgr, children[0], 101) == [3]
    assert mgr.get_block_ids("c0") == [0, 3] and blocks[1].ref_cnt == 1
    assert decode(mgr, children[1], 102) == []  # the last sharer writes in place
    assert mgr.get_block_ids("c1") == [0, 1]
    assert mgr.take_copy_ops() == [(1, 2), (1, 3)]
    assert mgr.take_copy_ops() == []
    # Later writes are private: no more copies. Block 0 stays shared by all three.
    assert decode(mgr, parent, 103) == [] and mgr.take_copy_ops() == []
    assert blocks[0].ref_cnt == 3
    # Each sample's now-full block 1 is hashed from its own tokens.
    assert blocks[2].block_hash == parent.block_hashes[1]
    assert parent.block_hashes[1] == hash_block_tokens(
        parent.block_hashes[0], [4, 5, 100, 103], None)
    for req in [parent] + children:
        mgr.free(req)
        mgr.check_integrity()
    assert all(b.ref_cnt == 0 for b in blocks) and mgr.usage == 0.0


def test_fork_copies_nothing_when_no_shared_block_holds_computed_tokens() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    # At a block boundary the first new token opens a new block for each sample.
    parent, child = make_request("p", list(range(8))), make_request("c", list(range(8)))
    admit(mgr, parent)
    mgr.fork(parent, child)
    child.num_computed_tokens = 8
    assert decode(mgr, parent, 1) == [2] and decode(mgr, child, 2) == [3]
    assert mgr.get_block_ids("p") == [0, 1, 2] and mgr.get_block_ids("c") == [0, 1, 3]
    # 4 known + 2 speculative tokens: block 5 is allocated but holds nothing computed, and
    # only block 4 (full of known tokens) is hashed. The child replaces it without a copy.
    parent, child = make_request("p2", [7] * 4), make_request("c2", [7] * 4)
    assert [b.block_id for b in mgr.allocate_slots(parent, 6)] == [4, 5]
    assert len(parent.block_hashes) == 1 and mgr.block_pool.blocks[5].block_hash is None
    parent.num_computed_tokens = 4  # both speculative tokens rejected
    mgr.fork(parent, child)
    child.num_computed_tokens = 4
    assert decode(mgr, child, 9) == [6]
    assert mgr.get_block_ids("c2") == [4, 6] and mgr.block_pool.blocks[5].ref_cnt == 1
    assert mgr.take_copy_ops() == []


def test_copy_on_write_failure_changes_nothing_and_free_drops_pending_copies() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    parent, child = make_request("p", list(range(6))), make_request("c", list(range(6)))
    filler = make_request("f", [9])
    admit(mgr, parent)
    admit(mgr, filler)
    mgr.fork(parent, child)
    child.num_computed_tokens = 6
    parent.append_output_token_ids([1])
    before = snapshot(mgr, parent)
    assert mgr.allocate_slots(parent, 1) is None  # the copy needs a block: none is free
    assert snapshot(mgr, parent) == before
    mgr.check_integrity()
    mgr.free(filler)
    assert [b.block_id for b in mgr.allocate_slots(parent, 1)] == [2]
    # The parent is freed before its forward (an abort): its pending copy goes with it.
    mgr.free(parent, discard_cache=True)
    mgr.check_integrity()
    assert mgr.take_copy_ops() == []
    # Now the child owns block 1 alone and writes in place.
    child.append_output_token_ids([2])
    assert mgr.allocate_slots(child, 1) == [] and mgr.take_copy_ops() == []
    mgr.check_integrity()


def test_fork_rejects_a_child_that_differs_in_the_computed_prefix() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    parent = make_request("p", list(range(6)))
    admit(mgr, parent)
    with pytest.raises(ValueError, match="differs"):
        mgr.fork(parent, make_request("c", [0, 1, 2, 3, 4, 9]))
    with pytest.raises(ValueError, match="cache_salt"):
        mgr.fork(parent, make_request("c", list(range(6)), salt=("x",)))
    mgr.check_integrity()


def test_discard_cache_drops_hashes_of_released_blocks() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    b = make_request("b", list(range(10)))
    admit(mgr, b)  # shares blocks 0, 1 with a
    mgr.free(b, discard_cache=True)  # 0, 1 are still held by a: they stay cached
    mgr.check_integrity()
    assert mgr.get_computed_blocks(make_request("x", list(range(10))))[1] == 8
    mgr.free(a, discard_cache=True)
    mgr.check_integrity()
    assert mgr.get_computed_blocks(make_request("y", list(range(10)))) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert free_ids(mgr) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]


def test_usage_and_prefix_cache_stats() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    assert mgr.num_blocks == 8 and mgr.num_blocks_needed(9) == 3 and mgr.num_blocks_needed(8) == 2
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    assert mgr.usage == 3 / 8 and mgr.num_free_blocks == 5
    mgr.free(a)
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 8
    admit(mgr, make_request("b", list(range(10))))  # 8 of 10 tokens hit
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)
    assert mgr.prefix_cache_hit_rate == 0.4
    assert mgr.usage == 3 / 8


def test_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(10)))
    assert admit(mgr, a) == [0, 1, 2]
    assert a.block_hashes == [] and mgr.block_pool.cached_block_hash_to_block == {}
    mgr.free(a)
    b = make_request("b", list(range(10)))
    assert mgr.get_computed_blocks(b) == ([], 0)
    assert mgr.prefix_cache_queries == 0 and mgr.prefix_cache_hit_rate == 0.0
    assert admit(mgr, b) == [3, 4, 5]


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    mgr.check_integrity()


def test_check_integrity_catches_a_ref_count_leak() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    admit(mgr, make_request("a", list(range(6))))
    mgr.block_pool.touch([mgr.block_pool.blocks[0]])  # a reference no request holds
    with pytest.raises(AssertionError, match="block 0 has ref_cnt 2 but 1 request"):
        mgr.check_integrity()


# ---------------------------------------------------------------- property test


class KVSim:
    """A model of the device's KV cache: each slot holds (salt, prefix) of the token whose
    K/V was last written there. A correct manager lets a request read only slots holding
    its own prefix, and a cached block always holds what its hash claims."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr, self.bs = mgr, mgr.block_size
        self.slots: dict[tuple[int, int], tuple] = {}
        self.hash_contents: dict[int, list[tuple]] = {}  # every block hash ever computed

    def forward(self, req: Request, num_new: int) -> None:
        for src, dst in self.mgr.take_copy_ops():  # the runner copies first, in order
            for off in range(self.bs):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
                else:
                    self.slots.pop((dst, off), None)
        table = self.mgr.get_block_ids(req.request_id)
        for p in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            content = self.content(req, p) if p < req.num_tokens else ("spec", p)
            self.slots[(table[p // self.bs], p % self.bs)] = content

    @staticmethod
    def content(req: Request, pos: int) -> tuple:
        return req.cache_salt, tuple(req.all_token_ids[:pos + 1])

    def check(self, live: list[Request]) -> None:
        for req in live:
            table = self.mgr.get_block_ids(req.request_id)
            assert len(table) * self.bs >= req.num_computed_tokens
            for p in range(req.num_computed_tokens):
                assert self.slots.get((table[p // self.bs], p % self.bs)) == self.content(req, p), (
                    f"{req.request_id} reads foreign KV at position {p}")
            for i, h in enumerate(req.block_hashes):
                self.hash_contents[h] = [self.content(req, i * self.bs + j) for j in range(self.bs)]
        for h, block in self.mgr.block_pool.cached_block_hash_to_block.items():
            held = [self.slots.get((block.block_id, j)) for j in range(self.bs)]
            assert held == self.hash_contents[h], f"cached block {block.block_id} holds stale KV"


class RandomWorkload:
    """Drives one manager with hypothesis-chosen admits, chunks, decodes (with speculative
    lookahead), forks, preemptions, failed forwards and frees."""

    def __init__(self, data: st.DataObject, mgr: KVCacheManager) -> None:
        self.data, self.mgr, self.sim = data, mgr, KVSim(mgr)
        self.live: list[Request] = []
        self.waiting: list[Request] = []  # preempted, to be readmitted
        self.ids = itertools.count()

    def draw(self, strategy: st.SearchStrategy):
        return self.data.draw(strategy)

    def run_forward(self, req: Request, num_new: int, num_spec: int) -> None:
        if self.draw(st.integers(0, 9)) == 0:  # the forward failed: nothing was written
            self.mgr.take_copy_ops()
            self.mgr.free(req, discard_cache=True)
            if req in self.live:
                self.live.remove(req)
            return
        self.sim.forward(req, num_new + num_spec)
        req.num_computed_tokens += num_new

    def add(self) -> None:
        if self.waiting and self.draw(st.booleans()):
            req = self.waiting.pop(0)
        else:
            tokens = self.draw(st.lists(st.integers(0, 2), min_size=1, max_size=12))
            salt = self.draw(st.sampled_from([None, ("lora", 1)]))
            req = make_request(f"r{next(self.ids)}", tokens, salt)
        hits, num_hit = self.mgr.get_computed_blocks(req)
        assert num_hit < req.num_tokens and num_hit == len(hits) * self.mgr.block_size
        num_new = self.draw(st.integers(1, req.num_tokens - num_hit))
        before = snapshot(self.mgr, req)
        if self.mgr.allocate_slots(req, num_new, hits) is None:
            assert snapshot(self.mgr, req) == before
            self.waiting.append(req)
            return
        req.num_computed_tokens = num_hit
        self.live.append(req)
        self.run_forward(req, num_new, 0)

    def step(self, req: Request) -> None:
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([self.draw(st.integers(0, 2))])
        remaining = req.num_tokens - req.num_computed_tokens
        num_new = self.draw(st.integers(1, remaining))
        num_spec = self.draw(st.integers(0, 2)) if num_new == remaining else 0
        before = snapshot(self.mgr, req)
        if self.mgr.allocate_slots(req, num_new + num_spec) is None:
            assert snapshot(self.mgr, req) == before
            self.mgr.free(req)  # preemption by recompute
            req.num_computed_tokens = 0
            self.live.remove(req)
            self.waiting.append(req)
            return
        self.run_forward(req, num_new, num_spec)

    def fork(self, parent: Request) -> None:
        child = make_request(f"r{next(self.ids)}", parent.all_token_ids, parent.cache_salt)
        self.mgr.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.live.append(child)

    def one_op(self) -> None:
        op = self.draw(st.sampled_from(["add", "step", "step", "step", "fork", "free"]))
        if op == "add" or not self.live:
            self.add()
            return
        req = self.draw(st.sampled_from(self.live))
        if op == "step":
            self.step(req)
        elif op == "fork":
            self.fork(req)
        else:
            self.mgr.free(req, discard_cache=self.draw(st.booleans()))
            self.live.remove(req)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_workloads_keep_integrity_and_kv_contents(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(1, 12), label="num_blocks")
    caching = data.draw(st.booleans(), label="enable_caching")
    mgr = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    work = RandomWorkload(data, mgr)
    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        work.one_op()
        mgr.check_integrity()
        work.sim.check(work.live)
    for req in work.live:
        mgr.free(req)
        mgr.check_integrity()
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)
    assert mgr.num_free_blocks == num_blocks and mgr.usage == 0.0 and mgr.req_to_blocks == {}
    work.sim.check([])
