"""Multi-LoRA (see README.md in this folder): PEFT adapters loaded into CPU memory, adapter
slots in the wrapped projections, and the per-token adapter index of a step."""
from aioengine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
