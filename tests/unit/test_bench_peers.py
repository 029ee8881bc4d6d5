"""Benchmark peers in their own venvs (bench/peers.py, peer_child.py, hf_export.py).

Everything here runs without vLLM or llama.cpp: the command line, the JSON protocol (with
a stand-in child, and peer_child.py's own loop on a fake backend), and the Hugging Face
export. The tests that run a real peer need its python in AIOENGINE_VLLM_PYTHON or
AIOENGINE_LLAMACPP_PYTHON and are skipped otherwise.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from aioengine.bench import build_parser
from aioengine.bench import main as bench_main
from aioengine.bench import peer_child, peers
from aioengine.bench.hf_export import export_hf, export_key
from aioengine.bench.latency import first_diff, format_latency, parse_latency_engines
from aioengine.bench.peers import (LATENCY_PEERS, OFFLINE_PEERS, LatencyPeer, PeerError,
                                   PeerProcess, PeerRequest, parse_event, peer_env,
                                   run_peer_latency, vllm_options, with_peers)
from aioengine.model.loader import load_model

from tests.model.gguf_writer import tokenizer_fields, write_tiny_gguf
from tests.tiny_models import make_tiny_hf_model

VLLM_PYTHON = os.environ.get("AIOENGINE_VLLM_PYTHON")
LLAMACPP_PYTHON = os.environ.get("AIOENGINE_LLAMACPP_PYTHON")
VOCAB = 512


# ---- command line -----------------------------------------------------------------------


def test_peer_flags_add_the_peer_to_the_engines() -> None:
    args = build_parser().parse_args(["offline", "--vllm-python", "/p/bin/python"])
    assert (args.vllm_dtype, args.vllm_enforce_eager) == ("bfloat16", False)
    assert with_peers(args.engines, args, OFFLINE_PEERS) == ["aioengine", "hf", "hf-cb", "vllm"]
    args = build_parser().parse_args(["offline", "--engines", "vllm,aioengine",
                                      "--vllm-python", "/p"])
    assert with_peers(args.engines, args, OFFLINE_PEERS) == ["vllm", "aioengine"]
    args = build_parser().parse_args(["offline", "--engines", "aioengine,vllm"])
    with pytest.raises(SystemExit, match="--vllm-python"):
        with_peers(args.engines, args, OFFLINE_PEERS)
    args = build_parser().parse_args(["latency", "--llamacpp-python", "/l", "--vllm-python",
                                      "/v", "--engines", "llamacpp,aioengine"])
    assert with_peers(args.engines, args, LATENCY_PEERS) == ["llamacpp", "aioengine", "vllm"]
    assert parse_latency_engines("aioengine,vllm,llamacpp") == ["aioengine", "vllm", "llamacpp"]
    with pytest.raises(SystemExit):  # llama.cpp is a single-stream peer only
        build_parser().parse_args(["offline", "--llamacpp-python", "/l"])
    with pytest.raises(argparse.ArgumentTypeError):
        parse_latency_engines("vllm,vllm")
    args = build_parser().parse_args(["export-hf", "/m.gguf", "--dtype", "bfloat16"])
    assert (args.model, args.dtype, args.out) == ("/m.gguf", "bfloat16", None)


def test_vllm_options_follow_our_engine_flags() -> None:
    args = build_parser().parse_args(["offline", "--vllm-python", "/p", "--max-num-seqs", "8",
                                      "--max-num-batched-tokens", "256", "--max-model-len",
                                      "1024", "--no-enable-prefix-caching", "--seed", "3",
                                      "--kv-cache-memory", "123456", "--vllm-dtype", "float32"])
    assert vllm_options(args) == {
        "dtype": "float32", "seed": 3, "max_num_seqs": 8, "max_num_batched_tokens": 256,
        "enable_prefix_caching": False, "enable_chunked_prefill": True,
        "kv_cache_memory_bytes": 123456, "enforce_eager": False, "max_model_len": 1024}
    args = build_parser().parse_args(["latency", "--llamacpp-python", "/l"])
    assert "max_model_len" not in vllm_options(argparse.Namespace(**{**vars(args),
                                                                     "vllm_dtype": "bfloat16"}))
    spec = peers.latency_peers(args, prompt_len=256)
    assert spec == {"llamacpp": LatencyPeer("/l", {"n_ctx": 384, "n_batch": 512, "seed": 0})}


# ---- the protocol -----------------------------------------------------------------------


def test_request_line_and_events() -> None:
    req = PeerRequest("vllm", "offline", "/m", 2, [[1, 2]], [4], {"dtype": "bfloat16"})
    assert json.loads(req.to_line()) == {
        "backend": "vllm", "mode": "offline", "model": "/m", "threads": 2,
        "prompts": [[1, 2]], "output_lens": [4], "options": {"dtype": "bfloat16"},
        "warmup": 0, "repeats": 1}
    assert parse_event('{"event": "run", "run": 0}', "run") == {"event": "run", "run": 0}
    for line, match in (('{"event": "error", "message": "boom"}', "boom"),
                        ('{"event": "done"}', "'done' where 'run'"),
                        ("INFO vllm says hi", "not JSON"), ("[1]", "no event")):
        with pytest.raises(PeerError, match=match):
            parse_event(line, "run")
    env = peer_env("vllm", 3, base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "3", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in peer_env("llamacpp", 1, base={})


def test_child_loop_on_a_fake_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """peer_child.serve: loaded, then ready / go / run per run, then done."""
    monkeypatch.setattr(peer_child, "_llamacpp", lambda req: (None, {"fake": True}))
    monkeypatch.setattr(peer_child, "_llamacpp_runner", lambda llm, n_batch: (
        lambda prompt, n: ([0.1 * (i + 1) for i in range(n)], prompt[:1] * n)))
    req = PeerRequest("llamacpp", "latency", "/m.gguf", 1, [[7, 8]], [3], {"n_batch": 4},
                      warmup=1, repeats=2)
    out = io.StringIO()
    peer_child.serve(json.loads(req.to_line()), io.StringIO("go\ngo\ngo\n"), out)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["loaded", "ready", "run", "ready", "run", "ready",
                                            "run", "done"]
    assert events[0]["info"]["fake"] and events[2]["token_ids"] == [7, 7, 7]
    assert events[2]["token_times_s"] == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(RuntimeError, match="parent went away"):
        peer_child.serve(json.loads(req.to_line()), io.StringIO(""), io.StringIO())
    with pytest.raises(ValueError, match="unsupported"):
        peer_child.serve({"backend": "llamacpp", "mode": "offline"}, io.StringIO(), out)


def test_child_without_the_peer_reports_its_error() -> None:
    """peer_child.py in an interpreter without vLLM: an error event, and the log kept."""
    req = PeerRequest("vllm", "offline", "/nowhere", 1, [[1]], [2], {})
    with pytest.raises(PeerError, match="peer failed: ModuleNotFoundError") as info:
        with PeerProcess(sys.executable, "vllm", 1) as peer:
            peer.send(req.to_line())
            peer.recv("loaded")
    log = str(info.value).split("(peer log: ")[1].split(";")[0]
    assert os.path.isfile(log)
    os.unlink(log)
    with pytest.raises(PeerError, match="not an executable"):
        PeerProcess("/no/such/python", "vllm", 1)


FAKE_CHILD = textwrap.dedent("""
    import json, sys
    req = json.loads(sys.stdin.readline())
    def send(**m):
        print(json.dumps(m), flush=True)
    send(event="loaded", info={"model": req["model"]})
    for i in range(req["warmup"] + req["repeats"]):
        send(event="ready", run=i)
        assert sys.stdin.readline().strip() == "go"
        n = req["output_lens"][0]
        send(event="run", run=i, token_times_s=[0.5 + 0.1 * k for k in range(n)],
             token_ids=list(range(n)))
    send(event="done")
""")


def test_latency_handshake_with_a_stand_in_child(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """run_peer_latency: bandwidth around every timed run, warm-ups dropped."""
    child = tmp_path / "child.py"
    child.write_text(FAKE_CHILD)
    monkeypatch.setattr(peers, "CHILD_SCRIPT", str(child))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    result = run_peer_latency("llamacpp", LatencyPeer(sys.executable), str(model), [1, 2, 3],
                              4, warmup=1, repeats=2, bandwidth_bytes=1 << 20)
    assert result.engine == "llamacpp" and len(result.runs) == 2
    assert result.peer_info == {"model": str(model)}
    assert result.outputs == [[0, 1, 2, 3]] * 2
    run = result.runs[0]
    assert run.ttft_s == pytest.approx(0.5) and run.tpot_s == pytest.approx(0.1)
    assert all(r.bandwidth > 0 for r in result.runs)
    summary = result.summary(weight_bytes=10**6)
    assert summary["peer_info"] == {"model": str(model)} and "tpot_over_floor" in summary


def test_latency_report_lines_for_peers() -> None:
    assert first_diff([1, 2, 3], [1, 2, 3]) is None and first_diff([1, 2, 3], [1, 5, 3]) == 1
    stat = {"median": 2.0, "best": 1.0}
    row = {k: stat for k in ("ttft_ms", "tpot_ms", "itl_median_ms", "e2e_ms",
                             "tpot_over_floor")}
    report = {"environment": {"torch": "t", "transformers": "x", "torch_threads": 2,
                              "cpu_count": 2, "cuda": None}, "model": "m",
              "config": {"input_len": 4, "output_len": 3, "seed": 0, "repeats": 1, "warmup": 0},
              "floor": {"bandwidth_gb_per_s": 1.0, "bandwidth_repeats": 5,
                        "bandwidth_buffer_bytes": 1 << 20, "weight_bytes": 10**6,
                        "floor_ms": 1.0},
              "results": {"aioengine": row, "llamacpp": {**row, "peer_info": {}}},
              "skipped": {"vllm": "PeerError: no"}, "tpot_over_floor": stat,
              "target_tpot_over_floor": 1.4,
              "speedup_vs": {"llamacpp": {"median": 0.5, "best": 0.25}},
              "agreement": {"llamacpp": 7}}
    text = format_latency(report)
    assert "aioengine speed-up vs llamacpp (llamacpp TPOT / our TPOT): x0.50" in text
    assert "greedy output of llamacpp vs ours: first differs at token 7" in text
    assert "vllm       skipped: PeerError: no" in text and "can go below 1" in text


def test_saved_report_takes_int_keys(tmp_path: Path) -> None:
    """A peer whose greedy outputs differ from ours gives `first_diffs` int keys."""
    from aioengine.bench.offline import compare_outputs
    from aioengine.bench.report import save_json

    agreement = compare_outputs([[1, 2], [3, 4]], [[1, 2], [3, 5]])
    save_json(str(tmp_path / "r.json"), {"agreement": {"vllm": agreement.first_diffs}})
    assert json.loads((tmp_path / "r.json").read_text()) == {"agreement": {"vllm": {"1": 1}}}


# ---- the Hugging Face export ------------------------------------------------------------


def _write_tiny_gguf(path: Path, bundled_gguf_path: str, **overrides):
    """A tiny llama GGUF (tied embeddings, q/k rows permuted as llama.cpp stores them) and
    the transformers model it is equivalent to."""
    from aioengine.model.gguf_loader import FastGGUFReader

    hf = make_tiny_hf_model("llama", vocab_size=VOCAB, **overrides)
    reference = write_tiny_gguf(hf, "llama", path, tokenizer_fields(FastGGUFReader(
        bundled_gguf_path)))
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return path, hf.eval()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, bundled_gguf_path: str):
    return _write_tiny_gguf(tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf",
                            bundled_gguf_path)


def test_export_loads_in_transformers_with_equal_logits(tiny_gguf, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, reference = tiny_gguf
    out = Path(export_hf(str(path), "float32", str(tmp_path / "hf")))
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == reference.config.rope_parameters["rope_theta"]
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(exported(tokens).logits, reference(tokens).logits,
                                   atol=1e-5, rtol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == VOCAB and "<|im_start|>" in tokenizer.chat_template
    # Our loader reads the same weights from the export as from the GGUF.
    ours = load_model(str(path), torch.float32, torch.device("cpu")).model.state_dict()
    again = load_model(str(out), torch.float32, torch.device("cpu")).model.state_dict()
    assert ours.keys() == again.keys()
    for name, tensor in ours.items():
        torch.testing.assert_close(again[name], tensor, atol=0, rtol=0, msg=name)


def test_export_cache_and_passthrough(tiny_gguf, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = tiny_gguf
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    first = export_hf(str(path), "bfloat16")
    assert Path(first).parent == tmp_path / "cache" / "hf-export"
    assert Path(first).name == export_key(str(path), "bfloat16")
    assert Path(first).name.startswith("tiny-bfloat16-")
    stamp = os.stat(Path(first) / "model.safetensors").st_mtime_ns
    assert export_hf(str(path), "bfloat16") == first  # reused, not rewritten
    assert os.stat(Path(first) / "model.safetensors").st_mtime_ns == stamp
    assert export_hf(str(path), "float32") != first
    assert sorted(p.name for p in (tmp_path / "cache" / "hf-export").iterdir()) == sorted(
        [Path(first).name, export_key(str(path), "float32")])  # no temporary left behind
    assert export_hf(first) == first  # a Hugging Face directory is already one
    with pytest.raises(ValueError, match="dtype"):
        export_hf(str(path), "int8")


def test_export_refuses_llama3_rope_factors(tmp_path: Path, bundled_gguf_path: str) -> None:
    from aioengine.model.gguf_loader import FastGGUFReader

    hf = make_tiny_hf_model("llama3", vocab_size=VOCAB)
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(hf, "llama", path, tokenizer_fields(FastGGUFReader(bundled_gguf_path)))
    with pytest.raises(NotImplementedError, match="rope"):
        export_hf(str(path), out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["llama3.gguf"]


# ---- real peers (their venvs named in the environment) ---------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not LLAMACPP_PYTHON, reason="set AIOENGINE_LLAMACPP_PYTHON to run llama.cpp")
def test_llamacpp_latency_agrees_with_ours(tiny_gguf, tmp_path: Path, bench_threads,
                                           capsys) -> None:
    path, _ = tiny_gguf  # llama.cpp reads the GGUF itself: no export
    out = tmp_path / "lat.json"
    assert bench_main(["latency", "--model", str(path), "--input-len", "24", "--output-len",
                       "8", "--repeats", "1", "--warmup", "1", "--bandwidth-mib", "16",
                       "--dtype", "float32",
                       "--engines", "aioengine", "--llamacpp-python", LLAMACPP_PYTHON,
                       "--save-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["skipped"] == {} and report["results"]["llamacpp"]["num_runs"] == 1
    assert report["agreement"]["llamacpp"] is None  # float32 weights: the same greedy tokens
    assert "llama_cpp_python" in report["results"]["llamacpp"]["peer_info"]
    assert "aioengine speed-up vs llamacpp" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON, reason="set AIOENGINE_VLLM_PYTHON to run vLLM")
def test_vllm_offline_agrees_with_ours(tmp_path: Path, bundled_gguf_path: str, bench_threads,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))  # the export
    # vLLM's CPU attention has kernels for some head sizes only (not 16): 2 heads of 64.
    path, _ = _write_tiny_gguf(tmp_path / "tiny64.gguf", bundled_gguf_path, hidden_size=128,
                               num_attention_heads=2, num_key_value_heads=1)
    out = tmp_path / "off.json"
    assert bench_main(["offline", "--model", str(path), "--num-prompts", "4",
                       "--input-len-min", "8", "--input-len-max", "24", "--output-len", "6",
                       "--engines", "aioengine", "--vllm-python", VLLM_PYTHON,
                       "--dtype", "float32", "--vllm-dtype", "float32",
                       "--vllm-enforce-eager", "--no-progress",
                       "--save-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["skipped"] == {}, report["skipped"]
    assert report["results"]["vllm"]["num_output_tokens"] == 4 * 6
    assert report["agreement"]["vllm"]["num_equal"] == 4
    assert report["results"]["vllm"]["peer_info"]["vllm"]
