"""run-batch against `aioengine bench offline` on the same requests (issue 31: >= 0.9x).

The workload is the one `bench offline` builds from the same flags (`--dataset`,
`--num-prompts`, `--output-len`, `--seed`); each request becomes a `/v1/completions` line
with the same prompt token ids, `max_tokens` = its output length, `ignore_eos` and greedy
sampling, so both do exactly the same work. The two commands run alternately (A B A B ...),
each in its own process on the same engine defaults; both time only the requests (the
engine's start-up and bench offline's warm-up excluded). Prints each run's output tokens/s
and the ratio run-batch / offline per pair and of the medians.

    .venv/bin/python scripts/run_batch_vs_offline.py --dataset text --num-prompts 64 \\
        --output-len 64 --pairs 3
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from aioengine.bench.datasets import add_dataset_args, build_workload

_SUMMARY = re.compile(r"run-batch: (\d+) ok, (\d+) failed.* in ([\d.]+) s; "
                      r"(\d+) prompt \+ (\d+) completion tokens")


def write_batch_file(args: argparse.Namespace, path: str) -> int:
    from aioengine.bench.offline import load_hf_tokenizer
    from aioengine.model.default import bundled_model_path

    workload = build_workload(args, load_hf_tokenizer(bundled_model_path()))
    with open(path, "wb") as f:
        for i, r in enumerate(workload.requests):
            body = {"prompt": r.prompt_token_ids, "max_tokens": r.output_len,
                    "ignore_eos": True, "temperature": 0}
            f.write(json.dumps({"custom_id": f"req-{i}", "method": "POST",
                                "url": "/v1/completions", "body": body}).encode() + b"\n")
    return sum(r.output_len for r in workload.requests)


def dataset_flags(args: argparse.Namespace) -> list[str]:
    return ["--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
            "--output-len", str(args.output_len), "--seed", str(args.seed)]


def run_offline(args: argparse.Namespace, folder: str) -> float:
    out = os.path.join(folder, "offline.json")
    subprocess.run([sys.executable, "-m", "aioengine.cli", "bench", "offline", "--engines",
                    "aioengine", "--no-progress", "--save-json", out, *dataset_flags(args)],
                   check=True, capture_output=True)
    with open(out) as f:
        return json.load(f)["results"]["aioengine"]["output_tok_per_s"]


def run_batch(args: argparse.Namespace, folder: str, batch_file: str, tokens: int) -> float:
    out = os.path.join(folder, "results.jsonl")
    if os.path.exists(out):
        os.remove(out)
    proc = subprocess.run([sys.executable, "-m", "aioengine.cli", "run-batch", "-i",
                           batch_file, "-o", out, "--no-progress"],
                          check=True, capture_output=True, text=True)
    match = _SUMMARY.search(proc.stderr)
    assert match, proc.stderr
    ok, failed, elapsed, completion = (int(match[1]), int(match[2]), float(match[3]),
                                       int(match[5]))
    assert failed == 0 and ok == args.num_prompts and completion == tokens, proc.stderr
    return completion / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        batch_file = os.path.join(folder, "requests.jsonl")
        tokens = write_batch_file(args, batch_file)
        offline, batch = [], []
        for pair in range(args.pairs):
            offline.append(run_offline(args, folder))
            batch.append(run_batch(args, folder, batch_file, tokens))
            print(f"pair {pair + 1}: offline {offline[-1]:.1f} tok/s, run-batch "
                  f"{batch[-1]:.1f} tok/s, ratio {batch[-1] / offline[-1]:.3f}", flush=True)
    med_o, med_b = statistics.median(offline), statistics.median(batch)
    print(f"median: offline {med_o:.1f}, run-batch {med_b:.1f} output tok/s; "
          f"ratio {med_b / med_o:.3f}")


if __name__ == "__main__":
    main()
