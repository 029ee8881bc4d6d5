"""The C packer of a GGUF's blocks (kernels/cpu/pack_blocks.c) against the torch packer that
defines the panel layout (kernels/cpu_blocks.py): the same bytes for every format, any n (a
multiple of 16 or not, the padding rows included) and k of one or several blocks, from
random bytes (NaN and infinite fp16 scales included) and from blocks that hold every code
value; the bytes unpack to the file's blocks; weights packed by it give the GEMM's float64
reference; and where it does not take the tensors, the torch path does, with the same bytes."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels import block_fields, cpu_blocks, cpu_build
from tests.model.test_block_gemm import _blocks, _float64_bound

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="CPU kernels not built")

TYPES = tuple(cpu_blocks.BLOCK_TYPES)
# (n, blocks per row): whole panels and not, one row, one block per row and several.
SHAPES = ((16, 1), (48, 3), (37, 2), (1, 1), (5, 4), (250, 2))


def _k(block_type: str, blocks_per_row: int) -> int:
    return blocks_per_row * cpu_blocks.BLOCK_TYPES[block_type].block_weights


def _random_bytes(block_type: str, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, cpu_blocks.row_bytes(k, block_type)), dtype=torch.uint8,
                         generator=g)


def _every_code(block_type: str, n: int, k: int) -> torch.Tensor:
    """Random bytes with a row of 0xFF bytes and a row of zeros: enough codes that each
    takes all its values (the test checks), the extremes in whole blocks."""
    raw = _random_bytes(block_type, n, k, seed=3)
    raw[0], raw[1] = 0xFF, 0
    return raw


def _c_and_reference(blocks: torch.Tensor, block_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The C packer's bytes (it must take these blocks) and the torch path's."""
    f = cpu_blocks.BLOCK_TYPES[block_type]
    k = blocks.shape[1] // f.block_bytes * f.block_weights
    ours = cpu_blocks._pack_c(blocks, f, k, None)
    assert ours is not None, "the C packer declined"
    assert torch.equal(cpu_blocks.pack_blocks(blocks, block_type), ours)  # pack_blocks uses it
    return ours, cpu_blocks.pack_blocks(blocks, block_type, reference=True)


def _first_difference(a: torch.Tensor, b: torch.Tensor, block_type: str) -> str:
    at = int((a != b).nonzero()[0])
    group = cpu_blocks.BLOCK_TYPES[block_type].group_bytes
    return f"byte {at} (group {at // group}, byte {at % group} of it): {int(a[at])} != {int(b[at])}"


@pytest.mark.parametrize("block_type", TYPES)
def test_c_packer_writes_the_reference_bytes(block_type: str) -> None:
    for seed, (n, blocks_per_row) in enumerate(SHAPES):
        k = _k(block_type, blocks_per_row)
        raw = _random_bytes(block_type, n, k, seed)
        ours, ref = _c_and_reference(raw, block_type)
        assert ours.numel() == ref.numel() == cpu_blocks.packed_nbytes(n, k, block_type)
        assert torch.equal(ours, ref), (block_type, n, k, _first_difference(ours, ref, block_type))
        assert torch.equal(cpu_blocks.unpack_blocks(ours, block_type, n, k), raw)


@pytest.mark.parametrize("block_type", TYPES)
def test_every_code_value(block_type: str) -> None:
    """Every code value (Q8_0's 256, Q6_K's 64, Q5_K's 32, ...) and every scale byte."""
    n, k = 96, _k(block_type, 4)
    raw = _every_code(block_type, n, k)
    codes = block_fields.file_fields(raw, block_type)["q"]
    assert codes.unique().numel() == 2 ** block_fields.CODE_BITS[block_type]  # the test's premise
    ours, ref = _c_and_reference(raw, block_type)
    assert torch.equal(ours, ref), (block_type, _first_difference(ours, ref, block_type))
    assert torch.equal(cpu_blocks.unpack_blocks(ours, block_type, n, k), raw)


@pytest.mark.parametrize("block_type", TYPES)
def test_into_a_slice_of_a_weight_buffer(block_type: str) -> None:
    """As Linear.load_block_rows packs: into `out`, a slice of a larger buffer, at a panel's
    offset, leaving the bytes around it alone; an `out` of another size is a ValueError."""
    n, k = 40, _k(block_type, 3)
    raw = _random_bytes(block_type, n, k, seed=7)
    nbytes = cpu_blocks.packed_nbytes(n, k, block_type)
    buf = torch.full((nbytes + 100,), 0xAB, dtype=torch.uint8)
    returned = cpu_blocks.pack_blocks(raw, block_type, out=buf[60:60 + nbytes])
    assert returned.data_ptr() == buf.data_ptr() + 60
    assert torch.equal(buf[60:60 + nbytes], cpu_blocks.pack_blocks(raw, block_type, reference=True))
    assert bool((buf[:60] == 0xAB).all()) and bool((buf[60 + nbytes:] == 0xAB).all())
    with pytest.raises(ValueError, match="packs to"):
        cpu_blocks.pack_blocks(raw, block_type, out=buf[:nbytes - 1])
    with pytest.raises(ValueError, match="whole"):
        cpu_blocks.pack_blocks(raw[:, 1:], block_type)


def test_same_bytes_on_any_number_of_threads() -> None:
    raw = _random_bytes("q6_k", 200, _k("q6_k", 2), seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_blocks.pack_blocks(raw, "q6_k")
        torch.set_num_threads(max(2, threads))
        many = cpu_blocks.pack_blocks(raw, "q6_k")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_torch_path_where_the_c_packer_does_not_apply(set_cpu_kernels) -> None:
    """Blocks the C packer does not take (not contiguous) and no kernels at all: the torch
    path, the same bytes."""
    raw = _random_bytes("q4_k", 48, _k("q4_k", 2), seed=5)
    expected = cpu_blocks.pack_blocks(raw, "q4_k")
    wide = torch.cat((raw, raw), dim=1)[:, :raw.shape[1]]  # rows strided: not contiguous
    assert not wide.is_contiguous()
    assert torch.equal(cpu_blocks.pack_blocks(wide, "q4_k"), expected)
    set_cpu_kernels("0")
    assert cpu_build.load() is None
    assert torch.equal(cpu_blocks.pack_blocks(raw, "q4_k"), expected)


@pytest.mark.parametrize("block_type", TYPES)
def test_c_packed_weights_give_the_float64_gemm(block_type: str) -> None:
    n, k = 37, _k(block_type, 2)
    blocks = _blocks(block_type, n, k, seed=n)
    data = cpu_blocks.pack_blocks(blocks, block_type)
    layout = cpu_blocks.layout_for([(block_type, n)], k)
    x, bias = torch.randn(7, k) * 3, torch.randn(n)
    ref, bound = _float64_bound(x, blocks, block_type, bias)
    y = cpu_blocks.gemm(x, data, layout, bias)
    assert y is not None
    assert ((y.double() - ref).abs() <= bound).all(), block_type
