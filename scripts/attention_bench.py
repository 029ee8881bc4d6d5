"""The C paged attention alone (aioengine.kernels.cpu.paged_attention), SmolLM2-135M's heads
(9 query, 3 KV, head size 64), a bf16 cache in blocks of 16, the engine's threads: a fresh
512-token prefill chunk of two 256-token prompts, a 512-token chunk after 1,024 cached
positions, and a 32-row decode at 200 positions each, with its K/V in the caches (the same
call repeated) and from memory (each call after reading 256 MB, as a decode step's weights
evict a layer's K/V before the next step reads it). Best of --rounds x 10 calls, ms per
call (one layer). The build is the one the CPU picks, or AIOENGINE_CPU_ISA's.

    .venv/bin/python scripts/attention_bench.py
    AIOENGINE_CPU_ISA=avx2 .venv/bin/python scripts/attention_bench.py
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from aioengine import cpu_info
from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.attention import build_attention_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def step(query_lens: list[int], seq_lens: list[int]) -> Callable[[], bool]:
    """One call of the kernel over a step of query_lens tokens per request (each request's
    last query_lens[i] of its seq_lens[i] positions), on scattered blocks."""
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 1
    free, tables = torch.randperm(num_blocks).tolist(), []
    for s in seq_lens:
        n = -(-s // BLOCK)
        tables.append(free[:n])
        free = free[n:]
    kv = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).bfloat16()
    meta, _ = build_attention_metadata(query_lens, seq_lens, tables, BLOCK,
                                       torch.device("cpu"))
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM)
    row_to_req = torch.repeat_interleave(torch.arange(len(seq_lens), dtype=torch.int32),
                                         torch.tensor(query_lens))
    row_seq_lens = torch.cat([torch.arange(s - n + 1, s + 1, dtype=torch.int32)
                              for n, s in zip(query_lens, seq_lens)])
    out = torch.empty_like(q)
    return lambda: cpu_kernels.paged_attention(out, q, kv, meta.block_tables, row_to_req,
                                               row_seq_lens, HEAD_DIM ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    cases = {"prefill 2 x 256": step([256, 256], [256, 256]),
             "prefill 512 after 1024": step([512], [1536]),
             "decode 32 x 200": step([1] * 32, [200] * 32)}
    cold = "decode 32 x 200, K/V from memory"
    evict = torch.ones(64 << 20)  # 256 MB
    best = dict.fromkeys([*cases, cold], float("inf"))
    for _ in range(args.rounds):
        for name, call in cases.items():
            start = time.perf_counter()
            for _ in range(10):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / 10)
        total = 0.0
        for _ in range(10):
            evict.sum()
            start = time.perf_counter()
            cases["decode 32 x 200"]()
            total += time.perf_counter() - start
        best[cold] = min(best[cold], total / 10)
    print(f"{cpu_info.cpu_model()} ({' '.join(cpu_info.relevant_flags())}); "
          f"the {cpu_kernels.variant()} build, {torch.get_num_threads()} threads")
    for name, seconds in best.items():
        print(f"{name:34s} {seconds * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
