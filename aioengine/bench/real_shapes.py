"""Models at the shapes people download, with seeded random weights, written as GGUF files.

    python -m aioengine.bench.real_shapes SHAPE TYPE OUT.gguf [--seed 0] [--plain]

SHAPE is a key of SHAPES, TYPE a key of gguf_writer.FILE_TYPES (Q4_K_M, Q8_0, ...). The
shapes are the published configs (config.json) of each model; the weights are normal with
a trained model's std (0.02; norms 1), so the speed of every kernel is the real model's
while the tokens it writes are noise. The tokenizer is the bundled SmolLM2's, its token list
padded to the shape's vocabulary. Tensors are generated, quantized and written a row chunk
at a time: writing the 8B shape needs about one chunk of memory, not the model's.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType

from aioengine.bench.gguf_writer import (FILE_TYPES, RowChunks, TensorPlan, permute_qk_rows,
                                         tensor_type, write_gguf)

WEIGHT_STD = 0.02  # HF's initializer_range for these families
CHUNK_ELEMENTS = 1 << 22  # float32 values generated and quantized at a time (16 MiB)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1+'s rope_scaling (rope_type llama3), written as llama.cpp's rope_freqs."""
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shape, as its config.json gives it. `arch` is llama.cpp's:
    "llama" (q/k rows permuted), "qwen2" (q/k/v biases), "qwen3" (q/k RMSNorms)."""
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float
    context: int
    rope_scaling: Llama3RopeScaling | None = None


SHAPES: dict[str, ModelShape] = {
    "llama3.2-1b": ModelShape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0,
                              1e-5, 131072, Llama3RopeScaling(32.0)),
    "llama3.2-3b": ModelShape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0,
                              1e-5, 131072, Llama3RopeScaling(32.0)),
    "llama3.1-8b": ModelShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0,
                              1e-5, 131072, Llama3RopeScaling(8.0)),
    "qwen2.5-0.5b": ModelShape("qwen2", 896, 24, 14, 2, 64, 4864, 151936, True, 1000000.0,
                               1e-6, 32768),
    "qwen2.5-1.5b": ModelShape("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True, 1000000.0,
                               1e-6, 32768),
    "qwen3-0.6b": ModelShape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1000000.0,
                             1e-6, 40960),
    "qwen3-1.7b": ModelShape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1000000.0,
                             1e-6, 40960),
    # Issue 49's "big 1B": SmolLM2's vocabulary and RoPE base at Llama 3.2 1B's body.
    "big1b": ModelShape("llama", 2048, 16, 32, 8, 64, 8192, 49152, True, 100000.0,
                        1e-5, 8192),
}


def llama3_rope_factors(shape: ModelShape) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs.weight for
    rope_type llama3 (long wavelengths slowed by `factor`, short ones kept, a smooth ramp
    between)."""
    s = shape.rope_scaling
    assert s is not None
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2) / shape.head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    ramp = 1 / ((1 - smooth) / s.factor + smooth)
    factors = np.where(wavelen < s.original_context / s.high_freq_factor, 1.0,
                       np.where(wavelen > s.original_context / s.low_freq_factor, s.factor, ramp))
    return factors.astype(np.float32)


def _random_chunks(shape: tuple[int, ...], seed: int, index: int, row_align: int,
                   permute: bool = False) -> Iterator[np.ndarray]:
    """The tensor's N(0, WEIGHT_STD) values in row chunks of whole heads (`row_align` rows);
    rows permuted to llama.cpp's q/k order when `permute` (row_align is then head_dim). Seeded per tensor,
    so a tensor's values do not depend on the file type or the other tensors."""
    rng = np.random.default_rng([seed, index])
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    step = max(row_align, CHUNK_ELEMENTS // cols // row_align * row_align)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        chunk = rng.standard_normal((n, cols), dtype=np.float32)
        chunk *= np.float32(WEIGHT_STD)
        if permute:
            chunk = permute_qk_rows(chunk, n // row_align)
        yield chunk.reshape(shape) if len(shape) == 1 else chunk


def _constant(shape: tuple[int, ...], value: np.ndarray | float) -> RowChunks:
    def chunks() -> Iterator[np.ndarray]:
        yield np.broadcast_to(np.asarray(value, np.float32), shape).copy()
    return chunks


def _matrix(name: str, shape: tuple[int, ...], qtype: T, seed: int, index: int,
            row_align: int = 1, permute: bool = False) -> TensorPlan:
    return TensorPlan(name, shape, qtype, lambda: _random_chunks(
        shape, seed, index, row_align, permute))


def _layer_tensors(s: ModelShape, file_type: str, layer: int, seed: int) -> list[TensorPlan]:
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    permute = s.arch == "llama"  # NORM RoPE: the converter interleaves each head's q/k rows
    weights = {  # name -> (rows, cols, row_align = one head where rows are heads)
        "attn_q": (q_rows, s.hidden, s.head_dim), "attn_k": (kv_rows, s.hidden, s.head_dim),
        "attn_v": (kv_rows, s.hidden, 1), "attn_output": (s.hidden, q_rows, 1),
        "ffn_gate": (s.intermediate, s.hidden, 1), "ffn_up": (s.intermediate, s.hidden, 1),
        "ffn_down": (s.hidden, s.intermediate, 1)}
    out = []
    for i, (base, (rows, cols, align)) in enumerate(weights.items()):
        name = f"blk.{layer}.{base}.weight"
        qtype = tensor_type(name, file_type, cols, s.layers, s.tied)
        out.append(_matrix(name, (rows, cols), qtype, seed, 1000 * (layer + 1) + i, align,
                           permute=permute and base in ("attn_q", "attn_k")))
    for i, (base, rows) in enumerate((("attn_q", q_rows), ("attn_k", kv_rows),
                                      ("attn_v", kv_rows))):
        if s.arch == "qwen2":
            out.append(_matrix(f"blk.{layer}.{base}.bias", (rows,), T.F32, seed,
                               1000 * (layer + 1) + 100 + i))
    norms = ["attn_norm", "ffn_norm"] + (["attn_q_norm", "attn_k_norm"]
                                         if s.arch == "qwen3" else [])
    for base in norms:
        width = s.head_dim if base in ("attn_q_norm", "attn_k_norm") else s.hidden
        out.append(TensorPlan(f"blk.{layer}.{base}.weight", (width,), T.F32,
                              _constant((width,), 1.0)))
    return out


def tensor_plans(s: ModelShape, file_type: str, seed: int) -> list[TensorPlan]:
    """Every tensor of the model in llama.cpp's order and names, typed by `file_type`."""
    embd = "token_embd.weight"
    plans = [_matrix(embd, (s.vocab, s.hidden), tensor_type(embd, file_type, s.hidden,
                                                             s.layers, s.tied), seed, 0)]
    if s.rope_scaling is not None:
        factors = llama3_rope_factors(s)
        plans.append(TensorPlan("rope_freqs.weight", factors.shape, T.F32,
                                _constant(factors.shape, factors)))
    for layer in range(s.layers):
        plans += _layer_tensors(s, file_type, layer, seed)
    plans.append(TensorPlan("output_norm.weight", (s.hidden,), T.F32, _constant((s.hidden,), 1.0)))
    if not s.tied:
        plans.append(_matrix("output.weight", (s.vocab, s.hidden), tensor_type(
            "output.weight", file_type, s.hidden, s.layers, s.tied), seed, 1))
    return plans


def model_metadata(s: ModelShape, name: str, file_type: str
                   ) -> list[tuple[str, object, GGUFValueType]]:
    a, u32, f32 = s.arch, GGUFValueType.UINT32, GGUFValueType.FLOAT32
    meta: list[tuple[str, object, GGUFValueType]] = [
        ("general.type", "model", GGUFValueType.STRING),
        ("general.name", f"{name} random weights", GGUFValueType.STRING),
        (f"{a}.block_count", s.layers, u32), (f"{a}.context_length", s.context, u32),
        (f"{a}.embedding_length", s.hidden, u32),
        (f"{a}.feed_forward_length", s.intermediate, u32),
        (f"{a}.attention.head_count", s.heads, u32),
        (f"{a}.attention.head_count_kv", s.kv_heads, u32),
        (f"{a}.attention.key_length", s.head_dim, u32),
        (f"{a}.attention.value_length", s.head_dim, u32),
        (f"{a}.rope.dimension_count", s.head_dim, u32),
        (f"{a}.rope.freq_base", s.rope_theta, f32),
        (f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps, f32),
        (f"{a}.vocab_size", s.vocab, u32),
        ("general.file_type", int(FILE_TYPES[file_type][0]), u32),
        ("general.quantization_version", 2, u32),
    ]
    return meta


def write_model(shape: str | ModelShape, file_type: str, path: str | Path, seed: int = 0,
                tokenizer_gguf: str | None = None, refine: bool = True) -> Path:
    """Writes `shape` (a SHAPES key, or a ModelShape) with seeded random weights as a
    `file_type` GGUF at `path`; the tokenizer is `tokenizer_gguf`'s (the bundled SmolLM2's
    by default); `refine=False`: the K-quants' plain min/max scales (gguf_writer.quantize).
    Returns the path."""
    from aioengine.model.default import bundled_model_path

    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    name = shape if isinstance(shape, str) else "custom"
    s = SHAPES[shape] if isinstance(shape, str) else shape
    source = GGUFReader(tokenizer_gguf or bundled_model_path())
    write_gguf(path, s.arch, model_metadata(s, name, file_type), source, s.vocab,
               tensor_plans(s, file_type, seed), refine=refine)
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aioengine.bench.real_shapes",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("type", choices=list(FILE_TYPES))
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plain", action="store_true",
                   help="K-quants without ggml's scale search (faster to write)")
    args = p.parse_args(argv)
    print(write_model(args.shape, args.type, args.out, args.seed, refine=not args.plain))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
