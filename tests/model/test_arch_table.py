"""README.md's table of supported architectures is the one the registry generates, and the
registry's claims hold where they are cheap to check here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_config

from aioengine.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig, UnsupportedModelError
from aioengine.model.registry import EAGLE_TARGET_ARCHITECTURES, architecture_support
from aioengine.spec_decode.eagle import SpeculativeConfigError, load_eagle_head

ROOT = Path(__file__).resolve().parents[2]


def test_readme_table_is_generated_from_the_registry() -> None:
    done = subprocess.run([sys.executable, "scripts/gen_arch_table.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_architecture_has_a_row() -> None:
    rows = architecture_support()
    assert [r.architecture for r in rows] == list(SUPPORTED_ARCHITECTURES)
    fused = {r.architecture: r.fused_cpu_decode for r in rows}
    assert fused["LlamaForCausalLM"] and not fused["Gemma2ForCausalLM"]
    gguf = {r.architecture: (r.gguf_file, "gguf" in r.storages) for r in rows}
    assert gguf["MistralForCausalLM"] == ("llama", False)
    assert gguf["Qwen3MoeForCausalLM"] == ("qwen3moe", False)
    assert gguf["Qwen3ForCausalLM"] == ("qwen3", True)


def test_an_unknown_architecture_is_named() -> None:
    cfg = make_tiny_config("llama")
    cfg.architectures = ["FalconForCausalLM"]
    cfg.model_type = "falcon"
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM.*Gemma3ForCausalLM"):
        ModelArchConfig.from_hf_config(cfg)


def test_eagle_heads_are_refused_for_other_families(tmp_path) -> None:
    """Fail closed: a head for a Gemma 3 target is refused before anything is read."""
    arch = ModelArchConfig.from_hf_config(make_tiny_config("gemma3"))
    assert arch.architecture not in EAGLE_TARGET_ARCHITECTURES
    import torch

    with pytest.raises(SpeculativeConfigError, match="Gemma3ForCausalLM .*ngram"):
        load_eagle_head(str(tmp_path), "eagle3", arch, torch.float32, torch.device("cpu"))
