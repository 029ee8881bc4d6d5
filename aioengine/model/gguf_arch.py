"""llama.cpp's GGUF architectures, read back as the Hugging Face models they were converted from.

A GGUF file names its architecture in `general.architecture` (llama.cpp's name). Each one we
read is a `GGUFArchitecture`: the transformers config its metadata makes, the HF name of
every tensor, and what llama.cpp's converter (convert_hf_to_gguf.py) did to the weights that
loading undoes. The metadata llama.cpp does not store, its loader (llama-model.cpp) fixes
per architecture, and so do we:

    llama      Llama, Mistral (sliding_window); Mixtral when {arch}.expert_count is set
    qwen2      q/k/v biases                  qwen3   q/k norms, head_dim from key_length
    qwen2moe   every layer sparse (ffn_{gate,up,down}_exps stacked [E, rows, cols], router
               ffn_gate_inp), a shared expert (ffn_*_shexp) gated by ffn_gate_inp_shexp;
               top-k weights not renormalised (llama.cpp's qwen2moe graph)
    qwen3moe   as qwen2moe without the shared expert; top-k weights renormalised
    gemma2     norms stored as 1 + w (the converter adds 1 to every *norm.weight, HF's Gemma
               RMSNorm keeps w and scales by 1 + w); attention scale 1/sqrt(head_dim) (the
               27B model, 46 layers: 1/sqrt(hidden / heads)); every other layer local
               (window 4096 unless given); soft-caps 50 / 30 unless given
    gemma3     as gemma2 with q/k norms, no attention soft-cap, 5 local layers to 1 global
               (27B: 62 layers); local RoPE base rope.freq_base_swa (10000 unless given),
               linear scaling (rope.scaling.*) on the global layers only
    phi3       fused attn_qkv and ffn_up (gate rows, then up rows); LongRoPE's factors
               as the tensors rope_factors_{short,long}
    olmo2      norms after attention and MLP only (post_attention_norm, post_ffw_norm),
               q/k norms over the whole projection
    granite    embedding_scale, residual_scale, attention.scale, logit_scale
    smollm3    every 4th layer without RoPE (llama.cpp's n_no_rope_layer_step = 4)

Q/K rows: the converter interleaves each head's rows (and biases) for the architectures whose
llama.cpp RoPE type is NORM (llama, granite, smollm3); the NEOX ones keep HF's order.
A key {arch}.attention.sliding_window_pattern (a period, or a flag per layer), which
llama.cpp reads for Gemma, overrides the default pattern.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

ROPE_FREQS = "rope_freqs.weight"  # llama3 scaling, as per-frequency factors
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 LongRoPE


class GGUFFormatError(ValueError):
    """The GGUF file lacks something we need, or uses a feature we do not implement."""


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, str or list (`default` when absent)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class GGUFMetadata:
    """A file's metadata under its architecture's prefix (`{arch}.key`), and its tensors."""

    def __init__(self, reader: Any, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensors = {t.name: t for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return field_value(self.reader, f"{self.arch}.{key}", default)

    def require(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        if value is None:
            raise GGUFFormatError(f"GGUF metadata lacks {self.arch}.{key}")
        return value

    def vector(self, name: str) -> list[float] | None:
        """A small float tensor's values (None when the file has no such tensor)."""
        from gguf.quants import dequantize

        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        return [float(v) for v in np.asarray(
            dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)]


@dataclass(frozen=True)
class ExpertNames:
    """Where a layer's experts live in HF names: `{prefix}.{e}.{gate|up|down}.weight`."""
    prefix: str
    gate: str
    up: str
    down: str


ConfigReader = Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]]


def _no_extra(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFArchitecture:
    """One llama.cpp architecture as the HF model it was converted from (module docstring).

    `layer_names`: GGUF name inside a block (`blk.N.`) -> HF name inside a layer
    (`model.layers.N.`); `config`: the family's config kwargs past the common ones;
    `permuted_qk`: q/k rows (and biases) interleaved per head by the converter;
    `norm_shift`: added by the converter to every `*norm.weight`; `experts`: the HF names
    stacked expert tensors split into; `rope_scalings`: the rope.scaling.type values read;
    `q4_1_blocks`: quantization "gguf" (the file's own Q4_1 projections) is checked for it."""
    gguf_name: str
    config_class: str
    hf_architecture: str
    layer_names: Mapping[str, str]
    config: ConfigReader = _no_extra
    permuted_qk: bool = False
    norm_shift: float = 0.0
    experts: ExpertNames | None = None
    rope_scalings: tuple[str, ...] = ()
    q4_1_blocks: bool = False


# ---- tensor names -------------------------------------------------------------------------

_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight"}
_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight"}
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight"}
# Gemma: ffn_norm is the norm before the MLP (HF's pre_feedforward_layernorm).
_POST_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_SANDWICH_NORMS = {"attn_norm.weight": "input_layernorm.weight",
                   "ffn_norm.weight": "pre_feedforward_layernorm.weight", **_POST_NORMS}
_QWEN_MOE = {"ffn_gate_inp.weight": "mlp.gate.weight"}
_SHARED_EXPERT = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                  "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
_PHI3 = {"attn_qkv.weight": "self_attn.qkv_proj.weight",
         "attn_output.weight": "self_attn.o_proj.weight",
         "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
SHARED_EXPERT_GATE = "ffn_gate_inp_shexp.weight"  # [hidden] in the file, HF's [1, hidden]


# ---- config kwargs ------------------------------------------------------------------------

def _window(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    window = meta.get("attention.sliding_window")
    if not window:
        return {}
    if meta.arch == "llama":
        return {"sliding_window": int(window)}
    return {"sliding_window": int(window), "use_sliding_window": True}  # Qwen's switch


def _llama(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in meta.tensors, **_window(meta, common)}


def _mixtral(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    return dict(num_local_experts=int(meta.require("expert_count")),
                num_experts_per_tok=int(meta.require("expert_used_count")),
                **_window(meta, common))


def _qwen_moe(meta: GGUFMetadata, common: dict[str, Any], shared: bool) -> dict[str, Any]:
    """Every layer sparse (llama.cpp has no dense layers for these archs); the expert width
    and the shared expert's as llama.cpp falls back when a key is absent."""
    used = int(meta.require("expert_used_count"))
    kwargs: dict[str, Any] = dict(
        num_experts=int(meta.require("expert_count")), num_experts_per_tok=used,
        moe_intermediate_size=int(meta.get("expert_feed_forward_length")
                                  or common["intermediate_size"] // used),
        decoder_sparse_step=1, mlp_only_layers=[],
        # llama.cpp's graphs: qwen3moe renormalises the top-k weights, qwen2moe does not.
        norm_topk_prob=bool(meta.get("expert_weights_norm", not shared)),
        **_window(meta, common))
    if shared:
        kwargs["shared_expert_intermediate_size"] = int(
            meta.get("expert_shared_feed_forward_length") or common["intermediate_size"])
        kwargs["qkv_bias"] = "blk.0.attn_q.bias" in meta.tensors
    return kwargs


def _layer_types(meta: GGUFMetadata, num_layers: int, period: int) -> list[str]:
    """Gemma's local / global layers: llama.cpp's default period (layer i is local when
    i % period < period - 1), or the file's own sliding_window_pattern (a period, or a flag
    per layer)."""
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise GGUFFormatError(f"{meta.arch}.attention.sliding_window_pattern has "
                                  f"{len(pattern)} flags for {num_layers} layers")
        local = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: a period of 0 makes every layer local
        period = int(pattern)
        local = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in local]


def _gemma_common(meta: GGUFMetadata, common: dict[str, Any], big_layers: int
                  ) -> dict[str, Any]:
    """What Gemma 2 and 3 share: llama.cpp's attention scale (query_pre_attn_scalar is not
    stored; the 27B model, known by its layer count, scales by hidden / heads)."""
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    scalar = common["hidden_size"] // heads if layers == big_layers else common["head_dim"]
    final_cap = meta.get("final_logit_softcapping")
    return dict(query_pre_attn_scalar=scalar, hidden_activation="gelu_pytorch_tanh",
                final_logit_softcapping=None if final_cap is None else float(final_cap))


def _gemma2(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    kwargs = _gemma_common(meta, common, big_layers=46)
    kwargs.update(sliding_window=int(meta.get("attention.sliding_window", 4096)),
                  layer_types=_layer_types(meta, common["num_hidden_layers"], 2),
                  attn_logit_softcapping=float(meta.get("attn_logit_softcapping", 50.0)),
                  final_logit_softcapping=float(meta.get("final_logit_softcapping", 30.0)))
    return kwargs


def _gemma3(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    kwargs = _gemma_common(meta, common, big_layers=62)
    window = meta.get("attention.sliding_window")
    num_layers = common["num_hidden_layers"]
    kwargs.update(sliding_window=int(window) if window else None, attn_logit_softcapping=None,
                  layer_types=(_layer_types(meta, num_layers, 6) if window
                               else ["full_attention"] * num_layers))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": common.pop("rope_theta")}
    if meta.get("rope.scaling.type", "none") == "linear":
        full.update(rope_type="linear", factor=float(meta.require("rope.scaling.factor")))
    local = {"rope_type": "default",
             "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
    kwargs["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    return kwargs


def _phi3(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE from the factor tensors; the window the converter stores (0: none)."""
    window = meta.get("attention.sliding_window")
    kwargs: dict[str, Any] = {"sliding_window": int(window) if window else None}
    long, short = (meta.vector(name) for name in ROPE_FACTORS)
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        kwargs["original_max_position_embeddings"] = int(original)
    if long is None and short is None and meta.get("rope.scaling.type") != "longrope":
        return kwargs
    if long is None or short is None or original is None:
        raise GGUFFormatError("phi3 GGUF: LongRoPE needs rope_factors_long, rope_factors_short "
                              "and rope.scaling.original_context_length")
    rope = dict(rope_type="longrope", rope_theta=common.pop("rope_theta"), long_factor=long,
                short_factor=short, original_max_position_embeddings=int(original))
    scale = common["max_position_embeddings"] / int(original)
    default = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
    stored = float(meta.get("rope.scaling.attn_factor", default))
    if abs(stored - default) > 1e-6 * default:  # transformers' own default otherwise
        rope["attention_factor"] = stored
    kwargs["rope_parameters"] = rope
    return kwargs


def _granite(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    return dict(embedding_multiplier=float(meta.require("embedding_scale")),
                residual_multiplier=float(meta.require("residual_scale")),
                attention_multiplier=float(meta.require("attention.scale")),
                logits_scaling=float(meta.require("logit_scale")),
                attention_bias="blk.0.attn_q.bias" in meta.tensors)


def _smollm3(meta: GGUFMetadata, common: dict[str, Any]) -> dict[str, Any]:
    layers = common["num_hidden_layers"]  # llama.cpp: no RoPE where (i + 1) % 4 == 0
    return dict(no_rope_layers=[int((i + 1) % 4 != 0) for i in range(layers)],
                no_rope_layer_interval=4, use_sliding_window=False)


_DENSE = {**_PRE_NORMS, **_ATTENTION, **_MLP}
_QWEN_EXPERTS = ExpertNames("mlp.experts", "gate_proj", "up_proj", "down_proj")
GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {a.gguf_name: a for a in (
    GGUFArchitecture("llama", "LlamaConfig", "LlamaForCausalLM", _DENSE, _llama,
                     permuted_qk=True, q4_1_blocks=True),
    GGUFArchitecture("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _DENSE, _window,
                     q4_1_blocks=True),
    GGUFArchitecture("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _DENSE | _QK_NORMS, _window,
                     q4_1_blocks=True),
    GGUFArchitecture("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                     {**_PRE_NORMS, **_ATTENTION, **_QWEN_MOE, **_SHARED_EXPERT},
                     lambda meta, common: _qwen_moe(meta, common, shared=True),
                     experts=_QWEN_EXPERTS),
    GGUFArchitecture("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                     {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS, **_QWEN_MOE},
                     lambda meta, common: _qwen_moe(meta, common, shared=False),
                     experts=_QWEN_EXPERTS),
    GGUFArchitecture("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
                     {**_SANDWICH_NORMS, **_ATTENTION, **_MLP}, _gemma2, norm_shift=1.0),
    GGUFArchitecture("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                     {**_SANDWICH_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}, _gemma3,
                     norm_shift=1.0, rope_scalings=("linear",)),
    GGUFArchitecture("phi3", "Phi3Config", "Phi3ForCausalLM", {**_PRE_NORMS, **_PHI3}, _phi3,
                     rope_scalings=("longrope",)),
    GGUFArchitecture("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
                     {**_POST_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}),
    GGUFArchitecture("granite", "GraniteConfig", "GraniteForCausalLM", _DENSE, _granite,
                     permuted_qk=True),
    GGUFArchitecture("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", _DENSE, _smollm3,
                     permuted_qk=True),
)}
# llama.cpp's "llama" with an expert count.
MIXTRAL = GGUFArchitecture(
    "llama", "MixtralConfig", "MixtralForCausalLM",
    {**_PRE_NORMS, **_ATTENTION, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"},
    _mixtral, permuted_qk=True, experts=ExpertNames("block_sparse_moe.experts", "w1", "w3", "w2"))


def gguf_file_architectures() -> dict[str, str]:
    """HF architecture -> the llama.cpp architecture whose GGUF files load as it. A Mistral
    file is llama.cpp's "llama" (read as LlamaForCausalLM with its window: the same model)."""
    names = {a.hf_architecture: a.gguf_name for a in (*GGUF_ARCHITECTURES.values(), MIXTRAL)}
    return names | {"MistralForCausalLM": "llama"}


def architecture_named(hf_architecture: str) -> GGUFArchitecture:
    """The GGUFArchitecture whose files load as `hf_architecture` (what the start-up cache
    records of a file, so a warm start need not parse it); KeyError for another name."""
    for spec in (*GGUF_ARCHITECTURES.values(), MIXTRAL):
        if spec.hf_architecture == hf_architecture:
            return spec
    raise KeyError(hf_architecture)


def file_architecture(reader: Any) -> GGUFArchitecture:
    """The file's architecture (GGUFFormatError naming the supported ones otherwise)."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFFormatError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    if arch == "llama" and field_value(reader, "llama.expert_count"):
        return MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def gguf_hf_config_kwargs(reader: Any) -> tuple[str, dict[str, Any]]:
    """(transformers config class name, its keyword arguments) from the GGUF metadata:
    plain JSON values, so the start-up cache can keep them."""
    spec = file_architecture(reader)
    meta = GGUFMetadata(reader, spec.gguf_name)
    common = _common_kwargs(meta, spec)
    common.update(spec.config(meta, common))
    return spec.config_class, common


def _common_kwargs(meta: GGUFMetadata, spec: GGUFArchitecture) -> dict[str, Any]:
    scaling = meta.get("rope.scaling.type", "none")
    if scaling not in ("none", None, *spec.rope_scalings):
        raise GGUFFormatError(
            f"unsupported rope scaling {scaling!r} in a {meta.arch} GGUF; supported: none"
            f"{''.join(', ' + s for s in spec.rope_scalings)} (llama3 scaling via rope_freqs)")
    hidden, heads = int(meta.require("embedding_length")), int(meta.require("attention.head_count"))
    head_dim = int(meta.require("attention.key_length", hidden // heads))
    rotated = meta.get("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        raise GGUFFormatError(f"{meta.arch} GGUF: RoPE over {rotated} of {head_dim} head "
                              "dimensions (partial rotary) is not supported")
    vocab = meta.get("vocab_size") or len(field_value(meta.reader, "tokenizer.ggml.tokens", []))
    return dict(
        architectures=[spec.hf_architecture],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta.require("feed_forward_length")),
        num_hidden_layers=int(meta.require("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.require("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.require("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.require("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.require("context_length")),
        tie_word_embeddings="output.weight" not in meta.tensors,
        bos_token_id=_plain(field_value(meta.reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_plain(field_value(meta.reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=_plain(field_value(meta.reader, "tokenizer.ggml.padding_token_id")),
    )


def _plain(value: Any) -> Any:
    """A metadata scalar as a Python int (numpy integers are not JSON), or None."""
    return None if value is None else int(value)
