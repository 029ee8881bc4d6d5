"""Loading PEFT adapters: what is refused, with an error naming it, and that a refused
adapter leaves nothing behind."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from aioengine.errors import NotFoundError
from aioengine.lora import LoRARequest
from aioengine.lora.adapter import LoRAError, LoRANotFoundError
from aioengine.lora.manager import LoRAConfig, LoRAManager
from aioengine.model.loader import load_model
from tests.lora_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_model_dir


@pytest.fixture(scope="module")
def manager(lora_model_dir: Path) -> LoRAManager:
    cpu = torch.device("cpu")
    manager = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=8), cpu, torch.float32)
    load_model(str(lora_model_dir), torch.float32, cpu, linear_factory=manager.linear_factory,
               lora_source=manager)
    return manager


def _refused(manager: LoRAManager, path: Path, error: type, match: str) -> None:
    before = (manager.get_stats(), [r.lora_name for r in manager.list_loras()])
    with pytest.raises(error, match=match):
        manager.add(LoRARequest("bad", str(path)))
    assert manager.get("bad") is None
    assert (manager.get_stats(), [r.lora_name for r in manager.list_loras()]) == before


def _peft(lora_model_dir, tmp_path, name, **kw) -> Path:
    kw.setdefault("r", 4)
    kw.setdefault("target_modules", ["q_proj"])
    return make_peft_adapter(lora_model_dir, tmp_path / name, **kw)


def test_unsupported_modules(manager, lora_model_dir, tmp_path) -> None:
    path = _peft(lora_model_dir, tmp_path, "emb", target_modules=["q_proj", "embed_tokens"])
    _refused(manager, path, LoRAError, "embed_tokens")
    path = _peft(lora_model_dir, tmp_path, "head", target_modules=["lm_head"])
    _refused(manager, path, LoRAError, "lm_head")
    path = _peft(lora_model_dir, tmp_path, "dora", use_dora=True)
    _refused(manager, path, LoRAError, "DoRA")


def test_rank_above_the_limit(manager, lora_model_dir, tmp_path) -> None:
    _refused(manager, _peft(lora_model_dir, tmp_path, "r16", r=16), LoRAError,
             "rank 16 of layers.0.q_proj is above max_lora_rank 8")


def test_other_base_model(manager, tmp_path) -> None:
    other = make_tiny_model_dir("llama", tmp_path / "other", hidden_size=32)
    _refused(manager, _peft(other, tmp_path, "other"), LoRAError, "different base model")


def test_missing_and_corrupt_files(manager, lora_model_dir, tmp_path) -> None:
    _refused(manager, tmp_path / "nowhere", LoRANotFoundError, "no LoRA adapter directory")
    good = _peft(lora_model_dir, tmp_path, "good")
    for name, damage, error, match in [
        ("no-weights", lambda p: (p / "adapter_model.safetensors").unlink(), LoRANotFoundError,
         "no adapter_model.safetensors"),
        ("no-config", lambda p: (p / "adapter_config.json").unlink(), LoRANotFoundError,
         "no adapter_config.json"),
        ("truncated", lambda p: _truncate(p / "adapter_model.safetensors"), LoRAError,
         "cannot be read"),
        ("bad-json", lambda p: (p / "adapter_config.json").write_text("{r: 4"), LoRAError,
         "not valid JSON"),
        ("bias", lambda p: _edit_config(p, bias="all"), LoRAError, "trained biases"),
        ("saved-modules", lambda p: _edit_config(p, modules_to_save=["lm_head"]), LoRAError,
         "modules_to_save"),
    ]:
        path = tmp_path / name
        shutil.copytree(good, path)
        damage(path)
        _refused(manager, path, error, match)
    assert issubclass(LoRANotFoundError, NotFoundError)


def test_loads_and_reports_memory(manager, lora_model_dir, tmp_path) -> None:
    path = _peft(lora_model_dir, tmp_path, "ok", r=8, target_modules=["q_proj", "down_proj"])
    registered = manager.add(LoRARequest("ok", str(path)))
    try:
        assert registered.lora_int_id > 0 and manager.get("ok") is registered
        with pytest.raises(LoRAError, match="already been loaded"):
            manager.add(LoRARequest("ok", str(path)))
        # A and B of q_proj and down_proj of both layers, float32.
        arch = manager.layers[0]["qkv_proj"]
        q = 8 * arch.in_features + arch.slice_sizes[0] * 8
        down = manager.layers[0]["down_proj"]
        d = 8 * down.in_features + down.out_features * 8
        assert manager.get_stats()["lora_cpu_bytes"] == 2 * (q + d) * 4
    finally:
        manager.remove("ok")


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _edit_config(path: Path, **changes) -> None:
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))
