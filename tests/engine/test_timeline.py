"""The step timeline behind `aioengine bench profile`."""
from __future__ import annotations

import asyncio
from pathlib import Path

from aioengine import AsyncEngine, SamplingParams
from aioengine.sched.scheduler_output import DECODE_ROWS_CHUNK
from aioengine.engine.timeline import PHASES


async def test_timeline_records_every_step_with_its_phases(tiny_llama_dir: Path,
                                                           tiny_prompts: list[list[int]]) -> None:
    # No prefix caching: every prompt token is then computed by exactly one step.
    engine = await AsyncEngine.create(str(tiny_llama_dir), max_model_len=256,
                                      max_num_batched_tokens=64, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

        async def run(prompt: list[int]) -> None:
            async for _ in engine.generate(prompt, params):
                pass

        await run(tiny_prompts[0])
        assert engine.timeline.records == []  # off by default
        engine.timeline.enabled = True
        await asyncio.gather(*(run(p) for p in tiny_prompts))
        records = engine.timeline.records
        prompt_tokens = sum(map(len, tiny_prompts))
        assert sum(r.num_tokens for r in records) == prompt_tokens + len(tiny_prompts) * 5
        assert {r.kind for r in records} <= {"prefill", "mixed", "decode"}
        assert records[-1].kind == "decode" and records[0].kind == "prefill"
        assert all(r.forward > 0 and r.wait >= 0 and r.schedule >= 0 for r in records)
        summary = engine.timeline.summary()
        assert summary["all"]["steps"] == len(records)
        assert set(summary["all"]) >= {f"{p}_ms" for p in PHASES} | {"overlap"}
        assert 0.0 <= summary["all"]["overlap"] <= 1.0
        # The step profile names the executor: a step with a prompt chunk longer than
        # DECODE_ROWS_CHUNK runs layerwise, the small decode steps at the end (8 requests
        # or fewer) in the fused C call.
        assert all(r.executor == "layerwise" for r in records
                   if r.num_tokens > DECODE_ROWS_CHUNK * r.num_reqs)
        assert records[-1].num_reqs <= 8 and records[-1].executor == "fused_cpu_decode"
        assert 0.0 < summary["decode"]["fused_share"] <= 1.0
        assert summary["prefill"]["fused_share"] == 0.0
    finally:
        await engine.shutdown()
