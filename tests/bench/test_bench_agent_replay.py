"""`aioengine bench spec --prompts agent-replay`: multi-turn tool-using conversations
(bench/agentic.py), deterministic per seed, warm-up and timed ones drawing disjoint values,
rendered as the server renders them for the bundled SmolLM2 template at realistic lengths,
and one short bench run end to end on a tiny random-weight Llama."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from aioengine.bench import agentic, main as bench_main
from aioengine.bench.agentic import (AGENTIC_SETS, PROMPT_SETS, TIMED_SEED, WARMUP_SEED,
                                     as_sent, chat_set, prompt_set, tool_conversations)
from aioengine.chat_prompt import render_chat_text
from aioengine.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser

from tests.tiny_models import make_tiny_model_dir


def _drawn(chats: list[list[dict]]) -> set[str]:
    """What the conversations draw by seed parity: ids (C-12345: the last digit's parity),
    dates, and the people, cities and functions of the halved lists."""
    text = "\n".join(m["content"] for chat in chats for m in chat)
    halved = set(agentic._FIRST + agentic._LAST + agentic._CITIES + agentic._NAMES)
    return (set(re.findall(r"\b[A-Za-z]{1,2}-\d+\b|\b2024-\d\d-\d\d\b", text))
            | (set(re.findall(r"\w+", text)) & halved))


def test_the_set_is_deterministic_and_held_out() -> None:
    assert "agent-replay" in AGENTIC_SETS and "agent-replay" not in PROMPT_SETS
    timed = chat_set("agent-replay", 12, TIMED_SEED)
    assert timed == chat_set("agent-replay", 12, TIMED_SEED)
    warm = chat_set("agent-replay", 50, WARMUP_SEED)
    assert _drawn(timed) and not _drawn(timed) & _drawn(warm)
    for chat in timed:  # a system prompt with the tools, a task, 3-6 round trips
        assert chat[0]["role"] == "system" and "<tools>" in chat[0]["content"]
        assert 3 <= sum("<tool_call>" in m["content"] for m in chat[1:]) <= 6
        assert chat[-1]["role"] == "user"  # a tool result or the ask for a report
    # Single-turn sets come as one user message each.
    assert chat_set("sql", 3, TIMED_SEED) == [[{"role": "user", "content": p}]
                                              for p in prompt_set("sql", 3, TIMED_SEED)]
    with pytest.raises(ValueError, match="chat_set"):
        prompt_set("agent-replay", 1, TIMED_SEED)


def test_conversations_render_as_the_server_does_at_agent_lengths(bundled_tokenizer) -> None:
    """The bench sends `as_sent`'s messages through the bare template; the server renders
    the OpenAI form (tool_calls, role tool) to the same text for the bundled model."""
    parser = get_tool_parser(DEFAULT_TOOL_PARSER)
    lengths = []
    for seed in (WARMUP_SEED, TIMED_SEED):
        for tools, messages in tool_conversations(12, seed):
            text = bundled_tokenizer.apply_chat_template(
                as_sent(tools, messages), tokenize=False, add_generation_prompt=True)
            assert text == render_chat_text(bundled_tokenizer, messages, tools, parser)
            lengths.append(len(bundled_tokenizer.encode(text, add_special_tokens=False)))
    assert 200 <= min(lengths) and max(lengths) <= 2000, lengths


def test_bench_spec_runs_the_replay(tmp_path: Path, bench_threads, capsys) -> None:
    # The conversations run past the tiny Llama's usual 512 positions.
    model = make_tiny_model_dir("llama", tmp_path / "model", seed=3,
                                max_position_embeddings=4096)
    path = tmp_path / "spec.json"
    rc = bench_main(["spec", "--model", str(model), "--dtype", "float32",
                     "--prompts", "agent-replay", "--specs", "off,suffix", "--num-prompts",
                     "2", "--warmup", "2", "--output-len", "16", "--save-json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["prompts"] == "agent-replay" and report["num_prompts"] == 2
    for name in ("off", "suffix"):
        assert report["summary"][name]["greedy_equal_to_off"] is True
        assert len(report["runs"][name]) == 2
    assert "2 agent-replay prompts" in capsys.readouterr().out
