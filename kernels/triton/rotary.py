"""Neox-style rotary embedding in place, from the engine's tables (aioengine.model.rotary:
cos/sin [max_positions, D/2] in the model dtype, indexed by position)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotary_kernel(
    x_ptr, positions_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_cos,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid (T, cdiv(H, BLOCK_H)): rotates the pairs (x[i], x[i + D/2]) of BLOCK_H heads of
    one token by the token's angles. Each product and sum is rounded to x's dtype, like the
    torch ops of apply_rope (exact in fp32, the same bits in fp16)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + dims, mask=dims < HALF, other=0.0)[None, :]
    ptr1 = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    c = cos.to(dtype)
    s = sin.to(dtype)
    o1 = (x1 * c).to(dtype) - (x2 * s).to(dtype)
    o2 = (x2 * c).to(dtype) + (x1 * s).to(dtype)
    tl.store(ptr1, o1.to(dtype), mask=mask)
    tl.store(ptr1 + HALF, o2.to(dtype), mask=mask)


def _rotate(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    if head_dim != 2 * cos.shape[1] or x.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} (contiguous last dim) needs cos/sin "
                         f"[P, {head_dim // 2}], got {tuple(cos.shape)}")
    if cos.stride() != sin.stride():
        raise ValueError("cos and sin need the same layout")
    if num_tokens == 0:
        return
    block_h = min(16, triton.next_power_of_2(num_heads))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x, positions, cos, sin, num_heads, x.stride(0), x.stride(1), cos.stride(0),
        HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h)


def rotary_embedding(positions: Tensor, q: Tensor, k: Tensor | None, cos: Tensor,
                     sin: Tensor) -> None:
    """q [T, Hq, D] and k [T, Hkv, D] (None: q only; any row/head strides, e.g. views of
    the fused qkv output) rotated in place by positions [T] (int64)."""
    _rotate(q, positions, cos, sin)
    if k is not None:
        _rotate(k, positions, cos, sin)


def rotary_embedding_ref(positions: Tensor, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The spec (aioengine.model.rotary.apply_rope): a new tensor."""
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
