"""The client boundary: what AsyncEngine and LLM offer besides running requests.

The server, Ray Serve, the benchmarks and the scripts see the engine only through these:
a request prepared once (`PreparedRequest`, engine/prepared_request.py, re-exported here),
model info, adapters, KV and engine stats. Nothing outside aioengine/engine/ reaches into
EngineCore (tests/unit/test_boundaries.py); the core, for its part, never imports this
module, so the client may name it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from aioengine.engine.prepared_request import PreparedRequest
from aioengine.errors import InvalidRequestError
from aioengine.lora.request import LoRARequest
from aioengine.tokenizer_utils import apply_chat_template, encode_prompt

if TYPE_CHECKING:
    import torch

    from aioengine.engine.core import EngineCore
    from aioengine.model.arch import ModelArchConfig
    from aioengine.spec_decode import SpeculativeConfig
    from aioengine.structured import StructuredOutputManager

# A prompt: text, token ids, or chat messages ({"role", "content"} dicts).
PromptType = Union[str, list[int], list[dict]]

__all__ = ["EngineClient", "PreparedRequest", "PromptType", "render_prompt"]


def render_prompt(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """Prompt -> (text if any, token ids)."""
    if isinstance(prompt, str):
        return prompt, encode_prompt(tokenizer, prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return None, apply_chat_template(tokenizer, prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(
        "prompt must be a string, a list of token ids, or a list of chat messages", "prompt")


class EngineClient:
    """Model info, adapters and stats of the engine `self.core` (AsyncEngine, LLM)."""

    core: EngineCore

    # ---- the model ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def model_path(self) -> str:
        """The model file or folder the weights were loaded from."""
        return self.core.loaded.model_path

    @property
    def model_arch(self) -> ModelArchConfig:
        return self.core.loaded.arch

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (for reading: weight bytes, hidden states for training data)."""
        return self.core.loaded.model

    @property
    def dtype(self) -> torch.dtype:
        return self.core.dtype

    def dtype_info(self) -> dict[str, object]:
        """Weights, activations and KV cache dtypes and why, resident weight bytes, CPU."""
        return self.core.dtype_info()

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model's sampling defaults (aioengine/generation_config.py): SamplingParams
        field -> value, for the fields a request leaves out."""
        return self.core.default_sampling

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return self.core.speculative_config

    @property
    def cuda_graphs_captured(self) -> bool:
        return self.core.runner.cuda_graphs is not None

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler and its stats (benchmarks time compiles through it)."""
        return self.core.structured

    # ---- requests -----------------------------------------------------------------------

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """InvalidRequestError (naming `param`) for an id outside the vocabulary."""
        self.core.admission.check_token_ids(token_ids, param)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """InvalidRequestError for a prompt that could never run (empty, outside the
        vocabulary, over the context), as `prepare` would raise it; safe off the loop."""
        self.core.admission.check_prompt(prompt_token_ids)

    def check_prompt_length(self, num_prompt: int) -> None:
        """InvalidRequestError for a prompt of `num_prompt` tokens over the context (the
        message `prepare` gives it); safe off the loop."""
        self.core.admission.check_prompt_length(num_prompt)

    def default_max_tokens(self, num_prompt: int, n: int) -> int:
        """Up to the context, capped so that n samples fit in the KV cache together."""
        return self.core.admission.default_max_tokens(num_prompt, n)

    # ---- adapters (vLLM's list_loras; loading is the front end's: blocking or not) ----

    def list_loras(self) -> list[LoRARequest]:
        return self.core.admission.list_loras()

    def get_lora(self, lora_name: str) -> LoRARequest | None:
        """The adapter loaded under `lora_name`, or None."""
        return None if self.core.lora is None else self.core.lora.get(lora_name)

    @property
    def lora_module_shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, PEFT module name) -> (in_features, out_features) of each projection an
        adapter may cover; empty without LoRA."""
        return {} if self.core.lora is None else dict(self.core.lora.module_shapes)

    # ---- KV cache and stats -------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.core.kv_cache_manager.num_blocks

    @property
    def block_size(self) -> int:
        return self.core.args.block_size

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing reset) while blocks are in use."""
        return self.core.kv_cache_manager.reset_prefix_cache()

    def reset_kv_peak_stats(self) -> None:
        """Starts a new KV peak measurement (`kv_peak_*`, `kv_waste_at_peak` in stats())."""
        self.core.reset_kv_peak_stats()

    def stats(self) -> dict[str, float]:
        """Point-in-time engine numbers: scheduler, KV cache, structured, LoRA, spec decode."""
        return self.core.stats()
