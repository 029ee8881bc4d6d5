"""The greedy invariances within bf16 and within int8 weights: whatever the engine settings,
the batch around a request or async scheduling, a request's greedy tokens are those the
same storage gives it under the default settings. (Against transformers these storages
are not exact; tests/model/test_llama_vs_hf.py bounds their logit error instead.)"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aioengine import LLM, AsyncEngine, SamplingParams

from tests.engine.conftest import assert_blocks_released
from tests.engine.test_invariance import CONFIGS, GREEDY

# name -> (engine settings, the projections' storage they must give, the KV cache's bytes
# per element: bf16 weights take a bf16 cache by default)
STORAGES = {"bfloat16": (dict(dtype="bfloat16"), "bfloat16", 2),
            "int8": (dict(dtype="float32", quantization="int8"), "int8", 4),
            "w8a8": (dict(dtype="float32", quantization="w8a8"), "w8a8", 4),
            "bf16-kv-cache": (dict(dtype="float32", kv_cache_dtype="bfloat16"), "float32", 2)}


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY)
    assert_blocks_released(llm.core)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=list(STORAGES))
def storage(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(storage: str, tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> list[list[int]]:
    settings, weights, kv_bytes = STORAGES[storage]
    llm = LLM(str(tiny_llama_dir), max_model_len=512, **settings)
    storages = {lin.storage for lin in llm.core.loaded.model.linears()}
    assert storages == {weights}
    assert llm.core.runner.kv_caches[0].dtype.itemsize == kv_bytes
    return _tokens(llm, tiny_prompts)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "default"])
def test_settings_do_not_change_greedy_tokens(name: str, storage: str, reference, tiny_llama_dir,
                                              tiny_prompts) -> None:
    llm = LLM(str(tiny_llama_dir), max_model_len=512, **STORAGES[storage][0], **CONFIGS[name])
    assert _tokens(llm, tiny_prompts) == reference


def test_preemption_and_alone_vs_batched(storage: str, reference, tiny_llama_dir,
                                         tiny_prompts) -> None:
    llm = LLM(str(tiny_llama_dir), block_size=8, num_kv_blocks=12, max_model_len=512,
              **STORAGES[storage][0])
    assert _tokens(llm, tiny_prompts) == reference
    assert llm.core.scheduler.num_preemptions > 0
    for prompt, expected in zip(tiny_prompts[:3], reference[:3]):
        assert _tokens(llm, [prompt]) == [expected]


def test_async_scheduling_with_staggered_arrivals(storage: str, reference, tiny_llama_dir,
                                                  tiny_prompts) -> None:
    # Prefix caching on: two prompts here share blocks within one step, which is what the
    # race fixed in Scheduler._allocate_ahead needed (it changed a request's tokens in up
    # to half the runs on a loaded machine, whatever the storage).
    settings = dict(STORAGES[storage][0])

    async def main() -> list[list[int]]:
        engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=512,
                                          async_scheduling=True, **settings)

        async def one(i: int, prompt: list[int]) -> list[int]:
            await asyncio.sleep(0.01 * i)
            tokens: list[int] = []
            async for out in engine.generate(prompt, GREEDY):
                tokens = out.outputs[0].cumulative_token_ids
            return tokens

        async with engine:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(tiny_prompts)))

    assert asyncio.run(main()) == reference
