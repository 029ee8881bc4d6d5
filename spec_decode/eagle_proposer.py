"""The EAGLE proposer: the draft head runs after every target step, on the worker.

EAGLE's row at position p reads the target's hidden state at p and the token at p + 1 and
predicts the token at p + 2. So after each step the head first catches up over the
positions whose target KV the step verified (one chunk per request, its own paged KV cache
in the same block tables, the next tokens shifted in), then drafts a chain:

    step rows     t_c  d_1  d_2        (d_1 kept, d_2 rejected; x sampled after d_1)
    head inputs   (h_c, d_1) (h_c+1, x)  -> draft 1 at the last row
    chain         (draft 1, head's own hidden) -> draft 2 -> ... -> draft k

Prompt chunks are caught up over too (their last next token is the next prompt token, or
the sampled one). Rows past the kept ones are dropped; their head KV slots, like the
target's, are rewritten by a later step before anything reads them. The chain writes the
head's KV a few positions past the step (the scheduler allocates num_speculative_tokens
lookahead slots for it). Drafts are the head's argmax (point masses for the rejection
sampler).

With a tree config (speculative_config["tree"]) the requests tree.supports_tree takes get
an EAGLE-2 tree instead (eagle_tree.py; its parents through Proposer.tree_parents), the
others a chain of `depth` drafts. After a tree step the kept rows are the root's and the
accepted nodes' (ProposeContext.kept_rows), at consecutive positions like a chain's.
"""
from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from aioengine.model.attention import build_attention_metadata
from aioengine.request import Request
from aioengine.spec_decode.eagle import EagleHead
from aioengine.spec_decode.eagle_tree import draft_trees, num_head_scratch_blocks
from aioengine.spec_decode.proposer import ProposeContext, Proposer
from aioengine.spec_decode.tree import TreeConfig, supports_tree


class EagleProposer(Proposer):
    def __init__(self, head: EagleHead, target: torch.nn.Module, k: int, num_blocks: int,
                 block_size: int, tree: TreeConfig | None = None) -> None:
        self.head = head
        self.target = target  # its embedding and LM head are shared with the head
        self.k = k
        self.block_size = block_size
        # Past the pool's blocks: scratch for the C attention's tree rows (eagle_tree.py).
        scratch = num_head_scratch_blocks(tree, block_size)
        self.tree_scratch_blocks = list(range(num_blocks, num_blocks + scratch))
        self.kv_cache = head.make_kv_cache(num_blocks + scratch, block_size)
        # EAGLE-3 reads the target's auxiliary layers, EAGLE-1 its final hidden states.
        self.uses_aux = head.method == "eagle3" and bool(head.aux_layer_ids)
        # Tree drafting (eagle_tree.py) for the requests tree.supports_tree takes; None: chains.
        self.tree = tree
        # The last propose's tree drafts' parents (Proposer.tree_parents).
        self._tree_parents: dict[str, list[int]] = {}

    def tree_parents(self) -> dict[str, list[int]]:
        return self._tree_parents

    @torch.inference_mode()
    def propose(self, ctx: ProposeContext, drafting_ids: Collection[str] | None = None,
                skip_ids: Collection[str] = ()) -> dict[str, list[int]]:
        """Catches the head up over the step's items and drafts for the requests in
        `drafting_ids` (None: all). A caller that takes other drafts (spec_decode/auto.py)
        skips a request's chain, and with `skip_ids` its catch-up too: the head's KV then
        misses those positions, which costs its later drafts acceptance, never
        correctness."""
        rows: list[int] = []  # step rows the head catches up over
        next_ids: list[int] = []  # the token after each of them
        query_lens, seq_lens, tables = [], [], []
        drafting: list[tuple[Request, int, list[int]]] = []  # (request, its last row, table)
        for i, item in enumerate(ctx.scheduled):
            request = item.request
            # A pooling request never drafts, and its last chunk has no next token.
            if request.request_id in skip_ids or request.is_pooling:
                continue
            start, end = ctx.item_starts[i], ctx.item_starts[i + 1]
            sampled = ctx.sampled_token_ids.get(request.request_id)
            step_ids = ctx.input_ids[start:end].tolist()
            if item.spec_token_ids:  # the kept positions: t_c and the accepted drafts
                n, after = len(sampled), sampled
                kept = ctx.kept_rows(i, n)
            else:
                if sampled:  # a decode or a prompt's last chunk: the (first) sampled token
                    n, after = end - start, step_ids[1:] + sampled[:1]
                else:  # a prompt chunk: the next prompt token
                    n = end - start
                    after = step_ids[1:] + [
                        request.all_token_ids[item.num_computed_tokens + n]]
                kept = list(range(start, start + n))
            rows.extend(kept)
            next_ids.extend(after[:n])
            query_lens.append(n)
            seq_lens.append(item.num_computed_tokens + n)
            tables.append(item.block_ids)
            if sampled and not request.is_finished and (
                    drafting_ids is None or request.request_id in drafting_ids):
                drafting.append((request, len(rows) - 1, item.block_ids))
        self._tree_parents = {}
        if not rows:  # every item skipped
            return {}
        logits_hidden, next_hidden, positions = self._catch_up(
            ctx, rows, next_ids, query_lens, seq_lens, tables)
        if not drafting:
            return {}
        trees, chains = self._split(drafting, positions)
        drafts = self._draft_chains(chains, logits_hidden, next_hidden, positions)
        if trees:
            last = torch.tensor([r for _, r, _ in trees], device=logits_hidden.device)
            assert self.tree is not None
            for (request, _, _), tree in zip(trees, draft_trees(
                    self.head, self.target, self.kv_cache, self.tree, logits_hidden[last],
                    next_hidden[last], positions[last], [t for _, _, t in trees],
                    self.block_size, self.tree_scratch_blocks)):
                drafts[request.request_id] = tree.tokens
                self._tree_parents[request.request_id] = tree.parents
        return drafts

    def _split(self, drafting: list[tuple[Request, int, list[int]]], positions: Tensor,
               ) -> tuple[list, list]:
        """(tree requests, chain requests): trees for those tree.supports_tree takes whose
        slots hold the head's tree rows (from the root's position on)."""
        if self.tree is None:
            return [], drafting
        trees, chains = [], []
        last = positions[[r for _, r, _ in drafting]].tolist()
        for entry, p in zip(drafting, last):
            request, _, table = entry
            fits = p + 1 + self.tree.num_head_rows <= len(table) * self.block_size
            (trees if fits and supports_tree(request) else chains).append(entry)
        return trees, chains

    def _draft_chains(self, drafting: list[tuple[Request, int, list[int]]],
                      logits_hidden: Tensor, next_hidden: Tensor, positions: Tensor,
                      ) -> dict[str, list[int]]:
        """A chain of k argmax drafts per request, from its last catch-up row."""
        if not drafting:
            return {}
        last = torch.tensor([r for _, r, _ in drafting], device=logits_hidden.device)
        draft = self.head.draft_argmax(logits_hidden[last], self.target.lm_head)
        hidden, pos = next_hidden[last], positions[last]
        drafts = [draft]
        tables = [t for _, _, t in drafting]
        capacity = torch.tensor([len(t) * self.block_size for t in tables], device=pos.device)
        for _ in range(self.k - 1):
            # A request whose slots end here (its last possible token) keeps rewriting its
            # last slot: drafts past it are cut by the scheduler anyway
            # (request_tokens.usable_drafts).
            pos = torch.minimum(pos + 1, capacity - 1)
            meta, _ = build_attention_metadata([1] * len(tables), (pos + 1).tolist(), tables,
                                               self.block_size, pos.device)
            logits_hidden, hidden = self.head(drafts[-1], hidden, pos, self.kv_cache, meta,
                                              self.target.embed_tokens)
            drafts.append(self.head.draft_argmax(logits_hidden, self.target.lm_head))
        out = torch.stack(drafts, dim=1).tolist()
        return {request.request_id: tokens for (request, _, _), tokens in zip(drafting, out)}

    def _catch_up(self, ctx: ProposeContext, rows: list[int], next_ids: list[int],
                  query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """The head over the step's kept rows: writes its KV there; returns its outputs and
        the rows' positions."""
        device = ctx.hidden.device
        index = torch.tensor(rows, device=device)
        source = ctx.aux_hidden if self.uses_aux else ctx.hidden
        assert source is not None, "EAGLE-3 needs the target's auxiliary hidden states"
        meta, positions = build_attention_metadata(query_lens, seq_lens, tables,
                                                   self.block_size, device)
        ids = torch.tensor(next_ids, dtype=torch.long, device=device)
        logits_hidden, next_hidden = self.head(ids, source[index], positions, self.kv_cache,
                                               meta, self.target.embed_tokens)
        return logits_hidden, next_hidden, positions
