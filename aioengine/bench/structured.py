"""`structured` mode: the per-token cost of a JSON-schema constraint, grammar compile times,
and the forward steps jump-forward saves.

    aioengine bench structured [--num-prompts 16] [--output-len 96] [--repeats 3]
                               [--save-json PATH] [engine flags]

Three runs of the same chat prompts, all submitted at once to one AsyncEngine: JSON schema
without jump-forward, JSON schema with it, and unconstrained (ignore_eos, as many tokens as
the constrained run's mean, so the batch stays comparable), `--repeats` times in turn
(medians reported: the machine may be shared). TPOT per request is (last token time -
first token time) / (tokens - 1), averaged over requests. Forward steps are the engine's
own step timeline (`engine.timeline`, as `profile` reads it): every step the loop ran. The
bitmask's own CPU cost (fill on the loop, apply in the runner) is timed separately per step.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from aioengine.sampling_params import SamplingParams, StructuredOutputs

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
RUNS = {"plain": "unconstrained", "no_jf": "JSON schema, jump-forward off",
        "jf": "JSON schema, jump-forward on"}


@dataclass
class RunResult:
    tpot_ms: float
    mean_tokens: float
    wall_s: float
    steps: int


def add_structured_parser(sub: Any) -> None:
    from aioengine.config import add_engine_args

    p = sub.add_parser("structured", help="JSON-schema constraint: TPOT vs unconstrained, "
                       "compile times, forward steps saved by jump-forward")
    p.add_argument("--num-prompts", type=int, default=16, help="chat prompts, all submitted at once (--max-num-seqs "
                   "of them run together)")
    p.add_argument("--output-len", type=int, default=96, help="greedy tokens at most")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three runs")
    p.add_argument("--save-json", default=None, metavar="PATH",
                   help="config, environment and the report")
    add_engine_args(p)
    p.set_defaults(func=structured_main, num_kv_blocks=1024)


def prompts(num_prompts: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON "
              f"(person #{i})."}] for i in range(num_prompts)]


async def _one(engine: Any, prompt: list[dict], params: SamplingParams,
               times: list[tuple[float, float, int]]) -> None:
    first = last = 0.0
    tokens = 0
    async for out in engine.generate(prompt, params):
        now = time.perf_counter()
        first = first or now
        last = now
        tokens = len(out.outputs[0].cumulative_token_ids)
    times.append((first, last, tokens))


async def _run(engine: Any, chats: list[list[dict]], params: SamplingParams) -> RunResult:
    """All prompts at once; the steps are the timeline's records of this run. None of these
    requests is ever scheduled ahead (grammars and ignore_eos+max_tokens rule it out), so
    every step has been recorded by the time the last output arrives."""
    engine.timeline.records.clear()
    times: list[tuple[float, float, int]] = []
    start = time.perf_counter()
    await asyncio.gather(*(_one(engine, chat, params, times) for chat in chats))
    wall = time.perf_counter() - start
    tpots = [(last - first) / (n - 1) * 1e3 for first, last, n in times if n > 1]
    return RunResult(statistics.mean(tpots) if tpots else float("nan"),
                     statistics.mean(n for _, _, n in times), wall,
                     len(engine.timeline.records))


def _median_run(runs: list[RunResult]) -> RunResult:
    return RunResult(*(statistics.median(getattr(r, f) for r in runs)
                       for f in ("tpot_ms", "mean_tokens", "wall_s", "steps")))


@contextlib.contextmanager
def _timed_bitmask(acc: dict[str, float]) -> Iterator[None]:
    """Times GrammarBitmask.fill and .apply (every engine's) while the block runs."""
    from aioengine.structured.bitmask import GrammarBitmask

    originals = {name: getattr(GrammarBitmask, name) for name in ("fill", "apply")}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += time.perf_counter() - start
                acc[name + "_calls"] += 1
        return wrapper

    for name, fn in originals.items():
        setattr(GrammarBitmask, name, timed(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(GrammarBitmask, name, fn)


async def _compile_times(manager: Any) -> dict[str, Any]:
    start = time.perf_counter()  # the first compile also builds xgrammar's TokenizerInfo
    await manager.compile_async(StructuredOutputs(regex="x"))
    tokenizer_info_ms = (time.perf_counter() - start) * 1e3
    compile_ms = {}
    for constraint in COMPILE_SET:
        start = time.perf_counter()
        await manager.compile_async(constraint)
        compile_ms[constraint.key[0]] = round((time.perf_counter() - start) * 1e3, 2)
    return {"tokenizer_info_ms": round(tokenizer_info_ms, 1), "compile_ms": compile_ms}


async def _rounds(engine: Any, chats: list[list[dict]], output_len: int,
                  repeats: int) -> tuple[dict[str, list[RunResult]], int]:
    """The three runs, `repeats` times; also the jump-forward tokens of the last jf run."""
    manager = engine.structured_outputs
    constrained = SamplingParams(temperature=0.0, max_tokens=output_len,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    runs: dict[str, list[RunResult]] = {"plain": [], "no_jf": [], "jf": []}
    jf_tokens = 0
    for _ in range(repeats):
        manager.jump_forward = False
        runs["no_jf"].append(await _run(engine, chats, constrained))
        manager.jump_forward = True
        jf_before = manager.stats.num_jump_forward_tokens
        runs["jf"].append(await _run(engine, chats, constrained))
        jf_tokens = manager.stats.num_jump_forward_tokens - jf_before
        runs["plain"].append(await _run(engine, chats, SamplingParams(
            temperature=0.0, ignore_eos=True,
            max_tokens=max(2, round(runs["no_jf"][-1].mean_tokens)))))
    return runs, jf_tokens


async def run_structured(model: str | None, engine_kwargs: dict[str, Any], num_prompts: int,
                         output_len: int, repeats: int) -> dict[str, Any]:
    from aioengine import AsyncEngine

    engine = await AsyncEngine.create(model, **engine_kwargs)
    chats = prompts(num_prompts)
    acc = {"fill": 0.0, "fill_calls": 0, "apply": 0.0, "apply_calls": 0}
    try:
        compiled = await _compile_times(engine.structured_outputs)
        # Warm-up (first-step allocations), not measured; ignore_eos so that no step is
        # scheduled ahead in vain and recorded in the first run.
        await _run(engine, chats[:2], SamplingParams(temperature=0.0, max_tokens=4,
                                                     ignore_eos=True))
        engine.timeline.enabled = True
        with _timed_bitmask(acc):
            runs, jf_tokens = await _rounds(engine, chats, output_len, repeats)
    finally:
        await engine.shutdown()
    return {**compiled, **summarize(runs, jf_tokens, num_prompts, acc)}


def summarize(runs: dict[str, list[RunResult]], jf_tokens: int, num_prompts: int,
              acc: dict[str, float]) -> dict[str, Any]:
    plain, no_jf, with_jf = (_median_run(runs[k]) for k in ("plain", "no_jf", "jf"))
    return {
        # Includes the wait for the loop's fill (zero when the fill finished first).
        "bitmask_fill_ms_per_step": 1e3 * acc["fill"] / max(1, acc["fill_calls"]),
        "bitmask_apply_ms_per_step": 1e3 * acc["apply"] / max(1, acc["apply_calls"]),
        "tpot_ms_runs": {k: [round(r.tpot_ms, 1) for r in v] for k, v in runs.items()},
        "unconstrained": asdict(plain), "json_schema_no_jump_forward": asdict(no_jf),
        "json_schema_jump_forward": asdict(with_jf),
        "tpot_ratio_no_jump_forward": no_jf.tpot_ms / plain.tpot_ms,
        "tpot_ratio_jump_forward": with_jf.tpot_ms / plain.tpot_ms,
        "jump_forward_tokens": jf_tokens,
        "jump_forward_tokens_per_request": jf_tokens / num_prompts,
        "forward_steps_saved": no_jf.steps - with_jf.steps,
    }


def format_structured(report: dict[str, Any]) -> str:
    from aioengine.bench.report import cpu_line

    keys = {"plain": "unconstrained", "no_jf": "json_schema_no_jump_forward",
            "jf": "json_schema_jump_forward"}
    base = report[keys["plain"]]["tpot_ms"]
    lines = [cpu_line(report["environment"]),
             f"{report['num_prompts']} chat prompts at once, greedy, <= "
             f"{report['output_len']} tokens, medians of {report['repeats']} rounds",
             f"{'run':<30} {'TPOT ms':>8} {'ratio':>6} {'tokens':>7} {'steps':>6}"]
    for key, label in RUNS.items():
        r = report[keys[key]]
        lines.append(f"{label:<30} {r['tpot_ms']:>8.1f} {r['tpot_ms'] / base:>5.2f}x "
                     f"{r['mean_tokens']:>7.1f} {r['steps']:>6.0f}")
    compile_ms = ", ".join(f"{k} {v:.1f}" for k, v in report["compile_ms"].items())
    lines += [f"forward steps saved by jump-forward: {report['forward_steps_saved']:.0f} "
              f"({report['jump_forward_tokens']} forced tokens, "
              f"{report['jump_forward_tokens_per_request']:.1f} per request)",
              f"bitmask ms/step: fill {report['bitmask_fill_ms_per_step']:.2f}, apply "
              f"{report['bitmask_apply_ms_per_step']:.2f}",
              f"compile ms: TokenizerInfo {report['tokenizer_info_ms']:.1f}, {compile_ms}"]
    return "\n".join(lines)


def structured_main(args: argparse.Namespace) -> int:
    from aioengine.bench.common import emit, run_config
    from aioengine.bench.report import environment_info
    from aioengine.config import engine_kwargs

    if args.num_prompts < 1 or args.output_len < 2 or args.repeats < 1:
        raise SystemExit("need --num-prompts >= 1, --output-len >= 2 (TPOT) and --repeats >= 1")
    result = asyncio.run(run_structured(args.model, engine_kwargs(args), args.num_prompts,
                                        args.output_len, args.repeats))
    report = {"mode": "structured", "environment": environment_info(), "model": args.model,
              "config": run_config(args), "num_prompts": args.num_prompts,
              "output_len": args.output_len, "repeats": args.repeats, **result}
    emit(report, format_structured(report), args.save_json)
    return 0
