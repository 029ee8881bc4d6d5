"""`bench gguf`'s workloads against a real server (the bundled model, not a GGUF of a big
shape): every figure comes back, and TPOT is the median of its single streams."""
from __future__ import annotations

import asyncio
import statistics

import numpy as np
from server_process import ServerProcess

from aioengine.bench import gguf_bench


def test_measure_reports_the_median_of_its_single_streams(tool_server: ServerProcess) -> None:
    report = asyncio.run(gguf_bench.measure(tool_server.url, np.random.default_rng(0), 300))
    runs = report["tpot_runs_ms"]
    assert len(runs) == gguf_bench.SINGLE_STREAMS and all(t > 0 for t in runs)
    assert report["tpot_ms"] == statistics.median(runs)
    assert report["single_tokens"] == gguf_bench.OUTPUT_LEN
    assert report["prefill_prompt_tokens"] == gguf_bench.PREFILL_LEN
    assert report["concurrent_tok_s"] > 0 and report["prefill_tok_s"] > 0
