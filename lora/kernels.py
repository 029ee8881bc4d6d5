"""The kernels that add a step's adapter updates to a wrapped projection's output, chosen
once per engine by device (LoRAManager): the C kernel on the CPU, Triton's shrink/expand
(kernels/triton/lora.py) on CUDA. Each `apply` returns False, having done nothing, where
it does not take the call; LinearWithLoRA then runs its torch form (the reference).
The protocol they implement, LoRAKernel, is the layer's (layers.py: what it calls), with
its default TorchLoRAKernel; both are re-exported here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from aioengine.kernels import cpu_decode
from aioengine.lora.layers import LinearWithLoRA, LoRAKernel, TorchLoRAKernel

__all__ = ["CpuLoRAKernel", "LoRAKernel", "TorchLoRAKernel", "TritonLoRAKernel",
           "select_lora_kernel"]


class CpuLoRAKernel:
    """The C kernel (cpu_decode.lora_apply), for float32 rows and slots it can read."""

    name = "cpu"

    def apply(self, layer: LinearWithLoRA, y: Tensor, x: Tensor) -> bool:
        slots = layer.kernel_slots
        token_slots = layer.step.token_slots
        return (slots is not None and token_slots is not None
                and cpu_decode.lora_apply(y, x, slots, token_slots))


class TritonLoRAKernel:
    """Triton's lora_shrink then lora_expand, with the step's tokens grouped by slot once
    for every projection (LoRAStep.device_groups)."""

    name = "triton"

    def apply(self, layer: LinearWithLoRA, y: Tensor, x: Tensor) -> bool:
        from aioengine.kernels.triton import lora_expand, lora_shrink
        step = layer.step
        if y.device != x.device or x.device != layer.lora_a.device or not x.is_contiguous():
            return False
        token_slots, groups = step.device_groups(layer.lora_a.shape[0])
        u = lora_shrink(x, layer.lora_a, layer.device_ranks, token_slots, groups)
        lora_expand(y, u, layer.lora_b, layer.device_ranks, token_slots, layer.slice_sizes,
                    groups)
        return True


def select_lora_kernel(device: torch.device) -> LoRAKernel:
    """Triton on CUDA, the C kernel on the CPU (it declines what it cannot run)."""
    if device.type == "cuda":
        return TritonLoRAKernel()
    return CpuLoRAKernel()
