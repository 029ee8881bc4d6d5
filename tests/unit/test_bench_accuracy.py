"""`aioengine bench accuracy`: the agreement and perplexity maths, the report, the command
line, and one real run on a tiny random-weight model (float32 vs float32 must agree)."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from aioengine.bench import build_parser
from aioengine.bench.accuracy import (CONFIGS, PPL_TEXT_FILE, config_kwargs, format_accuracy,
                                      parse_configs)
from aioengine.bench.accuracy_metrics import (PplWindow, first_divergence, greedy_agreement,
                                              perplexity, ppl_windows, window_nll)
from aioengine.outputs import Logprob

from tests.tiny_models import make_tiny_model_dir

# ---- greedy agreement ------------------------------------------------------------------


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [9, 2, 3]) == 0
    assert first_divergence([1, 2, 3], [1, 2, 9]) == 2
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter output diverges where it ends
    assert first_divergence([], []) is None


def test_greedy_agreement_counts_tokens_before_the_first_divergence() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [0, 0, 0, 0]]
    out = [[1, 2, 3, 4], [5, 6, 0, 8], [1, 9, 9, 9], [0, 0, 0, 1]]
    a = greedy_agreement(ref, out)
    assert a.divergences == [None, 2, 0, 3]
    # 4 + 2 + 0 + 3: the token after a divergence never counts, even when it matches again.
    assert a.num_identical_tokens == 9 and a.num_tokens == 16
    assert a.token_agreement == pytest.approx(9 / 16)
    assert a.num_identical_prompts == 1 and a.prompt_agreement == pytest.approx(0.25)
    assert a.mean_first_divergence == pytest.approx(5 / 3)
    assert a.median_first_divergence == 2.0
    s = a.summary()
    assert s["first_divergences"] == [None, 2, 0, 3] and s["token_agreement"] == a.token_agreement
    json.dumps(s)  # the JSON record takes it as is


def test_greedy_agreement_identical_and_mismatched() -> None:
    a = greedy_agreement([[1, 2], [3]], [[1, 2], [3]])
    assert a.token_agreement == 1.0 and a.prompt_agreement == 1.0
    assert a.mean_first_divergence is None and a.median_first_divergence is None
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [[1], [2]])


# ---- perplexity ------------------------------------------------------------------------


@pytest.mark.parametrize("n,context,stride", [(2, 2, 1), (10, 4, 2), (11, 4, 3), (100, 16, 5),
                                              (5, 1024, 512), (1025, 1024, 512),
                                              (3000, 1024, 512)])
def test_ppl_windows_score_every_token_but_the_first_once(n: int, context: int,
                                                          stride: int) -> None:
    windows = ppl_windows(n, context, stride)
    scored = [p for w in windows for p in range(w.score_from, w.end)]
    assert scored == list(range(1, n))
    for i, w in enumerate(windows):
        assert 0 <= w.begin < w.score_from < w.end <= n and w.end - w.begin <= context
        assert w.begin == i * stride
        if i:  # later windows keep at least context - stride tokens of context
            assert w.score_from - w.begin >= context - stride
    assert windows[-1].end == n


def test_ppl_windows_known_layout_and_errors() -> None:
    assert ppl_windows(10, 4, 2) == [PplWindow(0, 4, 1), PplWindow(2, 6, 4),
                                     PplWindow(4, 8, 6), PplWindow(6, 10, 8)]
    assert ppl_windows(3000, 1024, 512)[1] == PplWindow(512, 1536, 1024)
    for bad in ((10, 1, 1), (10, 4, 4), (10, 4, 0), (1, 4, 2)):
        with pytest.raises(ValueError):
            ppl_windows(*bad)


def _fake_prompt_logprobs(ids: list[int], w: PplWindow, lp: float) -> list:
    """What the engine returns for the window's prompt: None, then {token: Logprob}."""
    return [None] + [{t: Logprob(lp, 1)} for t in ids[w.begin + 1:w.end]]


def test_window_nll_and_perplexity_of_a_uniform_model() -> None:
    """A model that gives every token probability 1/V has perplexity V, however the text is
    windowed."""
    vocab = 50
    ids = [(7 * i) % vocab for i in range(37)]
    for context, stride in ((8, 3), (37, 36), (4, 3), (2, 1)):
        windows = ppl_windows(len(ids), context, stride)
        nll = sum(window_nll(w, ids, _fake_prompt_logprobs(ids, w, -math.log(vocab)))
                  for w in windows)
        assert perplexity(nll, len(ids) - 1) == pytest.approx(vocab)


def test_window_nll_scores_only_its_new_tokens() -> None:
    ids = [10, 11, 12, 13, 14, 15]
    w = PplWindow(2, 6, 4)  # scores tokens 14, 15 with 12, 13 as context
    lps = [None, {13: Logprob(-9.0, 3)}, {14: Logprob(-1.0, 1)}, {15: Logprob(-2.0, 1)}]
    assert window_nll(w, ids, lps) == pytest.approx(3.0)
    with pytest.raises(ValueError):  # the chosen token is missing
        window_nll(w, ids, [None, {13: Logprob(-9.0, 3)}, {99: Logprob(-1.0, 1)},
                            {15: Logprob(-2.0, 1)}])
    with pytest.raises(ValueError):  # wrong length
        window_nll(w, ids, lps[:3])


def test_shipped_ppl_text() -> None:
    with open(PPL_TEXT_FILE, encoding="utf-8") as f:
        words = f.read().split()
    assert 3000 <= len(words) <= 6000


# ---- configurations, report, command line ----------------------------------------------


def test_parse_configs_and_config_kwargs() -> None:
    assert parse_configs("float32, bfloat16,int8") == ["float32", "bfloat16", "int8"]
    for bad in ("", "float32,float32", "fp8"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_configs(bad)
    base = {"dtype": "auto", "quantization": None, "kv_cache_dtype": "auto", "seed": 3}
    assert config_kwargs(base, "float32") == {"seed": 3, "dtype": "float32"}
    assert config_kwargs(base, "int8") == {"seed": 3, "dtype": "auto", "quantization": "int8"}
    assert set(CONFIGS) >= {"float32", "bfloat16", "int8"}


def test_command_line_defaults_and_refusals() -> None:
    args = build_parser().parse_args(["accuracy"])
    assert args.configs == list(CONFIGS) and args.num_prompts is None
    assert args.output_len == 64 and (args.ppl_context, args.ppl_stride) == (1024, 512)
    args = build_parser().parse_args(["accuracy", "--configs", "float32", "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match="--dtype"):
        args.func(args)


def _report() -> dict:
    greedy = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 0, 7, 8]])
    return {"environment": {"torch": "2.x", "torch_threads": 2, "cpu_count": 2,
                            "cpu_model": "Some CPU", "cpu_flags": ["avx2", "fma"]},
            "model": "m.gguf", "config": {},
            "workload": {"num_prompts": 2, "prompt_format": "chat", "prompt_len_min": 10,
                         "prompt_len_max": 20, "output_len": 4, "ppl_text": "ppl_text.txt",
                         "ppl_scored_tokens": 999, "ppl_windows": 2, "ppl_context": 1024,
                         "ppl_stride": 512},
            "reference": {"ppl": 10.0},
            "results": {"bfloat16": {"greedy": greedy.summary(), "ppl": 10.5,
                                     "ppl_delta": 0.5, "ppl_delta_pct": 5.0}},
            "skipped": {"int8": "NotImplementedError: later"}}


def test_format_accuracy() -> None:
    text = format_accuracy(_report())
    assert "Some CPU (avx2 fma)" in text and "perplexity 10.0000" in text
    row = next(line for line in text.splitlines() if line.startswith("bfloat16"))
    assert "5/8  62.5%" in row and "1/2  50.0%" in row and "1.0 / 1.0" in row
    assert "10.5000" in row and "+0.5000 (+5.00%)" in row
    assert "int8     failed: NotImplementedError: later" in text


# ---- a real run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny_accuracy"), seed=3)


def test_float32_against_the_float32_reference(tiny_model_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Two float32 engines give the same greedy tokens and the same perplexity."""
    out = tmp_path / "acc.json"
    args = build_parser().parse_args([
        "accuracy", "--model", str(tiny_model_dir), "--configs", "float32",
        "--num-prompts", "4", "--output-len", "8", "--ppl-max-tokens", "400",
        "--ppl-context", "256", "--ppl-stride", "128", "--save-json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "accuracy" and report["environment"]["cpu_model"]
    assert isinstance(report["environment"]["cpu_flags"], list)
    wl = report["workload"]
    assert wl["num_prompts"] == 4 and wl["prompt_format"] == "chat"
    assert (wl["ppl_text_tokens"], wl["ppl_scored_tokens"]) == (400, 399)
    assert (wl["ppl_context"], wl["ppl_stride"]) == (256, 128)
    assert wl["ppl_windows"] == 3  # [0, 256), [128, 384), [256, 400)
    r = report["results"]["float32"]
    assert r["greedy"]["token_agreement"] == 1.0 and r["greedy"]["prompt_agreement"] == 1.0
    assert r["greedy"]["num_tokens"] == 32
    ppl = report["reference"]["ppl"]
    assert math.isfinite(ppl) and ppl > 1.0
    assert r["ppl"] == pytest.approx(ppl, rel=1e-6) and abs(r["ppl_delta"]) < 1e-6 * ppl
    assert "float32" in capsys.readouterr().out
