"""The seam: a projection (`aioengine.model.layers.Linear`) wrapped by LinearWithLoRA (vLLM's
BaseLinearLayerWithLoRA), which adds each token's adapter update to the base output. The
model makes the wrappers as it builds its layers, through LoRAManager.linear_factory.

A wrapped projection holds `max_loras` adapter slots, zero-padded to `max_lora_rank`:

    lora_a  [max_loras, S, R, K]   the A of each of its S slices (qkv: q, k, v; gate_up: 2)
    lora_b  [max_loras, R, N]      B transposed: row j holds column j of every slice's B
    ranks   [max_loras, S] int32   the rank of each slot's slice (0: not targeted)

and for a step whose per-token slots are `LoRAStep.token_slots` (-1 = base model):

    u[t, s] = lora_a[slot_t, s, :r] x[t]            (shrink, r = ranks[slot_t, s])
    y[t, n] += sum_j u[t, s(n), j] lora_b[slot_t, j, n]  (expand, j < r; the scaling is
                                                          folded into B at load)

A LoRAKernel (lora/kernels.py, chosen by LoRAManager per device) computes it: the C
kernel (`cpu_decode.lora_apply`) row by row on the CPU, Triton's shrink/expand on CUDA;
the torch form below, which groups the rows of each adapter (no per-row copy of the
weights), is their reference and runs whatever a kernel declines. The fused decode kernel
applies the same row arithmetic inside its single call (LoRAManager.decode_args).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from aioengine.kernels import cpu_decode
from aioengine.model.layers import Linear


class LoRAKernel(Protocol):
    """What LinearWithLoRA calls to add a step's updates (implementations: kernels.py)."""

    name: str

    def apply(self, layer: LinearWithLoRA, y: Tensor, x: Tensor) -> bool:
        """y [T, N] += the update of `layer`'s slots for x [T, K] at the step's token
        slots (layer.step), in place; False if this kernel does not take the call."""
        ...


class TorchLoRAKernel:
    """Takes no call: every update runs LinearWithLoRA's torch form."""

    name = "torch"

    def apply(self, layer: LinearWithLoRA, y: Tensor, x: Tensor) -> bool:
        return False


class LoRAStep:
    """The adapter slot of every token of the step being run, shared by every wrapped
    projection of the model (set by the runner before the forward, cleared after)."""

    def __init__(self) -> None:
        self.token_slots: Tensor | None = None  # int32 [T]; None: no adapter in the step
        self._slots: list[int] = []
        self._device: torch.device | None = None
        self._groups: list[tuple[int, slice | Tensor]] | None = None
        self._device_groups: tuple[Tensor, tuple[Tensor, Tensor, Tensor]] | None = None

    def set(self, token_slots: list[int], device: torch.device) -> None:
        self.clear()
        if all(s < 0 for s in token_slots):
            return
        self.token_slots = torch.tensor(token_slots, dtype=torch.int32)
        self._slots, self._device = token_slots, device

    def clear(self) -> None:
        self.token_slots, self._slots, self._groups = None, [], None
        self._device_groups = None

    def device_groups(self, num_slots: int) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """The token slots on the step's device and their lora_token_groups (Triton's
        view of the step), built on first use and shared by every projection."""
        if self._device_groups is None:
            from aioengine.kernels.triton import lora_token_groups
            assert self.token_slots is not None and self._device is not None
            slots = self.token_slots.to(self._device)
            self._device_groups = slots, lora_token_groups(slots, num_slots)
        return self._device_groups

    @property
    def groups(self) -> list[tuple[int, slice | Tensor]]:
        """(slot, rows) for each slot in use, rows a slice when contiguous, else an index:
        the torch form's view of the step, built on first use (the C kernel groups itself)."""
        if self._groups is None:
            rows: dict[int, list[int]] = {}
            for t, slot in enumerate(self._slots):
                if slot >= 0:
                    rows.setdefault(slot, []).append(t)
            self._groups = [
                (slot, slice(ts[0], ts[-1] + 1) if ts[-1] - ts[0] + 1 == len(ts)
                 else torch.tensor(ts, dtype=torch.long, device=self._device))
                for slot, ts in rows.items()]
        return self._groups


def _read_through(name: str) -> property:
    """A read-only attribute of the wrapped Linear, seen through the wrapper."""
    return property(lambda self: getattr(self.base_layer, name),
                    doc=f"The wrapped Linear's `{name}`.")


class LinearWithLoRA(nn.Module):
    """`base_layer`'s output plus the step's adapter updates: what LoRAManager.linear_factory
    makes of each projection as the model builds it. The model keeps the base Linear as its
    own (it loads, converts and packs it, and the fused decode kernel reads its weights); the
    layer's forward calls this wrapper instead."""

    def __init__(self, base_layer: Linear, slice_sizes: tuple[int, ...], max_loras: int,
                 max_rank: int, step: LoRAStep, dtype: torch.dtype = torch.float32,
                 kernel: LoRAKernel | None = None) -> None:
        super().__init__()
        if sum(slice_sizes) != base_layer.out_features:
            raise ValueError(f"slices {slice_sizes} do not add up to {base_layer.out_features}")
        self.base_layer = base_layer
        self.slice_sizes = slice_sizes
        self.offsets = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
        self.step = step
        device = base_layer.weight.device
        k, n, s = base_layer.in_features, base_layer.out_features, len(slice_sizes)
        self.lora_a = torch.zeros(max_loras, s, max_rank, k, dtype=dtype, device=device)
        self.lora_b = torch.zeros(max_loras, max_rank, n, dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, s, dtype=torch.int32)
        # The ranks where the slots are too (a kernel on the device reads them there);
        # `.to` returns `self.ranks` itself when that is already the slots' device.
        self.device_ranks = self.ranks.to(device)
        self.slice_sizes_t = torch.tensor(slice_sizes, dtype=torch.int64)
        self.kernel: LoRAKernel = kernel or TorchLoRAKernel()
        # The C kernel's view of the slots (None off the CPU / float32): checked once.
        self.kernel_slots = cpu_decode.lora_kernel_slots(self.lora_a, self.lora_b,
                                                          self.ranks, self.slice_sizes_t)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base_layer(x)
        if self.step.token_slots is not None:
            self.apply_lora(y, x)
        return y

    def apply_lora(self, y: Tensor, x: Tensor) -> None:
        """y [T, N] += each token's adapter update for x [T, K], in place."""
        slots = self.step.token_slots
        assert slots is not None and slots.shape[0] == x.shape[0] == y.shape[0]
        if self.kernel.apply(self, y, x):
            return
        for slot, rows in self.step.groups:
            xs = x[rows].float()
            for s, (off, n, r) in enumerate(zip(self.offsets, self.slice_sizes,
                                                self.ranks[slot].tolist())):
                if r:
                    u = xs @ self.lora_a[slot, s, :r].float().t()
                    y[rows, off:off + n] += (u @ self.lora_b[slot, :r, off:off + n].float()
                                             ).to(y.dtype)

    @torch.no_grad()
    def set_slot(self, slot: int, slices: list[tuple[Tensor, Tensor] | None]) -> None:
        """Slot `slot` <- one (A [r, K], B [N_s, r]) per slice, None where not targeted."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for s, pair in enumerate(slices):
            r = 0
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                off, n = self.offsets[s], self.slice_sizes[s]
                self.lora_a[slot, s, :r].copy_(a)
                self.lora_b[slot, :r, off:off + n].copy_(b.t())
            self.ranks[slot, s] = r
        if self.device_ranks is not self.ranks:
            self.device_ranks.copy_(self.ranks)

    def slot_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b, self.ranks))

    # The shapes of the wrapped Linear (the model converts and packs the base itself).
    in_features = _read_through("in_features")
    out_features = _read_through("out_features")
