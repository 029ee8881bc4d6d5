"""What a mixture-of-experts MLP is, read from a Hugging Face config (no torch here).

    MixtralForCausalLM    every layer sparse; softmax over the top-k router logits
                          (= softmax over all, then the top-k renormalised)
    Qwen3MoeForCausalLM   sparse where (i + 1) % decoder_sparse_step == 0 and i not in
                          mlp_only_layers (dense MLPs of `intermediate_size` elsewhere);
                          softmax over all, top-k, renormalised only with norm_topk_prob
    Qwen2MoeForCausalLM   as Qwen3-MoE, plus a shared expert on every sparse layer whose
                          output is scaled by sigmoid(shared_expert_gate(x))

`MoeSpec` is a `LayerSpec` option (layer_spec.py): a layer with one is a `moe` feature,
which the fused decode executor does not list, so such layers decode layerwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES: tuple[str, ...] = (
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
MOE_MODEL_TYPES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                   "qwen2_moe": "Qwen2MoeForCausalLM"}


@dataclass(frozen=True)
class MoeSpec:
    """One sparse MLP: `num_experts` SwiGLU experts of `intermediate_size`, `top_k` of them
    per token, weighted by the softmax of the router logits over all experts, restricted to
    the chosen ones and renormalised to sum 1 when `renormalize`; plus, when
    `shared_intermediate_size` > 0, a shared SwiGLU expert gated by a sigmoid."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.intermediate_size <= 0:
            raise ValueError(f"expert intermediate_size must be > 0, got "
                             f"{self.intermediate_size}")


def moe_from_hf_config(cfg: Any, arch: str) -> tuple[MoeSpec | None, tuple[int, ...]]:
    """(the sparse MLP, the indices of the layers that have it) for `arch`; (None, ()) for
    a dense architecture."""
    if arch not in MOE_ARCHITECTURES:
        return None, ()
    num_layers = int(cfg.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        spec = MoeSpec(num_experts=int(cfg.num_local_experts),
                       top_k=int(cfg.num_experts_per_tok),
                       intermediate_size=int(cfg.intermediate_size), renormalize=True)
        return spec, tuple(range(num_layers))
    if int(cfg.num_experts) <= 0:
        return None, ()
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    spec = MoeSpec(num_experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
                   intermediate_size=int(cfg.moe_intermediate_size),
                   renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                   shared_intermediate_size=shared if arch == "Qwen2MoeForCausalLM" else 0)
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    return spec, tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
