"""Reading llama.cpp GGUF files: config from metadata, tensors under Hugging Face names.

What each llama.cpp architecture's metadata and tensor names mean, and what its converter
did to the weights, is `gguf_arch.py`'s table; this module reads a file through it. Tensors
are read in place from the file's memory map, one at a time (`iter_gguf_tensors`: each a
`GGUFTensor`, its blocks as stored or its values dequantized, its pages dropped once
consumed), so the loader copies each once into the model's storage; `iter_gguf_weights`
dequantizes every tensor to float32 (stacked experts split). Only the `gguf` package is
used (its reader and dequantizer), so any type it can dequantize loads.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import json
import logging
import mmap
import re
import shutil
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from aioengine.kernels import cpu_blocks
from aioengine.model.arch import ModelArchConfig
from aioengine.model.gguf_arch import (EXPERT_TENSORS, ROPE_FACTORS,
                                       ROPE_FREQS, SHARED_EXPERT_GATE, GGUFArchitecture,
                                       GGUFFormatError, architecture_named, field_value,
                                       file_architecture, gguf_hf_config_kwargs)
from aioengine.model.moe_config import MoeSpec

__all__ = ["FastGGUFReader", "GGUFFormatError", "GGUFTensor", "gguf_hf_config",
           "iter_gguf_tensors", "iter_gguf_weights", "load_gguf_parts", "rope_freq_factors"]

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Read into the config (Phi-3's LongRoPE factors) or applied to the model (llama3's).
_NOT_WEIGHTS = (ROPE_FREQS, *ROPE_FACTORS)


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


def gguf_hf_config(reader: Any) -> Any:
    """Builds the transformers config the GGUF metadata describes."""
    return hf_config_from_kwargs(*gguf_hf_config_kwargs(reader))


def hf_config_from_kwargs(cls_name: str, kwargs: dict[str, Any]) -> Any:
    """The transformers config class `cls_name` built from `kwargs` (gguf_hf_config_kwargs;
    the start-up cache keeps the pair as JSON)."""
    import transformers

    return getattr(transformers, cls_name)(**kwargs)


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row order (weights and biases) for its NORM-RoPE archs.

    llama.cpp stores each head's rows interleaved, (x0, x_{D/2}, x1, x_{D/2+1}, ...), for its
    GPT-J style RoPE; HF keeps the halves apart, (x0..x_{D/2-1}, x_{D/2}..x_{D-1}).
    GGUF row h*D + 2*j + s is HF row h*D + s*D/2 + j.
    """
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(rows, *w.shape[1:]))


def hf_name(gguf_name: str, spec: GGUFArchitecture) -> str | None:
    """GGUF tensor name -> Hugging Face name in a `spec` file (None for tensors read
    elsewhere: RoPE factors)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _NOT_WEIGHTS:
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in spec.layer_names:
        raise GGUFFormatError(f"unexpected GGUF tensor {gguf_name!r} in a "
                              f"{spec.gguf_name} file ({spec.hf_architecture})")
    return f"model.layers.{m.group(1)}.{spec.layer_names[m.group(2)]}"


def _expert_names(gguf_name: str, spec: GGUFArchitecture,
                  num_experts: int) -> list[str] | None:
    """The HF names of a stacked expert tensor's slices, in order; None for any other."""
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in EXPERT_TENSORS:
        return None
    if spec.experts is None:
        raise GGUFFormatError(f"{gguf_name}: expert tensors in a {spec.gguf_name} file "
                              "without an expert count")
    names = spec.experts
    proj = dict(zip(EXPERT_TENSORS, (names.gate, names.up, names.down)))[m.group(2)]
    return [f"model.layers.{m.group(1)}.{names.prefix}.{e}.{proj}.weight"
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


def _as_hf(spec: GGUFArchitecture, gguf_name: str, name: str, data: np.ndarray,
           num_heads: int, num_kv_heads: int) -> np.ndarray:
    """What the converter did to one tensor, undone: q/k rows back in HF order, the norm
    shift taken off (HF's Gemma norms hold w, the file 1 + w), the shared expert's gate
    back to its [1, hidden]."""
    if spec.permuted_qk and ".self_attn.q_proj." in name:
        data = _unpermute_rows(data, num_heads)
    elif spec.permuted_qk and ".self_attn.k_proj." in name:
        data = _unpermute_rows(data, num_kv_heads)
    if spec.norm_shift and gguf_name.endswith("norm.weight"):
        data = data - np.float32(spec.norm_shift)
    if gguf_name.endswith(SHARED_EXPERT_GATE) and data.ndim == 1:
        data = data.reshape(1, -1)
    return data


def iter_gguf_weights(reader: Any, num_heads: int,
                      num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, float32 tensor) for every weight in the file, as the HF checkpoint
    it was converted from holds it."""
    spec = file_architecture(reader)
    num_experts = int(field_value(reader, f"{spec.gguf_name}.expert_count", 0) or 0)
    for tensor in reader.tensors:
        experts = _expert_names(tensor.name, spec, num_experts)
        if experts is not None:  # [E, rows, cols]: one HF tensor per expert
            stacked = dequantize_tensor(tensor)
            if stacked.ndim != 3 or stacked.shape[0] != num_experts:
                raise GGUFFormatError(f"{tensor.name}: shape {stacked.shape} is not "
                                      f"[{num_experts} experts, rows, cols]")
            for name, data in zip(experts, stacked):
                yield name, torch.from_numpy(data.copy())
            release_pages(tensor.data)
            continue
        name = hf_name(tensor.name, spec)
        if name is None:
            continue
        data = _as_hf(spec, tensor.name, name, dequantize_tensor(tensor), num_heads,
                      num_kv_heads)
        if not data.flags.writeable:  # F32 tensors are read-only views of the memory map
            data = data.copy()
        yield name, torch.from_numpy(data)
        release_pages(tensor.data)


# The HF names whose GGUF blocks may be kept as stored (the projections, the embedding
# and the LM head): everything else (norms, biases, routers) is read as float32.
BLOCK_TENSOR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                         "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                         "model.embed_tokens.weight", "lm_head.weight")


@dataclass(eq=False)
class GGUFTensor:
    """One tensor of a GGUF file as the Hugging Face tensor it was converted from, read on
    demand from the file's memory map: `blocks()` its stored bytes with rows in HF order,
    `dequantized()` its float32 values. Neither is kept: the loader copies what it takes
    into the model's storage, then `release()` drops this tensor's pages of the mapping
    from the process (they stay in the page cache), so reading a file never makes the
    whole file resident beside the model."""
    name: str  # the HF name
    gguf_name: str
    ggml_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # HF order: (rows, cols)
    spec: GGUFArchitecture
    heads: int  # the q/k row groups of a permuted projection (0: rows in HF order)
    raw: np.ndarray  # the reader's view of the stored bytes (or values, for float types)

    @property
    def block_type(self) -> str | None:
        """cpu_blocks' name of the stored type where the kernels run it; None otherwise."""
        return cpu_blocks.block_type_of(self.ggml_type)

    def blocks(self) -> torch.Tensor:
        """uint8 [rows, row_bytes]: the stored rows in HF order (a view of the mapping
        unless q/k rows are un-permuted: blocks run along a row, so rows move whole)."""
        data = self.raw.view(np.uint8).reshape(self.shape[0], -1)
        if self.heads:
            data = np.ascontiguousarray(_unpermute_rows(data, self.heads))
        with warnings.catch_warnings():  # a read-only view: only ever read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)

    def dequantized(self) -> torch.Tensor:
        """float32, HF-shaped, what the converter did undone (a new tensor)."""
        try:
            data = dequantize(self.raw, self.ggml_type)
        except NotImplementedError as e:
            raise GGUFFormatError(
                f"{self.gguf_name}: cannot dequantize {self.ggml_type.name}: {e}") from e
        data = _as_hf(self.spec, self.gguf_name, self.name, data.reshape(self.shape),
                      self.heads, self.heads)
        return torch.from_numpy(np.array(data, dtype=np.float32, copy=True))

    def release(self) -> None:
        release_pages(self.raw)


def release_pages(array: np.ndarray) -> None:
    """Drops the whole pages under `array` (a view of a read-only file mapping) from the
    process: its RSS no longer counts them; a later read faults them in again from the
    page cache. A no-op off Linux."""
    if _LIBC is None or array.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = array.__array_interface__["data"][0]
    first, last = -(-start // page) * page, (start + array.nbytes) // page * page
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_MADV_DONTNEED = 4


def iter_gguf_tensors(reader: Any, num_heads: int,
                      num_kv_heads: int) -> Iterator[tuple[str, GGUFTensor]]:
    """Yields (HF name, GGUFTensor) for every weight of a file without stacked experts,
    one at a time, each tensor's pages released once the consumer moves on (so consume
    each before asking for the next). RoPE factors are not weights (rope_freq_factors)."""
    spec = file_architecture(reader)
    for tensor in reader.tensors:
        name = hf_name(tensor.name, spec)
        if name is None:
            continue
        if _expert_names(tensor.name, spec, 1) is not None:
            raise GGUFFormatError(f"{tensor.name}: stacked expert tensors are read by "
                                  "iter_gguf_weights")
        heads = 0
        if spec.permuted_qk and ".self_attn.q_proj." in name:
            heads = num_heads
        elif spec.permuted_qk and ".self_attn.k_proj." in name:
            heads = num_kv_heads
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest first
        source = GGUFTensor(name, tensor.name, tensor.tensor_type, shape, spec, heads,
                            tensor.data)
        yield name, source
        source.release()


def rope_freq_factors(reader: Any) -> torch.Tensor | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            return torch.from_numpy(dequantize_tensor(tensor).astype(np.float32).reshape(-1))
    return None


# ---- once per start: the file parsed once, its config cached on disk ---------------------

_CACHE_SECTION = "weights"
_ROPE_NAME = "rope_freqs"


@dataclass
class GGUFParts:
    """What loading a GGUF takes from it: the config (class name and kwargs, and the
    ModelArchConfig made of it), llama3's RoPE factors, and the parsed file, whose tensors
    the model reads in place (`tensors`). The config and the factors are read from the
    start-up cache (weight_cache) when an entry for the file's bytes exists: building the
    transformers config imports ~1 s of transformers modules (torch.distributed among
    them), which a start from the cache does on the side (`hf_config`) while the weights
    load. (The weights as the model holds them are cached by the loader, apart.)"""
    config_class: str
    config_kwargs: dict[str, Any]
    arch: ModelArchConfig
    path: str
    rope_freq_factors: torch.Tensor | None
    from_cache: bool
    architecture: GGUFArchitecture
    _reader: Any = None

    @property
    def reader(self) -> Any:
        """The parsed file (FastGGUFReader), parsed on first use: a start whose weights
        come from the start-up cache never parses it (~0.8 s for the bundled file)."""
        if self._reader is None:
            self._reader = FastGGUFReader(self.path)
        return self._reader

    def hf_config(self) -> Any:
        """The transformers config; GGUFFormatError if its arch is not the cached one."""
        config = hf_config_from_kwargs(self.config_class, self.config_kwargs)
        if ModelArchConfig.from_hf_config(config) != self.arch:
            raise GGUFFormatError("the start-up cache's model config differs from the "
                                  "file's; remove the cache directory")
        return config

    @property
    def has_experts(self) -> bool:
        return self.architecture.experts is not None

    def tensors(self) -> Iterator[tuple[str, GGUFTensor]]:
        """Every weight but stacked experts', read in place (iter_gguf_tensors)."""
        kw = self.config_kwargs
        return iter_gguf_tensors(self.reader, kw["num_attention_heads"],
                                 kw["num_key_value_heads"])

    def tensor_types(self) -> dict[str, Any]:
        """HF name -> GGMLQuantizationType of every weight `tensors` yields (no data read)."""
        spec = self.architecture
        out = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name, spec)
            if name is not None:
                out[name] = tensor.tensor_type
        return out

    def float_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight dequantized to float32, one at a time (experts split)."""
        kw = self.config_kwargs
        return iter_gguf_weights(self.reader, kw["num_attention_heads"],
                                 kw["num_key_value_heads"])


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


def load_gguf_parts(path: str) -> GGUFParts:
    """GGUFParts of the file at `path` (see GGUFParts): the file is parsed once; its config
    comes from the cache or is computed and cached. Raises GGUFFormatError / OSError /
    ValueError for a file we cannot read."""
    from aioengine.model import weight_cache

    # The installed version, without importing transformers (~1 s: done on the side later).
    kind = f"gguf-config:v2:transformers-{importlib.metadata.version('transformers')}"
    name = weight_cache.entry_name(weight_cache.file_digest(path), kind)
    entry = weight_cache.lookup(_CACHE_SECTION, name)
    if entry is not None:
        try:
            return _parts_from_entry(entry, path)
        except (OSError, ValueError, KeyError) as e:  # verified, yet unreadable: rebuild
            logger.warning("start-up cache entry %s unreadable, rebuilding it: %s", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    reader = FastGGUFReader(path)
    spec = file_architecture(reader)
    cls_name, kwargs = gguf_hf_config_kwargs(reader)
    arch = ModelArchConfig.from_hf_config(hf_config_from_kwargs(cls_name, kwargs))
    rope = rope_freq_factors(reader)
    meta = {"config_class": cls_name, "arch": _arch_json(arch),
            "config_kwargs": json.dumps(kwargs), "architecture": spec.hf_architecture}
    tensors = {} if rope is None else {_ROPE_NAME: rope}
    weight_cache.store(_CACHE_SECTION, name, kind,
                       lambda tmp: weight_cache.save_tensors(tmp, tensors, meta))
    return GGUFParts(cls_name, kwargs, arch, path, rope, from_cache=False, architecture=spec,
                     _reader=reader)


def _parts_from_entry(entry: Any, path: str) -> GGUFParts:
    from aioengine.model import weight_cache

    meta = weight_cache.read_metadata(entry)
    # A copy: a view would keep the entry's mapping alive.
    rope = next((t.clone() for _, t in weight_cache.iter_tensors(entry, _ROPE_NAME)), None)
    return GGUFParts(meta["config_class"], json.loads(meta["config_kwargs"]),
                     _arch_from_json(meta["arch"]), path, rope, from_cache=True,
                     architecture=architecture_named(meta["architecture"]))
