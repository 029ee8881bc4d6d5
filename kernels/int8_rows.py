"""Symmetric int8 rounding of rows, as every CPU kernel that quantizes does it.

One home for the arithmetic the C kernels repeat bit for bit: int8 weights at load,
w8a8's activations per row, and the block GEMMs' activations per group of 32 or 256
(kernels/cpu/q4_1.h). The torch reference paths and the tests call these to get the
kernels' exact values.
"""
from __future__ import annotations

import torch
from torch import Tensor

# The float32 nearest 1/127 (what the C kernels multiply by).
_INV_127 = float(torch.tensor(1.0 / 127.0, dtype=torch.float32))


def quantize_int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 of x [M, K]: s = max|x_row| * (the float nearest 1/127), 1 for
    a zero row; q = round_half_even(x / s), so |x - q s| <= s / 2. Returns (q [M, K] int8,
    s [M] float32)."""
    x = x.float()
    scales = x.abs().amax(dim=1) * _INV_127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return torch.round(x / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def quantize_dequantize_blocks(x: Tensor, group: int = 32) -> Tensor:
    """x [M, K] as the block GEMMs see it: each group of `group` values (32; 256 for the
    K-quants) quantized to int8 with its own scale (`quantize_int8_rows` over groups),
    then multiplied back."""
    q, s = quantize_int8_rows(x.reshape(-1, group))
    return (q.float() * s[:, None]).view_as(x)
