"""The GGUF block formats' GEMM alone, AMX int8 tiles against the vector tiles of the same
build, interleaved in one process (the two give the same bits; kernels/cpu/
gemm_amx_blocks.c). One weight of N x K per format (written by our quantizer, plain
scales), copied to ~200 MB so that every pass reads it from memory; best of 3 rounds.

    .venv/bin/python scripts/block_gemm_bench.py --types q4_k,q6_k,q4_0,q8_0 --rows 8,32,512
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from aioengine import cpu_info
from aioengine.bench.gguf_writer import quantize
from aioengine.kernels import cpu_blocks, cpu_build

VECTOR, TILES = 0, 1
QTYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}


def packed(block_type: str, n: int, k: int) -> tuple[list[torch.Tensor], object]:
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(quantize(w, QTYPES[block_type], refine=False))
    data = cpu_blocks.pack_blocks(blocks, block_type)
    copies = max(1, int(200e6 // data.numel()))
    return [data.clone() for _ in range(copies)], cpu_blocks.layout_for([(block_type, n)], k)


def pass_s(x: torch.Tensor, weights: list[torch.Tensor], layout: object) -> float:
    cpu_blocks.gemm(x, weights[0], layout, None)
    start = time.perf_counter()
    for w in weights:
        cpu_blocks.gemm(x, w, layout, None)
    return (time.perf_counter() - start) / len(weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4_k,q5_k,q6_k,q4_0,q8_0")
    ap.add_argument("--rows", default="8,32,64,128,512")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cpu_build.load()
    if cpu_build.set_amx_mode(TILES) != "tiles":
        raise SystemExit(f"no AMX tiles here ({cpu_build.variant()} build): nothing to compare")
    flags = " ".join(f for f in sorted(cpu_info.cpu_flags()) if f.startswith(("amx", "avx512_")))
    print(f"{cpu_info.cpu_model()} ({flags}), {torch.get_num_threads()} threads, "
          f"{args.n} x {args.k}")
    for block_type in args.types.split(","):
        weights, layout = packed(block_type, args.n, args.k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, args.k)
            best = {VECTOR: float("inf"), TILES: float("inf")}
            for _ in range(args.rounds):
                for mode in best:
                    cpu_build.set_amx_mode(mode)
                    best[mode] = min(best[mode], pass_s(x, weights, layout))
            gop = {mode: 2 * m * args.n * args.k / s / 1e9 for mode, s in best.items()}
            print(f"{block_type} M={m}: vector {best[VECTOR] * 1e3:.3f} ms ({gop[VECTOR]:.0f} "
                  f"GOP/s), tiles {best[TILES] * 1e3:.3f} ms ({gop[TILES]:.0f} GOP/s): "
                  f"{best[VECTOR] / best[TILES]:.2f}x", flush=True)
    cpu_build.set_amx_mode(TILES)


if __name__ == "__main__":
    main()
