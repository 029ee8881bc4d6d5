"""The packed any-M GEMM on a GGUF's block formats (kernels/cpu_blocks.py, gemm_blocks.h and
its SIMD tiles gemm_legacy.h / gemm_kquant.h): per format, the repacking is lossless, the
kernel agrees with a float64 product of the dequantized weights and x quantized per 32-block
for M = 1..64 and n not a multiple of 16, a row's bits do not depend on M or on the rows
beside it, every build this CPU runs gives the same bits, a weight of parts equals its parts
side by side, and gather_rows gives the dequantized rows."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from aioengine.kernels import cpu_blocks
from aioengine.kernels.int8_rows import quantize_dequantize_blocks
from aioengine.kernels import cpu_build

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="CPU kernels not built")

VARIANTS = cpu_build.supported_variants()
TYPES = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")
ROWS = (1, 2, 3, 5, 6, 7, 13, 48, 64)
# (n, blocks per row): a lone edge panel, one block per row only, several panels and blocks.
SHAPES = ((37, 3), (100, 1), (70, 8))
# Byte offsets of each block type's fp16 fields (d, and m or dmin) within a file block.
_HALVES = {"q4_0": (0,), "q4_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2),
           "q6_k": (208,)}
_GGUF_QUANTIZED = {"q4_0": gguf.GGMLQuantizationType.Q4_0,
                   "q4_1": gguf.GGMLQuantizationType.Q4_1,
                   "q8_0": gguf.GGMLQuantizationType.Q8_0}


def _k(block_type: str, blocks: int) -> int:
    return blocks * cpu_blocks.BLOCK_TYPES[block_type].block_weights


def _random_bytes(block_type: str, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, cpu_blocks.row_bytes(k, block_type)), dtype=torch.uint8,
                         generator=g)


def _blocks(block_type: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Real-looking file blocks [n, row_bytes]: random floats quantized by the gguf package
    where it quantizes the type; else (K-quants) random codes and scales with fp16 d and
    dmin in [1e-3, 1e-2] (random fp16 bytes can be NaN or 65504)."""
    if block_type in _GGUF_QUANTIZED:
        w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(w, _GGUF_QUANTIZED[block_type]))
    return _with_sane_halves(_random_bytes(block_type, n, k, seed), block_type, seed)


def _with_sane_halves(blocks: torch.Tensor, block_type: str, seed: int) -> torch.Tensor:
    f = cpu_blocks.BLOCK_TYPES[block_type]
    b = blocks.view(blocks.shape[0], -1, f.block_bytes)
    g = torch.Generator().manual_seed(seed + 1)
    for at in _HALVES[block_type]:
        h = (torch.rand(b.shape[0], b.shape[1], generator=g) * 9e-3 + 1e-3).half()
        b[..., at:at + 2] = h.view(torch.uint8).view(b.shape[0], b.shape[1], 2)
    return blocks


def _packed(block_type: str, blocks: torch.Tensor, k: int):
    layout = cpu_blocks.layout_for([(block_type, blocks.shape[0])], k)
    return cpu_blocks.pack_blocks(blocks, block_type), layout


def _float64_bound(x: torch.Tensor, blocks: torch.Tensor, block_type: str, bias: torch.Tensor):
    """The float64 product of x quantized per group (x_group) and the dequantized weights, and the
    tolerance: 4 (k / 32 + 2) float32 eps of sum_j |x_j w_j| (each block adds a term with
    one or two roundings of a few ulps of that block's absolute sum, then the bias's add)."""
    xq = quantize_dequantize_blocks(x, cpu_blocks.x_group(block_type)).double()
    w = cpu_blocks.dequantize_blocks(blocks, block_type).double()
    ref = xq @ w.t() + bias.double()
    eps = torch.finfo(torch.float32).eps
    bound = 4 * (x.shape[1] / 32 + 2) * eps * (xq.abs() @ w.abs().t() + bias.double().abs())
    return ref, bound


@pytest.mark.parametrize("block_type", TYPES)
def test_pack_round_trips_any_bytes(block_type: str) -> None:
    for n, blocks_per_row in ((37, 3), (16, 1), (5, 2)):
        k = _k(block_type, blocks_per_row)
        raw = _random_bytes(block_type, n, k, seed=n)
        packed = cpu_blocks.pack_blocks(raw, block_type)
        assert packed.numel() == cpu_blocks.packed_nbytes(n, k, block_type)
        assert torch.equal(cpu_blocks.unpack_blocks(packed, block_type, n, k), raw)


@pytest.mark.parametrize("block_type", TYPES)
def test_gemm_matches_float64_for_every_m(variant: str, block_type: str) -> None:
    for n, blocks_per_row in SHAPES:
        k = _k(block_type, blocks_per_row)
        blocks = _blocks(block_type, n, k, seed=n)
        data, layout = _packed(block_type, blocks, k)
        x, bias = torch.randn(64, k) * 3, torch.randn(n)
        ref, bound = _float64_bound(x, blocks, block_type, bias)
        for m in ROWS:
            y = cpu_blocks.gemm(x[:m].contiguous(), data, layout, bias)
            assert y is not None and y.shape == (m, n)
            err = (y.double() - ref[:m]).abs()
            assert (err <= bound[:m]).all(), (variant, block_type, n, k, m,
                                              float((err / bound[:m]).max()))


@pytest.mark.parametrize("block_type", ("q8_0", "q4_0"))
def test_gemm_full_code_range(variant: str, block_type: str) -> None:
    """Every code (Q8_0's -128 too, which the gguf package never writes) against x blocks
    whose quantized values reach +-127: no int16 sum may saturate."""
    n, k = 48, 256
    blocks = _with_sane_halves(_random_bytes(block_type, n, k, seed=3), block_type, seed=3)
    data, layout = _packed(block_type, blocks, k)
    x = torch.randn(13, k)
    x[:, ::32] = 50.0  # each block's largest: its quantized value is 127
    x[1, :] = torch.where(torch.arange(k) % 2 == 0, 50.0, -50.0)  # all +-127
    bias = torch.zeros(n)
    ref, bound = _float64_bound(x, blocks, block_type, bias)
    y = cpu_blocks.gemm(x, data, layout)
    assert ((y.double() - ref).abs() <= bound).all(), variant


@pytest.mark.parametrize("block_type", TYPES)
def test_row_has_the_same_bits_in_any_step(block_type: str, one_thread) -> None:
    """Bit for bit: each row alone, inside steps of 2..64 rows at any place, one thread or
    two."""
    n, k = 70, _k(block_type, 3)
    data, layout = _packed(block_type, _blocks(block_type, n, k, seed=1), k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([cpu_blocks.gemm(x[i:i + 1].contiguous(), data, layout)
                       for i in range(64)])
    for m in range(2, 65):
        start = (m * 7) % (65 - m)
        y = cpu_blocks.gemm(x[start:start + m].contiguous(), data, layout)
        assert torch.equal(y, alone[start:start + m]), (block_type, m)
    assert torch.equal(one_thread(lambda: cpu_blocks.gemm(x, data, layout)), alone)


@pytest.mark.parametrize("block_type", TYPES)
def test_every_build_gives_the_same_bits(block_type: str, every_build) -> None:
    """The SIMD tiles of each build (VNNI, AVX512BW, AVX2) and the plain C tile (the
    baseline build) round the same way per element; Q4_1's baseline build alone rounds each
    product (gemm_q4_1.h's q41_block_step without FMA), so it is left out there."""
    n, k = 100, _k(block_type, 3)
    blocks = _blocks(block_type, n, k, seed=2)
    if block_type == "q8_0":  # the full code range, -128 included
        blocks = _with_sane_halves(_random_bytes(block_type, n, k, seed=2), block_type, seed=2)
    data, layout = _packed(block_type, blocks, k)
    x, bias = torch.randn(64, k) * 2, torch.randn(n)
    results = {}
    try:
        for name in VARIANTS:
            if block_type == "q4_1" and name == cpu_build.BASELINE_VARIANT:
                continue
            cpu_build.use_variant(name)
            assert cpu_build.load() is not None, cpu_build.load_error()
            results[name] = [cpu_blocks.gemm(x[:m].contiguous(), data, layout, bias)
                             for m in ROWS]
    finally:
        cpu_build.use_variant(None)
    first = results[VARIANTS[0]]
    for name, ys in results.items():
        for m, a, b in zip(ROWS, ys, first):
            assert torch.equal(a, b), (block_type, name, VARIANTS[0], m)


@pytest.mark.parametrize("first,second", [("q4_k", "q6_k"), ("q4_0", "q5_k"), ("q6_k", "q8_0")])
def test_parts_equal_their_concatenation(variant: str, first: str, second: str) -> None:
    """A fused weight of 32 rows of one type then 20 of another in one buffer: a Q4_K_M
    q/k/v (both K-quants: one x quantized per 256), or K-quants beside 32-block formats
    (x quantized per 256 for one part, per 32 for the other: one call per kind)."""
    k = 512
    a, b = _blocks(first, 32, k, seed=4), _blocks(second, 20, k, seed=5)
    layout = cpu_blocks.layout_for([(first, 32), (second, 20)], k)
    data = torch.cat((cpu_blocks.pack_blocks(a, first), cpu_blocks.pack_blocks(b, second)))
    assert data.numel() == layout.nbytes
    assert layout.storage == "mixed:" + "+".join(sorted((first, second)))
    x, bias = torch.randn(7, k), torch.randn(52)
    y = cpu_blocks.gemm(x, data, layout, bias)
    ya = cpu_blocks.gemm(x, *_packed(first, a, k), bias[:32])
    yb = cpu_blocks.gemm(x, *_packed(second, b, k), bias[32:])
    assert torch.equal(y, torch.cat((ya, yb), dim=1))
    w = torch.cat((cpu_blocks.dequantize_blocks(a, first), cpu_blocks.dequantize_blocks(b, second)))
    assert torch.equal(cpu_blocks.dequantize_weight(data, layout), w)
    ref = cpu_blocks.reference_linear(x, data, layout, bias)
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-3)


def test_gather_rows_equals_the_dequantized_rows() -> None:
    k = 512
    parts = (("q4_k", 32), ("q6_k", 16), ("q8_0", 16), ("q4_0", 16), ("q5_k", 16), ("q4_1", 9))
    blocks = [_blocks(t, r, k, seed=i) for i, (t, r) in enumerate(parts)]
    layout = cpu_blocks.layout_for(parts, k)
    data = torch.cat([cpu_blocks.pack_blocks(b, t) for b, (t, _) in zip(blocks, parts)])
    full = torch.cat([cpu_blocks.dequantize_blocks(b, t) for b, (t, _) in zip(blocks, parts)])
    rows = torch.tensor([0, 104, 31, 32, 47, 48, 63, 64, 80, 95, 96, 0, 100, 79, 103, 104])
    assert torch.equal(cpu_blocks.gather_rows(data, layout, rows), full[rows])
