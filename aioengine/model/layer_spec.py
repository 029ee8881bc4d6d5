"""The description of one decoder layer: what every executor of it reads.

A model is described once, per layer, from its `ModelArchConfig`; the layer code
(`llama.LlamaDecoderLayer`), the fused CPU decode executor and the attention backends all
read the same `LayerSpec`. Its fields are of two kinds:

    shape    sizes and constants every executor must honour (SHAPE_FIELDS)
    options  everything else: a value other than the field's default is a *feature* of
             the layer (`LayerSpec.features()`), which an executor runs only if it lists it

An option added here is therefore a feature no executor supports until it says so: the
fused executor then declines the layer and decode steps run layerwise (fail closed).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aioengine.model.arch import ModelArchConfig
from aioengine.model.moe_config import MoeSpec

SHAPE_FIELDS = frozenset({"layer_idx", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                          "intermediate_size", "rms_norm_eps"})


@dataclass(frozen=True)
class LayerSpec:
    layer_idx: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    # ---- options (feature = a non-default value) ----
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    # Attend to the last `sliding_window` positions only, the query's own included
    # (Mistral, Qwen2 with use_sliding_window; transformers' kv_idx > q_idx - window).
    sliding_window: int | None = None
    # A sparse MLP (mixture of experts, moe_config.py) in place of the dense one.
    moe: MoeSpec | None = None
    # The families past Llama (model/families.py):
    hidden_act: str = "silu"  # "gelu_pytorch_tanh": GeGLU (Gemma)
    attn_scale: float | None = None  # the attention scale (None: head_dim ** -0.5)
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    norm_style: str = "pre"  # "sandwich": also norms on the outputs (Gemma); "post": only those
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection, before RoPE (OLMo 2)
    residual_multiplier: float = 1.0  # attention / MLP outputs scaled before the add (Granite)
    local_rope: bool = False  # RoPE from the model's local table (Gemma 3's local layers)
    use_rope: bool = True  # False: no RoPE in this layer (SmolLM3)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    def features(self) -> frozenset[str]:
        """The options this layer uses: every non-shape field whose value is not its
        default."""
        return frozenset(f.name for f in dataclasses.fields(self)
                         if f.name not in SHAPE_FIELDS and getattr(self, f.name) != f.default)


def layer_specs(arch: ModelArchConfig) -> tuple[LayerSpec, ...]:
    """One LayerSpec per decoder layer of `arch`."""
    return tuple(
        LayerSpec(layer_idx=i, hidden_size=arch.hidden_size,
                  num_heads=arch.num_attention_heads, num_kv_heads=arch.num_key_value_heads,
                  head_dim=arch.head_dim, intermediate_size=arch.intermediate_size,
                  rms_norm_eps=arch.rms_norm_eps, qk_norm=arch.qk_norm,
                  attention_bias=arch.attention_bias,
                  sliding_window=arch.layer_sliding_window(i), moe=arch.layer_moe(i),
                  **_family_options(arch, i))
        for i in range(arch.num_hidden_layers))


# The options of the MLP side of a layer: no attention backend has a say in them.
MLP_FEATURES = frozenset({"moe"})

# Options the layer code implements around its attention backend's call (any backend).
LAYER_CODE_FEATURES = frozenset({"hidden_act", "attn_scale", "attn_logit_softcapping",
                                 "norm_style", "qk_norm_whole", "residual_multiplier",
                                 "local_rope", "use_rope"})


def _family_options(arch: ModelArchConfig, i: int) -> dict[str, object]:
    """Layer i's options from the families' ModelArchConfig fields."""
    windowed = arch.layer_sliding_window(i) is not None
    return dict(hidden_act=arch.hidden_act, attn_scale=arch.attention_multiplier,
                attn_logit_softcapping=arch.attn_logit_softcapping,
                norm_style=arch.norm_style, qk_norm_whole=arch.qk_norm_whole,
                residual_multiplier=arch.residual_multiplier,
                local_rope=windowed and arch.local_rope_theta is not None,
                use_rope=i not in arch.no_rope_layers)


def smallest_window(specs: tuple[LayerSpec, ...]) -> int | None:
    """The smallest sliding window of any layer (None: every layer attends to everything):
    up to that length, windowed attention equals full attention."""
    windows = [spec.sliding_window for spec in specs if spec.sliding_window is not None]
    return min(windows) if windows else None


def unsupported(specs: tuple[LayerSpec, ...], supported: frozenset[str]) -> frozenset[str]:
    """The features some layer uses that `supported` does not list."""
    used: set[str] = set()
    for spec in specs:
        used |= spec.features()
    return frozenset(used - supported)


def uniform_window(specs: tuple[LayerSpec, ...]) -> int | None:
    """The window past which no layer reads a position (the largest one), when every layer
    has one; None when some layer attends to everything (then every block stays needed)."""
    windows = [spec.sliding_window for spec in specs]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
