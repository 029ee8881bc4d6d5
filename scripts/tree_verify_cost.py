"""The forward cost of one speculative verification step against its row count: a tree of
N nodes (1 + N rows, worker/spec_tree.py) on the fused decode executor and on the layer
path, and a chain of the same rows (decode rows) on the fused executor, interleaved in one
process (tree fused, tree layerwise, chain fused, repeated): min, 10th percentile and
median of --repeats (on a shared machine the low percentiles are the cost, the median the
load).

The bundled model in the default storage of this CPU (bf16 weights, bf16 KV cache where
AVX512-BF16 is present), one request with a --context-token context (block size 16); the
trees: top_k 4 nodes at depth 1, each later node a child of the node four before it (so
N = 4, 8, 12 have depth 1, 2, 3). Only the model's forward (the layers and the final norm,
no LM head) is timed.

    .venv/bin/python scripts/tree_verify_cost.py --nodes 4,8,12 --repeats 30
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from aioengine import cpu_info
from aioengine.sched.scheduler_output import ScheduledRequest
from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model
from aioengine.spec_decode.tree import TreeConfig
from aioengine.worker.spec_tree import apply_tree_layout, num_tree_scratch_blocks
from aioengine.worker.step_layout import step_layout

CPU = torch.device("cpu")
BLOCK_SIZE = 16


def forward_ms(model, scheduled: list[ScheduledRequest], caches, scratch: list[int],
               fused: bool) -> tuple[float, str]:
    query_lens, seq_lens, tables, starts = step_layout(scheduled)
    meta, positions = build_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, CPU)
    positions = apply_tree_layout(scheduled, starts, meta, positions, scratch, BLOCK_SIZE)
    ids = torch.tensor([t for s in scheduled for t in s.token_ids])
    model.use_fused_decode = fused
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, positions, caches, meta)
        elapsed = time.perf_counter() - start
    model.use_fused_decode = True
    return 1e3 * elapsed, model.last_executor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="4,8,12")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    dtype = torch.bfloat16 if cpu_info.has_bf16_compute() else torch.float32
    model = load_model(None, dtype, CPU).model
    rng = random.Random(0)
    tree = TreeConfig(depth=max(nodes) // 4, top_k=4, num_nodes=max(nodes))
    pool = -(-(args.context + 1 + max(nodes)) // BLOCK_SIZE) + 1
    scratch_n = num_tree_scratch_blocks(tree, BLOCK_SIZE)
    caches = make_kv_caches(model.arch, pool + scratch_n, BLOCK_SIZE, dtype, CPU)
    scratch = list(range(pool, pool + scratch_n))
    table = list(range(pool))
    prompt = [rng.randrange(1000, 20000) for _ in range(args.context + 1)]
    with torch.inference_mode():
        meta, positions = build_attention_metadata([args.context], [args.context], [table],
                                                   BLOCK_SIZE, CPU)
        model(torch.tensor(prompt[:-1]), positions, caches, meta)

    def item(n: int, parents: list[int] | None) -> ScheduledRequest:
        drafts = [rng.randrange(1000, 20000) for _ in range(n)]
        return ScheduledRequest(request=None, num_computed_tokens=args.context,
                                token_ids=[prompt[-1]] + drafts, block_ids=table,
                                num_samples=1, spec_token_ids=drafts, spec_tree_parents=parents)

    cases = []
    for n in nodes:
        parents = [-1 if i < 4 else i - 4 for i in range(n)]
        cases += [(f"tree {n} fused", [item(n, parents)], True),
                  (f"tree {n} layerwise", [item(n, parents)], False),
                  (f"chain {n} fused", [item(n, None)], True)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    ran: dict[str, str] = {}
    for _ in range(args.repeats + 2):  # the first two rounds warm up
        for name, scheduled, fused in cases:
            ms, executor = forward_ms(model, scheduled, caches, scratch, fused)
            times[name].append(ms)
            ran[name] = executor
    print(f"CPU: {cpu_info.cpu_model()} ({' '.join(cpu_info.relevant_flags())})")
    print(f"{dtype} weights and KV, context {args.context}, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (interleaved)")
    for name, values in times.items():
        values = sorted(values[2:])
        print(f"{name:20s} {1 + int(name.split()[1]):3d} rows  min {values[0]:6.2f}  "
              f"p10 {values[len(values) // 10]:6.2f}  median {statistics.median(values):6.2f} ms"
              f"  {ran[name]}")


if __name__ == "__main__":
    main()
