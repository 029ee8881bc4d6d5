"""The any-M GEMM on W8A8 panels (GEMM_W8A8P, kernels/cpu/gemm_w8a8.h): every build this CPU
runs gives layers._w8a8_linear's bits (torch's `_int_mm` on x quantized per row) for M =
1..64, K and N not multiples of the tile, one or two threads; the repacking's round trip and
embedding rows; and a Linear stored as w8a8 packing in place."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_gemm
from aioengine.kernels.cpu_gemm_w8a8 import pack_w8a8, packed_shape, unpack_w8a8, w8a8_rows
from aioengine.model.layers import Linear, _w8a8_linear, quantize_int8_rows

# (N, K): K not a multiple of 4 and one edge panel; a few panels; a full-sized projection.
SHAPES = ((5, 7), (37, 66), (1000, 576))

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="CPU kernels not built")


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight as w8a8 stores it: int8 [n, k] and per-row float32 scales."""
    g = torch.Generator().manual_seed(seed)
    return quantize_int8_rows(torch.randn(n, k, generator=g))


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (their own scales), one of them zero (scale 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[min(3, m - 1)] = 0
    return x


@pytest.mark.parametrize("n,k", SHAPES)
def test_w8a8_gemm_gives_int_mm_bits_for_every_m(variant: str, n: int, k: int) -> None:
    q, scales = _weight(n, k)
    packed, bias = pack_w8a8(q), torch.randn(n)
    x = _x(64, k)
    ref = _w8a8_linear(x, q, bias, scales)
    ref_nobias = _w8a8_linear(x, q, None, scales)
    for m in range(1, 65):
        start = (m * 7) % (65 - m)
        rows = x[start:start + m].contiguous()
        y = cpu_gemm.gemm(rows, packed, n, bias, scales)
        assert y is not None and y.shape == (m, n)
        assert torch.equal(y, ref[start:start + m]), (m, variant)
    assert torch.equal(cpu_gemm.gemm(x, packed, n, None, scales), ref_nobias)


def test_w8a8_gemm_is_the_same_with_one_thread(variant: str, one_thread) -> None:
    n, k = 1000, 576
    q, scales = _weight(n, k, seed=1)
    packed, x = pack_w8a8(q), _x(40, k, seed=1)
    two = cpu_gemm.gemm(x, packed, n, None, scales)
    assert torch.equal(one_thread(lambda: cpu_gemm.gemm(x, packed, n, None, scales)), two)


def test_w8a8_pack_round_trips_and_gathers_rows() -> None:
    q, _ = _weight(45, 10, seed=2)
    packed = pack_w8a8(q)
    assert packed.shape == packed_shape(45, 10) == (3, 4, 64) and packed.dtype == torch.int8
    assert torch.equal(unpack_w8a8(packed, 45, 10), q)
    assert torch.equal(cpu_gemm.unpack_weight(packed, 45, 10), q)
    # Panel 1's header: its 16 columns' weight sums as int32.
    sums = packed[1, 0].view(torch.int32)
    assert torch.equal(sums, q[16:32].sum(dim=1, dtype=torch.int32))
    # Column 2 of panel 1 (row 18), k 4..7: group 1's bytes 8..11.
    assert torch.equal(packed[1, 2, 8:12], q[18, 4:8])
    assert not packed[2, 1:].view(3, 16, 4)[:, 13:].any()  # columns past N: zeros
    assert not packed[:, 3].view(3, 16, 4)[:, :, 2:].any()  # k past K: zeros
    rows = torch.tensor([0, 18, 44, 18])
    assert torch.equal(w8a8_rows(packed, rows, 10), q[rows])
    assert torch.equal(cpu_gemm.packed_rows(packed, rows, 10), q[rows])
    assert cpu_gemm.packed_format(packed) == cpu_gemm.GEMM_W8A8P


def test_w8a8_gemm_declines_what_it_does_not_take() -> None:
    q, scales = _weight(20, 64)
    packed = pack_w8a8(q)
    assert cpu_gemm.gemm(torch.randn(3, 60), packed, 20, None, scales) is None  # K mismatch
    assert cpu_gemm.gemm(torch.randn(3, 64), packed, 40, None, torch.ones(40)) is None
    assert cpu_gemm.gemm(torch.randn(3, 64), packed, 20) is None  # no scales
    assert cpu_gemm.gemm(torch.randn(3, 64).double(), packed, 20, None, scales) is None


def test_w8a8_linear_packs_in_place(set_cpu_kernels) -> None:
    """A Linear stored as w8a8 repacks into panels (+4 bytes a column, no second copy), its
    forward is the GEMM for every row count with _w8a8_linear's bits, and with the kernels
    off it unpacks for the call and computes the same bits. Before packing (no row-major
    W8A8 kernel) it is _w8a8_linear itself, and no C kernel claims it (kernel_format)."""
    lin = Linear(96, 70, True, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        lin.weight.copy_(torch.randn(70, 96))
        lin.bias.copy_(torch.randn(70))
    lin.convert("w8a8")
    q, scales = lin.weight.clone(), lin.scales
    x = torch.randn(33, 96)
    ref = _w8a8_linear(x, q, lin.bias, scales)
    assert lin.kernel_format is None
    for m in (1, 4):
        assert torch.equal(lin(x[:m]), ref[:m])
    before = lin.nbytes()
    added = lin.pack()
    assert lin.is_packed and lin.storage == "w8a8" and lin.packed is None
    assert added == 80 * 4 + 10 * 96 and lin.nbytes() == before + added  # sums, padding
    assert lin.kernel_format == cpu_gemm.GEMM_W8A8P
    assert torch.equal(lin.dense_weight(), q)
    for m in (1, 4, 9, 33):
        assert torch.equal(lin(x[:m]), ref[:m])
    set_cpu_kernels("0")
    assert torch.equal(lin(x), ref)
