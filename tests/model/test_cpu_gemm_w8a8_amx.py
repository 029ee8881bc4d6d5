"""W8A8 on AMX int8 tiles (kernels/cpu/gemm_amx_w8a8.c): the tiles' emulation in every
build whose W8A8 x is bytes (the VNNI builds), the tiles where the CPU has AMX and the kernel
grants the tile state (`scripts/amx_check.sh` runs this file there). Either gives torch's
`_int_mm` path's bits, as the vector tiles do: the tiles sum each element's exact int32 dot
over all of k and the float steps after it are w8_store's."""
from __future__ import annotations

import ctypes

import pytest
import torch
from amx_modes import EMULATED, OFF, TILES, has_tiles, keep_amx_mode  # noqa: F401 (autouse)

from aioengine.kernels import cpu_build, cpu_gemm
from aioengine.kernels.cpu_gemm_w8a8 import pack_w8a8
from aioengine.model.layers import _w8a8_linear, quantize_int8_rows

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="CPU kernels not built")

MIN_ROWS = 8  # gemm.h's AMX_W8A8_MIN_ROWS
BYTE_X_BUILDS = ("amx", "avx512_bf16")  # -mavx512vnni: x as q + 128 bytes (w8a8.h)
# (n, k): k below one 64-k chunk and not a multiple of 4, k of whole chunks, k with a tail
# of 11 groups, n with an edge panel and an odd panel count.
SHAPES = ((5, 7), (37, 128), (70, 300), (1000, 576))
ROWS = (7, 8, 15, 16, 17, 33, 64)


def _takes(rows: int) -> bool:
    fn = cpu_build.load().gemm_amx_w8a8_takes
    fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_int
    return bool(fn(rows))


def _check_int_mm_bits(mode: int) -> None:
    assert cpu_build.set_amx_mode(mode) is not None or mode == OFF
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        q, scales = quantize_int8_rows(torch.randn(n, k, generator=g))
        packed, bias = pack_w8a8(q), torch.randn(n, generator=g)
        x = torch.randn(max(ROWS), k, generator=g) * torch.logspace(-3, 2, max(ROWS))[:, None]
        x[3] = 0  # a zero row: scale 1
        for with_bias in (bias, None):
            ref = _w8a8_linear(x, q, with_bias, scales)
            for m in ROWS:
                y = cpu_gemm.gemm(x[:m].contiguous(), packed, n, with_bias, scales)
                assert torch.equal(y, ref[:m]), (cpu_build.variant(), mode, n, k, m)


def test_the_path_takes_byte_x_builds_from_its_row_count(variant: str) -> None:
    cpu_build.set_amx_mode(EMULATED)
    byte_x = variant in BYTE_X_BUILDS
    assert _takes(MIN_ROWS) == byte_x and _takes(512) == byte_x
    assert not _takes(MIN_ROWS - 1)
    cpu_build.set_amx_mode(OFF)
    assert not _takes(512)


def test_emulated_tiles_give_int_mm_bits(variant: str) -> None:
    _check_int_mm_bits(EMULATED)


@pytest.mark.skipif(not has_tiles(), reason="no AMX tiles here (CPU flags or kernel)")
def test_the_tiles_give_int_mm_bits() -> None:
    _check_int_mm_bits(TILES)
