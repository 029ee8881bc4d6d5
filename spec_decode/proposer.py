"""The seam between the model runner and a draft proposer.

After sampling a step, the runner hands the proposer the step as it ran (a ProposeContext)
and gets back drafts for the next step: request_id -> up to k token ids, proposed as if
every sampled token is kept (the scheduler drops them otherwise). The runner knows nothing
of how drafts are made: n-gram lookup reads token ids, EAGLE runs its head over the
target's hidden states.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

from torch import Tensor

from aioengine.sched.scheduler_output import ScheduledRequest
from aioengine.model.attention import AttentionMetadata
from aioengine.request import Request
from aioengine.spec_decode.ngram import NgramLookup
from aioengine.spec_decode.tree import TreeConfig


@dataclass
class ProposeContext:
    scheduled: list[ScheduledRequest]
    sampled_token_ids: dict[str, list[int]]  # the runner's output for this step
    item_starts: list[int]  # item i's tokens are rows item_starts[i]:item_starts[i + 1]
    input_ids: Tensor  # [T] the step's tokens (drafts included)
    positions: Tensor  # [T]
    hidden: Tensor  # [T, H] the target's final-normed hidden states
    aux_hidden: Tensor | None  # [T, n * H] the target's auxiliary layers (EAGLE-3)
    attn_metadata: AttentionMetadata
    # Verified trees (spec_decode/tree.py): request_id -> its accepted nodes, root to leaf.
    accepted_tree_nodes: dict[str, list[int]] = field(default_factory=dict)

    def kept_rows(self, i: int, num_kept: int) -> list[int]:
        """Item i's first `num_kept` verified rows on the accepted path (step rows): a
        chain's are consecutive, a tree's the root and its accepted nodes."""
        start = self.item_starts[i]
        item = self.scheduled[i]
        if not item.is_tree:
            return list(range(start, start + num_kept))
        nodes = self.accepted_tree_nodes.get(item.request.request_id, [])
        return [start + row for row in ([0] + [n + 1 for n in nodes])[:num_kept]]

    def samples(self) -> list[tuple[int, Request, list[int]]]:
        """(item index, sample, the tokens just sampled for it) for every sample that got
        tokens this step; the forks of an n > 1 request each with their one token."""
        out = []
        for i, item in enumerate(self.scheduled):
            tokens = self.sampled_token_ids.get(item.request.request_id)
            if not tokens:
                continue
            if item.num_samples > 1:
                forks = item.request.pending_forks[:item.num_samples - 1]
                out.extend((i, s, [t]) for s, t in zip([item.request] + forks, tokens))
            else:
                out.append((i, item.request, tokens))
        return out


class Proposer(abc.ABC):
    # Tree drafting's shape (spec_decode/tree.py), None: this proposer drafts chains only.
    tree: TreeConfig | None = None

    @abc.abstractmethod
    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        """Drafts for the step after `ctx` (runs on the worker, after sampling)."""

    def tree_parents(self) -> dict[str, list[int]]:
        """Of the drafts `propose` just returned, those that form a tree: request_id ->
        each draft's parent (spec_decode/tree.py); the others are chains."""
        return {}

    def draft_methods(self) -> dict[str, str]:
        """Of the drafts `propose` just returned, which method made each (request_id ->
        a SpeculativeConfig.draft_methods name) where the proposer chooses among several;
        {}: all are the config's method."""
        return {}


class NgramProposer(Proposer):
    """Prompt lookup over each sample's own tokens (spec_decode/ngram.py)."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.lookup = NgramLookup(min_n, max_n, k)

    def propose(self, ctx: ProposeContext) -> dict[str, list[int]]:
        drafts = {}
        for _, sample, tokens in ctx.samples():
            draft = self.lookup.propose(sample.all_token_ids + tokens)
            if draft:
                drafts[sample.request_id] = draft
        return drafts
