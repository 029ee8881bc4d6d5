"""Scheduler decisions: chunking, token budget, max_num_seqs, preemption, stops, forks."""
from __future__ import annotations

from aioengine.config import SchedulerConfig
from aioengine.sched.async_scheduler import AsyncScheduler
from aioengine.sched.chunking import ALONE_FACTOR, attention_chunk_cap
from aioengine.kv.kv_cache_manager import KVCacheManager
from aioengine.sched.scheduler import Scheduler
from aioengine.engine.features import EngineFeature
from aioengine.sched.scheduler_output import ModelRunnerOutput, SchedulerOutput
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 16,
                   max_num_seqs: int = 8, policy: str = "fcfs",
                   caching: bool = True,
                   features: tuple[EngineFeature, ...] = (),
                   chunk_cap: int = 0, attention_budget: int = 0) -> AsyncScheduler:
    """The engine's default scheduler (async scheduling on: schedule() as the synchronous
    Scheduler's, and schedule_ahead); fair prefill off unless `chunk_cap` (and
    `attention_budget`) is given."""
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=1024, policy=policy,
                             long_prefill_token_threshold=chunk_cap,
                             long_prefill_attention_budget=attention_budget)
    return AsyncScheduler(config, KVCacheManager(num_blocks, block_size,
                                                 enable_caching=caching), features)


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0,
                 priority: int = 0, first_token: int = 10, **params: object) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    sp.all_stop_token_ids = {EOS} | set(sp.stop_token_ids)
    return Request(rid, list(range(first_token, first_token + prompt_len)), sp,
                   arrival_time=arrival, priority=priority)


def fake_forward(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """What the runner would return: `token` for every sampling row."""
    return ModelRunnerOutput(sampled_token_ids={
        s.request.request_id: [token] * s.num_samples for s in out.scheduled if s.num_samples})


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, fake_forward(out, token))
    scheduler.kv_cache_manager.check_integrity()
    return out


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_long_prompt_is_chunked_under_the_budget() -> None:
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 20))
    assert scheduled_tokens(step(s)) == {"a": 8}
    assert scheduled_tokens(step(s)) == {"a": 8}
    out = step(s)
    assert scheduled_tokens(out) == {"a": 4}
    assert out.scheduled[0].num_samples == 1  # only the chunk that reaches the end samples
    assert s.requests["a"].output_token_ids == [7]


def test_decodes_and_prefill_chunks_share_a_step_decodes_first() -> None:
    s = make_scheduler(budget=8)
    s.add_request(make_request("a", 3, max_tokens=10))
    step(s)  # a: prefill of 3, samples its first token
    s.add_request(make_request("b", 30, arrival=1.0, first_token=100))
    out = step(s)
    assert scheduled_tokens(out) == {"a": 1, "b": 7}
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert out.total_num_scheduled_tokens == 8


def test_max_num_seqs_limits_running_requests() -> None:
    s = make_scheduler(budget=100, max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, arrival=float(i)))
    out = step(s)
    assert sorted(scheduled_tokens(out)) == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    config = SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8, max_model_len=64,
                             enable_chunked_prefill=False)
    s = Scheduler(config, KVCacheManager(64, 4))
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 6, arrival=1.0, first_token=100))
    assert scheduled_tokens(step(s)) == {"a": 6}  # b (6) does not fit in the 4 left
    assert scheduled_tokens(step(s)) == {"a": 1, "b": 6}


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens. Two requests of 8 prompt tokens take 2 blocks each; as they
    # decode they need more and the later one is preempted, then recomputed.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a = make_request("a", 8, max_tokens=12)
    b = make_request("b", 8, max_tokens=8, arrival=1.0, first_token=100)
    s.add_request(a)
    s.add_request(b)
    preempted_at = None
    for i in range(60):
        if not s.has_unfinished_requests():
            break
        out = step(s)
        if out.preempted and preempted_at is None:
            preempted_at = i
            assert [r.request_id for r in out.preempted] == ["b"]
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            assert s.waiting[0] is b
    assert preempted_at is not None
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 12 and b.num_output_tokens == 8
    assert b.num_preemptions >= 1
    assert s.kv_cache_manager.num_free_blocks == 6


def test_recompute_after_preemption_includes_generated_tokens() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    a = make_request("a", 8, max_tokens=12)
    b = make_request("b", 8, max_tokens=8, arrival=1.0, first_token=100)
    s.add_request(a)
    s.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        step(s)
    generated = b.num_output_tokens
    while b.status == RequestStatus.PREEMPTED:
        out = step(s)
    # b is re-admitted and recomputes its prompt plus everything it had generated.
    assert scheduled_tokens(out)["b"] == 8 + generated


def test_stop_rules() -> None:
    s = make_scheduler()
    eos = make_request("eos", 4, max_tokens=10)
    s.add_request(eos)
    step(s, token=EOS)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None

    s = make_scheduler()
    stop_id = make_request("stop_id", 4, max_tokens=10, stop_token_ids=[99])
    s.add_request(stop_id)
    step(s, token=99)
    assert stop_id.status == RequestStatus.FINISHED_STOPPED and stop_id.stop_reason == 99

    s = make_scheduler()
    min_tok = make_request("min", 4, max_tokens=10, min_tokens=2)
    s.add_request(min_tok)
    step(s, token=EOS)  # below min_tokens: EOS does not stop (the sampler masks it anyway)
    assert not min_tok.is_finished
    step(s, token=EOS)
    assert min_tok.status == RequestStatus.FINISHED_STOPPED

    s = make_scheduler()
    length = make_request("len", 4, max_tokens=2)
    s.add_request(length)
    step(s)
    step(s)
    assert length.status == RequestStatus.FINISHED_LENGTH
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks


def test_priority_policy_admits_lower_value_first() -> None:
    s = make_scheduler(budget=4, policy="priority")
    s.add_request(make_request("low", 4, arrival=0.0, priority=5))
    s.add_request(make_request("high", 4, arrival=1.0, priority=0))
    assert scheduled_tokens(step(s)) == {"high": 4}


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    s = make_scheduler(block_size=4, budget=64)
    s.add_request(make_request("a", 10, max_tokens=1))
    step(s)
    s.add_request(make_request("b", 10, max_tokens=1, arrival=1.0))
    out = step(s)
    assert scheduled_tokens(out) == {"b": 2}  # 2 full blocks (8 tokens) were cached
    assert out.scheduled[0].num_computed_tokens == 8


def test_request_that_can_never_fit_fails_instead_of_waiting_forever() -> None:
    s = make_scheduler(num_blocks=2, block_size=4, budget=64)
    r = make_request("big", 12)
    s.add_request(r)
    out = s.schedule()
    assert out.is_empty and r.status == RequestStatus.FINISHED_ERROR
    assert "KV blocks" in r.error and s.newly_failed == [r]
    assert not s.has_unfinished_requests()


def test_n_samples_fork_and_copy_on_write() -> None:
    s = make_scheduler(block_size=4, budget=64)
    parent = make_request("p#0", 6, max_tokens=3)
    forks = [make_request(f"p#{i}", 6, max_tokens=3) for i in (1, 2)]
    for i, f in enumerate(forks, 1):
        f.sample_index = i
    parent.pending_forks = list(forks)
    s.add_request(parent)
    out = s.schedule()
    assert out.scheduled[0].num_samples == 3
    s.update_from_output(out, ModelRunnerOutput({"p#0": [7, 8, 9]}))
    assert [r.output_token_ids for r in (parent, *forks)] == [[7], [8], [9]]
    kv = s.kv_cache_manager
    shared = kv.get_block_ids("p#0")
    assert all(kv.get_block_ids(f.request_id) == shared for f in forks)
    kv.check_integrity()
    out = step(s)
    # Each writes position 6, in the shared second block: two copies, the last writer
    # keeps the original.
    assert len(out.blocks_to_copy) == 2
    tails = {kv.get_block_ids(r.request_id)[1] for r in (parent, *forks)}
    assert len(tails) == 3
    assert len({kv.get_block_ids(r.request_id)[0] for r in (parent, *forks)}) == 1
    while s.has_unfinished_requests():
        step(s)
    assert kv.num_free_blocks == kv.num_blocks


def test_finish_requests_frees_blocks_immediately() -> None:
    s = make_scheduler()
    r = make_request("a", 9, max_tokens=10)
    s.add_request(r)
    step(s)
    assert s.kv_cache_manager.num_free_blocks < s.kv_cache_manager.num_blocks
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    s.kv_cache_manager.check_integrity()


def test_schedule_records_the_kv_peak_and_its_waste() -> None:
    s = make_scheduler(block_size=4, budget=16)
    s.add_request(make_request("a", 5, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3, first_token=100))
    kv = s.kv_cache_manager
    step(s)  # both prompts: 2 + 2 blocks, 13 tokens in 16 slots
    assert (kv.peak_num_blocks, kv.peak_num_empty_slots) == (4, 3)
    step(s)  # a: 6 tokens in 2 blocks; b: 9 tokens need a 3rd block -> 15 tokens in 20 slots
    assert (kv.peak_num_blocks, kv.peak_num_empty_slots, kv.waste_at_peak) == (5, 5, 0.25)
    step(s)  # 7 and 10 tokens in the same 5 blocks: not a new peak
    assert not s.has_unfinished_requests()
    assert (kv.peak_num_blocks, kv.peak_num_empty_slots) == (5, 5)


def test_the_synchronous_scheduler_never_schedules_ahead() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64)
    s = Scheduler(config, KVCacheManager(64, 4))
    s.add_request(make_request("a", 4, max_tokens=8))
    out = s.schedule()
    s.update_from_output(out, fake_forward(out))
    assert s.schedule_ahead(s.schedule()) is None


def test_a_step_never_holds_more_adapters_than_max_loras() -> None:
    """LoRA's admission hooks: with max_loras 2, a third adapter's request waits (a later
    one of a held adapter goes ahead of it) until the requests of one of the two end."""
    import torch

    from aioengine.lora.manager import LoRAConfig, LoRAManager
    from aioengine.lora.request import LoRARequest
    lora = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=4), torch.device("cpu"),
                       torch.float32)
    s = make_scheduler(budget=64, features=(lora,))
    adapters = {name: LoRARequest(name, "", i + 1) for i, name in enumerate("xyz")}
    for i, (rid, name) in enumerate([("a", "x"), ("b", "y"), ("c", "z"), ("d", "x")]):
        r = make_request(rid, 4, max_tokens=8 if rid == "b" else 2, arrival=float(i))
        r.lora_request = adapters[name]
        s.add_request(r)
    assert set(scheduled_tokens(step(s))) == {"a", "b", "d"}
    assert [r.request_id for r in s.waiting] == ["c"]
    assert "c" not in scheduled_tokens(step(s))  # a and d (x) end after this step
    assert "c" in scheduled_tokens(step(s))


def test_a_long_prompt_leaves_room_for_others_in_every_step() -> None:
    """Fair prefill (long_prefill_token_threshold 4 of a 16-token budget): a long prompt is
    computed 4 tokens a step, so a short one that arrives is admitted at once, computed
    in the room left and sampled in the step after its prompt is done."""
    s = make_scheduler(budget=16, chunk_cap=4)
    s.add_request(make_request("long", 100, max_tokens=2))
    assert scheduled_tokens(step(s)) == {"long": 4}
    s.add_request(make_request("short", 6, arrival=1.0, first_token=100))
    assert scheduled_tokens(step(s)) == {"long": 4, "short": 4}
    assert scheduled_tokens(step(s)) == {"long": 4, "short": 2}
    assert s.requests["short"].num_output_tokens == 1
    assert scheduled_tokens(step(s)) == {"long": 4, "short": 1}  # the short one decodes
    s.add_request(make_request("second", 3, arrival=2.0, first_token=200))
    assert scheduled_tokens(step(s)) == {"long": 4, "short": 1, "second": 3}


def test_the_default_prefill_chunk_cap_is_a_quarter_of_the_budget() -> None:
    assert SchedulerConfig(max_model_len=64, max_num_batched_tokens=512).prefill_chunk_cap == 128
    assert SchedulerConfig(max_model_len=64, long_prefill_token_threshold=0).prefill_chunk_cap == 0
    assert SchedulerConfig(max_model_len=64, enable_chunked_prefill=False).prefill_chunk_cap == 0


def test_the_attention_cap_is_the_largest_chunk_within_the_budget() -> None:
    for budget in (1, 7, 100, 16384, 99991):
        for p in (0, 1, 5, 127, 128, 1000, 7999, 100000):
            c = attention_chunk_cap(p, budget)
            assert c >= 1
            assert c == 1 or c * (p + c) <= budget
            assert (c + 1) * (p + c + 1) > budget
    assert attention_chunk_cap(0, 16384) == 128
    assert attention_chunk_cap(8000, 16384) == 2
    # A sliding window bounds every token's keys: past it the chunk stops shrinking.
    assert attention_chunk_cap(8000, 16384, window=4096) == attention_chunk_cap(4096, 16384) == 3
    assert attention_chunk_cap(3000, 16384, window=4096) == attention_chunk_cap(3000, 16384)


def test_a_long_prompts_chunks_shrink_as_its_context_grows() -> None:
    """Attention budget 256 pairs with a 16-token cap: the chunk at position p is the
    largest c with c * (p + c) <= 256 while another request runs, ALONE_FACTOR x 256 while the long
    prompt is alone, never below one token; a short prompt that arrives gets the next step
    to itself (the long prompt sits it out), then decodes beside the long prompt's chunks."""
    s = make_scheduler(budget=64, chunk_cap=16, attention_budget=256, num_blocks=256)
    s.add_request(make_request("long", 300, max_tokens=1))
    sizes, expected = [], []
    while "long" in s.requests and not s.requests["long"].num_output_tokens:
        p = s.requests["long"].num_computed_tokens
        arrives = p >= 48 and "short" not in s.requests
        if arrives:
            s.add_request(make_request("short", 12, max_tokens=500, arrival=1.0,
                                       first_token=500))
        alone = len(s.requests) == 1
        tokens = scheduled_tokens(step(s))
        sizes.append(tokens.get("long", 0))
        expected.append(0 if arrives else
                        min(16, 300 - p, attention_chunk_cap(p, 256 * ALONE_FACTOR if alone else 256)))
        assert tokens.get("short") == (None if "short" not in s.requests and not arrives
                                       else 12 if arrives else 1)
    assert sum(sizes) == 300
    assert sizes == expected
    sat_out = sizes.index(0)  # once, when the short prompt arrived; cheaper chunks after it
    assert 0 not in sizes[sat_out + 1:] and sizes[sat_out + 1] < sizes[sat_out - 1]
    assert sizes[-1] == 1


def test_a_long_prompt_never_sits_out_two_steps_running() -> None:
    """A new short request in every step: the long prompt leaves every other step to the
    newcomers and computes a chunk in the others, so steady arrivals cannot starve it."""
    s = make_scheduler(budget=64, chunk_cap=16, attention_budget=256, num_blocks=256)
    s.add_request(make_request("long", 100, max_tokens=1))
    step(s)
    sizes = []
    for i in range(6):
        s.add_request(make_request(f"short{i}", 4, max_tokens=1, arrival=1.0 + i))
        tokens = scheduled_tokens(step(s))
        assert tokens[f"short{i}"] == 4
        sizes.append(tokens.get("long", 0))
    assert sizes[0::2] == [0, 0, 0] and all(n > 0 for n in sizes[1::2])


def test_a_long_prompt_at_a_short_context_does_not_sit_out() -> None:
    """Where the attention budget does not bind (4096 pairs: a 16-token chunk fits up to
    position ~240), a chunk is cheap, and the long prompt shares every step."""
    s = make_scheduler(budget=64, chunk_cap=16, attention_budget=4096, num_blocks=256)
    s.add_request(make_request("long", 100, max_tokens=1))
    for i in range(4):
        s.add_request(make_request(f"short{i}", 4, max_tokens=1, arrival=1.0 + i))
        assert scheduled_tokens(step(s))["long"] == 16


def test_a_short_turn_after_a_long_cached_prefix_is_not_chunked_by_attention() -> None:
    """Only a long prompt is capped by attention: a second turn that adds 8 tokens to a
    cached 200-token conversation is computed in one step (8 x 208 pairs > 256)."""
    s = make_scheduler(budget=64, chunk_cap=16, attention_budget=256, num_blocks=128)
    first = make_request("first", 200, max_tokens=1)
    s.add_request(first)
    while "first" in s.requests:
        step(s)
    turn = Request("turn", first.prompt_token_ids + list(range(900, 908)),
                   first.sampling_params, arrival_time=1.0)
    s.add_request(turn)
    out = step(s)
    assert turn.num_cached_tokens == 200
    assert scheduled_tokens(out) == {"turn": 8}
