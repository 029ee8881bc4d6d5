"""RoPE variants (aioengine/model/rope_variants.py) against transformers' rope init functions,
and end to end on tiny models: LongRoPE's long factors past the original context (Phi-3),
dynamic NTK within max_position_embeddings (where transformers keeps the default table)."""
from __future__ import annotations

import random

import pytest
import torch
from hf_compare import assert_matches_hf
from paged_driver import PagedDriver, Seq
from tiny_models import make_tiny_config, make_tiny_model_dir

from aioengine.model.arch import ModelArchConfig, UnsupportedModelError
from aioengine.model.loader import load_model
from aioengine.model.rotary import RotaryEmbedding, rope_inv_freq

CPU = torch.device("cpu")
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]
LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]
# rope_type -> (rope parameters, max_position_embeddings); head_dim 16 (hidden 64, 4 heads).
VARIANTS = {
    "default": ({"rope_type": "default"}, 512),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 512),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 512),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 8.0, "mscale": 0.7, "mscale_all_dim": 1.0,
                     "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 64},
                    512),
    "yarn_attention_factor": ({"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                               "original_max_position_embeddings": 256}, 512),
    "longrope_long": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                       "original_max_position_embeddings": 64}, 512),
    "longrope_short": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                        "original_max_position_embeddings": 512}, 512),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, 512),
}


def _config(params: dict, max_pos: int):
    return make_tiny_config("llama", max_position_embeddings=max_pos,
                            rope_parameters={"rope_theta": 10000.0, **params})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_frequencies_and_scaling_equal_transformers(name: str) -> None:
    """inv_freq and the cos/sin scale equal transformers' init function's, at the sequence
    length our rule picks (LongRoPE: long past the original context; the model's context
    is longer than the original one exactly in the _long case)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, max_pos = VARIANTS[name]
    cfg = _config(params, max_pos)
    arch = ModelArchConfig.from_hf_config(cfg)
    kind = params["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, ref_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](cfg, CPU, seq_len=max_pos)
    assert torch.equal(rope_inv_freq(arch), ref.float())
    rotary = RotaryEmbedding(arch, torch.float32, CPU)
    assert rotary.attention_scaling == pytest.approx(ref_scale, rel=1e-12)
    pos = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(pos, ref.float())
    torch.testing.assert_close(rotary.cos, freqs.cos() * ref_scale, atol=1e-6, rtol=0)
    if name == "longrope_short":
        assert torch.equal(ref, ROPE_INIT_FUNCTIONS[kind](cfg, CPU, seq_len=None)[0])


def test_dynamic_is_default_within_max_positions() -> None:
    """transformers grows dynamic NTK's base only past max_position_embeddings, which no
    sequence we run reaches: the table is the default one."""
    dyn = ModelArchConfig.from_hf_config(_config(*VARIANTS["dynamic"]))
    plain = ModelArchConfig.from_hf_config(_config(*VARIANTS["default"]))
    assert dyn.rope_scaling is None and torch.equal(rope_inv_freq(dyn), rope_inv_freq(plain))


@pytest.mark.parametrize("params,message", [
    ({"rope_type": "su"}, "unsupported rope scaling type 'su'"),
    ({"rope_type": "yarn", "factor": 2.0}, "yarn rope scaling is missing"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
def test_unsupported_rope_names_the_architecture_and_feature(params: dict, message: str) -> None:
    cfg = make_tiny_config("llama")
    cfg.rope_parameters = {"rope_theta": 10000.0, **params}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelArchConfig.from_hf_config(cfg)


@pytest.fixture(scope="module")
def phi3_long(tmp_path_factory, bundled_tokenizer):
    """A Phi-3 whose context (512) is 8x its original one (64): LongRoPE's long factors and
    attention factor sqrt(1 + ln 8 / ln 64)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(
        "phi3", tmp_path_factory.mktemp("phi3_long"), tokenizer=bundled_tokenizer,
        original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=SHORT,
                             long_factor=LONG, original_max_position_embeddings=64))
    ours = load_model(str(path), torch.float32, CPU).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf


@torch.inference_mode()
def test_longrope_long_factors_match_transformers_past_the_original_context(phi3_long) -> None:
    """Prompts of 70 and 90 tokens (past 64: transformers takes the long factors for every
    position), chunked and batched, 12 greedy tokens: logits and tokens are transformers'."""
    ours, hf = phi3_long
    assert ours.rotary.attention_scaling > 1.0
    rng = random.Random(3)
    seqs = [Seq([rng.randrange(3, 49152) for _ in range(n)], n, 12) for n in (70, 90)]
    PagedDriver(ours, num_blocks=64, block_size=4, seed=2).run(seqs, chunk_sizes=[16, 7, 32])
    for seq in seqs:
        assert_matches_hf(hf, seq)


def test_transformers_4_phi3_config_reads_original_context_beside_rope_scaling() -> None:
    """transformers 4.x Phi-3 configs keep original_max_position_embeddings at the top level,
    `type` (not `rope_type`) in rope_scaling, and no rope_parameters."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=100, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512,
        original_max_position_embeddings=64, hidden_act="silu", rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    arch = ModelArchConfig.from_hf_config(cfg)
    new = ModelArchConfig.from_hf_config(_config(*VARIANTS["longrope_long"]))
    assert arch.rope_scaling == new.rope_scaling
    assert torch.equal(rope_inv_freq(arch), rope_inv_freq(new))
