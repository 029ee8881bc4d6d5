"""The rejection sampler: which drafts a request keeps, and the token after them.

A request with k drafts d_1..d_k has k + 1 verified rows of logits: row j is the target's
next-token distribution p_j after the context and d_1..d_j, shaped by every sampling
parameter exactly as a one-token step there would be (the runner builds row j's
SamplingRow with d_1..d_j as output tokens, and the grammar bitmask row for that position).

    greedy:   keep d_j while d_j == argmax p_{j-1}; then emit argmax p_a (a = kept drafts)
    sampled:  keep d_j with probability min(1, p(d_j) / q(d_j)), q = the proposer's
              distribution (a point mass for n-gram and argmax drafts: q(d_j) = 1); at the
              first rejection emit a draw from max(p - q, 0) normalised (point mass: p with
              d_j removed); if all are kept emit a draw from p_k (the bonus token)

Either way the emitted tokens are distributed exactly as one-at-a-time sampling would give
(Leviathan et al. 2023; Chen et al. 2023). This is the path of unseeded requests (the
shared generator) and of trees. A seeded request's chain is drawn row by row instead
(worker/verify.py's seeded_chain_tokens: a draft is kept while the row's own draw equals
it), so its generator advances as without speculation and its tokens are the ones it gets
without drafts, whatever they were (suffix drafts come from other requests) and in any
batch. A seeded tree's uniforms and final draw come from its own generator in an order
fixed by its own drafts, so it too gives the same tokens in any batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aioengine.sample.ops import exponential_race


@dataclass
class VerifyRows:
    """One request's share of the verified rows."""

    first_row: int  # rows first_row .. first_row + len(draft_token_ids) of probs / argmax
    draft_token_ids: list[int]
    generator: torch.Generator | None = None  # None = the shared generator
    draft_probs: Tensor | None = None  # [k, V] the proposer's q, None = point masses


def accept_greedy(target_argmax: list[int], drafts: list[int], first_row: int) -> list[int]:
    """Greedy verification over the argmax of the processed logits of each verified row."""
    out = []
    for j, draft in enumerate(drafts):
        target = target_argmax[first_row + j]
        out.append(target)
        if draft != target:
            return out
    out.append(target_argmax[first_row + len(drafts)])  # every draft kept: the bonus token
    return out


def accept_sampled(probs: Tensor, rows: VerifyRows,
                   shared_generator: torch.Generator | None) -> list[int]:
    """Rejection sampling for one request; `probs` [R, V] are the exact target
    distributions of the step's verified rows (sample.compute_probs)."""
    k = len(rows.draft_token_ids)
    first = rows.first_row
    generator = rows.generator if rows.generator is not None else shared_generator
    drafts = torch.tensor(rows.draft_token_ids, dtype=torch.int64, device=probs.device)
    p_draft = probs[first:first + k].gather(1, drafts[:, None]).squeeze(1)
    # Always k uniforms and one final draw: the random stream depends on nothing else.
    uniforms = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)
    if rows.draft_probs is None:
        accepted = uniforms < p_draft
    else:
        q_draft = rows.draft_probs.gather(1, drafts[:, None]).squeeze(1)
        accepted = uniforms * q_draft < p_draft
    rejected = (~accepted).nonzero()
    num_kept = int(rejected[0]) if len(rejected) else k
    final = probs[first + num_kept].clone()
    if num_kept < k:  # the residual distribution at the first rejection
        if rows.draft_probs is None:
            final[rows.draft_token_ids[num_kept]] = 0.0
        else:
            final = (final - rows.draft_probs[num_kept]).clamp_(min=0.0)
    token = exponential_race(final[None], {0: generator} if rows.generator is not None else {},
                             shared_generator)
    return rows.draft_token_ids[:num_kept] + [int(token)]
