"""Panel-packed weights and the any-M GEMM that reads them (`kernels/cpu/gemm.h`).

A projection's weight [N, K] is repacked once at load into [ceil(N / 16), K, 16] (panel p
holds output columns 16 p .. 16 p + 15, k-major; the last panel zero-padded) in its own
dtype: float32, bf16, or int8 with per-column scales. The packed tensor replaces the
row-major one (no second copy). A GGUF's Q4_1 blocks (uint8 [N, K / 32 * 20]) are
repacked byte for byte into [ceil(N / 16), K / 32, 320] (kernels/cpu/gemm_q4_1.h: per
32-block the 16 columns' d, m and nibbles interleaved four bytes per column), the same
bytes. `gemm` then computes x [M, K] @ W^T for any M with one arithmetic per output
element, so a row's result does not depend on the rows beside it. With bf16 weights the
AVX512-BF16 and AMX builds round x to bf16 and take k in pairs (`rounds_x_to_bf16`; AMX's
tiles in 32-k chunks, `cpu_build.amx_mode`, kernels/cpu/gemm_amx.c); the others
keep x in float32; Q4_1 quantizes x per 32-block to int8 (`int8_rows.quantize_dequantize_blocks`).
W8A8's int8 weights have panels of their own (`cpu_gemm_w8a8.py`, told apart by their 64-byte
rows: `packed_format`), x quantized per row.
"""
from __future__ import annotations

import torch
from torch import Tensor

from aioengine.kernels import cpu_build
from aioengine.kernels.cpu_gemm_w8a8 import is_w8a8_panels, unpack_w8a8, w8a8_rows
from aioengine.kernels.cpu_gemm_w8a8 import packed_shape as w8a8_packed_shape

PANEL = 16  # gemm.h's GEMM_NR
# gemm.h's GEMM_*P codes, by the packed tensor's dtype.
PACKED_FORMATS = {torch.float32: 5, torch.bfloat16: 6, torch.int8: 7, torch.uint8: 8}
GEMM_W8A8P = 9  # int8 panels of 4-k groups (cpu_gemm_w8a8.py), x quantized per row
# bf16 in AMX's tile layout (kernels/cpu/gemm_amx.c): [ceil(N / 16), pairs, 32] with pairs =
# ceil(K / 2) rounded up to 16 (tile_pairs); element [p, r, 2 j + h] is w[16 p + j, 2 r + h]
# (zeros past N and K). What pack_weight writes for bf16 while AMX is on (amx_layout).
GEMM_BF16T = 15
# Q4_1: 32 weights per 20-byte block; a panel's group of one 32-block is 16 such blocks.
Q4_1_BLOCK, Q4_1_BLOCK_BYTES = 32, 20
Q4_1_GROUP_BYTES = PANEL * Q4_1_BLOCK_BYTES


# The builds whose bf16 GEMM rounds x to bf16 (AVX512-BF16's vdpbf16ps and AMX's tdpbf16ps
# multiply bf16 pairs); the others multiply float32 x by the widened weights, unless AMX's
# arithmetic is emulated (cpu_build.amx_mode()).
_ROUNDING_BUILDS = frozenset({"avx512_bf16", "amx"})


def rounds_x_to_bf16() -> bool:
    """Whether the loaded build's bf16 GEMM rounds x to bf16 (to nearest even) before its
    exact products and float32 sums: a documented difference in arithmetic between builds,
    never between row counts of one build."""
    return cpu_build.load() is not None and (cpu_build.variant() in _ROUNDING_BUILDS
                                             or cpu_build.amx_mode() is not None)


def can_pack(weight: Tensor) -> bool:
    """Whether `weight` [N, K] (Q4_1: uint8 blocks [N, K / 32 * 20]) has a packed form the
    built kernels read."""
    return (weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in PACKED_FORMATS and cpu_build.load() is not None
            and (weight.dtype != torch.uint8 or weight.shape[1] % Q4_1_BLOCK_BYTES == 0))


def amx_layout() -> bool:
    """Whether pack_weight gives bf16 weights AMX's tile layout (GEMM_BF16T): while the
    loaded build multiplies them on tiles or emulates the tiles (cpu_build.amx_mode)."""
    return cpu_build.load() is not None and cpu_build.amx_mode() is not None


def tile_pairs(k: int) -> int:
    """Pairs of k per row of the tile layout (gemm.h's gemm_x_pair_stride)."""
    return (k + 31) // 32 * 16


def is_bf16_tiles(packed: Tensor) -> bool:
    """Whether a packed weight is in AMX's tile layout (its 64-byte rows of 32 bf16)."""
    return packed.dtype == torch.bfloat16 and packed.dim() == 3 and packed.shape[2] == 2 * PANEL


def packed_shape(weight: Tensor) -> tuple[int, int, int]:
    """The shape `pack_weight` gives `weight`."""
    n, k = weight.shape
    if weight.dtype == torch.uint8:
        return -(-n // PANEL), k // Q4_1_BLOCK_BYTES, Q4_1_GROUP_BYTES
    if weight.dtype == torch.bfloat16 and amx_layout():
        return -(-n // PANEL), tile_pairs(k), 2 * PANEL
    return -(-n // PANEL), k, PANEL


def packed_format(packed: Tensor) -> int:
    """The GEMM_*P code of a packed weight."""
    if is_bf16_tiles(packed):
        return GEMM_BF16T
    return GEMM_W8A8P if is_w8a8_panels(packed) else PACKED_FORMATS[packed.dtype]


def _k_matches(packed: Tensor, k: int) -> bool:
    """Whether a packed weight takes x of k features."""
    if is_w8a8_panels(packed):
        return packed.shape[1] == w8a8_packed_shape(1, k)[1]
    if is_bf16_tiles(packed):
        return packed.shape[1] == tile_pairs(k)
    return packed_in_features(packed) == k


def packed_in_features(packed: Tensor) -> int:
    """K of a packed weight (not of W8A8 panels, which round it up to a multiple of 4, nor
    of the bf16 tile layout's, to a multiple of 32)."""
    if packed.dtype == torch.uint8:
        return packed.shape[1] * Q4_1_BLOCK
    return packed.shape[1]


# Where column j of a panel sits: bf16 panels interleave columns j and j + 8 (one 32-bit
# lane holds both, which gemm.h widens with a shift and a mask); the others keep the order.
_BF16_SLOT = torch.tensor([2 * (j % 8) + j // 8 for j in range(PANEL)])
_BF16_ORDER = torch.argsort(_BF16_SLOT)  # the column held by each slot


def _slots(dtype: torch.dtype) -> Tensor | None:
    return _BF16_SLOT if dtype == torch.bfloat16 else None


def pack_weight(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16] in the same dtype (bf16 while AMX is on,
    amx_layout: [ceil(N / 16), tile_pairs(K), 32], GEMM_BF16T); Q4_1 blocks [N, K / 32 * 20]
    -> [ceil(N / 16), K / 32, 320] (into `out` when given: e.g. a huge-page buffer of
    `packed_shape`)."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = weight
    if panels * PANEL != n:  # zeros: Q4_1 blocks with d = m = 0, weights 0
        padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype)
        padded[:n] = weight
    if weight.dtype == torch.uint8:
        view = _q4_1_panels(padded.view(panels, PANEL, k // Q4_1_BLOCK_BYTES, Q4_1_BLOCK_BYTES))
    elif weight.dtype == torch.bfloat16 and amx_layout():
        view = _bf16_tiles(padded.view(panels, PANEL, k))
    else:
        grouped = padded.view(panels, PANEL, k)
        if weight.dtype == torch.bfloat16:
            grouped = grouped[:, _BF16_ORDER]
        view = grouped.transpose(1, 2)
    if out is None:
        return view.contiguous()
    return out.copy_(view)


def _bf16_tiles(grouped: Tensor) -> Tensor:
    """[panels, 16 columns, k] -> [panels, tile_pairs(k), 32]: per pair of k, every column's
    two values side by side (GEMM_BF16T)."""
    p, _, k = grouped.shape
    padded = torch.nn.functional.pad(grouped, (0, 2 * tile_pairs(k) - k))
    return padded.view(p, PANEL, -1, 2).transpose(1, 2).reshape(p, -1, 2 * PANEL)


def _q4_1_panels(blocks: Tensor) -> Tensor:
    """[panels, 16 columns, nb, 20] -> [panels, nb, 320]: per 32-block the columns' d (32
    bytes), m (32 bytes), then nibble bytes 4 j .. 4 j + 3 of every column for j = 0..3
    (gemm_q4_1.h)."""
    p, _, nb, _ = blocks.shape
    b = blocks.permute(0, 2, 1, 3)  # [p, nb, 16, 20]
    quants = b[..., 4:].reshape(p, nb, PANEL, 4, 4).transpose(2, 3)  # [p, nb, j, column, 4]
    return torch.cat((b[..., 0:2].reshape(p, nb, 32), b[..., 2:4].reshape(p, nb, 32),
                      quants.reshape(p, nb, 256)), dim=-1)


def _q4_1_blocks(packed: Tensor) -> Tensor:
    """`_q4_1_panels` undone: [panels, nb, 320] -> [panels * 16, nb * 20]."""
    p, nb, _ = packed.shape
    d = packed[..., 0:32].reshape(p, nb, PANEL, 2)
    m = packed[..., 32:64].reshape(p, nb, PANEL, 2)
    quants = packed[..., 64:].reshape(p, nb, 4, PANEL, 4).transpose(2, 3).reshape(p, nb, PANEL, 16)
    blocks = torch.cat((d, m, quants), dim=-1)  # [p, nb, 16, 20]
    return blocks.transpose(1, 2).reshape(p * PANEL, nb * Q4_1_BLOCK_BYTES)


def unpack_weight(packed: Tensor, n: int, k: int | None = None) -> Tensor:
    """The row-major [n, K] weight (Q4_1: the blocks [n, K / 32 * 20]) back from its packed
    form (a copy); W8A8 panels need k."""
    if is_w8a8_panels(packed):
        assert k is not None, "W8A8 panels need in_features to unpack"
        return unpack_w8a8(packed, n, k)
    if packed.dtype == torch.uint8:
        return _q4_1_blocks(packed)[:n].contiguous()
    if is_bf16_tiles(packed):
        p, pairs, _ = packed.shape
        rows = packed.view(p, pairs, PANEL, 2).transpose(1, 2).reshape(p * PANEL, 2 * pairs)
        return rows[:n, :k].contiguous()
    panels, k, _ = packed.shape
    cols = packed if (slots := _slots(packed.dtype)) is None else packed[:, :, slots]
    return cols.transpose(1, 2).reshape(panels * PANEL, k)[:n].contiguous()


def packed_rows(packed: Tensor, rows: Tensor, k: int | None = None) -> Tensor:
    """Rows `rows` [T] (int64) of the weight, [T, K], gathered from its packed form: the
    embedding lookup of a table that is also the (tied) LM head (W8A8 panels need k). Not
    for Q4_1 panels (ValueError): an embedding is never stored so."""
    if is_w8a8_panels(packed):
        assert k is not None, "W8A8 panels need in_features to gather rows"
        return w8a8_rows(packed, rows, k)
    if packed.dtype == torch.uint8:
        raise ValueError("packed_rows: Q4_1 panels hold no embedding table")
    col = rows % PANEL
    if is_bf16_tiles(packed):
        pairs = packed.view(packed.shape[0], packed.shape[1], PANEL, 2)[rows // PANEL, :, col]
        return pairs.reshape(rows.shape[0], -1)[:, :k]
    if (slots := _slots(packed.dtype)) is not None:
        col = slots[col]
    return packed[rows // PANEL, :, col]


def gemm(x: Tensor, packed: Tensor, n: int, bias: Tensor | None = None,
         scales: Tensor | None = None) -> Tensor | None:
    """x [M, K] float32 @ W^T (* scales [n]) (+ bias [n]) -> [M, n] float32 for any M, W
    packed by `pack_weight` (or `cpu_gemm_w8a8.pack_w8a8`: x quantized per row); None (nothing computed) where the kernel does not apply or is
    not built, so the caller takes its torch path."""
    lib = cpu_build.load()
    if (lib is None or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu"
            or not x.is_contiguous() or packed.dim() != 3 or not packed.is_contiguous()
            or packed.dtype not in PACKED_FORMATS or not _k_matches(packed, x.shape[1])
            or packed.shape[0] * PANEL < n
            or (packed.dtype == torch.uint8 and packed.shape[2] != Q4_1_GROUP_BYTES)
            or (packed.dtype == torch.int8) != (scales is not None)):
        return None
    for t in (bias, scales):
        if t is not None and not (t.dtype == torch.float32 and t.is_contiguous()
                                  and t.shape == (n,)):
            return None
    m, k = x.shape
    out = x.new_empty((m, n))
    if m == 0:
        return out
    rc = lib.packed_gemm(out.data_ptr(), x.data_ptr(), packed.data_ptr(),
                         0 if scales is None else scales.data_ptr(), packed_format(packed),
                         0 if bias is None else bias.data_ptr(), m, n, k,
                         torch.get_num_threads())
    if rc == -2:  # never for a packed_format code: a Python/C mismatch, not memory
        raise ValueError(f"gemm: the kernel does not know format {packed_format(packed)}")
    if rc != 0:
        raise MemoryError("gemm: out of memory")
    return out
