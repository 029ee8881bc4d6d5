"""The GGUF block formats' GEMM on AMX int8 tiles (kernels/cpu/gemm_amx_blocks.c): the
tiles' emulation in every build, the tiles themselves where the CPU has AMX and the kernel
grants the tile state (`scripts/amx_check.sh` runs this file there). Either gives the vector
tiles' bits: the tiles form each block's integer dot, exact, and the float steps after it
are the vector tiles' own, so a row's bits do not depend on which path its step took."""
from __future__ import annotations

import ctypes

import pytest
import torch
from amx_modes import EMULATED, OFF, TILES, has_tiles, keep_amx_mode  # noqa: F401 (autouse)
from test_block_gemm import _blocks, _k, _packed, _random_bytes, _with_sane_halves

from aioengine.kernels import cpu_blocks, cpu_build

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="CPU kernels not built")

AMX_TYPES = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k")
MIN_ROWS = 32  # gemm.h's AMX_BLOCK_MIN_ROWS
# Below the path's minimum, one whole 16-row tile pair, partial tiles (33, 47), four tiles.
ROWS = (31, 32, 33, 47, 64)
# (n, blocks per row): a lone edge panel, one block per row, several panels (3 in flight:
# 70 columns are 5 panels, a group of 3 and one of 2).
SHAPES = ((37, 3), (100, 1), (70, 8))


def _takes(block_type: str, rows: int) -> bool:
    """Whether gemm_range sends `rows` rows of this format to the tiles (or their emulation)."""
    fn = cpu_build.load().gemm_amx_blocks_takes
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_int
    return bool(fn(cpu_blocks.BLOCK_TYPES[block_type].code, rows))


def _products(mode: int, block_type: str, seed: int) -> list[torch.Tensor]:
    """For each shape and row count, y = x w^T + bias with the AMX mode set to `mode`."""
    assert cpu_build.set_amx_mode(mode) == {OFF: None, TILES: "tiles", EMULATED: "emulated"}[mode]
    out = []
    for n, blocks_per_row in SHAPES:
        k = _k(block_type, blocks_per_row)
        blocks = _blocks(block_type, n, k, seed=seed + n)
        if block_type == "q8_0":  # the full code range, -128 included
            blocks = _with_sane_halves(_random_bytes(block_type, n, k, seed=n), block_type, n)
        data, layout = _packed(block_type, blocks, k)
        g = torch.Generator().manual_seed(seed + k)
        x, bias = torch.randn(max(ROWS), k, generator=g) * 3, torch.randn(n, generator=g)
        x[1, ::32] = 60.0  # a block whose quantized values reach 127
        out += [cpu_blocks.gemm(x[:m].contiguous(), data, layout, bias) for m in ROWS]
    return out


def test_the_path_takes_its_formats_from_its_row_count() -> None:
    cpu_build.set_amx_mode(EMULATED)
    for block_type in AMX_TYPES:
        assert _takes(block_type, MIN_ROWS) and _takes(block_type, 512)
        assert not _takes(block_type, MIN_ROWS - 1)
    assert not _takes("q4_1", 512)  # Q4_1 keeps its own tiles
    cpu_build.set_amx_mode(OFF)
    assert not any(_takes(t, 512) for t in AMX_TYPES)


@pytest.mark.parametrize("block_type", AMX_TYPES)
def test_emulated_tiles_give_the_vector_bits(variant: str, block_type: str) -> None:
    """In every build (the AVX-512 float steps or the plain C ones after the emulated
    products), for every row count around and above the path's minimum."""
    vector = _products(OFF, block_type, seed=1)
    emulated = _products(EMULATED, block_type, seed=1)
    for i, (a, b) in enumerate(zip(vector, emulated)):
        assert torch.equal(a, b), (variant, block_type, SHAPES[i // len(ROWS)], ROWS[i % len(ROWS)])


@pytest.mark.skipif(not has_tiles(), reason="no AMX tiles here (CPU flags or kernel)")
@pytest.mark.parametrize("block_type", AMX_TYPES)
def test_the_tiles_give_the_emulation_and_vector_bits(block_type: str) -> None:
    """On AMX hardware: tdpbsud's sums equal the emulation's, so all three paths agree."""
    tiles = _products(TILES, block_type, seed=2)
    for other in (EMULATED, OFF):
        for a, b in zip(tiles, _products(other, block_type, seed=2)):
            assert torch.equal(a, b), (block_type, other)


@pytest.mark.parametrize("block_type", ("q4_k", "q6_k"))
def test_a_row_has_the_same_bits_in_steps_on_either_side_of_the_minimum(block_type: str,
                                                                           one_thread) -> None:
    """Rows alone (vector tiles) against the same rows inside steps of 32..64 (the tiles'
    emulation), one thread or two: batching never changes a token's logits."""
    n, k = 40, _k(block_type, 2)
    data, layout = _packed(block_type, _blocks(block_type, n, k, seed=5), k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(5))
    cpu_build.set_amx_mode(EMULATED)
    alone = torch.cat([cpu_blocks.gemm(x[i:i + 1].contiguous(), data, layout) for i in range(64)])
    for m in (32, 45, 64):
        start = 64 - m
        y = cpu_blocks.gemm(x[start:start + m].contiguous(), data, layout)
        assert torch.equal(y, alone[start:start + m]), (block_type, m)
    assert torch.equal(one_thread(lambda: cpu_blocks.gemm(x, data, layout)), alone)
