"""Random PEFT LoRA adapters for the tiny models of tiny_models.py, written with `peft` itself
(the reference the engine is tested against).

    path = make_peft_adapter(model_dir, tmp_path / "a", r=4, target_modules=["q_proj"])
"""
from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(model_dir: Path, path: Path, *, r: int, target_modules: list[str],
                      lora_alpha: float = 16.0, use_rslora: bool = False, seed: int = 0,
                      scale: float = 0.3, **lora_config: object) -> Path:
    """Saves a LoRA adapter for the HF model at `model_dir` whose A and B are random (peft
    starts B at zero, which would make every adapter the base model). `lora_config`: more
    LoraConfig fields (use_dora, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                        lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM",
                        **lora_config)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    return Path(path)


def peft_model(model_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """transformers' model at `model_dir` with the adapter applied (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).eval()
