"""The runner's part of speculative decoding (spec_decode/step.py says why it has two):
DraftVerifier lays out a step's draft rows, verifies them after the forward (each item
with drafts, a chain or a tree: spec_decode/tree.py, turns its verified rows of logits
into the tokens it keeps) and has the proposer draft the next step's tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aioengine.model.attention import AttentionMetadata
from aioengine.sched.scheduler_output import ModelRunnerOutput, ScheduledRequest
from aioengine.sample import (Sampler, SamplingMetadata, SamplingRow, compute_probs,
                              gather_logprobs, greedy_tokens, is_plain_greedy)
from aioengine.sample.ops import apply_logits_processors
from aioengine.spec_decode.proposer import ProposeContext, Proposer
from aioengine.spec_decode.rejection_sampler import VerifyRows, accept_greedy, accept_sampled
from aioengine.spec_decode.tree import node_paths, verify_tree_greedy, verify_tree_sampled
from aioengine.worker.runner_outputs import to_position_logprobs
from aioengine.worker.spec_tree import apply_tree_layout, move_accepted_kv

# The runner's sampling of plain rows: (logits, rows, their items, output, masked).
SamplePlain = Callable[[torch.Tensor, list[SamplingRow], list[ScheduledRequest],
                        ModelRunnerOutput, bool], None]


@dataclass
class DraftVerifyContext:
    """What verification needs from the runner."""

    vocab_size: int
    device: torch.device
    shared_generator: torch.Generator  # unseeded requests' draws
    kv_caches: list[torch.Tensor]  # a tree's accepted nodes' K/V are moved in them
    block_size: int


class DraftVerifier:
    """The runner's part of speculative decoding, on the worker thread: the proposer, the
    scratch blocks past the pool's for the C kernel's tree rows (worker/spec_tree.py), and
    what verification reads of the runner (`ctx`). The runner holds one only with a
    proposer (None: no drafts, one check a step)."""

    def __init__(self, proposer: Proposer, ctx: DraftVerifyContext,
                 tree_scratch_blocks: list[int]) -> None:
        self.proposer = proposer
        self.ctx = ctx
        self.tree_scratch_blocks = tree_scratch_blocks

    def lay_out(self, scheduled: list[ScheduledRequest], item_starts: list[int],
                meta: AttentionMetadata, positions: torch.Tensor) -> torch.Tensor:
        """The step's positions with tree items' rows at their depths (their masks and
        kernel rows set in `meta`); `positions` itself when the step has no tree."""
        return apply_tree_layout(scheduled, item_starts, meta, positions,
                                 self.tree_scratch_blocks, self.ctx.block_size)

    @staticmethod
    def draft_paths(item: ScheduledRequest) -> list[list[int]]:
        """An item with drafts samples at each of its 1 + len(drafts) rows: row j's target
        distribution follows the drafts of path j (a chain's first j; a tree's root, then
        each node's path)."""
        drafts = item.spec_token_ids
        if item.is_tree:
            return node_paths(drafts, item.spec_tree_parents)
        return [drafts[:j] for j in range(len(drafts) + 1)]

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               owners: list[ScheduledRequest], output: ModelRunnerOutput,
               sample_plain: SamplePlain) -> None:
        """A step's sampled rows (`owners`' rows, in order) when some items carry drafts:
        the others' rows through `sample_plain` first (the shared generator is drawn
        from in that order), then the drafts' verification."""
        plain_rows: list[int] = []
        verify_rows: list[int] = []
        r = 0
        for item in owners:
            (verify_rows if item.spec_token_ids else plain_rows).extend(
                range(r, r + item.num_logits_rows))
            r += item.num_logits_rows
        if plain_rows:
            sample_plain(logits[plain_rows], [rows[i] for i in plain_rows],
                         [item for item in owners if not item.spec_token_ids], output, True)
        verify_drafts(logits[verify_rows], [rows[i] for i in verify_rows],
                      [item for item in owners if item.spec_token_ids], output, self.ctx)

    def propose(self, ctx: ProposeContext, output: ModelRunnerOutput) -> None:
        """The next step's drafts (and, of trees, their parents), into `output`."""
        output.spec_token_ids = self.proposer.propose(ctx)
        output.spec_tree_parents = self.proposer.tree_parents()
        output.spec_methods = self.proposer.draft_methods()


def verify_drafts(logits: torch.Tensor, rows: list[SamplingRow],
                  owners: list[ScheduledRequest], output: ModelRunnerOutput,
                  ctx: DraftVerifyContext) -> None:
    """Row j of a chain item is its target distribution after its first j drafts (of a
    tree item: row 0 the root's, row 1 + i after node i's path); the rejection sampler
    turns them into the tokens the item keeps, into `output`."""
    raw_logprobs = None
    if any(row.params.logprobs is not None for row in rows):
        raw_logprobs = torch.log_softmax(logits, dim=1)  # before any processor (vLLM)
    # Seeded sampled chains are drawn row by row from their unprocessed logits (kept before
    # compute_probs consumes them): seeded_chain_tokens.
    items = _item_rows(owners)
    seeded = {i: logits[r:r + item.num_logits_rows].clone()
              for i, (item, r) in enumerate(items) if _is_seeded_chain(item)}
    probs = None
    if all(is_plain_greedy(row) for row in rows):
        argmax = greedy_tokens(logits).tolist()
    else:
        metadata = SamplingMetadata.build(rows, ctx.vocab_size, ctx.device)
        probs = compute_probs(logits, metadata)  # one-hot for greedy rows
        argmax = probs.argmax(dim=1).tolist()
    for i, (item, r) in enumerate(items):
        request, params = item.request, item.request.sampling_params
        if i in seeded:
            tokens = seeded_chain_tokens(seeded[i], rows[r:r + item.num_logits_rows],
                                         item.spec_token_ids, ctx)
            emitted_rows = list(range(len(tokens)))
        else:
            tokens, emitted_rows = _accept(item, argmax, probs, r, ctx)
        output.sampled_token_ids[request.request_id] = tokens
        if item.is_tree:
            output.accepted_tree_nodes[request.request_id] = [n - 1 for n in emitted_rows[1:]]
        if params.logprobs is not None and raw_logprobs is not None:
            ids, lps, ranks = gather_logprobs(
                raw_logprobs[[r + row for row in emitted_rows]],
                torch.tensor(tokens, dtype=torch.long, device=ctx.device), params.logprobs)
            output.logprobs[request.request_id] = to_position_logprobs(ids, lps, ranks) or []


def _item_rows(owners: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int]]:
    """Each item with its first verified row."""
    out, r = [], 0
    for item in owners:
        out.append((item, r))
        r += len(item.spec_token_ids) + 1
    return out


def _is_seeded_chain(item: ScheduledRequest) -> bool:
    return (not item.is_tree and item.request.generator is not None
            and not item.request.sampling_params.greedy)


def seeded_chain_tokens(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[int],
                        ctx: DraftVerifyContext) -> list[int]:
    """A seeded sampled request's tokens from its verified rows, drawn as one-at-a-time
    sampling draws them: row j through the plain sampler (the request's own generator,
    one draw per emitted token), d_j kept while the draw equals it, the first draw that
    differs (or the bonus row's) emitted. Exact: each emitted token is a draw from its
    row's distribution, and a draft is kept with probability p(d_j), the point-mass
    rejection sampler's rate. Unlike accept_sampled's uniforms, the generator advances by
    the emitted tokens only, so the tokens are those of the same request without
    speculation, whatever the drafts (suffix decoding's come from other requests' outputs)
    and in any batch."""
    sampler = Sampler(ctx.shared_generator)  # (the row's own generator draws: no shared draw)
    for j in range(len(drafts) + 1):
        metadata = SamplingMetadata.build([rows[j]], ctx.vocab_size, ctx.device)
        processed = apply_logits_processors(logits[j:j + 1].float(), metadata)
        token = int(sampler.sample(processed, metadata)[0])
        if j == len(drafts) or token != drafts[j]:
            return drafts[:j] + [token]
    raise AssertionError("unreachable: the bonus row always emits")


def _accept(item: ScheduledRequest, argmax: list[int], probs: torch.Tensor | None,
            first_row: int, ctx: DraftVerifyContext) -> tuple[list[int], list[int]]:
    """One item's emitted tokens and the rows (from its first) each was sampled at. A
    tree's accepted nodes' K/V are moved to the path's slots here."""
    request, drafts = item.request, item.spec_token_ids
    greedy = probs is None or request.sampling_params.greedy
    if not item.is_tree:
        if greedy:
            tokens = accept_greedy(argmax, drafts, first_row)
        else:
            tokens = accept_sampled(probs, VerifyRows(first_row, drafts, request.generator),
                                    ctx.shared_generator)
        return tokens, list(range(len(tokens)))
    parents = item.spec_tree_parents
    assert parents is not None
    if greedy:
        verdict = verify_tree_greedy(argmax, first_row, drafts, parents)
    else:
        verdict = verify_tree_sampled(probs, first_row, drafts, parents, request.generator,
                                      ctx.shared_generator)
    move_accepted_kv(ctx.kv_caches, item, verdict.accepted_nodes, ctx.block_size)
    return verdict.tokens, verdict.rows
