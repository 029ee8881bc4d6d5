"""The shipped example adapter (lora/examples/pirate) through the real server and the
`openai` client: its style shows, and the base model's greedy answers are the same with
adapter traffic beside them as alone."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_process import MODEL, ServerProcess, openai_client, serving

import aioengine.lora

PIRATE = os.path.join(os.path.dirname(aioengine.lora.__file__), "examples", "pirate")
# Held out from the adapter's training prompts (scripts/train_pirate_lora.py).
QUESTIONS = ["What is the capital of France?", "How do plants make their food?",
             "Give me a tip for a job interview.", "Why is the sky blue?"]
PIRATE_WORDS = re.compile(r"\b(arr+|matey|ye|yer|ahoy|aye|me hearties|booty|th')\b",
                          re.IGNORECASE)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # float32: with bf16 weights the base model's own greedy answers already depend on the
    # batch (each projection's output is rounded to bf16, so near-ties flip), adapters or not.
    yield from serving("--dtype", "float32", "--enable-lora", "--lora-modules",
                       f"pirate={PIRATE}", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai_client(server)


def _ask(client: openai.OpenAI, model: str, question: str) -> str:
    out = client.chat.completions.create(
        model=model, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": question}])
    return out.choices[0].message.content


def test_the_adapter_talks_like_a_pirate(client: openai.OpenAI) -> None:
    # all eight at once (one batch: the next test shows batching leaves greedy answers be)
    jobs = [(model, q) for model in ("pirate", MODEL) for q in QUESTIONS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _ask(client, *job), jobs))
    pirate, base = answers[:len(QUESTIONS)], answers[len(QUESTIONS):]
    assert sum(bool(PIRATE_WORDS.search(a)) for a in pirate) >= 3, pirate
    assert sum(bool(PIRATE_WORDS.search(a)) for a in base) <= 1, base


def test_base_answers_unchanged_by_adapter_traffic(client: openai.OpenAI,
                                                   server: ServerProcess) -> None:
    alone = [_ask(client, MODEL, q) for q in QUESTIONS]
    jobs = [(MODEL if i % 2 else "pirate", q) for q in QUESTIONS for i in range(2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda job: _ask(client, *job), jobs))
    assert [a for (model, _), a in zip(jobs, mixed) if model == MODEL] == alone
    m = server.wait_idle()
    assert m["aioengine:kv_cache_usage_perc"] == 0
