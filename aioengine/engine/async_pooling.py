"""AsyncEngine's pooling API (vLLM's encode, for embeddings and scores): prefill-only
requests the same loop batches with everything else, each ending in one
PoolingRequestOutput. The server's /v1/embeddings, /pooling, /score and /rerank run on it.

`AsyncPooling` is an object AsyncEngine holds (its `prepare_pooling` and `encode`
delegate to it); it reads the engine through `PoolingHost`, the part of AsyncEngine a
pooling request shares with `generate`: rendering, adapters, and the request bookkeeping
(one id space, one abort path)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol, Sequence

from aioengine.engine.client import PreparedRequest, PromptType, render_prompt
from aioengine.lora.request import LoRARequest
from aioengine.outputs import PoolingRequestOutput
from aioengine.pooling_params import PoolingParams

if TYPE_CHECKING:
    from aioengine.engine.admission import RequestAdmission
    from aioengine.engine.output_processor import OutputProcessor
    from aioengine.request import Request


class PoolingHost(Protocol):
    """What a pooling request needs of the engine that runs it (AsyncEngine)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def processor(self) -> OutputProcessor: ...

    async def _load_lora_if_missing(self, lora_request: LoRARequest | None) -> None: ...

    def _given_prepared(self, prompt: PromptType | PreparedRequest,
                        params: PoolingParams | None,
                        lora_request: LoRARequest | None) -> PreparedRequest | None: ...

    def _start_request(self, prepared: PreparedRequest, request_id: str | None,
                       priority: int) -> tuple[str, list[Request]]: ...

    def _abort(self, request_id: str) -> None: ...

    def _forget(self, request_id: str) -> None: ...


class AsyncPooling:
    """`prepare_pooling` and `encode` of the engine `host`, admitted by `admission`
    (its core's)."""

    def __init__(self, host: PoolingHost, admission: RequestAdmission) -> None:
        self.host = host
        self.admission = admission

    async def prepare(self, prompts: Sequence[PromptType],
                      pooling_params: PoolingParams | None = None,
                      lora_request: LoRARequest | None = None,
                      admit: Callable[[], None] | None = None) -> list[PreparedRequest]:
        """Admits pooling requests (RequestAdmission.prepare_pooling), queueing nothing;
        then `admit()` (a server's admission control)."""
        host = self.host
        params = pooling_params if pooling_params is not None else PoolingParams()
        await host._load_lora_if_missing(lora_request)
        prepared = [self.admission.prepare_pooling(token_ids, params, lora_request, text)
                    for text, token_ids in (render_prompt(host.tokenizer, p) for p in prompts)]
        if admit is not None:
            admit()
        return prepared

    async def encode(self, prompt: PromptType | PreparedRequest,
                     pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> AsyncIterator[PoolingRequestOutput]:
        """AsyncEngine.encode: one PoolingRequestOutput, then the request is forgotten;
        closing the generator before that aborts it."""
        host = self.host
        prepared = host._given_prepared(prompt, pooling_params, lora_request)
        if prepared is None:
            prepared = (await self.prepare([prompt], pooling_params, lora_request))[0]
        if prepared.pooling_params is None:
            raise ValueError("encode() takes a request prepared by prepare_pooling()")
        request_id, _ = host._start_request(prepared, request_id, priority)
        done: asyncio.Future[PoolingRequestOutput] = asyncio.get_running_loop().create_future()
        host.processor.add_pooling_request(
            request_id, prepared.prompt_token_ids,
            lambda out: None if done.done() else done.set_result(out))
        finished = False
        try:
            out = await done
            finished = True
            yield out
        finally:
            if not finished:
                host._abort(request_id)
            host._forget(request_id)
