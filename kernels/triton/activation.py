"""silu_and_mul (vLLM's name): the MLP's activation over the fused gate_up output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, n, stride_o, stride_x, BLOCK: tl.constexpr):
    """Grid (T, cdiv(N, BLOCK)): out[t, j] = silu(x[t, j]) * x[t, N + j], silu in fp32 and
    rounded to the dtype before the product (the two roundings of F.silu(gate) * up)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """x [T, 2N] = [gate | up] -> silu(gate) * up [T, N]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"expected [T, 2N] with a contiguous last dim, got {tuple(x.shape)}")
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device) if out is None else out
    if x.shape[0]:
        block = min(BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            out, x, n, out.stride(0), x.stride(0), BLOCK=block)
    return out


def silu_and_mul_ref(x: Tensor) -> Tensor:
    """The spec (the engine's torch path)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
