"""Async scheduling: Scheduler.schedule_ahead hands out the next decode step while the
one before it is in flight, only where schedule() would hand out the same after the update."""
from __future__ import annotations

import pytest

from aioengine.sched.scheduler_output import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput
from aioengine.request import RequestStatus

from tests.unit.test_scheduler import (EOS, fake_forward, make_request, make_scheduler,
                                       scheduled_tokens, step)


def ahead_of(s, out: SchedulerOutput) -> SchedulerOutput:
    ahead = s.schedule_ahead(out)
    assert ahead is not None
    return ahead


def test_pipelined_decode_equals_step_by_step() -> None:
    """Prompt 6, block size 4: the first step computes the prompt, each step ahead one
    more position (6, 7, 8), scheduled while the step before it is in flight. Position 8
    opens a third block."""
    s = make_scheduler(block_size=4)
    r = make_request("a", 6, max_tokens=10)
    s.add_request(r)
    in_flight = s.schedule()
    steps = [in_flight]
    for position, token in zip((6, 7, 8), (30, 31, 32)):
        ahead = ahead_of(s, in_flight)
        assert ahead.follows_step == in_flight.step_id and ahead.step_id == in_flight.step_id + 1
        item = ahead.scheduled[0]
        assert (item.num_computed_tokens, item.token_ids, item.num_samples) == (
            position, [PLACEHOLDER_TOKEN_ID], 1)
        assert len(item.block_ids) == position // 4 + 1
        s.update_from_output(in_flight, fake_forward(in_flight, token=token))
        assert r.num_computed_tokens == position and r.output_token_ids[-1] == token
        in_flight = ahead
        steps.append(ahead)
    s.update_from_output(in_flight, fake_forward(in_flight, token=33))
    assert r.num_computed_tokens == 9 and r.output_token_ids == [30, 31, 32, 33]
    assert steps[1].scheduled[0].block_ids == steps[2].scheduled[0].block_ids
    assert steps[3].scheduled[0].block_ids[:2] == steps[2].scheduled[0].block_ids
    s.kv_cache_manager.check_integrity()
    # The same request scheduled one step at a time: the same blocks and tokens.
    t = make_scheduler(block_size=4)
    twin = make_request("a", 6, max_tokens=10)
    t.add_request(twin)
    for token in (30, 31, 32, 33):
        step(t, token)
    assert twin.output_token_ids == r.output_token_ids
    assert t.kv_cache_manager.get_block_ids("a") == s.kv_cache_manager.get_block_ids("a")
    assert s.num_steps_ahead == 3 and t.num_steps_ahead == 0


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.2), dict(frequency_penalty=0.5), dict(presence_penalty=0.5),
    dict(min_tokens=3),
])
def test_declines_when_sampling_reads_the_output_tokens(params: dict) -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=10, **params))
    out = s.schedule()
    assert s.schedule_ahead(out) is None


def test_declines_with_requests_waiting_or_left_out() -> None:
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 4, max_tokens=10))
    step(s)
    out = s.schedule()
    s.add_request(make_request("b", 4, max_tokens=10, arrival=1.0))
    assert s.schedule_ahead(out) is None  # b must be admitted by schedule()

    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 4, max_tokens=10))
    s.add_request(make_request("b", 20, max_tokens=10, arrival=1.0))
    out = s.schedule()  # a's prompt and a chunk of b's: b samples nothing yet
    assert scheduled_tokens(out) == {"a": 4, "b": 4}
    assert s.schedule_ahead(out) is None

    s = make_scheduler()
    parent = make_request("p#0", 4, max_tokens=10)
    parent.pending_forks = [make_request("p#1", 4, max_tokens=10)]
    s.add_request(parent)
    assert s.schedule_ahead(s.schedule()) is None  # n = 2: the fork starts at the update


def test_requests_their_step_ends_by_length_are_left_out() -> None:
    s = make_scheduler()
    s.add_request(make_request("short", 4, max_tokens=1))
    s.add_request(make_request("long", 4, max_tokens=10, first_token=100))
    out = s.schedule()
    assert scheduled_tokens(ahead_of(s, out)) == {"long": 1}
    s = make_scheduler()
    s.add_request(make_request("short", 4, max_tokens=1))
    assert s.schedule_ahead(s.schedule()) is None


def test_a_stop_token_or_an_abort_drops_the_token_computed_ahead() -> None:
    s = make_scheduler(block_size=4)
    stops = make_request("stops", 7, max_tokens=10)
    aborted = make_request("aborted", 7, max_tokens=10, first_token=100)
    s.add_request(stops)
    s.add_request(aborted)
    step(s)
    out = s.schedule()
    ahead = ahead_of(s, out)
    s.update_from_output(out, ModelRunnerOutput({"stops": [EOS], "aborted": [5]}))
    assert stops.status == RequestStatus.FINISHED_STOPPED
    s.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)  # a stop string, say
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # freed at once, the step ahead in flight
    outputs = s.update_from_output(ahead, fake_forward(ahead, token=9))
    assert outputs == []
    assert stops.output_token_ids == [7, EOS] and aborted.output_token_ids == [7, 5]
    assert stops.num_computed_tokens == 8  # not advanced by the dropped step
    kv.check_integrity()
    assert not s.has_unfinished_requests()


def test_blocks_shared_within_the_step_in_flight_are_kept() -> None:
    """Two prompts sharing 8 tokens admitted in one step: the second hits the first's two
    full blocks while that very step computes them. The step scheduled ahead must count
    them as written (the in-flight step's tokens), not copy-on-write them into empty
    blocks, which once lost the first request's prefix KV (a race seen under load)."""
    s = make_scheduler(block_size=4)
    a = make_request("a", 10, max_tokens=5, arrival=0.0)
    b = make_request("b", 12, max_tokens=5, arrival=1.0)
    b.prompt_token_ids[10:] = [90, 91]
    b.all_token_ids[:] = b.prompt_token_ids
    s.add_request(a)
    s.add_request(b)
    in_flight = s.schedule()
    table_a = s.kv_cache_manager.get_block_ids("a")
    assert s.kv_cache_manager.get_block_ids("b")[:2] == table_a[:2]  # the hits
    ahead = ahead_of(s, in_flight)
    assert not ahead.blocks_to_copy
    assert s.kv_cache_manager.get_block_ids("a")[:3] == table_a
    s.update_from_output(in_flight, fake_forward(in_flight))
    s.update_from_output(ahead, fake_forward(ahead))
    s.kv_cache_manager.check_integrity()


def auto_scheduler(rest_when_idle: bool = True):
    """A scheduler with drafts configured as method auto configures them."""
    from aioengine.config import SchedulerConfig
    from aioengine.kv.kv_cache_manager import KVCacheManager
    from aioengine.sched.async_scheduler import AsyncScheduler

    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=1024,
                             long_prefill_token_threshold=0, long_prefill_attention_budget=0,
                             num_speculative_tokens=4, spec_rest_when_idle=rest_when_idle)
    return AsyncScheduler(config, KVCacheManager(256, 4, enable_caching=True))


def run_ahead_or_step(s, in_flight: SchedulerOutput, drafts: dict[str, list[int]],
                      token: int = 7) -> SchedulerOutput:
    """Finishes `in_flight` (its proposals, if it made any, are `drafts`) and returns the
    next step: the one scheduled ahead of it if there is one, else schedule()'s."""
    ahead = s.schedule_ahead(in_flight)
    out = fake_forward(in_flight, token)
    if in_flight.propose_drafts:
        out.spec_token_ids = drafts
    s.update_from_output(in_flight, out)
    return ahead if ahead is not None else s.schedule()


def test_a_resting_proposer_lets_steps_run_ahead_and_wakes_for_drafts() -> None:
    """Method auto, steps of 8 requests (a verified row costs 0.30 of a token): each step
    that proposed nothing doubles the steps that propose nothing after it (1, 2, 4, ...),
    and those are scheduled ahead; a step that finds a draft ends the rest, and a new
    request makes its step propose at once."""
    from aioengine.spec_decode.step import MAX_REST_STEPS

    s = auto_scheduler()
    for i in range(8):
        s.add_request(make_request("a" if i == 0 else f"r{i}", 4, max_tokens=200))
    out = s.schedule()
    assert out.propose_drafts and len(out.scheduled) == 8
    proposing = []
    for _ in range(40):
        out = run_ahead_or_step(s, out, {})
        proposing.append(out.propose_drafts)
    gaps = [i for i, p in enumerate(proposing) if p]
    assert [b - a for a, b in zip(gaps, gaps[1:])] == [3, 5, 9, 17]
    assert MAX_REST_STEPS == 16
    # The first step of each rest is scheduled after the proposing one's update, the
    # others ahead of the step before them.
    assert s.num_steps_ahead == proposing.count(False) - proposing.count(True) - 1
    # A proposal that found drafts: the next steps verify them and propose again.
    while not out.propose_drafts:
        out = run_ahead_or_step(s, out, {})
    out = run_ahead_or_step(s, out, {"a": [1, 2]})
    assert out.propose_drafts and out.scheduled[0].spec_token_ids == [1, 2]
    out = run_ahead_or_step(s, out, {})
    assert not out.propose_drafts and s.spec_decode.idle_rounds == 1  # the rest starts over
    # A request joining makes its step propose, resting or not.
    s.add_request(make_request("b", 4, max_tokens=200, arrival=1.0))
    out = run_ahead_or_step(s, out, {})
    assert out.propose_drafts and "b" in scheduled_tokens(out)


@pytest.mark.parametrize("rest_when_idle", [True, False], ids=["auto-one-request", "other"])
def test_a_lone_request_or_another_method_proposes_every_step(rest_when_idle: bool) -> None:
    """Method auto with one request (a verified row costs 0.05 of a token) does not rest:
    any draft found pays there, and a rest would skip a repeat's first drafts. Other
    methods never rest."""
    s = auto_scheduler(rest_when_idle=rest_when_idle)
    s.add_request(make_request("a", 4, max_tokens=50))
    out = s.schedule()
    for _ in range(10):
        out = run_ahead_or_step(s, out, {})
        assert out.propose_drafts
    assert s.num_steps_ahead == 0
