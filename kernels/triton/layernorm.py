"""RMSNorm and RMSNorm with the residual add fused in (vLLM's rms_norm /
fused_add_rms_norm), computed as the engine's F.rms_norm does: in fp32, weight included,
rounded once to the activations' dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr, hidden, eps,
    stride_o, stride_x, stride_r,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    """Grid (T,): one row. With ADD_RESIDUAL, residual <- x + residual (rounded to its
    dtype) first, and the norm is taken of that sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        total = (x + r.to(tl.float32)).to(r.dtype)
        tl.store(residual_ptr + row * stride_r + cols, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def _check_rows(*tensors: Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"expected [T, H] rows with a contiguous last dim, got "
                             f"{tuple(t.shape)} strides {t.stride()}")


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """x [T, H] -> x / rms(x) * weight [T, H] (a new tensor unless `out` is given)."""
    out = torch.empty_like(x) if out is None else out
    _check_rows(x, out)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            out, x, x, weight, x.shape[1], eps, out.stride(0), x.stride(0), x.stride(0),
            BLOCK=triton.next_power_of_2(x.shape[1]), ADD_RESIDUAL=False)
    return out


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """In place: residual += x, then x = rms_norm(residual) * weight. Returns (x, residual)."""
    _check_rows(x, residual)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, x, residual, weight, x.shape[1], eps, x.stride(0), x.stride(0),
            residual.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]), ADD_RESIDUAL=True)
    return x, residual


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The spec: fp32 throughout, one rounding at the end (what F.rms_norm does on the CPU)."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    """The spec, out of place: (rms_norm(x + residual), x + residual)."""
    total = x + residual
    return rms_norm_ref(total, weight, eps), total
