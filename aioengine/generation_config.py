"""The model's own sampling defaults (vLLM's `--generation-config auto|vllm|DIR`).

A request that leaves out a sampling field gets the model's default for it, not
SamplingParams' (temperature 1.0, top_p 1.0): the OpenAI routes through
`server/protocol.build_sampling_params`, the offline `LLM` through
`get_default_sampling_params()`. A field the request gives always wins.

    auto   a Hugging Face directory's generation_config.json, a GGUF's general.sampling.*
           metadata, the bundled SmolLM2's shipped defaults (model/default.py)
    vllm   none: SamplingParams' own defaults
    DIR    DIR/generation_config.json

The defaults are a dict of SamplingParams field -> value (vLLM's `get_diff_sampling_param`),
with only the fields the model sets; `max_new_tokens` becomes `max_tokens`.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from typing import Any

from aioengine.errors import ConfigError, InvalidRequestError
from aioengine.sampling_params import SamplingParams

logger = logging.getLogger("aioengine")

GENERATION_CONFIG_SETTINGS = ("auto", "vllm")
GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field: the fields vLLM's
# get_diff_sampling_param takes.
_HF_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
              "min_p": "min_p", "repetition_penalty": "repetition_penalty",
              "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: vLLM reads `to_diff_dict()`, in which a field
# equal to its default is absent, so e.g. `"top_k": 50` is not a model default.
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
# llama.cpp's general.sampling.* keys (src/llama-arch.cpp; common/common.cpp reads them as
# the sampler's defaults) -> SamplingParams field. The others (sequence, xtc_*, mirostat*,
# penalty_last_n) have no SamplingParams field.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature",
                      "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p",
                      "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}
_INT_FIELDS = frozenset({"top_k", "max_tokens"})


def check_generation_config_setting(setting: str) -> None:
    """ConfigError unless `setting` is auto, vllm or a directory with generation_config.json
    (checked before the model loads, so a typo fails the start at once)."""
    if setting in GENERATION_CONFIG_SETTINGS:
        return
    if not os.path.isfile(os.path.join(os.path.expanduser(setting), GENERATION_CONFIG_FILE)):
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a directory holding "
                          f"{GENERATION_CONFIG_FILE}; {setting!r} has no {GENERATION_CONFIG_FILE}")


def model_sampling_defaults(setting: str, model_path: str) -> dict[str, Any]:
    """The defaults `setting` selects for the model at `model_path` (a .gguf file or a HF
    directory), checked as SamplingParams; logged once when there are any."""
    check_generation_config_setting(setting)
    if setting == "vllm":
        return {}
    if setting != "auto":
        defaults = read_hf_generation_config(os.path.expanduser(setting))
    elif model_path.endswith(".gguf"):
        defaults = _gguf_defaults(model_path)
    elif os.path.isfile(os.path.join(model_path, GENERATION_CONFIG_FILE)):
        defaults = read_hf_generation_config(model_path)
    else:
        defaults = {}
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as e:
        raise ConfigError(f"the model's sampling defaults {defaults} are not valid sampling "
                          f"parameters ({e}); start with --generation-config vllm to ignore "
                          f"them") from None
    if defaults:
        logger.info("Default sampling parameters from the model: %s (a request's own fields "
                    "win; --generation-config vllm: none)", defaults)
    return defaults


def _gguf_defaults(path: str) -> dict[str, Any]:
    """The file's general.sampling.* values over, for the bundled SmolLM2 (whose GGUF has
    none), the defaults shipped with it."""
    from aioengine.model.default import BUNDLED_SAMPLING_DEFAULTS, is_bundled_model

    shipped = dict(BUNDLED_SAMPLING_DEFAULTS) if is_bundled_model(path) else {}
    try:
        return {**shipped, **read_gguf_sampling(path)}
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"cannot read the sampling metadata of {path}: {e}") from None


def read_hf_generation_config(directory: str) -> dict[str, Any]:
    """The sampling defaults of `directory`/generation_config.json."""
    path = os.path.join(directory, GENERATION_CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return defaults_from_hf(config, path)


def defaults_from_hf(config: dict[str, Any], source: str) -> dict[str, Any]:
    """generation_config.json fields -> SamplingParams fields (absent, null and
    transformers' own defaults left out)."""
    defaults = {}
    for hf_name, name in _HF_FIELDS.items():
        value = config.get(hf_name)
        if value is None or (hf_name in _HF_DEFAULTS and value == _HF_DEFAULTS[hf_name]):
            continue
        defaults[name] = _number(name, value, f"{source}: {hf_name}")
    return defaults


def _number(name: str, value: Any, where: str) -> int | float:
    """`value` as the type of SamplingParams' `name` (an int field takes 40.0 as 40)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be a number, got {value!r:.80}")
    if name in _INT_FIELDS:
        if value != int(value):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(value)
    return float(value)


# ---- GGUF metadata: the few sampling keys, without parsing the file -----------------------
# gguf's reader builds every tokenizer string and tensor record (0.9 s for the bundled
# file); this walk decodes only the general.sampling.* values and steps over the rest.

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                   10: "Q", 11: "q", 12: "d"}  # GGUFValueType -> struct format
_STRING, _ARRAY = 8, 9


class _MetadataWalk:
    """A cursor over a GGUF file's key/value section (GGUF v2/v3, either byte order)."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        # A big-endian file's version reads as a multiple of 2**16 (gguf's reader's test).
        self.order = ">" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0 else "<"
        version = struct.unpack_from(self.order + "I", buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.pos = 8

    def read(self, fmt: str, size: int) -> Any:
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> bytes:
        n = self.read("Q", 8)
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos])

    def value(self, kind: int, keep: bool) -> Any:
        """The next value of type `kind`: decoded when `keep`, else stepped over (None)."""
        if kind in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[kind]
            size = struct.calcsize(fmt)
            if not keep:
                return self._skip(size)
            value = self.read(fmt, size)
            return _shortest_float32(value) if fmt == "f" else value
        if kind == _STRING:
            return self.string().decode("utf-8", "replace") if keep else self._skip_string()
        if kind == _ARRAY:
            item_kind, count = self.read("I", 4), self.read("Q", 8)
            if item_kind in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[item_kind])
            elif item_kind == _STRING:  # the vocabulary and merges: lengths only
                for _ in range(count):
                    self._skip_string()
            else:
                for _ in range(count):
                    self.value(item_kind, False)
            return None
        raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")

    def _skip(self, size: int) -> None:
        self.pos += size

    def _skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from(self.order + "Q", self.buf, self.pos)[0]


def _shortest_float32(x: float) -> float:
    """The shortest decimal that is the same float32 (0.6, not 0.6000000238418579): what
    the file's writer meant, and what logs and /v1/models show."""
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == x:
            return y
    return x


def read_gguf_sampling(path: str) -> dict[str, Any]:
    """The GGUF file's general.sampling.* defaults as SamplingParams fields."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        buf = memoryview(m)
        try:
            return _sampling_fields(_MetadataWalk(buf))
        finally:
            buf.release()


def _sampling_fields(walk: _MetadataWalk) -> dict[str, Any]:
    walk.read("Q", 8)  # tensor count
    num_kv = walk.read("Q", 8)
    defaults: dict[str, Any] = {}
    for _ in range(num_kv):
        key = walk.string().decode("utf-8", "replace")
        kind = walk.read("I", 4)
        name = GGUF_SAMPLING_KEYS.get(key)
        value = walk.value(kind, keep=name is not None)
        if name is not None and value is not None:
            defaults[name] = _number(name, value, f"GGUF metadata {key}")
    return defaults
