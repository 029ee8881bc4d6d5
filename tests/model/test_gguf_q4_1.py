"""`quantization="gguf"`: the GGUF's own blocks (here Q4_1, and the Q8_0 of another file),
repacked at load into the any-M GEMM's panels (cpu_blocks: the same bytes) and read by it
for every row count (x quantized per 32-block); blocks left unpacked take the torch path."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_writer import tokenizer_fields, write_tiny_gguf
from hf_compare import prefill_logits
from test_fused_decode import _decode, _prefilled
from test_gguf_loader import VOCAB
from tiny_models import make_tiny_hf_model

from aioengine import LLM, SamplingParams
from aioengine.kernels import cpu_blocks, cpu_decode
from aioengine.model.gguf_loader import FastGGUFReader
from aioengine.model.layers import _q4_1_linear, dequantize_q4_1, linear
from aioengine.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def q4_1_gguf(tmp_path_factory, bundled_gguf_path: str):
    """A tiny llama (tied embeddings, GQA) written with every matrix as Q4_1."""
    path = tmp_path_factory.mktemp("q4_1") / "tiny.gguf"
    write_tiny_gguf(make_tiny_hf_model("llama", vocab_size=VOCAB), "llama", path,
                    tokenizer_fields(FastGGUFReader(bundled_gguf_path)), quantize="Q4_1")
    return str(path)


def test_blocks_dequantize_as_gguf_does_and_unpacked_take_the_torch_path() -> None:
    """dequantize_q4_1 reads the blocks as the gguf package does. Q4_1 has no row-major
    kernel (every Linear holding blocks is packed where the kernels read them: Linear.pack),
    so `linear` computes blocks left unpacked with `_q4_1_linear`."""
    w = np.random.default_rng(0).standard_normal((200, 576)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1))
    expected = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(dequantize_q4_1(blocks).numpy(), expected)
    x, bias = torch.randn(3, 576) * 2, torch.randn(200)
    assert torch.equal(linear(x, blocks, bias), _q4_1_linear(x, blocks, bias))


def test_loads_the_blocks_as_stored(q4_1_gguf: str) -> None:
    model = load_model(q4_1_gguf, torch.float32, CPU, quantization="gguf").model
    projections = [lin for layer in model.layers for lin in layer.projections()]
    assert {lin.storage for lin in projections} == {"q4_1"}
    assert all(lin.blocks is not None for lin in projections)  # GEMM_Q41P panels
    # Stored once: the panels hold the blocks' bytes (and the last panel's padding).
    blocks = sum(lin.out_features * lin.in_features // 32 * 20 for lin in projections)
    assert sum(lin.weight.numel() for lin in projections) <= 1.1 * blocks
    assert model.embed_tokens.storage == "q4_1"  # the file's type (tied: the LM head too)
    reader = FastGGUFReader(q4_1_gguf)
    v = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    qkv = model.layers[0].qkv_proj  # v's rows are the last of the fused q/k/v
    rows = cpu_blocks.unpack_blocks(qkv.weight, "q4_1", qkv.out_features, qkv.in_features)
    assert torch.equal(rows[-v.data.shape[0]:], torch.from_numpy(np.array(v.data)))
    # Against the same file dequantized: only x's per-block quantization differs.
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = prefill_logits(load_model(q4_1_gguf, torch.float32, CPU).model, tokens)
    got = prefill_logits(model, tokens)
    assert (got - ref).pow(2).mean().sqrt() < 0.05 * ref.pow(2).mean().sqrt()


@pytest.mark.parametrize("seq_lens", [[6, 17, 3], [(5 * i) % 23 + 2 for i in range(12)]])
def test_fused_decode_reads_the_blocks(q4_1_gguf: str, monkeypatch: pytest.MonkeyPatch,
                                       seq_lens: list[int]) -> None:
    """The fused decode on the Q4_1 panels, 3 rows and 12 (past the 8 of row-major
    weights): the layer path's values (the same GEMM; norms and attention may differ in
    the last bits)."""
    model = load_model(q4_1_gguf, torch.float32, CPU, quantization="gguf").model
    case = _prefilled(model, seq_lens, vocab=VOCAB)
    calls, real = [], cpu_decode.llama_decode
    monkeypatch.setattr(cpu_decode, "llama_decode",
                        lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    ours, ours_caches = _decode(model, True, *case)
    assert calls == [True]  # the fused kernel ran the step
    ref, ref_caches = _decode(model, False, *case)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    for a, b in zip(ours_caches, ref_caches):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_greedy_alone_equals_batched(q4_1_gguf: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % (VOCAB - 3) + 3 for j in range(n)]
               for i, n in enumerate((5, 23, 40, 9))]
    llm = LLM(q4_1_gguf, quantization="gguf", max_model_len=256)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    tiny = LLM(q4_1_gguf, quantization="gguf", max_model_len=256, max_num_batched_tokens=7)
    assert batched == alone == [o.outputs[0].token_ids for o in tiny.generate(prompts, params)]


def test_gguf_quantization_needs_a_gguf(tiny_model_dirs, tmp_path, bundled_gguf_path) -> None:
    """A directory is refused; a Q8_0 file keeps its Q8_0 (any type cpu_blocks runs)."""
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_model(str(tiny_model_dirs["llama"]), torch.float32, CPU, quantization="gguf")
    path = tmp_path / "q8.gguf"
    write_tiny_gguf(make_tiny_hf_model("llama", vocab_size=VOCAB), "llama", path,
                    tokenizer_fields(FastGGUFReader(bundled_gguf_path)), quantize=True)
    model = load_model(str(path), torch.float32, CPU, quantization="gguf").model
    assert {lin.storage for lin in model.linears()} == {"q8_0"}
