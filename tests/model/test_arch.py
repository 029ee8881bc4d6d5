"""ModelArchConfig.from_hf_config across architectures, transformers versions and bad configs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers
from tiny_models import make_tiny_config

from aioengine.model.arch import ModelArchConfig, UnsupportedModelError


def test_llama_fields() -> None:
    arch = ModelArchConfig.from_hf_config(make_tiny_config("llama"))
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (49152, 64, 128)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (2, 4, 2)
    assert arch.head_dim == 16
    assert (arch.rms_norm_eps, arch.rope_theta, arch.rope_scaling) == (1e-5, 10000.0, None)
    assert arch.tie_word_embeddings and not arch.attention_bias and not arch.qk_norm
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, [2])
    assert arch.max_model_len == arch.max_position_embeddings == 512
    assert (arch.q_size, arch.kv_size) == (64, 32)


def test_arch_specific_features() -> None:
    llama3 = ModelArchConfig.from_hf_config(make_tiny_config("llama3"))
    assert llama3.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64.0}
    assert llama3.rope_theta == 500000.0 and not llama3.tie_word_embeddings
    qwen2 = ModelArchConfig.from_hf_config(make_tiny_config("qwen2"))
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    qwen3 = ModelArchConfig.from_hf_config(make_tiny_config("qwen3"))
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.head_dim == 32
    mistral = ModelArchConfig.from_hf_config(make_tiny_config("mistral"))
    assert mistral.architecture == "MistralForCausalLM" and mistral.max_model_len == 512


def test_sliding_window_no_longer_caps_max_model_len() -> None:
    """The window is attention's (tests/model/test_sliding_window.py), not a length cap."""
    arch = ModelArchConfig.from_hf_config(make_tiny_config("mistral", sliding_window=128))
    assert (arch.sliding_window, arch.max_model_len) == (128, 512)
    qwen2 = ModelArchConfig.from_hf_config(make_tiny_config("qwen2", use_sliding_window=True,
                                                            sliding_window=100))
    assert qwen2.max_model_len == 512 and qwen2.sliding_window == 100


def test_transformers_4_style_config() -> None:
    """rope_theta / rope_scaling as separate attributes (no rope_parameters)."""
    cfg = SimpleNamespace(
        architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
        rope_theta=1234.0, max_position_embeddings=32, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=[5, 6],
        rope_scaling={"type": "llama3", "factor": 2, "low_freq_factor": 1,
                      "high_freq_factor": 2, "original_max_position_embeddings": 16})
    arch = ModelArchConfig.from_hf_config(cfg)
    assert arch.rope_theta == 1234.0 and arch.rope_scaling["factor"] == 2.0
    assert arch.head_dim == 4 and arch.eos_token_ids == [5, 6]


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as e:
        ModelArchConfig.from_hf_config(transformers.GPT2Config())
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("rope", [
    # transformers knows these; rope_variants.py does not.
    {"rope_type": "proportional", "factor": 2.0},
    {"rope_type": "mrope", "mrope_section": [2, 2, 4]},
])
def test_unsupported_rope_scaling(rope) -> None:
    with pytest.raises(UnsupportedModelError,
                       match="LlamaForCausalLM: unsupported rope scaling type"):
        cfg = make_tiny_config("llama")
        cfg.rope_parameters = {"rope_theta": 10000.0, **rope}
        ModelArchConfig.from_hf_config(cfg)


def test_unsupported_features() -> None:
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM: unsupported hidden_act"):
        ModelArchConfig.from_hf_config(make_tiny_config("llama", hidden_act="gelu"))
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        ModelArchConfig.from_hf_config(make_tiny_config("llama", mlp_bias=True))
