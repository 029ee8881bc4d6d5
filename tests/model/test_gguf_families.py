"""GGUF files of the families past Llama: a tiny random Hugging Face model of each, written
as llama.cpp's converter writes it (gguf_family_writer.py), loads through our GGUF reader and
gives transformers' logits on the HF directory it came from, and again from the start-up
cache."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf_family_writer import quantizable, write_llama_cpp_gguf
from gguf_writer import tokenizer_fields
from hf_compare import prefill_logits
from moe_models import make_tiny_moe_hf_model
from tiny_models import make_tiny_hf_model

from aioengine.model.arch import ModelArchConfig
from aioengine.model.gguf_arch import GGUFFormatError, gguf_hf_config_kwargs
from aioengine.model.gguf_loader import FastGGUFReader, load_gguf_parts
from aioengine.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")
VOCAB = 512  # the bundled vocabulary cut down: the GGUF tokenizer converts quickly
_GEMMA3_6 = ["sliding_attention"] * 5 + ["full_attention"]

# case -> (tiny model maker, its arch, llama.cpp arch, config overrides). The overrides make
# each model one llama.cpp's format describes (gguf_family_writer refuses others).
CASES: dict[str, tuple[Any, str, str, dict[str, Any]]] = {
    # 6 experts top-2, renormalised (llama.cpp's qwen3moe), every layer sparse, q/k norms.
    "qwen3moe": (make_tiny_moe_hf_model, "qwen3_moe", "qwen3moe",
                 dict(mlp_only_layers=[], norm_topk_prob=True)),
    # Top-3 of 5 not renormalised, the shared expert and its sigmoid gate, q/k/v biases.
    "qwen2moe": (make_tiny_moe_hf_model, "qwen2_moe", "qwen2moe",
                 dict(mlp_only_layers=[], norm_topk_prob=False)),
    # Q8_0 blocks, stacked experts included (3-D tensors dequantized to [E, rows, cols]).
    "qwen2moe-q8_0": (make_tiny_moe_hf_model, "qwen2_moe", "qwen2moe",
                      dict(mlp_only_layers=[], norm_topk_prob=False, moe_intermediate_size=64)),
    # Norms stored 1 + w, soft-caps, every other layer local (window 16 < 40 tokens).
    "gemma2": (make_tiny_hf_model, "gemma2", "gemma2", dict(query_pre_attn_scalar=16)),
    # 46 layers: llama.cpp's Gemma 2 27B, scaled by hidden / heads (16), not head_dim (32).
    "gemma2-46-layers": (make_tiny_hf_model, "gemma2", "gemma2", dict(
        num_hidden_layers=46, head_dim=32, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"] * 23)),
    # llama.cpp's default pattern (5 local : 1 global), local RoPE base from freq_base_swa,
    # linear scaling on the global layer.
    "gemma3": (make_tiny_hf_model, "gemma3", "gemma3",
               dict(query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=_GEMMA3_6)),
    # Alternating local / global: the file's sliding_window_pattern flags.
    "gemma3-pattern": (make_tiny_hf_model, "gemma3", "gemma3", dict(query_pre_attn_scalar=16)),
    # Fused attn_qkv / ffn_up, LongRoPE factors from tensors.
    "phi3": (make_tiny_hf_model, "phi3", "phi3", {}),
    # Plain RoPE (as Phi-3-mini-4k), a window of 16 (Phi-3-mini's 2047, as HF applies it).
    "phi3-window": (make_tiny_hf_model, "phi3", "phi3", dict(
        sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "olmo2": (make_tiny_hf_model, "olmo2", "olmo2", {}),
    # The four multipliers; q/k rows permuted (llama.cpp's NORM RoPE).
    "granite": (make_tiny_hf_model, "granite", "granite", {}),
    # Layer 3 without RoPE; q/k rows permuted.
    "smollm3": (make_tiny_hf_model, "smollm3", "smollm3", {}),
}
# 46 layers add up float32 rounding (~1.4e-4 here); a wrong attention scale is off by ~10.
_ATOL = {"gemma2-46-layers": 5e-4}
# What the GGUF's config must share with the HF one (floats differ by float32 rounding).
_SAME = ("architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias", "qk_norm",
         "sliding_window", "sliding_window_layers", "moe", "moe_layers", "hidden_act",
         "norm_style", "qk_norm_whole", "norm_weight_offset", "no_rope_layers",
         "final_logit_softcapping", "attn_logit_softcapping", "local_rope_theta")


@pytest.fixture(scope="module")
def tok_fields(bundled_gguf_path: str) -> dict:
    return tokenizer_fields(FastGGUFReader(bundled_gguf_path))


def _save(case: str, root: Path) -> Path:
    """The case's tiny model saved; a "-q8_0" case's weights round-tripped through Q8_0
    first (where the writer will quantize them), so file and directory hold the same."""
    make, tiny, _, overrides = CASES[case]
    path = root / "hf"
    model = make(tiny, seed=3, vocab_size=VOCAB, **overrides)
    if case.endswith("-q8_0"):
        q8 = gguf.GGMLQuantizationType.Q8_0
        with torch.no_grad():
            for p in model.parameters():
                if quantizable(p.numpy(), "Q8_0"):
                    data = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                    p.copy_(torch.from_numpy(data.reshape(p.shape)))
    model.save_pretrained(path)
    return path



@pytest.mark.parametrize("case", list(CASES))
def test_family_gguf_logits_match_transformers(tmp_path, monkeypatch, tok_fields,
                                               case: str) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = _save(case, tmp_path)
    path = tmp_path / f"{case}.gguf"
    write_llama_cpp_gguf(model_dir, CASES[case][2], path, tok_fields,
                         "Q8_0" if case.endswith("-q8_0") else None)
    if case.endswith("-q8_0"):
        types = {t.name: t.tensor_type.name for t in FastGGUFReader(str(path)).tensors}
        assert types["blk.0.ffn_down_exps.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    loaded = load_model(str(path), torch.float32, CPU)
    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    expected = ModelArchConfig.from_hf_config(reference.config)
    assert ({f: getattr(loaded.arch, f) for f in _SAME}
            == {f: getattr(expected, f) for f in _SAME})
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        ref = reference(torch.tensor([tokens]), use_cache=False).logits[0]
    ours = prefill_logits(loaded.model, tokens)
    torch.testing.assert_close(ours, ref, atol=_ATOL.get(case, 1e-4), rtol=1e-5)
    assert load_gguf_parts(str(path)).from_cache
    again = load_model(str(path), torch.float32, CPU)  # from the start-up cache
    assert again.arch == loaded.arch
    assert torch.equal(prefill_logits(again.model, tokens), ours)


def test_tokenizer_of_a_file_autotokenizer_cannot_configure(tmp_path, monkeypatch,
                                                            tok_fields) -> None:
    """transformers rebuilds no config for a granite file; its tokenizer still loads, and
    tokenizes and templates as the same metadata in a llama file does."""
    from gguf_writer import write_tiny_gguf

    from aioengine.model.loader import load_tokenizer

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    granite, llama = tmp_path / "granite.gguf", tmp_path / "llama.gguf"
    write_llama_cpp_gguf(_save("granite", tmp_path), "granite", granite, tok_fields)
    write_tiny_gguf(make_tiny_hf_model("llama", vocab_size=VOCAB), "llama", llama, tok_fields)
    ours, ref = load_tokenizer(str(granite)), load_tokenizer(str(llama))
    assert len(ours) == len(ref) == VOCAB
    for text in ("Hello world, the cat sat.", "<|im_start|>user\nhi<|im_end|>", "  two  spaces"):
        assert ours(text).input_ids == ref(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_q_k_biases_are_unpermuted_like_the_weights() -> None:
    """llama.cpp's LlamaModel.permute interleaves q/k bias rows as it does weight rows (no
    tiny model here has q/k biases without an o_proj bias, which we do not load)."""
    from gguf_writer import llama_cpp_permute

    from aioengine.model.gguf_arch import GGUF_ARCHITECTURES
    from aioengine.model.gguf_loader import _as_hf

    bias = torch.randn(4 * 16, generator=torch.Generator().manual_seed(0)).numpy()
    stored = llama_cpp_permute(bias, 4)
    assert not (stored == bias).all()
    back = _as_hf(GGUF_ARCHITECTURES["llama"], "blk.0.attn_q.bias",
                  "model.layers.0.self_attn.q_proj.bias", stored, 4, 2)
    assert (back == bias).all()


def test_q4_1_blocks_refused_for_unchecked_architectures(tmp_path, monkeypatch,
                                                         tok_fields) -> None:
    """Fail closed: quantization 'gguf' keeps Q4_1 blocks only for the archs it is checked
    on; a Gemma 2 file is refused, naming them."""
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "gemma2.gguf"
    write_llama_cpp_gguf(_save("gemma2", tmp_path), "gemma2", path, tok_fields)
    with pytest.raises(ModelLoadError, match="implemented for llama, qwen2, qwen3 files, not "
                                             "gemma2"):
        load_model(str(path), torch.float32, CPU, "gguf")


def _metadata_only(path: Path, arch: str, **keys: Any) -> FastGGUFReader:
    """A GGUF of `arch` with the common shape keys, `keys` ({key: (adder, value)}) and no
    tensors: enough for the config reader."""
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in [("add_block_count", 2), ("add_context_length", 64),
                       ("add_embedding_length", 64), ("add_feed_forward_length", 128),
                       ("add_head_count", 4), ("add_layer_norm_rms_eps", 1e-5),
                       *keys.values()]:
        getattr(w, add)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return FastGGUFReader(str(path))


@pytest.mark.parametrize("arch,keys,match", [
    # Phi-4-mini's partial rotary (RoPE over 3/4 of each head): not implemented.
    ("phi3", {"rot": ("add_rope_dimension_count", 12)}, "RoPE over 12 of 16 head dimensions"),
    # LongRoPE declared without its factor tensors.
    ("phi3", {"t": ("add_rope_scaling_type", gguf.RopeScalingType.LONGROPE)},
     "LongRoPE needs rope_factors_long"),
    # Only linear scaling is read for Gemma 3 (its global layers).
    ("gemma3", {"t": ("add_rope_scaling_type", gguf.RopeScalingType.YARN)},
     "unsupported rope scaling 'yarn' in a gemma3 GGUF; supported: none, linear"),
    # Granite's multipliers are required (llama.cpp requires them too).
    ("granite", {}, "lacks granite.embedding_scale"),
    ("qwen3moe", {}, "lacks qwen3moe.expert_used_count"),
])
def test_config_reader_fails_closed(tmp_path, arch: str, keys: dict, match: str) -> None:
    reader = _metadata_only(tmp_path / "m.gguf", arch, **keys)
    with pytest.raises(GGUFFormatError, match=match):
        gguf_hf_config_kwargs(reader)
