"""The runner's asynchronous output (the CUDA hand-over, worker/async_output.py) on the CPU:
forced on, every plain step hands an AsyncModelRunnerOutput to the loop, which resolves it
there; tokens and logprobs equal the synchronous path's, with async scheduling's device-side
input ids in the steady state."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioengine import AsyncEngine, SamplingParams
from aioengine.config import gpu_kv_cache_budget
from aioengine.sched.scheduler_output import ModelRunnerOutput
from aioengine.model.attention import to_device
from aioengine.worker.async_output import AsyncModelRunnerOutput, resolve_now

from tests.engine.conftest import assert_blocks_released


def test_the_async_output_is_read_once() -> None:
    reads = []
    out = ModelRunnerOutput(sampled_token_ids={"r": [3]})
    pending = AsyncModelRunnerOutput(None, lambda: reads.append(1) or out)
    assert pending.is_ready() and reads == []  # nothing read before it is asked for
    assert resolve_now(pending) is out and pending.get_output() is out and reads == [1]
    assert resolve_now(out) is out


def test_host_tensors_stay_where_they_are_on_the_cpu() -> None:
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t


def test_the_gpu_kv_budget() -> None:
    gib = 2**30
    # 0.9 of 140 GiB, less a 17 GiB profiling peak and 1 GiB outside torch.
    assert gpu_kv_cache_budget(140 * gib, 0.9, 17 * gib, gib) == int(126 * gib) - 18 * gib
    assert gpu_kv_cache_budget(16 * gib, 0.5, 9 * gib, 0) == 0


async def _run(model_dir: Path, prompts: list[list[int]], async_output: bool,
               ) -> tuple[list, int]:
    # No speculation: a step that proposes drafts reads its output at once.
    engine = await AsyncEngine.create(str(model_dir), max_model_len=256, dtype="float32",
                                      speculative_config=None)
    runner = engine.core.runner
    runner.async_output = async_output
    handed = []
    execute = runner.execute_model
    runner.execute_model = lambda *a: (lambda o: handed.append(type(o)) or o)(execute(*a))
    try:
        cases = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                 SamplingParams(temperature=0.8, seed=7, max_tokens=10, logprobs=2, n=2,
                                ignore_eos=True)]
        results = []
        for params in cases:
            for i, prompt in enumerate(prompts[:3]):
                # Outputs carry the new tokens since the last one the consumer took, so how
                # they are grouped depends on timing: join them per sample.
                samples: dict[int, tuple[list, list]] = {}
                async for out in engine.generate(prompt, params, f"r{len(results)}"):
                    for c in out.outputs:
                        ids, lps = samples.setdefault(c.index, ([], []))
                        ids.extend(c.token_ids)
                        lps.extend(sorted(lp.items()) for lp in c.logprobs or [])
                results.append(sorted(samples.items()))
        assert_blocks_released(engine.core)
        if async_output:
            assert handed and all(t is AsyncModelRunnerOutput for t in handed)
        else:
            assert handed and all(t is ModelRunnerOutput for t in handed)
        return results, engine.core.scheduler.num_steps_ahead
    finally:
        await engine.shutdown()


async def test_async_output_equals_the_synchronous_path(
        tiny_llama_dir: Path, tiny_prompts: list[list[int]]) -> None:
    expected, _ = await _run(tiny_llama_dir, tiny_prompts, False)
    got, steps_ahead = await _run(tiny_llama_dir, tiny_prompts, True)
    assert got == expected
    assert steps_ahead > 0  # steps ahead took their input ids from the device copy
