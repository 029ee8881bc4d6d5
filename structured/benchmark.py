"""Structured-output benchmark: per-token cost of a JSON-schema constraint, grammar compile
time, and the forward steps jump-forward saves.

    python -m aioengine.structured.benchmark [--num-prompts 16] [--max-tokens 96]

Three runs of the same chat prompts, all submitted at once to one AsyncEngine:
unconstrained (ignore_eos, as many tokens as the constrained run's mean, so the batch stays
comparable), JSON schema without jump-forward, JSON schema with it, `--repeats` times in
turn (medians reported: the machine may be shared). TPOT per request is
(last token time - first token time) / (tokens - 1), averaged over requests. The bitmask's
own CPU cost (fill on the loop, apply in the runner) is timed separately per step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

from aioengine.engine.async_engine import AsyncEngine
from aioengine.sampling_params import SamplingParams, StructuredOutputs
from aioengine.structured.bitmask import GrammarBitmask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "zip": {"type": "string", "pattern": "[0-9]{5}"}}, "required": ["city", "zip"]},
    "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "hiking", "cooking"]},
                "maxItems": 3},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "address", "hobbies", "employed"]}
# Extra constraints timed for compile cost only.
COMPILE_SET = [StructuredOutputs(json=SCHEMA), StructuredOutputs(json_object=True),
               StructuredOutputs(regex=r"\+?[0-9]{1,3}-[0-9]{3}-[0-9]{4}"),
               StructuredOutputs(choice=["positive", "negative", "neutral"]),
               StructuredOutputs(grammar='root ::= item ("," item)*\nitem ::= [a-z]+')]
TOPICS = ["a teacher", "a painter", "a pilot", "a chef", "a nurse", "a farmer", "a coder",
          "a singer"]


@dataclass
class RunResult:
    tpot_ms: float
    mean_tokens: float
    wall_s: float
    steps: int


async def _one(engine: AsyncEngine, prompt: list[dict], params: SamplingParams,
               times: list[tuple[float, float, int]]) -> None:
    first = last = 0.0
    tokens = 0
    async for out in engine.generate(prompt, params):
        now = time.perf_counter()
        first = first or now
        last = now
        tokens = len(out.outputs[0].cumulative_token_ids)
    times.append((first, last, tokens))


async def _run(engine: AsyncEngine, prompts: list[list[dict]],
               params: SamplingParams) -> RunResult:
    steps = 0
    execute = engine.core.execute

    def counting(scheduler_output):  # type: ignore[no-untyped-def]
        nonlocal steps
        steps += 1
        return execute(scheduler_output)

    engine.core.execute = counting  # type: ignore[method-assign]
    times: list[tuple[float, float, int]] = []
    start = time.perf_counter()
    await asyncio.gather(*(_one(engine, p, params, times) for p in prompts))
    wall = time.perf_counter() - start
    del engine.core.execute
    tpots = [(last - first) / (n - 1) * 1e3 for first, last, n in times if n > 1]
    return RunResult(statistics.mean(tpots), statistics.mean(n for _, _, n in times), wall,
                     steps)


def _timed(fn, acc: dict[str, float], name: str):  # type: ignore[no-untyped-def]
    def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - start
            acc[name + "_calls"] += 1
    return wrapper


def _median_run(runs: list[RunResult]) -> RunResult:
    return RunResult(*(statistics.median(getattr(r, f) for r in runs)
                       for f in ("tpot_ms", "mean_tokens", "wall_s", "steps")))


async def main(args: argparse.Namespace) -> None:
    engine = await AsyncEngine.create(num_kv_blocks=1024, max_num_seqs=max(64, args.num_prompts))
    prompts = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON "
                 f"(person #{i})."}] for i in range(args.num_prompts)]
    manager = engine.core.structured
    start = time.perf_counter()  # the first compile also builds xgrammar's TokenizerInfo
    await manager.compile_async(StructuredOutputs(regex="x"))
    tokenizer_info_ms = (time.perf_counter() - start) * 1e3
    compile_ms = []
    for constraint in COMPILE_SET:
        start = time.perf_counter()
        await manager.compile_async(constraint)
        compile_ms.append((constraint.key[0], (time.perf_counter() - start) * 1e3))
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    # Warm-up (first-step allocations), not measured.
    await _run(engine, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))
    acc = {"fill": 0.0, "fill_calls": 0, "apply": 0.0, "apply_calls": 0}
    GrammarBitmask.fill = _timed(GrammarBitmask.fill, acc, "fill")  # type: ignore
    GrammarBitmask.apply = _timed(GrammarBitmask.apply, acc, "apply")  # type: ignore
    runs: dict[str, list[RunResult]] = {"plain": [], "no_jf": [], "jf": []}
    jf_tokens = 0
    for _ in range(args.repeats):
        manager.jump_forward = False
        runs["no_jf"].append(await _run(engine, prompts, constrained))
        manager.jump_forward = True
        jf_before = manager.stats.num_jump_forward_tokens
        runs["jf"].append(await _run(engine, prompts, constrained))
        jf_tokens = manager.stats.num_jump_forward_tokens - jf_before
        runs["plain"].append(await _run(engine, prompts, SamplingParams(
            temperature=0.0, ignore_eos=True,
            max_tokens=max(2, round(runs["no_jf"][-1].mean_tokens)))))
    await engine.shutdown()
    plain, no_jf, with_jf = (_median_run(runs[k]) for k in ("plain", "no_jf", "jf"))
    report = {
        "num_prompts": args.num_prompts,
        "tokenizer_info_ms": round(tokenizer_info_ms, 1),
        "compile_ms": {k: round(v, 2) for k, v in compile_ms},
        # Includes the wait for the loop's fill (zero when the fill finished first).
        "bitmask_fill_ms_per_step": 1e3 * acc["fill"] / max(1, acc["fill_calls"]),
        "bitmask_apply_ms_per_step": 1e3 * acc["apply"] / max(1, acc["apply_calls"]),
        "tpot_ms_runs": {k: [round(r.tpot_ms, 1) for r in v] for k, v in runs.items()},
        "unconstrained": vars(plain), "json_schema_no_jump_forward": vars(no_jf),
        "json_schema_jump_forward": vars(with_jf),
        "tpot_ratio_no_jump_forward": no_jf.tpot_ms / plain.tpot_ms,
        "tpot_ratio_jump_forward": with_jf.tpot_ms / plain.tpot_ms,
        "jump_forward_tokens": jf_tokens,
        "jump_forward_tokens_per_request": jf_tokens / args.num_prompts,
        "forward_steps_saved": no_jf.steps - with_jf.steps,
    }
    print(json.dumps(report, indent=2, default=lambda x: round(x, 3)))


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
