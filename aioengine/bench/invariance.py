"""Greedy output under every way a step can be formed (issue 29's invariance): each prompt
alone with prefix caching off (the reference), all prompts batched, every prompt again
from a warm prefix cache, prefill in small chunks, and n-gram speculation. Used by
scripts/greedy_invariance.py and tests/engine/test_bundled_invariance.py.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from aioengine import LLM, SamplingParams

DATA = os.path.join(os.path.dirname(__file__), "data", "prompts.jsonl")
# Each mode: the engine arguments beside the common ones, and whether the prompts run one by
# one (False: all in one generate call, batched by the scheduler).
MODES: dict[str, tuple[dict, bool]] = {
    "alone": ({"enable_prefix_caching": False}, True),
    "batched": ({"enable_prefix_caching": False}, False),
    "prefix_cached": ({"enable_prefix_caching": True}, False),
    "chunked": ({"enable_prefix_caching": False, "max_num_batched_tokens": 16,
                 "long_prefill_token_threshold": 16}, False),
    # 6-token chunks: computed as decode rows (ScheduledRequest.as_decode_rows), in the
    # fused CPU executor where it applies.
    "chunked_rows": ({"enable_prefix_caching": False, "max_num_batched_tokens": 16,
                      "long_prefill_token_threshold": 6}, False),
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
    """The greedy completions of `prompts` (chat messages) in mode `name`."""
    extra, one_by_one = MODES[name]
    args = dict(engine_args)
    llm = LLM(args.pop("model", None), **args, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if name == "prefix_cached":  # fill the cache, then measure the rerun
        llm.generate(prompts, params)
    if one_by_one:
        outs = [llm.generate(p, params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    return [list(o.outputs[0].token_ids) for o in outs]


def differing(prompts: list, engine_args: dict, modes: list[str], max_tokens: int,
              report: Callable[[str, list[int], float], None] | None = None,
              ) -> dict[str, list[int]]:
    """Per mode, the indices of the prompts whose completion differs from "alone"'s
    (which runs first); `report(mode, indices, seconds)` after each mode."""
    ref: list[list[int]] | None = None
    result: dict[str, list[int]] = {}
    for name in ["alone"] + [m for m in modes if m != "alone"]:
        start = time.perf_counter()
        got = run_mode(name, prompts, engine_args, max_tokens)
        ref = got if ref is None else ref
        result[name] = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
        if report is not None:
            report(name, result[name], time.perf_counter() - start)
    return result
