"""EngineCore: model + KV cache + scheduler + runner, driven one step at a time.

    schedule()  ->  execute(scheduler_output)  ->  update(scheduler_output, runner_output)
    (event loop)    (off the loop: worker thread)  (event loop)

It is synchronous; AsyncEngine and LLM drive it, and nothing outside aioengine/engine/
touches it. Request validation and adapter resolution are its `admission`
(RequestAdmission, admission.py): every front end prepares a request there once, then
add_request queues it. The features EngineArgs enables (enabled_features) are a tuple
of EngineFeature that the core, the scheduler and the runner loop over (features.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch

from aioengine import envs
from aioengine import cpu_info
from aioengine.config import ConfigError, EngineArgs, SchedulerConfig
from aioengine.dtypes import auto_dtype, auto_kv_cache_dtype, parse_dtype
from aioengine.sched.async_scheduler import AsyncScheduler
from aioengine.engine.kv_setup import kv_cache_layout, make_kv_cache_manager, peak_layer_blocks
from aioengine.sched.scheduler import Scheduler
from aioengine.sched.scheduler_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from aioengine.engine.admission import RequestAdmission
from aioengine.generation_config import model_sampling_defaults
from aioengine.engine.prepared_request import PreparedRequest
from aioengine.engine.features import (EngineFeature, admit_request, feature_stats,
                                       prepare_step, shutdown)
from aioengine.model.llama import kv_cache_bytes_per_block
from aioengine.kernels import cpu as cpu_kernels
from aioengine.lora.manager import LoRAConfig, LoRAManager
from aioengine.lora.request import LoRARequest
from aioengine.model.loader import activation_dtype, load_model
from aioengine.model.registry import check_lora_architecture
from aioengine.model.triton_attention import TritonAttentionBackend, select_attention_backend
from aioengine.request import Request, RequestStatus
from aioengine.sampling_params import SamplingParams
from aioengine.spec_decode import SpeculativeConfig, make_proposer, num_lookahead_tokens
from aioengine.spec_decode.step import SpeculativeDecoding
from aioengine.spec_decode.shipped import resolve_speculative_config
from aioengine.structured import StructuredOutputManager
from aioengine.tokenizer_utils import get_eos_token_ids
from aioengine.worker.async_output import AsyncModelRunnerOutput, resolve_now
from aioengine.worker.cuda_graphs import default_capture_sizes
from aioengine.worker.gpu_memory import profile_gpu_kv_cache_memory
from aioengine.worker.model_runner import ModelRunner

logger = logging.getLogger("aioengine")


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        self.speculative_config = SpeculativeConfig.parse(args.speculative_config)
        if envs.AIOENGINE_CPU_THREADS > 0:
            torch.set_num_threads(envs.AIOENGINE_CPU_THREADS)
        self.device = args.resolve_device()
        self.dtype = parse_dtype(args.dtype, self.device)
        self.dtype_reason = (auto_dtype(self.device)[1] if args.dtype == "auto"
                             else f"dtype={args.dtype} requested")
        compute = activation_dtype(self.dtype, self.device)
        self.kv_cache_dtype = (auto_kv_cache_dtype(self.dtype, compute, args.quantization,
                                                   self.device)
                               if args.kv_cache_dtype == "auto"
                               else parse_dtype(args.kv_cache_dtype, self.device))
        start = time.perf_counter()
        attn_backend = select_attention_backend(args.attention_backend, self.device)  # fails fast
        # Multi-LoRA: made before the model, which builds its projections through it.
        self.lora: LoRAManager | None = None
        if args.enable_lora:
            self.lora = LoRAManager(LoRAConfig.from_engine_args(args), self.device, self.dtype,
                                    args.quantization)
        self.loaded = load_model(args.model, self.dtype, self.device, args.quantization,
                                 tokenizer=args.tokenizer,
                                 linear_factory=None if self.lora is None
                                 else self.lora.linear_factory, lora_source=self.lora,
                                 native_gguf=args.dtype == "auto" and not _bundled(args.model))
        # What a request leaving a sampling field out gets (--generation-config; logged).
        self.default_sampling = model_sampling_defaults(args.generation_config,
                                                        self.loaded.model_path)
        if self.lora is not None:
            check_lora_architecture(self.loaded.arch.architecture)
            logger.info("LoRA: %d slots of rank %d (%.1f MiB), up to %d adapters in CPU memory",
                        args.max_loras, args.max_lora_rank, self.lora.slot_bytes() / 2**20,
                        self.lora.config.cpu_capacity)
        self.loaded.model.attn_backend = attn_backend
        self.speculative_config = resolve_speculative_config(
            self.speculative_config, self.loaded.model_path, self.loaded.arch)
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = self.loaded.arch.vocab_size
        self.max_model_len = self._resolve_max_model_len(args)
        if not args.enable_chunked_prefill and args.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({args.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")
        spec = self.speculative_config
        self.kv_layout = kv_cache_layout(
            self.loaded.model.layer_specs, args, self.max_model_len, self._num_kv_blocks(),
            windows_supported="sliding_window" in attn_backend.SUPPORTED_FEATURES,
            eagle=spec is not None and spec.uses_draft_head)
        num_blocks = self.kv_layout.num_blocks[0]
        self.kv_cache_manager = make_kv_cache_manager(self.kv_layout, args)
        proposer = make_proposer(spec, self.loaded, num_blocks, args.block_size, self.dtype,
                                 self.device)
        self.eos_token_ids = get_eos_token_ids(self.tokenizer, self.loaded.hf_config)
        self.eos_token_ids |= set(self.loaded.arch.eos_token_ids)
        self.structured, self.features = enabled_features(
            args, self.lora, self.tokenizer, self.vocab_size, self.eos_token_ids)
        # Drafts are part of the step (scheduled, verified), not a feature.
        self.spec_decode = SpeculativeDecoding(spec)
        scheduler_cls = AsyncScheduler if args.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(SchedulerConfig.from_engine_args(
            args, self.max_model_len, spec, num_lookahead_tokens(spec)), self.kv_cache_manager,
            self.features, self.spec_decode.counters)
        self.admission = RequestAdmission(args, self.vocab_size, self.max_model_len,
                                          self.eos_token_ids, self.kv_cache_manager,
                                          self.lora, self.features)
        self.runner = ModelRunner(self.loaded, num_blocks, args.block_size, self.device,
                                  self.kv_cache_dtype, seed=args.seed, proposer=proposer,
                                  features=self.features,
                                  kv_groups=self.kv_layout.runner_groups())
        warm_start = time.perf_counter()
        warm_tokens = self.runner.warm_up(args.max_num_batched_tokens, self.max_model_len)
        logger.debug("warm-up step of %d tokens: %.2fs", warm_tokens,
                     time.perf_counter() - warm_start)
        if (self.device.type == "cuda" and not args.enforce_eager and self.lora is None
                and isinstance(attn_backend, TritonAttentionBackend)):
            sizes = default_capture_sizes(args.max_num_seqs)
            graph_start = time.perf_counter()
            self.runner.capture_cuda_graphs(sizes, self.max_model_len)
            logger.info("CUDA graphs of decode steps captured for %d batch sizes (1..%d): "
                        "%.1fs", len(sizes), sizes[-1], time.perf_counter() - graph_start)
        info = self.dtype_info()
        logger.info("weights %s (%s), activations %s, KV cache %s; %.0f MiB of weights; CPU %s, "
                    "C kernels %s", info["weights"], info["dtype_reason"], info["activations"],
                    info["kv_cache_dtype"], info["weight_bytes"] / 2**20, info["cpu"]["model"],
                    info["cpu"]["kernels"])
        logger.info("engine ready: %s on %s, %d KV blocks of %d tokens, max_model_len %d, "
                    "%.1fs", self.loaded.model_path, self.device, num_blocks, args.block_size,
                    self.max_model_len, time.perf_counter() - start)

    def dtype_info(self) -> dict[str, object]:
        """What the engine computes in and why: weights (their dtype, or int8), activations,
        KV cache, resident weight bytes, and the CPU model, flags and C-kernel build the
        choice was based on (the start-up log, `/version` and `/v1/models` show it)."""
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        model = self.loaded.model
        return {
            "dtype": name(self.dtype), "quantization": self.args.quantization,
            "weights": self.args.quantization or _weight_storages(model) or name(self.dtype),
            "dtype_reason": self.dtype_reason, "activations": name(model.dtype),
            "kv_cache_dtype": name(self.kv_cache_dtype), "weight_bytes": model.weight_bytes(),
            "cpu": {"model": cpu_info.cpu_model(), "flags": cpu_info.relevant_flags(),
                    "kernels": cpu_kernels.describe() if self.device.type == "cpu" else None},
        }

    def _resolve_max_model_len(self, args: EngineArgs) -> int:
        model_len = self.loaded.model.max_model_len  # as its attention backend computes it
        if args.max_model_len is None:
            return model_len
        if not 1 <= args.max_model_len <= model_len:
            raise ConfigError(f"max_model_len must be in [1, {model_len}] for this model, "
                              f"got {args.max_model_len}")
        return args.max_model_len

    def _num_kv_blocks(self) -> int:
        """--num-kv-blocks; else the blocks of --kv-cache-memory bytes, or of the default
        space (CUDA: what a profiling run leaves of --gpu-memory-utilization; elsewhere
        sized to the model's KV bytes per token and the memory available now, or
        $AIOENGINE_CPU_KVCACHE_SPACE GiB: gpu_memory.cpu_kv_cache_memory), at most what
        max_num_seqs full-length requests use. Logged with how it was chosen."""
        from aioengine.worker.gpu_memory import cpu_kv_cache_memory

        if self.args.num_kv_blocks is not None:
            return self.args.num_kv_blocks
        bs = self.args.block_size
        per_block = kv_cache_bytes_per_block(self.loaded.arch, bs, self.kv_cache_dtype)
        # More blocks than max_num_seqs full-length requests can use only serve the prefix
        # cache; capping keeps a tiny model from building millions of block objects.
        usable = self.args.max_num_seqs * -(-self.max_model_len // bs)
        memory, reason = self.args.kv_cache_memory, "--kv-cache-memory"
        if memory is None and self.device.type == "cuda":
            memory, reason = profile_gpu_kv_cache_memory(
                self.loaded, self.args, self.max_model_len, self.kv_cache_dtype,
                self.device), "--gpu-memory-utilization"
        elif memory is None:
            memory, reason = cpu_kv_cache_memory(-(-per_block // bs), usable * bs)
        num_blocks = min(memory // per_block, usable)
        if num_blocks < 1:
            raise ConfigError(f"kv_cache_memory {memory} bytes holds no block ({per_block} bytes "
                              f"per block of {bs} tokens)")
        logger.info("KV cache: %d blocks, %.0f MiB, %d tokens (%d bytes/token, %s); %s",
                    num_blocks, num_blocks * per_block / 2**20, num_blocks * bs,
                    per_block // bs, str(self.kv_cache_dtype).removeprefix("torch."), reason)
        return num_blocks

    # ---- requests (validation and adapters: self.admission) ---------------------------

    def add_request(self, request_id: str, prompt: PreparedRequest | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> list[Request]:
        """Queues one request; returns its samples (n > 1 samples fork from the first once
        its prompt is computed). Sample i's seed is `seed + i`. A PreparedRequest is queued
        as prepared (nothing is validated or resolved again); token ids are prepared here
        first (`lora_request` must then name a loaded adapter)."""
        if isinstance(prompt, PreparedRequest):
            if params is not None or lora_request is not None:
                raise ValueError("a prepared request carries its own params and adapter")
            prepared = prompt
        else:
            prepared = self.admission.prepare(prompt, params or SamplingParams(), lora_request)
        prompt_token_ids, params = prepared.prompt_token_ids, prepared.sampling_params
        lora = prepared.lora_request
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        samples = []
        for i in range(params.n):
            sample_params = params
            if params.seed is not None and i > 0:
                sample_params = _with_seed(params, params.seed + i)
            sample = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=list(prompt_token_ids), sampling_params=sample_params,
                arrival_time=arrival, priority=priority, parent_id=request_id, sample_index=i,
                lora_request=lora, pooling_params=prepared.pooling_params,
                # The adapter's load is part of every block hash: KV computed under one
                # adapter (or an earlier load of the same name) is never reused by another.
                cache_salt=None if lora is None else ("lora", lora.lora_int_id))
            admit_request(self.features, sample)
            samples.append(sample)
        samples[0].pending_forks = samples[1:]
        self.scheduler.add_request(samples[0])
        return samples

    def finish_requests(self, samples: list[Request], status: RequestStatus) -> None:
        """Ends samples early (abort, stop string); samples never forked end with them."""
        for sample in samples:
            if sample.is_finished:
                continue
            if sample.request_id in self.scheduler.requests:
                self.scheduler.finish_requests([sample.request_id], status)
            else:  # a fork that has not started yet
                sample.status = status

    def apply_finish_orders(self, orders: list[tuple[Request, RequestStatus, str | None]]) -> None:
        """Ends samples the output processor stopped (stop string) or failed."""
        for request, status, detail in orders:
            self.finish_requests([request], status)
            if status == RequestStatus.FINISHED_STOPPED:
                request.stop_reason = detail
            else:
                request.error = detail

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """The adapters (names) of the running and of the waiting requests (vLLM's
        lora_requests_info metric), each sorted."""
        def names(requests: list[Request]) -> list[str]:
            return sorted({r.lora_request.lora_name for r in requests if r.lora_request})
        return names(self.scheduler.running), names(self.scheduler.waiting)

    def shutdown(self) -> None:
        """Ends what the features started (grammar compile workers)."""
        shutdown(self.features)

    def stats(self) -> dict[str, float]:
        """Point-in-time numbers for logs and metrics."""
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_blocks": kv.num_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            # The step with the most KV blocks in use since reset_kv_peak_stats(): how many,
            # and the share of their slots that held no token (partial last blocks).
            "kv_peak_blocks": kv.peak_num_blocks,
            "kv_peak_empty_slots": kv.peak_num_empty_slots,
            "kv_waste_at_peak": kv.waste_at_peak,
            # Summed over KV cache groups (each times its layers): what the peak held.
            "kv_peak_layer_blocks": peak_layer_blocks(self.kv_layout, kv),
            **feature_stats(self.features),
            **self.spec_decode.get_stats(),
        }

    def reset_kv_peak_stats(self) -> None:
        """Starts a new KV peak measurement (`kv_peak_*` and `kv_waste_at_peak` in stats())."""
        self.kv_cache_manager.reset_peak_usage()

    # ---- the step ---------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> SchedulerOutput:
        return prepare_step(self.features, self.scheduler.schedule())

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """The next step, scheduled while `in_flight` runs (AsyncScheduler), or None: then
        update `in_flight` and call schedule(). The synchronous Scheduler always says None."""
        return self.scheduler.schedule_ahead(in_flight)

    def fill_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fills the step's grammar bitmask (on the loop, while the forward runs: the
        runner waits for it only at sampling time). Never raises."""
        if scheduler_output.grammar_bitmask is not None:
            scheduler_output.grammar_bitmask.fill()

    def execute(self, scheduler_output: SchedulerOutput,
                before_layers: Callable[[], None] | None = None,
                ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Runs the step (off the loop); `before_layers()` is called once its inputs are
        ready and embedded, right before the model's layers. On CUDA the output may still
        be on its way (AsyncModelRunnerOutput: AsyncEngine awaits it off the loop)."""
        return self.runner.execute_model(scheduler_output, before_layers)

    def update(self, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def fail_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> list[Request]:
        """A forward failed: fail every request in it (not the engine). Their blocks may hold
        unwritten KV, so their prefix-cache entries are dropped too."""
        failed = []
        for item in scheduler_output.scheduled:
            request = item.request
            if request.is_finished:
                continue
            request.error = f"{type(error).__name__}: {error}"
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR,
                                           discard_cache=True)
            failed.append(request)
        return _with_pending_forks(failed)

    def take_failed(self) -> list[Request]:
        failed, self.scheduler.newly_failed = self.scheduler.newly_failed, []
        return _with_pending_forks(failed)

    def step(self) -> tuple[list[EngineCoreOutput], list[Request]]:
        """One synchronous step (for LLM and tests): outputs and newly failed requests."""
        scheduler_output = self.schedule()
        failed = self.take_failed()
        if scheduler_output.is_empty:
            return [], failed
        self.fill_bitmask(scheduler_output)  # no overlap in the synchronous path
        try:
            runner_output = resolve_now(self.execute(scheduler_output))
        except Exception as e:  # noqa: BLE001 - one bad batch must not take the engine down
            logger.exception("forward failed")
            return [], failed + self.fail_step(scheduler_output, e)
        return self.update(scheduler_output, runner_output), failed


def enabled_features(args: EngineArgs, lora: LoRAManager | None, tokenizer: Any,
                     vocab_size: int, eos_token_ids: set[int],
                     ) -> tuple[StructuredOutputManager, tuple[EngineFeature, ...]]:
    """The features `args` enables, in the order their hooks run and their stats are
    listed: structured output (always: a request asks for it), then LoRA when
    --enable-lora (`lora`: made before the model, which builds its projections through
    it). Also the structured one on its own: the grammar compiler, which benchmarks time."""
    # Grammars allow EOS only where they may end; compiles run in their own workers.
    structured = StructuredOutputManager(
        tokenizer, vocab_size, eos_token_ids, jump_forward=args.structured_jump_forward,
        compile_timeout_s=args.structured_outputs_compile_timeout)
    return structured, (structured,) if lora is None else (structured, lora)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _with_pending_forks(failed: list[Request]) -> list[Request]:
    """A failed first sample takes its never-started forks down with it."""
    out = []
    for request in failed:
        out.append(request)
        for fork in request.pending_forks:
            fork.status, fork.error = request.status, request.error
            out.append(fork)
        request.pending_forks = []
    return out


def _weight_storages(model: torch.nn.Module) -> str | None:
    """The projections' storages where a GGUF file's own block types run natively
    ("gguf bfloat16, q4_k, q6_k"), else None (one float dtype: the engine's)."""
    from aioengine.model.layers import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not any(getattr(m, "blocks", None) is not None for m in linears):
        return None
    names = {part for m in linears for part in m.storage.removeprefix("mixed:").split("+")}
    return "gguf " + ", ".join(sorted(names))


def _bundled(model: str | None) -> bool:
    """Whether `model` is the bundled SmolLM2. It keeps its bf16 load by default: run natively
    (its Q4_1 projections, its Q8_0 tied head, x quantized per 32-block) it answers "What is
    the capital of France?" greedily with "L'Etoile, la Marseillaise, ..." (as llama-server
    does on the same file), the bf16 load with "Paris". `-q gguf` runs it natively."""
    from aioengine.model.default import is_bundled_model
    from aioengine.model.loader import resolve_model_path

    try:
        return is_bundled_model(resolve_model_path(model))
    except Exception:  # an unresolvable path: the loader reports it
        return False
