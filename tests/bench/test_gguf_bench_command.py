"""`aioengine bench gguf`'s command for our server: speculation off unless asked for, as
llama-server drafts nothing."""
from __future__ import annotations

from aioengine.bench.gguf_bench import BenchConfig, our_command


def _spec_flag(command: list[str]) -> list[str]:
    i = command.index("--speculative-config")
    assert "--speculative-config" not in command[i + 1:]
    return command[i:i + 2]


def test_our_server_runs_without_speculation_by_default() -> None:
    cfg = BenchConfig(model="m.gguf", llama_server=None, our_args=["--quantization", "gguf"])
    command = our_command(cfg, 8000)
    assert _spec_flag(command) == ["--speculative-config", "none"]
    assert command[-2:] == ["--quantization", "gguf"]


def test_our_args_may_turn_speculation_on() -> None:
    cfg = BenchConfig(model="m.gguf", llama_server=None,
                      our_args=["--speculative-config", "suffix"])
    assert _spec_flag(our_command(cfg, 8000)) == ["--speculative-config", "suffix"]
    cfg.our_args = ["--speculative-config=auto"]
    command = our_command(cfg, 8000)
    assert "--speculative-config" not in command and command[-1] == "--speculative-config=auto"
