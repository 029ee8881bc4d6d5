"""A GGUF loaded in its own types (issue 49): the projections, embedding and LM head kept as
the file's blocks where the CPU kernels run them (cpu_blocks), per tensor type, fused
slices of different types as a weight of parts, other types dequantized to the auto dtype
with one log line; the tensors read in place from the mapped file, one at a time."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import add_tokenizer, gguf_name, llama_cpp_permute, tokenizer_fields
from hf_compare import prefill_logits
from tiny_models import make_tiny_hf_model

from aioengine.kernels import cpu_blocks
from aioengine.model.gguf_loader import FastGGUFReader
from aioengine.model.loader import load_model

CPU = torch.device("cpu")
VOCAB = 512
# q and k Q4_0 with v Q8_0 (a fused q/k/v of two types), o and gate/up Q4_1, down Q8_0.
MIXED = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q4_1",
         "gate_proj": "Q4_1", "up_proj": "Q4_1", "down_proj": "Q8_0", "embed_tokens": "Q8_0"}


def write_typed_gguf(hf_model, path: Path, tok: dict, types: dict[str, str]) -> None:
    """A llama GGUF of `hf_model` whose matrices are stored in `types` (by the HF module
    name's last part, or by the full HF name; F32 where absent), as llama.cpp's converter
    lays them out (q/k rows permuted)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    add_tokenizer(w, tok, cfg.vocab_size)
    for add, value in [("add_block_count", cfg.num_hidden_layers),
                       ("add_context_length", cfg.max_position_embeddings),
                       ("add_embedding_length", cfg.hidden_size),
                       ("add_feed_forward_length", cfg.intermediate_size),
                       ("add_head_count", cfg.num_attention_heads),
                       ("add_head_count_kv", cfg.num_key_value_heads),
                       ("add_layer_norm_rms_eps", cfg.rms_norm_eps)]:
        getattr(w, add)(value)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        qtype = types.get(name) or types.get(name.split(".")[-2]) if data.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data))
        elif qtype == "F16":
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tok(bundled_gguf_path: str) -> dict:
    return tokenizer_fields(FastGGUFReader(bundled_gguf_path))


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, tok) -> str:
    path = tmp_path_factory.mktemp("native") / "mixed.gguf"
    write_typed_gguf(make_tiny_hf_model("llama", vocab_size=VOCAB), path, tok, MIXED)
    return str(path)


def _file_blocks(path: str, gguf_tensor: str) -> torch.Tensor:
    t = next(t for t in FastGGUFReader(path).tensors if t.name == gguf_tensor)
    return torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(t.data.shape[0], -1)


def test_native_load_keeps_each_tensor_in_its_type(mixed_gguf: str) -> None:
    model = load_model(mixed_gguf, torch.bfloat16, CPU, native_gguf=True).model
    layer = model.layers[0]
    assert layer.qkv_proj.storage == "mixed:q4_0+q8_0"
    assert [(p.block_type, p.rows) for p in layer.qkv_proj.blocks.parts] == [
        ("q4_0", 64 + 32), ("q8_0", 32)]  # q and k one part, v its own
    assert (layer.o_proj.storage, layer.gate_up_proj.storage, layer.down_proj.storage) == (
        "q4_1", "q4_1", "q8_0")
    assert model.embed_tokens.storage == "q8_0" and model.lm_head is model.embed_tokens
    assert layer.qkv_proj.kernel_format is None  # no single format: a weight of parts
    assert layer.o_proj.kernel_format == cpu_blocks.BLOCK_TYPES["q4_1"].code
    assert model.norm.dtype == layer.input_layernorm.dtype == torch.float32
    # The file's bytes, packed: unpacking gives them back (k's rows un-permuted whole).
    qkv, k_rows = layer.qkv_proj, (64, 96)
    part = qkv.blocks.parts[0]
    ours = cpu_blocks.unpack_blocks(qkv.weight[part.offset:part.offset + part.nbytes],
                                    "q4_0", part.rows, 64)
    k_file = _file_blocks(mixed_gguf, "blk.0.attn_k.weight")
    assert torch.equal(ours[k_rows[0]:k_rows[1]],
                       torch.from_numpy(np.ascontiguousarray(
                           _unpermute(k_file.numpy(), 2))))
    v = qkv.blocks.parts[1]
    assert torch.equal(cpu_blocks.unpack_blocks(qkv.weight[v.offset:v.offset + v.nbytes],
                                                "q8_0", 32, 64),
                       _file_blocks(mixed_gguf, "blk.0.attn_v.weight"))
    # Stored once: the packed bytes are the file's blocks (Q4_K/Q5_K scales aside).
    lins = model.linears()
    file_bytes = sum(t.n_bytes for t in FastGGUFReader(mixed_gguf).tensors if len(t.shape) == 2)
    assert sum(lin.weight.numel() for lin in lins) <= 1.1 * file_bytes


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)


def test_native_logits_match_the_dequantized_load(mixed_gguf: str) -> None:
    """The same file dequantized to float32 (an explicit dtype keeps that path): only x's
    per-32-block int8 quantization differs."""
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref_model = load_model(mixed_gguf, torch.float32, CPU).model
    assert {lin.storage for lin in ref_model.linears()} == {"float32"}
    ref = prefill_logits(ref_model, tokens)
    got = prefill_logits(load_model(mixed_gguf, torch.bfloat16, CPU, native_gguf=True).model,
                         tokens)
    assert (got - ref).pow(2).mean().sqrt() < 0.05 * ref.pow(2).mean().sqrt()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_types_not_run_natively_are_dequantized_with_one_log_line(
        tmp_path, tok, caplog: pytest.LogCaptureFixture) -> None:
    """Q5_0 gate (so the fused gate/up, whose up is Q4_1, goes whole), an F16 down: bf16,
    named in one line; the rest stays in blocks."""
    path = tmp_path / "q5_0.gguf"
    types = dict(MIXED, **{"model.layers.0.mlp.gate_proj.weight": "Q5_0",
                           "model.layers.1.mlp.down_proj.weight": "F16"})
    write_typed_gguf(make_tiny_hf_model("llama", vocab_size=VOCAB), path, tok, types)
    with caplog.at_level(logging.INFO, logger="aioengine.model.loader"):
        model = load_model(str(path), torch.bfloat16, CPU, native_gguf=True).model
    lines = [r.getMessage() for r in caplog.records if "not run natively" in r.getMessage()]
    assert lines == ["dequantized to bfloat16 (not run natively): Q5_0 x 1, Q4_1 x 1, F16 x 1"]
    assert model.layers[0].gate_up_proj.storage == "bfloat16"
    assert model.layers[1].down_proj.storage == "bfloat16"
    assert model.layers[1].gate_up_proj.storage == "q4_1"
    assert model.layers[0].down_proj.storage == "q8_0"
    ref = load_model(str(path), torch.float32, CPU).model
    tokens = list(range(3, 40))
    got, want = prefill_logits(model, tokens), prefill_logits(ref, tokens)
    assert (got - want).pow(2).mean().sqrt() < 0.05 * want.pow(2).mean().sqrt()


# Python that loads a GGUF natively and prints its RSS before, at peak and after (kB).
_RSS_SCRIPT = """
import json, sys, torch
from aioengine.model.loader import load_model
import transformers, aioengine.kernels.cpu_blocks  # imports before the baseline
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
base = status("VmRSS:")
loaded = load_model(sys.argv[1], torch.bfloat16, torch.device("cpu"), native_gguf=True)
print(json.dumps({"base": base, "peak": status("VmHWM:"), "after": status("VmRSS:"),
                  "weights": loaded.model.weight_bytes() // 1024}))
"""


@pytest.mark.slow
def test_load_peak_rss_is_close_to_what_stays_resident(tmp_path, tok) -> None:
    """A ~100 MB Q8_0/Q4_0 file loads in a fresh process whose RSS grows at the peak at most
    1.25x what it keeps (the file's pages dropped as each tensor is packed, no float copy);
    the weights it keeps are at most 1.1x the file."""
    path = tmp_path / "mid.gguf"
    hf = make_tiny_hf_model("llama", vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4)
    types = {"q_proj": "Q4_0", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "Q8_0",
             "gate_proj": "Q8_0", "up_proj": "Q8_0", "down_proj": "Q8_0", "embed_tokens": "Q8_0"}
    write_typed_gguf(hf, path, tok, types)
    del hf
    env_cache = {"AIOENGINE_CACHE_DIR": str(tmp_path / "cache")}
    import os
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(path)], capture_output=True,
                         text=True, check=True, env={**os.environ, **env_cache})
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    file_kb = path.stat().st_size / 1024
    assert rss["weights"] <= 1.1 * file_kb
    grown_peak, grown_after = rss["peak"] - rss["base"], rss["after"] - rss["base"]
    assert grown_peak <= 1.25 * grown_after, rss


def test_second_load_reads_the_packed_weights_from_the_cache(
        mixed_gguf: str, tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    """The start-up cache keeps what the model holds (panels of blocks, float32 norms):
    a second load reads them into place (no repacking) and computes the same logits."""
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    tokens = list(range(3, 40))
    first = load_model(mixed_gguf, torch.bfloat16, CPU, native_gguf=True).model
    with caplog.at_level(logging.DEBUG, logger="aioengine.model.loader"):
        again = load_model(mixed_gguf, torch.bfloat16, CPU, native_gguf=True).model
    assert any("GGUF weights read from the start-up cache" in r.getMessage()
               for r in caplog.records)
    assert ([lin.storage for lin in again.linears()]
            == [lin.storage for lin in first.linears()])
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(again.linears(), first.linears()))
    assert torch.equal(prefill_logits(again, tokens), prefill_logits(first, tokens))
    # Another storage is another entry: an explicit float32 load dequantizes.
    assert {lin.storage for lin in load_model(mixed_gguf, torch.float32, CPU).model.linears()
            } == {"float32"}
