"""A minimal stand-in for scheduler + runner, to drive our model through paged steps in tests.

Each sequence gets shuffled, non-contiguous physical blocks; each step runs decodes first,
then prefill chunks of the sizes a test asks for; greedy sampling at chunk ends.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import LlamaForCausalLM, make_kv_caches


@dataclass
class Seq:
    token_ids: list[int]
    num_prompt: int
    max_new_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    # Logits [V] of every position that sampled, in order.
    sampled_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.max_new_tokens


class PagedDriver:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 128, block_size: int = 4,
                 seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_caches = make_kv_caches(model.arch, num_blocks, block_size, torch.float32,
                                        torch.device("cpu"))
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        self.free_blocks = free

    def _ensure_blocks(self, seq: Seq, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.free_blocks.pop())

    @torch.inference_mode()
    def step(self, work: list[tuple[Seq, int]]) -> None:
        """Runs one forward over `work` = [(seq, num_new_tokens)], decodes first."""
        work = sorted(work, key=lambda w: w[1] != 1)  # stable: decodes first
        for seq, n in work:
            self._ensure_blocks(seq, seq.num_computed + n)
        input_ids = torch.tensor(
            [t for s, n in work for t in s.token_ids[s.num_computed:s.num_computed + n]])
        meta, positions = build_attention_metadata(
            [n for _, n in work], [s.num_computed + n for s, n in work],
            [s.block_ids for s, _ in work], self.block_size, torch.device("cpu"))
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        for i, (seq, n) in enumerate(work):
            seq.num_computed += n
            if seq.num_computed == len(seq.token_ids) and not seq.done:
                last = meta.query_start_loc_cpu[i + 1] - 1
                logits = self.model.compute_logits(hidden[last:last + 1])[0]
                seq.sampled_logits.append(logits)
                seq.token_ids.append(int(logits.argmax()))

    def run(self, seqs: list[Seq], chunk_sizes: list[int]) -> None:
        """Steps until every seq is done; prefill chunk sizes cycle through `chunk_sizes`."""
        step = 0
        while not all(s.done for s in seqs):
            work = []
            for j, seq in enumerate(seqs):
                left = len(seq.token_ids) - seq.num_computed
                if seq.done or left == 0:
                    continue
                chunk = chunk_sizes[(step + j) % len(chunk_sizes)]
                work.append((seq, min(left, chunk)))
            self.step(work)
            step += 1
