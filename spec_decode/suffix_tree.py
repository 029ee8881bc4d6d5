"""A depth-limited suffix tree with counts (suffix decoding's index), array-backed.

Every suffix of every inserted sequence, cut at `max_depth` tokens, is a path from the
root; a node is one distinct substring of length <= max_depth and counts the suffixes
through it (its occurrences). So a node's child c's count over the node's count is the
empirical probability that c's token follows the node's substring:

    sequence  a b a b c        node "a b" (count 2) -> child "a b a" (1), "a b c" (1)

Storage: one int32 `array` per field (token, count, depth, best child, first child, next
sibling), indexed by node id, plus one dict for the whole tree mapping
(parent << 32 | token) to the child's id, and a free list of ids that eviction gave back.
`best[n]` is kept equal to n's most frequent child (ties to the lower token id) on every
insert and remove, so a greedy walk reads one array per step.

Sequences are inserted and removed token by token through a cursor: the nodes of the
suffixes ending at the last token, by depth (`cursor[j]` has depth j; cursor[0] is the
root). Inserting a token extends each of them by one edge: O(max_depth) per token.
"""
from __future__ import annotations

from array import array
from typing import Iterator, Sequence

import numpy as np

ROOT = 0
_NONE = -1
# Bytes a node costs on CPython: seven int32 fields, and its dict entry (a key above
# 2**30, a value and the table slot). Used to bound the global tree, not measured per tree.
BYTES_PER_NODE = 7 * 4 + 120


def _int32_array(values: np.ndarray) -> array:
    out = array("i")
    out.frombytes(values.astype(np.int32).tobytes())
    return out


def _edge(node: int, token: int) -> int:
    return (node << 32) | token


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.token = array("i", [_NONE])
        self.count = array("i", [0])
        self.depth = array("i", [0])
        self.parent = array("i", [_NONE])
        self.best = array("i", [_NONE])
        self.first_child = array("i", [_NONE])
        self.next_sibling = array("i", [_NONE])
        self.edges: dict[int, int] = {}
        self.free: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included."""
        return len(self.token) - len(self.free)

    @property
    def nbytes(self) -> int:
        return self.num_nodes * BYTES_PER_NODE

    def child(self, node: int, token: int) -> int:
        """`node`'s child by `token`, or -1."""
        return self.edges.get(_edge(node, token), _NONE)

    def children(self, node: int) -> Iterator[int]:
        """`node`'s children's ids."""
        c = self.first_child[node]
        while c != _NONE:
            yield c
            c = self.next_sibling[c]

    @classmethod
    def from_sequence(cls, tokens: Sequence[int], max_depth: int) -> SuffixTree:
        """The tree `insert(tokens)` builds in an empty tree, built with numpy (a prompt is
        indexed at once): the windows tokens[i:i + max_depth] sorted, a node is a run of
        windows sharing its first d tokens (its count the run's length), its parent the
        run of d - 1 tokens around it. Children come out sorted by token."""
        tree = cls(max_depth)
        x = np.asarray(tokens, dtype=np.int64)
        n = len(x)
        if n == 0:
            return tree
        windows = np.full((n, max_depth), -1, dtype=np.int64)  # -1 past the end
        for j in range(min(max_depth, n)):
            windows[:n - j, j] = x[j:]
        lengths = np.minimum(max_depth, n - np.arange(n))
        order = np.lexsort(windows.T[::-1])
        w, lengths = windows[order], lengths[order]
        lcp = np.zeros(n, dtype=np.int64)  # shared leading tokens with the row before
        lcp[1:] = np.cumprod(w[1:] == w[:-1], axis=1).sum(axis=1)
        lcp[1:] = np.minimum(lcp[1:], np.minimum(lengths[1:], lengths[:-1]))
        parents, toks, counts = [], [], []
        prev_bounds, prev_ids, next_id = np.array([0]), np.array([ROOT]), 1
        for d in range(1, max_depth + 1):
            bounds = np.flatnonzero(lcp < d)  # runs of rows sharing d tokens start here
            sizes = np.diff(np.append(bounds, n))
            keep = lengths[bounds] >= d
            starts = bounds[keep]
            if not len(starts):
                break
            ids = np.arange(next_id, next_id + len(starts))
            parents.append(prev_ids[np.searchsorted(prev_bounds, starts, side="right") - 1])
            toks.append(w[starts, d - 1])
            counts.append(sizes[keep])
            prev_bounds, prev_ids, next_id = starts, ids, next_id + len(starts)
        tree._fill(np.concatenate(parents), np.concatenate(toks), np.concatenate(counts),
                   np.repeat(np.arange(1, len(parents) + 1), [len(p) for p in parents]))
        return tree

    def _fill(self, parent: np.ndarray, token: np.ndarray, count: np.ndarray,
              depth: np.ndarray) -> None:
        """Nodes 1.. of an empty tree from their fields; node ids grouped by parent, in
        token order within a parent (as from_sequence makes them)."""
        num = len(parent) + 1
        ids = np.arange(1, num)
        same = np.append(parent[1:] == parent[:-1], False)  # the next node is a sibling
        next_sibling = np.where(same, ids + 1, _NONE)
        first_child = np.full(num, _NONE, dtype=np.int64)
        group_start = np.append(True, ~same[:-1])
        first_child[parent[group_start]] = ids[group_start]
        best = np.full(num, _NONE, dtype=np.int64)
        by_count = np.lexsort((ids, -count, parent))  # per parent: most frequent first
        firsts = by_count[np.append(True, parent[by_count][1:] != parent[by_count][:-1])]
        best[parent[firsts]] = ids[firsts]
        lead = np.array([_NONE])
        self.token = _int32_array(np.concatenate([lead, token]))
        self.count = _int32_array(np.concatenate([[0], count]))
        self.depth = _int32_array(np.concatenate([[0], depth]))
        self.parent = _int32_array(np.concatenate([lead, parent]))
        self.best = _int32_array(best)
        self.first_child = _int32_array(first_child)
        self.next_sibling = _int32_array(np.concatenate([lead, next_sibling]))
        self.edges = dict(zip(((parent << 32) | token).tolist(), ids.tolist()))

    # ---- insert ---------------------------------------------------------------------

    def insert(self, tokens: Sequence[int]) -> None:
        """Adds every suffix of `tokens` (up to max_depth tokens each)."""
        cursor = [ROOT]
        for t in tokens:
            cursor = self.append(cursor, t)

    def append(self, cursor: list[int], token: int) -> list[int]:
        """The sequence whose suffixes end at `cursor` grows by `token`: each of those
        suffixes (and the empty one) gains an occurrence followed by `token`. Returns the
        new cursor."""
        new = [ROOT]
        max_depth, edges, count, best, depth = (self.max_depth, self.edges, self.count,
                                                self.best, self.depth)
        for node in cursor:
            if depth[node] >= max_depth:
                break
            c = edges.get((node << 32) | token, _NONE)
            if c == _NONE:
                c = self._new_child(node, token)
            count[c] += 1
            b = best[node]
            if b != c and (b == _NONE or self._beats(c, b)):
                best[node] = c
            new.append(c)
        return new

    def _new_child(self, node: int, token: int) -> int:
        if self.free:
            c = self.free.pop()
            self.token[c], self.count[c], self.depth[c] = token, 0, self.depth[node] + 1
            self.parent[c], self.best[c], self.first_child[c] = node, _NONE, _NONE
        else:
            c = len(self.token)
            self.token.append(token)
            self.count.append(0)
            self.depth.append(self.depth[node] + 1)
            self.parent.append(node)
            self.best.append(_NONE)
            self.first_child.append(_NONE)
            self.next_sibling.append(_NONE)
        self.next_sibling[c] = self.first_child[node]
        self.first_child[node] = c
        self.edges[_edge(node, token)] = c
        return c

    def _beats(self, a: int, b: int) -> bool:
        """Child a is more frequent than child b (ties: the lower token)."""
        ca, cb = self.count[a], self.count[b]
        return ca > cb or (ca == cb and self.token[a] < self.token[b])

    # ---- remove ---------------------------------------------------------------------

    def remove(self, tokens: Sequence[int]) -> None:
        """Takes back one earlier `insert(tokens)`: its occurrences leave every node,
        nodes left with none are freed, best children recomputed."""
        cursor = [ROOT]
        emptied: list[int] = []
        touched: set[int] = set()
        max_depth = self.max_depth
        for t in tokens:
            new = [ROOT]
            for node in cursor:
                if self.depth[node] >= max_depth:
                    break
                c = self.edges[_edge(node, t)]
                self.count[c] -= 1
                if self.count[c] == 0:
                    emptied.append(c)
                touched.add(node)
                new.append(c)
            cursor = new
        # A parent empties before its children are reached, so nodes are freed only now.
        for c in emptied:
            self._unlink(c)
        dead = set(emptied)
        for node in touched:
            if node not in dead:
                self._recompute_best(node)

    def _unlink(self, c: int) -> None:
        parent = self.parent[c]
        del self.edges[_edge(parent, self.token[c])]
        prev, n = _NONE, self.first_child[parent]
        while n != c:
            prev, n = n, self.next_sibling[n]
        if prev == _NONE:
            self.first_child[parent] = self.next_sibling[c]
        else:
            self.next_sibling[prev] = self.next_sibling[c]
        self.count[c], self.best[c], self.token[c] = 0, _NONE, _NONE
        self.free.append(c)

    def _recompute_best(self, node: int) -> None:
        best, n = _NONE, self.first_child[node]
        while n != _NONE:
            if best == _NONE or self._beats(n, best):
                best = n
            n = self.next_sibling[n]
        self.best[node] = best

    # ---- lookup ---------------------------------------------------------------------

    def match(self, context: Sequence[int]) -> list[int]:
        """The nodes of `context`'s suffixes of length 1, 2, ... that occur, root first
        (a cursor): a suffix absent means every longer one is absent too."""
        cursor = [ROOT]
        n = len(context)
        for m in range(1, min(self.max_depth, n) + 1):
            node = ROOT
            for t in context[n - m:]:
                node = self.edges.get(_edge(node, t), _NONE)
                if node == _NONE:
                    return cursor
            cursor.append(node)
        return cursor

    def follow(self, cursor: list[int], token: int) -> list[int]:
        """The cursor after `token` without inserting it (lookups only)."""
        new = [ROOT]
        max_depth = self.max_depth
        for node in cursor:
            if self.depth[node] >= max_depth:
                break
            c = self.edges.get(_edge(node, token), _NONE)
            if c == _NONE:
                break
            new.append(c)
        return new

    def walk(self, node: int, max_tokens: int, min_token_prob: float,
             ) -> tuple[list[int], float]:
        """From `node`, the most frequent child while the running product of child count
        over parent count stays >= min_token_prob: (tokens, score), the score being the
        sum of those products (the expected number of them a verifier keeps)."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        best, count, token = self.best, self.count, self.token
        while len(tokens) < max_tokens:
            c = best[node]
            if c == _NONE:
                break
            prob *= count[c] / count[node]
            if prob < min_token_prob:
                break
            tokens.append(token[c])
            score += prob
            node = c
        return tokens, score

    def speculate(self, cursor: list[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """The best-scored walk from any matched suffix in `cursor` (cursor[m] matches m
        tokens), each allowed min(max_tokens, max_spec_factor * m) tokens; ties go to the
        longer match."""
        best_tokens: list[int] = []
        best_score = 0.0
        for m in range(len(cursor) - 1, 0, -1):
            limit = min(max_tokens, int(m * max_spec_factor + 1e-6))
            if limit <= best_score:  # a walk scores at most its length; limits shrink
                break
            tokens, score = self.walk(cursor[m], limit, min_token_prob)
            if score > best_score:
                best_tokens, best_score = tokens, score
        return best_tokens, best_score
