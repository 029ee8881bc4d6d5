"""Turns a SchedulerOutput into one forward pass and the sampled tokens.

Runs off the event loop (a worker thread on CPU), so it reads only the snapshot in the
SchedulerOutput plus request fields the loop does not change during a step.

    flattened step (decodes first, then prefill chunks), T tokens:
    input_ids   [ d0 | d1 | s0 s0 s0 | p0 p0 p0 p0 | p1 p1 ]
    sample rows [ d0 | d1 | s0 s0 s0 |          p0 |       ]  <- only where a chunk ends
    attention   [ decode rows ........ | prefill chunks      ]

On CUDA, steps are launched on the runner's stream from pinned inputs and the runner does
not wait for them: plain sampling steps return an AsyncModelRunnerOutput whose sampled ids
are copied back on a copy stream (worker/async_output.py), and a step scheduled ahead reads
its input ids on the device from the step before it (`_input_ids`).

s0 is a decode with two drafts (speculative decoding): each of its positions is its own
decode row (its own position and seq_len, the request's block table) and is sampled; the
rejection sampler (aioengine.spec_decode) keeps the drafts the target agrees with. After
sampling, the proposer (if any) drafts the next step's tokens. All three are the runner's
part of speculative decoding, `spec_decode` (worker/verify.py's DraftVerifier).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from aioengine.sched.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from aioengine.engine.features import EngineFeature
from aioengine.model.attention import build_attention_metadata, to_device
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import LoadedModel
from aioengine.pooling_params import chunk_share
from aioengine.request import Request
from aioengine.structured import GrammarBitmask
from aioengine.sample import (Sampler, SamplingMetadata, SamplingRow,
                              compute_prompt_logprobs, greedy_tokens, is_plain_greedy,
                              make_generator)
from aioengine.spec_decode.proposer import ProposeContext, Proposer
from aioengine.worker.async_output import AsyncModelRunnerOutput, HostCopier
from aioengine.worker.runner_outputs import (PlainSample, plain_tensors, read_plain,
                                             to_position_logprobs)
from aioengine.worker.cuda_graphs import CUDAGraphRunner
from aioengine.worker.spec_tree import num_tree_scratch_blocks
from aioengine.worker.verify import DraftVerifier, DraftVerifyContext
from aioengine.worker.step_layout import LayerKVGroups, copy_blocks, step_layout

# The CPU warm-up's multiply-adds: 128 tokens of the bundled 135M model; a larger model
# warms up on fewer tokens (16 at least), since the first step of any size pays the most.
_CPU_WARM_UP_MACS = 18 * 10**9


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int,
                 device: torch.device, kv_cache_dtype: torch.dtype, seed: int = 0,
                 proposer: Proposer | None = None, features: Sequence[EngineFeature] = (),
                 async_output: bool | None = None,
                 kv_groups: Sequence[tuple[tuple[int, ...], int]] = ()) -> None:
        """`kv_groups`: with KV cache groups (kv/kv_cache_groups.py), each group's layers
        and number of blocks, group 0 first (`num_blocks` is then group 0's)."""
        self.model = loaded.model
        # The engine's features, around each forward (begin_execute / end_execute): LoRA
        # puts the step's adapters in slots and sets every token's slot.
        self.features = tuple(features)
        self.arch = loaded.arch
        self.device = device
        self.block_size = block_size
        self.vocab_size = loaded.arch.vocab_size
        # Each layer's KV cache group (None: one group, `num_blocks` blocks in every layer).
        self.kv_groups = LayerKVGroups(kv_groups, loaded.arch.num_hidden_layers) \
            if kv_groups else None
        # Past the pool's blocks: scratch for the C kernel's tree rows (worker/spec_tree.py).
        scratch = 0 if kv_groups or proposer is None else num_tree_scratch_blocks(
            proposer.tree, block_size)
        layer_blocks = self.kv_groups.layer_blocks if self.kv_groups else num_blocks + scratch
        # The blocks every layer has (warm_up writes only those).
        self.num_blocks = min(self.kv_groups.layer_blocks) if self.kv_groups else num_blocks
        self.kv_caches = make_kv_caches(loaded.arch, layer_blocks, block_size, kv_cache_dtype,
                                        device)
        # Unseeded requests share this generator (engine seed); seeded ones have their own.
        self.sampler = Sampler(torch.Generator(device).manual_seed(seed))
        # Speculative decoding's part in the step (worker/verify.py): lays out, verifies
        # and proposes drafts. None: no drafts.
        self.spec_decode = DraftVerifier(proposer, DraftVerifyContext(
            self.vocab_size, device, self.sampler.generator, self.kv_caches, block_size),
            list(range(num_blocks, num_blocks + scratch))) if proposer is not None else None
        # On CUDA the forward is issued on its own stream (from the worker thread).
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # KV caches zeroed
        # Plain sampling steps return an AsyncModelRunnerOutput (default: on CUDA), their
        # ids copied back by `copier` while the worker goes on; else the lists, at once.
        self.async_output = device.type == "cuda" if async_output is None else async_output
        self.copier = HostCopier(device)
        # CUDA graphs of decode steps (capture_cuda_graphs); None: every step eager.
        self.cuda_graphs: CUDAGraphRunner | None = None
        # The last step run, its sampled ids on the device and each request's row in them:
        # the input ids of a step scheduled ahead, gathered there without a host round trip.
        self._last_step_id: int | None = None
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._plain: list[PlainSample] = []

    def execute_model(self, scheduler_output: SchedulerOutput,
                      before_layers: Callable[[], None] | None = None,
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """`before_layers()` runs once the inputs are ready, right before the model's
        layers (after the embedding lookup: LlamaForCausalLM.forward calls it)."""
        begun: list[EngineFeature] = []
        try:
            for feature in self.features:
                feature.begin_execute(scheduler_output)
                begun.append(feature)
            if self.stream is None:
                return self._execute(scheduler_output, before_layers)
            with torch.cuda.stream(self.stream):
                return self._execute(scheduler_output, before_layers)
        finally:
            for feature in reversed(begun):
                feature.end_execute(scheduler_output)

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput,
                 before_layers: Callable[[], None] | None,
                 ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        # With async output (CUDA) every phase is launch time; the device time lands in the
        # loop's "wait".
        start = time.perf_counter()
        self._plain = []
        scheduled = scheduler_output.scheduled
        if self.kv_groups is not None:
            self.kv_groups.copy_blocks(self.kv_caches, scheduler_output.blocks_to_copy)
        elif scheduler_output.blocks_to_copy:
            src, dst = zip(*scheduler_output.blocks_to_copy)
            copy_blocks(self.kv_caches, list(src), list(dst))
        input_ids = self._input_ids(scheduler_output)
        query_lens, seq_lens, block_tables, item_starts = step_layout(scheduled)
        attn_metadata, positions = build_attention_metadata(
            query_lens=query_lens, seq_lens=seq_lens, block_tables=block_tables,
            block_size=self.block_size, device=self.device)
        if self.kv_groups is not None:
            attn_metadata.layer_metas = self.kv_groups.layer_metas(
                scheduled, query_lens, seq_lens, attn_metadata, self.block_size, self.device)
        if self.spec_decode is not None:
            positions = self.spec_decode.lay_out(scheduled, item_starts, attn_metadata,
                                                 positions)
        prepared = time.perf_counter()
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(attn_metadata):
            hidden = self.cuda_graphs.run(input_ids, positions, attn_metadata, before_layers)
            executor = "cuda_graph"
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, attn_metadata,
                                before_layers=before_layers)
            executor = self.model.last_executor
        aux_hidden = None
        if isinstance(hidden, tuple):  # the model hands out auxiliary layers' hidden states
            hidden, aux_hidden = hidden
        forwarded = time.perf_counter()

        output = ModelRunnerOutput(sampled_token_ids={}, executor=executor)
        self._sample(scheduled, hidden, item_starts, output, scheduler_output.grammar_bitmask)
        self._prompt_logprobs(scheduled, hidden, item_starts, output)
        self._pool(scheduled, hidden, item_starts, output)
        sampled = time.perf_counter()
        drafter = self.spec_decode if scheduler_output.propose_drafts else None
        plain, self._plain = self._plain, []
        self._last_step_id = scheduler_output.step_id
        if plain and self.async_output and drafter is None:
            # Only the sampled ids are still on the device: hand the output over unread.
            hosts, event = self.copier.copy(
                [t for sample in plain for t in plain_tensors(sample)])
            output.timings = {"prepare": prepared - start, "forward": forwarded - prepared,
                              "sample": time.perf_counter() - forwarded, "propose": 0.0}
            return AsyncModelRunnerOutput(event, lambda: read_plain(plain, hosts, output))
        if plain:
            read_plain(plain, [t for sample in plain for t in plain_tensors(sample)], output)
        if drafter is not None:
            drafter.propose(ProposeContext(
                scheduled=scheduled, sampled_token_ids=output.sampled_token_ids,
                item_starts=item_starts, input_ids=input_ids, positions=positions,
                hidden=hidden, aux_hidden=aux_hidden, attn_metadata=attn_metadata,
                accepted_tree_nodes=output.accepted_tree_nodes), output)
        output.timings = {"prepare": prepared - start, "forward": forwarded - prepared,
                          "sample": sampled - forwarded, "propose": time.perf_counter() - sampled}
        return output

    def _input_ids(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """The step's tokens; a step scheduled ahead takes them from the step before it,
        which must be the last one run (a failed one leaves nothing to take): gathered on
        the device from that step's sampled ids, which the host may not have yet."""
        last_step, self._last_step_id = self._last_step_id, None
        last_sampled, self._last_sampled = self._last_sampled, None
        if scheduler_output.follows_step is None:
            ids = [t for s in scheduler_output.scheduled for t in s.token_ids]
            return to_device(torch.tensor(ids, dtype=torch.long), self.device)
        if last_step != scheduler_output.follows_step or last_sampled is None:
            raise RuntimeError(f"step {scheduler_output.step_id} was scheduled after step "
                               f"{scheduler_output.follows_step}, which did not complete")
        sampled, row_of = last_sampled
        rows = [row_of[s.request.request_id] for s in scheduler_output.scheduled]
        return sampled[to_device(torch.tensor(rows, dtype=torch.long), self.device)]

    def capture_cuda_graphs(self, capture_sizes: list[int], max_model_len: int,
                            capture: bool = True) -> None:
        """Decode steps of up to max(capture_sizes) requests replay CUDA graphs from now on
        (capture=False, off CUDA: the same padded buffers, run eagerly)."""
        self.cuda_graphs = CUDAGraphRunner(self.model, self.kv_caches, capture_sizes,
                                           max_model_len, self.block_size, self.device,
                                           capture=capture)
        if self.stream is None:
            self.cuda_graphs.capture()
            return
        with torch.cuda.stream(self.stream):
            self.cuda_graphs.capture()

    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int, max_model_len: int) -> int:
        """vLLM's dummy run, at start-up: one step of `max_num_tokens` prompt tokens (the
        largest the scheduler makes; as few requests as max_model_len allows, fewer tokens
        if the KV cache is smaller), then a decode step over those requests, each with its
        LM head rows. Returns the tokens of the first step.

        The first step of that size pays one-time costs that would otherwise land on the
        first requests: the matmul libraries' kernel generation for large shapes and the
        allocator's growth to a full step's activations (measured on 2 CPU cores: the first
        512-token step took up to 1.2 s where the next ones took ~0.65 s). The KV blocks it
        wrote are zeroed again; no request or hash ever saw them.

        On the CPU at most 128 tokens, since only that much pays (issue 27): most of
        the one-time cost is the first step of any size (oneDNN's and libgomp's set-up, the
        C kernels' first calls: a first 32-token step took 3-5 s on a loaded 2-core VM where
        a 37-token step right after took 1.3 s), while a 512-token step computes 4x a
        128-token one for a saving only the first 512-token step sees (~0.5 s). Fewer for a
        larger model (`_CPU_WARM_UP_MACS`): a 1B model's 128-token step alone took 2.9 s of
        an 8 s start. On a GPU the full step runs: gpu_memory profiles the largest step's
        peak memory with it.
        """
        bs = self.block_size
        if self.device.type == "cpu":
            macs = sum(lin.in_features * lin.out_features for lin in self.model.linears()
                       if lin is not self.model.embed_tokens or lin is self.model.lm_head)
            max_num_tokens = min(max_num_tokens, 128,
                                 max(16, _CPU_WARM_UP_MACS // max(1, macs)))
        per_request = max(1, min(max_model_len, max_num_tokens))

        def split(num_tokens: int) -> list[int]:
            return [min(per_request, num_tokens - start)
                    for start in range(0, num_tokens, per_request)]

        def blocks(lens: list[int]) -> list[int]:
            return [-(-n // bs) for n in lens]

        num_tokens = max_num_tokens  # halved until it fits (1 token fits: num_blocks >= 1)
        while num_tokens > 1 and sum(blocks(split(num_tokens))) > self.num_blocks:
            num_tokens //= 2
        lens = split(num_tokens)
        tables, first = [], 0
        for n in blocks(lens):
            tables.append(list(range(first, first + n)))
            first += n
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        for query_lens in (lens, [1] * len(lens)):  # the prompts, then one decode each
            meta, positions = build_attention_metadata(query_lens, lens, tables, bs, self.device)
            hidden = self.model(input_ids[:sum(query_lens)], positions, self.kv_caches, meta)
            if isinstance(hidden, tuple):  # (hidden, auxiliary layers' hidden states)
                hidden = hidden[0]
            last = torch.tensor(meta.query_start_loc_cpu[1:], device=self.device) - 1
            self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        for cache in self.kv_caches:
            cache[:, :first].zero_()
        return num_tokens

    def _sample(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor,
                item_starts: list[int], output: ModelRunnerOutput,
                grammar_bitmask: GrammarBitmask | None = None) -> None:
        """Logits for every row that samples (ScheduledRequest.num_logits_rows, in item
        order, as the grammar bitmask has them), then tokens: the Sampler for plain rows,
        the rejection sampler for items with drafts (worker/verify.py)."""
        spec = self.spec_decode
        row_index: list[int] = []
        rows: list[SamplingRow] = []
        owners: list[ScheduledRequest] = []
        for i, item in enumerate(scheduled):
            if item.num_samples == 0:
                continue
            end = item_starts[i + 1]
            if spec is not None and item.spec_token_ids:
                row_index.extend(range(end - len(item.spec_token_ids) - 1, end))
                rows.extend(self._sampling_row(item.request, path)
                            for path in spec.draft_paths(item))
            else:
                samples = [item.request] + item.request.pending_forks[:item.num_samples - 1]
                for sample in samples:
                    row_index.append(end - 1)
                    rows.append(self._sampling_row(sample))
            owners.append(item)
        if not rows:
            return
        # Logits only for the rows that sample; the LM head is the largest matmul. When every
        # row samples once, in order (decode steps), no gather: it cost 0.17 ms a step on
        # the CPU, right after a forward has streamed the weights through the caches.
        if row_index == list(range(hidden.shape[0])):
            sample_hidden = hidden
        else:
            sample_hidden = hidden[torch.tensor(row_index, device=self.device)]
        logits = self.model.compute_logits(sample_hidden)
        if grammar_bitmask is not None:
            # Before every sampling parameter, so logprobs are those of the masked logits.
            # Waits for the loop to finish filling the mask (it does so during the forward).
            grammar_bitmask.apply(logits)
        if spec is not None and any(item.spec_token_ids for item in owners):
            spec.sample(logits, rows, owners, output, self._sample_plain)
            return
        self._sample_plain(logits, rows, owners, output, grammar_bitmask is not None)

    def _sample_plain(self, logits: torch.Tensor, rows: list[SamplingRow],
                      owners: list[ScheduledRequest], output: ModelRunnerOutput,
                      masked: bool) -> None:
        """One token per row through the Sampler (1, or 1 + forks, per item), left on the
        device: `_execute` reads them (`read_plain`) at once or hands them over unread."""
        lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if not masked and all(is_plain_greedy(row) for row in rows):
            sampled = greedy_tokens(logits)
        else:
            metadata = SamplingMetadata.build(rows, self.vocab_size, self.device)
            result = self.sampler(logits, metadata)
            sampled = result.sampled_token_ids
            if (result.logprob_token_ids is not None and result.logprobs is not None
                    and result.sampled_token_ranks is not None):
                lp = (result.logprob_token_ids, result.logprobs, result.sampled_token_ranks)
        row_of, r = {}, 0
        for item in owners:
            row_of[item.request.request_id] = r
            r += item.num_samples
        self._last_sampled = sampled, row_of
        self._plain.append((sampled, lp, owners))

    def _sampling_row(self, request: Request, drafts: list[int] | None = None) -> SamplingRow:
        """The row of `request`'s next token; with `drafts`, of the token after them (they
        count as output tokens: penalties and min_tokens see them as a later step would)."""
        params = request.sampling_params
        if params.seed is not None and request.generator is None:
            request.generator = make_generator(params.seed, self.device)
        outputs = request.output_token_ids + drafts if drafts else request.output_token_ids
        return SamplingRow(params=params, prompt_token_ids=request.prompt_token_ids,
                           output_token_ids=outputs, generator=request.generator)

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor,
                         item_starts: list[int], output: ModelRunnerOutput) -> None:
        """Position p of the prompt predicts prompt token p + 1: a chunk covering
        positions [start, end) yields entries for tokens start+1 .. min(end, P-1)."""
        for i, item in enumerate(scheduled):
            if not item.want_prompt_logprobs:
                continue
            request = item.request
            start = item.num_computed_tokens
            end = min(start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if end <= start:
                output.prompt_logprobs[request.request_id] = []
                continue
            rows = hidden[item_starts[i]:item_starts[i] + end - start]
            targets = torch.tensor(request.prompt_token_ids[start + 1:end + 1],
                                   dtype=torch.long, device=self.device)
            k = request.sampling_params.prompt_logprobs or 0
            ids, lps, ranks = compute_prompt_logprobs(self.model.compute_logits(rows), targets, k)
            output.prompt_logprobs[request.request_id] = to_position_logprobs(ids, lps, ranks)

    @staticmethod
    def _pool(scheduled: list[ScheduledRequest], hidden: torch.Tensor,
              item_starts: list[int], output: ModelRunnerOutput) -> None:
        """Pooling requests: their chunk's share of the pooled vector, from the final-normed
        hidden states (no LM head, no sampling for them)."""
        for i, item in enumerate(scheduled):
            params = item.request.pooling_params
            if params is None:
                continue
            share = chunk_share(params, hidden[item_starts[i]:item_starts[i + 1]],
                                item.num_computed_tokens, item.request.num_prompt_tokens)
            if share is not None:
                output.pooler_output[item.request.request_id] = share
