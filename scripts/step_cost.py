"""Decode-step cost against the number of rows, and against this CPU's roofline.

One engine; for each repeat, for each row count R (interleaved: 1 4 32 1 4 32 ...), R
concurrent requests of 16 random prompt tokens and --output-len new tokens (EOS ignored);
the step timeline's worker time (prepare + forward + sample, the LM head included) of the
decode steps with exactly R rows, median over repeats. The roofline of an R-row step is
max((weight bytes + K/V bytes) / read bandwidth, 2 R params / GEMM peak): the K/V its rows
read at their mean context (16 prompt tokens and half the output), the bandwidth measured
by the bench's probe (sums over 1 GiB in a child), the GEMM peak by the any-M GEMM itself
on an L2-resident packed weight in the model's storage, the best of 48 and 512 rows (48
rows alone read 500-740 GFLOP/s on the AMX Xeon, a third of what 512 rows reach there).

    .venv/bin/python scripts/step_cost.py --dtype bfloat16 --rows 1,4,32 --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import torch

from aioengine import AsyncEngine, SamplingParams, cpu_info
from aioengine.bench.floor import measure_read_bandwidth, weight_bytes_per_token


def gemm_peak_flops(storage: str) -> float | None:
    """FLOP/s of the any-M GEMM on a [512, 576] weight in the projections' `storage`
    (Linear.storage: float32, bfloat16, int8, w8a8 or q4_1; L2-resident, packed as the
    model packs it), the best of 48 and 512 rows, best of 20 each; None where it is not
    built or does not pack."""
    try:
        from aioengine.kernels import cpu_gemm
        from aioengine.model.layers import Linear
    except ImportError:
        return None
    lin = Linear(576, 512, False, torch.float32, torch.device("cpu"))
    w = torch.randn(512, 576)
    with torch.no_grad():
        if storage == "q4_1":
            import gguf
            lin.use_q4_1_storage()
            lin.weight.copy_(torch.from_numpy(
                gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)))
        else:
            lin.weight.copy_(w)
            lin.convert(storage)
    lin.pack()
    if not lin.is_packed:
        return None
    peak = 0.0
    for rows, calls in ((48, 50), (512, 5)):
        x = torch.randn(rows, 576)
        best = float("inf")
        for _ in range(20):
            start = time.perf_counter()
            for _ in range(calls):
                cpu_gemm.gemm(x, lin.weight, 512, None, lin.scales)
            best = min(best, (time.perf_counter() - start) / calls)
        peak = max(peak, 2 * rows * 512 * 576 / best)
    return peak


async def decode_step_ms(engine: AsyncEngine, rows: int, output_len: int, seed: int) -> float:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    async def one() -> None:
        prompt = [rng.randrange(1000, 20000) for _ in range(16)]
        async for _ in engine.generate(prompt, params):
            pass

    timeline = engine.timeline
    timeline.records.clear()
    timeline.enabled = True
    await asyncio.gather(*(one() for _ in range(rows)))
    timeline.enabled = False
    steps = [r for r in timeline.records if r.kind == "decode" and r.num_tokens == rows]
    return 1e3 * statistics.median(r.prepare + r.forward + r.sample for r in steps)


async def main_async(args: argparse.Namespace) -> dict:
    # Plain decode steps of exactly R rows: no drafts (speculation is on by default).
    engine = await AsyncEngine.create(args.model, dtype=args.dtype,
                                      quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype, speculative_config=None)
    try:
        model = engine.model
        await decode_step_ms(engine, 1, 8, 0)  # warm-up
        times: dict[int, list[float]] = {r: [] for r in args.rows}
        for rep in range(args.repeats):
            for r in args.rows:
                times[r].append(await decode_step_ms(engine, r, args.output_len, rep))
        weights = weight_bytes_per_token(model)
        arch = engine.model_arch  # K and V of one position, every layer
        kv_dtype = getattr(torch, engine.dtype_info()["kv_cache_dtype"])
        kv_row = (2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
                  * torch.empty((), dtype=kv_dtype).element_size())
        mean_context = 16 + args.output_len / 2
        params = sum(lin.in_features * lin.out_features for lin in model.linears()
                     if lin is not model.embed_tokens or lin is model.lm_head)
        storage = model.layers[0].qkv_proj.storage
    finally:
        await engine.shutdown()
    bandwidth = measure_read_bandwidth()
    peak = gemm_peak_flops(storage)
    out = {"cpu": cpu_info.cpu_model(), "flags": cpu_info.relevant_flags(),
           "dtype": args.dtype, "quantization": args.quantization,
           "kv_cache_dtype": args.kv_cache_dtype,
           "weight_bytes": weights, "kv_bytes_per_row": kv_row * mean_context,
           "params": params, "read_bandwidth_gbs": bandwidth / 1e9,
           "gemm_peak_gflops": None if peak is None else peak / 1e9, "rows": {}}
    one = statistics.median(times[args.rows[0]])
    for r in args.rows:
        ms = statistics.median(times[r])
        step_bytes = weights + r * kv_row * mean_context
        roof = max(step_bytes / bandwidth, 2 * r * params / peak if peak else 0.0) * 1e3
        out["rows"][r] = {"step_ms": ms, "all_ms": times[r], "vs_first": ms / one,
                          "roofline_ms": roof, "vs_roofline": ms / roof}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 32])
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save-json", default=None)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    print(f"{out['cpu']} {' '.join(out['flags'])}; {args.dtype} {args.quantization or ''}; "
          f"read {out['read_bandwidth_gbs']:.1f} GB/s, GEMM peak "
          f"{out['gemm_peak_gflops'] or float('nan'):.0f} GFLOP/s")
    for r, row in out["rows"].items():
        print(f"rows {r:3d}: {row['step_ms']:7.2f} ms  x{row['vs_first']:.2f} of {args.rows[0]} "
              f"row(s)  roofline {row['roofline_ms']:6.2f} ms  x{row['vs_roofline']:.2f}")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
