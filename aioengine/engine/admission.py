"""RequestAdmission: what EngineCore decides about a request before it is queued, in one
place so that every front end (AsyncEngine, LLM, and the HTTP server through them)
rejects the same inputs with the same messages: the prompt and params validated, the
adapter resolved, and `prepare`, which does both once per request; then the features'
own checks (`prepare_features`, a grammar's compile), which a front end runs after its
own admission control since they may take long.

EngineCore holds one (`core.admission`), made once the model, the KV cache and the
features exist; it reads only what it is given, which is fixed for the engine's life.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from aioengine.engine.features import EngineFeature, prepare_request, prepare_request_async
from aioengine.engine.prepared_request import PreparedRequest
from aioengine.errors import InvalidRequestError
from aioengine.lora.adapter import LoRANotFoundError
from aioengine.lora.manager import LoRAManager
from aioengine.lora.request import LoRARequest
from aioengine.pooling_params import PoolingParams
from aioengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from aioengine.config import EngineArgs
    from aioengine.kv.kv_cache_manager import KVCacheManager


class RequestAdmission:
    def __init__(self, args: EngineArgs, vocab_size: int, max_model_len: int,
                 eos_token_ids: set[int], kv_cache_manager: KVCacheManager,
                 lora: LoRAManager | None, features: tuple[EngineFeature, ...]) -> None:
        self.args = args
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv_cache_manager = kv_cache_manager  # only its fixed sizes are read
        self.lora = lora
        self.features = features

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """InvalidRequestError (naming `param`) for an id outside the vocabulary: the one
        place that decides it (prompts, /detokenize). min/max run in C; the ids are only
        walked in Python to name the first bad one."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return
        bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """InvalidRequestError for a prompt that could never run whatever its params: empty,
        an id outside the vocabulary, no room left in the context. Reads only fixed
        attributes, so a front end may call it off the event loop, right after tokenizing
        (a prompt far over the context fails there, not on the loop)."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        self.check_token_ids(prompt_token_ids, "prompt")
        self.check_prompt_length(len(prompt_token_ids))

    def check_prompt_length(self, num_prompt: int) -> None:
        """InvalidRequestError for a prompt of `num_prompt` tokens that leaves no room to
        generate (a front end that has only counted a long prompt's tokens asks this)."""
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens but the model's context length is "
                f"{self.max_model_len}, leaving no room to generate", "prompt")

    def default_max_tokens(self, num_prompt: int, n: int) -> int:
        """'Up to the context', capped so that n samples fit in the KV cache together (the
        server's default: validate_prompt rejects a request that could never fit)."""
        fits = (self.kv_cache_manager.num_blocks // n) * self.args.block_size - num_prompt
        return max(1, min(self.max_model_len - num_prompt, fits))

    def prepare(self, prompt_token_ids: list[int], params: SamplingParams,
                lora_request: LoRARequest | None = None, prompt_text: str | None = None,
                fit_kv_cache: bool = False) -> PreparedRequest:
        """Admits a request once, queueing nothing: the registered adapter it names
        (resolve_lora), its own copy of `params` (a caller may reuse one for many prompts)
        validated against the prompt. `fit_kv_cache`: max_tokens None means
        default_max_tokens rather than the whole context. The features' checks (a grammar's
        compile) are prepare_features', run by the front end after this. Raises
        InvalidRequestError, LoRANotFoundError."""
        lora = self.resolve_lora(lora_request)
        params = params.clone()
        if params.max_tokens is None:  # the one place an unset max_tokens is resolved
            num_prompt = len(prompt_token_ids)
            params.max_tokens = (self.default_max_tokens(num_prompt, params.n) if fit_kv_cache
                                 else self.max_model_len - num_prompt)
        self.validate_prompt(prompt_token_ids, params)
        return PreparedRequest(list(prompt_token_ids), params, prompt_text, lora)

    def prepare_pooling(self, prompt_token_ids: list[int], params: PoolingParams,
                        lora_request: LoRARequest | None = None,
                        prompt_text: str | None = None) -> PreparedRequest:
        """Admits a pooling (prefill-only) request: the prompt may fill the whole context
        (nothing is generated), and its blocks must fit the cache. Raises
        InvalidRequestError, LoRANotFoundError."""
        lora = self.resolve_lora(lora_request)
        num_prompt = len(prompt_token_ids)
        if not prompt_token_ids:
            raise InvalidRequestError("the input is empty", "input")
        self.check_token_ids(prompt_token_ids, "input")
        if num_prompt > self.max_model_len:
            raise InvalidRequestError(
                f"the input has {num_prompt} tokens but the model's context length is "
                f"{self.max_model_len}", "input")
        needed = self.kv_cache_manager.num_blocks_needed(num_prompt)
        if needed > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"the input needs {needed} KV blocks but the cache has only "
                f"{self.kv_cache_manager.num_blocks}", "input")
        # Never sampled: one greedy token's worth, so that nothing reads an unset field.
        placeholder = SamplingParams(max_tokens=1, temperature=0.0)
        placeholder.all_stop_token_ids = set()
        return PreparedRequest(list(prompt_token_ids), placeholder, prompt_text, lora,
                               pooling_params=params)

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidRequestError for anything that could never run (`max_tokens` is
        resolved: prepare); resolves the stop token set in `params`."""
        num_prompt = len(prompt_token_ids)
        self.check_prompt(prompt_token_ids)
        assert params.max_tokens is not None
        if num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt} tokens and max_tokens is {params.max_tokens} "
                f"({num_prompt + params.max_tokens} in total)", "max_tokens")
        params.validate_vocab(self.vocab_size)
        needed = params.n * self.kv_cache_manager.num_blocks_needed(num_prompt + params.max_tokens)
        if needed > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"the request may need {needed} KV blocks (n={params.n}, {num_prompt} prompt + "
                f"{params.max_tokens} new tokens) but the cache has only "
                f"{self.kv_cache_manager.num_blocks}", "max_tokens")
        params.all_stop_token_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids

    def prepare_features(self, params: SamplingParams) -> None:
        """Every feature's prepare (blocking: a grammar compiles); raises
        InvalidRequestError (a bad schema, regex or grammar)."""
        prepare_request(self.features, params)

    async def prepare_features_async(self, params: SamplingParams) -> None:
        """Every feature's prepare_async (a grammar compiles in a worker); raises
        InvalidRequestError before anything is queued."""
        await prepare_request_async(self.features, params)

    # ---- LoRA adapters ------------------------------------------------------------------

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora, "
                                      "--enable-lora)", "lora_request")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Loads and registers an adapter (blocking: reads its files); returns it with the
        lora_int_id of this load. Raises LoRAError / LoRANotFoundError."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Forgets an adapter: new requests for it are refused, running ones finish on it.
        Raises LoRANotFoundError for a name not loaded."""
        if self._lora_manager().remove(lora_name) is None:
            raise LoRANotFoundError(f"the LoRA adapter {lora_name!r} is not loaded")

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list_loras()

    def resolve_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The registered adapter a request names, without loading (LoRAManager.resolve)."""
        return None if lora_request is None else self._lora_manager().resolve(lora_request)

    def load_lora_if_missing(self, lora_request: LoRARequest | None) -> None:
        """Loads the adapter a request names from its lora_path when no adapter of that
        name is loaded (blocking: file reads); prepare() resolves it afterwards."""
        if lora_request is None:
            return
        manager = self._lora_manager()
        if manager.get(lora_request.lora_name) is None and lora_request.lora_path:
            manager.add(lora_request, exist_ok=True)
