"""The any-M GEMM alone over SmolLM2-135M's projection shapes (30 layers' qkv, o, gate_up,
down and the LM head, random weights packed in the storage), per CPU-kernel build, the
builds interleaved in one process: best of 5 per round, min over rounds. `onednn` is the
local ceiling beside them: torch's bf16 `linear` on the same shapes (oneDNN, which uses AMX
where the CPU has it), x already bf16.

    .venv/bin/python scripts/gemm_bench.py --dtype bfloat16 --builds amx,avx512_bf16,onednn
"""
from __future__ import annotations

import argparse
import time

import torch

from aioengine import cpu_info
from aioengine.bench.gemm_ceiling import best_pass_s
from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_gemm

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def packed_weights(dtype: torch.dtype) -> list[tuple[torch.Tensor, int, int,
                                                    torch.Tensor | None]]:
    out = []
    for n, k in SHAPES:
        w, scales = torch.randn(n, k) * 0.05, None
        if dtype == torch.int8:
            scales = w.abs().amax(1) / 127
            w = (w / scales[:, None]).round().to(torch.int8)
        else:
            w = w.to(dtype)
        out.append((cpu_gemm.pack_weight(w), n, k, scales))
    return out


ONEDNN = "onednn"


def best_ms(weights: list, m: int, repeats: int = 5) -> float:
    xs = {k: torch.randn(m, k) for k in {k for _, _, k, _ in weights}}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for packed, n, k, scales in weights:
            if cpu_gemm.gemm(xs[k], packed, n, None, scales) is None:
                raise RuntimeError(f"the kernel declined a [{n}, {k}] weight")
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def onednn_best_ms(plain: list[torch.Tensor], m: int, repeats: int = 5) -> float:
    return best_pass_s(plain, m, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "int8"])
    ap.add_argument("--builds", default=",".join(cpu_kernels.supported_variants()[:-1]),
                    help=f"kernel builds, and {ONEDNN!r} (torch's bf16 linear)")
    ap.add_argument("--rows", default="1,2,4,5,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    builds, rows = args.builds.split(","), [int(r) for r in args.rows.split(",")]
    dtype = getattr(torch, args.dtype)
    weights: dict[str, list] = {}  # per build: its packing (bf16: AMX's tile layout or not)
    plain = [torch.randn(n, k).bfloat16() for n, k in SHAPES] if ONEDNN in builds else []
    times = {b: {m: [] for m in rows} for b in builds}
    for _ in range(args.rounds):
        for b in builds:
            if b == ONEDNN:
                for m in rows:
                    times[b][m].append(onednn_best_ms(plain, m))
                continue
            cpu_kernels.use_variant(b)
            cpu_kernels.load()
            weights.setdefault(b, packed_weights(dtype))
            for m in rows:
                times[b][m].append(best_ms(weights[b], m))
    flops = 2 * sum(n * k for n, k in SHAPES)
    print(f"{cpu_info.cpu_model()} ({' '.join(cpu_info.relevant_flags())}); {args.dtype}, "
          f"{2 * sum(n * k for n, k in SHAPES) / 1e6:.0f} MB in bf16")
    for m in rows:
        cells = [f"{b} {min(times[b][m]):7.2f} ms "
                 f"(x{min(times[b][m]) / min(times[b][rows[0]]):.2f} of M={rows[0]}, "
                 f"{m * flops / min(times[b][m]) / 1e6:4.0f} GFLOP/s)" for b in builds]
        print(f"M={m:3d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
