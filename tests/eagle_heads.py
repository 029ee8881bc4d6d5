"""Random-weight EAGLE-1 / EAGLE-3 draft heads in the published formats, for tests.

    target = make_tiny_model_dir("llama", tmp_path / "m")   # or any dir with its config.json
    head_dir = make_random_eagle_head_dir(target, tmp_path / "eagle3", "eagle3",
                                          draft_vocab_size=1000)
    load_eagle_head(str(head_dir), "eagle3", arch, torch.float32, torch.device("cpu"))

EAGLE-1 as yuhuili/EAGLE-LLaMA3-Instruct-8B (LlamaConfig-like config with "bias", weights
fc.*, layers.0.*, embed_tokens.weight), EAGLE-3 as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
(architectures LlamaForCausalLMEagle3, draft_vocab_size; fc, midlayer.*, norm, lm_head,
d2t, t2d). Seeded: the same arguments give the same weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from aioengine.spec_decode.eagle import default_aux_layer_ids

# tiny_models.py's initializer_range: logits peaked enough that greedy choices are no ties.
_SCALE = 0.2
# Target config fields the head copies (its layer has the target's shape and RoPE).
_COPIED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
           "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id")


def make_random_eagle_head_dir(target_model_dir: str | Path, out_dir: str | Path, method: str,
                               *, draft_vocab_size: int | None = None,
                               aux_layer_ids: list[int] | None = None, seed: int = 0,
                               fc_bias: bool = False, input_layernorm: bool = False,
                               draft_token_ids: list[int] | None = None) -> Path:
    """Writes config.json + model.safetensors of a random `method` ("eagle" | "eagle3")
    head for the target whose config.json is in `target_model_dir`; returns out_dir.

    EAGLE-3: `draft_vocab_size` (default: the target's) picks a random sorted subset of the
    target vocabulary (d2t), or `draft_token_ids` is that vocabulary; `aux_layer_ids` go to
    eagle_config (default: none written, fc sized for default_aux_layer_ids). EAGLE-1: `fc_bias` and `input_layernorm` add those
    optional tensors."""
    if method not in ("eagle", "eagle3"):
        raise ValueError(f"unknown method {method!r}")
    target = json.loads((Path(target_model_dir) / "config.json").read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return _SCALE * torch.randn(shape, generator=gen)

    def norm() -> torch.Tensor:  # not all ones, so a dropped norm cannot pass
        return 1.0 + _SCALE * torch.randn(h, generator=gen)

    eagle3 = method == "eagle3"
    layer = "midlayer." if eagle3 else "layers.0."
    attn_in = 2 * h if eagle3 else h
    inter = target["intermediate_size"]
    w = {f"{layer}self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
         f"{layer}self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
         f"{layer}self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
         f"{layer}self_attn.o_proj.weight": rand(h, heads * head_dim),
         f"{layer}mlp.gate_proj.weight": rand(inter, h),
         f"{layer}mlp.up_proj.weight": rand(inter, h),
         f"{layer}mlp.down_proj.weight": rand(h, inter),
         f"{layer}post_attention_layernorm.weight": norm()}
    cfg = {k: target[k] for k in _COPIED if target.get(k) is not None}
    cfg.update(hidden_act="silu", model_type="llama", num_hidden_layers=1,
               tie_word_embeddings=False, torch_dtype="float32", initializer_range=_SCALE)
    if eagle3:
        num_aux = len(aux_layer_ids or default_aux_layer_ids(target["num_hidden_layers"]))
        n = len(draft_token_ids) if draft_token_ids else draft_vocab_size or vocab
        ids = torch.randperm(vocab, generator=gen)[:n].sort().values if n < vocab \
            else torch.arange(vocab)
        if draft_token_ids:
            ids = torch.tensor(sorted(draft_token_ids))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w.update({"fc.weight": rand(h, num_aux * h),
                  "midlayer.input_layernorm.weight": norm(),
                  "midlayer.hidden_norm.weight": norm(),
                  "norm.weight": norm(), "lm_head.weight": rand(n, h),
                  "d2t": ids - torch.arange(n), "t2d": t2d})
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=n)
        if aux_layer_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    else:
        w.update({"fc.weight": rand(h, 2 * h), "embed_tokens.weight": rand(vocab, h)})
        if fc_bias:
            w["fc.bias"] = rand(h)
        if input_layernorm:
            w["layers.0.input_layernorm.weight"] = norm()
        cfg.update(architectures=["LlamaForCausalLM"], bias=fc_bias)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
