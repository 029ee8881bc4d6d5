"""Expert weight bytes a decode step reads, against the bytes of the experts it routes to.

Loads an MoE checkpoint (HF directory) with the engine's loader, then for each decode batch
size feeds every sparse layer's block (model/moe.py: router + grouped experts) one row per
request of unit-RMS random hidden states, as a decode step's post-attention norm gives it,
and counts, per layer and step: the experts routed to, the weight bytes the expert Linears
actually read (each call's weight, counted as it runs), the bytes of the routed experts'
weights, and of all experts'. The grouped path should read each routed expert once:
read / routed = 1.00 whatever the batch. Counts, not timings: load on the machine does not
change them.

    .venv/bin/python scripts/moe_traffic.py --model DIR [--rows 1,4,8,32] [--dtype bfloat16]

A model to try it on: tests/moe_models.py's make_tiny_moe_dir("mixtral", DIR, hidden_size=512,
intermediate_size=1024, num_hidden_layers=8, num_local_experts=8, ...) (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Iterator

import torch

from aioengine import cpu_info
from aioengine.model.loader import load_model
from aioengine.model.moe import SparseMoeBlock, route


def weight_bytes(lin) -> int:
    return lin.weight.numel() * lin.weight.element_size() + (
        0 if lin.scales is None else lin.scales.numel() * lin.scales.element_size())


@contextmanager
def counting(block: SparseMoeBlock, calls: list[int]) -> Iterator[None]:
    """Appends each expert Linear call's weight bytes to `calls` while inside."""
    saved = []
    for mlp in block.experts:
        for lin in (mlp.gate_up_proj, mlp.down_proj):
            def counted(x, lin=lin, real=lin.forward):
                calls.append(weight_bytes(lin))
                return real(x)
            saved.append((lin, lin.forward))
            lin.forward = counted
    try:
        yield
    finally:
        for lin, real in saved:
            lin.forward = real


def step_counts(block: SparseMoeBlock, rows: int, gen: torch.Generator,
                dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(experts routed, bytes read, routed experts' bytes, all experts' bytes)."""
    x = torch.randn(rows, block.gate.in_features, generator=gen).to(dtype)
    _, ids = route(block.gate(x), block.spec.top_k, block.spec.renormalize)
    routed = sorted(set(ids.reshape(-1).tolist()))
    per_expert = [weight_bytes(m.gate_up_proj) + weight_bytes(m.down_proj)
                  for m in block.experts]
    calls: list[int] = []
    with counting(block, calls):
        block(x)
    return len(routed), sum(calls), sum(per_expert[e] for e in routed), sum(per_expert)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an MoE checkpoint (HF directory)")
    p.add_argument("--rows", default="1,4,8,32", help="decode batch sizes")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20, help="random steps per batch size")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    loaded = load_model(args.model, dtype, torch.device("cpu"))
    blocks = [layer.mlp for layer in loaded.model.layers if layer.mlp is not None]
    spec = blocks[0].spec
    print(f"CPU: {cpu_info.cpu_model()}; flags: {' '.join(cpu_info.relevant_flags())}")
    print(f"model {args.model}: {len(blocks)} sparse layers, {spec.num_experts} experts, "
          f"top-{spec.top_k}, {args.dtype}; {args.steps} random steps per batch size")
    print("rows | experts routed / layer | read MiB / step | routed experts' MiB | "
          "all experts' MiB | read / routed")
    gen = torch.Generator().manual_seed(0)
    mib = 2.0 ** 20
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            totals = [0, 0, 0, 0]
            for _ in range(args.steps):
                for block in blocks:
                    for i, v in enumerate(step_counts(block, rows, gen, dtype)):
                        totals[i] += v
            n_layers = args.steps * len(blocks)
            routed, read, routed_bytes, all_bytes = totals
            print(f"{rows} | {routed / n_layers:.2f} | {read / args.steps / mib:.1f} | "
                  f"{routed_bytes / args.steps / mib:.1f} | {all_bytes / args.steps / mib:.1f} "
                  f"| {read / routed_bytes:.2f}")


if __name__ == "__main__":
    main()
