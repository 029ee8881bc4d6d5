"""The trainable EAGLE-3 head (spec_decode/train/head.py) computes what the engine's head
computes: a random TrainableEagle3, exported and loaded by load_eagle_head, gives the same
logits over the paged cache (a catch-up prefill, then the draft chain) as its own
training-time-test forward at the same origin, for every chain step."""
from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_config

from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import build_attention_metadata
from aioengine.model.layers import Linear
from aioengine.spec_decode.eagle import load_eagle_head
from aioengine.spec_decode.train.head import TrainableEagle3, export_head

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def _random_head(arch: ModelArchConfig, aux: tuple[int, ...], draft_ids: torch.Tensor | None,
                 seed: int) -> tuple[TrainableEagle3, Linear]:
    gen = torch.Generator().manual_seed(seed)
    v, h = arch.vocab_size, arch.hidden_size
    embed = Linear(h, v, False, dtype=torch.float32, device=CPU)
    embed.weight.copy_(0.2 * torch.randn(v, h, generator=gen))
    head = TrainableEagle3(arch, aux, embed.weight, embed.weight, draft_ids, max_positions=64)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return head, embed


@pytest.mark.parametrize("reduced", [False, True])
def test_exported_head_matches_the_engine_head(tmp_path, reduced: bool) -> None:
    arch = ModelArchConfig.from_hf_config(make_tiny_config("llama", num_hidden_layers=4))
    aux = (1, 2)
    draft_ids = torch.randperm(arch.vocab_size, generator=torch.Generator().manual_seed(1))[
        :500].sort().values if reduced else None
    head, embed = _random_head(arch, aux, draft_ids, seed=2)
    export_head(head, str(tmp_path), dtype=torch.float32)
    engine_head = load_eagle_head(str(tmp_path), "eagle3", arch, torch.float32, CPU)
    assert engine_head.aux_layer_ids == aux

    gen = torch.Generator().manual_seed(3)
    t, k = 11, 4
    ids = torch.randint(arch.vocab_size, (t,), generator=gen)
    states = torch.randn(t, len(aux) * arch.hidden_size, generator=gen)
    with torch.no_grad():
        trained = head(states[None], ids[None], k)
    origin = t - 1 - k  # tokens up to origin + k exist
    kv = engine_head.make_kv_cache(num_blocks=8, block_size=BLOCK_SIZE)
    blocks = [5, 0, 7, 2]
    with torch.inference_mode():
        # Catch-up over positions 0..origin: row p reads the state at p and the token p + 1.
        n = origin + 1
        meta, positions = build_attention_metadata([n], [n], [blocks], BLOCK_SIZE, CPU)
        logits_hidden, hidden = engine_head(ids[1:n + 1], states[:n], positions, kv, meta,
                                            embed)
        logits_hidden, hidden = logits_hidden[-1:], hidden[-1:]
        for j in range(k):
            if j:  # chain step j: the token at origin + 1 + j, the previous hidden
                pos = torch.tensor([origin + j])
                meta, _ = build_attention_metadata([1], [origin + j + 1], [blocks],
                                                   BLOCK_SIZE, CPU)
                logits_hidden, hidden = engine_head(ids[origin + 1 + j:origin + 2 + j],
                                                    hidden, pos, kv, meta, embed)
            torch.testing.assert_close(logits_hidden[0], trained[j][0, origin],
                                       atol=1e-4, rtol=1e-4)
            ours = head.logits(trained[j][0, origin:origin + 1])
            theirs = engine_head.compute_logits(logits_hidden, embed)
            if draft_ids is not None:
                assert torch.isinf(theirs).sum() == arch.vocab_size - len(draft_ids)
                theirs = theirs[:, draft_ids]
            torch.testing.assert_close(theirs, ours, atol=1e-3, rtol=1e-4)


def test_an_exported_head_reads_back_for_the_trainers_checks(tmp_path) -> None:
    """load_exported_head (scripts/eagle_integration.py) gives back the exported weights
    (float32 export: exactly), the aux layers and t2d of the draft vocabulary."""
    from aioengine.spec_decode.train.head import load_exported_head

    arch = ModelArchConfig.from_hf_config(make_tiny_config("llama", num_hidden_layers=4))
    draft_ids = torch.tensor([3, 17, 40, 41, 900])
    head, embed = _random_head(arch, (1, 3), draft_ids, seed=4)
    export_head(head, str(tmp_path), dtype=torch.float32)
    back, t2d = load_exported_head(str(tmp_path), arch, embed.weight, embed.weight)
    assert back.aux_layer_ids == (1, 3) and not back.training
    assert torch.equal(back.draft_ids, draft_ids)
    for (name, p), (_, q) in zip(head.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), name
    assert t2d[draft_ids].tolist() == [0, 1, 2, 3, 4]
    assert int((t2d >= 0).sum()) == 5


def test_fine_tuning_starts_from_an_exported_heads_weights(tmp_path) -> None:
    """init_from_head (train-eagle --init-head) copies every trained tensor of an exported
    head into a head with another draft vocabulary, whose LM head stays the target's rows
    for its own vocabulary; a head for other aux layers is refused."""
    from aioengine.spec_decode.train.head import init_from_head

    arch = ModelArchConfig.from_hf_config(make_tiny_config("llama", num_hidden_layers=4))
    trained, embed = _random_head(arch, (1, 3), torch.tensor([3, 17, 40, 41, 900]), seed=4)
    export_head(trained, str(tmp_path), dtype=torch.float32)
    wider = torch.tensor([0, 3, 5, 17, 40, 41, 77, 900])
    fresh = TrainableEagle3(arch, (1, 3), embed.weight, embed.weight, wider, max_positions=64)
    init_from_head(fresh, str(tmp_path))
    for (name, p), (_, q) in zip(trained.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(fresh.lm_head, embed.weight[wider])
    other = TrainableEagle3(arch, (0, 3), embed.weight, embed.weight, wider, max_positions=64)
    with pytest.raises(ValueError, match="aux layers"):
        init_from_head(other, str(tmp_path))
