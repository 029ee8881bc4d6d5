"""The model's building blocks that have a fast CPU path: projections (`linear`), RMSNorm
with the residual add fused in, and SiLU-and-mul (vLLM's names and semantics).

Each takes the C kernel of `aioengine.kernels.cpu` where it applies (float32 on the CPU,
kernels built) and the plain torch ops otherwise; the torch ops are the reference the
kernels are tested against.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from aioengine.kernels import cpu as cpu_kernels


# Up to this many rows a CPU float32 matmul is a gemv over chunks of weight rows (`linear`);
# with a oneDNN-packed weight at hand, up to PACKED_GEMV_MAX_ROWS.
GEMV_MAX_ROWS = 4
PACKED_GEMV_MAX_ROWS = 2
_ROWS_PER_CHUNK = 3072


@functools.lru_cache(maxsize=None)
def _num_chunks(n: int) -> int:
    """At least 4 chunks (2 threads, some balance), about 3,072 weight rows each for wide
    outputs (the LM head: 16), and a divisor of n; 1 means do not split."""
    c = min(16, max(4, n // _ROWS_PER_CHUNK))
    while n % c:
        c -= 1
    return c


def _onednn_linear() -> Callable[..., Tensor] | None:
    """oneDNN's fp32 matmul (the op inductor emits for CPU linears), when this torch has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           packed: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N].

    `F.linear` on the CPU goes to MKL, which on these AMD cores runs fp32 at ~140 GFLOP/s
    and threads few-row products badly (a 1-row product streams the weight at a third of
    the memory bandwidth). So in float32 on the CPU:
    - up to GEMV_MAX_ROWS rows (PACKED_GEMV_MAX_ROWS with `packed`; decode of a few
      requests): the C gemv (`cpu_kernels.gemv`), which streams each thread's weight rows
      in order; without the kernels, one `bmm` over chunks of the weight's rows (a view, no
      copy), so every thread streams whole chunks;
    - otherwise oneDNN's matmul, on `packed` (the weight reordered once into oneDNN's
      blocked layout, `pack_linear_weight`) when the model has it.
    Measured over SmolLM2-135M's 30 layers of weights, 2 cores: 1 row 40 -> 17 ms
    (F.linear -> chunked gemv); in a later run chunked gemv -> C gemv 14.6 -> 14.1 ms at 1
    row, 17.5 -> 15.1 ms at 2, the LM head 3.6 -> 3.0 ms at 1; 32 rows 87 (F.linear) -> 62
    (oneDNN) -> 52 ms (packed); 512 rows 725 -> 541 -> 526 ms; the LM head at 32 rows 33 ->
    13 -> 10 ms.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    m, (n, k) = x.shape[0], weight.shape
    # Packed oneDNN already beats the chunked gemv from 3-4 rows on (4 rows: 19.5 vs 25.5 ms).
    gemv_max_rows = GEMV_MAX_ROWS if packed is None else PACKED_GEMV_MAX_ROWS
    if m <= gemv_max_rows and (out := cpu_kernels.gemv(x, weight, bias)) is not None:
        return out
    if m <= gemv_max_rows and (c := _num_chunks(n)) > 1:
        # [c, N/c, K] @ [c, K, M] -> [c, N/c, M] = out^T. One row is already in order; the
        # view keeps the usual strides (a transposed [1, N] would pass as contiguous with
        # strides (1, 1), and MKL's bmm then takes a slow path on it: 4x per layer).
        out = torch.bmm(weight.view(c, n // c, k), x.t().expand(c, k, m))
        out = out.view(1, n) if m == 1 else out.view(n, m).t().contiguous()
        return out if bias is None else out.add_(bias)
    if _ONEDNN_LINEAR is not None:
        return _ONEDNN_LINEAR(x, weight if packed is None else packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


# The row count oneDNN tunes a packed weight's layout for (any count works): decode batches.
_PACK_FOR_ROWS = 32


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """`weight` [N, K] reordered for oneDNN's matmul (a copy in its own layout), or None
    where `linear` would not use it (not float32 on the CPU, or no oneDNN)."""
    if _ONEDNN_LINEAR is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_FOR_ROWS)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H] normalised by its root mean square, times weight [H]; a new tensor."""
    out = cpu_kernels.rms_norm(x, weight, eps)
    return out if out is not None else F.rms_norm(x, x.shape[-1:], weight, eps)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm of a layer's next sub-block and
    the running residual stream. x and residual [T, H] may be updated in place (the C
    kernel writes the sum into residual and the normed rows into x): use the results."""
    if cpu_kernels.fused_add_rms_norm(x, residual, weight, eps):
        return x, residual
    residual = x + residual
    return F.rms_norm(residual, residual.shape[-1:], weight, eps), residual


def silu_and_mul(x: Tensor) -> Tensor:
    """x [T, 2d] = [gate | up] (the fused gate_up projection) -> silu(gate) * up [T, d]."""
    out = cpu_kernels.silu_and_mul(x)
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
