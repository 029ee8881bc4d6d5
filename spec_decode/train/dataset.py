"""The shards in memory, the draft vocabulary, and padded training batches.

Recorded shards carry the target's aux states and top-k labels; online ones (token ids
only) get them per batch from a `Recorder` (data.record_sequences over the batch)."""
from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# A sequence counts as greedy when its response tokens are the target's top-1 this often
# (recorded in one batched prefill, a near-tie can flip between batch shapes).
GREEDY_MATCH = 0.97

# Online data: whole sequences -> {"aux", "topk_ids", "topk_probs"}, rows in sequence order.
Recorder = Callable[[list[list[int]]], dict[str, Tensor]]


@dataclass
class Dataset:
    input_ids: Tensor  # [N] int64
    aux: Tensor | None  # [N, A * H] bf16; None: online (token ids only)
    topk_ids: Tensor | None  # [N, K] int64
    topk_probs: Tensor | None  # [N, K] fp16
    starts: list[int]
    lens: list[int]
    prompt_lens: list[int]
    greedy: list[bool]

    @classmethod
    def load(cls, directory: str) -> Dataset:
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(directory)
                       if f.startswith("shard_") and f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no shard_*.safetensors in {directory}")
        parts = [load_file(os.path.join(directory, f)) for f in files]
        ids = torch.cat([p["input_ids"] for p in parts]).long()
        lens = [int(x) for p in parts for x in p["seq_lens"]]
        prompt_lens = [int(x) for p in parts for x in p["prompt_lens"]]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        if "aux" not in parts[0]:  # online: greedy as generated
            greedy = [bool(x) for p in parts for x in p["greedy"]]
            return cls(ids, None, None, None, starts, lens, prompt_lens, greedy)
        topk_ids = torch.cat([p["topk_ids"] for p in parts]).long()
        greedy = []
        for s, n, p in zip(starts, lens, prompt_lens):
            resp = ids[s + p:s + n]
            pred = topk_ids[s + p - 1:s + n - 1, 0]
            greedy.append(bool((resp == pred).float().mean() >= GREEDY_MATCH)
                          if n > p else False)
        return cls(ids, torch.cat([p["aux"] for p in parts]), topk_ids,
                   torch.cat([p["topk_probs"] for p in parts]), starts, lens, prompt_lens,
                   greedy)

    @property
    def online(self) -> bool:
        return self.aux is None

    def sequence(self, i: int) -> list[int]:
        return self.input_ids[self.starts[i]:self.starts[i] + self.lens[i]].tolist()

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def max_len(self) -> int:
        return max(self.lens)

    def response_tokens(self) -> Tensor:
        return torch.cat([self.input_ids[s + p:s + n]
                          for s, n, p in zip(self.starts, self.lens, self.prompt_lens)])

    def coverage(self, draft_ids: Tensor | None) -> float:
        """Share of the response tokens inside the draft vocabulary."""
        if draft_ids is None:
            return 1.0
        tokens = self.response_tokens()
        inside = torch.zeros(int(max(tokens.max(), draft_ids.max())) + 1, dtype=torch.bool)
        inside[draft_ids] = True
        return float(inside[tokens].float().mean())


def draft_vocabulary(data: Dataset, vocab_size: int, size: int) -> Tensor | None:
    """The `size` most frequent target tokens of the responses (and of their top-k labels,
    to break ties among rare ones), in increasing id order; None for the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    counts = torch.bincount(data.response_tokens(), minlength=vocab_size).double()
    if data.topk_ids is not None:
        counts += 1e-3 * torch.bincount(data.topk_ids[:, 0], minlength=vocab_size).double()
    return counts.topk(size).indices.sort().values


@dataclass
class Batch:
    """Sequences padded to [B, T]: input ids, aux states, labels, lengths."""

    input_ids: Tensor  # [B, T]
    aux: Tensor  # [B, T, A * H]
    topk_ids: Tensor  # [B, T, K]
    topk_probs: Tensor  # [B, T, K]
    lens: Tensor  # [B]
    prompt_lens: Tensor  # [B]
    greedy: Tensor  # [B] bool

    @property
    def num_tokens(self) -> int:
        return int(self.lens.sum())

    def step_mask(self, j: int) -> Tensor:
        """[B, T]: origins t from which draft step j is trained: drafting starts after the
        first response token (t >= prompt_len - 1) and the predicted token t + 2 + j exists."""
        t = torch.arange(self.input_ids.shape[1])
        return (t >= self.prompt_lens[:, None] - 1) & (t + 2 + j < self.lens[:, None])

    def labels(self, j: int, rows: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """The target's top-k at position t + 1 + j (its prediction of token t + 2 + j)."""
        b, t = rows
        return self.topk_ids[b, t + 1 + j], self.topk_probs[b, t + 1 + j]

    def greedy_rows(self, flat_origins: Tensor) -> Tensor:
        """Which of the origins (flattened b * T + t) lie in greedy sequences."""
        return self.greedy[flat_origins // self.input_ids.shape[1]]


def make_batches(data: Dataset, batch_tokens: int, seed: int, epoch: int,
                 shuffle: bool = True) -> list[list[int]]:
    """Sequences of similar length grouped into batches of <= batch_tokens once padded (at
    least one sequence each), as sequence indices (`pad` builds one); the order of the
    batches shuffled by (seed, epoch)."""
    order = sorted(range(data.num_seqs), key=lambda i: data.lens[i])
    groups: list[list[int]] = []
    for i in order:
        longest = data.lens[i]
        if groups and (len(groups[-1]) + 1) * longest <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    if shuffle:
        random.Random(seed * 100003 + epoch).shuffle(groups)
    return groups


def pad(data: Dataset, idx: list[int], recorder: Recorder | None = None) -> Batch:
    """The padded batch of sequences `idx`; online data takes its aux states and labels
    from `recorder`."""
    if data.online:
        if recorder is None:
            raise ValueError("online data (token ids only) needs a recorder")
        rec = recorder([data.sequence(i) for i in idx])
        aux_all, ids_all, probs_all = rec["aux"], rec["topk_ids"].long(), rec["topk_probs"]
        offsets = [0]
        for i in idx:
            offsets.append(offsets[-1] + data.lens[i])
    else:
        aux_all, ids_all, probs_all = data.aux, data.topk_ids, data.topk_probs
        offsets = [data.starts[i] for i in idx]
    t = max(data.lens[i] for i in idx)
    b, width, k = len(idx), aux_all.shape[1], ids_all.shape[1]
    ids = torch.zeros(b, t, dtype=torch.long)
    aux = torch.zeros(b, t, width, dtype=aux_all.dtype)
    tk = torch.zeros(b, t, k, dtype=torch.long)
    tp = torch.zeros(b, t, k, dtype=probs_all.dtype)
    for row, i in enumerate(idx):
        s, n, o = data.starts[i], data.lens[i], offsets[row]
        ids[row, :n] = data.input_ids[s:s + n]
        aux[row, :n] = aux_all[o:o + n]
        tk[row, :n] = ids_all[o:o + n]
        tp[row, :n] = probs_all[o:o + n]
    return Batch(ids, aux, tk, tp, torch.tensor([data.lens[i] for i in idx]),
                 torch.tensor([data.prompt_lens[i] for i in idx]),
                 torch.tensor([data.greedy[i] for i in idx]))
