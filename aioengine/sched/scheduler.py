"""The token-budget scheduler (vLLM v1's single rule).

There are no prefill or decode phases. Every running request has `num_computed_tokens`
that catches up with `num_tokens`; a step hands out `{request_id: num_new_tokens}` under
`max_num_batched_tokens` and `max_num_seqs`. A long prompt is thereby chunked and mixed
with the decodes of other requests, a prefix-cache hit just starts `num_computed_tokens`
further along, and a preempted request is recomputed the same way.

    running requests first (they already hold blocks), then waiting ones (FCFS/priority):

    request  |<---- num_computed_tokens ---->|<-- num_new_tokens -->|... num_tokens
             |  KV in cache (or cache hits)   |  computed this step  |
"""
from __future__ import annotations

import bisect
import time
from typing import Iterable, Sequence

from aioengine.config import SchedulerConfig
from aioengine.sched.chunking import PrefillChunker
from aioengine.kv.kv_cache_groups import GroupedKVCacheManager
from aioengine.kv.kv_cache_manager import KVCacheManager
from aioengine.sched.request_tokens import append_run, pool_chunk
from aioengine.sched.scheduler_output import (EngineCoreOutput, ModelRunnerOutput,
                                             ScheduledRequest, SchedulerOutput)
from aioengine.sched.spec_stats import SpecDecodingStats
from aioengine.spec_decode.step import DraftScheduling
from aioengine.engine.features import AdmissionFailed, EngineFeature
from aioengine.pooling_params import PoolingState
from aioengine.request import Request, RequestStatus


class Scheduler:
    """The synchronous scheduler: one step at a time, each after the update of the one
    before (AsyncScheduler, in sched/async_scheduler.py, also schedules ahead).

    The engine's features (structured output, LoRA) take part through their scheduler
    hooks (aioengine.engine.features): which waiting requests may be admitted, which may
    be scheduled ahead, the tokens they force after a sampled one, the drafts kept."""

    def __init__(self, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManager | GroupedKVCacheManager,
                 features: Sequence[EngineFeature] = (),
                 spec_stats: SpecDecodingStats | None = None) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.features = tuple(features)
        self.waiting: list[Request] = []  # kept in policy order; index 0 is next
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests the scheduler itself failed (they can never fit); drained by the engine.
        self.newly_failed: list[Request] = []
        self.num_steps = 0
        self.num_steps_ahead = 0  # of them, scheduled ahead (schedule_ahead)
        # Fair prefill: how many tokens a request computes in a step (sched/chunking.py).
        self._chunker = PrefillChunker(config, kv_cache_manager.sliding_window)
        # Speculative decoding's part in the step (spec_decode/step.py): drafts in the
        # budget, their lookahead slots, and the counters EngineCore.spec_decode reports
        # (`spec_stats`). None: no drafts.
        self.spec_decode = DraftScheduling.from_config(config, spec_stats)

    # ---- queue management --------------------------------------------------------------

    def _queue_key(self, request: Request) -> tuple:
        if self.config.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def _enqueue_waiting(self, request: Request) -> None:
        """Inserts by (priority,) arrival time: a preempted request keeps its arrival time,
        so it goes back in front of everything that arrived after it."""
        # Keys computed only along the bisection: building all of them made each insertion
        # O(queue), so a 2,048-input pooling call O(n^2) on the event loop.
        self.waiting.insert(bisect.bisect_right(self.waiting, self._queue_key(request),
                                                key=self._queue_key), request)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        discard_cache: bool = False) -> list[Request]:
        """Ends requests (abort, error, stop string) and releases their blocks at once."""
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = status
            self.kv_cache_manager.free(request, discard_cache=discard_cache)
            finished.append(request)
        return finished

    # ---- the step --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.config.policy == "priority":
            self.running.sort(key=self._queue_key)
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []  # (request, new tokens, of them drafts)
        preempted: list[Request] = []
        spec = self._step_spec()
        self._chunker.begin_step(bool(self.waiting)
                                 and len(self.running) < self.config.max_num_seqs)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, request.num_computed_tokens, budget, True)
            if num_new == 0:
                i += 1
                continue
            # Drafts ride along with a decode (one token left to compute), within the budget;
            # their slots are allocated like any token's (rejected ones are rewritten later).
            num_spec, lookahead = 0, 0
            if spec is not None:
                if request.num_tokens - request.num_computed_tokens == 1:
                    fits = spec.num_drafts(request, budget - num_new)
                    if fits is None:  # it waits for a step with room for all its drafts
                        i += 1
                        continue
                    num_spec = fits
                lookahead = spec.lookahead(
                    request, request.num_computed_tokens + num_new + num_spec)
            if not self._allocate_or_preempt(request, num_new + num_spec, preempted,
                                             lookahead):
                break  # the request itself was preempted: nothing after it fits either
            scheduled.append((request, num_new + num_spec, num_spec))
            budget -= num_new + num_spec
            i += 1

        num_before_admissions = len(scheduled)
        if not preempted:  # admit waiting requests only when nobody had to be preempted
            blocked = self._admit_waiting(scheduled, budget)
            if blocked is not None and not scheduled and not self.running:
                self._fail_unfittable(blocked)
        self.kv_cache_manager.observe_peak_usage()
        admitting = len(scheduled) > num_before_admissions
        propose = spec is not None and spec.proposes(admitting=admitting)
        if self.spec_decode is not None:
            self.spec_decode.count_step()
        return self._make_output(scheduled, preempted, propose)

    def _admit_waiting(self, scheduled: list[tuple[Request, int, int]],
                       budget: int) -> Request | None:
        """Admits waiting requests in queue order while the budget lasts; returns the one
        that did not fit (None if none was refused for room). A request a feature holds
        back (its grammar still compiling, its adapter one more than max_loras in the
        step) is skipped, not waited for."""
        for feature in self.features:
            feature.begin_admission(self.running)
        w = 0
        while (w < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[w]
            if not self._features_admit(request):
                w += 0 if request.is_finished else 1  # a failed one left the queue
                continue
            num_new = self._admit(request, budget)
            if num_new is None:
                return request
            for feature in self.features:
                feature.admitted(request)
            scheduled.append((request, num_new, 0))
            budget -= num_new
        return None

    def _features_admit(self, request: Request) -> bool:
        """Every feature's can_admit; one that raises AdmissionFailed fails the request."""
        try:
            return all(feature.can_admit(request) for feature in self.features)
        except AdmissionFailed as e:
            request.error = str(e)
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            self.newly_failed.append(request)
            return False

    def _num_new_tokens(self, request: Request, num_computed: int, budget: int,
                        running: bool = False) -> int:
        """PrefillChunker's count; "alone" when no other request runs or waits."""
        alone = len(self.running) + len(self.waiting) <= 1
        return self._chunker.num_new_tokens(request, num_computed, budget, alone, running)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             preempted: list[Request], lookahead: int = 0) -> bool:
        """Allocates slots (and `lookahead` more), preempting the lowest-priority running
        request (the last one in `running`, never one already scheduled this step) until
        they fit."""
        while self.kv_cache_manager.allocate_slots(request, num_new + lookahead) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, budget: int) -> int | None:
        # prompt_logprobs and mean/cls pooling need every prompt position computed: no
        # prefix-cache lookup (their blocks are still cached for others).
        computed_blocks, num_hit = None, 0
        if request.reads_cached_prefix:
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        num_new = self._num_new_tokens(request, num_hit, budget)
        if num_new == 0:
            return None
        spec = self._step_spec()
        lookahead = spec.lookahead(request, num_hit + num_new) if spec is not None else 0
        if self.kv_cache_manager.allocate_slots(request, num_new + lookahead,
                                                computed_blocks) is None:
            return None
        self.waiting.remove(request)
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return num_new

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, restart from token 0 (its prefix may still
        be cached), back to the front of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_tree_parents = [], None
        if request.pooling_params is not None:  # its chunks are computed again
            request.pooling_state = PoolingState(request.pooling_params)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(request)

    def _fail_unfittable(self, request: Request) -> None:
        """Nothing runs and the head of the queue still cannot get its blocks: it never will."""
        needed = self.kv_cache_manager.num_blocks_needed(request.num_tokens)
        request.error = (f"request needs {needed} KV blocks for {request.num_tokens} tokens but "
                         f"the cache has {self.kv_cache_manager.num_blocks} blocks")
        self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
        self.newly_failed.append(request)

    def _make_output(self, scheduled: list[tuple[Request, int, int]],
                     preempted: list[Request], speculate: bool = False) -> SchedulerOutput:
        items = []
        for request, num_new, num_spec in scheduled:
            start = request.num_computed_tokens
            end = start + num_new - num_spec
            drafts = request.spec_token_ids[:num_spec]
            parents = request.spec_tree_parents
            items.append(ScheduledRequest(
                request=request,
                num_computed_tokens=start,
                token_ids=request.all_token_ids[start:end] + drafts,
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                group_block_ids=self.kv_cache_manager.get_group_block_ids(request.request_id),
                num_samples=((1 + len(request.pending_forks))
                             if end == request.num_tokens and not request.is_pooling else 0),
                want_prompt_logprobs=(request.sampling_params.prompt_logprobs is not None
                                      and start < request.num_prompt_tokens),
                spec_token_ids=drafts,
                spec_tree_parents=parents[:num_spec] if parents and drafts else None,
            ))
        # Decodes first: the attention backend batches all single-token rows in one call
        # (a request with drafts is one decode row per position).
        items.sort(key=lambda s: not s.is_decode)
        self.num_steps += 1
        return SchedulerOutput(
            scheduled=items,
            total_num_scheduled_tokens=sum(n for _, n, _ in scheduled),
            blocks_to_copy=self.kv_cache_manager.take_copy_ops(),
            preempted=preempted,
            step_id=self.num_steps,
            # Decided once per step: where drafts are verified (by the batch before
            # admissions), unless the proposer rests (DraftScheduling.proposes).
            propose_drafts=speculate,
        )

    def _step_spec(self) -> DraftScheduling | None:
        """Speculative decoding's part if a step of the running requests verifies (and
        proposes) drafts; None when it does not (or drafts are off)."""
        spec = self.spec_decode
        return spec if spec is not None and spec.verifies(len(self.running)) else None

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """The synchronous scheduler never schedules a step before the update of the one
        in flight (AsyncScheduler does)."""
        return None

    # ---- after the forward -------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advances every scheduled request, forks n > 1 samples, advances grammar matchers
        (appending jump-forward tokens), applies token-level stop rules (EOS,
        stop_token_ids, max_tokens, max_model_len) and frees finished requests.

        A request finished while the forward ran (abort, stop string) is skipped: the token
        computed for it is dropped.

        With drafts, the sampled tokens (accepted drafts, then the token after them) are
        appended one at a time, each checked as if it were the step's only token: the run
        ends at the first that stops the request or is followed by jump-forward tokens, and
        `num_computed_tokens` covers only the positions whose input was kept. The KV of the
        rest stays in its slots, to be rewritten.
        """
        outputs: list[EngineCoreOutput] = []
        if scheduler_output.propose_drafts and self.spec_decode is not None:
            self.spec_decode.note_proposals(any(runner_output.spec_token_ids.values()),
                                            len(scheduler_output.scheduled))
        for item in scheduler_output.scheduled:
            request = item.request
            if request.is_finished:
                continue
            num_drafts = len(item.spec_token_ids)
            request.num_computed_tokens += item.num_new_tokens - num_drafts
            request.spec_token_ids, request.spec_tree_parents = [], None
            rid = request.request_id
            if request.pooling_state is not None:
                pooled = pool_chunk(request, runner_output.pooler_output.get(rid))
                if pooled is not None:
                    outputs.append(EngineCoreOutput(request, [], pooled=pooled))
                continue
            prompt_lps = runner_output.prompt_logprobs.get(rid)
            tokens = runner_output.sampled_token_ids.get(rid)
            if not tokens:
                if prompt_lps:
                    outputs.append(EngineCoreOutput(request, [], prompt_logprobs=prompt_lps))
                continue
            logprobs = runner_output.logprobs.get(rid)
            if num_drafts and self.spec_decode is not None:
                self.spec_decode.observe(num_drafts, len(tokens) - 1, request.spec_method)
            # One run for the request, or one token for each sample an n > 1 prompt forks.
            samples = [request] + self._fork(request)
            runs = [tokens] if len(samples) == 1 else [[token] for token in tokens]
            start = 0
            for i, (sample, run) in enumerate(zip(samples, runs)):
                outputs.append(append_run(
                    sample, run, self.features, self.config,
                    logprobs[start:start + len(run)] if logprobs else None,
                    prompt_lps if i == 0 else None,
                    runner_output.spec_token_ids.get(sample.request_id),
                    runner_output.spec_tree_parents.get(sample.request_id),
                    runner_output.spec_methods.get(sample.request_id, "")))
                start += len(run)
        for out in outputs:
            if out.finished and out.request.request_id in self.requests:
                self.running.remove(out.request)
                del self.requests[out.request.request_id]
                self.kv_cache_manager.free(out.request)
        return outputs

    def _fork(self, request: Request) -> list[Request]:
        """The first sample of an n > 1 request just finished its prompt: the others start
        here, sharing its blocks (copy-on-write on the last, partial one)."""
        forks, request.pending_forks = request.pending_forks, []
        for child in forks:
            self.kv_cache_manager.fork(request, child)
            child.num_computed_tokens = request.num_computed_tokens
            child.num_cached_tokens = request.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self.running.append(child)
        return forks
