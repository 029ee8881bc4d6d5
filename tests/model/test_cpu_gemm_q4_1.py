"""The any-M GEMM on a GGUF's Q4_1 blocks repacked into panels (GEMM_Q41P,
kernels/cpu/gemm_q4_1.h): every build this CPU runs against a float64 reference for M =
1..64 and N not a multiple of 16, one arithmetic per output element whatever the rows beside
it (and the same bits from the AVX2 and AVX-512 builds), the repacking's round trip, and a
Linear holding the blocks."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_blocks, cpu_gemm
from aioengine.model.layers import (Linear, _q4_1_linear, dequantize_q4_1,
                                    quantize_dequantize_blocks)

VARIANTS = cpu_kernels.supported_variants()
# (N, K): one edge panel, a few panels and an edge one, a full-sized projection.
SHAPES = ((5, 32), (37, 64), (1000, 576))

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels not built")



def _blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF Q4_1 blocks [n, k / 32 * 20] of a random weight, quantized by the gguf package."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1))


@pytest.mark.parametrize("n,k", SHAPES)
def test_q4_1_gemm_matches_float64_for_every_m(variant: str, n: int, k: int) -> None:
    blocks = _blocks(n, k)
    packed = cpu_gemm.pack_weight(blocks)
    x, bias = torch.randn(64, k) * 3, torch.randn(n)
    # x as the kernel quantizes it (per 32-block, bit for bit), the weights exactly.
    xq, w = quantize_dequantize_blocks(x).double(), dequantize_q4_1(blocks).double()
    ref = xq @ w.t() + bias.double()
    bound = 8 * k * torch.finfo(torch.float32).eps * (xq.abs() @ w.abs().t() + 1)
    for m in range(1, 65):
        y = cpu_gemm.gemm(x[:m].contiguous(), packed, n, bias)
        assert y is not None and y.shape == (m, n)
        assert ((y.double() - ref[:m]).abs() <= bound[:m]).all(), (m, variant)


def test_q4_1_x_is_quantized_as_quantize_dequantize_blocks(variant: str) -> None:
    """Bit for bit: with blocks that pick one x element each (d = 1, m = 0, one nibble of
    1), y is s_b * qx, which quantize_dequantize_blocks computes the same way."""
    k = 64
    blocks = torch.zeros(k, k // 32, 20, dtype=torch.uint8)
    blocks[:, :, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for c in range(k):  # column c reads weight c: block c // 32, nibble byte (c % 32) % 16
        j = c % 32
        blocks[c, c // 32, 4 + j % 16] = 1 if j < 16 else 16
    packed = cpu_gemm.pack_weight(blocks.view(k, -1))
    x = torch.randn(40, k) * torch.logspace(-3, 3, 40)[:, None]
    x[3, :32] = 0  # a zero block: scale 1
    y = cpu_gemm.gemm(x, packed, k)
    assert torch.equal(y, quantize_dequantize_blocks(x))


def test_q4_1_row_has_the_same_bits_alone_and_in_any_step(variant: str, one_thread) -> None:
    """Bit for bit: a row alone, inside steps of 2..64 rows at any place in them, with one
    thread or two; and the AVX2 and AVX-512 builds agree (the same roundings per element)."""
    n, k = 1000, 576
    packed = cpu_gemm.pack_weight(_blocks(n, k, seed=1))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([cpu_gemm.gemm(x[i:i + 1].contiguous(), packed, n) for i in range(64)])
    for m in range(2, 65):
        start = (m * 7) % (65 - m)
        y = cpu_gemm.gemm(x[start:start + m].contiguous(), packed, n)
        assert torch.equal(y, alone[start:start + m]), m
    assert torch.equal(one_thread(lambda: cpu_gemm.gemm(x, packed, n)), alone)
    if variant != cpu_kernels.BASELINE_VARIANT:  # without FMA: two roundings per step
        cpu_kernels.use_variant("avx2" if "avx2" in VARIANTS else variant)
        assert torch.equal(cpu_gemm.gemm(x, packed, n), alone)


def test_q4_1_pack_round_trips() -> None:
    blocks = _blocks(45, 96)
    packed = cpu_gemm.pack_weight(blocks)
    assert packed.shape == (3, 3, 320) and packed.dtype == torch.uint8
    assert cpu_gemm.packed_shape(blocks) == packed.shape
    assert cpu_gemm.packed_in_features(packed) == 96
    assert packed.numel() == 48 * 3 * 20  # the same bytes, plus the edge panel's 3 columns
    assert torch.equal(cpu_gemm.unpack_weight(packed, 45), blocks)
    # Column 2 of panel 1 (row 18): its d and m, then its nibble bytes 4 j .. 4 j + 3.
    row = blocks[18].view(3, 20)[1]
    group = packed[1, 1]
    assert torch.equal(group[4:6], row[0:2]) and torch.equal(group[36:38], row[2:4])
    assert torch.equal(group[64 + 64 * 3 + 8:64 + 64 * 3 + 12], row[4 + 12:4 + 16])
    assert not packed[2, :, 64:].view(3, 4, 16, 4)[:, :, 13:].any()  # padding: zero blocks
    with pytest.raises(ValueError):
        cpu_gemm.packed_rows(packed, torch.tensor([0]))


def test_q4_1_gemm_declines_what_it_does_not_take() -> None:
    packed = cpu_gemm.pack_weight(_blocks(20, 64))
    assert cpu_gemm.gemm(torch.randn(3, 32), packed, 20) is None  # K mismatch
    assert cpu_gemm.gemm(torch.randn(3, 64), packed, 40) is None  # more columns than panels
    assert cpu_gemm.gemm(torch.randn(3, 64), packed, 20, scales=torch.ones(20)) is None
    assert cpu_gemm.gemm(torch.randn(3, 64), packed[:, :, :160].contiguous(), 20) is None
    assert not cpu_gemm.can_pack(torch.zeros(4, 30, dtype=torch.uint8))  # not whole blocks


def test_q4_1_linear_packs_in_place_and_unpacks_without_kernels(set_cpu_kernels) -> None:
    """A Linear's Q4_1 blocks pack into panels of the same bytes as they load
    (use_block_storage, load_block_rows: no second copy), its forward is the GEMM for every
    row count, and with the kernels off it computes the same values from the blocks
    (dequantized per call, x quantized per 32-block the same way: _q4_1_linear)."""
    lin = Linear(96, 70, True, torch.float32, torch.device("cpu"))
    lin.use_block_storage(cpu_blocks.layout_for([("q4_1", 70)], 96))
    blocks = _blocks(70, 96, seed=2)
    with torch.no_grad():
        lin.load_block_rows(0, blocks, "q4_1")
        lin.bias.copy_(torch.randn(70))
    x = torch.randn(9, 96)
    assert lin.kernel_format == cpu_gemm.PACKED_FORMATS[torch.uint8] and lin.storage == "q4_1"
    # The panels hold the blocks plus the 10 padding columns' blocks.
    assert lin.nbytes() == (70 + 10) * 3 * 20 + 70 * 4 and lin.pack() == 0
    assert torch.equal(cpu_blocks.unpack_blocks(lin.weight, "q4_1", 70, 96), blocks)
    for m in (1, 4, 9):
        want = cpu_blocks.gemm(x[:m].contiguous(), lin.weight, lin.blocks, lin.bias)
        if want is not None:
            assert torch.equal(lin(x[:m]), want)
    fast = lin(x)
    set_cpu_kernels("0")
    torch.testing.assert_close(lin(x), fast, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lin(x), _q4_1_linear(x, blocks, lin.bias), atol=1e-4, rtol=1e-4)
