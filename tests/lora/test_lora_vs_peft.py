"""Mixed-adapter batches against transformers + peft: several random PEFT adapters (ranks,
target modules, rsLoRA differ) and base rows in one step, each row's logits against its
own adapter's, on the layer path (prefill chunks, many decode rows: the C lora_apply and
the torch form) and the fused decode path."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.kernels import cpu_decode, cpu_gemm
from aioengine.lora import LoRARequest
from aioengine.lora.manager import LoRAConfig, LoRAManager
from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model
from tests.float_error import assert_as_exact_as
from tests.lora_adapters import make_peft_adapter, peft_model
from tests.tiny_models import make_tiny_model_dir

CPU = torch.device("cpu")
BLOCK = 4
ADAPTERS = {  # name -> make_peft_adapter arguments
    "attn": dict(r=4, target_modules=["q_proj", "v_proj"], seed=1),
    "all": dict(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"], seed=2, use_rslora=True),
    "mlp": dict(r=2, target_modules=["gate_proj", "down_proj", "o_proj"], seed=3, lora_alpha=4),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "gemma2",
                                                "gemma3", "olmo2", "granite", "smollm3"])
def setup(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"lora_{arch}")
    model_dir = make_tiny_model_dir(arch, root / "model", seed=5)
    adapters = {name: make_peft_adapter(model_dir, root / name, **kw)
                for name, kw in ADAPTERS.items()}
    refs = {name: peft_model(model_dir, path) for name, path in adapters.items()}
    refs[None] = peft_model(model_dir, None)
    return model_dir, adapters, refs


def _engine_model(model_dir, adapters):
    manager = LoRAManager(LoRAConfig(max_loras=3, max_lora_rank=8), CPU, torch.float32)
    model = load_model(str(model_dir), torch.float32, CPU, linear_factory=manager.linear_factory,
                       lora_source=manager).model
    loras = {name: manager.add(LoRARequest(name, str(path))) for name, path in adapters.items()}
    loras[None] = None
    return model, manager, loras


def _reference_logits(refs, name, tokens):
    with torch.no_grad():
        return refs[name](torch.tensor([tokens])).logits[0].float()


def _exact_logits(refs, name, tokens):
    """The reference model in float64: what both float32 runs are judged by."""
    with torch.no_grad():
        return copy.deepcopy(refs[name]).double()(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_mixed_batch_matches_peft(setup, kernels, monkeypatch):
    model_dir, adapters, refs = setup
    if kernels == "c":
        assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    else:
        monkeypatch.setattr(cpu_decode, "lora_apply", lambda *a: False)
    model, manager, loras = _engine_model(model_dir, adapters)
    rng = random.Random(0)
    names = ["attn", None, "all", "mlp", "all", None, "attn"]
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(3, 14))] for _ in names]
    nblocks = [-(-(len(p) + 2) // BLOCK) for p in prompts]
    caches = make_kv_caches(model.arch, sum(nblocks) + 1, BLOCK, torch.float32, CPU)
    tables, first = [], 0
    for n in nblocks:
        tables.append(list(range(first, first + n)))
        first += n
    # One prefill step: every prompt a segment of its own adapter.
    lens = [len(p) for p in prompts]
    with torch.inference_mode():
        meta, pos = build_attention_metadata(lens, lens, tables, BLOCK, CPU)
        manager.assign_slots([(loras[n], len(p)) for n, p in zip(names, prompts)])
        hidden = model(torch.tensor([t for p in prompts for t in p]), pos, caches, meta)
        logits = model.compute_logits(hidden)
        manager.end_step()
    ref32 = torch.cat([_reference_logits(refs, n, p) for n, p in zip(names, prompts)])
    exact = torch.cat([_exact_logits(refs, n, p) for n, p in zip(names, prompts)])
    assert_as_exact_as(logits, ref32, exact)
    # Decode steps of every prompt's next token: fused (<= 8 rows) and layer path.
    nxt = [int(logits[sum(lens[:i + 1]) - 1].argmax()) for i in range(len(prompts))]
    fused_calls = []
    real_decode = cpu_decode.llama_decode
    monkeypatch.setattr(cpu_decode, "llama_decode",
                        lambda *a, **kw: fused_calls.append(kw["lora"]) or real_decode(*a, **kw))
    for fused in (True, False):
        model.use_fused_decode = fused
        with torch.inference_mode():
            meta, pos = build_attention_metadata([1] * len(prompts), [n + 1 for n in lens],
                                                 tables, BLOCK, CPU)
            manager.assign_slots([(loras[n], 1) for n in names])
            out = model.compute_logits(model(torch.tensor(nxt), pos, caches, meta))
            manager.end_step()
        refs32 = torch.stack([_reference_logits(refs, n, p + [t])[-1]
                              for n, p, t in zip(names, prompts, nxt)])
        assert_as_exact_as(out, refs32, torch.stack([_exact_logits(refs, n, p + [t])[-1]
                                                     for n, p, t in zip(names, prompts, nxt)]))
        assert out.argmax(-1).tolist() == refs32.argmax(-1).tolist()
    # The fused step ran in the C kernel with the adapters (no silent layer-path fallback),
    # unless the model's layers use options it does not list (Gemma, OLMo 2, ...: declined).
    if model.fused_decode.declined:
        assert fused_calls == []
    else:
        assert len(fused_calls) == 1 and fused_calls[0] is not None


def test_bf16_slots_same_on_every_path(setup, monkeypatch):
    """bf16 weights keep the slots in bf16 (widened in registers): the C kernel and the torch
    form agree, the fused decode agrees with the layer path (bf16's tolerance, as for the
    base model), and the adapters still change the logits."""
    model_dir, adapters, _ = setup
    manager = LoRAManager(LoRAConfig(max_loras=3, max_lora_rank=8), CPU, torch.bfloat16)
    model = load_model(str(model_dir), torch.bfloat16, CPU,
                       linear_factory=manager.linear_factory, lora_source=manager).model
    assert manager.slot_dtype == torch.bfloat16
    loras = [manager.add(LoRARequest(n, str(p))) for n, p in adapters.items()] + [None]
    rng = random.Random(1)
    seq_lens = [rng.randrange(3, 20) for _ in loras]
    nblocks = [-(-s // BLOCK) for s in seq_lens]
    tables = [list(range(sum(nblocks[:i]), sum(nblocks[:i + 1]))) for i in range(len(loras))]
    caches = make_kv_caches(model.arch, sum(nblocks), BLOCK, torch.float32, CPU)
    meta, pos = build_attention_metadata([1] * len(loras), seq_lens, tables, BLOCK, CPU)
    ids = torch.tensor([rng.randrange(3, 49000) for _ in loras])

    def decode(token_loras, fused=True):
        model.use_fused_decode = fused
        manager.assign_slots([(lora, 1) for lora in token_loras])
        with torch.inference_mode():
            out = model.compute_logits(model(ids, pos, caches, meta))
        manager.end_step()
        return out

    fused, layer = decode(loras), decode(loras, fused=False)
    torch.testing.assert_close(fused, layer, atol=3e-2, rtol=3e-2)
    monkeypatch.setattr(cpu_decode, "lora_apply", lambda *a: False)
    # The two LoRA forms differ in summation order only; where the base GEMM rounds its x to
    # bf16 (the AVX512-BF16 build) a last-bit difference can move x by a bf16 step in the
    # next projection, so the tolerance is bf16's there.
    tol = (3e-2, 3e-2) if cpu_gemm.rounds_x_to_bf16() else (1e-3, 1e-4)
    torch.testing.assert_close(decode(loras, fused=False), layer, atol=tol[0], rtol=tol[1])
    base = decode([None] * len(loras))
    assert (fused[:3] - base[:3]).abs().amax() > 1.0
    torch.testing.assert_close(fused[3], base[3])
