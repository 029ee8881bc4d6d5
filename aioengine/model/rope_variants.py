"""RoPE scaling variants: the inverse frequencies and the cos/sin scale of each `rope_type`.

    default   theta ** -(2i / d)
    linear    default / factor (position interpolation)
    dynamic   NTK-aware: theta grown to theta * (factor * L / L0 - (factor - 1)) ** (d / (d - 2))
              once a sequence passes L0 = max_position_embeddings. We never run a sequence
              past L0 (max_model_len is max_position_embeddings), where transformers' rule
              keeps the default frequencies, so dynamic is default here, exactly
    yarn      frequencies blended between interpolated (/ factor) and extrapolated ones by a
              linear ramp over the dimensions whose rotation count at the original length
              lies between beta_slow and beta_fast; cos/sin scaled by the attention factor
              (0.1 ln(factor) + 1, or mscale / mscale_all_dim, or the config's own)
    longrope  default frequencies divided per dimension by short_factor or long_factor; cos/sin
              scaled by sqrt(1 + ln(f) / ln(L0)), f = max_position_embeddings / L0
    llama3    long wavelengths slowed by `factor`, short ones kept, the band between smoothed

LongRoPE's choice: transformers picks, on every forward, the long factors for *all* positions
when the longest position + 1 exceeds original_max_position_embeddings (L0) and the short ones
otherwise. A paged cache cannot re-rotate keys it already holds, so we choose once per model:
long when the model's context (max_position_embeddings) exceeds L0, short otherwise. Sequences
on the same side of L0 as the model's context are then exactly transformers'; a long-context
model given a sequence of at most L0 tokens rotates it with the long factors (vLLM keeps a
table of each and switches per batch, which makes a token's result depend on its batch).

Everything is float32 and follows transformers' rope init functions' operation order, so
the tables equal theirs bit for bit (tests/model/test_rope_variants.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "longrope",
                                         "llama3")
# The keys each type needs in the config's rope parameters.
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings")}
_OPTIONAL = ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow",
             "truncate")


class UnsupportedRopeError(ValueError):
    """A rope type or parameter this module does not implement."""


def normalize_rope_scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    """A config's rope parameters (without rope_theta) -> our scaling dict, None for plain
    RoPE. Raises UnsupportedRopeError naming an unknown type, a missing key, or a partial
    rotary factor (RoPE over part of each head, not implemented)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRopeError(f"unsupported rope scaling type {rope_type!r}; supported: "
                                   f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1.0):
        raise UnsupportedRopeError(f"partial_rotary_factor {partial} (RoPE over part of a head) "
                                   "is not supported")
    if rope_type in ("default", "dynamic"):  # dynamic: see the module docstring
        return None
    missing = [k for k in _REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise UnsupportedRopeError(f"{rope_type} rope scaling is missing {missing}")
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for key in _REQUIRED[rope_type] + _OPTIONAL:
        if params.get(key) is not None:
            value = params[key]
            scaling[key] = ([float(v) for v in value] if isinstance(value, (list, tuple))
                            else value if isinstance(value, bool) else float(value))
    return scaling


@dataclass(frozen=True)
class RopeFrequencies:
    inv_freq: Tensor  # [head_dim // 2] float32
    attention_scaling: float  # cos and sin are multiplied by it (yarn, longrope)


def _default_inv_freq(theta: float, dim: int) -> Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta ** exponent)


def rope_frequencies(theta: float, head_dim: int, scaling: dict[str, Any] | None,
                     max_position_embeddings: int) -> RopeFrequencies:
    """The inverse frequencies and cos/sin scale of `scaling` (normalize_rope_scaling's)."""
    if scaling is None:
        return RopeFrequencies(_default_inv_freq(theta, head_dim), 1.0)
    kind = scaling["rope_type"]
    if kind == "linear":
        return RopeFrequencies(_default_inv_freq(theta, head_dim) / scaling["factor"], 1.0)
    if kind == "llama3":
        return RopeFrequencies(_llama3(_default_inv_freq(theta, head_dim), scaling), 1.0)
    if kind == "yarn":
        return _yarn(theta, head_dim, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(theta, head_dim, scaling, max_position_embeddings)
    raise UnsupportedRopeError(f"unsupported rope scaling type {kind!r}")


def _llama3(inv_freq: Tensor, s: dict[str, Any]) -> Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: dict[str, Any], max_pos: int) -> RopeFrequencies:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / old_len
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original length.
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the extrapolated (unscaled) frequency
    return RopeFrequencies(interpolated * (1 - keep) + extrapolated * keep, float(attention))


def _longrope(theta: float, dim: int, s: dict[str, Any], max_pos: int) -> RopeFrequencies:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / old_len
    attention = s.get("attention_factor")
    if attention is None:
        attention = (1.0 if factor <= 1.0
                     else math.sqrt(1 + math.log(factor) / math.log(old_len)))
    ext = s["long_factor"] if longrope_uses_long(s, max_pos) else s["short_factor"]
    if len(ext) != dim // 2:
        raise UnsupportedRopeError(f"longrope factors have {len(ext)} entries, expected "
                                   f"head_dim / 2 = {dim // 2}")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** exponent)
    return RopeFrequencies(inv_freq, float(attention))


def longrope_uses_long(scaling: dict[str, Any], max_position_embeddings: int) -> bool:
    """Our LongRoPE rule (module docstring): the long factors when the model's context
    exceeds the original one."""
    return max_position_embeddings > scaling["original_max_position_embeddings"]
