"""The sampler's vectorised logits transforms, in pipeline order.

All functions work on a whole batch and modify `logits` in place where they can (the
sampler owns its logits). Per-row behaviour comes from `[rows, 1]` columns whose
neutral values make a step a no-op for rows that do not use it.

    all rows:     logit_bias -> min_tokens -> repetition penalty -> frequency/presence
    greedy rows:  argmax
    random rows:  temperature -> min_p -> top_k -> top_p -> exponential race
"""
from __future__ import annotations

import torch
from torch import Tensor

from aioengine.kernels import cpu as cpu_kernels
from aioengine.sample.metadata import LOGIT_BOUND, SamplingMetadata

NEG_INF = float("-inf")


def greedy_tokens(logits: Tensor) -> Tensor:
    """logits [N, V] -> [N] int64, each row's argmax (the first largest, a NaN the
    largest): the C kernel on the CPU, torch's argmax elsewhere, the same tokens."""
    tokens = cpu_kernels.argmax_rows(logits)
    return tokens if tokens is not None else logits.argmax(dim=1)


def apply_logits_processors(logits: Tensor, metadata: SamplingMetadata) -> Tensor:
    """Steps shared by greedy and random rows, all sparse edits of `[N, V]` logits."""
    if metadata.logit_bias is not None:
        bias = metadata.logit_bias
        logits.index_put_((bias.row_indices, bias.token_ids), bias.values, accumulate=True)
    if metadata.min_tokens_mask is not None:
        mask = metadata.min_tokens_mask
        position = (mask.row_indices, mask.token_ids)
        before = logits[position]
        logits.index_put_(position, mask.values)
        # A grammar that allows only stop tokens here (it has ended) wins over min_tokens:
        # a row the ban left without any token gets its stop tokens back (no sync).
        emptied = torch.isneginf(logits.amax(dim=-1))[mask.row_indices]
        logits.index_put_(position, torch.where(emptied, before, mask.values))
    if metadata.repetition_penalty is not None:
        # HF: a seen token's positive logit is divided by the factor, a negative one
        # multiplied, so a factor > 1 always makes it less likely.
        rep = metadata.repetition_penalty
        position = (rep.row_indices, rep.token_ids)
        seen = logits[position]
        # Clamped to +-LOGIT_BOUND so an extreme factor gives no inf (inf - inf = NaN
        # later); a masked -inf stays -inf.
        edited = torch.where(seen > 0, seen / rep.values, seen * rep.values)
        edited.clamp_(-LOGIT_BOUND, LOGIT_BOUND)
        logits[position] = torch.where(torch.isneginf(seen), seen, edited)
    if metadata.output_penalty is not None:
        out = metadata.output_penalty
        logits.index_put_((out.row_indices, out.token_ids), out.values, accumulate=True)
    return logits


def apply_temperature_min_p(logits: Tensor, temperature: Tensor | None,
                            log_min_p: Tensor | None) -> Tensor:
    """Scales by 1/temperature, then drops tokens with p < min_p * p_max.

    min_p is compared in log space: p_i / p_max = exp(l_i - l_max), so no softmax is
    needed; log(0) = -inf keeps every token.
    """
    if temperature is not None:
        logits.div_(temperature)
    if log_min_p is not None:
        threshold = logits.amax(dim=1, keepdim=True) + log_min_p
        logits.masked_fill_(logits < threshold, NEG_INF)
    return logits


def kth_largest(sorted_desc: Tensor, top_k: Tensor) -> Tensor:
    """`[rows, 1]` k-th largest value from descending values; -inf where top_k == 0 (off)."""
    kth = sorted_desc.gather(1, (top_k - 1).clamp(min=0, max=sorted_desc.shape[1] - 1))
    return kth.masked_fill_(top_k == 0, NEG_INF)


def mask_top_p(sorted_logits: Tensor, top_p: Tensor, log_norm: Tensor | None = None) -> Tensor:
    """Top-p on descending logits: a token stays iff the probability mass strictly before
    it is < p, so the first token always stays and the one that crosses p is kept.

    `log_norm` is the row's log normaliser when `sorted_logits` is only a slice of the
    distribution (default: normalise over the given values). Returns the cumulative mass
    at each position, so callers can check that the nucleus fits in the slice.
    """
    if log_norm is None:
        log_norm = sorted_logits.logsumexp(dim=1, keepdim=True)
    probs = (sorted_logits - log_norm).exp_()
    cumulative = probs.cumsum(dim=1)
    # Rows with top_p == 1 must keep everything, but rounding can push the running mass
    # to 1.0 before the tail ends: give them an unreachable threshold instead.
    threshold = top_p.masked_fill(top_p >= 1.0, float("inf"))
    sorted_logits.masked_fill_(cumulative - probs >= threshold, NEG_INF)
    return cumulative


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                      max_top_k: int) -> Tensor:
    """Top-k (ties at the k-th value stay), then top-p over the top-k-renormalised
    distribution, over the whole vocabulary. One `topk(max_top_k)` when only top-k is
    used (`max_top_k >= top_k` of every row, known without a device sync), a full sort
    when top-p is."""
    if top_p is None:
        if top_k is None:
            return logits
        top_values = logits.topk(max_top_k, dim=1).values
        return logits.masked_fill_(logits < kth_largest(top_values, top_k), NEG_INF)
    sorted_logits, order = logits.sort(dim=1, descending=True)
    if top_k is not None:
        sorted_logits.masked_fill_(sorted_logits < kth_largest(sorted_logits, top_k), NEG_INF)
    mask_top_p(sorted_logits, top_p)
    return logits.scatter_(1, order, sorted_logits)


def scratch(workspace: Tensor | None, like: Tensor) -> Tensor:
    """A tensor shaped like `like`, carved from `workspace` when it is big enough.

    Why: on CPU a fresh `[256, 49152]` float32 tensor (48 MB) comes from mmap and its
    page faults cost as much as an exp over it; a buffer reused across steps does not.
    Invariant: callers use one scratch at a time (the next call may overwrite it).
    """
    if workspace is not None and workspace.numel() >= like.numel():
        return workspace[:like.numel()].view(like.shape)
    return torch.empty_like(like)


def logsumexp(logits: Tensor, workspace: Tensor | None = None) -> Tensor:
    """`[rows, 1]` log normaliser of finite-max rows, with its `[rows, V]` temporary in
    `workspace` (torch.logsumexp allocates, which doubles its cost on CPU)."""
    row_max = logits.amax(dim=1, keepdim=True)
    shifted = torch.sub(logits, row_max, out=scratch(workspace, logits))
    return shifted.exp_().sum(dim=1, keepdim=True).log_().add_(row_max)


def unnormalized_probs_(logits: Tensor) -> Tensor:
    """exp(logits - row max), in place: proportional to softmax, one pass cheaper and
    with no new `[N, V]` allocation (the race does not need normalised rows)."""
    return logits.sub_(logits.amax(dim=1, keepdim=True)).exp_()


def exponential_race(probs: Tensor, generators: dict[int, torch.Generator],
                     shared_generator: torch.Generator | None,
                     workspace: Tensor | None = None) -> Tensor:
    """One token per row of `probs` (rows need not be normalised; consumed in place).

    argmax(p / E) with E ~ Exponential(1) i.i.d. picks token i with probability p_i /
    sum(p): min_j E_j / p_j lands on i w.p. p_i / sum(p). No cumulative sums and no
    device sync. E = -log(U), U ~ Uniform[0, 1): inversion, 4x faster than
    `exponential_` on CPU; U < 1 keeps E > 0, so p = 0 never yields 0/0 = NaN.

    Seeded rows draw their noise from their own generator only, so their tokens do not
    depend on the rest of the batch; the other rows share one draw. The noise lives in
    `workspace` (see `scratch`).
    """
    noise = scratch(workspace, probs)
    if len(generators) < probs.shape[0]:
        noise.uniform_(generator=shared_generator)
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    noise.log_().neg_()
    return greedy_tokens(probs.div_(noise))


def local_generators(generators: dict[int, torch.Generator],
                     rows: list[int]) -> dict[int, torch.Generator]:
    """Renumbers `generators` for the sub-batch `rows` (position j holds row rows[j])."""
    return {j: generators[row] for j, row in enumerate(rows) if row in generators}
