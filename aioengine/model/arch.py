"""One normalized description of a Llama-family decoder, whatever config it came from.

Hugging Face configs differ by model and by transformers version (4.x has `rope_theta` +
`rope_scaling`, 5.x folds both into `rope_parameters`); everything past this file reads only
`ModelArchConfig`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioengine.model.families import (FAMILY_ARCHITECTURES, FAMILY_MODEL_TYPES,
                                      UnsupportedModelError, family_fields, rope_params)
from aioengine.model.moe_config import (MOE_ARCHITECTURES, MOE_MODEL_TYPES, MoeSpec,
                                        moe_from_hf_config)
from aioengine.model.rope_variants import (SUPPORTED_ROPE_TYPES, UnsupportedRopeError,
                                           normalize_rope_scaling)

# Architecture name (config.architectures[0]) -> the features that architecture implies.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", **MOE_MODEL_TYPES,
}
# The families past the Llama family (model/families.py: what each config says).
SUPPORTED_ARCHITECTURES += FAMILY_ARCHITECTURES
_MODEL_TYPE_TO_ARCH.update(FAMILY_MODEL_TYPES)


__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelArchConfig",
           "UnsupportedModelError"]


@dataclass(frozen=True)
class ModelArchConfig:
    """Shape and numerics of a Llama-family model.

    `sliding_window`: the attention window of the layers `sliding_window_layers` lists
    (None: every layer; transformers' `layer_types`), full attention elsewhere. Per layer,
    `layer_spec.layer_specs` reads it through `layer_sliding_window`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    # Mixture of experts (moe_config.py): the sparse MLP of the layers `moe_layers` lists.
    moe: MoeSpec | None = None
    moe_layers: tuple[int, ...] = ()
    # ---- the families past Llama (model/families.py); defaults: the Llama family ----
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    embedding_multiplier: float = 1.0  # embeddings scaled (Gemma: sqrt(hidden); Granite)
    residual_multiplier: float = 1.0  # attention / MLP outputs scaled before the add (Granite)
    attention_multiplier: float | None = None  # the attention scale (None: head_dim ** -0.5)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    attn_logit_softcapping: float | None = None  # the same on attention scores (Gemma 2)
    # "pre": norms before attention / MLP (Llama); "sandwich": and after them too (Gemma);
    # "post": only after them, on the outputs (OLMo 2).
    norm_style: str = "pre"
    norm_weight_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma: 1 + w)
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection (OLMo 2)
    # The sliding-window layers' own RoPE (Gemma 3's rope_local_base_freq), None: the model's.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    no_rope_layers: tuple[int, ...] = ()  # layers that apply no RoPE (SmolLM3)

    def layer_moe(self, layer_idx: int) -> MoeSpec | None:
        """The sparse MLP of layer `layer_idx` (None: a dense MLP)."""
        return self.moe if layer_idx in self.moe_layers else None

    @property
    def max_model_len(self) -> int:
        """Longest sequence this model can run (its position table's length)."""
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx` (None: full attention)."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is None or layer_idx in self.sliding_window_layers:
            return self.sliding_window
        return None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelArchConfig:
        """Normalizes a transformers `PretrainedConfig` (4.x or 5.x)."""
        arch = _architecture(cfg)
        try:  # every unsupported feature named with the architecture that asked for it
            _check_unsupported_features(cfg)
            theta, scaling = _rope(rope_params(cfg, "full_attention"), cfg)
            extra = family_fields(cfg, arch, _rope)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{arch}: {e}") from e
        num_heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        moe, moe_layers = moe_from_hf_config(cfg, arch)
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_hidden_layers=int(cfg.num_hidden_layers),
            num_attention_heads=num_heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.max_position_embeddings),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no switch for it).
            attention_bias=(arch == "Qwen2ForCausalLM"
                            or bool(getattr(cfg, "attention_bias", False))
                            or (arch == "Qwen2MoeForCausalLM"
                                and bool(getattr(cfg, "qkv_bias", True)))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=_token_ids(getattr(cfg, "eos_token_id", None)),
            sliding_window=_sliding_window(cfg, arch),
            sliding_window_layers=_sliding_window_layers(cfg),
            moe=moe, moe_layers=moe_layers,
        )
        return cls(**(fields | extra))


def _architecture(cfg: Any) -> str:
    names = list(getattr(cfg, "architectures", None) or [])
    if not names and getattr(cfg, "model_type", None) in _MODEL_TYPE_TO_ARCH:
        names = [_MODEL_TYPE_TO_ARCH[cfg.model_type]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = names or [getattr(cfg, "model_type", "unknown")]
    raise UnsupportedModelError(
        f"unsupported model architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_unsupported_features(cfg: Any) -> None:
    if getattr(cfg, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")


def _rope(params: dict[str, Any], cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """Returns (rope_theta, rope_scaling or None for plain RoPE) from one set of rope
    parameters (rope_variants.normalize_rope_scaling says which types exist)."""
    params = dict(params)
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    try:
        return float(theta), normalize_rope_scaling(params)
    except UnsupportedRopeError as e:
        raise UnsupportedModelError(str(e)) from e


def _sliding_window(cfg: Any, arch: str) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    if arch.startswith("Qwen") and not getattr(
            cfg, "use_sliding_window", False):
        return None  # Qwen configs carry a window size even when it is switched off
    return int(window) if window else None


def _sliding_window_layers(cfg: Any) -> tuple[int, ...] | None:
    """The layers transformers' `layer_types` marks "sliding_attention" (None: no such
    list, the window applies to every layer)."""
    types = getattr(cfg, "layer_types", None)
    if not types:
        return None
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
