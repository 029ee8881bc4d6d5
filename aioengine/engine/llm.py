"""LLM: a small synchronous front end for scripts and batch jobs, on the same core."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from aioengine.config import EngineArgs
from aioengine.engine.async_engine import PromptType, render_prompt
from aioengine.engine.core import EngineCore
from aioengine.engine.output_processor import OutputProcessor
from aioengine.lora.request import LoRARequest
from aioengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from aioengine.sampling_params import SamplingParams


class LLM:
    """`LLM(model=None, **engine_args).generate(prompts, params)` -> final outputs, in order."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.core = EngineCore(EngineArgs.from_kwargs(model=model, **engine_args))
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.core.tokenizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt; an
        adapter not loaded yet is loaded from its lora_path."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]  # a single prompt
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_request)} LoRA requests")
        loras = [self.core.ensure_lora(lora) for lora in lora_request]
        latest: dict[str, dict[int, CompletionOutput]] = {}
        logprobs: dict[tuple[str, int], list[PositionLogprobs]] = {}
        finals: dict[str, RequestOutput] = {}

        def sink(out: RequestOutput) -> None:
            per_sample = latest.setdefault(out.request_id, {})
            for completion in out.outputs:
                per_sample[completion.index] = completion
                if completion.logprobs:
                    logprobs.setdefault((out.request_id, completion.index), []).extend(
                        completion.logprobs)
            if out.finished:
                finals[out.request_id] = out

        # Validate everything first, so a bad prompt leaves nothing queued.
        rendered = [(*render_prompt(self.tokenizer, p), _copy(sp))
                    for p, sp in zip(prompts, sampling_params)]
        for _, token_ids, params in rendered:
            self.core.validate_prompt(token_ids, params)
            if params.structured_outputs is not None:  # a bad grammar raises here
                self.core.structured.compile(params.structured_outputs)
        ids = []
        for i, ((text, token_ids, params), lora) in enumerate(zip(rendered, loras)):
            request_id = f"llm-{id(self)}-{i}"
            samples = self.core.add_request(request_id, token_ids, params, lora_request=lora)
            self.processor.add_request(request_id, text, samples, sink)
            ids.append(request_id)
        while self.core.has_unfinished_requests():
            outputs, failed = self.core.step()
            self.core.apply_finish_orders(self.processor.process_outputs(outputs, failed))
        return [_whole(finals[rid], latest[rid], logprobs, rid) for rid in ids]


def _copy(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params)  # the engine resolves max_tokens etc. in place


def _whole(final: RequestOutput, samples: dict[int, CompletionOutput],
           logprobs: dict[tuple[str, int], list[PositionLogprobs]], rid: str) -> RequestOutput:
    """The final output with every sample's whole text, tokens and logprobs."""
    outputs = [CompletionOutput(
        index=c.index, text=c.cumulative_text, token_ids=c.cumulative_token_ids,
        cumulative_text=c.cumulative_text, cumulative_token_ids=c.cumulative_token_ids,
        logprobs=logprobs.get((rid, c.index)), finished=c.finished,
        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        error=c.error) for _, c in sorted(samples.items())]
    final.outputs = outputs
    return final
