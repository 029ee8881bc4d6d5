"""The any-M GEMM on panel-packed weights (kernels/cpu/gemm.h, kernels/cpu_gemm.py): every
build this CPU runs against a float64 reference for M = 1..64 and shapes that are not
multiples of the tile, and one arithmetic per output element whatever the rows beside it.
GGUF Q4_1 blocks (gemm_q4_1.h) in tests/model/test_cpu_gemm_q4_1.py."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_gemm
from aioengine.model.layers import Linear, quantize_int8_rows

VARIANTS = cpu_kernels.supported_variants()
FORMATS = ("float32", "bfloat16", "int8")
# (N, K): an edge panel, K of 1, odd K, a full-sized projection.
SHAPES = ((37, 19), (16, 1), (100, 64), (1000, 576))

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels not built")



def _weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None,
                                                               torch.Tensor]:
    """(the stored weight, its scales, its exact value in float64)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if fmt == "int8":
        q, scales = quantize_int8_rows(w)
        return q, scales, q.double() * scales.double()[:, None]
    stored = w.to(getattr(torch, fmt))
    return stored, None, stored.double()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_matches_float64_for_every_m(variant: str, fmt: str, n: int, k: int) -> None:
    w, scales, exact = _weight(fmt, n, k)
    packed = cpu_gemm.pack_weight(w)
    bias = torch.randn(n)
    x = torch.randn(64, k)
    # The AVX512-BF16 build multiplies bf16 pairs: x rounded to bf16 first (documented).
    xr = x.bfloat16().double() if fmt == "bfloat16" and cpu_gemm.rounds_x_to_bf16() else x.double()
    assert cpu_gemm.rounds_x_to_bf16() == (fmt == "bfloat16" and variant in ("avx512_bf16", "amx")) \
        or fmt != "bfloat16"
    ref = xr @ exact.t() + bias.double()
    # float32 sums of k exact products: error within a few ulps of the sum of magnitudes
    bound = 8 * k * torch.finfo(torch.float32).eps * (xr.abs() @ exact.abs().t() + 1)
    for m in range(1, 65):
        y = cpu_gemm.gemm(x[:m].contiguous(), packed, n, bias, scales)
        assert y is not None and y.shape == (m, n)
        assert ((y.double() - ref[:m]).abs() <= bound[:m]).all(), (m, variant)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_has_the_same_bits_alone_and_in_any_step(variant: str, fmt: str,
                                                      one_thread) -> None:
    """Bit for bit: a row alone, inside steps of 2..64 rows, at any place in them, and with
    one thread or two."""
    n, k = 1000, 576
    w, scales, _ = _weight(fmt, n, k, seed=1)
    packed = cpu_gemm.pack_weight(w)
    x = torch.randn(64, k)
    alone = torch.cat([cpu_gemm.gemm(x[i:i + 1].contiguous(), packed, n, None, scales)
                       for i in range(64)])
    for m in range(2, 65):
        start = (m * 7) % (65 - m)
        y = cpu_gemm.gemm(x[start:start + m].contiguous(), packed, n, None, scales)
        assert torch.equal(y, alone[start:start + m]), m
    assert torch.equal(one_thread(lambda: cpu_gemm.gemm(x, packed, n, None, scales)), alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pack_round_trips_and_rows_gather(dtype: torch.dtype) -> None:
    w = (torch.randn(45, 7) * 50).to(dtype)
    packed = cpu_gemm.pack_weight(w)
    # bf16 while AMX is on: the tile layout, k padded to 32 in pairs (test_cpu_gemm_amx.py)
    tiles = dtype == torch.bfloat16 and cpu_gemm.amx_layout()
    assert packed.shape == ((3, 16, 32) if tiles else (3, 7, 16)) and packed.dtype == dtype
    assert (packed[2, :, :] != 0).sum() <= 13 * 7  # the edge panel's padding is zeros
    assert torch.equal(cpu_gemm.unpack_weight(packed, 45, 7), w)
    rows = torch.tensor([0, 44, 8, 15, 16, 3, 8])
    assert torch.equal(cpu_gemm.packed_rows(packed, rows, 7), w[rows])


def test_gemm_declines_what_it_does_not_take() -> None:
    w = torch.randn(20, 8)
    packed = cpu_gemm.pack_weight(w)
    assert cpu_gemm.gemm(torch.randn(3, 8, dtype=torch.float64), packed, 20) is None
    assert cpu_gemm.gemm(torch.randn(3, 9), packed, 20) is None  # K mismatch
    assert cpu_gemm.gemm(torch.randn(3, 8), packed, 40) is None  # more columns than panels
    assert cpu_gemm.gemm(torch.randn(3, 8), packed, 20, scales=torch.ones(20)) is None
    assert cpu_gemm.gemm(torch.randn(8, 3).t(), packed, 20) is None  # not contiguous
    assert cpu_gemm.gemm(torch.randn(0, 8), packed, 20).shape == (0, 20)
    # Codes 0-4 (the row-major gemvs, retired: projection.h) are unknown to the entry point,
    # which computes nothing for them.
    lib = cpu_kernels.load()
    x, out = torch.randn(3, 8), torch.full((3, 20), 7.0)
    for code in range(5):
        assert lib.packed_gemm(out.data_ptr(), x.data_ptr(), w.data_ptr(), None, code, None,
                               3, 20, 8, 1) == -2
    assert (out == 7.0).all()


def test_int8_weights_are_within_half_a_step() -> None:
    """quantize_int8_rows (the int8 and w8a8 storages): every weight within half its row's
    step of its stored value."""
    w = torch.randn(300, 576, generator=torch.Generator().manual_seed(0))
    q, s = quantize_int8_rows(w)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
def test_packed_linear_is_the_gemm_and_unpacks_without_kernels(storage: str,
                                                               set_cpu_kernels) -> None:
    """A Linear repacks in place (no second copy), its forward is the GEMM for any rows,
    and with the kernels turned off afterwards it computes the same values from the weight
    unpacked for the call."""
    lin = Linear(96, 70, True, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 96))
        lin.bias.copy_(torch.randn(70))
    lin.convert(storage)
    dense = lin.dense_weight().clone()
    assert lin.pack() >= 0 and lin.is_packed and lin.packed is None
    assert torch.equal(lin.dense_weight(), dense)
    x = torch.randn(9, 96)
    fast = lin(x)
    assert torch.equal(fast, cpu_gemm.gemm(x, lin.weight, 70, lin.bias, lin.scales))
    rounds = storage == "bfloat16" and cpu_gemm.rounds_x_to_bf16()
    set_cpu_kernels("0")
    slow = lin(x if not rounds else x.bfloat16().float())  # the GEMM's x, as it rounds it
    torch.testing.assert_close(slow, fast, atol=1e-4, rtol=1e-4)
