"""AsyncEngine's pooling API (vLLM's encode, for embeddings and scores): prefill-only
requests the same loop batches with everything else, each ending in one
PoolingRequestOutput. The server's /v1/embeddings, /pooling, /score and /rerank run on it."""
from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

from aioengine.engine.client import PreparedRequest, PromptType, render_prompt
from aioengine.errors import EngineDeadError, InvalidRequestError
from aioengine.lora.request import LoRARequest
from aioengine.outputs import PoolingRequestOutput
from aioengine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from aioengine.engine.async_engine import AsyncEngine


class AsyncPoolingMixin:
    """`prepare_pooling` and `encode` of AsyncEngine, on its request bookkeeping (request
    ids, the output processor, `_abort` / `_forget`) and its loop."""

    async def prepare_pooling(self: AsyncEngine, prompts: Sequence[PromptType],
                              pooling_params: PoolingParams | None = None,
                              lora_request: LoRARequest | None = None,
                              admit: Callable[[], None] | None = None,
                              ) -> list[PreparedRequest]:
        """Admits pooling requests (EngineCore.prepare_pooling), queueing nothing; then
        `admit()` (a server's admission control). Raises InvalidRequestError,
        LoRANotFoundError, LoRAError."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        await self._load_lora_if_missing(lora_request)
        prepared = [self.core.admission.prepare_pooling(token_ids, params, lora_request, text)
                    for text, token_ids in (render_prompt(self.tokenizer, p) for p in prompts)]
        if admit is not None:
            admit()
        return prepared

    async def encode(self: AsyncEngine, prompt: PromptType | PreparedRequest,
                     pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's encode: a prefill-only request, batched with everything else, that yields
        one PoolingRequestOutput (the pooled final hidden states; `outputs` None and
        `error` set if it failed). Its KV blocks are freed when it ends. Cancelling the
        consumer aborts it. `prompt`: a prompt (prepared here: InvalidRequestError before
        anything is queued) or a PreparedRequest from `prepare_pooling`."""
        prepared = self._given_prepared(prompt, pooling_params, lora_request)
        if prepared is None:
            prepared = (await self.prepare_pooling([prompt], pooling_params, lora_request))[0]
        if prepared.pooling_params is None:
            raise ValueError("encode() takes a request prepared by prepare_pooling()")
        if not self.is_running:
            raise EngineDeadError("the engine is not running") from self._dead
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues or request_id in self._samples:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        done: asyncio.Future[PoolingRequestOutput] = asyncio.get_running_loop().create_future()
        self._samples[request_id] = self.core.add_request(request_id, prepared,
                                                          priority=priority)
        self.processor.add_pooling_request(
            request_id, prepared.prompt_token_ids,
            lambda out: None if done.done() else done.set_result(out))
        self._wakeup.set()
        finished = False
        try:
            out = await done
            finished = True
            yield out
        finally:
            if not finished:
                self._abort(request_id)
            self._forget(request_id)
