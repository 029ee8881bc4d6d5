"""Nothing a caller hands the engine is changed, and a consumer that lags holds one merged
update, not a queue of them."""
from __future__ import annotations

import asyncio
import copy
import json
import random
from pathlib import Path

import pytest

from aioengine import AsyncEngine, SamplingParams
from aioengine.outputs import (CompletionOutput, Logprob, RequestOutput,
                               RequestOutputCollector, merge_request_outputs)
from aioengine.sampling_params import StructuredOutputs

from tests.engine.conftest import assert_blocks_released


@pytest.fixture
async def engine(tiny_llama_dir: Path):
    engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=256, dtype="float32",
                                      max_num_batched_tokens=64)
    yield engine
    await engine.shutdown()


async def final_tokens(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
                       ) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    async for out in engine.generate(prompt, params):
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens


async def test_one_params_object_serves_many_prompts(engine: AsyncEngine) -> None:
    """max_tokens=None means "up to the context" for each prompt: the first prompt's room
    must not stay in the caller's object (it made a longer second prompt a 400)."""
    rng = random.Random(1)
    short = [rng.randrange(100, 4000) for _ in range(10)]
    long = [rng.randrange(100, 4000) for _ in range(200)]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for params in (SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=None, n=2, temperature=1.0, seed=3,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=None, temperature=0,
                                  structured_outputs=StructuredOutputs(json=schema))):
        before = copy.deepcopy(params)
        for prompt in (short, long, short):
            tokens = await final_tokens(engine, prompt, params)
            assert len(tokens) == params.n
            if params.structured_outputs is not None:
                text = engine.tokenizer.decode(tokens[0], skip_special_tokens=True)
                assert isinstance(json.loads(text)["a"], int)
            else:
                assert all(len(t) == 256 - len(prompt) for t in tokens.values())
        assert params == before and params.all_stop_token_ids == set()
    assert_blocks_released(engine.core)


async def test_a_consumer_that_lags_gets_one_merged_update(engine: AsyncEngine,
                                                           tiny_prompts) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    want = await final_tokens(engine, tiny_prompts[2], params)
    gen = engine.generate(tiny_prompts[2], params)
    first = await gen.__anext__()
    while engine.core.has_unfinished_requests():  # not reading while it runs to the end
        await asyncio.sleep(0.01)
    rest = [out async for out in gen]
    assert len(rest) == 1 and rest[0].finished  # everything since `first`, in one update
    c = rest[0].outputs[0]
    assert first.outputs[0].token_ids + c.token_ids == want[0]
    assert len(c.logprobs) == len(c.token_ids) and c.cumulative_token_ids == want[0]
    assert first.outputs[0].text + c.text == c.cumulative_text
    assert_blocks_released(engine.core)


def completion(index: int, tokens: list[int], finished: bool = False) -> CompletionOutput:
    return CompletionOutput(index, "".join(map(str, tokens)), tokens, "", [],
                            [{t: Logprob(-1.0, 1)} for t in tokens], finished,
                            "length" if finished else None)


def test_merge_joins_each_sample_and_keeps_the_later_state() -> None:
    a = RequestOutput("r", [1], [completion(0, [5]), completion(1, [6])], num_cached_tokens=0)
    b = RequestOutput("r", [1], [completion(1, [7], finished=True)], finished=False,
                      num_cached_tokens=16)
    m = merge_request_outputs(a, b)
    assert [c.index for c in m.outputs] == [0, 1]
    assert m.outputs[1].token_ids == [6, 7] and m.outputs[1].text == "67"
    assert [list(p) for p in m.outputs[1].logprobs] == [[6], [7]]
    assert m.outputs[1].finished and m.outputs[1].finish_reason == "length"
    assert m.outputs[0].token_ids == [5] and m.num_cached_tokens == 16


async def test_collector_holds_one_update() -> None:
    collector = RequestOutputCollector()
    for t in range(100):
        collector.put(RequestOutput("r", [1], [completion(0, [t])]))
    assert collector._pending is not None and len(collector._pending.outputs) == 1
    out = await collector.get()
    assert out.outputs[0].token_ids == list(range(100))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(collector.get(), 0.05)
