"""`aioengine generate`'s flags are generated: its sampling flags from SamplingParams' fields
(aioengine.cli.GENERATE_FLAGS), the rest from EngineArgs'."""
from __future__ import annotations

from aioengine.cli import GENERATE_FLAGS, build_parser
from aioengine.config import ENGINE_FLAGS, flag_values
from aioengine.sampling_params import SamplingParams


def _generate_args(*flags: str):
    return build_parser()[0].parse_args(["generate", "hi", *flags])


def test_every_generate_flag_is_generated() -> None:
    parser = build_parser()[1]["generate"]
    by_hand = {action.dest for action in parser._actions
               if action.option_strings and action.dest not in ENGINE_FLAGS
               and action.dest not in {options.get("dest", name)
                                       for name, (_, options) in GENERATE_FLAGS.items()}}
    assert by_hand == {"help", "chat"}
    names = {opt for action in parser._actions for opt in action.option_strings
             if action.dest in ("max_tokens", "temperature", "top_p", "sample_seed")}
    assert names == {"--max-tokens", "--temperature", "--top-p", "--sample-seed"}


def test_generate_defaults() -> None:
    """Greedy and 128 tokens are the command's own; the rest are SamplingParams'."""
    params = SamplingParams(**flag_values(_generate_args(), GENERATE_FLAGS))
    assert (params.max_tokens, params.temperature) == (128, 0.0)
    assert (params.top_p, params.seed) == (SamplingParams().top_p, SamplingParams().seed)


def test_generate_flags_reach_sampling_params() -> None:
    args = _generate_args("--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9",
                          "--sample-seed", "3", "--seed", "11")
    params = SamplingParams(**flag_values(args, GENERATE_FLAGS))
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.5, 0.9, 3)
    assert args.seed == 11  # the engine's seed is its own flag
