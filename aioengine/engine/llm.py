"""LLM: a small synchronous front end for scripts and batch jobs, on the same core (and
the same client boundary as AsyncEngine: EngineClient)."""
from __future__ import annotations

from typing import Sequence

from aioengine.config import EngineArgs
from aioengine.engine.async_engine import PromptType, render_prompt
from aioengine.engine.client import EngineClient, PreparedRequest
from aioengine.engine.core import EngineCore
from aioengine.engine.output_processor import OutputProcessor
from aioengine.lora.request import LoRARequest
from aioengine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from aioengine.sampling_params import SamplingParams


class LLM(EngineClient):
    """`LLM(model=None, **engine_args).generate(prompts, params)` -> final outputs, in order."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.core = EngineCore(EngineArgs.from_kwargs(model=model, **engine_args))
        self.processor = OutputProcessor(self.core.tokenizer)

    def prepare(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Admits a request once, queueing nothing: its adapter loaded if its name is not
        (blocking) and resolved, the prompt rendered and validated with its own copy of the
        params, the grammar compiled (blocking). Raises InvalidRequestError (a bad prompt,
        params, schema, regex or grammar), LoRANotFoundError, LoRAError."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.core.load_lora_if_missing(lora_request)
        text, token_ids = render_prompt(self.tokenizer, prompt)
        prepared = self.core.prepare(token_ids, params, lora_request, text)
        if params.structured_outputs is not None:  # a bad grammar raises here
            self.core.structured.compile(params.structured_outputs)
        return prepared

    def generate(self, prompts: PromptType | PreparedRequest
                 | Sequence[PromptType | PreparedRequest],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt; an
        adapter not loaded yet is loaded from its lora_path. A PreparedRequest (`prepare`)
        runs as prepared, with its own params and adapter. Every prompt is prepared before
        any is queued, so a bad one leaves nothing queued."""
        if isinstance(prompts, (str, PreparedRequest, dict)) or (
                prompts and (isinstance(prompts[0], int)
                             or isinstance(prompts[0], dict) and "role" in prompts[0])):
            prompts = [prompts]  # a single prompt: text, token ids, a dict or chat messages
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(lora_request)} LoRA requests")
        prepared = [self._prepared(p, sp, lora)
                    for p, sp, lora in zip(prompts, sampling_params, lora_request)]
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

        ids = []
        for i, request in enumerate(prepared):
            request_id = f"llm-{id(self)}-{i}"
            samples = self.core.add_request(request_id, request)
            self.processor.add_request(request_id, request.prompt_text, samples, sink)
            ids.append(request_id)
        while self.core.has_unfinished_requests():
            outputs, failed = self.core.step()
            self.core.apply_finish_orders(self.processor.process_outputs(outputs, failed))
        return [_whole(finals[rid], latest[rid], logprobs, rid) for rid in ids]

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Loads (blocking) and registers an adapter; returns it with its lora_int_id.
        Raises LoRAError (name taken, bad files) or LoRANotFoundError (no such path)."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Unloads an adapter; raises LoRANotFoundError for a name not loaded."""
        self.core.remove_lora(lora_name)

    def _prepared(self, prompt: PromptType | PreparedRequest, params: SamplingParams | None,
                  lora_request: LoRARequest | None) -> PreparedRequest:
        if not isinstance(prompt, PreparedRequest):
            return self.prepare(prompt, params, lora_request)
        if params is not None or lora_request is not None:
            raise ValueError("a prepared request carries its own params and adapter")
        return prompt


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
