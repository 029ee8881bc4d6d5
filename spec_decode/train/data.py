"""Training data by self-distillation: prompts -> the target's own responses through the
engine's batched decoding (greedy and sampled), then one prefill of each whole sequence
through the same model recording what the head reads and what it must predict.

A shard (`shard_NNNN.safetensors`, written once, skipped when present: generation resumes
where it stopped) holds S sequences of N tokens in all:

    input_ids    [N] int32    prompt + response tokens, sequences one after another
    seq_lens     [S] int32
    prompt_lens  [S] int32    the loss covers response tokens only
    greedy       [S] int8     1 for a greedy response
    aux          [N, A * H]   bfloat16: the residual stream into each aux layer
    topk_ids     [N, K] int32 the target's K most likely next tokens at each position
    topk_probs   [N, K] fp16  and their probabilities (the soft labels)

Online data (`DataConfig.record` False) stops after `greedy`: token ids only (a few bytes
a position instead of ~3.5 KB), and the trainer recomputes the last three for each batch
with `record_sequences` (as SpecForge and vLLM's speculators train online).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16


@dataclass
class DataConfig:
    out_dir: str
    temperature: float = 0.7  # of the sampled responses
    num_sampled: int = 1  # sampled responses per prompt, besides the greedy one
    max_tokens: int = 320
    top_k_labels: int = 8
    shard_prompts: int = 256
    seed: int = 0
    record: bool = True  # False: token ids only (online training)


def shard_path(out_dir: str, index: int) -> str:
    return os.path.join(out_dir, f"shard_{index:04d}.safetensors")


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


@torch.inference_mode()
def record_sequences(model: torch.nn.Module, sequences: list[list[int]],
                     aux_layers: tuple[int, ...], top_k: int,
                     max_batch_tokens: int = 2048) -> dict[str, Tensor]:
    """One prefill per packed batch of whole sequences through `model` (an aioengine
    LlamaForCausalLM): its aux hidden states (bf16) and top-k next-token probabilities."""
    arch = model.arch
    longest = max(len(s) for s in sequences)
    blocks_per_seq = -(-longest // BLOCK_SIZE)
    max_seqs = max(1, max_batch_tokens // longest)
    kv_caches = make_kv_caches(arch, blocks_per_seq * max_seqs, BLOCK_SIZE, torch.float32,
                               model.device)
    saved = model.aux_hidden_state_layers
    model.aux_hidden_state_layers = aux_layers
    aux_out, ids_out, probs_out = [], [], []
    try:
        for i in range(0, len(sequences), max_seqs):
            batch = sequences[i:i + max_seqs]
            lens = [len(s) for s in batch]
            tables = [list(range(j * blocks_per_seq, (j + 1) * blocks_per_seq))
                      for j in range(len(batch))]
            meta, positions = build_attention_metadata(lens, lens, tables, BLOCK_SIZE,
                                                       model.device)
            ids = torch.tensor([t for s in batch for t in s], device=model.device)
            hidden, aux = model(ids, positions, kv_caches, meta)
            aux_out.append(aux.to(torch.bfloat16))
            for chunk in hidden.split(512):
                probs = torch.softmax(model.compute_logits(chunk), dim=-1)
                p, t = probs.topk(top_k, dim=-1)
                ids_out.append(t.to(torch.int32))
                probs_out.append(p.to(torch.float16))
    finally:
        model.aux_hidden_state_layers = saved
    return {"aux": torch.cat(aux_out), "topk_ids": torch.cat(ids_out),
            "topk_probs": torch.cat(probs_out)}


def make_recorder(model_path: str, dtype: str, aux_layers: tuple[int, ...],
                  top_k: int) -> Callable[[list[list[int]]], dict[str, Tensor]]:
    """Online training's recorder: the target as the data was generated (its dtype), its
    aux states and top-k labels for a batch of whole sequences (record_sequences)."""
    from aioengine.dtypes import parse_dtype
    from aioengine.model.loader import load_model

    cpu = torch.device("cpu")
    model = load_model(model_path, parse_dtype(dtype.removeprefix("torch."), cpu), cpu).model

    def record(sequences: list[list[int]]) -> dict[str, Tensor]:
        return record_sequences(model, sequences, aux_layers, top_k,
                                max_batch_tokens=sum(len(s) for s in sequences))

    return record


def write_self_prompts(llm, topics: tuple[str, ...], per_topic: int, seed: int) -> list[str]:
    """Requests the target writes itself (sampled at temperature 1), cleaned, deduplicated."""
    from aioengine.sampling_params import SamplingParams
    from aioengine.spec_decode.train.prompts import clean_self_prompt, self_prompt_requests

    if per_topic <= 0:
        return []
    asks = [chat(p) for p in self_prompt_requests(topics)]
    params = SamplingParams(n=per_topic, temperature=1.0, top_p=0.95, max_tokens=60,
                            seed=seed)
    outs = llm.generate(asks, params)
    found = (clean_self_prompt(c.text) for o in outs for c in o.outputs)
    return list(dict.fromkeys(p for p in found if p))


def generate_data(llm, prompts: list[str], aux_layers: tuple[int, ...], cfg: DataConfig,
                  progress=None) -> dict[str, float]:
    """Writes the shards for `prompts` into cfg.out_dir (those already there are kept).
    Returns throughput figures: tokens generated per second and sequences recorded."""
    from safetensors.torch import save_file

    from aioengine.sampling_params import SamplingParams

    os.makedirs(cfg.out_dir, exist_ok=True)
    model = llm.model
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
    stats = {"generated_tokens": 0, "generate_s": 0.0, "recorded_tokens": 0, "record_s": 0.0}
    num_shards = -(-len(prompts) // cfg.shard_prompts)
    for index in range(num_shards):
        path = shard_path(cfg.out_dir, index)
        if os.path.exists(path):
            continue
        chunk = prompts[index * cfg.shard_prompts:(index + 1) * cfg.shard_prompts]
        t0 = time.perf_counter()
        sampled = SamplingParams(n=cfg.num_sampled, temperature=cfg.temperature,
                                 max_tokens=cfg.max_tokens, seed=cfg.seed + index)
        params = [greedy] * len(chunk) + ([sampled] * len(chunk) if cfg.num_sampled else [])
        asks = [chat(p) for p in chunk] * (2 if cfg.num_sampled else 1)
        outs = llm.generate(asks, params)
        sequences, prompt_lens, greedy_flags = [], [], []
        for j, out in enumerate(outs):
            for c in out.outputs:
                if c.token_ids:
                    sequences.append(list(out.prompt_token_ids) + list(c.token_ids))
                    prompt_lens.append(len(out.prompt_token_ids))
                    greedy_flags.append(int(j < len(chunk)))
        t1 = time.perf_counter()
        rec = (record_sequences(model, sequences, aux_layers, cfg.top_k_labels)
               if cfg.record else {})
        t2 = time.perf_counter()
        tensors = {"input_ids": torch.tensor([t for s in sequences for t in s],
                                             dtype=torch.int32),
                   "seq_lens": torch.tensor([len(s) for s in sequences], dtype=torch.int32),
                   "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
                   "greedy": torch.tensor(greedy_flags, dtype=torch.int8), **rec}
        save_file(tensors, path + ".tmp")
        os.replace(path + ".tmp", path)  # a shard is there whole or not at all
        generated = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
        stats["generated_tokens"] += generated
        stats["generate_s"] += t1 - t0
        stats["recorded_tokens"] += sum(len(s) for s in sequences)
        stats["record_s"] += t2 - t1
        if progress is not None:
            progress(index + 1, num_shards, generated / (t1 - t0),
                     sum(len(s) for s in sequences) / max(t2 - t1, 1e-9))
    return stats


def write_meta(out_dir: str, meta: dict) -> None:
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
