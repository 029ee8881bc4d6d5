"""Writes a tiny transformers model as a llama.cpp-style GGUF file, for loader tests.

Mirrors what llama.cpp's converter (convert_hf_to_gguf.py) does, written independently of
our loader: tensor names, the q/k row permutation for llama, llama3 scaling as a
`rope_freqs` tensor, and optional Q8_0 quantization (write_tiny_gguf); every family's
metadata, names and weight changes (gguf_family_writer.py). The tokenizer is
the bundled one cut down to `vocab_size` tokens.
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _NAMES:
        return _NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's two halves interleaved row by row."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(cfg) -> np.ndarray:
    """Per-frequency divisors equivalent to llama3 rope scaling, as llama.cpp stores them."""
    rp = dict(getattr(cfg, "rope_parameters", None) or cfg.rope_scaling)
    base = rp.get("rope_theta", getattr(cfg, "rope_theta", None))
    dim = cfg.hidden_size // cfg.num_attention_heads
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tokenizer_fields(bundled_reader) -> dict:
    """The bundled GGUF's tokenizer metadata (tokens, types, merges, template)."""
    f = bundled_reader.fields
    return {k: f[k].contents() for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                         "tokenizer.ggml.merges", "tokenizer.chat_template")}


def add_tokenizer(w: gguf.GGUFWriter, tok: dict, vocab_size: int) -> None:
    tokens = tok["tokenizer.ggml.tokens"][:vocab_size]
    vocab = set(tokens)
    # Keep the merges whose two parts and result all survive the cut.
    merges = [m for m in tok["tokenizer.ggml.merges"]
              if all(p in vocab for p in m.split(" ")) and m.replace(" ", "") in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(tok["tokenizer.ggml.token_type"][:vocab_size])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(tok["tokenizer.chat_template"])


def write_tiny_gguf(hf_model, gguf_arch: str, path: Path, tok: dict,
                    quantize: bool | str = False) -> dict:
    """Writes `hf_model`; returns the HF state dict the file is equivalent to (quantization
    round-tripped), for building the reference model."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), gguf_arch)
    add_tokenizer(w, tok, cfg.vocab_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rp = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    if rp.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    reference = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        qtype = None
        if quantize and data.ndim == 2:
            # True: Q8_0; or a type's name ("Q4_1", as the bundled model's projections).
            qtype = gguf.GGMLQuantizationType[quantize if isinstance(quantize, str) else "Q8_0"]
            data = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        reference[name] = torch.from_numpy(data.copy())
        if gguf_arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if qtype is None:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return reference
