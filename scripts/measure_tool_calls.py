"""What constrained tool calls cost, on the bundled model in-process (no server).

    .venv/bin/python scripts/measure_tool_calls.py [--rounds 5] [--save-json FILE]

Measures (1) the compile time of the tools' structural tag for 1, 4 and 16 tools, cold and
from the cache; (2) one request at a time, greedy: decode speed of a forced call
(`tool_choice` named, and "required") against the same prompt answered as free text, and
the share of a call's tokens that jump-forward appended without a forward step. Prints one
JSON record with the CPU model and flags.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from aioengine import AsyncEngine, SamplingParams
from aioengine.cpu_info import cpu_flags, cpu_model
from aioengine.sampling_params import StructuredOutputs
from aioengine.chat_prompt import render_chat_prompt
from aioengine.server.tools import ToolServingConfig, chat_tool_plan


def tool(i: int) -> dict:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}


def compile_times(engine: AsyncEngine) -> dict[str, float]:
    cache = engine.structured_outputs.compiler
    cache.compile(StructuredOutputs(json_object=True))  # builds the TokenizerInfo first
    out = {}
    for n in (1, 4, 16):
        plan = chat_tool_plan({"tools": [tool(i) for i in range(n)], "tool_choice": "required"},
                              ToolServingConfig())
        constraint = plan.constraint(None, None)
        start = time.perf_counter()
        cache.compile(constraint)
        out[f"compile_ms_{n}_tools"] = round(1e3 * (time.perf_counter() - start), 2)
        start = time.perf_counter()
        cache.compile(constraint)
        out[f"cached_ms_{n}_tools"] = round(1e3 * (time.perf_counter() - start), 3)
    return out


async def one(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> tuple[float, int,
                                                                                    float]:
    """(seconds, output tokens, seconds to the first token)."""
    start = time.perf_counter()
    first = None
    tokens = 0
    async for out in engine.generate(ids, params, f"m-{time.perf_counter_ns()}"):
        if first is None:
            first = time.perf_counter() - start
        tokens += len(out.outputs[0].token_ids)  # outputs are deltas
    return time.perf_counter() - start, tokens, first or 0.0


def case_request(engine: AsyncEngine, choice: object) -> tuple[list[int], SamplingParams]:
    """The prompt (tools offered in every case, so prompts are alike) and its params."""
    tools = [tool(0), tool(1)]
    config = ToolServingConfig()
    plan = chat_tool_plan({"tools": tools, "tool_choice": choice or "required",
                           "parallel_tool_calls": False}, config)
    assert plan is not None
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    ids = render_chat_prompt(engine.tokenizer, messages, [t.chat_dict() for t in plan.tools],
                             plan.parser)
    constraint = plan.constraint(None, None) if choice is not None else None
    return ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=choice is None,
                               structured_outputs=constraint)


async def decode_rates(engine: AsyncEngine, rounds: int) -> dict[str, float]:
    cases = {"text": None, "named": {"type": "function", "function": {"name": "tool_0"}},
             "required": "required"}
    totals = {k: [0.0, 0, 0.0, 0] for k in cases}  # decode s, tokens, ttft s, jumped tokens
    structured = engine.structured_outputs
    for choice in cases.values():  # warm-up: first steps, grammar compiles
        await one(engine, *case_request(engine, choice))
    for _ in range(rounds):
        for name, choice in cases.items():  # interleaved: the machine's drift hits all
            ids, params = case_request(engine, choice)
            jumped = structured.get_stats()["structured_jump_forward_tokens"]
            seconds, tokens, ttft = await one(engine, ids, params)
            t = totals[name]
            t[0] += seconds - ttft
            t[1] += tokens
            t[2] += ttft
            t[3] += structured.get_stats()["structured_jump_forward_tokens"] - jumped
    out: dict[str, float] = {}
    for name, (seconds, tokens, ttft, jumped) in totals.items():
        # Tokens after the first, per second of decoding (jump-forward tokens included).
        out[f"{name}_tokens_per_s"] = round((tokens - rounds) / seconds, 1)
        out[f"{name}_tokens"] = tokens // rounds
        out[f"{name}_ttft_ms"] = round(1e3 * ttft / rounds, 1)
        out[f"{name}_decode_ms"] = round(1e3 * seconds / rounds, 1)
        out[f"{name}_jump_forward_share"] = round(jumped / tokens, 3)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--save-json", default=None)
    args = parser.parse_args()
    engine = await AsyncEngine.create(None)
    try:
        record = {"cpu": cpu_model(), "flags": " ".join(sorted(
            f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))),
            **compile_times(engine), **await decode_rates(engine, args.rounds)}
    finally:
        await engine.shutdown()
    print(json.dumps(record, indent=1))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
