"""GGUF files written by us: ggml's block quantizers in numpy, llama.cpp's type mixes, and a
streaming writer (one tensor, one row chunk at a time).

Quantizers: float32 [rows, cols] -> the ggml blocks of each row, uint8 [rows, row_bytes],
vectorized over every block of the array. Layouts and the scale searches follow ggml's
reference quantizers (ggml-quants.c `quantize_row_*_ref`; no importance matrix):

    Q8_0  d f16 | qs int8[32]                      x = d * q
    Q4_0  d f16 | qs[16] (nibbles: j, j + 16)      x = d * (q - 8)
    Q4_1  d f16 | m f16 | qs[16]                   x = d * q + m
    Q5_0  d f16 | qh u32 | qs[16]                  x = d * (q - 16), bit 4 of q in qh
    Q5_1  d f16 | m f16 | qh u32 | qs[16]          x = d * q + m
    Q4_K  d f16 | dmin f16 | scales[12] | qs[128]  8 sub-blocks of 32: x = d*sc*q - dmin*m,
                                                   6-bit sc and m packed in 12 bytes
    Q5_K  as Q4_K with qh[32] (bit j of qh[i]: bit 4 of sub-block j's element i) before qs
    Q6_K  ql[128] | qh[64] | scales int8[16] | d f16   16 sub-blocks of 16: x = d*sc*(q - 32)

Rounding as ggml's: `nearest_int` is round-half-even (np.rint); Q8_0 uses C's roundf (half
away from zero); Q4_0/Q4_1/Q5_0/Q5_1 truncate x*id + 0.5 (+ offset) towards zero.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES

GROUP_MAX_EPS = 1e-15  # ggml: a sub-block whose largest |x| is below this is all zeros
QK_K = 256


def row_bytes(cols: int, qtype: T) -> int:
    """Bytes of one row of `cols` values in `qtype` (cols a multiple of its block size)."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{cols} columns are not a multiple of {qtype.name}'s block {block}")
    return cols // block * size


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """[n] or [n, 1] float32 -> [n, 2] uint8 (fp16, round to nearest even, as ggml's)."""
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: half away from zero (np.rint rounds half to even)."""
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def _signed_absmax(b: np.ndarray) -> np.ndarray:
    """Per row of `b`, the value with the largest magnitude (its sign kept), [n, 1]."""
    return np.take_along_axis(b, np.abs(b).argmax(axis=-1, keepdims=True), axis=-1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 32] values < 16 -> [n, 16]: byte j holds element j (low) and j + 16 (high)."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _high_bits(q: np.ndarray) -> np.ndarray:
    """[n, 32] 5-bit values -> [n, 4]: bit j of the little-endian u32 is bit 4 of element j."""
    bits = ((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return bits.sum(axis=-1, dtype=np.uint32).reshape(-1, 1).view(np.uint8)


# ---- 32-element blocks ----------------------------------------------------------------------

def _q8_0(b: np.ndarray) -> np.ndarray:
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)
    q = _roundf(b * _safe_inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=-1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / np.float32(-8)
    q = np.minimum(15, np.trunc(b * _safe_inverse(d) + np.float32(8.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=-1)


def _q4_1(b: np.ndarray) -> np.ndarray:
    lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = np.minimum(15, np.trunc((b - lo) * _safe_inverse(d) + np.float32(0.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=-1)


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _signed_absmax(b) / np.float32(-16)
    q = np.minimum(31, np.trunc(b * _safe_inverse(d) + np.float32(16.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _high_bits(q), _pack_nibbles(q & 15)], axis=-1)


def _q5_1(b: np.ndarray) -> np.ndarray:
    lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = np.minimum(31, np.trunc((b - lo) * _safe_inverse(d) + np.float32(0.5))).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _high_bits(q), _pack_nibbles(q & 15)],
                          axis=-1)


# ---- K-quants (256-element super-blocks) ---------------------------------------------------

def _weighted_error(x: np.ndarray, w: np.ndarray, q: np.ndarray, scale: np.ndarray,
                    lo: np.ndarray) -> np.ndarray:
    diff = scale[:, None] * q + lo[:, None] - x
    return (w * diff * diff).sum(axis=-1)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
               nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qkx2_quants over every sub-block (rows of x): x ~ scale * q - min with
    q in [0, nmax], weighted least squares over nstep + 1 trial inverse scales.
    Returns (scale [n], min [n] >= 0); a flat sub-block gives scale 0."""
    lo = np.minimum(x.min(axis=-1), 0)
    span = x.max(axis=-1) - lo
    flat = span == 0
    span = np.where(flat, 1, span)
    sum_w, sum_x = w.sum(axis=-1), (w * x).sum(axis=-1)
    iscale = nmax / span
    q = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    scale = 1 / iscale
    best = _weighted_error(x, w, q, scale, lo)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        q = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        sum_l, sum_l2, sum_xl = (w * q).sum(-1), (w * q * q).sum(-1), (w * q * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0  # ggml: the offset may only lower the values
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, 0, this_min)
        err = _weighted_error(x, w, q, np.nan_to_num(this_scale), np.nan_to_num(this_min))
        better = (det > 0) & (err < best)
        scale, lo = np.where(better, this_scale, scale), np.where(better, this_min, lo)
        best = np.where(better, err, best)
    return np.where(flat, 0, scale).astype(np.float32), (-lo).astype(np.float32)


def _pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> ggml's 12 bytes (get_scale_min_k4 reads them back)."""
    lo = (ls[:, :4] | ((ls[:, 4:] >> 4) << 6)).astype(np.uint8)
    mid = (lm[:, :4] | ((lm[:, 4:] >> 4) << 6)).astype(np.uint8)
    hi = ((ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)).astype(np.uint8)
    return np.concatenate([lo, mid, hi], axis=-1)


def _k_scales_mins(b: np.ndarray, nmax: int, rmin: float, nstep: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's two-level scales: per 32-sub-block (scale, min) from make_qkx2, then each
    quantized to 6 bits against the super-block's largest. Returns the fp16 d and dmin as
    float32 [n], and the 6-bit sc, m [n, 8]."""
    n = b.shape[0]
    sub = b.reshape(n * 8, 32)
    av = np.sqrt((sub * sub).mean(axis=-1, keepdims=True))
    scales, mins = _make_qkx2(sub, av + np.abs(sub), nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = scales.max(axis=-1), mins.max(axis=-1)
    ls = np.minimum(63, np.rint(scales * _safe_inverse(max_scale / 63)[:, None]))
    lm = np.minimum(63, np.rint(mins * _safe_inverse(max_min / 63)[:, None]))
    d = (max_scale / np.float32(63)).astype(np.float16).astype(np.float32)
    dmin = (max_min / np.float32(63)).astype(np.float16).astype(np.float32)
    return d, dmin, ls.astype(np.uint8), lm.astype(np.uint8)


def _k_levels(b: np.ndarray, d: np.ndarray, dmin: np.ndarray, ls: np.ndarray, lm: np.ndarray,
              nmax: int) -> np.ndarray:
    """The final levels [n, 8, 32] against the stored (fp16, 6-bit) scales, as ggml does."""
    sub_d = d[:, None] * ls
    sub_m = dmin[:, None] * lm
    x = b.reshape(-1, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((x + sub_m[..., None]) / sub_d[..., None])
    q = np.where(sub_d[..., None] == 0, 0, q)
    return np.clip(q, 0, nmax).astype(np.uint8)


def _q4_k(b: np.ndarray, nstep: int = 20) -> np.ndarray:
    d, dmin, ls, lm = _k_scales_mins(b, 15, -1.0, nstep)
    q = _k_levels(b, d, dmin, ls, lm, 15).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c, 2c + 1
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(ls, lm), qs], axis=-1)


def _q5_k(b: np.ndarray, nstep: int = 15) -> np.ndarray:
    d, dmin, ls, lm = _k_scales_mins(b, 31, -0.5, nstep)
    q = _k_levels(b, d, dmin, ls, lm, 31)
    qh = (((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
        axis=1, dtype=np.uint8)  # [n, 32]: bit j from sub-block j
    low = (q & 15).reshape(-1, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(ls, lm), qh, qs],
                          axis=-1)


def _make_qx(x: np.ndarray, nmax: int, search: bool) -> np.ndarray:
    """ggml's make_qx_quants (rmse_type 1: weights x^2) over every sub-block (rows of x):
    the scale of x ~ scale * q, q in [-nmax, nmax - 1], searched over 19 inverse scales."""
    peak = _signed_absmax(x)[:, 0]
    zero = np.abs(peak) < GROUP_MAX_EPS
    peak = np.where(zero, 1, peak)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = np.clip(np.rint(iscale[:, None] * x), -nmax, nmax - 1)
        return (w * x * q).sum(-1), (w * q * q).sum(-1)

    sumlx, suml2 = fit(-nmax / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, 0)
        best = scale * sumlx
        for step in (s for s in range(-9, 10) if s != 0 and search):
            sumlx, suml2 = fit(-(nmax + np.float32(0.1) * step) / peak)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, scale).astype(np.float32)


def _q6_k(b: np.ndarray, search: bool = True) -> np.ndarray:
    n = b.shape[0]
    scales = _make_qx(b.reshape(n * 16, 16), 32, search).reshape(n, 16)
    max_scale = _signed_absmax(scales)[:, 0]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = np.where(empty, 0, np.float32(-128) / np.where(empty, 1, max_scale))
    d = np.where(empty, 0, _safe_inverse(iscale)).astype(np.float16).astype(np.float32)
    sc = np.minimum(127, np.rint(iscale[:, None] * scales)).astype(np.int8)
    sub_d = d[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(b.reshape(n, 16, 16) / sub_d[..., None])
    q = (np.clip(np.where(sub_d[..., None] == 0, 0, q), -32, 31) + 32).astype(np.uint8)
    q4 = q.reshape(n, 2, 2, 64)  # element h*128 + s*64 + i -> ql[h*64 + i], nibble s
    ql = (q4[:, :, 0] & 15) | ((q4[:, :, 1] & 15) << 4)
    hi = (q.reshape(n, 2, 4, 32) >> 4) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    qh = hi.sum(axis=2, dtype=np.uint8)  # element h*128 + k*32 + i -> qh[h*32 + i], bits 2k
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           _f16_bytes(d)], axis=-1)


def _bf16(b: np.ndarray) -> np.ndarray:
    """ggml's fp32 -> bf16: round to nearest even (NaN quieted)."""
    n = b.view(np.uint32).astype(np.uint64)
    n = np.where((n & 0x7FFFFFFF) > 0x7F800000, (n & 0xFFFF0000) | (64 << 16), n)
    return ((n + (0x7FFF + ((n >> 16) & 1))) >> 16).astype(np.uint16).view(np.uint8)


_BLOCK_QUANTIZERS: dict[T, Callable[..., np.ndarray]] = {
    T.Q8_0: _q8_0, T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1,
    T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}
QUANT_TYPES = (*_BLOCK_QUANTIZERS, T.F32, T.F16, T.BF16)


def quantize(w: np.ndarray, qtype: T, refine: bool = True) -> np.ndarray:
    """float32 [rows, cols] (or [cols]) -> ggml bytes uint8 [rows, row_bytes(cols, qtype)].

    `refine=False` skips the K-quants' scale searches (plain min/max scales: faster, a little
    less accurate; the layout is the same)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows_shape = w.shape[:-1]
    w2 = w.reshape(-1, w.shape[-1])
    nbytes = row_bytes(w2.shape[1], qtype)
    if qtype == T.F32:
        out = w2.view(np.uint8)
    elif qtype == T.F16:
        out = w2.astype(np.float16).view(np.uint8)
    elif qtype == T.BF16:
        out = _bf16(w2).reshape(w2.shape[0], -1)
    else:
        block = GGML_QUANT_SIZES[qtype][0]
        fn = _BLOCK_QUANTIZERS[qtype]
        blocks = w2.reshape(-1, block)
        if qtype in (T.Q4_K, T.Q5_K):
            out = fn(blocks, nstep=(20 if qtype == T.Q4_K else 15) if refine else 0)
        elif qtype == T.Q6_K:
            out = fn(blocks, search=refine)
        else:
            out = fn(blocks)
    return np.ascontiguousarray(out).reshape(*rows_shape, nbytes)


# ---- llama.cpp's type mixes ----------------------------------------------------------------

# file type name -> (general.file_type, the type of most weight matrices)
FILE_TYPES: dict[str, tuple[LlamaFileType, T]] = {
    "F32": (LlamaFileType.ALL_F32, T.F32), "F16": (LlamaFileType.MOSTLY_F16, T.F16),
    "BF16": (LlamaFileType.MOSTLY_BF16, T.BF16), "Q8_0": (LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
    "Q4_0": (LlamaFileType.MOSTLY_Q4_0, T.Q4_0), "Q4_1": (LlamaFileType.MOSTLY_Q4_1, T.Q4_1),
    "Q4_K_M": (LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
    "Q5_K_M": (LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K),
    "Q6_K": (LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
}
# llama.cpp's tensor_type_fallback: a 256-block type on a row that 256 does not divide.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's layers that get more bits in the _M mixes: the first and last eighth, and
    every third one between."""
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def tensor_type(name: str, file_type: str, cols: int, n_layers: int,
                tied_embeddings: bool) -> T:
    """The type llama-quantize gives weight matrix `name` (llama_tensor_get_type, dense
    non-Falcon models, no imatrix, not --pure): the output matrix (the token embedding when
    tied) in Q6_K unless the file is Q8_0 or wider; in the _M mixes attn_v and ffn_down in
    Q6_K where use_more_bits holds; a 256-block type on a row 256 does not divide falls back
    to a 32-block one. 1-D tensors (norms, biases) are F32 and not decided here."""
    default = FILE_TYPES[file_type][1]
    if default in (T.F32, T.F16, T.BF16):
        return default
    qtype = default
    is_output = name == "output.weight" or (tied_embeddings and name == "token_embd.weight")
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if is_output:
        if cols % QK_K:
            return T.Q8_0
        return default if default == T.Q8_0 else T.Q6_K
    if file_type in ("Q4_K_M", "Q5_K_M") and (".attn_v." in name or ".ffn_down." in name):
        if use_more_bits(layer, n_layers):
            qtype = T.Q6_K
    if cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK.get(qtype, qtype)
    return qtype


def permute_qk_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """HF q/k rows (or biases) -> llama.cpp's order for its NORM-RoPE archs: within each head,
    HF row s*D/2 + j becomes row 2*j + s (gguf_loader._unpermute_rows is the inverse)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return (w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(rows, *w.shape[1:]))


# ---- the file --------------------------------------------------------------------------------

RowChunks = Callable[[], Iterator[np.ndarray]]


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its GGUF name, float32 shape (numpy order: [rows, cols] or
    [cols]), type, and a generator of float32 row chunks that together make it."""
    name: str
    shape: tuple[int, ...]
    qtype: T
    chunks: RowChunks

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1
        return rows * row_bytes(self.shape[-1], self.qtype)

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], row_bytes(self.shape[-1], self.qtype))


def copy_tokenizer(writer: GGUFWriter, source: GGUFReader, vocab_size: int) -> None:
    """Every `tokenizer.*` field of `source` (the chat template too), with the token list
    (and its types and scores, where present) padded with llama.cpp's reserved-token names,
    typed UNUSED, up to `vocab_size` so the vocabulary matches the embedding's rows."""
    tokens = list(source.fields["tokenizer.ggml.tokens"].contents())
    if vocab_size < len(tokens):
        raise ValueError(f"vocab {vocab_size} is smaller than the source tokenizer's "
                         f"{len(tokens)} tokens")
    pad = vocab_size - len(tokens)
    padding = {"tokenizer.ggml.tokens": [f"<|reserved_special_token_{i}|>" for i in range(pad)],
               "tokenizer.ggml.token_type": [5] * pad,  # llama_token_type UNUSED
               "tokenizer.ggml.scores": [0.0] * pad}
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key in padding:
            value = list(value) + padding[key]
        sub_type = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)


def write_gguf(path: str | Path, arch: str, metadata: Sequence[tuple[str, Any, GGUFValueType]],
               tokenizer_source: GGUFReader, vocab_size: int,
               tensors: Sequence[TensorPlan], refine: bool = True) -> None:
    """Writes the file streaming: header, metadata and every tensor's info first, then each
    tensor's data chunk by chunk, so the peak memory is one chunk's, not the model's."""
    writer = GGUFWriter(str(path), arch)
    for key, value, vtype in metadata:
        writer.add_key_value(key, value, vtype)
    copy_tokenizer(writer, tokenizer_source, vocab_size)
    for t in tensors:
        writer.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.nbytes,
                               raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    for t in tensors:
        writer.write_padding(fout, fout.tell())
        written = 0
        for chunk in t.chunks():
            data = quantize(chunk, t.qtype, refine)
            data.tofile(fout)
            written += data.nbytes
        if written != t.nbytes:
            raise RuntimeError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
        writer.write_padding(fout, written)
    writer.close()
