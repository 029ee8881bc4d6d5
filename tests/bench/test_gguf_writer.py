"""Our GGUF writer: each quantizer against gguf's dequantizer (and ggml's own quantizer where
built), llama.cpp's type mix, and tiny random-weight files that our engine and llama.cpp
read."""
from __future__ import annotations

import ctypes
import dataclasses
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from aioengine.bench.gguf_writer import (QUANT_TYPES, permute_qk_rows, quantize, row_bytes,
                                         use_more_bits)
from aioengine.bench.real_shapes import SHAPES, ModelShape, write_model
from aioengine.model.gguf_loader import _unpermute_rows

LLAMA_BIN = Path("/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
# RMS of (dequantize(quantize(w)) - w) / RMS(w) for normal weights: a few times below each
# type's step (4 bits ~ 1/15 of a block's range, ...), far above a wrong layout's ~1.4.
RMS_BOUND = {T.Q8_0: 0.01, T.Q4_0: 0.12, T.Q4_1: 0.11, T.Q5_0: 0.06, T.Q5_1: 0.055,
             T.Q4_K: 0.10, T.Q5_K: 0.05, T.Q6_K: 0.025, T.F32: 0.0, T.F16: 1e-3, T.BF16: 5e-3}
TINY = ModelShape("llama", 256, 8, 4, 2, 64, 512, 49152 + 64, True, 10000.0, 1e-5, 2048)


def _weights(rows: int = 16, cols: int = 512, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32) * 0.02
    w[1, :256] = 0  # an all-zero block and super-block
    w[2, :256] = 0.01  # a flat one
    w[3] = -np.abs(w[3])  # all negative: a K-quant min below zero, no positive values
    return w


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_round_trip_through_gguf_dequantize(qtype: T) -> None:
    w = _weights()
    data = quantize(w, qtype)
    assert data.dtype == np.uint8 and data.shape == (16, row_bytes(512, qtype))
    back = dequantize(data, qtype)
    assert back.shape == w.shape
    assert np.all(back[1, :256] == 0)
    rms = np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2))
    assert rms <= RMS_BOUND[qtype], rms


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16],
                         ids=lambda t: t.name)
def test_bytes_equal_gguf_quantize(qtype: T) -> None:
    w = _weights(seed=1)
    np.testing.assert_array_equal(quantize(w, qtype), gguf_quantize(w, qtype))


def _ggml_quantize(w: np.ndarray, qtype: T) -> np.ndarray:
    """ggml's own quantizer (ggml_quantize_chunk, no importance matrix) from the built
    library."""
    lib = ctypes.CDLL(str(LLAMA_BIN / "libggml-base.so"))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    out = np.zeros((w.shape[0], row_bytes(w.shape[1], qtype)), np.uint8)
    fn(int(qtype), w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None)
    return out


@pytest.mark.skipif(not (LLAMA_BIN / "libggml-base.so").exists(), reason="ggml not built")
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K,
                                   T.Q6_K], ids=lambda t: t.name)
def test_bytes_match_ggml(qtype: T) -> None:
    """32-blocks: identical bytes. K-quants: ggml sums in another order, so a trial scale
    at a tie can go the other way; most bytes still agree and the values barely differ."""
    w = _weights(64, 1024, seed=2)
    ours, ref = quantize(w, qtype), _ggml_quantize(w, qtype)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        assert (ours == ref).mean() > 0.9
        diff = dequantize(ours, qtype) - dequantize(ref, qtype)
        assert np.sqrt(np.mean(diff ** 2) / np.mean(w ** 2)) < RMS_BOUND[qtype] / 2
    else:
        np.testing.assert_array_equal(ours, ref)


def test_plain_k_quants_keep_the_layout() -> None:
    w = _weights(seed=3)
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        back = dequantize(quantize(w, qtype, refine=False), qtype)
        assert np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2)) <= RMS_BOUND[qtype] * 1.3


def test_qk_permutation_is_the_loaders_inverse() -> None:
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    permuted = permute_qk_rows(w, 8)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(_unpermute_rows(permuted, 8), w)
    # llama.cpp's order: head 0's rows 0, 32, 1, 33, ...
    assert list(permuted[:4, 0] // 3) == [0, 32, 1, 33]


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_q4_k_m_mix(tmp_path: Path) -> None:
    path = write_model(TINY, "Q4_K_M", tmp_path / "m.gguf")
    types = _types(path)
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert types["token_embd.weight"] == "Q6_K"  # tied: quantized as the output
    assert "output.weight" not in types
    for i in range(8):
        more = "Q6_K" if i in (0, 3, 6, 7) else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == more
        assert types[f"blk.{i}.ffn_down.weight"] == more
        for base in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{base}.weight"] == "Q4_K"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == TINY.vocab and tokens[-1] == "<|reserved_special_token_63|>"
    assert reader.fields["tokenizer.chat_template"].contents()


def test_fallback_types_on_rows_256_does_not_divide(tmp_path: Path) -> None:
    """Qwen2.5-0.5B's hidden 896 is not a multiple of 256: llama.cpp's Q4_K -> Q5_0 and
    Q6_K -> Q8_0 (the tied embedding) fallbacks; the 1024-wide ffn_down keeps Q6_K/Q4_K."""
    shape = dataclasses.replace(TINY, arch="qwen2", hidden=384, heads=6, intermediate=1024)
    types = _types(write_model(shape, "Q4_K_M", tmp_path / "q.gguf"))
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.1.attn_q.weight"] == "Q5_0" and types["blk.0.attn_v.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_q.bias"] == "F32"


def test_real_shapes_table() -> None:
    s = SHAPES["llama3.2-1b"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab) == (
        2048, 16, 32, 8, 8192, 128256)
    for shape in SHAPES.values():
        assert shape.heads % shape.kv_heads == 0 and shape.vocab >= 49152


@pytest.fixture(scope="module")
def tiny_q8_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(TINY, "Q8_0", tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", seed=7)


def test_loader_reads_the_hf_weights_back(tiny_q8_0: Path) -> None:
    """The loader's un-permuted q rows are the generated (HF-order) values: the writer's
    permutation is the one llama.cpp's converter applies."""
    from aioengine.bench.real_shapes import WEIGHT_STD
    from aioengine.model.gguf_loader import iter_gguf_weights

    weights = dict(iter_gguf_weights(gguf.GGUFReader(tiny_q8_0), TINY.heads, TINY.kv_heads))
    q = weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    rng = np.random.default_rng([7, 1000])  # blk.0's first tensor (real_shapes' seeding)
    expected = rng.standard_normal(q.shape, dtype=np.float32) * np.float32(WEIGHT_STD)
    assert np.abs(q - expected).max() < 0.01 * np.abs(expected).max()


def test_engine_generates_from_a_written_file(tiny_q8_0: Path) -> None:
    from aioengine import LLM, SamplingParams

    llm = LLM(model=str(tiny_q8_0), max_model_len=128)
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=6, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 6 and all(0 <= t < TINY.vocab for t in ids)


@pytest.mark.slow
@pytest.mark.skipif(not (LLAMA_BIN / "llama-quantize").exists(), reason="llama.cpp not built")
def test_llama_quantize_reads_our_file_and_picks_our_types(tiny_q8_0: Path,
                                                           tmp_path: Path) -> None:
    """llama-quantize loads our Q8_0 file and, asked for Q4_K_M, gives every tensor the type
    our Q4_K_M writer gives it."""
    out = tmp_path / "requant.gguf"
    subprocess.run([str(LLAMA_BIN / "llama-quantize"), "--allow-requantize", str(tiny_q8_0),
                    str(out), "Q4_K_M", "2"], check=True, capture_output=True, timeout=300)
    ours = write_model(TINY, "Q4_K_M", tmp_path / "ours.gguf", seed=7)
    assert _types(out) == _types(ours)
