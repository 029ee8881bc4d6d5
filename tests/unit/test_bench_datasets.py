"""The benchmark's datasets and workloads (no model runs; the rest of the pure parts is in
test_bench.py)."""
from __future__ import annotations

import pytest

from aioengine.bench import build_parser
from aioengine.bench.datasets import (DATASETS, GROUNDED_FILE, PROMPTS_FILE, BenchRequest,
                                      Workload, build_workload, grounded_dataset,
                                      load_prompt_texts, normal_vocab, random_dataset,
                                      shared_prefix_dataset, text_dataset, with_text)
from aioengine.bench.report import format_offline
from tests.unit.bench_reports import VOCAB, offline_report


# ---- datasets --------------------------------------------------------------------------


def test_random_dataset_is_seeded_and_in_range() -> None:
    a = random_dataset(VOCAB, 50, 5, 20, 7, seed=3)
    assert a == random_dataset(VOCAB, 50, 5, 20, 7, seed=3)
    assert a.prompts != random_dataset(VOCAB, 50, 5, 20, 7, seed=4).prompts
    assert len(a.requests) == 50 and a.output_len == 7
    assert all(5 <= r.prompt_len <= 20 and set(r.prompt_token_ids) <= set(VOCAB)
               for r in a.requests)
    assert {r.prompt_len for r in a.requests} != {a.requests[0].prompt_len}  # lengths vary
    assert a.num_prompt_tokens == sum(len(p) for p in a.prompts)
    with pytest.raises(ValueError):
        random_dataset(VOCAB, 4, 10, 5, 7, seed=0)


def test_w1_workload_matches_the_recorded_one(bundled_tokenizer) -> None:
    """docs/benchmarks.md quotes W1 as 4,697 prompt tokens: the move into the package must
    not change the workload, or old and new numbers stop being comparable."""
    vocab = normal_vocab(bundled_tokenizer)
    assert bundled_tokenizer.bos_token_id not in vocab
    w1 = random_dataset(vocab, 32, 32, 256, 64, seed=0)
    assert w1.num_prompt_tokens == 4697
    assert w1.summary()["prompt_len_min"] >= 32 and w1.summary()["prompt_len_max"] <= 256


def test_shared_prefix_dataset_shape() -> None:
    w = shared_prefix_dataset(VOCAB, 12, num_prefixes=3, prefix_len=10, suffix_len=4,
                              output_len=5, seed=1)
    assert w == shared_prefix_dataset(VOCAB, 12, 3, 10, 4, 5, seed=1)
    assert all(r.prompt_len == 14 for r in w.requests)
    prefixes = [tuple(p[:10]) for p in w.prompts]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(p[10:]) for p in w.prompts}) == 12  # distinct suffixes
    # Shuffled: not the round-robin order the prompts were built in.
    first_seen = list(dict.fromkeys(prefixes))
    assert [first_seen.index(p) for p in prefixes] != [0, 1, 2] * 4
    with pytest.raises(ValueError):
        shared_prefix_dataset(VOCAB, 2, 3, 10, 4, 5, seed=1)


def test_shipped_prompts_file() -> None:
    texts = load_prompt_texts(PROMPTS_FILE)
    assert len(texts) >= 200
    assert len(set(texts)) == len(texts)
    assert all(len(t.split()) >= 3 and t[-1] in ".?!:'\"" for t in texts)


def test_text_dataset_tokenizes_and_cycles(bundled_tokenizer) -> None:
    n = len(load_prompt_texts()) + 5
    w = text_dataset(bundled_tokenizer, n, output_len=9, seed=2)
    assert w == text_dataset(bundled_tokenizer, n, output_len=9, seed=2)
    first = w.requests[0]
    assert first.prompt_token_ids == bundled_tokenizer.encode(first.prompt_text,
                                                              add_special_tokens=False)
    texts = [r.prompt_text for r in w.requests]
    assert texts[-5:] == texts[:5]  # past the end of the file it starts again
    assert w.summary()["dataset"] == "text" and w.output_len == 9


def test_shipped_grounded_prompts_file() -> None:
    """Input-grounded prompts: each asks to repeat, correct, summarise or edit (code) a text
    it quotes in full, so that much of the answer is in the prompt."""
    texts = load_prompt_texts(GROUNDED_FILE)
    assert len(texts) == 24 and len(set(texts)) == len(texts)
    assert all(150 <= len(t.split()) <= 400 for t in texts)
    firsts = [t.split("\n", 1)[0].lower() for t in texts]
    kinds = {"repeat": ("repeat", "copy", "reproduce", "echo", "type out"),
             "correct": ("correct", "fix the spelling", "proofread"),
             "summarise": ("summarise", "summary"),
             "rename": ("rename",), "type hints": ("type hints", "type annotations"),
             "fix a bug": ("bug",)}
    for kind, words in kinds.items():
        assert sum(any(w in f for w in words) for f in firsts) >= 3, kind
    code = [t for t in texts if "```python" in t]
    assert len(code) == 9 and all(t.count("```") == 2 for t in code)
    # Shipped in the wheel: pyproject's package data takes every data/*.jsonl.
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "data/*.jsonl" in pyproject["tool"]["setuptools"]["package-data"]["aioengine.bench"]


def test_grounded_dataset_is_registered(bundled_tokenizer) -> None:
    assert "grounded" in DATASETS
    w = grounded_dataset(bundled_tokenizer, 30, output_len=9, seed=1)
    assert w == grounded_dataset(bundled_tokenizer, 30, output_len=9, seed=1)
    assert w.name == "grounded" and w.summary()["path"] == "grounded.jsonl"
    texts = [r.prompt_text for r in w.requests]
    assert set(texts) == set(load_prompt_texts(GROUNDED_FILE)) and texts[24:] == texts[:6]
    first = w.requests[0]
    # As the text dataset: the user's message as plain text tokens (no chat template, no
    # BOS); `bench serve --endpoint chat` sends `prompt_text` as the user message.
    assert first.prompt_token_ids == bundled_tokenizer.encode(first.prompt_text,
                                                              add_special_tokens=False)
    assert all(150 <= r.prompt_len <= 1000 for r in w.requests)
    args = build_parser().parse_args(["offline", "--dataset", "grounded", "--num-prompts", "3"])
    built = build_workload(args, bundled_tokenizer)
    assert built.name == "grounded" and len(built.requests) == 3
    assert "input-grounded text and code prompts" in format_offline({
        **offline_report({}), "workload": built.summary()})


def test_with_text_decodes_token_prompts(bundled_tokenizer) -> None:
    ids = bundled_tokenizer.encode("Hello there, how are you?", add_special_tokens=False)
    w = with_text(random_dataset(VOCAB, 2, 3, 3, 4, seed=0), bundled_tokenizer)
    assert all(r.prompt_text == bundled_tokenizer.decode(r.prompt_token_ids) for r in w.requests)
    one = Workload("x", [BenchRequest(ids, None, 4)], 0, {})
    assert with_text(one, bundled_tokenizer).requests[0].prompt_text == "Hello there, how are you?"


# ---- metrics ---------------------------------------------------------------------------
