"""Rotary position embedding (neox style) for the Llama family: inverse frequencies with
llama3 scaling, a cos/sin table indexed by position, and the per-step rotation every layer
applies to its q and k heads (the device ops' kernel in place, torch ops otherwise)."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from aioengine.model.arch import ModelArchConfig
from aioengine.model.ops import TorchOps


def rope_inv_freq(arch: ModelArchConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with llama3 scaling when configured."""
    dim = arch.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (arch.rope_theta ** exponent)
    scaling = arch.rope_scaling
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) from a cos/sin table indexed by position."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.max_positions = arch.max_position_embeddings
        self.dtype = dtype
        self.set_inv_freq(rope_inv_freq(arch), device)

    def set_inv_freq(self, inv_freq: Tensor, device: torch.device) -> None:
        # Built in float32 like the reference implementation, stored in the model dtype.
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())
        self.cos = freqs.cos().to(device=device, dtype=self.dtype)  # [P, D/2]
        self.sin = freqs.sin().to(device=device, dtype=self.dtype)

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [T, 1, D/2] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class RopeStep:
    """One step's rotary embedding, applied by every layer to its q and k heads."""

    def __init__(self, rotary: RotaryEmbedding, positions: Tensor, ops: TorchOps) -> None:
        self.rotary, self.positions, self.ops = rotary, positions, ops
        self._cos_sin: tuple[Tensor, Tensor] | None = None

    def __call__(self, x: Tensor) -> Tensor:
        """x [T, H, D] rotated: in place by the ops' kernel where it applies, else a new
        tensor from the torch ops (cos/sin looked up once per step)."""
        if self.ops.rotary_inplace(x, self.positions, self.rotary.cos, self.rotary.sin):
            return x
        if self._cos_sin is None:
            self._cos_sin = self.rotary.lookup(self.positions)
        return apply_rope(x, *self._cos_sin)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D]: rotates the pair (x[i], x[i + D/2]) by the position's angle i."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
