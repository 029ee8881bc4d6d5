"""The model's sampling defaults (--generation-config): what each source yields, the GGUF
metadata walk against gguf's own reader, the request fields they fill (and never
override), and the offline LLM's defaults on a tiny GGUF with general.sampling.* keys."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from aioengine import LLM, SamplingParams
from aioengine.config import ConfigError, EngineArgs
from aioengine.generation_config import (defaults_from_hf, model_sampling_defaults,
                                         read_gguf_sampling, read_hf_generation_config)
from aioengine.model.default import BUNDLED_SAMPLING_DEFAULTS, is_bundled_model
from aioengine.model.gguf_loader import FastGGUFReader
from aioengine.server.protocol import (ApiError, chat_sampling_params,
                                       completion_sampling_params)
from aioengine.server.serving_responses import responses_sampling_params

from tests.model.gguf_writer import tokenizer_fields, write_tiny_gguf
from tests.tiny_models import make_tiny_hf_model

# A Qwen3-style generation_config.json: do_sample and the ids are not sampling fields.
QWEN_STYLE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True,
              "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 256,
              "repetition_penalty": 1.0}
GGUF_KEYS = {"general.sampling.temp": (gguf.GGUFValueType.FLOAT32, 0.75),
             "general.sampling.top_k": (gguf.GGUFValueType.INT32, 1),
             "general.sampling.top_p": (gguf.GGUFValueType.FLOAT32, 0.5),
             "general.sampling.min_p": (gguf.GGUFValueType.FLOAT32, 0.05),
             "general.sampling.penalty_repeat": (gguf.GGUFValueType.FLOAT32, 1.25),
             "general.sampling.mirostat": (gguf.GGUFValueType.INT32, 2)}  # no field: left out
# 0.05 is no float32: read back as the decimal that was written, not 0.05000000074505806.
GGUF_DEFAULTS = {"temperature": 0.75, "top_k": 1, "top_p": 0.5, "min_p": 0.05,
                 "repetition_penalty": 1.25}


def _hf_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


# ---- sources ------------------------------------------------------------------------------

def test_hf_fields_map_as_vllm_maps_them(tmp_path: Path) -> None:
    # repetition_penalty 1.0 is transformers' default, so not a model default (to_diff_dict).
    assert read_hf_generation_config(str(_hf_dir(tmp_path, QWEN_STYLE))) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 256}


def test_hf_defaults_equal_to_transformers_own_are_left_out() -> None:
    assert defaults_from_hf({"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                             "min_p": None, "max_new_tokens": None}, "x") == {}
    assert defaults_from_hf({"top_k": 40.0, "min_p": 0}, "x") == {"top_k": 40, "min_p": 0.0}


@pytest.mark.parametrize("config,needle", [({"temperature": "hot"}, "temperature must be a number"),
                                           ({"top_k": 2.5}, "top_k must be an integer"),
                                           ({"max_new_tokens": True}, "must be a number")])
def test_hf_bad_values_are_config_errors(config: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        defaults_from_hf(config, "generation_config.json")


def test_auto_on_a_hf_dir_and_dir_override(tmp_path: Path) -> None:
    model = _hf_dir(tmp_path / "model", {"temperature": 0.3})
    other = _hf_dir(tmp_path / "other", {"top_p": 0.8, "max_new_tokens": 9})
    assert model_sampling_defaults("auto", str(model)) == {"temperature": 0.3}
    assert model_sampling_defaults(str(other), str(model)) == {"top_p": 0.8, "max_tokens": 9}
    assert model_sampling_defaults("vllm", str(model)) == {}
    assert model_sampling_defaults("auto", str(tmp_path)) == {}  # no generation_config.json


def test_invalid_sampling_values_fail_the_start(tmp_path: Path) -> None:
    model = _hf_dir(tmp_path / "model", {"temperature": -0.5})
    with pytest.raises(ConfigError, match="--generation-config vllm"):
        model_sampling_defaults("auto", str(model))


@pytest.mark.parametrize("setting", ["/no/such/dir", "."])
def test_a_bad_dir_is_refused_by_validate(setting: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # "." is a directory without generation_config.json
    with pytest.raises(ConfigError, match="'auto', 'vllm' or a directory holding "
                                          "generation_config.json"):
        EngineArgs(generation_config=setting).validate()


def test_bundled_model_ships_the_model_cards_defaults(bundled_gguf_path: str,
                                                      tmp_path: Path) -> None:
    assert is_bundled_model(bundled_gguf_path)
    assert read_gguf_sampling(bundled_gguf_path) == {}  # the file itself has none
    assert model_sampling_defaults("auto", bundled_gguf_path) == BUNDLED_SAMPLING_DEFAULTS
    assert BUNDLED_SAMPLING_DEFAULTS == {"temperature": 0.2, "top_p": 0.9}
    assert model_sampling_defaults("vllm", bundled_gguf_path) == {}
    # Another file (a link's target is the bundled file; a copy's name is not) is not it.
    (tmp_path / "link.gguf").symlink_to(bundled_gguf_path)
    assert is_bundled_model(str(tmp_path / "link.gguf"))
    assert not is_bundled_model(str(tmp_path / "missing.gguf"))


# ---- the GGUF metadata walk -----------------------------------------------------------------

def _write_metadata_gguf(path: Path, endian: gguf.GGUFEndian, sampling: bool) -> None:
    """A tensor-less GGUF whose sampling keys sit among values of every kind."""
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_token_list([f"tok{i}" for i in range(300)] + ["", "é✓"])
    w.add_array("test.nested", [[1, 2, 3], [4]])
    w.add_array("test.strings_of_arrays", [["a", "bc"], ["d"]])
    w.add_token_types([1] * 302)
    w.add_array("test.floats", [0.5, 1.5])
    w.add_bool("test.flag", True)
    w.add_uint64("test.u64", 1 << 40)
    w.add_float64("test.f64", 2.5)
    w.add_int8("test.i8", -3)
    w.add_string("general.sampling.sequence", "top_k;top_p;temperature")
    if sampling:
        for key, (vtype, value) in GGUF_KEYS.items():
            w.add_key_value(key, value, vtype)
    w.add_string("test.after", "still read past")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_metadata_walk_reads_what_ggufs_reader_reads(tmp_path: Path,
                                                     endian: gguf.GGUFEndian) -> None:
    path = tmp_path / "m.gguf"
    _write_metadata_gguf(path, endian, sampling=True)
    assert read_gguf_sampling(str(path)) == GGUF_DEFAULTS
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["test.after"].contents() == "still read past"
    assert {k: pytest.approx(reader.fields[k].contents()) for k in GGUF_KEYS} == {
        k: v for k, (_, v) in GGUF_KEYS.items()}
    _write_metadata_gguf(path, endian, sampling=False)
    assert read_gguf_sampling(str(path)) == {}


def test_metadata_walk_refuses_a_non_gguf(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ConfigError, match="bad magic"):
        model_sampling_defaults("auto", str(tmp_path / "x.gguf"))


# ---- request fields -----------------------------------------------------------------------

MODEL = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
         "repetition_penalty": 1.1, "max_tokens": 7}


def test_an_omitted_field_gets_the_models_default() -> None:
    p = chat_sampling_params({"messages": []}, MODEL)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.2, 0.9, 20, 0.05, 1.1, 7)
    p = chat_sampling_params({"temperature": None, "max_tokens": None}, MODEL)  # null: omitted
    assert (p.temperature, p.max_tokens) == (0.2, 7)
    assert chat_sampling_params({}, None).temperature == 1.0
    assert chat_sampling_params({}, {}).max_tokens is None  # the context


def test_a_given_field_always_wins() -> None:
    body = {"temperature": 1, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1,
            "max_tokens": 30}
    p = chat_sampling_params(body, MODEL)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        1.0, 1.0, 0, 0.0, 1.0, 30)
    assert chat_sampling_params({"max_completion_tokens": 3}, MODEL).max_tokens == 3


def test_completions_keep_vllms_16_token_default_capped_by_the_model() -> None:
    assert completion_sampling_params({}, MODEL)[0].max_tokens == 7
    assert completion_sampling_params({}, {"max_tokens": 100})[0].max_tokens == 16
    assert completion_sampling_params({"max_tokens": None}, MODEL)[0].max_tokens is None
    assert completion_sampling_params({"max_tokens": 40}, MODEL)[0].max_tokens == 40
    assert completion_sampling_params({}, MODEL)[0].temperature == 0.2


def test_responses_take_the_defaults_too() -> None:
    p = responses_sampling_params({"input": "hi"}, MODEL)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.2, 20, 7)
    p = responses_sampling_params({"temperature": 0.0, "max_output_tokens": 2}, MODEL)
    assert (p.temperature, p.max_tokens) == (0.0, 2)


def test_a_bad_given_field_is_still_a_400() -> None:
    with pytest.raises(ApiError) as e:
        chat_sampling_params({"temperature": "warm"}, MODEL)
    assert e.value.param == "temperature"


# ---- the offline LLM on a GGUF with general.sampling.* ------------------------------------

@pytest.fixture(scope="module")
def sampling_gguf(tmp_path_factory: pytest.TempPathFactory, bundled_gguf_path: str) -> Path:
    """A tiny llama GGUF, copied with the sampling keys added (gguf's gguf_new_metadata)."""
    root = tmp_path_factory.mktemp("gen_gguf")
    plain = root / "plain.gguf"
    write_tiny_gguf(make_tiny_hf_model("llama", vocab_size=512), "llama", plain,
                    tokenizer_fields(FastGGUFReader(bundled_gguf_path)))
    path = root / "sampling.gguf"
    copy_with_new_metadata(gguf.GGUFReader(str(plain)), gguf.GGUFWriter(str(path), "llama"),
                           {k: MetadataDetails(t, v) for k, (t, v) in GGUF_KEYS.items()}, [])
    return path


def test_llm_uses_the_gguf_defaults_where_params_are_omitted(sampling_gguf: Path) -> None:
    llm = LLM(str(sampling_gguf), dtype="float32", num_kv_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert defaults == SamplingParams(**GGUF_DEFAULTS)
    # top_k 1 makes the defaults greedy: the same text as explicit temperature 0.
    prompt = "Once upon a time"
    [implicit] = llm.generate(prompt, use_tqdm=False)
    [greedy] = llm.generate(prompt, SamplingParams(temperature=0.0, repetition_penalty=1.25,
                                                   min_p=0.05), use_tqdm=False)
    assert len(implicit.outputs[0].token_ids) == 16  # SamplingParams' max_tokens
    assert implicit.outputs[0].token_ids == greedy.outputs[0].token_ids
    off = LLM(str(sampling_gguf), dtype="float32", num_kv_blocks=64, generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams()


def test_the_flag_sets_the_engine_arg() -> None:
    from aioengine.cli import build_parser
    from aioengine.config import engine_kwargs

    parser, _ = build_parser()
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["generation_config"] == "auto"
    args = parser.parse_args(["generate", "hi", "--generation-config", "vllm"])
    assert engine_kwargs(args)["generation_config"] == "vllm"
