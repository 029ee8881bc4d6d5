"""`accuracy` mode: how far each engine configuration drifts from our own float32 engine.

    aioengine bench accuracy --configs float32,bfloat16,int8,w8a8 [--num-prompts N]
                             [--output-len 64] [--ppl-context 1024 --ppl-stride 512]

Per configuration (one `LLM` each, freed before the next), against a float32 reference
engine built first:

- greedy agreement: the shipped prompts (data/prompts.jsonl, as single user messages
  through the model's chat template), `--output-len` tokens each, greedy with EOS ignored
  so every output has the same length. A prompt's tokens count as identical up to its
  first divergence from the reference; after it, the context differs, so none count.
- perplexity of data/ppl_text.txt from the engine's prompt logprobs, in sliding windows
  (Hugging Face's recipe: windows of `context` tokens every `stride` tokens, each scoring
  only the tokens the previous one did not). The arithmetic is in accuracy_metrics.py.

The reference is its own engine even when `float32` is among the configurations, so that
row checks that two float32 engines agree exactly (100%, delta 0).
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from aioengine.bench.accuracy_metrics import (PplWindow, greedy_agreement, perplexity,
                                              ppl_windows, window_nll)
from aioengine.bench.datasets import PROMPTS_FILE, load_prompt_texts

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
PPL_TEXT_FILE = os.path.join(DATA_DIR, "ppl_text.txt")
REFERENCE = "float32"
# Each configuration's weight/compute settings (EngineArgs fields). Everything else comes
# from the engine flags and is shared by the reference and every configuration.
CONFIGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "auto", "quantization": "int8"},
    "w8a8": {"dtype": "auto", "quantization": "w8a8"},
    "gguf": {"dtype": "auto", "quantization": "gguf"},
}
# The engine flags that the configurations decide (so they must stay at their defaults).
_CONFIG_FLAGS = {"dtype": "auto", "quantization": None, "kv_cache_dtype": "auto"}
# A failure of one configuration is recorded and the others still run.
_CONFIG_ERRORS = (ValueError, RuntimeError, NotImplementedError, TypeError, MemoryError)


# ---- engine runs -----------------------------------------------------------------------


@dataclass(frozen=True)
class AccuracyInputs:
    """What every configuration runs: token ids made once by the reference's tokenizer."""

    prompts: list[list[int]]
    prompt_format: str  # "chat" or "plain" (a tokenizer without a chat template)
    output_len: int
    ppl_token_ids: list[int]
    windows: list[PplWindow]
    ppl_context: int  # the window and step in effect (after the caps)
    ppl_stride: int

    @property
    def num_ppl_tokens(self) -> int:
        """Scored tokens: all but the text's first."""
        return len(self.ppl_token_ids) - 1 if self.windows else 0

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {"prompts_file": os.path.basename(PROMPTS_FILE), "num_prompts": len(lens),
                "prompt_format": self.prompt_format, "prompt_len_min": min(lens),
                "prompt_len_max": max(lens), "output_len": self.output_len,
                "ppl_text": os.path.basename(PPL_TEXT_FILE),
                "ppl_text_tokens": len(self.ppl_token_ids),
                "ppl_scored_tokens": self.num_ppl_tokens, "ppl_windows": len(self.windows),
                "ppl_context": self.ppl_context, "ppl_stride": self.ppl_stride}


def _prompt_ids(tokenizer: Any, texts: list[str]) -> tuple[list[list[int]], str]:
    from aioengine.tokenizer_utils import apply_chat_template, encode_prompt

    if getattr(tokenizer, "chat_template", None):
        return [apply_chat_template(tokenizer, [{"role": "user", "content": t}])
                for t in texts], "chat"
    return [encode_prompt(tokenizer, t) for t in texts], "plain"


def build_inputs(tokenizer: Any, max_model_len: int, num_prompts: int | None, output_len: int,
                 ppl_context: int, ppl_stride: int, ppl_max_tokens: int | None) -> AccuracyInputs:
    """The prompts (the first `num_prompts` of the file, default all) and the perplexity
    windows. A window leaves one slot of the context for the token the request generates;
    `ppl_max_tokens` (0 = no perplexity) cuts the text short for quick runs."""
    from aioengine.tokenizer_utils import encode_prompt

    texts = load_prompt_texts()[:num_prompts]
    if not texts or output_len < 1:
        raise ValueError("need --num-prompts >= 1 and --output-len >= 1")
    prompts, prompt_format = _prompt_ids(tokenizer, texts)
    with open(PPL_TEXT_FILE, encoding="utf-8") as f:
        ppl_ids = encode_prompt(tokenizer, f.read())[:ppl_max_tokens]
    context = min(max_model_len - 1, ppl_context)
    stride = min(ppl_stride, context - 1)
    windows = [] if ppl_max_tokens == 0 else ppl_windows(len(ppl_ids), context, stride)
    return AccuracyInputs(prompts, prompt_format, output_len, ppl_ids, windows, context, stride)


@dataclass
class ConfigRun:
    """One engine's greedy outputs and perplexity over the shared inputs."""

    outputs: list[list[int]]
    nll: float
    greedy_s: float
    ppl_s: float


def measure(llm: Any, inputs: AccuracyInputs) -> ConfigRun:
    from aioengine import SamplingParams

    start = time.perf_counter()
    greedy = SamplingParams(temperature=0, max_tokens=inputs.output_len, ignore_eos=True)
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(inputs.prompts, greedy)]
    greedy_s = time.perf_counter() - start
    nll = 0.0
    if inputs.windows:
        scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        ids = inputs.ppl_token_ids
        outs = llm.generate([ids[w.begin:w.end] for w in inputs.windows], scoring)
        nll = sum(window_nll(w, ids, o.prompt_logprobs or [])
                  for w, o in zip(inputs.windows, outs, strict=True))
    return ConfigRun(outputs, nll, greedy_s, time.perf_counter() - start - greedy_s)


def _with_engine(model: str | None, kwargs: dict[str, Any], fn: Callable[[Any], Any]) -> Any:
    """`fn(llm)` on a fresh engine, freed (weights and KV cache) before returning."""
    from aioengine import LLM

    llm = LLM(model, **kwargs)
    try:
        return fn(llm)
    finally:
        del llm
        gc.collect()


def config_kwargs(base: dict[str, Any], name: str) -> dict[str, Any]:
    """The engine flags minus the ones configurations decide, plus `name`'s settings."""
    shared = {k: v for k, v in base.items() if k not in _CONFIG_FLAGS}
    return {**shared, **CONFIGS[name]}


def _ppl(nll: float, inputs: AccuracyInputs) -> float | None:
    return perplexity(nll, inputs.num_ppl_tokens) if inputs.windows else None


def _config_result(name: str, run: ConfigRun, ref: ConfigRun,
                   inputs: AccuracyInputs) -> dict[str, Any]:
    ppl, ref_ppl = _ppl(run.nll, inputs), _ppl(ref.nll, inputs)
    return {"config": name, "engine_kwargs": CONFIGS[name],
            "greedy": greedy_agreement(ref.outputs, run.outputs).summary(),
            "ppl": ppl, "ppl_delta": None if ppl is None else ppl - ref_ppl,
            "ppl_delta_pct": None if ppl is None else 100.0 * (ppl / ref_ppl - 1.0),
            "greedy_s": run.greedy_s, "ppl_s": run.ppl_s}


def run_accuracy(model: str | None, base_kwargs: dict[str, Any], configs: list[str],
                 num_prompts: int | None, output_len: int, ppl_context: int = 1024,
                 ppl_stride: int = 512, ppl_max_tokens: int | None = None) -> dict[str, Any]:
    """The reference, then each configuration in turn; the report's measured part."""
    def reference(llm: Any) -> tuple[AccuracyInputs, ConfigRun]:
        inputs = build_inputs(llm.tokenizer, llm.max_model_len, num_prompts, output_len,
                              ppl_context, ppl_stride, ppl_max_tokens)
        return inputs, measure(llm, inputs)

    inputs, ref = _with_engine(model, config_kwargs(base_kwargs, REFERENCE), reference)
    results: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in configs:
        try:
            run = _with_engine(model, config_kwargs(base_kwargs, name),
                               lambda llm: measure(llm, inputs))
            results[name] = _config_result(name, run, ref, inputs)
        except _CONFIG_ERRORS as e:
            skipped[name] = f"{type(e).__name__}: {e}"
        gc.collect()  # a failed engine lives on in its traceback until here
    return {"workload": inputs.summary(),
            "reference": {"config": REFERENCE, "engine_kwargs": CONFIGS[REFERENCE],
                          "ppl": _ppl(ref.nll, inputs), "greedy_s": ref.greedy_s,
                          "ppl_s": ref.ppl_s},
            "results": results, "skipped": skipped}


# ---- report and command line -----------------------------------------------------------


def _row(name: str, width: int, r: dict[str, Any]) -> str:
    g = r["greedy"]
    tokens = f"{g['num_identical_tokens']}/{g['num_tokens']} {100 * g['token_agreement']:5.1f}%"
    prompts = (f"{g['num_identical_prompts']}/{g['num_prompts']} "
               f"{100 * g['prompt_agreement']:5.1f}%")
    div = ("-" if g["mean_first_divergence"] is None else
           f"{g['mean_first_divergence']:.1f} / {g['median_first_divergence']:.1f}")
    ppl, delta = "-", "-"
    if r["ppl"] is not None:
        ppl, delta = f"{r['ppl']:.4f}", f"{r['ppl_delta']:+.4f} ({r['ppl_delta_pct']:+.2f}%)"
    return f"{name:<{width}} {tokens:>20} {prompts:>18} {div:>19} {ppl:>11} {delta:>20}"


def format_accuracy(report: dict[str, Any]) -> str:
    from aioengine.bench.report import cpu_line

    env, wl, ref = report["environment"], report["workload"], report["reference"]
    ppl = ("perplexity skipped" if ref["ppl"] is None else
           f"perplexity {ref['ppl']:.4f} on {wl['ppl_text']} ({wl['ppl_scored_tokens']} tokens "
           f"scored, {wl['ppl_windows']} windows of <= {wl['ppl_context']} tokens, stride "
           f"{wl['ppl_stride']})")
    names = [*report["results"], *report["skipped"]]
    w = max([8, *(len(n) for n in names)])
    lines = [f"torch {env['torch']}, {env['torch_threads']} torch threads, "
             f"{env['cpu_count']} CPUs", cpu_line(env),
             f"model {report['model']}",
             f"greedy: {wl['num_prompts']} prompts ({wl['prompt_format']}, "
             f"{wl['prompt_len_min']}-{wl['prompt_len_max']} tokens) x {wl['output_len']} "
             f"output tokens, EOS ignored",
             f"reference: a float32 engine; {ppl}", "",
             f"{'config':<{w}} {'tokens identical':>20} {'prompts identical':>18} "
             f"{'1st div mean/median':>19} {'ppl':>11} {'ppl - ref':>20}"]
    lines += [_row(name, w, r) for name, r in report["results"].items()]
    for name, reason in report["skipped"].items():
        lines.append(f"{name:<{w}} failed: {reason}")
    lines.append("tokens identical: before each prompt's first divergence from the reference; "
                 "1st div: over the prompts that diverge")
    return "\n".join(lines)


def parse_configs(spec: str) -> list[str]:
    """`--configs`: a comma-separated list of distinct names from CONFIGS, run in order."""
    names = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--configs must name distinct configurations from {list(CONFIGS)}, got {spec!r}")
    return names


def add_accuracy_parser(sub: Any) -> None:
    from aioengine.config import add_engine_args

    p = sub.add_parser("accuracy", help="greedy agreement and perplexity of engine "
                       "configurations vs our float32 engine")
    p.add_argument("--configs", type=parse_configs, default=list(CONFIGS),
                   help=f"comma-separated, run in order, from {list(CONFIGS)}: "
                        + "; ".join(f"{k} = {v}" for k, v in CONFIGS.items()))
    p.add_argument("--num-prompts", type=int, default=None,
                   help="the first N shipped prompts (default: all)")
    p.add_argument("--output-len", type=int, default=64,
                   help="greedy tokens per prompt (EOS ignored)")
    p.add_argument("--ppl-context", type=int, default=1024,
                   help="perplexity window (capped at max_model_len - 1)")
    p.add_argument("--ppl-stride", type=int, default=512,
                   help="perplexity window step (capped at the window - 1)")
    p.add_argument("--ppl-max-tokens", type=int, default=None,
                   help="score only the text's first N tokens (0: no perplexity)")
    p.add_argument("--save-json", default=None, metavar="PATH",
                   help="config, environment, summary and per-prompt divergences")
    add_engine_args(p)  # shared by the reference and every configuration
    p.set_defaults(func=accuracy_main)


def accuracy_main(args: argparse.Namespace) -> int:
    from aioengine.bench.common import emit, run_config
    from aioengine.bench.report import environment_info
    from aioengine.config import engine_kwargs
    from aioengine.model.default import bundled_model_path

    set_flags = ["--" + k.replace("_", "-") for k, default in _CONFIG_FLAGS.items()
                 if getattr(args, k, default) != default]
    if set_flags:
        raise SystemExit(f"--configs sets {', '.join(set_flags)} per configuration; "
                         "leave them out")
    if args.ppl_max_tokens is not None and args.ppl_max_tokens < 0:
        raise SystemExit("--ppl-max-tokens must be >= 0")
    model = args.model or bundled_model_path()
    measured = run_accuracy(model, engine_kwargs(args), args.configs, args.num_prompts,
                            args.output_len, args.ppl_context, args.ppl_stride,
                            args.ppl_max_tokens)
    report = {"mode": "accuracy", "environment": environment_info(), "model": model,
              "config": run_config(args), **measured}
    emit(report, format_accuracy(report), args.save_json)
    return 1 if report["skipped"] else 0
