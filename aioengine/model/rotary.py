"""Rotary position embedding (neox style): inverse frequencies with the configured scaling
(rope_variants.py), a cos/sin table indexed by position (scaled by yarn's / longrope's
attention factor), and the per-step rotation every layer applies to its q and k heads (the
device ops' kernel in place, torch ops otherwise)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from aioengine.model.arch import ModelArchConfig
from aioengine.model.ops import TorchOps
from aioengine.model.rope_variants import RopeFrequencies, rope_frequencies


def rope_inv_freq(arch: ModelArchConfig, local: bool = False) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32) with the configured scaling
    (rope_variants.py); `local`: those of the sliding-window layers' own RoPE (Gemma 3)."""
    return _frequencies(arch, local).inv_freq


def _frequencies(arch: ModelArchConfig, local: bool) -> RopeFrequencies:
    if local and arch.local_rope_theta is not None:
        return rope_frequencies(arch.local_rope_theta, arch.head_dim, arch.local_rope_scaling,
                                arch.max_position_embeddings)
    return rope_frequencies(arch.rope_theta, arch.head_dim, arch.rope_scaling,
                            arch.max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves) from a cos/sin table indexed by position."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 local: bool = False) -> None:
        super().__init__()
        self.max_positions = arch.max_position_embeddings
        self.dtype = dtype
        freqs = _frequencies(arch, local)
        # yarn / longrope: cos and sin scaled (transformers' attention_scaling).
        self.attention_scaling = freqs.attention_scaling
        self.set_inv_freq(freqs.inv_freq, device)

    def set_inv_freq(self, inv_freq: Tensor, device: torch.device) -> None:
        # Built in float32 like the reference implementation, stored in the model dtype.
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        self.cos = cos.to(device=device, dtype=self.dtype)  # [P, D/2]
        self.sin = sin.to(device=device, dtype=self.dtype)

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
