"""Sliding-window attention, added through the layer description only (LayerSpec's
`sliding_window` option): exact against transformers on tiny Mistral (every layer windowed)
and Qwen2 (`layer_types`: only the layers past max_window_layers) models with sequences far
longer than the window; the fused decode executor runs only the steps whose sequences fit
in the window and declines the rest, which then run layerwise."""
from __future__ import annotations

import random

import pytest
import torch
from hf_compare import assert_matches_hf
from paged_driver import PagedDriver, Seq
from tiny_models import make_tiny_model_dir

from aioengine.model.arch import ModelArchConfig
from aioengine.model.layer_spec import layer_specs
from aioengine.model.loader import load_model
from aioengine.model.triton_attention import TorchAttentionBackend

CPU = torch.device("cpu")
WINDOW = 8
CASES = {"mistral": dict(sliding_window=WINDOW),
         "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)}


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory, bundled_tokenizer):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(request.param, tmp_path_factory.mktemp(request.param),
                               tokenizer=bundled_tokenizer, **CASES[request.param])
    ours = load_model(str(path), torch.float32, CPU).model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, ours, hf


def test_the_window_reaches_the_layers_it_names(models) -> None:
    arch_name, ours, _ = models
    windows = [spec.sliding_window for spec in ours.layer_specs]
    assert windows == ([WINDOW, WINDOW] if arch_name == "mistral" else [None, WINDOW])
    assert ours.max_model_len == ours.arch.max_position_embeddings  # no cap: real windows
    assert {"sliding_window"} <= set().union(*(s.features() for s in ours.layer_specs))


@torch.inference_mode()
def test_greedy_decode_matches_transformers_past_the_window(models) -> None:
    """Prompts of 5 and 11 tokens (one inside the window, one past it), 24 new tokens each,
    prefilled in chunks of 3 and 7: logits and greedy tokens equal transformers' on the
    whole sequence; the fused executor ran exactly the decode steps that fit the window."""
    _, ours, hf = models
    rng = random.Random(0)
    seqs = [Seq([rng.randrange(3, 49152) for _ in range(n)], n, 24) for n in (5, 11)]
    driver = PagedDriver(ours)
    executors: list[tuple[int, str]] = []
    step = 0
    while not all(s.done for s in seqs):
        work = []
        for seq in seqs:
            left = len(seq.token_ids) - seq.num_computed
            if not seq.done and left:
                work.append((seq, min(left, (3, 7)[step % 2])))
        driver.step(work)
        if all(n == 1 for _, n in work):
            executors.append((max(s.num_computed for s, _ in work), ours.last_executor))
        step += 1
    for seq in seqs:
        assert_matches_hf(hf, seq)
    windowed = any(spec.sliding_window for spec in ours.layer_specs)
    assert windowed and executors
    for longest, name in executors:
        assert name == ("fused_cpu_decode" if longest <= WINDOW else "layerwise"), longest
    assert any(name == "layerwise" for _, name in executors)


def test_a_backend_without_windows_caps_max_model_len(models) -> None:
    """Full attention is windowed attention up to the window: a backend that lacks the
    feature is taken with max_model_len capped there (the Triton backend's case)."""
    _, ours, _ = models

    class FullAttentionOnly(TorchAttentionBackend):
        SUPPORTED_FEATURES = frozenset({"qk_norm", "attention_bias"})

    backend = ours.attn_backend
    try:
        ours.attn_backend = FullAttentionOnly()
        assert ours.max_model_len == WINDOW
    finally:
        ours.attn_backend = backend
    assert ours.max_model_len == ours.arch.max_position_embeddings


def test_an_unknown_layer_feature_declines_the_fused_executor(models) -> None:
    """Fail closed: an executor that does not list a feature the layers use (here one
    without sliding_window, as the kernel would be before it learnt it) declines them."""
    _, ours, _ = models
    from aioengine.model.executors import FusedCpuDecodeExecutor

    class NarrowFused(FusedCpuDecodeExecutor):
        SUPPORTED_FEATURES = frozenset({"qk_norm", "attention_bias"})

    assert NarrowFused(ours).declined == {"sliding_window"}
    assert FusedCpuDecodeExecutor(ours).declined == frozenset()


def test_arch_reads_the_window_per_layer() -> None:
    from tiny_models import make_tiny_config

    qwen2 = ModelArchConfig.from_hf_config(make_tiny_config("qwen2", **CASES["qwen2"]))
    assert [s.sliding_window for s in layer_specs(qwen2)] == [None, WINDOW]
    off = ModelArchConfig.from_hf_config(make_tiny_config("qwen2", sliding_window=WINDOW))
    assert all(s.sliding_window is None for s in layer_specs(off))
