"""The model runner's outputs from host copies: sampled ids and logprobs of the plain
(non-speculative) rows of a step, per request, as ModelRunnerOutput holds them."""
from __future__ import annotations

import torch

from aioengine.sched.scheduler_output import ModelRunnerOutput, ScheduledRequest
from aioengine.outputs import Logprob, PositionLogprobs

# Sampled ids (and, when asked for, logprob ids, logprobs and ranks) of the plain rows of
# one step, with the items they belong to: turned into the output's lists by `read_plain`.
PlainSample = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                    list[ScheduledRequest]]


def to_position_logprobs(ids: torch.Tensor | None, lps: torch.Tensor | None,
                          ranks: torch.Tensor | None) -> list[PositionLogprobs] | None:
    """[N, K+1] tensors (chosen token first, then the top K) -> one dict per row."""
    if ids is None or lps is None or ranks is None:
        return None
    out = []
    for row_ids, row_lps, rank in zip(ids.tolist(), lps.tolist(), ranks.tolist()):
        entry = {row_ids[0]: Logprob(row_lps[0], rank)}
        for j, (tok, lp) in enumerate(zip(row_ids[1:], row_lps[1:])):
            entry.setdefault(tok, Logprob(lp, j + 1))
        out.append(entry)
    return out


def plain_tensors(sample: PlainSample) -> list[torch.Tensor]:
    sampled, lp, _ = sample
    return [sampled] if lp is None else [sampled, *lp]


def read_plain(plain: list[PlainSample], hosts: list[torch.Tensor],
                output: ModelRunnerOutput) -> ModelRunnerOutput:
    """Fills `output` from the host copies of each plain sample's tensors (in the order
    `plain_tensors` lists them)."""
    i = 0
    for _, lp, owners in plain:
        sampled = hosts[i].tolist()
        logprobs = to_position_logprobs(*hosts[i + 1:i + 4]) if lp is not None else None
        i += 1 if lp is None else 4
        r = 0
        for item in owners:
            rid = item.request.request_id
            n = item.num_samples
            output.sampled_token_ids[rid] = sampled[r:r + n]
            k = item.request.sampling_params.logprobs
            if k is not None and logprobs is not None:
                output.logprobs[rid] = [_top(entry, k) for entry in logprobs[r:r + n]]
            r += n
    return output


def _top(entry: PositionLogprobs, k: int) -> PositionLogprobs:
    """Keeps the chosen token (first key) and the k best alternatives."""
    items = list(entry.items())
    chosen, rest = items[0], sorted(items[1:], key=lambda kv: kv[1].rank)
    return dict([chosen] + [kv for kv in rest if kv[1].rank <= k])
