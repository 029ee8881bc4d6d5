"""Multi-LoRA through the engine: greedy tokens equal transformers + peft for every request
of a mixed batch, under prefix caching, chunked prefill, preemption, async scheduling,
n > 1 and speculative decoding; slots and the CPU cache stay within their limits; every
KV block comes back."""
from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path

import pytest

from aioengine import LLM, AsyncEngine, LoRARequest, SamplingParams, StructuredOutputs
from aioengine.errors import NotFoundError
from tests.engine.conftest import assert_blocks_released
from tests.lora.conftest import NEW_TOKENS

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _assignments(names, n):
    """Adapter (or None) per prompt, round-robin over the base model and the adapters."""
    cycle = itertools.cycle([None, *names])
    return [next(cycle) for _ in range(n)]


def _requests(adapter_dirs, assigned):
    return [None if a is None else LoRARequest(a, str(adapter_dirs[a])) for a in assigned]


@pytest.mark.parametrize("settings", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),  # chunked prefill, chunks of several adapters
    dict(num_kv_blocks=12, max_model_len=64),  # preemption by recompute
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_min": 1}),
], ids=["default", "no-prefix-cache", "chunked", "preempt", "ngram"])
def test_llm_mixed_adapters_match_peft(lora_model_dir: Path, adapter_dirs, lora_prompts,
                                       peft_greedy, settings) -> None:
    llm = LLM(str(lora_model_dir), dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=8, **settings)
    assigned = _assignments(list(adapter_dirs), len(lora_prompts) * 2)
    prompts = lora_prompts * 2
    outs = llm.generate(prompts, GREEDY, _requests(adapter_dirs, assigned))
    for i, (a, out) in enumerate(zip(assigned, outs)):
        assert out.outputs[0].token_ids == peft_greedy[a][i % len(lora_prompts)], (i, a)
    if "num_kv_blocks" in settings:
        assert llm.core.scheduler.num_preemptions > 0
    assert_blocks_released(llm.core)


def test_prefix_cache_keeps_adapters_and_reloads_apart(lora_model_dir: Path, adapter_dirs,
                                                       lora_prompts, peft_greedy) -> None:
    llm = LLM(str(lora_model_dir), dtype="float32", enable_lora=True, max_lora_rank=8)
    prompt = lora_prompts[2]  # 40 tokens: two full blocks of 16
    a1 = LoRARequest("a1", str(adapter_dirs["a1"]))

    def run(lora):
        out = llm.generate([prompt], GREEDY, lora)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    assert run(a1) == (peft_greedy["a1"][2], 0)
    assert run(a1) == (peft_greedy["a1"][2], 32)  # the same adapter reuses its blocks
    assert run(None) == (peft_greedy[None][2], 0)  # the base model does not
    assert run(LoRARequest("a2", str(adapter_dirs["a2"])))[1] == 0
    # Reloaded under the same name from other weights: a new load, never the old blocks.
    llm.core.admission.remove_lora("a1")
    assert run(LoRARequest("a1", str(adapter_dirs["a3"]))) == (peft_greedy["a3"][2], 0)
    assert_blocks_released(llm.core)


def test_max_loras_per_step_and_cpu_lru(lora_model_dir: Path, adapter_dirs, lora_prompts,
                                        peft_greedy) -> None:
    llm = LLM(str(lora_model_dir), dtype="float32", enable_lora=True, max_loras=2,
              max_cpu_loras=2, max_lora_rank=8)
    manager = llm.core.lora
    seen = []
    real = manager.assign_slots
    manager.assign_slots = (lambda items: seen.append({x.lora_name for x, _ in items if x})
                            or real(items))
    assigned = _assignments(list(adapter_dirs), len(lora_prompts) * 3)
    outs = llm.generate(lora_prompts * 3, GREEDY, _requests(adapter_dirs, assigned))
    for i, (a, out) in enumerate(zip(assigned, outs)):
        assert out.outputs[0].token_ids == peft_greedy[a][i % len(lora_prompts)]
    assert max(len(s) for s in seen) == 2  # never three adapters in one step
    stats = llm.core.stats()
    assert stats["lora_num_cpu"] <= 2 and stats["lora_num_registered"] == 3
    assert stats["lora_cpu_bytes"] > 0 and stats["lora_slot_bytes"] > 0
    # a1 was evicted from the CPU cache by a3; using it again reads it from disk again.
    out = llm.generate([lora_prompts[0]], GREEDY, LoRARequest("a1"))[0]
    assert out.outputs[0].token_ids == peft_greedy["a1"][0]
    assert_blocks_released(llm.core)


async def test_async_engine_adapters_n_structured_and_unload(lora_model_dir: Path,
                                                             adapter_dirs, lora_prompts,
                                                             peft_greedy) -> None:
    engine = await AsyncEngine.create(str(lora_model_dir), dtype="float32", enable_lora=True,
                                      max_loras=2, max_lora_rank=8)
    try:
        a1 = await engine.add_lora(LoRARequest("a1", str(adapter_dirs["a1"])))
        assert [x.lora_name for x in engine.list_loras()] == ["a1"] and a1.lora_int_id > 0

        async def final(prompt, params, lora):
            outs = [o async for o in engine.generate(prompt, params, lora_request=lora)]
            return outs[-1]

        # Mixed adapters at once, async scheduling on; a2 loaded on first use by its path.
        jobs = [final(p, GREEDY, lora) for p, lora in zip(
            lora_prompts, [LoRARequest("a1"), None, LoRARequest("a2", str(adapter_dirs["a2"])),
                           LoRARequest("a1"), None])]
        outs = await asyncio.gather(*jobs)
        expect = ["a1", None, "a2", "a1", None]
        for i, (out, a) in enumerate(zip(outs, expect)):
            assert out.outputs[0].cumulative_token_ids == peft_greedy[a][i]
        # Structured output under an adapter: the constraint holds.
        out = await final(lora_prompts[0], SamplingParams(
            temperature=0, max_tokens=20,
            structured_outputs=StructuredOutputs(regex="(yes|no)-[0-9]{3}")), a1)
        assert re.fullmatch("(yes|no)-[0-9]{3}", out.outputs[0].cumulative_text)
        # n > 1 (forks share the adapter's prompt blocks): every greedy sample the same.
        out = await final(lora_prompts[1], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True, n=3), a1)
        assert [c.cumulative_token_ids for c in out.outputs] == [peft_greedy["a1"][1]] * 3
        # Unloading while a request runs on it: that request finishes, new ones are refused.
        gen = engine.generate(lora_prompts[2], SamplingParams(max_tokens=30, ignore_eos=True),
                              lora_request=a1)
        first = await gen.__anext__()
        await engine.remove_lora("a1")
        rest = [o async for o in gen]
        assert (rest[-1] if rest else first).finished
        assert (rest[-1] if rest else first).outputs[0].finish_reason == "length"
        with pytest.raises(NotFoundError, match="a1"):
            await final(lora_prompts[0], GREEDY, LoRARequest("a1"))
        with pytest.raises(NotFoundError):
            await engine.remove_lora("a1")
        assert_blocks_released(engine.core)
    finally:
        await engine.shutdown()
