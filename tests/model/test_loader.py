"""Loading Hugging Face directories (plain and sharded) and every loader error."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model_dir

from aioengine.model.loader import (ModelLoadError, load_model, load_tokenizer,
                                    resolve_model_path, safetensors_files)

CPU = torch.device("cpu")


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, tiny_model_dirs,
                                                       bundled_tokenizer) -> None:
    sharded = make_tiny_model_dir("qwen2", tmp_path / "sharded", max_shard_size="200KB",
                                  tokenizer=bundled_tokenizer)
    assert len(safetensors_files(str(sharded))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(str(sharded), torch.float32, CPU)
    b = load_model(str(tiny_model_dirs["qwen2"]), torch.float32, CPU)
    wa, wb = _weights(a.model), _weights(b.model)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_loaded_model_fields(tiny_model_dirs) -> None:
    loaded = load_model(str(tiny_model_dirs["llama3"]), torch.float32, CPU)
    assert loaded.model_path == str(tiny_model_dirs["llama3"])
    assert loaded.arch.architecture == "LlamaForCausalLM" and loaded.max_model_len == 512
    assert loaded.hf_config.eos_token_id == 2
    assert loaded.tokenizer.chat_template and len(loaded.tokenizer) == 49152
    assert load_tokenizer(str(tiny_model_dirs["llama3"])).encode("hello world") == \
        loaded.tokenizer.encode("hello world")


def test_bfloat16_load(tiny_model_dirs) -> None:
    """On the CPU bf16 is the projections' and embedding's storage; norms, RoPE tables and
    the activations stay float32."""
    model = load_model(str(tiny_model_dirs["qwen3"]), torch.bfloat16, CPU).model
    assert all(lin.weight.dtype == torch.bfloat16 for lin in model.linears())
    assert model.dtype == torch.float32 and model.norm.dtype == torch.float32
    assert model.layers[0].q_norm.dtype == torch.float32


@pytest.mark.parametrize("dtype,quantization,itemsize", [(torch.float32, None, 4),
                                                         (torch.bfloat16, None, 2),
                                                         (torch.float32, "int8", 1)])
def test_resident_weight_bytes(tiny_model_dirs, dtype, quantization, itemsize) -> None:
    """Weights take their storage's bytes, and no more than 1.1x of them in all, float32
    included: with the CPU kernels built every projection is repacked in place into the
    GEMM's panels (no second, oneDNN-packed copy)."""
    model = load_model(str(tiny_model_dirs["llama"]), dtype, CPU, quantization).model
    own = sum(lin.in_features * lin.out_features for lin in model.linears()) * itemsize
    if cpu_kernels.load() is not None:
        projections = [lin for layer in model.layers for lin in layer.projections()]
        assert all(lin.is_packed and lin.packed is None for lin in projections)
    assert own <= model.weight_bytes() <= 1.1 * own


def test_bad_dtype_names_supported() -> None:
    with pytest.raises(ModelLoadError, match="float32, float16, bfloat16"):
        load_model(None, torch.int8, CPU)


def test_missing_path(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope"), torch.float32, CPU)


def test_file_that_is_not_gguf(tmp_path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        load_model(str(f), torch.float32, CPU)


def test_directory_without_config(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_directory_with_one_gguf_resolves_to_it(tmp_path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path / "m.gguf")
    (tmp_path / "n.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several .gguf"):
        resolve_model_path(str(tmp_path))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_no_weights_and_pickle_refused(tmp_path, tiny_model_dirs) -> None:
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors"):
        load_model(str(d), torch.float32, CPU)
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are not loaded"):
        load_model(str(d), torch.float32, CPU)


def test_missing_tokenizer(tmp_path, tiny_model_dirs) -> None:
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer"):
        load_model(str(d), torch.float32, CPU)


def test_default_model_override_is_validated(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AIOENGINE_DEFAULT_MODEL", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(None, torch.float32, CPU)


def test_missing_tensor_and_missing_shard(tmp_path, tiny_model_dirs) -> None:
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing 1 weight\(s\): layers.1.gate_up_proj"):
        load_model(str(d), torch.float32, CPU)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(d), torch.float32, CPU)


def test_unexpected_tensor(tmp_path, tiny_model_dirs) -> None:
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # llama has no bias
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected weight"):
        load_model(str(d), torch.float32, CPU)


def test_unsupported_architecture(tmp_path, tiny_model_dirs) -> None:
    d = _copy(tiny_model_dirs["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GemmaForCausalLM"], model_type="gemma")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GemmaForCausalLM.*supported: LlamaForCausalLM"):
        load_model(str(d), torch.float32, CPU)
