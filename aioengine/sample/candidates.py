"""Random sampling of the batch's random rows: top-candidate slices + the full path.

A full-vocabulary sort of `[256, 49152]` costs about a second on two CPU cores. But a
top-k row can only sample its top k tokens, and a top-p row usually only a few dozen
(SmolLM2 at T=0.7, p=0.9: median 2, max ~110). So rows with top-k/top-p first try a
`topk(size)` slice for each size in CANDIDATE_SIZES, and the race runs on the slice. A
top-p row whose nucleus does not fit (the slice's mass is below p) moves on to the next
size, then to the full path, so every path samples exactly the same distribution.

Which path a row takes depends only on its own params and logits, so a seeded row's
tokens stay independent of the rest of the batch.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from aioengine.sample.metadata import CANDIDATE_SIZES, SamplingMetadata
from aioengine.sample.ops import (
    NEG_INF,
    apply_temperature_min_p,
    apply_top_k_top_p,
    exponential_race,
    kth_largest,
    local_generators,
    logsumexp,
    mask_top_p,
    unnormalized_probs_,
)

# (rows, unnormalised probs over token_ids or, when None, over the vocabulary, token_ids)
RowGroup = tuple[list[int], Tensor, Tensor | None]


def _select(column: Tensor | None, values: list, neutral: object,
            rows: list[int]) -> Tensor | None:
    """The `rows` of a `[R, 1]` column, or None when all those rows are neutral (the
    Python copy `values` decides, so no sync); no copy when `rows` is every row."""
    if column is None or all(values[row] == neutral for row in rows):
        return None
    return _take(column, rows, len(values))


def _take(tensor: Tensor, rows: list[int], num_rows: int) -> Tensor:
    if len(rows) == num_rows:  # rows are sorted and distinct: this is every row, in order
        return tensor
    return tensor[torch.tensor(rows, dtype=torch.int64, device=tensor.device)]


def filter_candidates(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                      size: int, needs_full_norm: bool = True,
                      workspace: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The top `size` tokens of each row, with top-k/top-p applied on the slice.

    Returns (candidate logits, -inf where filtered out; candidate token ids; `fits`, a
    `[rows]` bool that is False where the top-p nucleus may extend past the slice, or
    None when every row fits by construction).
    Invariant: every row has 0 < top_k <= size, or top_k == 0 and top_p < 1.
    `needs_full_norm=False` promises every top-p row also has top-k (skips a full pass).
    """
    values, token_ids = logits.topk(min(size, logits.shape[1]), dim=1)
    if top_k is not None:
        values.masked_fill_(values < kth_largest(values, top_k), NEG_INF)
    if top_p is None:
        return values, token_ids, None
    # With top-k on, the whole renormalised distribution is inside the slice; without
    # it the normaliser is the full row's.
    log_norm = values.logsumexp(dim=1, keepdim=True)
    if needs_full_norm:
        full_norm = logsumexp(logits, workspace)
        log_norm = full_norm if top_k is None else torch.where(top_k > 0, log_norm, full_norm)
    cumulative = mask_top_p(values, top_p, log_norm)
    fits = cumulative[:, -1] >= top_p.squeeze(1)
    if top_k is not None:
        fits |= top_k.squeeze(1) > 0
    return values, token_ids, fits


def _candidate_groups(logits: Tensor, metadata: SamplingMetadata, pending: list[int],
                      workspace: Tensor | None) -> Iterator[RowGroup]:
    """Yields the slice groups; leaves in `pending` the rows that fit no slice."""
    num_rows = logits.shape[0]
    for size in CANDIDATE_SIZES:
        rows = [row for row in pending if metadata.top_k_list[row] <= size]
        if not rows:
            continue
        values, token_ids, fits = filter_candidates(
            _take(logits, rows, num_rows),
            _select(metadata.top_k, metadata.top_k_list, 0, rows),
            _select(metadata.top_p, metadata.top_p_list, 1.0, rows), size,
            needs_full_norm=any(metadata.top_k_list[row] == 0 for row in rows),
            workspace=workspace)
        if fits is not None:
            # The data-dependent branch (a sync): candidates are used on CPU only.
            fit_list = fits.tolist()
            if not all(fit_list):
                rows = [row for row, ok in zip(rows, fit_list) if ok]
                values, token_ids = values[fits], token_ids[fits]
        done = set(rows)
        pending[:] = [row for row in pending if row not in done]
        if rows:
            yield rows, unnormalized_probs_(values), token_ids


def random_row_distributions(logits: Tensor, metadata: SamplingMetadata,
                             workspace: Tensor | None = None) -> Iterator[RowGroup]:
    """Splits the `[R, V]` processed logits of the random rows (consumed) into groups.

    Yields `(rows, probs, token_ids)`: `probs[j]` is proportional to the distribution of
    random row `rows[j]` over `token_ids[j]` (a candidate slice) or, when `token_ids` is
    None, over the whole vocabulary. Every random row is in exactly one group.
    `workspace` is scratch space (see ops.scratch); a group's probs never live in it.
    """
    logits = apply_temperature_min_p(logits, metadata.temperature, metadata.log_min_p)
    pending = list(metadata.candidate_rows)
    yield from _candidate_groups(logits, metadata, pending, workspace)
    full_rows = sorted(metadata.full_rows + pending)
    if full_rows:
        sub = apply_top_k_top_p(
            _take(logits, full_rows, logits.shape[0]),
            _select(metadata.top_k, metadata.top_k_list, 0, full_rows),
            _select(metadata.top_p, metadata.top_p_list, 1.0, full_rows),
            max(metadata.top_k_list[row] for row in full_rows))
        yield full_rows, unnormalized_probs_(sub), None


def sample_random_rows(logits: Tensor, metadata: SamplingMetadata,
                       shared_generator: torch.Generator | None,
                       workspace: Tensor | None = None) -> Tensor:
    """`[R, V]` processed logits of the random rows -> `[R]` sampled token ids."""
    sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for rows, probs, token_ids in random_row_distributions(logits, metadata, workspace):
        choice = exponential_race(probs, local_generators(metadata.generators, rows),
                                  shared_generator, workspace)
        if token_ids is not None:
            choice = token_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
        sampled[torch.tensor(rows, device=logits.device)] = choice
    return sampled


def random_row_probs(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """`[R, V]` processed logits of the random rows -> the exact, normalised `[R, V]`
    distributions `sample_random_rows` draws from (for tests and a rejection sampler)."""
    probs = torch.zeros_like(logits)
    for rows, group_probs, token_ids in random_row_distributions(logits.clone(), metadata):
        group_probs = group_probs / group_probs.sum(dim=1, keepdim=True)
        if token_ids is not None:
            group_probs = torch.zeros(len(rows), logits.shape[1], dtype=group_probs.dtype,
                                      device=logits.device).scatter_(1, token_ids, group_probs)
        probs[torch.tensor(rows, device=logits.device)] = group_probs
    return probs
