"""Throughput benchmarks for aioengine.

    python scripts/benchmark.py offline [--num-prompts 32] [--output-len 64] [engine flags]

`offline`: one seeded batch of random-token prompts, all submitted at once, run through
aioengine's `LLM` and through Hugging Face transformers' `generate` (static batches, left
padding) on the same weights. Prints throughput per engine, our ratio to each peer, and how
many of our greedy outputs equal the peer's token for token.

Every request produces exactly `--output-len` tokens (greedy, EOS ignored), so all engines
do the same work and their outputs are comparable position by position.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

# Loading a GGUF draws a progress bar per tensor on stderr; silence tqdm before anything
# imports it (it reads TQDM_* variables once, at import).
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

# Run as a file (`python scripts/benchmark.py`), the repository root is not on sys.path;
# add it so the checkout is benchmarked even without `pip install -e .`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aioengine.cli import add_engine_args, engine_kwargs  # noqa: E402
from aioengine.model.default import bundled_model_path  # noqa: E402

OUR_ENGINE = "aioengine"


# ---- environment ---------------------------------------------------------------------


def environment_info() -> dict[str, Any]:
    """What the numbers depend on; recorded with every result."""
    return {
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


# ---- workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """N prompts of random token ids; every request generates exactly `output_len` tokens."""

    prompts: list[list[int]]
    output_len: int
    seed: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def summary(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {"num_prompts": len(lens), "prompt_len_min": min(lens),
                "prompt_len_max": max(lens), "num_prompt_tokens": sum(lens),
                "output_len": self.output_len, "seed": self.seed}


def normal_vocab(tokenizer: Any) -> list[int]:
    """Token ids a prompt may use: the whole vocabulary minus special and added tokens.

    Special tokens (BOS, <|im_start|>, ...) would change the model's behaviour in ways
    no real prompt does, and some engines treat them specially on input.
    """
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    return [i for i in range(len(tokenizer)) if i not in excluded]


def make_workload(vocab: list[int], num_prompts: int, input_len_min: int, input_len_max: int,
                  output_len: int, seed: int) -> Workload:
    """Seeded: the same arguments always give the same prompts."""
    if not 1 <= input_len_min <= input_len_max:
        raise ValueError(f"need 1 <= input_len_min <= input_len_max, got "
                         f"[{input_len_min}, {input_len_max}]")
    if num_prompts < 1 or output_len < 1:
        raise ValueError("num_prompts and output_len must be >= 1")
    rng = random.Random(seed)
    prompts = [rng.choices(vocab, k=rng.randint(input_len_min, input_len_max))
               for _ in range(num_prompts)]
    return Workload(prompts=prompts, output_len=output_len, seed=seed)


# ---- results -------------------------------------------------------------------------


@dataclass
class EngineResult:
    """One engine's timed run of the whole workload (warm-up excluded)."""

    engine: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    threads: int
    outputs: list[list[int]] = field(repr=False)

    @property
    def output_tps(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tps(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        return {**d, "output_tok_per_s": self.output_tps, "total_tok_per_s": self.total_tps}


def _result(engine: str, workload: Workload, outputs: list[list[int]],
            elapsed_s: float) -> EngineResult:
    # Invariant the comparison relies on: every engine did exactly the same work.
    bad = [i for i, o in enumerate(outputs) if len(o) != workload.output_len]
    if len(outputs) != len(workload.prompts) or bad:
        raise RuntimeError(f"{engine}: expected {len(workload.prompts)} outputs of "
                           f"{workload.output_len} tokens; wrong length at requests {bad[:8]}")
    return EngineResult(engine=engine, num_requests=len(outputs),
                        num_prompt_tokens=workload.num_prompt_tokens,
                        num_output_tokens=sum(len(o) for o in outputs),
                        elapsed_s=elapsed_s, threads=torch.get_num_threads(), outputs=outputs)


@dataclass
class OutputAgreement:
    """How many of our greedy outputs equal a peer's, token for token.

    Informational: batched fp32 with padding changes summation order, so near-ties in
    the logits may flip a late token and everything after it.
    """

    num_equal: int
    num_requests: int
    # request index -> first position where the two outputs differ
    first_diffs: dict[int, int]

    @property
    def mean_first_diff(self) -> float | None:
        if not self.first_diffs:
            return None
        return sum(self.first_diffs.values()) / len(self.first_diffs)


def compare_outputs(ours: list[list[int]], peer: list[list[int]]) -> OutputAgreement:
    first_diffs = {}
    for i, (a, b) in enumerate(zip(ours, peer, strict=True)):
        if a != b:
            first_diffs[i] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                  min(len(a), len(b)))
    return OutputAgreement(num_equal=len(ours) - len(first_diffs), num_requests=len(ours),
                           first_diffs=first_diffs)


# ---- engines -------------------------------------------------------------------------


def run_aioengine(workload: Workload, model: str, kwargs: dict[str, Any]) -> EngineResult:
    """Our engine: every prompt submitted at once through `LLM.generate`."""
    from aioengine import LLM, SamplingParams

    threads = torch.get_num_threads()
    llm = LLM(model, **kwargs)
    # The engine may size torch's thread pool on load; the benchmark's setting wins so
    # every engine runs with the same threads.
    torch.set_num_threads(threads)
    warmup = [p[:16] for p in workload.prompts[:2]]
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=workload.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    return _result(OUR_ENGINE, workload, [list(o.outputs[0].token_ids) for o in outs], elapsed)


def _hf_location(model: str) -> dict[str, str]:
    """`from_pretrained` arguments for a .gguf file or a Hugging Face directory."""
    if os.path.isfile(model):
        return {"pretrained_model_name_or_path": os.path.dirname(model),
                "gguf_file": os.path.basename(model)}
    return {"pretrained_model_name_or_path": model}


def load_hf_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(**_hf_location(model))


def load_hf_model(model: str) -> Any:
    """The model through transformers in float32; a GGUF is dequantized on load."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    where = _hf_location(model)
    if "gguf_file" in where and not is_accelerate_available():
        # transformers refuses GGUF files without accelerate; say how to get going.
        raise RuntimeError("transformers needs `accelerate` to load a GGUF file: "
                           "`pip install accelerate`, or pass --engines aioengine")
    return AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), padded on the left so every row's last token is real
    and generated tokens line up in the same columns."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_generate(hf_model: Any, prompts: list[list[int]], output_len: int,
                pad_id: int) -> list[list[int]]:
    ids, mask = _left_pad(prompts, pad_id)
    # eos_token_id=None mirrors our `ignore_eos`: never stop early and never suppress EOS.
    # (min_new_tokens alone would mask EOS out of the logits, changing greedy outputs.)
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len,
                                pad_token_id=pad_id, eos_token_id=None,
                                temperature=None, top_p=None, top_k=None)
    return out[:, ids.shape[1]:].tolist()


def run_hf(workload: Workload, model: str, batch_size: int) -> EngineResult:
    """transformers `generate` in static batches of `batch_size`, in workload order."""
    hf_model, tokenizer = load_hf_model(model), load_hf_tokenizer(model)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    hf_generate(hf_model, [p[:16] for p in workload.prompts[:2]], 4, pad_id)  # warm-up
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        outputs += hf_generate(hf_model, workload.prompts[i:i + batch_size],
                               workload.output_len, pad_id)
    elapsed = time.perf_counter() - start
    return _result("hf", workload, outputs, elapsed)


Runner = Callable[[Workload, str, argparse.Namespace], EngineResult]
RUNNERS: dict[str, Runner] = {
    OUR_ENGINE: lambda w, model, args: run_aioengine(w, model, engine_kwargs(args)),
    "hf": lambda w, model, args: run_hf(w, model, args.hf_batch_size),
}


# ---- offline -------------------------------------------------------------------------


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the workload, runs each engine in turn, and returns the whole report."""
    model = args.model or bundled_model_path()
    workload = make_workload(normal_vocab(load_hf_tokenizer(model)), args.num_prompts,
                             args.input_len_min, args.input_len_max, args.output_len, args.seed)
    results: dict[str, EngineResult] = {}
    for name in args.engines:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = RUNNERS[name](workload, model, args)
        gc.collect()  # drop the previous engine's weights before the next one loads
    report: dict[str, Any] = {
        "environment": environment_info(), "model": model,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "workload": workload.summary(),
        "results": {name: r.summary() for name, r in results.items()},
        "ratios": {}, "agreement": {}}
    ours = results.get(OUR_ENGINE)
    for name, peer in results.items():
        if ours is None or name == OUR_ENGINE:
            continue
        report["ratios"][name] = {"output": ours.output_tps / peer.output_tps,
                                  "total": ours.total_tps / peer.total_tps}
        agreement = compare_outputs(ours.outputs, peer.outputs)
        report["agreement"][name] = {**asdict(agreement),
                                     "mean_first_diff": agreement.mean_first_diff}
    return report


def parse_engines(spec: str) -> list[str]:
    """`--engines`: a comma-separated list of distinct names from RUNNERS, run in order."""
    engines = [e.strip() for e in spec.split(",") if e.strip()]
    unknown = [e for e in engines if e not in RUNNERS]
    if not engines or unknown or len(set(engines)) != len(engines):
        raise argparse.ArgumentTypeError(f"--engines must name distinct engines from {sorted(RUNNERS)}, "
                         f"got {spec!r}")
    return engines


def format_report(report: dict[str, Any]) -> str:
    env, wl = report["environment"], report["workload"]
    lines = [
        f"torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['torch_threads']} torch threads, {env['cpu_count']} CPUs"
        + (f", {env['cuda']}" if env["cuda"] else ""),
        f"model {report['model']}",
        f"workload: {wl['num_prompts']} prompts of {wl['prompt_len_min']}-"
        f"{wl['prompt_len_max']} random tokens ({wl['num_prompt_tokens']} in all), "
        f"{wl['output_len']} output tokens each, seed {wl['seed']}",
        "",
        f"{'engine':<10} {'requests':>8} {'prompt tok':>10} {'output tok':>10} "
        f"{'elapsed s':>9} {'output tok/s':>12} {'total tok/s':>11}",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"{name:<10} {r['num_requests']:>8} {r['num_prompt_tokens']:>10} "
            f"{r['num_output_tokens']:>10} {r['elapsed_s']:>9.2f} "
            f"{r['output_tok_per_s']:>12.1f} {r['total_tok_per_s']:>11.1f}")
    for name, ratio in report["ratios"].items():
        lines.append(f"{OUR_ENGINE} / {name}: output x{ratio['output']:.2f}, "
                     f"total x{ratio['total']:.2f}")
    for name, a in report["agreement"].items():
        line = f"greedy outputs equal to {name}: {a['num_equal']}/{a['num_requests']}"
        if a["first_diffs"]:
            line += f" (differing ones diverge at token {a['mean_first_diff']:.1f} on average)"
        lines.append(line)
    return "\n".join(lines)


def offline_main(args: argparse.Namespace) -> int:
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    # The engine reads its thread count from here when it loads; keep both in step.
    os.environ["AIOENGINE_CPU_THREADS"] = str(threads)
    report = run_offline(args)
    print(format_report(report))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"saved {args.save_json}", file=sys.stderr)
    return 0


# ---- command line --------------------------------------------------------------------


def add_offline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="one batch of requests, all at once, vs transformers")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="static batch size of the transformers baseline")
    p.add_argument("--engines", type=parse_engines, default=[OUR_ENGINE, "hf"],
                   help=f"comma-separated, from {sorted(RUNNERS)}")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for every engine (default: os.cpu_count())")
    p.add_argument("--save-json", default=None, metavar="PATH")
    # The engine flags (vLLM names) come from the CLI so they never drift; its --seed
    # seeds both the workload and the engine.
    add_engine_args(p)
    p.set_defaults(func=offline_main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_offline_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
