"""EAGLE-2 dynamic tree drafting with an EAGLE head (Li et al. 2024, "EAGLE-2").

From the head's last catch-up row (position P - 1: it predicts the token at P + 1, after
the root x at P), for each request:

    depth 1   the top_k tokens of the head's distribution: the first nodes
    depth d   the top_k nodes of depth d (by score) are expanded: the head runs one row
              per node (its token, its parent row's next hidden state, position P - 2 + d)
              and each gets its top_k children; the top_k children (of top_k * top_k) by
              score are expanded next
    score     the product of draft probabilities along the node's path (summed logs)
    tree      the num_nodes best-scored nodes of all made, listed by score (a child never
              scores above its parent, and comes later on ties, so the list is parents
              first: spec_decode/tree.py)

The head's rows of depth d attend to the head's context (positions < P) and their
ancestors' rows: rows are stored in the request's own slots from P on (depth d's at
P + (d - 1) * top_k ...), with a tree mask (AttentionMetadata.tree_masks). Where the
proposer's scratch blocks suffice, each row also gets the C attention's table of its own
(AttentionMetadata.tree_kernel, as the target's tree rows: worker/spec_tree.py): the
context's tail and the row's ancestors copied into scratch blocks at positions P .. P + d - 1,
so the row attends exactly as the chain's head row at its position, and the fused head
step (eagle_fused.py) runs it. The next step's catch-up rewrites the head's KV at the kept
positions before anything reads them, as after a chain. A request whose slots cannot hold
the rows (its last tokens) is left to the chain.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from aioengine.model.attention import AttentionMetadata, build_attention_metadata
from aioengine.model.tree_attention import TreeKernelRows
from aioengine.spec_decode.eagle import EagleHead
from aioengine.spec_decode.tree import TreeConfig


# Tree requests per propose whose head rows the C attention (and the fused head step)
# takes: the scratch blocks are kept for this many (the target's TREE_KERNEL_MAX_REQUESTS,
# worker/spec_tree.py); beyond, the rows take torch SDPA through their masks.
HEAD_TREE_MAX_REQUESTS = 8


def num_head_scratch_blocks(config: TreeConfig | None, block_size: int) -> int:
    """Scratch blocks past the pool's in the head's cache: per head row of one depth (top_k
    per request), the context's tail (< one block) and its path (up to depth)."""
    if config is None:
        return 0
    per_row = -(-(block_size - 1 + config.depth) // block_size)
    return HEAD_TREE_MAX_REQUESTS * config.top_k * per_row


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]


@dataclass
class _Frontier:
    """The nodes expanded at one depth, top_k per request ([R, K] / [R, K, H])."""

    tokens: Tensor
    scores: Tensor
    hidden: Tensor  # the hidden state each node's head row reads (its parent row's output)
    pool_ids: Tensor  # the nodes' ids in the pool
    ancestors: Tensor  # [R, K, rows so far] bool: which earlier head rows are ancestors


def draft_trees(head: EagleHead, target: torch.nn.Module, kv_cache: Tensor,
                config: TreeConfig, logits_hidden: Tensor, next_hidden: Tensor,
                last_positions: Tensor, tables: list[list[int]], block_size: int,
                scratch_blocks: Sequence[int] = (),
                ) -> list[DraftTree]:
    """One tree per request (rows of the inputs: each request's last catch-up row);
    `scratch_blocks`: blocks of kv_cache past the pool's for the C attention's rows."""
    num_reqs, k = logits_hidden.shape[0], config.top_k
    logp, tokens = head.draft_topk(logits_hidden, target.lm_head, k)
    pool_tokens, pool_parents, pool_scores = [tokens], [torch.full_like(tokens, -1)], [logp]
    frontier = _Frontier(tokens, logp, next_hidden[:, None].expand(-1, k, -1),
                         torch.arange(k, device=tokens.device).expand(num_reqs, k),
                         torch.zeros(num_reqs, k, 0, dtype=torch.bool, device=tokens.device))
    num_pool = k
    for depth in range(1, config.depth):
        out_hidden, child_hidden = _expand(head, target, kv_cache, frontier, depth,
                                           last_positions, tables, block_size, scratch_blocks)
        child_logp, child_tokens = head.draft_topk(out_hidden, target.lm_head, k)
        scores = frontier.scores[:, :, None] + child_logp.view(num_reqs, k, k)  # [R, K, K]
        pool_tokens.append(child_tokens.view(num_reqs, k * k))
        pool_parents.append(frontier.pool_ids[:, :, None].expand(-1, -1, k).reshape(
            num_reqs, k * k))
        pool_scores.append(scores.view(num_reqs, k * k))
        if depth + 1 < config.depth:
            frontier = _next_frontier(frontier, scores, child_tokens, child_hidden, num_pool,
                                      depth)
        num_pool += k * k
    return _select(torch.cat(pool_tokens, 1), torch.cat(pool_parents, 1),
                   torch.cat(pool_scores, 1), config.num_nodes)


def _expand(head: EagleHead, target: torch.nn.Module, kv_cache: Tensor, frontier: _Frontier,
            depth: int, last_positions: Tensor, tables: list[list[int]], block_size: int,
            scratch_blocks: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The head's rows for the frontier of `depth` (stored from P + (depth - 1) * K)."""
    num_reqs, k = frontier.tokens.shape
    device = frontier.tokens.device
    first = (last_positions + 1).tolist()  # P: the first slot the head's tree rows use
    seq_lens = [p + depth * k for p in first]
    meta, _ = build_attention_metadata([k] * num_reqs, seq_lens, tables, block_size, device)
    own = torch.eye(k, dtype=torch.bool, device=device).expand(num_reqs, k, k)
    masks = torch.cat((frontier.ancestors, own), dim=2)  # [R, K, depth * K]
    meta.tree_masks = {r: masks[r] for r in range(num_reqs)}
    meta.tree_kernel = _kernel_rows(meta, masks, first, depth, tables, block_size,
                                    scratch_blocks)
    positions = (last_positions + depth).repeat_interleave(k)
    return head(frontier.tokens.reshape(-1), frontier.hidden.reshape(num_reqs * k, -1),
                positions, kv_cache, meta, target.embed_tokens)


def _kernel_rows(meta: AttentionMetadata, masks: Tensor, first: list[int], depth: int,
                 tables: list[list[int]], bs: int, scratch_blocks: Sequence[int],
                 ) -> TreeKernelRows | None:
    """Each head row's own table for the C attention: the request's blocks before the
    one holding position P, then scratch blocks holding positions from that block's start
    to P - 1 (copied from the request's slots), the row's ancestors and the row itself (P ..
    P + depth - 1, one per depth); seq_len P + depth. None when the scratch blocks do not
    suffice (the rows then take torch SDPA through the masks)."""
    free = list(reversed(scratch_blocks))
    src: list[int] = []
    dst: list[int] = []
    extra: list[list[int]] = []
    seq_lens: list[int] = []
    ancestors = masks.cpu().tolist()  # [R, K, depth * K]: the rows each row sees
    for r, (p, table) in enumerate(zip(first, tables)):
        b0 = p // bs
        for seen in ancestors[r]:
            count = -(-(p + depth - b0 * bs) // bs)
            if len(free) < count:
                return None
            blocks = [free.pop() for _ in range(count)]
            positions = list(range(b0 * bs, p)) + [p + i for i, s in enumerate(seen) if s]
            for n, position in enumerate(positions):
                src.append(table[position // bs] * bs + position % bs)
                dst.append(blocks[n // bs] * bs + n % bs)
            extra.append(table[:b0] + blocks)
            seq_lens.append(p + depth)
    width = max(meta.block_tables.shape[1], max(len(t) for t in extra))
    rows = torch.tensor([t + [0] * (width - len(t)) for t in extra], dtype=torch.int32)
    device = meta.block_tables.device
    return TreeKernelRows(
        block_tables=rows, row_to_req=torch.arange(len(extra), dtype=torch.int32),
        row_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        src_slots=torch.tensor(src, dtype=torch.long, device=device),
        dst_slots=torch.tensor(dst, dtype=torch.long, device=device))


def _next_frontier(frontier: _Frontier, scores: Tensor, child_tokens: Tensor,
                   child_hidden: Tensor, num_pool: int, depth: int) -> _Frontier:
    """The top_k children (of the frontier's top_k * top_k) by score."""
    num_reqs, k = frontier.tokens.shape
    best = scores.view(num_reqs, k * k).topk(k, dim=1)
    parent = best.indices // k  # the frontier node (and head row of this depth) it hangs on
    rows = torch.arange(num_reqs, device=parent.device)[:, None]
    own_row = torch.nn.functional.one_hot(parent, k).bool()  # [R, K, K]: its parent's row
    return _Frontier(
        tokens=child_tokens.view(num_reqs, k * k)[rows, best.indices],
        scores=best.values,
        hidden=child_hidden.view(num_reqs, k, -1)[rows, parent],
        pool_ids=num_pool + best.indices,
        ancestors=torch.cat((frontier.ancestors[rows, parent], own_row), dim=2))


def _select(tokens: Tensor, parents: Tensor, scores: Tensor, num_nodes: int,
            ) -> list[DraftTree]:
    """The num_nodes best nodes of each request's pool, best first (ties: the earlier
    made, so parents come before their children), parents renumbered."""
    trees = []
    for toks, pars, scs in zip(tokens.tolist(), parents.tolist(), scores.tolist()):
        order = sorted(range(len(toks)), key=lambda i: (-scs[i], i))[:num_nodes]
        index = {node: n for n, node in enumerate(order)}
        trees.append(DraftTree([toks[i] for i in order],
                               [-1 if pars[i] < 0 else index[pars[i]] for i in order]))
    return trees
