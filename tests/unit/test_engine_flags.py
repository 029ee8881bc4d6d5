"""The engine flags (aioengine.config): EngineArgs is the one home of their defaults, the
CLI and the benchmarks share them, bench never imports the CLI; and `--tokenizer`."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aioengine.cli import build_parser as cli_parser
from aioengine.config import ENGINE_FLAGS, EngineArgs, engine_kwargs
from aioengine.model.loader import ModelLoadError, load_model

from tests.tiny_models import bundled_tokenizer, make_tiny_model_dir

LORA_FIELDS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
# Every engine flag and its aliases (those of aioengine/cli.py before they moved, and
# --tokenizer, --prefix-caching-hash-algo since).
FLAG_NAMES = {
    "--model", "--tokenizer", "--dtype", "--quantization", "-q", "--kv-cache-dtype",
    "--device", "--seed", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
    "--block-size", "--kv-cache-memory", "--kv-cache-memory-bytes", "--num-kv-blocks",
    "--enable-prefix-caching", "--enable-chunked-prefill", "--structured-jump-forward",
    "--async-scheduling", "--scheduling-policy", "--speculative-config",
    "--prefix-caching-hash-algo", "--attention-backend", "--enforce-eager",
    "--no-enforce-eager", "--gpu-memory-utilization",
    "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
    "--no-structured-jump-forward", "--no-async-scheduling"}


def _parsed(command: list[str]):
    return cli_parser()[0].parse_args(command)


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_cli_defaults_are_engine_args_defaults(command: list[str]) -> None:
    args = _parsed(command)
    defaults = EngineArgs()
    checked = [f.name for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)]
    assert set(ENGINE_FLAGS) <= set(checked)
    if command[0] == "serve":
        assert set(LORA_FIELDS) <= set(checked)
    for name in checked:
        assert getattr(args, name) == getattr(defaults, name), name
    assert EngineArgs(model=args.model, **engine_kwargs(args)) == defaults


def test_bench_defaults_are_engine_args_defaults() -> None:
    from aioengine.bench import build_parser

    args = build_parser().parse_args(["latency"])
    assert EngineArgs(model=args.model, **engine_kwargs(args)) == EngineArgs()


def test_every_flag_keeps_its_name() -> None:
    parser = cli_parser()[1]["generate"]
    names = {opt for action in parser._actions for opt in action.option_strings
             if action.dest in ENGINE_FLAGS}
    assert names == FLAG_NAMES
    args = _parsed(["generate", "hi", "-q", "int8", "--kv-cache-memory-bytes", "4096",
                    "--no-enable-prefix-caching", "--max-num-seqs", "3",
                    "--tokenizer", "/tok", "--enforce-eager", "--gpu-memory-utilization", "0.5",
                    "--attention-backend", "torch"])
    kwargs = engine_kwargs(args)
    assert (kwargs["enforce_eager"], kwargs["gpu_memory_utilization"]) == (True, 0.5)
    assert kwargs["attention_backend"] == "torch"
    assert (kwargs["quantization"], kwargs["kv_cache_memory"]) == ("int8", 4096)
    assert (kwargs["enable_prefix_caching"], kwargs["max_num_seqs"]) == (False, 3)
    assert kwargs["tokenizer"] == "/tok" and "model" not in kwargs


def test_bench_does_not_import_the_cli() -> None:
    code = ("import sys; from aioengine.bench import build_parser; build_parser(); "
            "assert 'aioengine.cli' not in sys.modules, 'bench imported aioengine.cli'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def marked_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled tokenizer saved with a chat template of its own, to tell it apart."""
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer = bundled_tokenizer()
    template = tokenizer.chat_template
    tokenizer.chat_template = "MARKED {{ messages[0]['content'] }}"
    try:
        tokenizer.save_pretrained(out)
    finally:
        tokenizer.chat_template = template  # the cached tokenizer is shared
    return out


def test_load_model_uses_the_given_tokenizer(tiny_dir: Path, marked_tokenizer_dir: Path) -> None:
    cpu = torch.device("cpu")
    own = load_model(str(tiny_dir), torch.float32, cpu)
    assert not own.tokenizer.chat_template.startswith("MARKED")
    other = load_model(str(tiny_dir), torch.float32, cpu, tokenizer=str(marked_tokenizer_dir))
    assert other.tokenizer.chat_template.startswith("MARKED")
    assert other.model_path == own.model_path
    with pytest.raises(ModelLoadError, match="is not a directory or a .gguf file"):
        load_model(str(tiny_dir), torch.float32, cpu, tokenizer=str(tiny_dir / "nope"))


def test_engine_args_tokenizer_reaches_the_engine(tiny_dir: Path,
                                                  marked_tokenizer_dir: Path) -> None:
    from aioengine import LLM

    llm = LLM(str(tiny_dir), tokenizer=str(marked_tokenizer_dir), dtype="float32",
              num_kv_blocks=16, max_model_len=64)
    assert llm.tokenizer.chat_template.startswith("MARKED")
