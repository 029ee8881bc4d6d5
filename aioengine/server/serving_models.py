"""The models a server answers to (vLLM's OpenAIServingModels): its base model under its
served names, and the engine's LoRA adapters, each a model of its own by its name.

    --lora-modules name=path | '{"name", "path", "base_model_name"}'    at start-up
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}    with --allow-runtime-
    POST /v1/unload_lora_adapter {"lora_name"}                 lora-updating only

The engine's registry is the one list of adapters; the server only keeps the
`base_model_name` an adapter was given: its `parent` in /v1/models, as given (vLLM's
rule; default: the first served name). Error bodies of these routes are vLLM's: `type`
"InvalidUserInput", "BadRequestError" or "NotFoundError", `code` the HTTP status.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aioengine.errors import InvalidRequestError, NotFoundError
from aioengine.lora.request import LoRARequest
from aioengine.server.protocol import ApiError

if TYPE_CHECKING:
    from aioengine.engine.async_engine import AsyncEngine

logger = logging.getLogger("aioengine.server")


# An adapter's name is a model name in requests, /v1/models and Ray's multiplexed ids:
# letters, digits, '.', '_', '-', in '/'-separated parts (an "org/name" is fine), each
# starting with a letter, digit or '_' (so no '.', '..' or empty part), <= 128 characters.
_ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*")
ADAPTER_NAME_RULE = ("letters, digits, '.', '_' and '-' in '/'-separated parts, each starting "
                     "with a letter, digit or '_', at most 128 characters")
# One text for any adapter that cannot be found, whatever is missing at its path (the
# directory, its config, its weights): a client learns nothing about the server's files.
# The reason goes to the server's log.
_ADAPTER_NOT_FOUND = "No LoRA adapter can be loaded from lora_path {path!r}."


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot be an adapter's name (ADAPTER_NAME_RULE), or None."""
    if len(name) <= 128 and _ADAPTER_NAME_RE.fullmatch(name):
        return None
    return f"invalid LoRA adapter name {name[:140]!r}: use {ADAPTER_NAME_RULE}"


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


class LoRAModuleError(Exception):
    """A `--lora-modules` adapter that cannot be served (the start-up fails)."""


def _module_from_dict(item: Any, text: str) -> LoRAModulePath:
    if not isinstance(item, dict):
        raise argparse.ArgumentTypeError(
            f"invalid --lora-modules entry {text!r}: a JSON entry must be an object with "
            f"name, path and optionally base_model_name")
    unknown = sorted(set(item) - {"name", "path", "base_model_name"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"invalid --lora-modules entry {text!r}: unknown field(s) {', '.join(unknown)}")
    name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise argparse.ArgumentTypeError(
            f"invalid --lora-modules entry {text!r}: name and path must be non-empty strings")
    if base is not None and not isinstance(base, str):
        raise argparse.ArgumentTypeError(
            f"invalid --lora-modules entry {text!r}: base_model_name must be a string")
    return _module(name, path, base, text)


def _module(name: str, path: str, base: str | None, text: str) -> LoRAModulePath:
    problem = adapter_name_problem(name)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"--lora-modules entry {text!r}: {problem}")
    return LoRAModulePath(name, path, base)


def parse_lora_modules(text: str) -> list[LoRAModulePath]:
    """argparse `type` of `--lora-modules`: `name=path`, a JSON object {"name", "path",
    "base_model_name"} or a JSON list of them."""
    text = text.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(
                f"invalid JSON in --lora-modules {text!r}: {e}") from None
        items = value if isinstance(value, list) else [value]
        return [_module_from_dict(item, text) for item in items]
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(
            f"invalid --lora-modules entry {text!r}: expected name=path or a JSON object "
            f'{{"name": ..., "path": ..., "base_model_name": ...}}')
    return [_module(name, path, None, text)]


def _lora_error(status: int, message: str, type: str, param: str | None = None) -> ApiError:
    return ApiError(status, message, param, type=type, code=status)


def model_not_found(model: str) -> ApiError:
    """vLLM's 404 for a `model` that is neither a served name nor a loaded adapter."""
    return _lora_error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


class ServingModels:
    def __init__(self, engine: AsyncEngine, base_model_names: list[str],
                 on_demand: Sequence[LoRAModulePath] = ()) -> None:
        """`on_demand`: adapters listed while not loaded; something else loads each before
        a request names it (a Ray Serve replica, through model multiplexing)."""
        self.engine = engine
        self.base_model_names = base_model_names
        self.on_demand = {m.name: m for m in on_demand}
        # adapter name -> its base_model_name
        self._parents: dict[str, str] = {m.name: m.base_model_name for m in on_demand
                                         if m.base_model_name is not None}

    def _registered(self, name: str) -> LoRARequest | None:
        return self.engine.get_lora(name)

    def resolve(self, body: dict) -> tuple[str, LoRARequest | None]:
        """The model a request names (absent: the first served name) and the adapter it
        runs with (None: the base model); 404 for a name that is neither."""
        model = body.get("model")
        if model is None:
            return self.base_model_names[0], None
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string", "model")
        if model in self.base_model_names:
            return model, None
        if self._registered(model) is not None:
            # By name only: the engine takes the registered adapter without a thread hop.
            return model, LoRARequest(model)
        raise model_not_found(model)

    def lora_cards(self) -> list[tuple[LoRARequest, str]]:
        """Each on-demand adapter (loaded or not), then each other loaded one in load
        order, with its parent (its base_model_name, else the first served name)."""
        default = self.base_model_names[0]
        loaded = {lora.lora_name: lora for lora in self.engine.list_loras()}
        listed = [loaded.pop(m.name, LoRARequest(m.name, m.path))
                  for m in self.on_demand.values()] + list(loaded.values())
        return [(lora, self._parents.get(lora.lora_name, default)) for lora in listed]

    # ---- loading and unloading ----------------------------------------------------------

    def _check_name(self, name: str) -> str | None:
        """Why `name` cannot be a new adapter's, or None."""
        problem = adapter_name_problem(name)
        if problem is not None:
            return problem
        if name in self.base_model_names:
            return f"'{name}' is a served name of the base model"
        if self._registered(name) is not None:
            return f"The lora adapter '{name}' has already been loaded."
        return None

    async def init_static_loras(self, modules: list[LoRAModulePath]) -> None:
        """Loads the `--lora-modules` adapters; raises LoRAModuleError for the first that
        cannot be served."""
        for module in modules:
            where = f"--lora-modules {module.name}={module.path}"
            problem = self._check_name(module.name)
            if problem is not None:
                raise LoRAModuleError(f"{where}: {problem}")
            try:
                await self.engine.add_lora(LoRARequest(module.name, module.path))
            except (InvalidRequestError, NotFoundError) as e:
                raise LoRAModuleError(f"{where}: {e}") from None
            if module.base_model_name is not None:
                self._parents[module.name] = module.base_model_name

    async def load_lora_adapter(self, body: dict) -> str:
        """POST /v1/load_lora_adapter: loads (off the event loop) and registers an adapter;
        the success text, or an ApiError."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise _lora_error(400, "Both 'lora_name' and 'lora_path' must be provided.",
                              "InvalidUserInput")
        problem = self._check_name(name)
        if problem is not None:
            raise _lora_error(400, problem, "InvalidUserInput", "lora_name")
        if not self.engine.is_running:
            raise ApiError(503, "the engine is not running", type="service_unavailable_error")
        try:
            await self.engine.add_lora(LoRARequest(name, path))
        except NotFoundError as e:
            logger.info("LoRA adapter %r not loaded from %r: %s", name, path, e)
            raise _lora_error(404, _ADAPTER_NOT_FOUND.format(path=path[:300]),
                              "NotFoundError", "lora_path") from None
        except InvalidRequestError as e:
            raise _lora_error(400, str(e), "BadRequestError", e.param) from None
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, body: dict) -> str:
        """POST /v1/unload_lora_adapter: new requests naming the adapter get a 404 at once;
        those already running finish on it. `lora_int_id` (vLLM's) is ignored."""
        name = body.get("lora_name")
        if not (isinstance(name, str) and name):
            raise _lora_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                              "InvalidUserInput")
        not_found = _lora_error(404, f"The lora adapter '{name}' cannot be found.",
                                "NotFoundError", "lora_name")
        if self._registered(name) is None:
            raise not_found
        try:
            await self.engine.remove_lora(name)
        except NotFoundError:  # removed meanwhile
            raise not_found from None
        self._parents.pop(name, None)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
