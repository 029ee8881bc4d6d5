"""Fair prefill, measured: a short chat's TTFT alone and while a long prompt prefills, for
several --long-prefill-token-threshold values (one engine each, in one process), with
the long prompt's own time to first token. Prints one JSON line per setting.

    .venv/bin/python scripts/fair_prefill.py --thresholds 0,128,64 --long-len 8000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from aioengine import AsyncEngine, SamplingParams
from aioengine.cpu_info import cpu_model, relevant_flags

SHORT = [{"role": "user", "content": "Name three colors."}]


async def ttft(engine: AsyncEngine, prompt, max_tokens: int = 1) -> float:
    start = time.perf_counter()
    async for _ in engine.generate(prompt, SamplingParams(temperature=0.0,
                                                          max_tokens=max_tokens)):
        return time.perf_counter() - start
    raise RuntimeError("no output")


async def measure(threshold: int, long_len: int, delay: float, repeats: int) -> dict:
    engine = await AsyncEngine.create(long_prefill_token_threshold=threshold)
    try:
        vocab = engine.tokenizer.vocab_size
        alone = [await ttft(engine, SHORT) for _ in range(repeats + 1)][1:]
        contended, long_ttfts = [], []
        for r in range(repeats):
            rng = random.Random(r)
            long_prompt = [rng.randrange(100, vocab - 100) for _ in range(long_len)]
            long_task = asyncio.create_task(ttft(engine, long_prompt))
            await asyncio.sleep(delay)
            contended.append(await ttft(engine, SHORT))
            long_ttfts.append(await long_task)
        return {"threshold": threshold, "short_ttft_alone_s": statistics.median(alone),
                "short_ttft_during_long_s": statistics.median(contended),
                "ratio": statistics.median(contended) / statistics.median(alone),
                "long_ttft_s": statistics.median(long_ttfts), "long_len": long_len}
    finally:
        await engine.shutdown()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--thresholds", default="0,128,64")
    p.add_argument("--long-len", type=int, default=8000)
    p.add_argument("--delay", type=float, default=1.0, help="seconds into the long prefill")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(json.dumps({"cpu": cpu_model(), "flags": relevant_flags()}))
    for threshold in (int(t) for t in args.thresholds.split(",")):
        print(json.dumps(await measure(threshold, args.long_len, args.delay, args.repeats)),
              flush=True)


if __name__ == "__main__":
    asyncio.run(main())
