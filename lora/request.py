"""LoRARequest: which adapter a request runs with (vLLM's shape)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter by name and the PEFT directory it loads from.

        LoRARequest("pirate", "lora/examples/pirate")        # name, path
        LoRARequest("pirate", 1, "lora/examples/pirate")     # vLLM's (name, int id, path)

    `lora_int_id` is assigned by the engine when it loads the adapter: a number unique to
    that load (a reload under the same name gets a new one), which is what the prefix cache
    and the adapter slots key on. One given by the caller is ignored for that purpose.
    """

    lora_name: str
    lora_path: str = ""
    lora_int_id: int = 0

    def __post_init__(self) -> None:
        path, int_id = self.lora_path, self.lora_int_id
        if isinstance(path, int) and not isinstance(path, bool):
            # vLLM's positional order: (lora_name, lora_int_id, lora_path).
            self.lora_path, self.lora_int_id = (int_id if isinstance(int_id, str) else ""), path
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if not isinstance(self.lora_path, str):
            raise ValueError("LoRARequest: lora_path must be a string")
        if not isinstance(self.lora_int_id, int):
            raise ValueError("LoRARequest: lora_int_id must be an int")
