"""Tiny random-weight mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE), built
like tests/tiny_models.py's dense ones: real transformers models, seeded, saved with the
bundled tokenizer.

    path = make_tiny_moe_dir("mixtral", tmp_path / "m")
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import save_model_dir, seeded_hf_model

MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
    eos_token_id=2, pad_token_id=2, initializer_range=0.2, tie_word_embeddings=False,
)

_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # 4 experts, top-2, every layer sparse.
    "mixtral": ("MixtralConfig", dict(intermediate_size=96, num_local_experts=4,
                                      num_experts_per_tok=2, rope_theta=1000000.0)),
    # 6 experts, top-2, not renormalised; layer 1 dense (mlp_only_layers), qk-norm, head_dim
    # 32 != hidden / heads.
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        intermediate_size=128, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], head_dim=32,
        rope_theta=1000000.0)),
    # Renormalised top-3 of 5, a shared expert with its sigmoid gate; sparse every 1st and
    # 3rd layer (decoder_sparse_step=1 minus mlp_only_layers=[1]).
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        intermediate_size=112, moe_intermediate_size=40, num_experts=5, num_experts_per_tok=3,
        norm_topk_prob=True, shared_expert_intermediate_size=80, decoder_sparse_step=1,
        mlp_only_layers=[1], rope_theta=1000000.0)),
}


def make_tiny_moe_config(arch: str, **overrides: Any):
    import transformers

    cls_name, extra = _ARCHS[arch]
    return getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides})


def make_tiny_moe_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A seeded random-weight transformers MoE model in float32, eval mode, norms
    randomised (a loader that drops them cannot pass)."""
    return seeded_hf_model(make_tiny_moe_config(arch, **overrides), seed)


def make_tiny_moe_dir(arch: str, path: Path, *, seed: int = 0, tokenizer: Any = None,
                      **overrides: Any) -> Path:
    """Writes a tiny `arch` MoE model (one of MOE_ARCHS) with the bundled tokenizer."""
    return save_model_dir(make_tiny_moe_hf_model(arch, seed=seed, **overrides), path,
                          tokenizer=tokenizer)
