"""Writes a saved tiny Hugging Face model as llama.cpp's convert_hf_to_gguf.py writes it, for
every llama.cpp architecture we read: its metadata keys, its tensor names (gguf-py's
tensor_mapping.py), and what the converter does to the weights (q/k rows interleaved for the
NORM-RoPE archs, 1 added to Gemma's norm weights, experts stacked [E, rows, cols], the shared
expert's gate squeezed to [hidden], Phi-3's LongRoPE factors as tensors). Written from the
converter's description, independently of our loader.

A model llama.cpp's format cannot describe is refused (ValueError), as the converter would
refuse it or write a file that means another model: e.g. a Gemma whose query_pre_attn_scalar
is not llama.cpp's, a Qwen MoE with dense layers or another top-k normalisation, a SmolLM3
whose RoPE-less layers are not every 4th.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf_writer import add_tokenizer, llama_cpp_permute

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up rows in one tensor
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
# Gemma 2/3 and OLMo 2: HF's post_attention_layernorm follows attention (ATTN_POST_NORM).
_POST_ATTENTION = {"post_attention_layernorm": "post_attention_norm"}
_PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's NORM RoPE type
_EXPERTS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
_EXPERT_HF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate",
              "w3": "up", "w2": "down"}


def write_llama_cpp_gguf(model_dir: Path, gguf_arch: str, path: Path, tok: dict,
                         qtype: str | None = None) -> None:
    """`model_dir` (config.json, model.safetensors) as a GGUF of `gguf_arch`: float32, or
    with `qtype` ("Q8_0") every tensor of 2+ dims whose rows split into its blocks (stacked
    experts too), the rest float32, as llama.cpp falls back."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    state = {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), gguf_arch)
    add_tokenizer(w, tok, cfg["vocab_size"])
    _common_metadata(w, cfg, gguf_arch)
    _FAMILY[gguf_arch](w, cfg, state)
    for name, data in _tensors(cfg, gguf_arch, state):
        data = np.ascontiguousarray(data.numpy())
        if qtype is not None and quantizable(data, qtype):
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantizable(data: np.ndarray, qtype: str) -> bool:
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return data.ndim >= 2 and data.shape[-1] % block == 0


def _rope(cfg: dict, layer_type: str = "full_attention") -> dict:
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    return rope.get(layer_type, rope)


def _common_metadata(w: gguf.GGUFWriter, cfg: dict, arch: str) -> None:
    """TextModel.set_gguf_parameters' keys (Phi-3 writes its own)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(_rope(cfg)["rope_theta"])
    if cfg.get("head_dim") and arch != "phi3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])


def _refuse(condition: bool, why: str) -> None:
    if condition:
        raise ValueError(f"llama.cpp's GGUF cannot describe this model: {why}")


def _plain(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    pass


def _qwen_moe(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    """Qwen2MoeModel.set_gguf_parameters (Qwen3MoeModel inherits it)."""
    shared = "shared_expert_intermediate_size" in cfg
    _refuse(bool(cfg.get("mlp_only_layers")) or cfg.get("decoder_sparse_step", 1) != 1,
            "dense MLP layers in a Qwen MoE (no tensor name for them)")
    _refuse(bool(cfg.get("norm_topk_prob")) == shared,
            "top-k normalisation other than llama.cpp's for this arch")
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if shared:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _gemma_scale(cfg: dict, big_layers: int) -> None:
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    expected = cfg["hidden_size"] // heads if layers == big_layers else cfg["head_dim"]
    _refuse(cfg["query_pre_attn_scalar"] != expected,
            f"query_pre_attn_scalar {cfg['query_pre_attn_scalar']}, llama.cpp uses {expected}")


def _sliding_pattern(w: gguf.GGUFWriter, cfg: dict, period: int) -> None:
    """The per-layer flags (as llama.cpp reads sliding_window_pattern) where layer_types
    is not llama.cpp's default period."""
    local = [t == "sliding_attention" for t in cfg["layer_types"]]
    if local != [i % period < period - 1 for i in range(len(local))]:
        w.add_sliding_window_pattern(local)


def _gemma2(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    _gemma_scale(cfg, big_layers=46)
    w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    _sliding_pattern(w, cfg, 2)


def _gemma3(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    _gemma_scale(cfg, big_layers=62)
    full = _rope(cfg)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base_swa(_rope(cfg, "sliding_attention")["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    _sliding_pattern(w, cfg, 6)


def _phi3(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    """Phi3MiniModel: the original context, the window (0: none), LongRoPE's factors as
    tensors with its attention factor."""
    rope = _rope(cfg)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    _refuse(rope.get("partial_rotary_factor", 1.0) != 1.0, "partial rotary")
    original = rope.get("original_max_position_embeddings", cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(head_dim)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def _granite(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])


def _smollm3(w: gguf.GGUFWriter, cfg: dict, state: dict) -> None:
    flags = cfg.get("no_rope_layers") or []
    _refuse(flags != [int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])],
            "RoPE-less layers other than every 4th (llama.cpp's n_no_rope_layer_step)")


_FAMILY = {"llama": _plain, "qwen2moe": _qwen_moe, "qwen3moe": _qwen_moe, "gemma2": _gemma2,
           "gemma3": _gemma3, "phi3": _phi3, "olmo2": _plain, "granite": _granite,
           "smollm3": _smollm3}


def _tensors(cfg: dict, arch: str, state: dict[str, torch.Tensor]) -> list[tuple[str, Any]]:
    """(GGUF name, tensor) for every weight, experts stacked per layer and projection."""
    out, experts = [], {}
    for name, data in state.items():
        if name == "lm_head.weight" and (cfg.get("tie_word_embeddings") or arch == "gemma2"):
            continue
        if ".experts." in name:
            layer, rest = name.split(".")[2], name.split(".experts.")[1]
            expert, proj = rest.split(".")[:2]
            experts.setdefault((layer, _EXPERT_HF[proj]), {})[int(expert)] = data
            continue
        out.append((_gguf_name(name, arch), _converted(cfg, arch, name, data)))
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        out.append((f"blk.{layer}.{_EXPERTS[proj]}.weight", stacked))
    return out


def _gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    table = _LAYER | (_POST_ATTENTION if arch in ("gemma2", "gemma3", "olmo2") else {})
    return f"blk.{layer}.{table[module]}.{kind}"


def _converted(cfg: dict, arch: str, name: str, data: torch.Tensor) -> torch.Tensor:
    """What modify_tensors does to one tensor."""
    if arch in _PERMUTED and ".q_proj." in name:
        data = llama_cpp_permute(data.numpy(), cfg["num_attention_heads"])
    elif arch in _PERMUTED and ".k_proj." in name:
        data = llama_cpp_permute(data.numpy(), cfg["num_key_value_heads"])
    data = torch.as_tensor(data)
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        data = data + 1  # Gemma(2|3)Model.modify_tensors
    if name.endswith("shared_expert_gate.weight"):
        data = data.squeeze()  # written as [hidden], as llama.cpp's loader declares it
    return data
