"""Suffix decoding's tree and proposer against a brute-force reading of the rule: counts are
occurrences of substrings (up to max_depth tokens) in the inserted sequences, the walk
follows the most frequent next token (ties: the lower id) while the running product of
count ratios stays >= min_token_prob, at most min(k, factor * m) tokens from a match of m
tokens and never past max_depth, and the best-scored walk wins (ties: the longer match)."""
from __future__ import annotations

import argparse
import random
import time

import pytest

from aioengine.lora.request import LoRARequest
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.suffix import GlobalSuffixCache, SuffixParams, SuffixProposer
from aioengine.spec_decode.suffix_tree import BYTES_PER_NODE, SuffixTree
from aioengine.errors import ConfigError


def occurrences(seqs: list[list[int]], s: list[int]) -> int:
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if q[i:i + n] == s)


def brute_walk(seqs, s, limit, depth, min_prob) -> tuple[list[int], float]:
    out, prob, score = [], 1.0, 0.0
    path = list(s)
    while len(out) < limit and len(path) < depth:
        counts = {}
        for q in seqs:
            for i in range(len(q) - len(path)):
                if q[i:i + len(path)] == path:
                    t = q[i + len(path)]
                    counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        t = min(counts, key=lambda x: (-counts[x], x))
        prob *= counts[t] / occurrences(seqs, path)
        if prob < min_prob:
            break
        out.append(t)
        score += prob
        path.append(t)
    return out, score


def brute_speculate(seqs, context, k, factor, min_prob, depth) -> tuple[list[int], float]:
    best, best_score = [], 0.0
    for m in range(min(depth, len(context)), 0, -1):
        s = context[len(context) - m:]
        if not occurrences(seqs, s):
            continue
        tokens, score = brute_walk(seqs, s, min(k, int(m * factor + 1e-6)), depth, min_prob)
        if score > best_score:
            best, best_score = tokens, score
    return best, best_score


def test_docstring_example() -> None:
    tree = SuffixTree(4)
    tree.insert([1, 2, 1, 2, 3])
    cursor = tree.match([1, 2])
    assert [tree.count[n] for n in cursor[1:]] == [2, 2]  # "2" and "1 2" occur twice
    # After "1 2": 1 (tie with 3: the lower id), p = 1/2, then 2 (p stays 1/2).
    assert tree.walk(cursor[2], 4, 0.0) == ([1, 2], 1.0)
    assert tree.walk(cursor[2], 4, 0.6) == ([], 0.0)  # min_token_prob cuts at once
    # The tree's depth bounds a match plus its draft: "1 2" + 2 tokens = depth 4.
    assert tree.walk(cursor[2], 10, 0.0)[0] == [1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        depth = rng.randint(1, 7)
        alphabet = rng.randint(1, 4)
        seqs = [[rng.randrange(alphabet) for _ in range(rng.randint(0, 25))]
                for _ in range(rng.randint(1, 4))]
        tree = SuffixTree(depth)
        for q in seqs:
            tree.insert(q)
        for _ in range(10):
            ctx = [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]
            k, factor = rng.randint(1, 8), rng.choice([0.5, 1.0, 2.0])
            min_prob = rng.choice([0.0, 0.1, 0.4])
            got = tree.speculate(tree.match(ctx), k, factor, min_prob)
            want = brute_speculate(seqs, ctx, k, factor, min_prob, depth)
            assert got[0] == want[0] and got[1] == pytest.approx(want[1])


def test_append_cursor_builds_the_same_tree_and_matches_its_own_end() -> None:
    rng = random.Random(5)
    seq = [rng.randrange(3) for _ in range(200)]
    a, b = SuffixTree(6), SuffixTree(6)
    a.insert(seq)
    cursor = [0]
    for t in seq:
        cursor = b.append(cursor, t)
    assert a.num_nodes == b.num_nodes
    assert cursor == b.match(seq)  # the cursor is the sequence's own suffixes' nodes
    assert a.speculate(a.match(seq), 8, 1.0, 0.1) == b.speculate(cursor, 8, 1.0, 0.1)


def _paths(tree: SuffixTree) -> dict[tuple[int, ...], tuple]:
    """Every node by its path: count, most frequent child's token, children's tokens."""
    out, stack = {}, [(0, ())]
    while stack:
        node, path = stack.pop()
        kids, c = [], tree.first_child[node]
        while c != -1:
            kids.append(tree.token[c])
            stack.append((c, path + (tree.token[c],)))
            c = tree.next_sibling[c]
        best = tree.best[node]
        out[path] = (tree.count[node] if node else None,
                     tree.token[best] if best != -1 else None, sorted(kids))
    return out


def test_from_sequence_builds_what_insert_builds() -> None:
    """The numpy build of a prompt's tree is node for node the token-by-token one, and
    grows the same afterwards."""
    rng = random.Random(3)
    for _ in range(200):
        depth = rng.randint(1, 8)
        seq = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 40))]
        a, b = SuffixTree(depth), SuffixTree.from_sequence(seq, depth)
        a.insert(seq)
        assert _paths(a) == _paths(b) and len(a.edges) == len(b.edges) == b.num_nodes - 1
        ca, cb = a.match(seq), b.match(seq)
        for t in [rng.randrange(5) for _ in range(10)]:
            ca, cb = a.append(ca, t), b.append(cb, t)
        assert _paths(a) == _paths(b)


def test_remove_takes_back_an_insert_and_frees_its_nodes() -> None:
    rng = random.Random(1)
    seqs = [[rng.randrange(5) for _ in range(rng.randint(5, 60))] for _ in range(6)]
    tree, fresh = SuffixTree(8), SuffixTree(8)
    for q in seqs:
        tree.insert(q)
    for q in seqs[::2]:
        tree.remove(q)
    for q in seqs[1::2]:
        fresh.insert(q)
    assert tree.num_nodes == fresh.num_nodes
    for _ in range(200):
        ctx = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
        assert (tree.speculate(tree.match(ctx), 6, 1.0, 0.0)
                == fresh.speculate(fresh.match(ctx), 6, 1.0, 0.0))
    for q in seqs[1::2]:
        tree.remove(q)
    assert tree.num_nodes == 1 and not tree.edges  # the root alone: nothing leaks
    tree.insert(seqs[0])  # freed ids are reused
    assert len(tree.token) < sum(len(q) for q in seqs) * 8


def test_adaptive_length_and_min_token_prob() -> None:
    tree = SuffixTree(64)
    body = list(range(100, 140))
    tree.insert(body)
    # A match of m tokens drafts at most factor * m tokens.
    for m, factor, want in ((2, 1.0, 2), (2, 2.0, 4), (5, 1.0, 5), (3, 0.5, 1)):
        assert len(tree.speculate(tree.match(body[:m]), 30, factor, 0.1)[0]) == want
    assert len(tree.speculate(tree.match(body[:20]), 8, 1.0, 0.1)[0]) == 8  # k caps it
    # A fork: after 7 8, 9 came 3 times and 5 once: p(9) = 3/4, then the rest follows.
    fork = SuffixTree(16)
    for tail in ([9, 1], [9, 1], [9, 1], [5, 2]):
        fork.insert([7, 8] + tail)
    assert fork.speculate(fork.match([7, 8]), 8, 1.0, 0.5) == ([9, 1], 1.5)
    assert fork.speculate(fork.match([7, 8]), 8, 1.0, 0.8)[0] == []


def test_global_cache_evicts_oldest_first_by_count_and_bytes() -> None:
    cache = GlobalSuffixCache(max_depth=4, max_requests=2, max_bytes=10**9)
    outs = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for out in outs:
        cache.add(0, out)
    assert [o for _, o in cache.cached] == outs[1:]
    tree = cache.trees[0]
    assert tree.child(0, 1) == -1 and tree.child(0, 4) != -1  # the first one is gone
    fresh = SuffixTree(4)
    for out in outs[1:]:
        fresh.insert(out)
    assert tree.num_nodes == fresh.num_nodes
    # Bytes: room for about two outputs' nodes.
    one = SuffixTree(4)
    one.insert(outs[0])
    cache = GlobalSuffixCache(4, 100, max_bytes=int(2.5 * (one.num_nodes - 1) * BYTES_PER_NODE))
    for out in outs:
        cache.add(0, out)
    assert len(cache.cached) == 2 and cache.nbytes <= cache.max_bytes
    # An output bigger than the bound alone is not kept; 0 requests keeps none.
    cache.add(0, list(range(1000, 1400)))
    assert cache.nbytes <= cache.max_bytes
    off = GlobalSuffixCache(4, 0, 10**9)
    off.add(0, [1, 2, 3])
    assert not off.trees


def _request(rid: str, prompt: list[int], lora: int = 0) -> Request:
    """A sample as admission leaves it: with an adapter, in that adapter's draft pool
    (LoRAManager.draft_pool; the engine tests run the real admission)."""
    lora_request = LoRARequest(f"a{lora}", "", lora) if lora else None
    request = Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=64),
                      lora_request=lora_request)
    request.draft_pool = (("lora", lora),) if lora else ()
    return request


def _params(**kw) -> SuffixParams:
    return SuffixParams(**{"num_speculative_tokens": 8, "max_tree_depth": 24,
                           "max_cached_requests": 100, "max_spec_factor": 1.0,
                           "min_token_prob": 0.1, "max_cached_bytes": 10**9, **kw})


def _finish(proposer: SuffixProposer, request: Request, output: list[int]) -> None:
    for t in output:  # one token a step, as the engine appends them
        proposer.propose_one(request, request.all_token_ids + [t])
        request.append_output_token_ids([t])
    request.status = RequestStatus.FINISHED_STOPPED
    proposer.retire_finished()


def test_proposer_learns_from_finished_requests_per_adapter_and_drops_their_state() -> None:
    proposer = SuffixProposer(_params())
    answer = [500 + i for i in range(30)]
    _finish(proposer, _request("a", [1, 2, 3]), answer)
    assert not proposer.samples  # its own tree went with it
    assert [o for _, o in proposer.global_cache.cached] == [answer]
    # A new request whose output starts like the cached one gets the rest as drafts.
    b = _request("b", [9, 9, 9])
    assert proposer.propose_one(b, b.all_token_ids + answer[:4]) == answer[4:8]
    # The same under another adapter: the base model's outputs are not its drafts.
    c = _request("c", [9, 9, 9], lora=3)
    assert proposer.propose_one(c, c.all_token_ids + answer[:4]) == []
    # Its own prompt still is (the per-request tree).
    d = _request("d", answer[:12] + [7], lora=3)
    assert proposer.propose_one(d, d.all_token_ids + answer[:4]) == answer[4:8]
    for r in (b, c, d):
        r.status = RequestStatus.FINISHED_ABORTED
    proposer.retire_finished()
    assert not proposer.samples


def test_proposer_follows_the_global_tree_as_it_changes() -> None:
    """The global cursor is followed token by token while the tree is unchanged and
    matched anew after it changes; both give what a fresh match gives."""
    proposer = SuffixProposer(_params(max_cached_requests=3))
    rng = random.Random(2)
    shapes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    for i in range(8):
        _finish(proposer, _request(f"w{i}", [1]), shapes[i % 3])
        r = _request(f"r{i}", [2, 3])
        out = shapes[(i + 1) % 3]
        for j in range(1, 20):
            tokens = r.all_token_ids + out[:j]
            got = proposer.propose_one(r, tokens)
            tree = proposer.global_cache.trees[()]
            local = proposer.samples[r.request_id]
            fresh = tree.speculate(tree.match(tokens[-24:]), 8, 1.0, 0.1)
            own = local.tree.speculate(local.cursor, 8, 1.0, 0.1)
            assert got == (fresh[0] if fresh[1] > own[1] else own[0])
        r.status = RequestStatus.FINISHED_ABORTED
        proposer.retire_finished()
    assert len(proposer.global_cache.cached) == 3 and not proposer.samples


def test_propose_time_for_a_2000_token_context() -> None:
    """A step's propose (one new token: both trees' cursors and walks) is well under a
    millisecond with a 2,000-token context and a warm global tree."""
    rng = random.Random(0)
    proposer = SuffixProposer(_params(num_speculative_tokens=16))
    for i in range(20):
        _finish(proposer, _request(f"w{i}", [1]),
                [rng.randrange(300) for _ in range(200)])
    prompt = [rng.randrange(300) for _ in range(2000)]
    r = _request("r", prompt)
    proposer.propose_one(r, prompt)  # the prompt's tree is built once
    steps = [rng.randrange(300) for _ in range(200)]
    start = time.perf_counter()
    for t in steps:
        proposer.propose_one(r, r.all_token_ids + [t])
        r.append_output_token_ids([t])
    per_step = (time.perf_counter() - start) / len(steps)
    assert per_step < 1e-3, per_step


def test_config() -> None:
    cfg = SpeculativeConfig.parse({"method": "suffix"})
    assert (cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth,
            cfg.suffix_decoding_max_cached_requests, cfg.suffix_decoding_max_spec_factor,
            cfg.suffix_decoding_min_token_prob) == (8, 24, 10000, 1.0, 0.1)
    assert not cfg.uses_draft_head and cfg.disable_by_batch_size is None
    cfg = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 32, '
                                  '"suffix_decoding_max_cached_requests": 0}')
    assert cfg.num_speculative_tokens == 32 and cfg.suffix_decoding_max_cached_requests == 0
    for bad, field in (({"num_speculative_tokens": 33}, "num_speculative_tokens"),
                       ({"suffix_decoding_max_tree_depth": 0}, "max_tree_depth"),
                       ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
                       ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
                       ({"suffix_decoding_max_cached_requests": -1}, "cached_requests"),
                       ({"model": "x"}, "model"), ({"tree": {"depth": 2}}, "tree")):
        with pytest.raises(ConfigError, match=field):
            SpeculativeConfig.parse({"method": "suffix", **bad})
    with pytest.raises(ConfigError, match="only used by method 'suffix'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                 "suffix_decoding_max_tree_depth": 8})


def test_bench_spec_entries_and_agentic_sets() -> None:
    from aioengine.bench.agentic import PROMPT_SETS, TIMED_SEED, WARMUP_SEED, prompt_set
    from aioengine.bench.spec import parse_spec

    assert parse_spec("suffix", None) == {"method": "suffix"}
    assert parse_spec("suffix16", None) == {"method": "suffix", "num_speculative_tokens": 16}
    assert parse_spec("suffix:4:0.3", None) == {"method": "suffix", "num_speculative_tokens": 4,
                                                "suffix_decoding_min_token_prob": 0.3}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_spec("suffix:4", None)
    for name in PROMPT_SETS:  # agent-replay: tests/bench/test_bench_agent_replay.py
        timed = prompt_set(name, 20, TIMED_SEED)
        assert timed == prompt_set(name, 20, TIMED_SEED)  # deterministic
        assert not set(timed) & set(prompt_set(name, 50, WARMUP_SEED))  # held out
