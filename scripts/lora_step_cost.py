"""Forward cost of fixed steps with and without 4 random rank-8 adapters, alternated in one
process (bundled SmolLM2-135M in bf16, adapter slots in bf16, as `aioengine bench lora`):

    decode32    32 decode rows (the fused decode executor), adapters round-robin
    prefill512  4 prompts of 128 tokens (the layer path, lora_apply), one adapter each

Prints min and median wall time and process CPU time (every thread's) of each. On a loaded
machine the CPU time is the steadier figure; with OMP_WAIT_POLICY=passive it leaves out
the threads' spinning at barriers.

    .venv/bin/python scripts/lora_step_cost.py decode32,prefill512 12
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time

import torch

from aioengine.bench.lora import write_random_adapter
from aioengine.lora import LoRARequest
from aioengine.lora.manager import LoRAConfig, LoRAManager
from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model

CPU = torch.device("cpu")
BLOCK = 16
ROWS = 32


def main(which: list[str], reps: int) -> None:
    torch.set_num_threads(2)
    manager = LoRAManager(LoRAConfig(max_loras=4, max_lora_rank=8), CPU, torch.bfloat16)
    model = load_model(None, torch.bfloat16, CPU, linear_factory=manager.linear_factory,
                       lora_source=manager).model
    tmp = tempfile.mkdtemp()
    loras = [manager.add(LoRARequest(f"a{i}", write_random_adapter(
        os.path.join(tmp, f"a{i}"), manager.module_shapes, 8, i))) for i in range(4)]
    rng = random.Random(0)
    ctx = [rng.randrange(32, 256) for _ in range(ROWS)]
    nblocks = [-(-(c + 2) // BLOCK) for c in ctx]
    used = sum(nblocks)
    caches = make_kv_caches(model.arch, used + 4 * 9, BLOCK, torch.float32, CPU)
    tables = [list(range(sum(nblocks[:i]), sum(nblocks[:i + 1]))) for i in range(ROWS)]
    prompt_tables = [list(range(used + 9 * k, used + 9 * (k + 1))) for k in range(4)]

    def step(lens, seq_lens, tabs, ids, step_loras) -> tuple[float, float]:
        meta, pos = build_attention_metadata(lens, seq_lens, tabs, BLOCK, CPU)
        manager.assign_slots(list(zip(step_loras, lens)))
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            model(ids, pos, caches, meta)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        manager.end_step()
        return 1e3 * wall, 1e3 * cpu

    def ids(n: int) -> torch.Tensor:
        return torch.tensor([rng.randrange(3, 40000) for _ in range(n)])

    for i in range(ROWS):  # the decode rows' contexts
        step([ctx[i]], [ctx[i]], [tables[i]], ids(ctx[i]), [None])
    decode_ids, prompt_ids = ids(ROWS), ids(512)
    cases = {
        "decode32": lambda ls: step([1] * ROWS, [c + 1 for c in ctx], tables, decode_ids,
                                    [ls[i % 4] for i in range(ROWS)]),
        "prefill512": lambda ls: step([128] * 4, [128] * 4, prompt_tables, prompt_ids, ls),
    }
    kinds = {"base": [None] * 4, "lora": loras}
    times = {(c, k): [] for c in which for k in kinds}
    for c in which:  # warm-up
        for k in kinds:
            cases[c](kinds[k])
    for r in range(reps):
        for c in which:
            for k in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
                times[(c, k)].append(cases[c](kinds[k]))
    for c in which:
        for j, what in enumerate(("wall", "cpu")):
            b = [t[j] for t in times[(c, "base")]]
            lo = [t[j] for t in times[(c, "lora")]]
            print(f"{c} {what}: base min {min(b):.2f} med {statistics.median(b):.2f} ms | "
                  f"lora min {min(lo):.2f} med {statistics.median(lo):.2f} ms | extra min "
                  f"{min(lo) - min(b):.2f} med {statistics.median(lo) - statistics.median(b):.2f}"
                  f" ms | ratio med {statistics.median(lo) / statistics.median(b):.3f}")


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["decode32", "prefill512"],
         int(sys.argv[2]) if len(sys.argv) > 2 else 10)
