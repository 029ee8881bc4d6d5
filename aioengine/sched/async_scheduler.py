"""AsyncScheduler: vLLM's async scheduling, the Scheduler that also hands out the step
after the one in flight before that one's tokens are known (EngineArgs.async_scheduling).
"""
from __future__ import annotations

from aioengine.sched.scheduler import Scheduler
from aioengine.sched.scheduler_output import (PLACEHOLDER_TOKEN_ID, ScheduledRequest,
                                             SchedulerOutput)
from aioengine.request import Request


class AsyncScheduler(Scheduler):
    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """vLLM's async scheduling: the step after `in_flight`, scheduled while it runs and
        before its tokens are known. Each of its requests computes one more token, the one
        `in_flight` samples for it (the runner fills the id in), so the worker goes from
        one step to the next without waiting for the loop's update and schedule.

        Only in the steady state where that is exactly what schedule() would hand out after
        the update: nothing waiting, every running request in `in_flight` with one sampled
        row, and nothing in its sampling that reads the output tokens (penalties, min_tokens
        still banning stop tokens, a feature's state such as a grammar). None otherwise: the engine then waits for the
        update and calls schedule(). Requests that `in_flight` surely ends (max_tokens,
        max_model_len) are left out; one that it ends by a stop token computes one token in
        vain, which update_from_output drops, as for an abort.

        Only schedule() admits, preempts or hits the prefix cache, and only with no step in
        flight. A step ahead writes K/V only into its requests' unhashed tail blocks, so a
        block freed meanwhile (stop, abort) and handed out again is rewritten by its new
        owner in a later step (the worker runs steps in order) before anyone reads it.
        """
        live = [item for item in in_flight.scheduled if not item.request.is_finished]
        # With drafts verified in `in_flight` (its tokens unknown in number) or proposed
        # after it, the next step needs its update first; so does a step due to propose.
        spec = self._step_spec()
        if ((self.spec_decode is not None
             and (in_flight.propose_drafts or any(item.spec_token_ids for item in live)))
                or (spec is not None and spec.proposes(admitting=False))
                or self.waiting or len(live) != len(self.running)
                or len(live) > self.config.max_num_batched_tokens
                or not all(self._can_run_ahead(item) for item in live)):
            return None
        ahead = [item for item in live if not self._ends_by_length(item.request)]
        if not ahead or not self._allocate_ahead(ahead):
            return None
        items = [ScheduledRequest(
            request=item.request,
            num_computed_tokens=item.num_computed_tokens + item.num_new_tokens,
            token_ids=[PLACEHOLDER_TOKEN_ID],
            block_ids=self.kv_cache_manager.get_block_ids(item.request.request_id),
            group_block_ids=self.kv_cache_manager.get_group_block_ids(item.request.request_id),
            num_samples=1) for item in ahead]
        self.kv_cache_manager.observe_peak_usage()
        if self.spec_decode is not None:
            self.spec_decode.count_step()
        self.num_steps += 1
        self.num_steps_ahead += 1
        return SchedulerOutput(scheduled=items, total_num_scheduled_tokens=len(items),
                               blocks_to_copy=self.kv_cache_manager.take_copy_ops(),
                               step_id=self.num_steps, follows_step=in_flight.step_id)

    def _can_run_ahead(self, item: ScheduledRequest) -> bool:
        request, params = item.request, item.request.sampling_params
        return (item.num_samples == 1
                and all(f.allows_schedule_ahead(request) for f in self.features)
                and request.num_computed_tokens == item.num_computed_tokens
                and request.num_output_tokens >= params.min_tokens
                and not params.reads_output_tokens)

    def _ends_by_length(self, request: Request) -> bool:
        """Whether the token being sampled for `request` will end it (request_tokens.check_stop)."""
        return (request.num_output_tokens + 1 >= (request.sampling_params.max_tokens or 0)
                or request.num_tokens + 1 >= self.config.max_model_len)

    def _allocate_ahead(self, ahead: list[ScheduledRequest]) -> bool:
        """Slots for one token past each in-flight step. On a shortage some requests may
        keep the blocks they got: their next allocate_slots counts them as theirs."""
        for item in ahead:
            done = item.num_computed_tokens + item.num_new_tokens  # once in_flight has run
            if self.kv_cache_manager.allocate_slots(item.request, 1,
                                                    num_computed_tokens=done) is None:
                return False
        return True
