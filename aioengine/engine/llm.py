"""LLM: a small synchronous front end for scripts and batch jobs, on the same core (and
the same client boundary as AsyncEngine: EngineClient)."""
from __future__ import annotations

from typing import Callable, Sequence

from tqdm.auto import tqdm

from aioengine.chat_prompt import normalize_tool, render_chat_prompt
from aioengine.config import ConfigError, EngineArgs
from aioengine.engine.client import EngineClient, PreparedRequest, PromptType, render_prompt
from aioengine.engine.core import EngineCore
from aioengine.engine.output_processor import OutputProcessor
from aioengine.lora.request import LoRARequest
from aioengine.errors import InvalidRequestError
from aioengine.outputs import (CompletionOutput, PoolingRequestOutput, PositionLogprobs,
                               RequestOutput)
from aioengine.pooling_params import PoolingParams
from aioengine.sampling_params import SamplingParams
from aioengine.scoring import (ScoringOutput, ScoringRequestOutput, cosine_similarity,
                               score_pairs)
from aioengine.tokenizer_utils import ChatTemplateError
from aioengine.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser


class LLM(EngineClient):
    """`LLM(model=None, **engine_args).generate(prompts, params)` -> final outputs, in order."""

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        if args.otlp_traces_endpoint is not None:  # refused rather than silently ignored
            raise ConfigError("otlp_traces_endpoint: request traces are exported by "
                              "AsyncEngine (and so the server), not by LLM")
        self.core = EngineCore(args)
        self.processor = OutputProcessor(self.core.tokenizer)
        self._num_requests = 0

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the params a prompt without its own gets, SamplingParams with the model's
        defaults (--generation-config; SamplingParams() under "vllm")."""
        return SamplingParams(**self.default_sampling)

    def prepare(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Admits a request once, queueing nothing: its adapter loaded if its name is not
        (blocking) and resolved, the prompt rendered and validated with its own copy of the
        params, the grammar compiled (blocking). Raises InvalidRequestError (a bad prompt,
        params, schema, regex or grammar), LoRANotFoundError, LoRAError."""
        params = (sampling_params if sampling_params is not None
                  else self.get_default_sampling_params())
        self.core.admission.load_lora_if_missing(lora_request)
        text, token_ids = render_prompt(self.tokenizer, prompt)
        prepared = self.core.admission.prepare(token_ids, params, lora_request, text)
        self.core.admission.prepare_features(params)  # a bad grammar raises here
        return prepared

    def generate(self, prompts: PromptType | PreparedRequest
                 | Sequence[PromptType | PreparedRequest],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None) per prompt; an
        adapter not loaded yet is loaded from its lora_path. A PreparedRequest (`prepare`)
        runs as prepared, with its own params and adapter. Every prompt is prepared before
        any is queued, so a bad one leaves nothing queued. `use_tqdm`: a progress bar over
        the prompts (never for one)."""
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
        for request in prepared:
            request_id = self._next_id()
            samples = self.core.add_request(request_id, request)
            self.processor.add_request(request_id, request.prompt_text, samples, sink)
            ids.append(request_id)
        self._run(len(ids), lambda: len(finals), use_tqdm, "Processed prompts")
        return [_whole(finals[rid], latest[rid], logprobs, rid) for rid in ids]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: LoRARequest | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             tool_parser: str = DEFAULT_TOOL_PARSER) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or a list of them,
        rendered as the server's chat route renders them (aioengine/chat_prompt.py: the
        model's template or `chat_template`, `tools` as OpenAI tool dicts, offered in
        `tool_parser`'s call format to a template that does not take tools), then
        generated. Raises InvalidRequestError for malformed messages or a failing template."""
        if not messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        parser = get_tool_parser(tool_parser)
        prompts: list[PromptType] = []
        try:
            tool_dicts = [normalize_tool(t) for t in tools or []]
            for conversation in conversations:
                prompts.append(render_chat_prompt(
                    self.tokenizer, conversation, tool_dicts, parser, chat_template,
                    add_generation_prompt, chat_template_kwargs))
        except ChatTemplateError as e:
            raise InvalidRequestError(str(e), "messages") from None
        return self.generate(prompts, sampling_params, lora_request, use_tqdm=use_tqdm)

    # ---- pooling (embeddings, scores) ----------------------------------------------------

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | None = None,
               lora_request: LoRARequest | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Prefill-only requests, batched by the scheduler: each prompt's pooled final
        hidden states (PoolingParams: last, mean or cls; normalised by default), in order.
        Every prompt is prepared before any is queued (InvalidRequestError)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = pooling_params if pooling_params is not None else PoolingParams()
        self.core.admission.load_lora_if_missing(lora_request)
        prepared = [self.core.admission.prepare_pooling(ids, params, lora_request, text)
                    for text, ids in (render_prompt(self.tokenizer, p) for p in prompts)]
        finals: dict[str, PoolingRequestOutput] = {}
        ids = []
        for request in prepared:
            request_id = self._next_id()
            self.core.add_request(request_id, request)
            self.processor.add_pooling_request(request_id, request.prompt_token_ids,
                                               lambda out: finals.__setitem__(out.request_id,
                                                                              out))
            ids.append(request_id)
        self._run(len(ids), lambda: len(finals), use_tqdm, "Pooled prompts")
        return [finals[rid] for rid in ids]

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling: str = "last",
              normalize: bool = True, lora_request: LoRARequest | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """vLLM's LLM.embed: `encode` with `pooling` (last, mean, cls); each output's
        `outputs.embedding` is the vector as a list."""
        return self.encode(prompts, PoolingParams(pooling, normalize), lora_request, use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              pooling: str = "last", lora_request: LoRARequest | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score for an embedding model: the cosine similarity of the embeddings
        of text_1 and each text_2 (one text_1), or of text_1[i] and text_2[i]."""
        pairs = score_pairs(text_1, text_2)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = self.embed(texts, pooling, True, lora_request, use_tqdm)
        by_text = dict(zip(texts, outs))
        results = []
        for i, (a, b) in enumerate(pairs):
            ea, eb = by_text[a], by_text[b]
            if ea.outputs is None or eb.outputs is None:
                raise RuntimeError(ea.error or eb.error or "embedding failed")
            results.append(ScoringRequestOutput(
                f"score-{i}", ScoringOutput(cosine_similarity(ea.outputs.data, eb.outputs.data)),
                ea.prompt_token_ids + eb.prompt_token_ids))
        return results

    def _next_id(self) -> str:
        self._num_requests += 1
        return f"llm-{id(self)}-{self._num_requests}"

    def _run(self, total: int, num_done: Callable[[], int], use_tqdm: bool, desc: str) -> None:
        """Steps until nothing is left, with a progress bar over `total` requests (not for
        one request, nor with use_tqdm=False)."""
        with tqdm(total=total, desc=desc, disable=not use_tqdm or total <= 1,
                  dynamic_ncols=True) as bar:
            while self.core.has_unfinished_requests():
                outputs, failed = self.core.step()
                self.core.apply_finish_orders(self.processor.process_outputs(outputs, failed))
                bar.update(num_done() - bar.n)

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Loads (blocking) and registers an adapter; returns it with its lora_int_id.
        Raises LoRAError (name taken, bad files) or LoRANotFoundError (no such path)."""
        return self.core.admission.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Unloads an adapter; raises LoRANotFoundError for a name not loaded."""
        self.core.admission.remove_lora(lora_name)

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
