"""What the scheduler does with a request's new tokens once a step has sampled them: the
features' forced tokens (a grammar's jump-forward), the stop checks, and which of the
runner's drafts the next step may verify; a pooling request's chunk folded into its vector."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from aioengine.config import SchedulerConfig
from aioengine.sched.scheduler_output import EngineCoreOutput
from aioengine.engine.features import EngineFeature
from aioengine.request import Request, RequestStatus

if TYPE_CHECKING:
    import torch


def usable_drafts(request: Request, drafts: list[int], features: Sequence[EngineFeature],
                  config: SchedulerConfig) -> list[int]:
    """The drafts that can matter next step: no more than the tokens the request may
    still produce after the one the step samples anyway, and, under a grammar, the
    prefix the matcher accepts."""
    params = request.sampling_params
    left = min((params.max_tokens or 0) - request.num_output_tokens,
               config.max_model_len - request.num_tokens)
    # Never more than a step can hold, so a seeded request always gets all its drafts
    # in some step (schedule() trims none of them for it).
    room = min(left - 1, config.max_num_batched_tokens - 1)
    drafts = drafts[:max(room, 0)]
    for feature in features:
        if drafts:
            drafts = feature.usable_drafts(request, drafts, left)
    return drafts


def forced_tokens(request: Request, token: int, features: Sequence[EngineFeature],
                  config: SchedulerConfig) -> list[int]:
    """The features' forced_tokens after `token` (a grammar's jump-forward), appended
    to the request and returned: never past max_tokens / max_model_len, never after a
    stop token."""
    params = request.sampling_params
    stops = (request.num_output_tokens >= params.min_tokens
             and token in params.all_stop_token_ids)
    room = 0 if stops else min((params.max_tokens or 0) - request.num_output_tokens,
                               config.max_model_len - request.num_tokens)
    extra: list[int] = []
    for feature in features:
        extra += feature.forced_tokens(request, token, room - len(extra))
    request.append_output_token_ids(extra)
    return extra


def check_stop(request: Request, max_model_len: int) -> None:
    """Ends the request (its status) on a stop token, max_tokens or the context's end."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens and token in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = token if token in params.stop_token_ids else None
    elif (request.num_output_tokens >= (params.max_tokens or 0)
          or request.num_tokens >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH


def draws_own_noise(request: Request) -> bool:
    """A seeded sampled request: its tokens depend only on its seed and logits."""
    params = request.sampling_params
    return params.seed is not None and not params.greedy


def pool_chunk(request: Request, share: torch.Tensor | None) -> torch.Tensor | None:
    """Folds a pooling request's chunk into its vector; once its prompt is computed,
    ends it (FINISHED_STOPPED: the scheduler's update frees its blocks) and returns the
    pooled vector."""
    assert request.pooling_state is not None
    request.pooling_state.add(share)
    if request.num_computed_tokens < request.num_prompt_tokens:
        return None
    request.status = RequestStatus.FINISHED_STOPPED
    return request.pooling_state.finish(request.num_prompt_tokens)

def append_run(request: Request, tokens: list[int], features: Sequence[EngineFeature],
               config: SchedulerConfig, logprobs: list | None, prompt_lps: list | None,
               drafts: list[int] | None, tree_parents: list[int] | None = None,
               draft_method: str = "") -> EngineCoreOutput:
    """Appends `tokens` (sampled in one step for `request`, each after the one before)
    until one ends the request or brings jump-forward tokens; takes the drafts the
    runner proposed after them only if every token was kept."""
    new_token_ids: list[int] = []
    kept = 0
    for token in tokens:
        if kept:
            request.num_computed_tokens += 1  # the previous token's KV is now verified
        kept += 1
        request.append_output_token_ids([token])
        new_token_ids.append(token)
        extra = forced_tokens(request, token, features, config)
        new_token_ids += extra
        if not request.is_finished:
            check_stop(request, config.max_model_len)
        if request.is_finished or extra:
            break
    if drafts and kept == len(tokens) and not request.is_finished and not extra:
        request.spec_token_ids = usable_drafts(request, drafts, features, config)
        # A tree's drafts are listed parents first: a prefix of them is a tree.
        request.spec_tree_parents = (tree_parents[:len(request.spec_token_ids)]
                                     if tree_parents is not None else None)
        request.spec_method = draft_method
    return EngineCoreOutput(request, new_token_ids,
                            new_logprobs=logprobs[:kept] if logprobs else None,
                            prompt_logprobs=prompt_lps)
