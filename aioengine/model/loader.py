"""Finds, validates and loads a model: the bundled GGUF, a GGUF file, or a Hugging Face directory.

    model=None            -> the bundled SmolLM2-135M-Instruct (Q4_1 GGUF)
    model="/x/m.gguf"     -> GGUF: config from metadata, weights dequantized, tokenizer and
                             chat template read by transformers from the same file; all
                             three cached on disk by the file's bytes (weight_cache), so a
                             second start parses nothing
    model="/x/dir"        -> config.json + *.safetensors (sharded or not) + tokenizer files
    tokenizer="/x/tok"    -> that tokenizer (a directory of HF tokenizer files, or a .gguf
                             file) instead of the model's own (vLLM's --tokenizer)

Never unpickles and never runs code from the checkpoint (no trust_remote_code).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from aioengine.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig, UnsupportedModelError
from aioengine.model.default import ModelNotFoundError, bundled_model_path
from aioengine.model.gguf_loader import GGUFFormatError
from aioengine.kernels.cpu_decode import LoRADecodeSource
from aioengine.model.layers import LinearFactory
from aioengine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message says what is missing or unsupported."""


@dataclass(frozen=True)
class ModelHooks:
    """What features give the model as it is built (before its weights load): the factory
    that makes each projection (LoRA's wrappers) and the fused decode kernel's LoRA slots."""
    linear_factory: LinearFactory | None = None
    lora_source: LoRADecodeSource | None = None


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    model_path: str
    hf_config: Any  # transformers PretrainedConfig
    max_model_len: int


def resolve_model_path(model: str | None) -> str:
    """`None` -> the bundled GGUF; otherwise an existing GGUF file or model directory."""
    if model is None:  # the bundled model, or AIOENGINE_DEFAULT_MODEL: validated alike
        try:
            model = bundled_model_path()
        except ModelNotFoundError as e:
            raise ModelLoadError(str(e)) from e
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {model!r} does not exist; give a Hugging Face model "
                             "directory or a .gguf file (the model hub is not used)")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"model file {model!r} is not a .gguf file; supported: a .gguf "
                                 "file or a directory with config.json and *.safetensors")
        return path
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    raise ModelLoadError(
        f"model directory {model!r} has no config.json" +
        (f" and several .gguf files {ggufs}: name one" if ggufs else "") +
        "; supported: a Hugging Face directory (config.json, *.safetensors) or a .gguf file")


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer (with chat template) of a model path as `load_model` resolves it."""
    return _load_tokenizer(resolve_model_path(model))


def resolve_tokenizer_path(tokenizer: str) -> str:
    """An existing tokenizer directory or .gguf file (the model hub is not used)."""
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    raise ModelLoadError(f"tokenizer {tokenizer!r} is not a directory or a .gguf file; give a "
                         "directory with the tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, ...) or a .gguf file (the model hub is not used)")


def _load_tokenizer(path: str) -> Any:
    """A directory's tokenizer, or a GGUF's, through the start-up cache (weight_cache:
    transformers builds a GGUF's tokenizer by parsing the whole file, ~6 s here)."""
    from transformers import AutoTokenizer

    from aioengine.model import weight_cache

    try:
        if path.endswith(".gguf"):
            return weight_cache.cached_tokenizer(path, lambda: _gguf_tokenizer(path))
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from e


def _gguf_tokenizer(path: str) -> Any:
    """transformers' tokenizer of a GGUF file. AutoTokenizer first rebuilds the model's
    config to pick a tokenizer class, which transformers does for some architectures only
    (not olmo2, granite or smollm3 files); the tokenizer itself it builds from any file's
    tokenizer.ggml.* metadata, so those load as its plain fast tokenizer (the class
    AutoTokenizer picks for a llama file too)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory, name = os.path.split(path)
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except ValueError as e:
        try:
            return PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
        except (OSError, ValueError, KeyError, TypeError):
            raise e from None


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the model computes in for weights of `dtype`: float32 on the CPU (norms,
    RoPE, attention and the residual stream; bf16 weights are read as bf16 by the matmuls),
    the weights' dtype elsewhere."""
    return torch.float32 if device.type == "cpu" else dtype


def load_model(model: str | None, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None, tokenizer: str | None = None, *,
               linear_factory: LinearFactory | None = None,
               lora_source: LoRADecodeSource | None = None) -> LoadedModel:
    """Loads weights, config and tokenizer; see the module docstring for what `model` and
    `tokenizer` can be. `linear_factory` / `lora_source` go to the model as it is built
    (LlamaForCausalLM's: how LoRA wraps the projections), before the weights load.
    The projections and the embedding are stored in `dtype`, or as int8 with per-row scales
    for quantization="int8" / "w8a8", computed from whatever the checkpoint holds; "gguf"
    keeps a GGUF's own Q4_1 projection blocks."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ModelLoadError(f"unsupported dtype {dtype}; supported: {names}")
    if quantization not in (None, "int8", "w8a8", "gguf"):
        raise ModelLoadError(f"unsupported quantization {quantization!r}; "
                             f"supported: int8, w8a8, gguf")
    storage = quantization or str(dtype).removeprefix("torch.")
    path = resolve_model_path(model)
    # Checked before the weights load, so a bad path fails fast.
    tokenizer_path = resolve_tokenizer_path(tokenizer) if tokenizer is not None else path
    if quantization == "gguf" and not path.endswith(".gguf"):
        raise ModelLoadError(f"quantization 'gguf' reads a GGUF file's own blocks; {path} "
                             f"is not a .gguf file")
    start = time.perf_counter()
    hooks = ModelHooks(linear_factory, lora_source)
    try:
        if path.endswith(".gguf"):
            loaded = _load_gguf(path, dtype, device, storage, tokenizer_path, hooks)
        else:
            loaded = _load_hf_dir(path, dtype, device, storage, tokenizer_path, hooks)
    except (UnsupportedModelError, GGUFFormatError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    logger.debug("loaded %s in %.2fs", path, time.perf_counter() - start)
    return loaded


def _arch_config(hf_config: Any, path: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(hf_config)


def _build(arch: ModelArchConfig, weights: Iterator[tuple[str, torch.Tensor]],
           dtype: torch.dtype, device: torch.device, path: str, storage: str, hooks: ModelHooks,
           q4_1_blocks: Iterator[tuple[str, torch.Tensor]] | None = None) -> LlamaForCausalLM:
    """The model in `storage`, built with `hooks`: loaded from `weights` (in the activations'
    dtype), then converted, or given a GGUF's own Q4_1 blocks (`q4_1_blocks`, storage
    "gguf")."""
    compute = activation_dtype(dtype, device)
    model = LlamaForCausalLM(arch, compute, device, linear_factory=hooks.linear_factory,
                             lora_source=hooks.lora_source)
    try:
        model.load_weights(weights)
        if q4_1_blocks is not None:
            model.load_q4_1_blocks(q4_1_blocks)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    if q4_1_blocks is None and storage != str(compute).removeprefix("torch."):
        model.convert_weights(storage)
    added = model.pack_weights()
    if added:
        logger.info("packed the projections for oneDNN (+%.0f MiB)", added / 2**20)
    return model.eval()


def _load_hf_dir(path: str, dtype: torch.dtype, device: torch.device, storage: str,
                 tokenizer_path: str, hooks: ModelHooks) -> LoadedModel:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read {path}/config.json: {e}; supported architectures: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}") from e
    arch = _arch_config(hf_config, path)
    files = safetensors_files(path)
    model = _build(arch, _iter_safetensors(files), dtype, device, path, storage, hooks)
    tokenizer = _load_tokenizer(tokenizer_path)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, model_path=path,
                       hf_config=hf_config, max_model_len=arch.max_model_len)


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files: those the shard index names, else all of them."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise ModelLoadError(f"{path}: shard(s) named in the index are missing: {missing}")
        return [os.path.join(path, n) for n in names]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        return [os.path.join(path, f) for f in files]
    pickled = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
    hint = (f" (found {pickled}: pickle checkpoints are not loaded for safety; convert them "
            "to safetensors)") if pickled else ""
    raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")


def _iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device, storage: str,
               tokenizer_path: str, hooks: ModelHooks) -> LoadedModel:
    """The file is parsed at most once (never when the start-up cache has its parts), and
    the tokenizer and the transformers config load on a thread of their own meanwhile:
    mostly Python and imports, against mostly GIL-free numpy and torch here."""
    from aioengine.model import gguf_loader

    with ThreadPoolExecutor(2, thread_name_prefix="aioengine-load") as pool:
        tokenizer_future = pool.submit(_load_tokenizer, tokenizer_path)
        try:
            parts = gguf_loader.load_gguf_parts(path, with_q4_1_blocks=storage == "gguf")
        except (ValueError, OSError) as e:
            if isinstance(e, (GGUFFormatError, UnsupportedModelError)):
                raise
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        config_future = pool.submit(parts.hf_config)
        model = _build(parts.arch, parts.weights, dtype, device, path, storage, hooks,
                       parts.q4_1_blocks)
        if parts.rope_freq_factors is not None:
            model.set_rope_freq_factors(parts.rope_freq_factors)
        tokenizer, hf_config = tokenizer_future.result(), config_future.result()
    logger.debug("GGUF parts %s the start-up cache", "read from" if parts.from_cache
                 else "computed and written to")
    return LoadedModel(model=model, arch=parts.arch, tokenizer=tokenizer, model_path=path,
                       hf_config=hf_config, max_model_len=parts.arch.max_model_len)
