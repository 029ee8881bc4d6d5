"""Property test of the KVCacheManager: random admits, chunks, decodes (with speculative
lookahead), forks, preemptions, failed forwards and frees, against a simulation of what
every KV slot holds. A wrong hit, a missed copy or a write into a shared block shows up as
a request reading KV that is not its own."""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine.kv.kv_cache_manager import NULL_BLOCK, KVCacheManager
from aioengine.request import Request

from test_kv_cache_manager import make_request, snapshot  # tests/unit is on sys.path
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
            # With a sliding window, the next query (at num_computed) reads only the last W.
            first = max(0, req.num_computed_tokens - (self.mgr.sliding_window or 10**9) + 1)
            for p in range(first, req.num_computed_tokens):
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
        self.check_window_bound(req, num_new + num_spec)
        self.run_forward(req, num_new, num_spec)

    def check_window_bound(self, req: Request, num_new: int) -> None:
        """With a window W, a request holds the blocks its next queries can read and the
        ones it writes: at most cdiv(W - 1 + num_new, B) + 1, whatever its length."""
        window, bs = self.mgr.sliding_window, self.mgr.block_size
        if window is None:
            return
        held = [b for b in self.mgr.get_blocks(req.request_id) if b is not NULL_BLOCK]
        assert len(held) <= -(-(window - 1 + num_new) // bs) + 1, (
            f"{req.request_id} holds {len(held)} blocks with window {window}")

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
    window = data.draw(st.sampled_from([None, None, 1, 2, 3, 5]), label="sliding_window")
    mgr = KVCacheManager(num_blocks, block_size, enable_caching=caching,
                         sliding_window=window, max_step_tokens=64)
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
