"""The trainer's prompts, draft vocabulary and batch masks (spec_decode/train/), and the
`aioengine train-eagle` entry point."""
from __future__ import annotations

import pytest
import torch

from aioengine.cli import main as cli_main
from aioengine.spec_decode.train.dataset import Dataset, draft_vocabulary, make_batches, pad
from aioengine.spec_decode.train.cli import corpus_training_prompts
from aioengine.spec_decode.train.corpus import corpus_prompts
from aioengine.spec_decode.train.prompts import (HELD_OUT_TOPICS, clean_self_prompt,
                                                 shipped_prompts, split_prompts)


def test_held_out_prompts_never_reach_training() -> None:
    train, held = split_prompts(seed=0)
    assert len(held) == 65 and not set(train) & set(held)
    assert len(set(train)) == len(train) > 1000
    assert not any(topic in p for p in train for topic in HELD_OUT_TOPICS)
    assert split_prompts(seed=0) == (train, held)  # seeded
    assert split_prompts(seed=1)[0] != train and split_prompts(seed=1)[1] == held


def test_corpus_prompts_are_many_varied_and_never_the_benchmarks() -> None:
    train, held = split_prompts(seed=0)
    corpus = corpus_training_prompts(held, seed=0)
    shipped = set(shipped_prompts())
    assert len(corpus) >= 10_000 and len(set(corpus)) == len(corpus)
    assert not (set(corpus) & (shipped | set(held)))
    assert not any(t.lower() in p.lower() for p in corpus for t in HELD_OUT_TOPICS)
    sources = corpus_prompts(HELD_OUT_TOPICS, shipped, seed=0)
    assert all(len(v) > 200 for v in sources.values()), {k: len(v) for k, v in sources.items()}
    # Input-grounded prompts quote real text (a passage of Python's documentation).
    assert any("Python documentation" in p and len(p) > 300 for p in sources["python_docs"])
    assert corpus_training_prompts(held, seed=0) == corpus  # seeded


def test_online_batches_take_aux_and_labels_from_the_recorder() -> None:
    seqs, prompt_lens = [[4, 5, 6], [7, 8]], [1, 1]
    ids = torch.tensor([t for s in seqs for t in s])
    data = Dataset(ids, None, None, None, [0, 3], [3, 2], prompt_lens, [True, False])
    seen = []

    def recorder(batch: list[list[int]]) -> dict[str, torch.Tensor]:
        seen.append(batch)
        flat = torch.tensor([t for s in batch for t in s], dtype=torch.float32)
        return {"aux": flat[:, None].repeat(1, 4).to(torch.bfloat16),
                "topk_ids": (flat[:, None] + 1).long(), "topk_probs": torch.ones(len(flat), 1)}

    assert data.online
    with pytest.raises(ValueError, match="recorder"):
        pad(data, [0, 1])
    batch = pad(data, [1, 0], recorder)
    assert seen == [[[7, 8], [4, 5, 6]]]
    assert batch.input_ids.tolist() == [[7, 8, 0], [4, 5, 6]]
    assert batch.aux[:, :, 0].tolist() == [[7, 8, 0], [4, 5, 6]]
    assert batch.topk_ids[:, :, 0].tolist() == [[8, 9, 0], [5, 6, 7]]
    assert batch.greedy.tolist() == [False, True]


def test_clean_self_prompt() -> None:
    assert clean_self_prompt(' "Question: How do tides work?" ') == "How do tides work?"
    assert clean_self_prompt("ok") is None
    assert clean_self_prompt("x" * 500) is None


def _dataset(seqs: list[list[int]], prompt_lens: list[int], k: int = 2) -> Dataset:
    ids = torch.tensor([t for s in seqs for t in s])
    n = ids.numel()
    starts = [sum(len(s) for s in seqs[:i]) for i in range(len(seqs))]
    return Dataset(ids, torch.zeros(n, 4, dtype=torch.bfloat16),
                   torch.zeros(n, k, dtype=torch.long), torch.ones(n, k, dtype=torch.float16),
                   starts, [len(s) for s in seqs], prompt_lens, [True] * len(seqs))


def test_draft_vocabulary_is_the_most_frequent_response_tokens() -> None:
    # Prompt tokens (9) do not count; 5 is the most frequent response token, then 7.
    data = _dataset([[9, 9, 5, 5, 7], [9, 5, 7, 3]], [2, 1])
    assert draft_vocabulary(data, 10, 2).tolist() == [5, 7]  # increasing ids
    assert draft_vocabulary(data, 10, 0) is None and draft_vocabulary(data, 10, 10) is None
    assert data.coverage(torch.tensor([5, 7])) == pytest.approx(5 / 6)


def test_step_masks_start_after_the_first_response_token() -> None:
    data = _dataset([[1, 2, 3, 4, 5, 6], [1, 2, 3]], [2, 1])
    (group,) = make_batches(data, 64, seed=0, epoch=0)
    batch = pad(data, group)
    row = group.index(0)
    # Origins t >= prompt_len - 1 = 1 whose predicted token t + 2 + j exists (< 6).
    assert batch.step_mask(0)[row].nonzero().flatten().tolist() == [1, 2, 3]
    assert batch.step_mask(2)[row].nonzero().flatten().tolist() == [1]
    other = group.index(1)
    assert batch.step_mask(0)[other].nonzero().flatten().tolist() == [0]
    assert batch.input_ids[other].tolist() == [1, 2, 3, 0, 0, 0]


def test_batches_respect_the_token_budget_and_shuffle_by_epoch() -> None:
    data = _dataset([[1] * n for n in (3, 4, 5, 6, 7, 8, 9, 10)], [1] * 8)
    for epoch in range(3):
        groups = make_batches(data, 16, seed=0, epoch=epoch)
        assert sorted(i for g in groups for i in g) == list(range(8))
        assert all(len(g) * max(data.lens[i] for i in g) <= 16 for g in groups)
    assert make_batches(data, 16, 0, 0) == make_batches(data, 16, 0, 0)


def test_train_eagle_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train-eagle", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for knob in ("--draft-vocab-size", "--ttt-steps", "--temperature", "--max-train-minutes"):
        assert knob in out
