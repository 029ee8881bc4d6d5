"""The bf16 GEMM on AMX tiles (kernels/cpu/gemm_amx.c): its emulation everywhere, the
tiles themselves where the CPU has AMX and the kernel grants the tile state (the
`amx_check.sh` script runs this file there)."""
from __future__ import annotations

import pytest
import torch
from amx_modes import EMULATED, TILES, has_tiles, keep_amx_mode  # noqa: F401 (autouse)

from aioengine.kernels import cpu_build, cpu_gemm

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="no C kernels built")

MODES = [EMULATED] + ([TILES] if has_tiles() else [])


def _use(mode: int) -> None:
    assert cpu_build.set_amx_mode(mode) == {TILES: "tiles", EMULATED: "emulated"}[mode]


def _pack(mode: int, w: torch.Tensor) -> torch.Tensor:
    """w packed in the tile layout (what the loader does while AMX is on)."""
    _use(mode)
    packed = cpu_gemm.pack_weight(w)
    assert cpu_gemm.packed_format(packed) == cpu_gemm.GEMM_BF16T
    assert torch.equal(cpu_gemm.unpack_weight(packed, *w.shape), w)
    return packed


def _gemm(mode: int, x: torch.Tensor, packed: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    _use(mode)
    y = cpu_gemm.gemm(x, packed, n, bias)
    assert y is not None
    return y


def _bf16_weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,k", [(45, 10), (33, 37), (16, 64), (100, 77), (50, 576), (7, 1)])
def test_tiles_match_float64_for_every_m(mode: int, n: int, k: int) -> None:
    """x rounded to bf16 (as the tiles read it), exact products, float32 sums: within a few
    ulps of the sum of magnitudes of the float64 product, for M = 1..64."""
    w = _bf16_weight(n, k, seed=1)
    packed, bias = _pack(mode, w), torch.randn(n)
    x = torch.randn(64, k)
    xr, exact = x.bfloat16().double(), w.double()
    ref = xr @ exact.t() + bias.double()
    bound = 8 * k * torch.finfo(torch.float32).eps * (xr.abs() @ exact.abs().t() + 1)
    for m in range(1, 65):
        y = _gemm(mode, x[:m].contiguous(), packed, n, bias)
        assert ((y.double() - ref[:m]).abs() <= bound[:m]).all(), (m, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_row_has_the_same_bits_alone_and_in_any_step(mode: int, one_thread) -> None:
    """Bit for bit: a row alone, inside steps of 2..64 rows (whole and partial 16-row
    tiles, one panel or two), with one thread or two."""
    n, k = 200, 96
    packed = _pack(mode, _bf16_weight(n, k, seed=2))
    x = torch.randn(64, k)
    alone = torch.cat([_gemm(mode, x[i:i + 1].contiguous(), packed, n) for i in range(64)])
    for m in (2, 3, 15, 16, 17, 31, 32, 33, 48, 64):
        for start in (0, 64 - m):
            rows = x[start:start + m].contiguous()
            assert torch.equal(_gemm(mode, rows, packed, n), alone[start:start + m]), (m, start)
    assert torch.equal(one_thread(lambda: _gemm(mode, x, packed, n)), alone)


def test_the_emulation_is_the_measured_arithmetic() -> None:
    """One 32-k chunk as two sums, even k and odd k, then added: k = 4 with weights 2^24, 1,
    -2^24, 1 against x = 1 gives 2 (E = 2^24 - 2^24, O = 1 + 1). One chain in k order gives 1
    (2^24 + 1 rounds back to 2^24), vdpbf16ps's odd-then-even chain 0."""
    w = torch.tensor([[2.0**24, 1.0, -(2.0**24), 1.0]]).bfloat16()
    y = _gemm(EMULATED, torch.ones(1, 4), _pack(EMULATED, w), 1)
    assert y.item() == 2.0
    # chunks are added in k order: chunk 0 sums to 2^24, chunk 1 adds 1 (lost), 1 (lost)
    w2 = torch.zeros(1, 96)
    w2[0, 0], w2[0, 32], w2[0, 64] = 2.0**24, 1.0, 1.0
    y2 = _gemm(EMULATED, torch.ones(1, 96), _pack(EMULATED, w2.bfloat16()), 1)
    assert y2.item() == 2.0**24


def test_denormals_are_read_as_zero_and_flushed() -> None:
    """A bf16 denormal weight (or x) multiplies as zero; a denormal sum is flushed."""
    tiny = torch.tensor([[1.0e-39, 1.0]]).bfloat16()  # 1e-39: a bf16 denormal
    assert tiny[0, 0].item() != 0.0
    # 2^30 * 1e-39 would be a normal float32 (~1e-30): zero only if the weight reads as 0
    y = _gemm(EMULATED, torch.tensor([[2.0**30, 0.0]]), _pack(EMULATED, tiny), 1)
    assert y.item() == 0.0
    small = torch.tensor([[2.0**-100, 0.0]]).bfloat16()  # normal, but its square is not
    y = _gemm(EMULATED, torch.tensor([[2.0**-30, 0.0]]), _pack(EMULATED, small), 1)
    assert y.item() == 0.0  # 2^-130: a float32 denormal, flushed


@pytest.mark.skipif(TILES not in MODES, reason="no AMX tiles here (CPU flags or kernel)")
@pytest.mark.parametrize("scale", [1.0, 1e-18, 1e18])
def test_the_emulation_is_bit_equal_to_the_hardware(scale: float) -> None:
    """Random inputs over wide exponent ranges (products near the denormal range at
    1e-18), odd k, 1..40 rows: the tiles and the emulation give the same bits."""
    g = torch.Generator().manual_seed(3)
    for m, n, k in [(1, 48, 64), (7, 33, 37), (40, 100, 577), (16, 16, 1536)]:
        w = (torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, k),
                                                                       generator=g)))
        x = torch.randn(m, k, generator=g) * scale
        packed, bias = _pack(TILES, w.bfloat16()), torch.randn(n, generator=g)
        assert torch.equal(_gemm(TILES, x, packed, n, bias), _gemm(EMULATED, x, packed, n, bias))


def test_unavailable_tiles_fail_closed() -> None:
    """Asking for tiles where there are none leaves the vector kernels on, and bf16 weights
    packed for them."""
    if TILES in MODES:
        pytest.skip("this machine has AMX tiles")
    assert cpu_build.set_amx_mode(TILES) is None
    packed = cpu_gemm.pack_weight(torch.ones(16, 32).bfloat16())
    assert cpu_gemm.packed_format(packed) == cpu_gemm.PACKED_FORMATS[torch.bfloat16]


def test_tile_layout_rows_for_the_embedding() -> None:
    """packed_rows (a tied LM head's embedding lookup) reads the tile layout: odd K."""
    w = _bf16_weight(40, 37, seed=4)
    packed = _pack(EMULATED, w)
    rows = torch.tensor([0, 17, 39, 5])
    assert torch.equal(cpu_gemm.packed_rows(packed, rows, 37), w[rows])
