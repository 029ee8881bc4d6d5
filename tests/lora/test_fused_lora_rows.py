"""The fused decode kernel's LoRA (kernels/cpu/lora_decode.h: the adapter tokens in blocks of
up to LORA_BLOCK per slot, the shrinks and expands split over the threads) gives every row
the bits of the layer path (lora_apply), whatever the step around it: the whole step, each
row alone and the rows reordered agree bit for bit, K/V included."""
from __future__ import annotations

import random

import pytest
import torch

from aioengine.kernels import cpu as cpu_kernels
from aioengine.lora import LoRARequest
from aioengine.lora.manager import LoRAConfig, LoRAManager
from aioengine.model.attention import build_attention_metadata
from aioengine.model.llama import make_kv_caches
from aioengine.model.loader import load_model

CPU = torch.device("cpu")
BLOCK = 4
# 10 rows of a2 (two blocks: 8 + 2), a3 and a1 in blocks of their own, base rows between.
NAMES = ["a2"] * 10 + ["a3"] * 4 + ["a1", None, "a1", None, None, "a2"]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=str)
def setup(request, lora_model_dir, adapter_dirs):
    assert cpu_kernels.load() is not None, cpu_kernels.load_error()
    dtype = request.param
    manager = LoRAManager(LoRAConfig(max_loras=3, max_lora_rank=8), CPU, dtype)
    model = load_model(str(lora_model_dir), dtype, CPU, linear_factory=manager.linear_factory,
                       lora_source=manager).model
    loras = {name: manager.add(LoRARequest(name, str(path)))
             for name, path in adapter_dirs.items()}
    loras[None] = None
    rng = random.Random(3)
    names = list(NAMES)
    rng.shuffle(names)  # a slot's rows interleave with the others', as in a decode step
    seq_lens = [rng.randrange(1, 30) for _ in names]
    nblocks = [-(-s // BLOCK) for s in seq_lens]
    tables = [list(range(sum(nblocks[:i]), sum(nblocks[:i + 1]))) for i in range(len(names))]
    caches = make_kv_caches(model.arch, sum(nblocks), BLOCK, torch.float32, CPU)
    for cache in caches:  # a context to attend to
        cache.normal_(generator=torch.Generator().manual_seed(4))
    ids = [rng.randrange(3, 40000) for _ in names]
    return model, manager, loras, names, seq_lens, tables, caches, ids


def _step(setup, rows: list[int], fused: bool, adapters: bool = True):
    """Hidden states and K/V caches of a decode step of `rows` (on copies of the caches)."""
    model, manager, loras, names, seq_lens, tables, caches, ids = setup
    caches = [c.clone() for c in caches]
    model.use_fused_decode = fused
    try:
        meta, pos = build_attention_metadata([1] * len(rows), [seq_lens[i] for i in rows],
                                             [tables[i] for i in rows], BLOCK, CPU)
        manager.assign_slots([(loras[names[i]] if adapters else None, 1) for i in rows])
        with torch.inference_mode():
            out = model(torch.tensor([ids[i] for i in rows]), pos, caches, meta)
        manager.end_step()
        assert model.last_executor == ("fused_cpu_decode" if fused else "layerwise")
    finally:
        model.use_fused_decode = True
    return out, caches


def _assert_same(a, b) -> None:
    (out_a, caches_a), (out_b, caches_b) = a, b
    assert torch.equal(out_a, out_b)
    for ca, cb in zip(caches_a, caches_b):
        assert torch.equal(ca, cb)


def test_fused_lora_rows_have_the_layer_paths_bits(setup):
    names = setup[3]
    rows = list(range(len(names)))
    fused = _step(setup, rows, fused=True)
    _assert_same(fused, _step(setup, rows, fused=False))
    # The adapters are there: their rows move, the base rows do not.
    base, _ = _step(setup, rows, fused=True, adapters=False)
    moved = (fused[0] - base).abs().amax(1) > 1e-3
    assert moved.tolist() == [n is not None for n in names]


def test_fused_lora_row_bits_do_not_depend_on_the_step(setup):
    names = setup[3]
    rows = list(range(len(names)))
    out, _ = _step(setup, rows, fused=True)
    alone = torch.cat([_step(setup, [i], fused=True)[0] for i in rows])
    assert torch.equal(alone, out)
    order = rows[::-1][1:] + rows[-1:]  # other blocks, other threads' shares
    reordered, _ = _step(setup, order, fused=True)
    assert torch.equal(reordered, out[order])
    some = rows[::3]
    assert torch.equal(_step(setup, some, fused=True)[0], out[some])
