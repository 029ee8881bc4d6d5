"""Tiny random-weight Hugging Face model directories, for tests anywhere in the suite.

    path = make_tiny_model_dir("qwen2", tmp_path / "m")
    load_model(str(path), torch.float32, torch.device("cpu"))

Each is a real `transformers` checkpoint (config.json, safetensors, the bundled SmolLM2
tokenizer, so vocab_size = 49152), seeded, so the same arguments give the same weights.
"""
from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# The families past Llama (aioengine/model/families.py) and a RoPE variant, kept apart from
# TINY_ARCHS: tests that need the fused decode executor or GGUF export use TINY_ARCHS.
FAMILY_ARCHS = ("gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3", "llama_yarn")

# Small enough to build in well under a second, big enough to exercise GQA (4 heads over
# 2 KV heads), several RoPE frequencies and more than one layer.
_COMMON: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    # Wider than the usual 0.02 so logits are peaked and greedy choices are not near-ties.
    initializer_range=0.2,
)

# Per arch: config class name, extra config, and whether embeddings are tied (both cases covered).
_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=4096,
                                      rope_theta=1000000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    # head_dim 32 != hidden / heads: the checkpoint must say it, and we must read it.
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0)),
    # Soft caps small enough to bite on these logits; a scale other than head_dim's; local
    # layers with a window of 16 every other layer.
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=8.0, tie_word_embeddings=True,
        attn_implementation="eager")),
    # Local layers with their own plain RoPE, global ones with linear scaling.
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}})),
    # LongRoPE within the original context (the short factors; test_rope_variants has the
    # long ones); fused qkv_proj / gate_up_proj in the checkpoint.
    "phi3": ("Phi3Config", dict(
        tie_word_embeddings=False, original_max_position_embeddings=512, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=512,
            short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            long_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]))),
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
    "granite": ("GraniteConfig", dict(
        tie_word_embeddings=True, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.1, logits_scaling=4.0)),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                                      tie_word_embeddings=True)),
    "llama_yarn": ("LlamaConfig", dict(
        tie_word_embeddings=False, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=128))),
}


@functools.lru_cache(maxsize=1)
def bundled_tokenizer():
    """The bundled SmolLM2 tokenizer (read once per process: parsing the GGUF takes seconds).
    AIOENGINE_TEST_TOKENIZER_DIR: the same tokenizer saved as a HF directory, for machines
    the 98 MB GGUF does not travel to (scripts/gpu_check.sh)."""
    from transformers import AutoTokenizer

    if os.environ.get("AIOENGINE_TEST_TOKENIZER_DIR"):
        return AutoTokenizer.from_pretrained(os.environ["AIOENGINE_TEST_TOKENIZER_DIR"])

    from aioengine.model.default import bundled_model_path

    path = bundled_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def make_tiny_config(arch: str, **overrides: Any):
    """The transformers config of a tiny model (`overrides` replace config fields)."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS + FAMILY_ARCHS}")
    cls_name, extra = _ARCHS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def make_tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A seeded random-weight transformers model in float32, eval mode (seeded_hf_model)."""
    return seeded_hf_model(make_tiny_config(arch, **overrides), seed)


def seeded_hf_model(config: Any, seed: int) -> torch.nn.Module:
    """The transformers model of `config` with seeded random weights, in float32, eval mode.

    Norm weights and biases are randomised too (transformers starts them at 1 and 0), so a
    loader that drops them cannot pass.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def make_tiny_model_dir(arch: str, path: Path, *, seed: int = 0, max_shard_size: str | None = None,
                        tokenizer: Any = None, **overrides: Any) -> Path:
    """Writes a tiny `arch` model (one of TINY_ARCHS) with the bundled tokenizer to `path`.

    `max_shard_size` (e.g. "200KB") splits the weights over several safetensors files.
    """
    return save_model_dir(make_tiny_hf_model(arch, seed=seed, **overrides), path,
                          max_shard_size=max_shard_size, tokenizer=tokenizer)


def save_model_dir(model: torch.nn.Module, path: Path, *, max_shard_size: str | None = None,
                   tokenizer: Any = None) -> Path:
    """Saves `model` as a checkpoint directory at `path`, with `tokenizer` (default: the
    bundled one)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(path, **kwargs)
    (tokenizer or bundled_tokenizer()).save_pretrained(path)
    return path
