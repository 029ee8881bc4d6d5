"""GGUF loading on tiny files written like llama.cpp writes them (see gguf_writer.py)."""
from __future__ import annotations

import pytest
import torch
from gguf_writer import tokenizer_fields, write_tiny_gguf
from hf_compare import prefill_logits
from tiny_models import make_tiny_hf_model

from aioengine.model.gguf_arch import GGUF_ARCHITECTURES
from aioengine.model.gguf_loader import FastGGUFReader, hf_name
from aioengine.model.loader import ModelLoadError, load_model

CPU = torch.device("cpu")
VOCAB = 512  # a cut-down bundled vocabulary keeps the GGUF tokenizer quick to convert


@pytest.fixture(scope="module")
def tok_fields(bundled_gguf_path: str) -> dict:
    return tokenizer_fields(FastGGUFReader(bundled_gguf_path))


def _reference_model(arch: str, state: dict):
    hf = make_tiny_hf_model(arch, vocab_size=VOCAB)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf.eval()



@pytest.mark.parametrize("arch,gguf_arch,quantize", [
    ("llama", "llama", False),   # GQA q/k un-permutation, tied embeddings
    ("llama", "llama", True),    # Q8_0 blocks dequantized to the right shapes
    ("llama3", "llama", False),  # llama3 scaling via rope_freqs, separate output.weight
    ("qwen2", "qwen2", False),   # q/k/v biases, no permutation
    ("qwen3", "qwen3", False),   # q/k norms, head_dim from key_length
])
def test_gguf_logits_match_transformers(tmp_path, tok_fields, arch, gguf_arch, quantize) -> None:
    hf = make_tiny_hf_model(arch, vocab_size=VOCAB)
    path = tmp_path / "tiny.gguf"
    reference = _reference_model(arch, write_tiny_gguf(hf, gguf_arch, path, tok_fields, quantize))
    loaded = load_model(str(path), torch.float32, CPU)
    assert loaded.arch.vocab_size == VOCAB and loaded.max_model_len == 512
    assert loaded.arch.tie_word_embeddings == hf.config.tie_word_embeddings
    assert loaded.arch.head_dim == (32 if arch == "qwen3" else 16)
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        ref = reference(torch.tensor([tokens]), use_cache=False).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, tokens), ref, atol=1e-4, rtol=1e-5)
    # The tokenizer and chat template come from the same file.
    assert len(loaded.tokenizer) == VOCAB
    assert "<|im_start|>" in loaded.tokenizer.chat_template


def test_gguf_errors(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bad), torch.float32, CPU)
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        hf_name("blk.0.ssm_conv1d.weight", GGUF_ARCHITECTURES["llama"])


def test_unsupported_gguf_architecture(tmp_path) -> None:
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    match = "unsupported GGUF architecture 'phi2'.*llama, qwen2, qwen3"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path), torch.float32, CPU)


def test_mixtral_gguf_logits_match_transformers(tmp_path, tok_fields) -> None:
    """A llama-arch GGUF with experts (as llama.cpp writes Mixtral): stacked expert tensors
    split per expert, the router, permuted q/k; logits equal transformers' on the HF
    directory it was written from. quantization 'gguf' (Q4_1 blocks kept) is refused."""
    from gguf_family_writer import write_llama_cpp_gguf
    from transformers import AutoModelForCausalLM

    from moe_models import make_tiny_moe_dir

    model_dir = make_tiny_moe_dir("mixtral", tmp_path / "hf", seed=5, vocab_size=VOCAB)
    path = tmp_path / "mixtral.gguf"
    write_llama_cpp_gguf(model_dir, "llama", path, tok_fields)
    loaded = load_model(str(path), torch.float32, CPU)
    assert loaded.arch.architecture == "MixtralForCausalLM" and loaded.arch.moe is not None
    assert (loaded.arch.moe.num_experts, loaded.arch.moe.top_k) == (4, 2)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = reference(torch.tensor([tokens]), use_cache=False).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, tokens), ref, atol=1e-4, rtol=1e-5)
    again = load_model(str(path), torch.float32, CPU)  # from the start-up cache
    assert again.arch == loaded.arch
    assert torch.equal(prefill_logits(again.model, tokens), prefill_logits(loaded.model, tokens))
    with pytest.raises(ModelLoadError, match="does not cover a mixture of experts"):
        load_model(str(path), torch.float32, CPU, "gguf")
