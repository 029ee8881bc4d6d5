"""The decoder families past the Llama family, as differences from it.

Each is a Llama-shaped decoder (RMSNorm, RoPE attention with GQA, gated MLP) with a few
options, read here from its Hugging Face config into `ModelArchConfig` fields (arch.py);
`layer_spec.layer_specs` turns the per-layer ones into LayerSpec options, so an executor
that does not list one declines the model (fail closed).

    Gemma2ForCausalLM   GeGLU (gelu tanh), embeddings * sqrt(hidden), RMSNorm (1 + w),
                        norms before and after attention and MLP, scale from
                        query_pre_attn_scalar, attention and final logit soft-capping,
                        alternating local (sliding) / global layers
    Gemma3ForCausalLM   Gemma 2 without soft-capping, with per-head q/k norm and the local
                        layers' own RoPE (rope_local_base_freq / rope_parameters per type)
    Phi3ForCausalLM     Llama with fused qkv_proj / gate_up_proj checkpoints (split at load)
                        and LongRoPE
    Olmo2ForCausalLM    norms only after attention and MLP (on their outputs), q/k RMSNorm
                        over the whole projection
    GraniteForCausalLM  embedding, residual and attention multipliers, logits divided
    SmolLM3ForCausalLM  every n-th layer without RoPE (no_rope_layers)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

FAMILY_MODEL_TYPES: dict[str, str] = {
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
}
FAMILY_ARCHITECTURES: tuple[str, ...] = tuple(FAMILY_MODEL_TYPES.values())
SUPPORTED_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")
# transformers' names of the tanh-approximated GELU.
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")

RopeReader = Callable[[dict[str, Any], Any], "tuple[float, dict[str, Any] | None]"]


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its features is not implemented here."""


def rope_params(cfg: Any, layer_type: str) -> dict[str, Any]:
    """The rope parameters of `layer_type` layers ("full_attention" / "sliding_attention"):
    transformers 5.x nests them per layer type for Gemma 3, else one dict for every layer
    (4.x: rope_theta beside rope_scaling)."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        params = dict(params)
        if layer_type in params or "full_attention" in params:
            return dict(params.get(layer_type) or params["full_attention"])
        return params
    out = dict(getattr(cfg, "rope_scaling", None) or {})
    out["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
    if getattr(cfg, "original_max_position_embeddings", None) is not None:
        # Phi-3 (4.x) keeps it beside rope_scaling, not in it.
        out.setdefault("original_max_position_embeddings", cfg.original_max_position_embeddings)
    return out


def _activation(cfg: Any) -> str:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act in _GELU_TANH:
        return "gelu_pytorch_tanh"
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: "
                                    f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    return act


def family_fields(cfg: Any, arch: str, read_rope: RopeReader) -> dict[str, Any]:
    """The ModelArchConfig fields `arch`'s config sets beyond the Llama family's."""
    fields: dict[str, Any] = {"hidden_act": _activation(cfg)}
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        fields.update(_gemma(cfg, arch, read_rope))
    elif arch == "Olmo2ForCausalLM":
        fields.update(norm_style="post", qk_norm_whole=True)
    elif arch == "GraniteForCausalLM":
        fields.update(embedding_multiplier=float(cfg.embedding_multiplier),
                      residual_multiplier=float(cfg.residual_multiplier),
                      attention_multiplier=float(cfg.attention_multiplier),
                      logits_scaling=float(cfg.logits_scaling))
    elif arch == "SmolLM3ForCausalLM":
        flags = list(getattr(cfg, "no_rope_layers", None) or [])
        fields["no_rope_layers"] = tuple(i for i, use in enumerate(flags) if not use)
        if not getattr(cfg, "use_sliding_window", False):
            fields["sliding_window"] = None
    return fields


def _gemma(cfg: Any, arch: str, read_rope: RopeReader) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        embedding_multiplier=math.sqrt(cfg.hidden_size), norm_style="sandwich",
        norm_weight_offset=1.0, attention_multiplier=float(cfg.query_pre_attn_scalar) ** -0.5,
        final_logit_softcapping=_cap(getattr(cfg, "final_logit_softcapping", None)),
        attn_logit_softcapping=_cap(getattr(cfg, "attn_logit_softcapping", None)))
    if arch == "Gemma3ForCausalLM":
        fields["qk_norm"] = True
        local = rope_params(cfg, "sliding_attention")
        if getattr(cfg, "rope_local_base_freq", None) is not None and not isinstance(
                getattr(cfg, "rope_parameters", None), dict):
            local = {"rope_theta": cfg.rope_local_base_freq}  # 4.x: local RoPE is plain
        theta, scaling = read_rope(local, cfg)
        fields.update(local_rope_theta=theta, local_rope_scaling=scaling)
    return fields


def _cap(value: float | None) -> float | None:
    return float(value) if value else None


def split_fused_checkpoint(name: str, tensor: Any, q_size: int, kv_size: int,
                           intermediate_size: int) -> list[tuple[str, Any]]:
    """Phi-3's fused checkpoint tensors as the separate ones the loader fuses again (so each
    part is checked for its own shape): `qkv_proj` -> q/k/v, `gate_up_proj` -> gate/up;
    any other tensor unchanged."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        prefix = name.removesuffix("qkv_proj.weight")
        q, k, v = _split_rows(name, tensor, (q_size, kv_size, kv_size))
        return [(prefix + "q_proj.weight", q), (prefix + "k_proj.weight", k),
                (prefix + "v_proj.weight", v)]
    if name.endswith(".mlp.gate_up_proj.weight"):
        prefix = name.removesuffix("gate_up_proj.weight")
        gate, up = _split_rows(name, tensor, (intermediate_size, intermediate_size))
        return [(prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up)]
    return [(name, tensor)]


def _split_rows(name: str, tensor: Any, sizes: tuple[int, ...]) -> tuple[Any, ...]:
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes)} "
                         f"({' + '.join(map(str, sizes))})")
    return tuple(tensor.split(list(sizes), dim=0))
