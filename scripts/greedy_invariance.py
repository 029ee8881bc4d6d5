"""Greedy output of the bundled model (or --model) under every way a step can be formed:
each prompt alone with prefix caching off (the reference), all prompts batched, every
prompt again from a warm prefix cache, prefill in small chunks, and n-gram speculation
(aioengine/bench/invariance.py). Prints, per mode, how many of the prompts' completions
differ from the reference (and the first that does); exit status 1 when any does.

    .venv/bin/python scripts/greedy_invariance.py --dtype bfloat16 --num-prompts 100
"""
from __future__ import annotations

import argparse
import sys

from aioengine.bench.invariance import MODES, differing, shipped_prompts


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

    def report(name: str, diff: list[int], seconds: float) -> None:
        first = f" (first: prompt {diff[0]})" if diff else ""
        print(f"{name:14s} {len(diff):3d} / {len(prompts)} differ{first}  {seconds:.1f} s",
              flush=True)

    result = differing(prompts, base, args.modes.split(","), args.max_tokens, report)
    return 1 if any(result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
