"""`aioengine bench profile`: the engine's own per-step timeline on a workload.

Runs the workload through AsyncEngine (the serving loop, with its overlap) with the step
timeline on, then prints the mean time of each phase per step kind (prefill-only, mixed,
decode-only) and how much of the loop's in-step work was hidden behind the worker. With
`--plot PATH.png` it also draws the run (bench/timeline_plot.py): each request's bar
(queued, prefill, decode), the steps' composition over time, TTFT and ITL; and the same
beside the table in a self-contained PATH.html.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from aioengine.bench.common import add_workload_args, emit, run_config
from aioengine.bench.datasets import Workload, build_workload


async def run_profile(workload: Workload, model: str | None,
                      engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    from aioengine import AsyncEngine, SamplingParams

    engine = await AsyncEngine.create(model, **engine_kwargs)
    try:
        async def one(prompt: list[int], output_len: int) -> dict[str, Any]:
            """The request's times (time.monotonic(), the steps' clock): arrival, first
            scheduled, each output's arrival at the caller, finish."""
            params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
            times: dict[str, Any] = {"arrival": time.monotonic(), "outputs": [],
                                     "num_prompt_tokens": len(prompt)}
            async for out in engine.generate(prompt, params):
                times["outputs"].append(time.monotonic())
                times["scheduled"] = out.metrics.get("first_scheduled_time")
            times["finish"] = times["outputs"][-1]
            return times

        await one(workload.prompts[0][:16], 4)  # warm-up, not recorded
        engine.timeline.enabled = True
        start, origin = time.perf_counter(), time.monotonic()
        requests = await asyncio.gather(*(one(r.prompt_token_ids, r.output_len)
                                          for r in workload.requests))
        elapsed = time.perf_counter() - start
        timeline = engine.timeline
        return {"elapsed_s": elapsed, "summary": timeline.summary(),
                "steps": timeline.to_json(), "origin": origin, "requests": requests}
    finally:
        await engine.shutdown()


def format_profile(report: dict[str, Any]) -> str:
    # Deferred: `aioengine bench --help` builds this module's parser and loads no engine.
    from aioengine.engine.timeline import PHASES

    summary = report["summary"]
    head = f"{'phase (mean ms/step)':22s}" + "".join(f"{k:>10s}" for k in summary)
    lines = [f"elapsed {report['elapsed_s']:.2f} s", head]
    for key in ("steps", "tokens_per_step", *(f"{p}_ms" for p in PHASES), "overlap",
                "fused_share"):
        fmt = "{:>10.0f}" if key == "steps" else "{:>10.2f}"
        lines.append(f"{key:22s}" + "".join(fmt.format(row[key]) for row in summary.values()))
    lines.append("worker = prepare + forward + sample; loop = schedule + process + update; "
                 "overlap = share of the loop's in-step work (process) hidden behind the worker; "
                 "fused_share = share of steps whose layers the fused CPU decode executor ran")
    return "\n".join(lines)


def add_profile_parser(sub: Any) -> None:
    from aioengine.config import add_engine_args

    p = sub.add_parser("profile", help="the engine's per-step timeline on a workload")
    add_workload_args(p)
    add_engine_args(p)
    p.set_defaults(func=profile_main)


def profile_main(args: argparse.Namespace) -> int:
    import aioengine.bench.report as rep
    from aioengine.bench.offline import load_hf_tokenizer
    from aioengine.config import engine_kwargs
    from aioengine.model.default import bundled_model_path

    model = args.model or bundled_model_path()
    workload = build_workload(args, load_hf_tokenizer(args.tokenizer or model))
    report = {"mode": "profile", "environment": rep.environment_info(), "model": model,
              "config": run_config(args), "workload": workload.summary(),
              **asyncio.run(run_profile(workload, model, engine_kwargs(args)))}
    emit(report, format_profile(report), args.save_json)
    if args.plot:
        import aioengine.bench.timeline_plot as tplot

        html = tplot.plot_profile(args.plot, report, format_profile(report))
        print(f"saved {args.plot} and {html}", file=sys.stderr)
    return 0
