"""The EAGLE-3 head's fused C step (spec_decode/eagle_fused.py) against its torch path: a
catch-up over two requests' chunks, then two chain steps of decode rows, in float32 and
bf16 and int8 storage (int8: a head's default on the CPU), with and without
norm_before_residual: the same bits in the outputs and in the head's KV cache, and the
kernel really ran."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eagle_heads import make_random_eagle_head_dir
from tiny_models import make_tiny_config

from aioengine.kernels import cpu as cpu_kernels
from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import build_attention_metadata
from aioengine.model.layers import Linear
from aioengine.spec_decode import eagle_fused
from aioengine.spec_decode.eagle import EagleHead, load_eagle_head

CPU = torch.device("cpu")
H = 64
VOCAB = 49152
BLOCK_SIZE = 4

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="C kernels not built")


def _head(tmp_path: Path, storage: torch.dtype, norm_before_residual: bool) -> EagleHead:
    target = tmp_path / "target"
    make_tiny_config("llama", num_hidden_layers=4).save_pretrained(target)
    path = make_random_eagle_head_dir(target, tmp_path / "head", "eagle3", seed=5,
                                      draft_vocab_size=700)
    if norm_before_residual:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "norm_before_residual": True}))
    arch = ModelArchConfig.from_hf_config(make_tiny_config("llama", num_hidden_layers=4))
    if storage == torch.int8:  # as make_proposer loads a head on the CPU by default
        return load_eagle_head(str(path), "eagle3", arch, torch.bfloat16, CPU, storage="int8")
    return load_eagle_head(str(path), "eagle3", arch, storage, CPU)


def _run(head: EagleHead, fused: bool, steps, embed: Linear) -> tuple[list, torch.Tensor]:
    """Each step: (query_lens, seq_lens, tables, token ids, hidden): the outputs and the
    head's KV cache after them all."""
    assert head.fused is not None
    head.fused.enabled = fused
    kv_cache = head.make_kv_cache(num_blocks=16, block_size=BLOCK_SIZE)
    outs = []
    with torch.inference_mode():
        for query_lens, seq_lens, tables, ids, hidden in steps:
            meta, positions = build_attention_metadata(query_lens, seq_lens, tables,
                                                       BLOCK_SIZE, CPU)
            outs.append(head(ids, hidden, positions, kv_cache, meta, embed))
    return outs, kv_cache


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_fused_step_gives_the_torch_paths_bits(tmp_path, monkeypatch, storage,
                                               norm_before_residual) -> None:
    head = _head(tmp_path, storage, norm_before_residual)
    gen = torch.Generator().manual_seed(0)
    embed = Linear(H, VOCAB, False, dtype=torch.float32, device=CPU)
    embed.weight.copy_(0.2 * torch.randn(VOCAB, H, generator=gen))
    tables = [[3, 9, 1, 12], [7, 2, 14, 5]]
    aux_width = head.input_hidden_size

    def ids(n: int) -> torch.Tensor:
        return torch.randint(VOCAB, (n,), generator=gen)

    steps = [  # catch-up: chunks of 6 and 3 (aux states), then chain steps (H wide)
        ([6, 3], [6, 3], tables, ids(9), torch.randn(9, aux_width, generator=gen)),
        ([1, 1], [7, 4], tables, ids(2), torch.randn(2, H, generator=gen)),
        ([1, 1], [8, 5], tables, ids(2), torch.randn(2, H, generator=gen)),
        ([2, 1], [10, 6], tables, ids(3), torch.randn(3, aux_width, generator=gen)),
    ]
    calls = []
    real = eagle_fused.cpu_decode.llama_decode

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(eagle_fused.cpu_decode, "llama_decode", spy)
    torch_outs, torch_cache = _run(head, False, steps, embed)
    assert calls == []
    fused_outs, fused_cache = _run(head, True, steps, embed)
    assert calls == [9, 2, 2, 3]
    for (a_logits, a_next), (b_logits, b_next) in zip(torch_outs, fused_outs):
        assert torch.equal(a_logits, b_logits)
        assert torch.equal(a_next, b_next)
    assert torch.equal(torch_cache, fused_cache)


def test_fused_step_declines_what_it_does_not_run(tmp_path) -> None:
    head = _head(tmp_path, torch.float32, False)
    assert head.fused is not None and head.fused.enabled
    kv_cache = head.make_kv_cache(num_blocks=4, block_size=BLOCK_SIZE)
    meta, positions = build_attention_metadata([2], [2], [[1]], BLOCK_SIZE, CPU)
    emb, hidden = torch.randn(2, H), torch.randn(2, H)
    assert head.fused.run(emb.double(), hidden.double(), positions, kv_cache, meta) is None
    assert head.fused.run(emb, hidden, positions, kv_cache, meta) is not None
    head.fused.enabled = False
    assert head.fused.run(emb, hidden, positions, kv_cache, meta) is None
    # Projections left unpacked (load_eagle_head packs them where the kernels are built):
    # no row-major kernel, so the step declines at any row count.
    for lin in head.layer.projections():
        lin.weight = torch.nn.Parameter(lin.dense_weight(), requires_grad=False)
    unpacked = eagle_fused.FusedEagleStep(head)
    assert unpacked.enabled and not unpacked.packed
    meta, positions = build_attention_metadata([1], [3], [[1]], BLOCK_SIZE, CPU)
    assert unpacked.run(emb[:1], hidden[:1], positions, kv_cache, meta) is None
