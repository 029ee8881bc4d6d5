"""Finds, validates and loads a model: the bundled GGUF, a GGUF file, or a Hugging Face directory.

    model=None            -> the bundled SmolLM2-135M-Instruct (Q4_1 GGUF)
    model="/x/m.gguf"     -> GGUF: config from metadata, weights read in place from the
                             file's memory map (the projections, embedding and LM head in
                             their own block types where the CPU kernels run them, with
                             native_gguf or quantization "gguf"; else dequantized tensor by
                             tensor), tokenizer and chat template read by transformers from
                             the same file; config and tokenizer cached on disk by the
                             file's bytes (weight_cache)
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
from collections.abc import Callable, Iterable, Iterator
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
               lora_source: LoRADecodeSource | None = None,
               native_gguf: bool = False) -> LoadedModel:
    """Loads weights, config and tokenizer; see the module docstring for what `model` and
    `tokenizer` can be. `linear_factory` / `lora_source` go to the model as it is built
    (LlamaForCausalLM's: how LoRA wraps the projections), before the weights load.
    The projections and the embedding are stored in `dtype`, or as int8 with per-row scales
    for quantization="int8" / "w8a8", computed from whatever the checkpoint holds.
    quantization="gguf", or `native_gguf` (what the engine's dtype "auto" means for a GGUF
    file) with no quantization, keeps a GGUF's own block types where the CPU kernels run
    them (cpu_blocks.BLOCK_TYPES) and dequantizes the others to `dtype`. Each tensor is
    read from the mapped file and copied once into its place."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ModelLoadError(f"unsupported dtype {dtype}; supported: {names}")
    if quantization not in (None, "int8", "w8a8", "gguf"):
        raise ModelLoadError(f"unsupported quantization {quantization!r}; "
                             f"supported: int8, w8a8, gguf")
    storage = quantization or str(dtype).removeprefix("torch.")
    path = resolve_model_path(model)
    if native_gguf and quantization is None and path.endswith(".gguf") and device.type == "cpu":
        storage = "gguf"
    # Checked before the weights load, so a bad path fails fast.
    tokenizer_path = resolve_tokenizer_path(tokenizer) if tokenizer is not None else path
    if quantization == "gguf" and not path.endswith(".gguf"):
        raise ModelLoadError(f"quantization 'gguf' reads a GGUF file's own blocks; {path} "
                             f"is not a .gguf file")
    start = time.perf_counter()
    hooks = ModelHooks(linear_factory, lora_source)
    try:
        if path.endswith(".gguf"):
            loaded = _load_gguf(path, dtype, device, storage, tokenizer_path, hooks,
                                explicit=quantization == "gguf")
        else:
            loaded = _load_hf_dir(path, dtype, device, storage, tokenizer_path, hooks)
    except (UnsupportedModelError, GGUFFormatError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    logger.debug("loaded %s in %.2fs", path, time.perf_counter() - start)
    return loaded


def _arch_config(hf_config: Any, path: str) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(hf_config)


def _build(arch: ModelArchConfig, weights: Iterable[tuple[str, Any]], dtype: torch.dtype,
           device: torch.device, path: str, storage: str, hooks: ModelHooks,
           plan: Callable[[LlamaForCausalLM], None] | None = None) -> LlamaForCausalLM:
    """The model in `storage`, built with `hooks` in the activations' dtype, its weights
    then given their storage (`plan`: a GGUF's blocks; float storages allocated in their
    dtype, which the checkpoint's tensors are converted to as they are copied in; int8 /
    w8a8 quantized from the loaded float32 weights), loaded one tensor at a time, packed."""
    compute = activation_dtype(dtype, device)
    model = LlamaForCausalLM(arch, compute, device, linear_factory=hooks.linear_factory,
                             lora_source=hooks.lora_source)
    float_storage = storage if storage in ("float32", "bfloat16", "float16") else None
    try:
        if plan is not None:
            plan(model)
            float_storage = str(dtype).removeprefix("torch.")
        if float_storage is not None:
            model.allocate_weights(getattr(torch, float_storage))
        model.load_weights(weights)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    model.convert_weights(float_storage or storage)
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
    model = _build(arch, iter_safetensors(files), dtype, device, path, storage, hooks)
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


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the files: read-only views of each file's memory
    map, one at a time; once the consumer asks for the next, the last one's pages are
    dropped from the process (gguf_loader.release_pages), so loading copies each tensor
    once into its place without the file becoming resident beside the model."""
    import mmap
    import struct
    import warnings

    import numpy as np

    from aioengine.model.gguf_loader import release_pages

    for file in files:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size else None
        if mapping is None:
            raise ModelLoadError(f"{file} is empty")
        try:
            (header_len,) = struct.unpack("<Q", mapping[:8])
            header = json.loads(mapping[8:8 + header_len])
        except (struct.error, ValueError) as e:
            raise ModelLoadError(f"{file} is not a safetensors file: {e}") from e
        base = 8 + header_len
        raw = np.frombuffer(mapping, dtype=np.uint8)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ModelLoadError(f"{file}: {name} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            data = raw[base + start:base + end]
            with warnings.catch_warnings():  # read-only: only ever read
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(data).view(dtype).view(info["shape"])
            yield name, tensor
            release_pages(data)


def _native_gguf_plan(parts: Any, storage_name: str) -> Callable[[LlamaForCausalLM], None]:
    """Gives the model's Linears the file's block types (LlamaForCausalLM.plan_block_storage)
    and logs, once, the types of the tensors dequantized instead."""
    from collections import Counter

    from aioengine.kernels import cpu_blocks

    def plan(model: LlamaForCausalLM) -> None:
        types = parts.tensor_types()
        dense = model.plan_block_storage({name: cpu_blocks.block_type_of(t)
                                          for name, t in types.items()})
        kept = Counter(lin.storage for lin in model.linears() if lin.blocks is not None)
        if kept:
            logger.info("GGUF weights kept in their own types: %s", ", ".join(
                f"{t} x {n}" for t, n in sorted(kept.items())))
        if dense:
            counts = Counter(types[name].name for name in dense)
            logger.info("dequantized to %s (not run natively): %s", storage_name,
                        ", ".join(f"{t} x {n}" for t, n in counts.most_common()))

    return plan


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device, storage: str,
               tokenizer_path: str, hooks: ModelHooks, explicit: bool) -> LoadedModel:
    """The file is parsed once (its config from the start-up cache when there), and the
    tokenizer and the transformers config load on a thread of their own meanwhile: mostly
    Python and imports, against mostly GIL-free numpy and torch here. Storage "gguf" keeps
    the file's block types (`explicit`: asked for by quantization="gguf", which an
    architecture or file this path is not checked on refuses; else such a file is
    dequantized to `dtype`)."""
    from aioengine.model import gguf_loader

    # transformers' top-level lazy module imported here, once: two threads importing it
    # first at the same time (the tokenizer's and the config's) can see it half set up
    # ("module 'transformers' has no attribute 'LlamaConfig'").
    import transformers  # noqa: F401

    with ThreadPoolExecutor(2, thread_name_prefix="aioengine-load") as pool:
        tokenizer_future = pool.submit(_load_tokenizer, tokenizer_path)
        try:
            parts = gguf_loader.load_gguf_parts(path)
        except (ValueError, OSError) as e:
            if isinstance(e, (GGUFFormatError, UnsupportedModelError)):
                raise
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        config_future = pool.submit(parts.hf_config)
        plan = None
        if storage == "gguf":
            refusal = _native_refusal(parts)
            if refusal is not None and explicit:
                raise GGUFFormatError(refusal)
            plan = _native_gguf_plan(parts, str(dtype).removeprefix("torch."))
            if refusal is not None:
                logger.info("%s: dequantized to %s", refusal, dtype)
                plan = None
            storage = str(dtype).removeprefix("torch.")
        model = _cached_gguf_model(parts, dtype, device, storage, plan is not None, hooks)
        if model is None:
            weights = parts.float_weights() if parts.has_experts else parts.tensors()
            model = _build(parts.arch, weights, dtype, device, path, storage, hooks, plan)
            _store_gguf_model(parts, dtype, storage, plan is not None, hooks, model)
        if parts.rope_freq_factors is not None:
            model.set_rope_freq_factors(parts.rope_freq_factors)
        tokenizer, hf_config = tokenizer_future.result(), config_future.result()
    logger.debug("GGUF config %s the start-up cache", "read from" if parts.from_cache
                 else "computed and written to")
    return LoadedModel(model=model, arch=parts.arch, tokenizer=tokenizer, model_path=path,
                       hf_config=hf_config, max_model_len=parts.arch.max_model_len)


# The start-up cache's section of loaded models, and the version of what an entry holds.
_MODEL_SECTION, _MODEL_STATE_VERSION = "models", 1


def _model_cache_name(parts: Any, dtype: torch.dtype, storage: str,
                      native: bool) -> tuple[str, str] | None:
    """(entry name, kind) of the model state a load of this file gives: keyed by the file's
    bytes and everything that changes the bytes it holds (storage, dtype, whether the
    blocks are kept, cpu_blocks' panel layout, whether the CPU kernels' panels are used at
    all and whether bf16 ones are in AMX's tile layout, this state's own layout)."""
    from aioengine.kernels import cpu_blocks, cpu_build, cpu_gemm
    from aioengine.model import weight_cache

    kind = (f"gguf-model:v{_MODEL_STATE_VERSION}:{storage}:{dtype}:native-{native}:"
            f"blocks-{cpu_blocks.LAYOUT_VERSION}:panels-{cpu_build.load() is not None}:"
            f"bf16-tiles-{cpu_gemm.amx_layout()}")
    return weight_cache.entry_name(weight_cache.file_digest(parts.path), kind), kind


def _cached_gguf_model(parts: Any, dtype: torch.dtype, device: torch.device, storage: str,
                       native: bool, hooks: ModelHooks) -> LlamaForCausalLM | None:
    """The model as a load of this file left it, read from the start-up cache: each tensor
    read once straight into its place (weight_cache.read_tensor_into); None where there
    is no entry (or hooks change what the model holds, or it is not a CPU load)."""
    from aioengine.model import weight_cache

    if device.type != "cpu" or hooks.linear_factory is not None:
        return None
    name, _ = _model_cache_name(parts, dtype, storage, native)
    entry = weight_cache.lookup(_MODEL_SECTION, name)
    if entry is None:
        return None
    try:
        index, meta = weight_cache.tensor_index(entry)
        model = LlamaForCausalLM(parts.arch, activation_dtype(dtype, device), device,
                                 lora_source=hooks.lora_source)
        model.restore_stored_state(
            json.loads(meta["linears"]), {k: (v.dtype, v.shape) for k, v in index.items()},
            lambda key, out: weight_cache.read_tensor_into(entry, index[key], out))
    except (OSError, ValueError, KeyError) as e:  # verified, yet not this model's: rebuild
        logger.warning("start-up cache entry %s unusable, rebuilding it: %s", entry, e)
        import shutil

        shutil.rmtree(entry, ignore_errors=True)
        return None
    model.pack_weights()  # oneDNN's copies of float32 weights left unpacked, if any
    logger.debug("GGUF weights read from the start-up cache (%s)", entry)
    return model.eval()


def _store_gguf_model(parts: Any, dtype: torch.dtype, storage: str, native: bool,
                      hooks: ModelHooks, model: LlamaForCausalLM) -> None:
    """Writes what the model holds into the start-up cache (streamed from the model's own
    tensors: no copy)."""
    from aioengine.model import weight_cache

    if model.device.type != "cpu" or hooks.linear_factory is not None:
        return
    name, kind = _model_cache_name(parts, dtype, storage, native)
    layouts, tensors = model.stored_state()
    path = None

    def write(tmp: Any) -> None:
        weight_cache.write_tensors(tmp / weight_cache.TENSORS_FILE, tensors,
                                   {"linears": json.dumps(layouts)})

    path = weight_cache.store(_MODEL_SECTION, name, kind, write)
    logger.debug("GGUF weights written to the start-up cache (%s)", path)


def _native_refusal(parts: Any) -> str | None:
    """Why the file's blocks cannot be kept (an architecture the path is not checked on, or
    experts), or None."""
    from aioengine.model.gguf_arch import GGUF_ARCHITECTURES

    spec = parts.architecture  # from the start-up cache where it has the file: not parsed
    if spec.experts is not None:
        return ("quantization 'gguf' does not cover a mixture of experts' expert weights; "
                "load without it")
    if not spec.q4_1_blocks:
        checked = [a.gguf_name for a in GGUF_ARCHITECTURES.values() if a.q4_1_blocks]
        return (f"quantization 'gguf' (the file's own blocks) is implemented for "
                f"{', '.join(checked)} files, not {spec.gguf_name}; load without it")
    return None
