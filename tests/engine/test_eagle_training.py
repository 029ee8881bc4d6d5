"""`aioengine train-eagle` end to end on a tiny random target: the data comes from the
engine, the trained head loads into the engine, keeps greedy output exact, and is accepted
more often than the untrained head on the same data (the trainer really learns)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model_dir

from aioengine.engine.llm import LLM
from aioengine.metrics import spec_decode_delta
from aioengine.sampling_params import SamplingParams
from aioengine.spec_decode.train.cli import main
from aioengine.spec_decode.train.prompts import split_prompts

pytestmark = pytest.mark.slow


def _predictable_target(path: Path) -> Path:
    """A tiny random Llama whose layers add nothing (o_proj and down_proj zeroed): its next
    token is a function of the current one, which a head can learn from a few thousand
    tokens (a fully random tiny model's next tokens are near-uniform: nothing to learn)."""
    target = make_tiny_model_dir("llama", path, seed=3, num_hidden_layers=4)
    file = target / "model.safetensors"
    weights = load_file(str(file))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    save_file(weights, str(file), metadata={"format": "pt"})
    return target


def _engine_acceptance(target: Path, head: Path | None, prompts: list[list[dict]],
                       ) -> tuple[list[list[int]], float | None]:
    # Drafting at any batch size: the 12 prompts run together (the default stops at 8).
    spec = ({"method": "eagle3", "model": str(head), "disable_by_batch_size": None}
            if head else None)
    llm = LLM(str(target), dtype="float32", speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40))
    delta = spec_decode_delta({}, llm.core.stats()) if head else None
    return ([o.outputs[0].token_ids for o in outs],
            delta["mean_acceptance_length"] if delta else None)


def test_trained_head_is_accepted_more_than_untrained(tmp_path: Path) -> None:
    target = _predictable_target(tmp_path / "target")
    common = ["--model", str(target), "--data", str(tmp_path / "data"), "--dtype", "float32",
              "--max-prompts", "48", "--max-heldout-prompts", "12", "--max-tokens", "40",
              "--self-prompts-per-topic", "0", "--draft-vocab-size", "2048",
              "--ttt-steps", "3", "--batch-tokens", "2048", "--eval-every", "20"]
    assert main([*common, "-o", str(tmp_path / "untrained"), "--epochs", "0"]) == 0
    assert main([*common, "-o", str(tmp_path / "trained"), "--stage", "train",
                 "--epochs", "10", "--lr", "3e-3", "--warmup-steps", "5"]) == 0
    untrained = json.loads((tmp_path / "untrained" / "training.json").read_text())
    trained = json.loads((tmp_path / "trained" / "training.json").read_text())
    assert trained["steps"] > 0 and untrained["steps"] == 0
    assert trained["heldout_loss"] < untrained["heldout_loss"]
    assert trained["acceptance_length"] > untrained["acceptance_length"] + 0.2
    config = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert config["n_predict"] == 3 and config["draft_vocab_size"] == 2048

    prompts = [[{"role": "user", "content": p}] for p in split_prompts()[1][:12]]
    plain, _ = _engine_acceptance(target, None, prompts)
    with_untrained, low = _engine_acceptance(target, tmp_path / "untrained", prompts)
    with_trained, high = _engine_acceptance(target, tmp_path / "trained", prompts)
    assert with_untrained == plain and with_trained == plain  # verification stays exact
    assert high > low + 0.2, (low, high)


def test_training_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """A run stopped after its first checkpoint continues from it, not from step 0."""
    target = make_tiny_model_dir("llama", tmp_path / "target", seed=3)
    common = ["--model", str(target), "--dtype", "float32", "-o", str(tmp_path / "head"),
              "--max-prompts", "16", "--max-heldout-prompts", "4", "--max-tokens", "24",
              "--self-prompts-per-topic", "0", "--draft-vocab-size", "1024",
              "--ttt-steps", "2", "--batch-tokens", "1024", "--eval-every", "2"]
    assert main([*common, "--epochs", "1", "--max-train-minutes", "0"]) == 0
    first = json.loads((tmp_path / "head" / "training.json").read_text())
    assert main([*common, "--epochs", "2"]) == 0  # data kept, training resumed
    second = json.loads((tmp_path / "head" / "training.json").read_text())
    assert 0 < first["steps"] < second["steps"]
    steps = [h["step"] for h in second["history"] if "loss" in h]
    assert steps == sorted(set(steps))  # no step trained twice


def test_online_data_records_what_the_recorded_data_holds(tmp_path: Path) -> None:
    """Token-only shards (--online) hold the same sequences as recorded ones, and the
    recorder gives the batches the aux states and labels the recorded shards hold; the
    online run trains (its held-out loss falls)."""
    from aioengine.spec_decode.train.data import make_recorder
    from aioengine.spec_decode.train.dataset import Dataset, pad

    target = _predictable_target(tmp_path / "target")
    common = ["--model", str(target), "--dtype", "float32", "--max-prompts", "24",
              "--max-heldout-prompts", "6", "--max-tokens", "24",
              "--self-prompts-per-topic", "0", "--draft-vocab-size", "1024",
              "--ttt-steps", "2", "--batch-tokens", "1024", "--eval-every", "10"]
    assert main([*common, "-o", str(tmp_path / "rec"), "--stage", "data"]) == 0
    assert main([*common, "-o", str(tmp_path / "onl"), "--online", "--epochs", "4",
                 "--lr", "3e-3", "--warmup-steps", "2"]) == 0
    recorded = Dataset.load(str(tmp_path / "rec" / "data" / "train"))
    online = Dataset.load(str(tmp_path / "onl" / "data" / "train"))
    assert online.online and not recorded.online
    assert torch.equal(online.input_ids, recorded.input_ids)
    assert online.lens == recorded.lens
    # Online: as generated (one greedy, one sampled each); recorded: responses the target's
    # top-1 matches, which includes every greedy one.
    assert sum(online.greedy) == len(online.lens) // 2
    assert all(r for o, r in zip(online.greedy, recorded.greedy) if o)
    meta = json.loads((tmp_path / "onl" / "data" / "meta.json").read_text())
    recorder = make_recorder(str(target), meta["dtype"], tuple(meta["aux_layers"]), 8)
    idx = [0, 3, 5]
    a, b = pad(online, idx, recorder), pad(recorded, idx)
    assert torch.allclose(a.aux.float(), b.aux.float(), atol=2e-2)
    assert (a.topk_ids[..., 0] == b.topk_ids[..., 0]).float().mean() > 0.99
    trained = json.loads((tmp_path / "onl" / "training.json").read_text())
    losses = [h["heldout_loss"] for h in trained["history"] if "heldout_loss" in h]
    assert trained["steps"] > 0 and losses[-1] < losses[0]
