"""Reading llama.cpp GGUF files: config from metadata, weights dequantized to Hugging Face names.

Only the `gguf` package is used (its reader and dequantizer), so any quantization it can
dequantize loads; the model then runs in the requested float dtype.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from aioengine.model.arch import ModelArchConfig
from aioengine.model.moe_config import MoeSpec

logger = logging.getLogger(__name__)

# GGUF general.architecture -> (transformers config class, HF architecture name).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Mixtral (llama.cpp's "llama" with an expert count): the router, and each expert
# projection stacked over the experts [E, rows, cols], split into HF's per-expert names.
_LAYER_NAMES_MOE = {"ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
_EXPERT_NAMES = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3",
                 "ffn_down_exps.weight": "w2"}
_MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"  # llama3 scaling, stored by llama.cpp as per-frequency factors


class FastGGUFReader(GGUFReader):
    """`gguf.GGUFReader`, about 2.5x faster to open.

    The stock reader slices a np.memmap ~1M times while parsing metadata (the tokenizer's
    vocabulary and merges), and every memmap slice pays for memmap.__array_finalize__.
    A plain ndarray view of the same mapping (no copy) parses identically without that cost.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = value.view(np.ndarray)


class GGUFFormatError(ValueError):
    """The GGUF file lacks something we need, or uses a feature we do not implement."""


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar, str or list (`default` when absent)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_architecture(reader: Any) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFFormatError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def gguf_hf_config(reader: Any) -> Any:
    """Builds the transformers config the GGUF metadata describes."""
    return hf_config_from_kwargs(*gguf_hf_config_kwargs(reader))


def hf_config_from_kwargs(cls_name: str, kwargs: dict[str, Any]) -> Any:
    """The transformers config class `cls_name` built from `kwargs` (gguf_hf_config_kwargs;
    the start-up cache keeps the pair as JSON)."""
    import transformers

    return getattr(transformers, cls_name)(**kwargs)


def gguf_hf_config_kwargs(reader: Any) -> tuple[str, dict[str, Any]]:
    """(transformers config class name, its keyword arguments) from the GGUF metadata:
    plain JSON values, so the start-up cache can keep them."""
    arch = gguf_architecture(reader)
    cls_name, hf_arch = GGUF_ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise GGUFFormatError(f"GGUF metadata lacks {arch}.{key}")
        return value

    scaling = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFFormatError(f"unsupported GGUF rope scaling {scaling!r}; supported: none "
                              f"(llama3 scaling via the rope_freqs tensor)")
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = (field_value(reader, f"{arch}.vocab_size")
             or len(field_value(reader, "tokenizer.ggml.tokens", [])))
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_plain(field_value(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_plain(field_value(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=_plain(field_value(reader, "tokenizer.ggml.padding_token_id")),
    )
    window = field_value(reader, f"{arch}.attention.sliding_window")
    if window:
        kwargs["sliding_window"] = int(window)
        if arch != "llama":
            kwargs["use_sliding_window"] = True
    experts = field_value(reader, f"{arch}.expert_count")
    if arch == "llama" and experts:  # Mixtral: a llama file with experts
        cls_name, kwargs["architectures"] = _MIXTRAL[0], [_MIXTRAL[1]]
        kwargs.update(num_local_experts=int(experts),
                      num_experts_per_tok=int(get("expert_used_count")))
    elif arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    return cls_name, kwargs


def _plain(value: Any) -> Any:
    """A metadata scalar as a Python int (numpy integers are not JSON), or None."""
    return None if value is None else int(value)


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order for llama models.

    llama.cpp stores each head's rows interleaved, (x0, x_{D/2}, x1, x_{D/2+1}, ...), for its
    GPT-J style RoPE; HF keeps the halves apart, (x0..x_{D/2-1}, x_{D/2}..x_{D-1}).
    GGUF row h*D + 2*j + s is HF row h*D + s*D/2 + j.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(rows, *w.shape[1:]))


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name (None for tensors handled elsewhere)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == ROPE_FREQS:
        return None
    m = _BLOCK_RE.match(gguf_name)
    names = _LAYER_NAMES | _LAYER_NAMES_MOE
    if m is None or m.group(2) not in names:
        raise GGUFFormatError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}"


def _expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The HF names of a stacked expert tensor's slices, in order; None for any other."""
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _EXPERT_NAMES:
        return None
    w = _EXPERT_NAMES[m.group(2)]
    return [f"model.layers.{m.group(1)}.block_sparse_moe.experts.{e}.{w}.weight"
            for e in range(num_experts)]


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """A reader tensor as float32 numpy, shaped [rows, cols] like its HF counterpart."""
    try:
        data = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GGUFFormatError(
            f"{tensor.name}: cannot dequantize {tensor.tensor_type.name}: {e}") from e
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest axis first
    return data.reshape(shape)


def iter_gguf_weights(reader: Any, num_heads: int,
                      num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) for every weight in the file."""
    arch = gguf_architecture(reader)
    permute = arch == "llama"
    num_experts = int(field_value(reader, f"{arch}.expert_count", 0) or 0)
    for tensor in reader.tensors:
        experts = _expert_names(tensor.name, num_experts)
        if experts is not None:  # [E, rows, cols]: one HF tensor per expert
            stacked = dequantize_tensor(tensor)
            if stacked.ndim != 3 or stacked.shape[0] != num_experts:
                raise GGUFFormatError(f"{tensor.name}: shape {stacked.shape} is not "
                                      f"[{num_experts} experts, rows, cols]")
            for name, data in zip(experts, stacked):
                yield name, torch.from_numpy(data.copy())
            continue
        name = hf_name(tensor.name)
        if name is None:
            continue
        data = dequantize_tensor(tensor)
        if permute and name.endswith("q_proj.weight"):
            data = _unpermute_rows(data, num_heads)
        elif permute and name.endswith("k_proj.weight"):
            data = _unpermute_rows(data, num_kv_heads)
        if not data.flags.writeable:  # F32 tensors are read-only views of the memory map
            data = data.copy()
        yield name, torch.from_numpy(data)


# The projections whose Q4_1 blocks `--quantization gguf` keeps as the file stores them.
_PROJECTION_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                        "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def iter_gguf_q4_1_blocks(reader: Any, num_heads: int,
                          num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, uint8 [rows, cols / 32 * 20]) for every projection, its Q4_1 blocks
    as stored (q/k rows put back in HF order: blocks run along a row, so rows move whole).
    Raises GGUFFormatError for a projection in another format."""
    from gguf import GGMLQuantizationType

    permute = gguf_architecture(reader) == "llama"
    for tensor in reader.tensors:
        if _expert_names(tensor.name, 0) is not None:
            raise GGUFFormatError(f"{tensor.name}: quantization 'gguf' does not cover a "
                                  "mixture of experts' expert weights; load without it")
        name = hf_name(tensor.name)
        if name is None or not name.endswith(_PROJECTION_SUFFIXES):
            continue
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            raise GGUFFormatError(f"{tensor.name} is {tensor.tensor_type.name}: quantization "
                                  f"'gguf' reads Q4_1 projections only")
        data = np.asarray(tensor.data)
        if permute and name.endswith("q_proj.weight"):
            data = _unpermute_rows(data, num_heads)
        elif permute and name.endswith("k_proj.weight"):
            data = _unpermute_rows(data, num_kv_heads)
        yield name, torch.from_numpy(np.array(data, copy=True))


def rope_freq_factors(reader: Any) -> torch.Tensor | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            return torch.from_numpy(dequantize_tensor(tensor).astype(np.float32).reshape(-1))
    return None


# ---- once per start: the file parsed at most once, its results cached on disk ----------

_CACHE_SECTION = "weights"
_WEIGHT_PREFIX, _BLOCK_PREFIX, _ROPE_NAME = "w/", "q/", "rope_freqs"


@dataclass
class GGUFParts:
    """What loading a GGUF takes from it: the config (class name and kwargs, and the
    ModelArchConfig made of it), the HF-named float32 weights (dequantized, q/k rows in HF
    order), the projections' Q4_1 blocks (quantization "gguf" only) and llama3's RoPE
    factors. Read from the start-up cache (weight_cache) when an entry for the file's bytes
    exists, else from the file, parsed once, and then cached. `weights` / `q4_1_blocks` are
    iterated once. The arch is cached too: building the transformers config imports ~1 s of
    transformers modules (torch.distributed among them), which a start from the cache does
    on the side (`hf_config`) while the weights load."""
    config_class: str
    config_kwargs: dict[str, Any]
    arch: ModelArchConfig
    weights: Iterator[tuple[str, torch.Tensor]]
    q4_1_blocks: Iterator[tuple[str, torch.Tensor]] | None
    rope_freq_factors: torch.Tensor | None
    from_cache: bool

    def hf_config(self) -> Any:
        """The transformers config; GGUFFormatError if its arch is not the cached one."""
        config = hf_config_from_kwargs(self.config_class, self.config_kwargs)
        if ModelArchConfig.from_hf_config(config) != self.arch:
            raise GGUFFormatError("the start-up cache's model config differs from the "
                                  "file's; remove the cache directory")
        return config


def _arch_json(arch: ModelArchConfig) -> str:
    return json.dumps(dataclasses.asdict(arch))


def _arch_from_json(text: str) -> ModelArchConfig:
    """The cached ModelArchConfig, equal to the one it was written from: JSON lists back
    to the tuples the fields hold, the MoE spec back to its dataclass."""
    fields = json.loads(text)
    for f in dataclasses.fields(ModelArchConfig):
        value = fields.get(f.name)
        if isinstance(value, list) and str(f.type).startswith("tuple"):
            fields[f.name] = tuple(value)
    if fields.get("moe") is not None:
        fields["moe"] = MoeSpec(**fields["moe"])
    return ModelArchConfig(**fields)


def load_gguf_parts(path: str, with_q4_1_blocks: bool) -> GGUFParts:
    """GGUFParts of the file at `path`, from the cache or from the file (see GGUFParts).
    Raises GGUFFormatError / OSError / ValueError for a file we cannot read."""
    from aioengine.model import weight_cache

    import transformers

    kind = (f"gguf-parts:float32{'+q4_1' if with_q4_1_blocks else ''}:"
            f"transformers-{transformers.__version__}")
    name = weight_cache.entry_name(weight_cache.file_digest(path), kind)
    entry = weight_cache.lookup(_CACHE_SECTION, name)
    if entry is not None:
        try:
            return _parts_from_entry(entry)
        except (OSError, ValueError, KeyError) as e:  # verified, yet unreadable: rebuild
            logger.warning("start-up cache entry %s unreadable, rebuilding it: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    parts, tensors = _parts_from_file(path, with_q4_1_blocks)
    meta = {"config_class": parts.config_class, "arch": _arch_json(parts.arch),
            "config_kwargs": json.dumps(parts.config_kwargs)}
    weight_cache.store(_CACHE_SECTION, name, kind,
                       lambda tmp: weight_cache.save_tensors(tmp, tensors, meta))
    return parts


def _parts_from_entry(entry: Any) -> GGUFParts:
    from aioengine.model import weight_cache

    meta = weight_cache.read_metadata(entry)
    # Copies: a view would keep the whole file's mapping (and its pages) alive.
    rope = next((t.clone() for _, t in weight_cache.iter_tensors(entry, _ROPE_NAME)), None)
    has_blocks = next(weight_cache.iter_tensors(entry, _BLOCK_PREFIX), None) is not None
    return GGUFParts(meta["config_class"], json.loads(meta["config_kwargs"]),
                     _arch_from_json(meta["arch"]), weight_cache.iter_tensors(entry, _WEIGHT_PREFIX),
                     weight_cache.iter_tensors(entry, _BLOCK_PREFIX) if has_blocks else None,
                     rope, from_cache=True)


def _parts_from_file(path: str, with_q4_1_blocks: bool
                     ) -> tuple[GGUFParts, dict[str, torch.Tensor]]:
    """The parts read from the file (its one parse this start), and the same tensors by
    cache name."""
    reader = FastGGUFReader(path)
    cls_name, kwargs = gguf_hf_config_kwargs(reader)
    arch = ModelArchConfig.from_hf_config(hf_config_from_kwargs(cls_name, kwargs))
    heads, kv_heads = kwargs["num_attention_heads"], kwargs["num_key_value_heads"]
    weights = list(iter_gguf_weights(reader, heads, kv_heads))
    blocks = list(iter_gguf_q4_1_blocks(reader, heads, kv_heads)) if with_q4_1_blocks else None
    rope = rope_freq_factors(reader)
    tensors = {_WEIGHT_PREFIX + n: t for n, t in weights}
    tensors.update({_BLOCK_PREFIX + n: t for n, t in blocks or ()})
    if rope is not None:
        tensors[_ROPE_NAME] = rope
    parts = GGUFParts(cls_name, kwargs, arch, iter(weights), None if blocks is None else iter(blocks),
                      rope, from_cache=False)
    return parts, tensors
