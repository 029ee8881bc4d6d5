"""Async scheduling in AsyncEngine: steps scheduled ahead give the same tokens as steps
scheduled one at a time, whatever ends the requests, and every block is released."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from aioengine import LLM, AsyncEngine, SamplingParams
from aioengine.sched.scheduler_output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput

from tests.engine.conftest import assert_blocks_released

# Speculation off: with the default (auto), a step of fewer than 7 requests proposes drafts
# every step (spec_decode/step.py, REST_MIN_ROW_COST), and a proposing step is never
# scheduled ahead; tests/unit/test_schedule_ahead.py covers drafts and steps ahead.
PLAIN = {"speculative_config": None}


async def run_all(model_dir: Path, prompts: list[list[int]], params: list[SamplingParams],
                  async_scheduling: bool) -> tuple[list[tuple], int]:
    # Every prompt in the first step: the steps ahead start with the second.
    engine = await AsyncEngine.create(str(model_dir), max_model_len=256, dtype="float32",
                                      async_scheduling=async_scheduling, **PLAIN)
    try:
        async def one(prompt: list[int], p: SamplingParams) -> tuple:
            outs = [out async for out in engine.generate(prompt, p)]
            final = outs[-1].outputs[0]
            tokens = [t for o in outs for t in o.outputs[0].token_ids]
            return tokens, final.finish_reason, final.cumulative_text

        results = await asyncio.gather(*(one(x, p) for x, p in zip(prompts, params)))
        assert_blocks_released(engine.core)
        return results, engine.core.scheduler.num_steps_ahead
    finally:
        await engine.shutdown()


async def test_same_tokens_as_one_step_at_a_time(tiny_llama_dir: Path,
                                                 tiny_prompts: list[list[int]],
                                                 tiny_reference: list[list[int]]) -> None:
    eos = 7
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        # Ends on a stop token the step ahead cannot know about.
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tiny_reference[2][4]]),
        SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True,
                       logprobs=2),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        # These two keep every step from being scheduled ahead while they run: min_tokens
        # for its first 2 tokens, the penalty for all 4.
        SamplingParams(temperature=0, max_tokens=12, min_tokens=2, stop_token_ids=[eos]),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3),
    ]
    pipelined, ahead = await run_all(tiny_llama_dir, tiny_prompts, params, True)
    stepwise, none = await run_all(tiny_llama_dir, tiny_prompts, params, False)
    assert ahead > 0 and none == 0
    assert pipelined == stepwise
    assert pipelined[0][0] == tiny_reference[0]
    assert pipelined[2][0] == tiny_reference[2][:5] and pipelined[2][1] == "stop"


async def test_a_stop_string_and_an_abort_while_steps_run_ahead(
        tiny_llama_dir: Path, tiny_prompts: list[list[int]],
        tiny_reference: list[list[int]]) -> None:
    engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=256, dtype="float32",
                                      **PLAIN)
    try:
        full = engine.tokenizer.decode(tiny_reference[1], skip_special_tokens=True)
        stop = full[len(full) // 2: len(full) // 2 + 3]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
        outs = [out async for out in engine.generate(tiny_prompts[1], params)]
        assert outs[-1].outputs[0].cumulative_text == full[:full.index(stop)]
        assert_blocks_released(engine.core)

        long = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
        gen = engine.generate(tiny_prompts[3], long, request_id="x")
        for _ in range(3):
            await gen.__anext__()
        await engine.abort("x")
        rest = [out async for out in gen]
        assert rest[-1].outputs[0].finish_reason == "abort"
        assert_blocks_released(engine.core)
        assert engine.core.scheduler.num_steps_ahead > 0
        # The engine goes on, and the next request is unaffected.
        again = [out async for out in engine.generate(tiny_prompts[1], params)]
        assert again[-1].outputs[0].cumulative_text == outs[-1].outputs[0].cumulative_text
    finally:
        await engine.shutdown()


def test_the_runner_refuses_a_step_ahead_of_one_that_did_not_run(tiny_llama_dir: Path) -> None:
    # No speculation: a step after one that proposed drafts is never scheduled ahead.
    llm = LLM(str(tiny_llama_dir), max_model_len=256, dtype="float32", speculative_config=None)
    request = llm.core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4))[0]
    orphan = SchedulerOutput(
        scheduled=[ScheduledRequest(request, 3, [PLACEHOLDER_TOKEN_ID], [0], 1)],
        total_num_scheduled_tokens=1, step_id=99, follows_step=98)
    with pytest.raises(RuntimeError, match="did not complete"):
        llm.core.execute(orphan)
    # After a step that ran, a step ahead of it takes its sampled token as input, gathered
    # from that step's sampled ids where they are (the device's copy on CUDA).
    first = llm.core.schedule()
    output = llm.core.execute(first)
    ahead = llm.core.schedule_ahead(first)
    assert ahead is not None and ahead.follows_step == first.step_id
    assert llm.core.runner._input_ids(ahead).tolist() == output.sampled_token_ids["r"]


async def test_staggered_arrivals_and_aborts_keep_greedy_tokens_and_blocks(
        tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> None:
    """Requests join and leave while steps run ahead (each arrival ends the pipeline for a
    step, each abort frees blocks a queued step still writes): every finished request has
    its solo greedy tokens and every block comes back."""
    rng = random.Random(5)
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(2, 24), ignore_eos=True)
              for _ in tiny_prompts]
    solo, _ = await run_all(tiny_llama_dir, tiny_prompts, params, False)
    engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=256, dtype="float32",
                                      max_num_batched_tokens=48, **PLAIN)
    try:
        async def one(i: int) -> list[int] | None:
            await asyncio.sleep(rng.random() * 0.05)
            tokens: list[int] = []
            abort_after = 3 if i % 3 == 2 else None
            async for out in engine.generate(tiny_prompts[i], params[i], request_id=f"r{i}"):
                tokens += out.outputs[0].token_ids
                if abort_after is not None and len(tokens) >= abort_after and not out.finished:
                    await engine.abort(f"r{i}")
            return None if abort_after is not None else tokens

        results = await asyncio.gather(*(one(i) for i in range(len(tiny_prompts))))
        for i, tokens in enumerate(results):
            if tokens is not None:
                assert tokens == solo[i][0], i
        assert_blocks_released(engine.core)
        assert engine.core.scheduler.num_steps_ahead > 0
    finally:
        await engine.shutdown()
