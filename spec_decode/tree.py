"""Draft trees (EAGLE-2, SpecInfer): their shape, what the tree path supports, and their
verification.

A tree of N draft nodes is two lists: `tokens[i]` and `parents[i]` (-1: a child of the
root, the request's last committed token; else the index of an earlier node, so any prefix
of the lists is a tree too and the scheduler may trim it like a chain). A chain of k drafts
is the tree whose parents are [-1, 0, 1, ..., k - 2].

The target verifies the root and the N nodes in one step as N + 1 rows:

    row          0 (root)   1 + i (node i)
    position     c          c + depth(i)          c = the root's position
    KV slot of   c          c + 1 + i             (the request's own slots: no new blocks)
    attends to   0 .. c     0 .. c, then its ancestors and itself among the node slots

After verification the accepted path's nodes n_1..n_a (depth j at list index >= j - 1) have
their K/V copied from slot c + 1 + n_j to slot c + j, in order of j (a source is never an
earlier copy's destination), so the cache holds exactly the path at its positions; the
scheduler then counts c + 1 + a computed tokens as for a chain, and the slots past them
are rewritten later, like a chain's rejected ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioengine.request import Request
from aioengine.sample.ops import exponential_race


@dataclass(frozen=True)
class TreeConfig:
    """speculative_config["tree"]: EAGLE-2's dynamic tree (its `depth`, `top_k` and
    `total_token`, here `num_nodes` = total_token - 1, the root not counted)."""

    depth: int  # draft tokens on the longest path
    top_k: int  # children tried per expanded node, and nodes expanded per depth
    num_nodes: int  # draft nodes verified per request and step

    @property
    def num_head_rows(self) -> int:
        """Rows the head runs to expand the tree (top_k per depth below the last)."""
        return self.top_k * (self.depth - 1)


def supports_tree(request: Request) -> bool:
    """The one place that says which requests the tree path drafts for; the others get a
    chain (the tree's most likely path). The engine's features decide it at admission
    (EngineFeature.allows_tree_drafts: a grammar masks drafts as a chain, adapters run
    on the chain path)."""
    return request.allows_tree_drafts


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth (a child of the root: 1)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_attention_mask(parents: list[int], device: torch.device) -> Tensor:
    """[1 + N, N] bool: which node slots each verified row sees (row 0, the root: none;
    row 1 + i: node i's ancestors and itself)."""
    n = len(parents)
    mask = torch.zeros(n + 1, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i + 1] = mask[p + 1]
        mask[i + 1, i] = True
    return mask.to(device)


def node_index_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root: the nodes on it, itself last."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    return paths


def node_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each row's draft tokens before the token it predicts: [] for the root, node i's
    path from the root through node i (penalties and min_tokens count them)."""
    return [[]] + [[tokens[n] for n in path] for path in node_index_paths(parents)]


def _children(parents: list[int]) -> list[list[int]]:
    """children[r]: the nodes whose parent is row r (row 0 = the root), in list order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


@dataclass
class TreeVerdict:
    """One request's verified tree: the emitted tokens (the accepted nodes' tokens, then
    one sampled after them) and the accepted nodes (list indices, root to leaf)."""

    tokens: list[int]
    accepted_nodes: list[int]

    @property
    def rows(self) -> list[int]:
        """The verified rows (relative to the root's) the emitted tokens were sampled at."""
        return [0] + [n + 1 for n in self.accepted_nodes]


def verify_tree_greedy(argmax: list[int], first_row: int, tokens: list[int],
                       parents: list[int]) -> TreeVerdict:
    """Walks down from the root while a child holds the target's argmax at its parent."""
    children = _children(parents)
    accepted: list[int] = []
    row = 0
    while True:
        target = argmax[first_row + row]
        match = next((c for c in children[row] if tokens[c] == target), None)
        if match is None:
            return TreeVerdict([tokens[n] for n in accepted] + [target], accepted)
        accepted.append(match)
        row = match + 1


def verify_tree_sampled(probs: Tensor, first_row: int, tokens: list[int],
                        parents: list[int], generator: torch.Generator | None,
                        shared_generator: torch.Generator | None) -> TreeVerdict:
    """Recursive rejection sampling over point-mass candidates (SpecInfer, EAGLE-2): at a
    row with target distribution p, child c (tried in list order) is accepted with
    probability p(c) / (the mass p has left), else p(c) is removed from p; with every
    child rejected (or none) a token is drawn from what is left. Since the candidates are
    distinct tokens, each token comes out with probability exactly p(token): the emitted
    tokens are distributed as one-at-a-time sampling. The uniforms and the final draw come
    from `generator` when the request is seeded (None: the shared one); how many it draws
    depends only on the request's own tree and logits."""
    children = _children(parents)
    gen = generator if generator is not None else shared_generator
    accepted: list[int] = []
    row = 0
    while True:
        p = probs[first_row + row].clone()
        match = None
        for c in children[row]:
            left = p.sum()
            u = torch.rand((), generator=gen, device=p.device, dtype=p.dtype)
            if left > 0 and u * left < p[tokens[c]]:
                match = c
                break
            p[tokens[c]] = 0.0
        if match is None:
            token = exponential_race(p[None], {0: generator} if generator is not None else {},
                                     shared_generator)
            return TreeVerdict([tokens[n] for n in accepted] + [int(token)], accepted)
        accepted.append(match)
        row = match + 1


def accepted_slot_moves(accepted_nodes: list[int], root_position: int,
                        ) -> list[tuple[int, int]]:
    """(from position, to position) of each accepted node whose K/V is not yet at its
    path position, in the order to copy them."""
    moves = []
    for j, node in enumerate(accepted_nodes, start=1):
        src = root_position + 1 + node
        if src != root_position + j:
            moves.append((src, root_position + j))
    return moves
