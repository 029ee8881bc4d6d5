"""The packed GEMM's SIMD tiles on a GGUF's K-quant blocks (kernels/cpu/gemm_kquant.h:
GEMM_Q4KP, GEMM_Q5KP, GEMM_Q6KP): the bits of the plain C tile (gemm_blocks.h's
gemm_blk_tile_c, which the baseline build runs) for every tile shape M = 1..64 picks, a
float64 product of the dequantized weights within float32 rounding, and a row's bits
whatever the rows beside it. The blocks are random code bytes (every code, the largest
included) with sane fp16 d and dmin: random d bytes could be NaN or huge."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_blocks
from aioengine.kernels.int8_rows import quantize_dequantize_blocks

KQUANTS = ("q4_k", "q5_k", "q6_k")
# Row counts: each tile height (1..6), the 6-row blocks and their remainders, two passes.
ROWS = (1, 2, 3, 5, 6, 7, 13, 48, 64)
# (n, k): one superblock and an edge panel; eight superblocks, many panels and an edge one.
SHAPES = ((37, 256), (200, 2048))
SIMD_VARIANTS = [v for v in cpu_kernels.supported_variants()
                 if v != cpu_kernels.BASELINE_VARIANT]

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels not built")


def _fp16_bytes(shape: tuple[int, ...], lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    v = torch.empty(shape).uniform_(lo, hi, generator=gen).half()
    return v.view(torch.uint8).reshape(*shape[:-1], 2)


def _random_blocks(n: int, k: int, block_type: str, seed: int) -> torch.Tensor:
    """A file's blocks [n, row_bytes]: random bytes, then positive d (and dmin) in
    [1e-4, 1e-2) written over their fields."""
    gen = torch.Generator().manual_seed(seed)
    f = cpu_blocks.BLOCK_TYPES[block_type]
    nb = k // f.block_weights
    b = torch.randint(0, 256, (n, nb, f.block_bytes), generator=gen, dtype=torch.uint8)
    if block_type == "q6_k":
        b[..., 208:210] = _fp16_bytes((n, nb, 1), 1e-4, 1e-2, gen)
    else:
        b[..., 0:2] = _fp16_bytes((n, nb, 1), 1e-4, 1e-2, gen)
        b[..., 2:4] = _fp16_bytes((n, nb, 1), 1e-4, 1e-2, gen)
    return b.reshape(n, -1)


def _weight(n: int, k: int, block_type: str, seed: int = 0):
    blocks = _random_blocks(n, k, block_type, seed)
    return blocks, cpu_blocks.pack_blocks(blocks, block_type), cpu_blocks.layout_for(
        [(block_type, n)], k)


def _gemm_with(variant: str, x: torch.Tensor, data: torch.Tensor, layout) -> torch.Tensor:
    cpu_kernels.use_variant(variant)
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    y = cpu_blocks.gemm(x, data, layout)
    assert y is not None
    return y


@pytest.fixture
def restore_variant():
    yield
    cpu_kernels.use_variant(None)


@pytest.mark.skipif(not SIMD_VARIANTS, reason="no SIMD build on this CPU")
@pytest.mark.parametrize("block_type", KQUANTS)
def test_simd_tiles_give_the_plain_c_tiles_bits(block_type: str, restore_variant,
                                               every_build) -> None:
    """Bit for bit, every SIMD build against the baseline build (the plain C tile), for
    every row count's tile shapes, n not a multiple of 16, k of one and of eight
    superblocks."""
    for n, k in SHAPES:
        _, data, layout = _weight(n, k, block_type, seed=n)
        x = torch.randn(64, k, generator=torch.Generator().manual_seed(k)) * 3
        x[5, :32] = 0  # a zero block: scale 1, sums 0
        for m in ROWS:
            xm = x[:m].contiguous()
            plain = _gemm_with(cpu_kernels.BASELINE_VARIANT, xm, data, layout)
            for variant in SIMD_VARIANTS:
                y = _gemm_with(variant, xm, data, layout)
                assert torch.equal(y, plain), (block_type, n, k, m, variant,
                                               (y - plain).abs().max().item())


def _magnitude_weight(blocks: torch.Tensor, block_type: str) -> torch.Tensor:
    """|d sc q| + |dmin mn| per weight (Q4_K/Q5_K: the blocks dequantized with dmin's sign
    flipped, d and dmin being positive), |w| for Q6_K: what float32 rounding scales with."""
    if block_type == "q6_k":
        return cpu_blocks.dequantize_blocks(blocks, block_type).abs()
    f = cpu_blocks.BLOCK_TYPES[block_type]
    flipped = blocks.clone().view(blocks.shape[0], -1, f.block_bytes)
    flipped[..., 3] |= 0x80
    return cpu_blocks.dequantize_blocks(flipped.view(blocks.shape[0], -1), block_type)


@pytest.mark.parametrize("block_type", KQUANTS)
def test_kquant_gemm_matches_float64(variant: str, block_type: str) -> None:
    """Every build against float64 over the dequantized weights with x quantized per 256
    (x_group): within (2 k / 32 + 4) float32 epsilons of the sum of the terms' magnitudes
    (each 32-block's one or two fused multiply-adds and a rounded scale product)."""
    n, k = 200, 2048
    blocks, data, layout = _weight(n, k, block_type, seed=3)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(4)) * 3
    bias = torch.randn(n)
    xq = quantize_dequantize_blocks(x, cpu_blocks.x_group(block_type)).double()
    ref = xq @ cpu_blocks.dequantize_blocks(blocks, block_type).double().t() + bias.double()
    scale = xq.abs() @ _magnitude_weight(blocks, block_type).double().t() + bias.double().abs()
    bound = (2 * k / 32 + 4) * torch.finfo(torch.float32).eps * scale
    for m in ROWS:
        y = cpu_blocks.gemm(x[:m].contiguous(), data, layout, bias)
        assert y is not None and y.shape == (m, n)
        err = (y.double() - ref[:m]).abs()
        assert (err <= bound[:m]).all(), (block_type, m, variant, (err / bound[:m]).max().item())


@pytest.mark.parametrize("block_type", KQUANTS)
def test_kquant_row_has_the_same_bits_alone_and_in_any_step(block_type: str, one_thread) -> None:
    """Bit for bit: a row alone, inside steps of 2..64 rows at any place in them, with one
    thread or two (the best build)."""
    n, k = 100, 512
    _, data, layout = _weight(n, k, block_type, seed=5)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([cpu_blocks.gemm(x[i:i + 1].contiguous(), data, layout)
                       for i in range(64)])
    for m in range(2, 65):
        start = (m * 7) % (65 - m)
        y = cpu_blocks.gemm(x[start:start + m].contiguous(), data, layout)
        assert torch.equal(y, alone[start:start + m]), (block_type, m)
    assert torch.equal(one_thread(lambda: cpu_blocks.gemm(x, data, layout)), alone)
