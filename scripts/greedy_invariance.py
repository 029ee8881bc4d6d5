"""Greedy output of the bundled model (or --model) under every way a step can be formed:
each prompt alone with prefix caching off (the reference), all prompts batched, every
prompt again from a warm prefix cache, prefill in small chunks, and n-gram speculation.
Prints, per mode, how many of the prompts' completions differ from the reference (and
the first that does); exit status 1 when any does.

    .venv/bin/python scripts/greedy_invariance.py --dtype bfloat16 --num-prompts 100
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from aioengine import LLM, SamplingParams

DATA = os.path.join(os.path.dirname(__file__), "..", "aioengine", "bench", "data",
                    "prompts.jsonl")
# Each mode: the engine arguments beside the common ones, and whether the prompts run one by
# one (False: all in one generate call, batched by the scheduler).
MODES: dict[str, tuple[dict, bool]] = {
    "alone": ({"enable_prefix_caching": False}, True),
    "batched": ({"enable_prefix_caching": False}, False),
    "prefix_cached": ({"enable_prefix_caching": True}, False),
    "chunked": ({"enable_prefix_caching": False, "max_num_batched_tokens": 16,
                 "long_prefill_token_threshold": 16}, False),
    "ngram": ({"enable_prefix_caching": False,
               "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                      "prompt_lookup_max": 4, "prompt_lookup_min": 2}}, True),
}


def shipped_prompts(n: int) -> list[list[dict]]:
    """The first n prompts of the bench's shipped prompt list, with "Name three colors."
    first (the case the bf16 mismatch was found on), as chat messages."""
    with open(DATA) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    texts = ["Name three colors."] + [t for t in texts if t != "Name three colors."]
    return [[{"role": "user", "content": t}] for t in texts[:n]]


def run_mode(name: str, prompts: list, engine_args: dict, max_tokens: int) -> list[list[int]]:
    extra, one_by_one = MODES[name]
    llm = LLM(engine_args.pop("model", None), **engine_args, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if name == "prefix_cached":  # fill the cache, then measure the rerun
        llm.generate(prompts, params)
    inputs = prompts  # chat messages, rendered as the server renders them
    if one_by_one:
        outs = [llm.generate(i, params)[0] for i in inputs]
    else:
        outs = llm.generate(inputs, params)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    prompts = shipped_prompts(args.num_prompts)
    base = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization}
    results: dict[str, list[list[int]]] = {}
    failed = False
    for name in ["alone"] + [m for m in args.modes.split(",") if m != "alone"]:
        start = time.perf_counter()
        results[name] = run_mode(name, prompts, dict(base), args.max_tokens)
        ref = results["alone"]
        diff = [i for i, (a, b) in enumerate(zip(ref, results[name])) if a != b]
        failed |= bool(diff)
        first = f" (first: prompt {diff[0]})" if diff else ""
        print(f"{name:14s} {len(diff):3d} / {len(prompts)} differ{first}  "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
