"""Shared inputs of the benchmark's unit tests: a vocabulary and an offline report."""
from __future__ import annotations

from aioengine.bench.datasets import random_dataset

VOCAB = list(range(100, 1100))


def offline_report(stats: dict) -> dict:
    row = {"num_requests": 2, "num_prompt_tokens": 8, "num_output_tokens": 6,
           "elapsed_s": 1.0, "output_tok_per_s": 6.0, "total_tok_per_s": 14.0}
    return {"environment": {"torch": "t", "transformers": "x", "torch_threads": 2,
                            "cpu_count": 2, "cuda": None},
            "model": "m", "workload": random_dataset(VOCAB, 2, 4, 4, 3, seed=0).summary(),
            "results": {"aioengine": {**row, "engine_stats": stats or None}},
            "skipped": {}, "ratios": {}, "agreement": {}}
