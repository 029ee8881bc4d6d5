"""Tree drafting (EAGLE-2) with the EAGLE-3 head shipped for the bundled
SmolLM2-135M-Instruct: greedy output equals greedy output without speculation on held-out
chat prompts (one request at a time, and a batch with a JSON-schema request, which gets
chains), with trees verified and paths of several nodes accepted."""
from __future__ import annotations

import json

import pytest

from aioengine import LLM, SamplingParams
from aioengine.sampling_params import StructuredOutputs
from aioengine.spec_decode.train.prompts import split_prompts

from tests.e2e.test_shipped_eagle_head import SCHEMA, _tokens, greedy_chats_equal

pytestmark = pytest.mark.slow

TREE = {"method": "eagle3", "tree": {"depth": 4, "top_k": 4, "num_nodes": 8}}


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    return LLM(num_kv_blocks=512), LLM(num_kv_blocks=512, speculative_config=TREE)


def test_greedy_chat_equal_with_tree_drafts(engines) -> None:
    plain, spec = engines
    delta = greedy_chats_equal(plain, spec)
    assert delta["num_drafts"] > 0 and delta["mean_acceptance_length"] > 1.25, delta
    stats = spec.core.spec_decode.counters
    assert stats.num_draft_tokens > 4 * stats.num_drafts  # trees, not chains of 4
    assert stats.num_accepted_tokens_per_pos[2] > 0


def test_batch_with_a_json_schema_request_equal(engines) -> None:
    plain, spec = engines
    chats = [[{"role": "user", "content": p}] for p in split_prompts()[1][6:8]]
    chats.append([{"role": "user", "content": "Name a famous scientist and their age at death."}])
    params = [SamplingParams(temperature=0.0, max_tokens=48)] * 2 + [
        SamplingParams(temperature=0.0, max_tokens=48,
                       structured_outputs=StructuredOutputs(json=SCHEMA))]
    got, want = spec.generate(chats, params), plain.generate(chats, params)
    assert _tokens(got) == _tokens(want)
    doc = json.loads(got[2].outputs[0].text)
    assert set(doc) == {"name", "age"} and isinstance(doc["age"], int)
