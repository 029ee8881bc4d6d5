"""AsyncEngine: streaming, n > 1, seeds, stop strings, aborts, cancellation, errors; every
scenario ends with every KV block released."""
from __future__ import annotations

import asyncio
import re
import time
from contextlib import aclosing
from pathlib import Path

import pytest

from aioengine import LLM, AsyncEngine, InvalidRequestError, SamplingParams
from aioengine.errors import EngineDeadError

from tests.engine.conftest import assert_blocks_released


@pytest.fixture
async def engine(tiny_llama_dir: Path):
    engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=256, dtype="float32",
                                      max_num_batched_tokens=32)
    yield engine
    await engine.shutdown()


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, **kw) -> list:
    return [out async for out in engine.generate(prompt, params, **kw)]


async def test_streamed_deltas_add_up_to_the_final_text(engine: AsyncEngine,
                                                        tiny_prompts: list[list[int]],
                                                        tiny_reference: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = await collect(engine, tiny_prompts[3], params)
    assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = outs[-1].outputs[0]
    assert [t for o in outs for t in o.outputs[0].token_ids] == tiny_reference[3]
    assert "".join(o.outputs[0].text for o in outs) == final.cumulative_text
    assert final.cumulative_text == engine.tokenizer.decode(tiny_reference[3],
                                                            skip_special_tokens=True)
    assert final.finish_reason == "length"
    assert_blocks_released(engine.core)


async def test_concurrent_requests_match_their_solo_outputs(engine: AsyncEngine,
                                                            tiny_prompts: list[list[int]],
                                                            tiny_reference: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = await asyncio.gather(*(collect(engine, p, params) for p in tiny_prompts))
    tokens = [[t for o in outs for t in o.outputs[0].token_ids] for outs in results]
    assert tokens == tiny_reference
    assert_blocks_released(engine.core)


async def test_n_samples_with_seed_are_distinct_indexed_and_reproducible(
        engine: AsyncEngine, tiny_prompts: list[list[int]]) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)

    async def texts() -> dict[int, list[int]]:
        by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for out in engine.generate(tiny_prompts[1], params):
            for c in out.outputs:
                by_index[c.index] += c.token_ids
        return by_index

    alone = await texts()
    assert all(len(v) == 8 for v in alone.values())
    assert len({tuple(v) for v in alone.values()}) == 3
    # Same seed, now next to other traffic: the same tokens.
    noise = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    crowded, *_ = await asyncio.gather(texts(), *(collect(engine, p, noise)
                                                   for p in tiny_prompts[2:6]))
    assert crowded == alone
    assert_blocks_released(engine.core)


async def test_stop_string_ends_the_request_and_is_cut(engine: AsyncEngine,
                                                       tiny_prompts: list[list[int]],
                                                       tiny_reference: list[list[int]]) -> None:
    full = engine.tokenizer.decode(tiny_reference[0], skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    outs = await collect(engine, tiny_prompts[0], params)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.cumulative_text == full[:full.index(stop)]
    assert_blocks_released(engine.core)


async def test_abort_and_cancel_release_blocks(engine: AsyncEngine,
                                               tiny_prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    gen = engine.generate(tiny_prompts[3], params, request_id="to-abort")
    first = await gen.__anext__()
    assert not first.finished
    await engine.abort("to-abort")
    rest = [out async for out in gen]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(tiny_prompts[4], params):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_blocks_released(engine.core)

    # Leaving the loop early aborts too, once the generator is closed (aclosing does it at
    # once; otherwise Python closes it when it is garbage-collected).
    async with aclosing(engine.generate(tiny_prompts[5], params)) as gen:
        async for _ in gen:
            break
    assert_blocks_released(engine.core)


@pytest.mark.parametrize("prompt, params, param", [
    ([], SamplingParams(), "prompt"),
    ([49152], SamplingParams(), "prompt"),
    (list(range(100, 356)), SamplingParams(), "prompt"),
    (list(range(100, 200)), SamplingParams(max_tokens=200), "max_tokens"),
    ([5, 6], SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    (12, SamplingParams(), "prompt"),
])
async def test_bad_input_raises_a_typed_error_and_queues_nothing(engine: AsyncEngine, prompt,
                                                                 params, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await collect(engine, prompt, params)
    assert info.value.param == param
    assert_blocks_released(engine.core)


async def test_a_prepared_request_is_validated_once_and_runs_as_prepared(
        engine: AsyncEngine, tiny_prompts: list[list[int]], tiny_reference: list[list[int]],
        monkeypatch) -> None:
    """prepare() admits the request (validation, params copied and resolved); generate()
    queues it without validating again, and gives the same tokens as a plain prompt."""
    admission = engine.core.admission
    validated = []
    real = admission.validate_prompt

    def counting(token_ids, params):
        validated.append(len(token_ids))
        return real(token_ids, params)

    monkeypatch.setattr(admission, "validate_prompt", counting)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prepared = await engine.prepare(tiny_prompts[3], params)
    assert validated == [len(tiny_prompts[3])] and engine.num_waiting_requests() == 0
    assert prepared.sampling_params is not params and params.all_stop_token_ids == set()
    assert prepared.prompt_token_ids == tiny_prompts[3] and prepared.lora_request is None
    outs = await collect(engine, prepared, None)
    assert [t for o in outs for t in o.outputs[0].token_ids] == tiny_reference[3]
    assert validated == [len(tiny_prompts[3])]  # not again when it was queued
    with pytest.raises(ValueError, match="carries its own"):
        await collect(engine, prepared, params)
    # fit_kv_cache: an unset max_tokens is what n samples fit in the cache, not the context
    unset = SamplingParams(n=2, max_tokens=None)
    fitted = await engine.prepare(tiny_prompts[0], unset, fit_kv_cache=True)
    fits = (engine.num_kv_blocks // 2) * engine.block_size - 3
    assert fitted.sampling_params.max_tokens == min(256 - 3, fits)
    assert (await engine.prepare(tiny_prompts[0], unset)).sampling_params.max_tokens == 256 - 3
    with pytest.raises(InvalidRequestError) as info:
        await engine.prepare([], params)
    assert info.value.param == "prompt" and engine.num_waiting_requests() == 0
    assert_blocks_released(engine.core)


def test_llm_runs_prepared_requests_and_plain_prompts_alike(
        tiny_llama_dir: Path, tiny_prompts: list[list[int]],
        tiny_reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=256, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prepared = llm.prepare(tiny_prompts[1], params)
    outs = llm.generate([prepared, tiny_prompts[2]], [None, params])
    assert [o.outputs[0].token_ids for o in outs] == tiny_reference[1:3]
    with pytest.raises(ValueError, match="carries its own"):
        llm.generate(prepared, params)
    with pytest.raises(InvalidRequestError) as info:
        llm.prepare([49152], params)
    assert info.value.param == "prompt"
    assert llm.max_model_len == 256 and llm.stats()["num_running"] == 0
    assert_blocks_released(llm.core)


async def test_a_failing_forward_fails_its_requests_not_the_engine(
        engine: AsyncEngine, tiny_prompts: list[list[int]], monkeypatch) -> None:
    runner = engine.core.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(scheduler_output, before_layers=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected device fault")
        return real(scheduler_output, before_layers)

    monkeypatch.setattr(runner, "execute_model", flaky)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = await collect(engine, tiny_prompts[0], params)
    assert outs[-1].outputs[0].finish_reason == "error"
    assert "injected device fault" in outs[-1].outputs[0].error
    assert_blocks_released(engine.core)
    ok = await collect(engine, tiny_prompts[0], params)
    assert ok[-1].outputs[0].finish_reason == "length"
    assert_blocks_released(engine.core)


async def test_chat_messages_and_shutdown(engine: AsyncEngine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    outs = await collect(engine, messages, SamplingParams(temperature=0, max_tokens=3))
    assert outs[-1].finished
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await collect(engine, "hello", SamplingParams())


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample line of Prometheus text output (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics_count_requests_tokens_and_latencies(engine: AsyncEngine,
                                                           tiny_prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    await asyncio.gather(*(collect(engine, p, params) for p in tiny_prompts[:4]))
    gen = engine.generate(tiny_prompts[4], SamplingParams(max_tokens=50, ignore_eos=True))
    await gen.__anext__()
    await gen.aclose()
    text = engine.metrics.render().decode()
    assert _metric(text, "aioengine:request_success_total", finished_reason="length") == 4
    assert _metric(text, "aioengine:request_success_total", finished_reason="abort") == 1
    assert _metric(text, "aioengine:generation_tokens_total") >= 4 * 5 + 1
    assert _metric(text, "aioengine:prompt_tokens_total") == sum(map(len, tiny_prompts[:5]))
    assert _metric(text, "aioengine:time_to_first_token_seconds_count") == 5
    assert _metric(text, "aioengine:inter_token_latency_seconds_count") == 4 * 4
    assert _metric(text, "aioengine:e2e_request_latency_seconds_count") == 5
    # TPOT of the four that produced 5 tokens, and of the aborted one if a step gave it a
    # second token before the abort landed (one token has no TPOT).
    assert 4 <= _metric(text, "aioengine:request_time_per_output_token_seconds_count") <= 5
    assert _metric(text, "aioengine:request_time_per_output_token_seconds_sum") > 0
    assert _metric(text, "aioengine:request_queue_time_seconds_count") == 5
    assert _metric(text, "aioengine:iteration_tokens_total_count") > 0
    # Every step's worker time, by the executor that ran its layers (the tiny model's).
    executors = set(re.findall(r'^aioengine:step_time_seconds_count\{executor="([^"]*)"', text,
                               re.M))
    assert executors and "" not in executors, text
    assert sum(_metric(text, "aioengine:step_time_seconds_count", executor=e)
               for e in executors) == _metric(text, "aioengine:iteration_tokens_total_count")
    assert _metric(text, "aioengine:prefix_cache_queries_total") > 0
    # Everything finished or aborted: nothing running, every block free.
    assert _metric(text, "aioengine:num_requests_running") == 0
    assert _metric(text, "aioengine:kv_cache_usage_perc") == 0


async def test_a_stalled_event_loop_shows_in_the_lag_histogram(engine: AsyncEngine) -> None:
    """aioengine:event_loop_lag_seconds: a coroutine that holds the loop for 0.35 s (a
    blocking call in an app that embeds the engine) makes the watcher wake >= 0.25 s late
    (its timer was due at most 0.1 s into the stall)."""
    def late() -> float:  # wake-ups more than 0.1 s late
        text = engine.metrics.render().decode()
        return (_metric(text, "aioengine:event_loop_lag_seconds_count")
                - _metric(text, "aioengine:event_loop_lag_seconds_bucket", le="0.1"))

    await asyncio.sleep(0.25)
    before = late()
    time.sleep(0.35)  # holds the loop
    await asyncio.sleep(0.25)
    text = engine.metrics.render().decode()
    assert _metric(text, "aioengine:event_loop_lag_seconds_count") >= 3
    assert late() >= before + 1, text
