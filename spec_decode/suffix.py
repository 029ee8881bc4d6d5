"""Suffix decoding (Oliaro et al., 2024; vLLM's `method: "suffix"`): drafts from what was
already written, in this request and in recent finished ones.

Two kinds of suffix tree (spec_decode/suffix_tree.py):
- one per running sample over its prompt and output, grown by the tokens of every step;
- a global one per draft pool (Request.draft_pool, from the features: one per LoRA
  adapter, and one for the base model) over the outputs of the last
  `max_cached_requests` finished samples, first in first out, and never more than
  `max_cached_bytes` of nodes.

Each step the sample's last tokens (up to max_tree_depth) are matched in both trees; from
each matched suffix of m tokens the most frequent continuation is followed node by node
while its empirical probability stays >= min_token_prob, for at most
min(k, max_spec_factor * m) tokens, and the best-scored walk (its expected accepted
tokens) of the two trees is the draft: 0..k tokens, so a request's draft length changes
from step to step. Verification is exact, so drafts only change speed.

The proposer learns that a sample finished from the sample itself (`Request.is_finished`,
set by the engine loop) at its next propose: its output then enters the global tree and
its own tree is dropped. Nothing of it lives in the scheduler or the runner.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from aioengine.request import Request
from aioengine.spec_decode.proposer import ProposeContext, Proposer
from aioengine.spec_decode.suffix_tree import SuffixTree


@dataclass(frozen=True)
class SuffixParams:
    num_speculative_tokens: int  # k: the most drafts a step
    max_tree_depth: int
    max_cached_requests: int  # 0: no global tree
    max_spec_factor: float
    min_token_prob: float
    max_cached_bytes: int


@dataclass
class _SampleState:
    """One running sample's tree and where its cursors stand."""

    request: Request
    tree: SuffixTree
    cursor: list[int]  # in `tree`, after the last indexed token
    num_indexed: int  # tokens of prompt + output in `tree`
    # The global tree's cursor after the same tokens, valid while global_version holds.
    global_cursor: list[int] = field(default_factory=list)
    global_version: int = -1
    num_indexed_global: int = 0


class GlobalSuffixCache:
    """Finished outputs, one tree per draft pool, evicted oldest first past either
    bound."""

    def __init__(self, max_depth: int, max_requests: int, max_bytes: int) -> None:
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.trees: dict[Hashable, SuffixTree] = {}
        self.cached: deque[tuple[Hashable, list[int]]] = deque()  # (pool, output), oldest first
        # Bumped on every change: cursors into a tree are only valid for one version.
        self.version = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.trees.values())

    def add(self, pool: Hashable, output: list[int]) -> None:
        if self.max_requests <= 0 or not output:
            return
        tree = self.trees.get(pool)
        if tree is None:
            tree = self.trees[pool] = SuffixTree(self.max_depth)
        tree.insert(output)
        self.cached.append((pool, output))
        self.version += 1
        while self.cached and (len(self.cached) > self.max_requests
                               or self.nbytes > self.max_bytes):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        pool, output = self.cached.popleft()
        tree = self.trees[pool]
        tree.remove(output)
        if tree.num_nodes == 1:  # the root alone
            del self.trees[pool]
        self.version += 1


class SuffixProposer(Proposer):
    def __init__(self, params: SuffixParams) -> None:
        self.params = params
        self.global_cache = GlobalSuffixCache(params.max_tree_depth, params.max_cached_requests,
                                              params.max_cached_bytes)
        self.samples: dict[str, _SampleState] = {}

    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        self.retire_finished()
        drafts = {}
        for _, sample, tokens in ctx.samples():
            if sample.is_finished:
                continue
            draft = self.propose_one(sample, sample.all_token_ids + tokens)
            if draft:
                drafts[sample.request_id] = draft
        return drafts

    def retire_finished(self) -> None:
        """Finished samples' outputs into the global tree; their own trees dropped."""
        done = [rid for rid, s in self.samples.items() if s.request.is_finished]
        for rid in done:
            state = self.samples.pop(rid)
            self.global_cache.add(state.request.draft_pool, list(state.request.output_token_ids))

    def propose_one(self, sample: Request, token_ids: list[int]) -> list[int]:
        """The draft after `token_ids` (the sample's prompt and output so far)."""
        return self.speculate(sample, token_ids)[0]

    def speculate(self, sample: Request, token_ids: list[int]) -> tuple[list[int], float]:
        """The draft after `token_ids` and its score: the tokens the trees expect of it
        to be accepted (the sum over its tokens of their empirical probabilities' running
        products), the best of the sample's own tree and its pool's global one."""
        p = self.params
        draft: list[int] = []
        score = 0.0
        for tree, cursor in self.matches(sample, token_ids):
            other, other_score = tree.speculate(cursor, p.num_speculative_tokens,
                                                p.max_spec_factor, p.min_token_prob)
            if other_score > score:
                draft, score = other, other_score
        return draft, score

    def matches(self, sample: Request, token_ids: list[int],
                ) -> list[tuple[SuffixTree, list[int]]]:
        """The trees a draft after `token_ids` may come from, each with its cursor there:
        the sample's own, then its draft pool's global tree if there is one."""
        state = self._sync(sample, token_ids)
        out = [(state.tree, state.cursor)]
        tree = self.global_cache.trees.get(sample.draft_pool)
        if tree is not None:
            out.append((tree, self._global_cursor(state, tree, token_ids)))
        return out

    def _sync(self, sample: Request, token_ids: list[int]) -> _SampleState:
        """The sample's state with every token of `token_ids` indexed. Tokens only ever
        get appended to a sample (a preempted one keeps its tokens), so its tree grows by
        the new ones; a new sample object under the id, or fewer tokens than indexed,
        starts a new tree."""
        state = self.samples.get(sample.request_id)
        if state is None or state.request is not sample or state.num_indexed > len(token_ids):
            # The prompt (and what came after it so far) indexed at once.
            tree = SuffixTree.from_sequence(token_ids, self.params.max_tree_depth)
            state = self.samples[sample.request_id] = _SampleState(
                sample, tree, tree.match(token_ids), len(token_ids))
        tree = state.tree
        for t in token_ids[state.num_indexed:]:
            state.cursor = tree.append(state.cursor, t)
        state.num_indexed = len(token_ids)
        return state

    def _global_cursor(self, state: _SampleState, tree: SuffixTree,
                       token_ids: list[int]) -> list[int]:
        """The global tree's cursor after `token_ids`: followed from the last step's by
        the new tokens while the tree is unchanged, else matched anew."""
        version = self.global_cache.version
        new = len(token_ids) - state.num_indexed_global if state.global_version == version \
            else -1
        if 0 <= new <= self.params.max_tree_depth:
            for t in token_ids[len(token_ids) - new:]:
                state.global_cursor = tree.follow(state.global_cursor, t)
        else:
            state.global_cursor = tree.match(token_ids[-self.params.max_tree_depth:])
        state.global_version = version
        state.num_indexed_global = len(token_ids)
        return state.global_cursor
