"""Device ops: the per-device kernels a decoder layer calls, chosen once per model.

    TorchOps   the plain torch ops: the reference every kernel is tested against
    CpuOps     the C kernels of aioengine.kernels.cpu (float32 on the CPU), each falling
               back to TorchOps where it does not apply (another dtype, kernels not built)
    TritonOps  the Triton kernels of aioengine.kernels.triton (the CUDA path)

A layer holds the ops object its model was built with and never asks which device a tensor
is on: the device is decided here, once, by `select_ops`. Projections (`layers.Linear`) and
attention (`attention.AttentionBackend`) have their own dispatch; these are the elementwise
and normalisation ops between them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from aioengine.kernels import cpu as cpu_kernels


class TorchOps:
    """The reference: plain torch ops on any device."""

    name = "torch"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x [T, H] normalised by its root mean square, times weight [H]; a new tensor."""
        return F.rms_norm(x, x.shape[-1:], weight, eps)

    def fused_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
        """(rms_norm(x + residual), x + residual): the pre-norm of a layer's next sub-block
        and the running residual stream. x and residual [T, H] may be updated in place (a
        kernel writes the sum into residual and the normed rows into x): use the results."""
        residual = x + residual
        return F.rms_norm(residual, residual.shape[-1:], weight, eps), residual

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """x [T, 2d] = [gate | up] (the fused gate_up projection) -> silu(gate) * up [T, d]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary_inplace(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
        """Rotates x [T, H, D] neox-style in place by positions [T] (cos/sin [P, D/2]
        tables) where a kernel does it; False, having done nothing, otherwise (the caller
        then takes rotary.apply_rope with its step's cos/sin lookup)."""
        return False

    # Whether fused_moe has a kernel (the MoE block stacks its experts' weights only then).
    has_fused_moe = False

    def fused_moe(self, x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor,
                  ids: Tensor) -> Tensor | None:
        """The grouped MoE MLP in one kernel over stacked expert weights (w13 [E, 2I, H],
        w2 [E, H, I]), or None where these ops have none: the block then runs its experts'
        Linears (model/moe.py, grouped_experts)."""
        return None


class CpuOps(TorchOps):
    """The C kernels where they apply (each returns None/False otherwise), else torch."""

    name = "cpu"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = cpu_kernels.rms_norm(x, weight, eps)
        return out if out is not None else super().rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
        if cpu_kernels.fused_add_rms_norm(x, residual, weight, eps):
            return x, residual
        return super().fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        out = cpu_kernels.silu_and_mul(x)
        return out if out is not None else super().silu_and_mul(x)

    def rotary_inplace(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
        return cpu_kernels.rotary_embedding(x, positions, cos, sin)


class TritonOps(TorchOps):
    """The Triton kernels (CUDA; on the CPU only under TRITON_INTERPRET=1, for tests).
    The kernels are imported on construction: triton.jit reads TRITON_INTERPRET when they
    are defined."""

    name = "triton"

    def __init__(self) -> None:
        from aioengine.kernels import triton as kernels

        self.kernels = kernels

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
        return self.kernels.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return self.kernels.silu_and_mul(x)

    def rotary_inplace(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> bool:
        self.kernels.rotary_embedding(positions, x, None, cos, sin)
        return True

    has_fused_moe = True

    def fused_moe(self, x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor,
                  ids: Tensor) -> Tensor | None:
        return self.kernels.fused_moe(x.contiguous(), w13, w2, weights, ids)


DeviceOps = TorchOps  # the interface: every ops object is a TorchOps


def select_ops(device: torch.device) -> TorchOps:
    """The ops for a model on `device`: Triton on CUDA, the C kernels on the CPU, torch on
    anything else."""
    if device.type == "cuda":
        return TritonOps()
    if device.type == "cpu":
        return CpuOps()
    return TorchOps()
