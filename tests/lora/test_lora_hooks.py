"""LoRA reaches the model through its build hooks (linear_factory, lora_source), never by
patching a built model: the base projections stay the model's own Linears (loaded,
converted and packed as without LoRA), the layers run the wrappers, and the slots take the
dtype the stored weights decide."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aioengine.lora.layers import LinearWithLoRA
from aioengine.lora.manager import LoRAConfig, LoRAManager, slot_dtype
from aioengine.model.layers import Linear
from aioengine.model.loader import load_model

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype,quantization", [(torch.float32, None),
                                                (torch.bfloat16, None),
                                                (torch.bfloat16, "int8")])
def test_model_built_through_the_factory(lora_model_dir: Path, dtype, quantization) -> None:
    manager = LoRAManager(LoRAConfig(max_loras=2, max_lora_rank=4), CPU, dtype, quantization)
    model = load_model(str(lora_model_dir), dtype, CPU, quantization,
                       linear_factory=manager.linear_factory, lora_source=manager).model
    plain = load_model(str(lora_model_dir), dtype, CPU, quantization).model
    assert model.lora_source is manager and not hasattr(model, "lora")
    assert len(manager.layers) == len(model.layers)
    for layer, plain_layer, wrapped in zip(model.layers, plain.layers, manager.layers):
        bases = layer.projections()
        assert all(type(b) is Linear for b in bases)  # never replaced
        assert [w.base_layer for w in wrapped.values()] == list(bases)
        assert all(isinstance(r, LinearWithLoRA) for r in layer._run)
        for base, ref in zip(bases, plain_layer.projections()):
            assert base.storage == ref.storage and torch.equal(base.weight, ref.weight)
    # The wrappers are not registered beside the bases: same parameters as without LoRA.
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert manager.slot_dtype == slot_dtype(dtype, CPU, quantization)
    expect = torch.bfloat16 if (dtype, quantization) == (torch.bfloat16, None) else torch.float32
    assert manager.layers[0]["qkv_proj"].lora_a.dtype == expect
    # No adapter in the step: the fused kernel gets none.
    assert manager.decode_args() is None


def test_factory_refuses_a_projection_twice(lora_model_dir: Path) -> None:
    manager = LoRAManager(LoRAConfig(max_loras=1, max_lora_rank=4), CPU, torch.float32)
    load_model(str(lora_model_dir), torch.float32, CPU, linear_factory=manager.linear_factory)
    with pytest.raises(ValueError, match="built twice"):
        load_model(str(lora_model_dir), torch.float32, CPU,
                   linear_factory=manager.linear_factory)
