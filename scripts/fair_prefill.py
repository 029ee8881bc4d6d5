"""Fair prefill, measured: a short chat's TTFT alone and while a long prompt prefills (one
short chat every --interval seconds from --delay on, until the long prompt's first token),
for several (--long-prefill-token-threshold, --long-prefill-attention-budget) settings
(one engine each, in one process), with the long prompt's own time to first token.
Prints one JSON line per setting.

    .venv/bin/python scripts/fair_prefill.py --settings 0:0,128:0,128:16384 --long-len 8000
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


async def measure(threshold: int, attention_budget: int, args: argparse.Namespace) -> dict:
    engine = await AsyncEngine.create(long_prefill_token_threshold=threshold,
                                      long_prefill_attention_budget=attention_budget)
    try:
        vocab = engine.tokenizer.vocab_size
        alone = [await ttft(engine, SHORT) for _ in range(args.repeats * 4 + 1)][1:]
        contended, long_ttfts = [], []
        for r in range(args.repeats):
            rng = random.Random(r)
            long_prompt = [rng.randrange(100, vocab - 100) for _ in range(args.long_len)]
            long_task = asyncio.create_task(ttft(engine, long_prompt))
            await asyncio.sleep(args.delay)
            while not long_task.done():
                contended.append(await ttft(engine, SHORT))
                await asyncio.sleep(args.interval)
            long_ttfts.append(await long_task)
        base = statistics.median(alone)
        return {"threshold": threshold, "attention_budget": attention_budget,
                "short_ttft_alone_s": round(base, 4),
                "short_ttft_during_long_s": {
                    "median": round(statistics.median(contended), 4),
                    "max": round(max(contended), 4), "n": len(contended)},
                "ratio_median": round(statistics.median(contended) / base, 2),
                "ratio_max": round(max(contended) / base, 2),
                "long_ttft_s": round(statistics.median(long_ttfts), 2),
                "long_len": args.long_len}
    finally:
        await engine.shutdown()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--settings", default="0:0,128:0,128:16384",
                   help="threshold:attention_budget pairs, comma-separated")
    p.add_argument("--long-len", type=int, default=8000)
    p.add_argument("--delay", type=float, default=1.0,
                   help="seconds into the long prefill of the first short chat")
    p.add_argument("--interval", type=float, default=3.0,
                   help="seconds between short chats while the long prompt prefills")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    print(json.dumps({"cpu": cpu_model(), "flags": relevant_flags()}))
    for setting in args.settings.split(","):
        threshold, budget = (int(v) for v in setting.split(":"))
        print(json.dumps(await measure(threshold, budget, args)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
