"""`onednn` in `aioengine bench offline --engines`: the workload's projection GEMMs alone,
on torch's bf16 `linear` (oneDNN, which uses AMX tiles where the CPU has them). It is the
local ceiling of any engine that runs those GEMMs in bf16: an engine's total tok/s over
this one's is the share of a matmul-bound run it reaches. Not an engine: it generates
nothing, so it has no outputs and no agreement line.

The steps are estimated from the workload and the scheduler's budget, as our scheduler
and vLLM's form them when every request arrives at once: the prompts' tokens in chunks of
max_num_batched_tokens rows, the LM head once per request at the end of its prompt, then
output_len - 1 decode steps of min(requests, max_num_seqs) rows, each with the LM head.
Each row count's pass over every layer's projections (qkv, o, gate_up, down: the weights
of the model's shape, all layers' allocated, so a decode pass streams them from memory as
an engine's does) is timed once warm, best of `repeats`, and the steps' passes summed.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from aioengine.bench.datasets import Workload
from aioengine.bench.results import EngineResult
from aioengine.model.arch import ModelArchConfig

ONEDNN = "onednn"


def model_arch(model: str) -> ModelArchConfig:
    """The architecture of a GGUF file or a HF checkpoint directory."""
    if model.endswith(".gguf"):
        from aioengine.model.gguf_loader import load_gguf_parts

        return load_gguf_parts(model).arch
    from transformers import AutoConfig

    return ModelArchConfig.from_hf_config(AutoConfig.from_pretrained(model))


def step_rows(workload: Workload, max_num_batched_tokens: int,
              max_num_seqs: int) -> tuple[Counter[int], Counter[int]]:
    """(row counts of the layers' passes, row counts of the LM head's), each with how many
    steps have it."""
    prompt = workload.num_prompt_tokens
    layers: Counter[int] = Counter({max_num_batched_tokens: prompt // max_num_batched_tokens})
    if prompt % max_num_batched_tokens:
        layers[prompt % max_num_batched_tokens] += 1
    requests = len(workload.requests)
    head: Counter[int] = Counter({requests: 1})
    decode_steps = max(r.output_len for r in workload.requests) - 1
    rows = min(requests, max_num_seqs)
    if decode_steps > 0:
        layers[rows] += decode_steps
        head[rows] += decode_steps
    return +layers, +head


def projection_shapes(arch: ModelArchConfig) -> list[tuple[int, int]]:
    """One layer's projections as (out features, in features): qkv, o, gate_up, down."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    return [(q + 2 * kv, h), (h, q), (2 * arch.intermediate_size, h),
            (h, arch.intermediate_size)]


def best_pass_s(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Seconds of one pass of torch's linear over `weights` at `rows` rows of bf16 x, warm,
    best of `repeats`."""
    xs = {k: torch.randn(rows, k).bfloat16() for k in {w.shape[1] for w in weights}}
    for w in weights[:4]:  # warm: oneDNN picks and caches a kernel per shape
        torch.nn.functional.linear(xs[w.shape[1]], w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best


def run_onednn_ceiling(workload: Workload, model: str, max_num_batched_tokens: int,
                       max_num_seqs: int, repeats: int = 3) -> EngineResult:
    """The estimated time of the workload's GEMMs on torch's bf16 linear, as a result row."""
    arch = model_arch(model)
    layers, head = step_rows(workload, max_num_batched_tokens, max_num_seqs)
    # The values do not matter to the time; a constant fills 8B-scale weights in a blink.
    layer_weights = [torch.full(shape, 0.01, dtype=torch.bfloat16)
                     for _ in range(arch.num_hidden_layers)
                     for shape in projection_shapes(arch)]
    elapsed = sum(n * best_pass_s(layer_weights, rows, repeats) for rows, n in layers.items())
    del layer_weights
    lm_head = [torch.full((arch.vocab_size, arch.hidden_size), 0.01, dtype=torch.bfloat16)]
    elapsed += sum(n * best_pass_s(lm_head, rows, repeats) for rows, n in head.items())
    return EngineResult(engine=ONEDNN, num_requests=len(workload.requests),
                        num_prompt_tokens=workload.num_prompt_tokens,
                        num_output_tokens=sum(r.output_len for r in workload.requests),
                        elapsed_s=elapsed, threads=torch.get_num_threads(), outputs=[])
