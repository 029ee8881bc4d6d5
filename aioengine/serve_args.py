"""The arguments of `aioengine serve`: the server's own flags (ServerConfig), the engine
flags (EngineArgs, aioengine.config), LoRA, tool calling and the --ray-* flags
(RayServeOptions), each generated from its dataclass field, and what they build.

The command line (aioengine.cli) and Ray Serve's `build_app` builder (aioengine.ray_serve)
both parse and check them here, so neither imports the other."""
from __future__ import annotations

import argparse
import os
from typing import Any

from aioengine import envs
from aioengine.config import (EngineArgs, FlagSpec, add_dataclass_flags, add_engine_args, flag,
                              flag_values)
from aioengine.ray_serve.options import add_ray_args
from aioengine.server.request_limits import RequestLimits
from aioengine.server.server_config import ServerConfig
from aioengine.pooling_params import POOLING_TYPES
from aioengine.reasoning_parsers import REASONING_PARSERS
from aioengine.tool_parsers import AUTO_TOOL_PARSER, TOOL_PARSERS


def lora_modules_arg(text: str) -> list:
    """One `--lora-modules` value: name=path, a JSON object or a JSON list of them."""
    from aioengine.server.serving_models import parse_lora_modules

    return parse_lora_modules(text)


# ServerConfig field -> its flag. `--api-key`'s default is $AIOENGINE_API_KEY when the
# parser is built (add_serve_args), not ServerConfig's None.
SERVER_FLAGS: dict[str, FlagSpec] = {
    "host": flag("--host", help="bind address (default: loopback)"),
    "port": flag("--port", type=int, help="0 picks a free port"),
    "api_key": flag("--api-key", help="require `Authorization: Bearer KEY` on every route "
                                      "but /health and the chat page at / (which asks for "
                                      "the key; default: $AIOENGINE_API_KEY)"),
    "metrics_without_api_key": flag(
        "--metrics-without-api-key", action="store_true",
        help="with --api-key: let /metrics answer without the key (a Prometheus scraper)"),
    "max_request_body_bytes": flag("--max-request-body-bytes", type=int,
                                   help="larger request bodies get a 413"),
    "keepalive_timeout": flag(
        "--keepalive-timeout", type=float, metavar="SECONDS",
        help="close a connection idle this long, or one that has not sent a whole request "
             "head in that time (default: %(default)s)"),
    "body_read_timeout": flag(
        "--body-read-timeout", type=float, metavar="SECONDS",
        help="a request body not received within this time gets a 408 and the connection "
             "is closed (default: %(default)s)"),
    "stream_write_timeout": flag(
        "--stream-write-timeout", type=float, metavar="SECONDS",
        help="a streaming client that accepts no chunk for this long (it stopped reading) "
             "is disconnected and its requests aborted (default: %(default)s)"),
    "max_connections": flag(
        "--max-connections", type=int, metavar="N",
        help="beyond N open connections a new one gets a 503 with Retry-After and is "
             "closed; 0: no cap (default: %(default)s)"),
    "max_queued_requests": flag("--max-queued-requests", type=int, metavar="N",
                                help="beyond N waiting requests new ones get 503 with "
                                     "Retry-After (SGLang's flag; default: unlimited)"),
    "allowed_hosts": flag(
        "--allowed-hosts", nargs="+", metavar="HOST",
        help="Host header names answered; any other gets a 421 (DNS rebinding). '*': any. "
             "Default: localhost, 127.0.0.1 and ::1 when bound to a loopback address, "
             "any otherwise"),
    "allowed_origins": flag(
        "--allowed-origins", nargs="+", metavar="ORIGIN", default=(),
        help="origins (scheme://host:port) whose pages may read responses (CORS); '*': "
             "any. Default: none"),
}
# RequestLimits field -> its flag: the work budget of one request (400 past each).
LIMIT_FLAGS: dict[str, FlagSpec] = {
    "max_json_depth": flag("--max-json-depth", type=int, metavar="N",
                           help="nesting of a request body's JSON (default: %(default)s)"),
    "max_pooling_inputs": flag(
        "--max-pooling-inputs", type=int, metavar="N",
        help="inputs of one embeddings or pooling call, documents of one score or rerank "
             "call (default: %(default)s)"),
    "max_stop_strings": flag("--max-stop-strings", type=int, metavar="N",
                             help="stop strings of one request (default: %(default)s)"),
    "max_stop_chars": flag("--max-stop-chars", type=int, metavar="N",
                           help="characters of one request's stop strings in all "
                                "(default: %(default)s)"),
    "max_logit_bias": flag("--max-logit-bias", type=int, metavar="N",
                           help="logit_bias entries of one request (default: %(default)s, "
                                "OpenAI's)"),
    "max_tools": flag("--max-tools", type=int, metavar="N",
                      help="tools of one request (default: %(default)s, OpenAI's)"),
    "max_schema_bytes": flag(
        "--max-schema-bytes", type=int, metavar="BYTES",
        help="size of one request's output schema, and of its tools in all, as JSON "
             "(default: %(default)s)"),
    "max_stored_response_bytes": flag(
        "--max-stored-response-bytes", type=int, metavar="BYTES",
        help="bytes the Responses store keeps in all; the least recently stored are "
             "dropped first (default: %(default)s)"),
}
# Multi-LoRA under vLLM's flag names (serve only): EngineArgs fields ...
LORA_ENGINE_FLAGS: dict[str, FlagSpec] = {
    "enable_lora": flag("--enable-lora", action="store_true",
                        help="serve PEFT LoRA adapters, each under its own model name"),
    "max_loras": flag("--max-loras", type=int,
                      help="distinct adapters in one batch (default: %(default)s)"),
    "max_lora_rank": flag("--max-lora-rank", type=int,
                          help="largest adapter rank that loads (default: %(default)s)"),
    "max_cpu_loras": flag("--max-cpu-loras", type=int,
                          help="adapters kept in CPU memory, least recently used evicted and "
                               "read again when needed (default: --max-loras)"),
}
# ... and ServerConfig fields. --lora-modules defaults to None ("extend" needs a list, not
# the field's tuple); check_serve_args makes it a flat list.
LORA_SERVER_FLAGS: dict[str, FlagSpec] = {
    "lora_modules": flag(
        "--lora-modules", type=lora_modules_arg, nargs="+", action="extend", default=None,
        metavar="NAME=PATH|JSON",
        help="adapters loaded at start-up: name=path, or a JSON object "
             '\'{"name": "name", "path": "lora_path", "base_model_name": "id"}\' '
             "(base_model_name: its parent in /v1/models); several allowed"),
    "allow_runtime_lora_updating": flag(
        "--allow-runtime-lora-updating", action="store_true",
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
             "(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; for trusted clients only)"),
}
# Tool calling, chat templates and the Responses API under vLLM's flag names (ServerConfig).
TOOL_FLAGS: dict[str, FlagSpec] = {
    "enable_auto_tool_choice": flag(
        "--enable-auto-tool-choice", action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default when a '
             "request has tools); needs --tool-call-parser"),
    "tool_call_parser": flag(
        "--tool-call-parser", choices=[*sorted(TOOL_PARSERS), AUTO_TOOL_PARSER],
        help="the model's tool-call format, read back into tool_calls and used for "
             "constrained calls (default for forced calls: hermes); auto: the format the "
             "chat template writes"),
    "reasoning_parser": flag(
        "--reasoning-parser", choices=sorted(REASONING_PARSERS),
        help="the model's thinking format: its <think>...</think> text is returned as "
             "reasoning_content (chat), reasoning items (Responses), apart from the answer, "
             "and tool-call parsing and structured output apply to the answer only"),
    "pooling": flag("--pooling", choices=POOLING_TYPES,
                    help="how /v1/embeddings, /pooling, /score and /rerank pool the final "
                    "hidden states: last token, mean, or first token (default: %(default)s; "
                    "a request's pooling_type overrides it)"),
    "chat_template": flag("--chat-template", metavar="FILE_OR_STRING",
                          help="a Jinja chat template (a file, or the template itself) "
                               "instead of the model's"),
    "max_stored_responses": flag(
        "--max-stored-responses", type=int,
        help="responses kept for previous_response_id and GET /v1/responses/ID (least "
             "recently stored dropped first, never a running background one: a new "
             "background response that does not fit beside them gets a 429; default: 1024)"),
    "trust_message_special_tokens": flag(
        "--trust-message-special-tokens", action="store_true",
        help="for trusted callers only: special tokens written in message content act as "
             "control tokens and any role renders (default: content is tokenized as text "
             "and roles are checked against the template's)"),
}


def _some(table: dict[str, FlagSpec], *names: str) -> dict[str, FlagSpec]:
    return {name: table[name] for name in names}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every argument of `aioengine serve`, in --help's order."""
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                        help="HF directory or .gguf file (default: bundled "
                             "SmolLM2-135M-Instruct)")
    add_dataclass_flags(parser, ServerConfig, _some(SERVER_FLAGS, "host", "port"))
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) in the API (default: MODEL)")
    add_dataclass_flags(parser, ServerConfig, _some(
        SERVER_FLAGS, "api_key", "metrics_without_api_key", "max_request_body_bytes",
        "keepalive_timeout", "body_read_timeout", "stream_write_timeout", "max_connections",
        "max_queued_requests", "allowed_hosts", "allowed_origins"))
    parser.set_defaults(api_key=envs.AIOENGINE_API_KEY)  # read when the parser is built
    add_dataclass_flags(parser.add_argument_group("request limits (a 400 past each)"),
                        RequestLimits, LIMIT_FLAGS)
    add_engine_args(parser)
    lora = parser.add_argument_group("LoRA adapters")
    add_dataclass_flags(lora, EngineArgs, _some(LORA_ENGINE_FLAGS, "enable_lora"))
    add_dataclass_flags(lora, ServerConfig, _some(LORA_SERVER_FLAGS, "lora_modules"))
    add_dataclass_flags(lora, EngineArgs, _some(LORA_ENGINE_FLAGS, "max_loras",
                                                "max_lora_rank", "max_cpu_loras"))
    add_dataclass_flags(lora, ServerConfig,
                        _some(LORA_SERVER_FLAGS, "allow_runtime_lora_updating"))
    add_dataclass_flags(parser.add_argument_group("tool calling and chat"), ServerConfig,
                        TOOL_FLAGS)
    add_ray_args(parser)


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    """Every argument of `aioengine run-batch`: the files, then serve's model, engine,
    LoRA and chat flags (no HTTP server, so none of its own)."""
    parser.add_argument("-i", "--input-file", required=True, metavar="FILE",
                        help="OpenAI Batch input: one JSON request a line (custom_id, "
                             "method, url, body)")
    parser.add_argument("-o", "--output-file", required=True, metavar="FILE",
                        help="Batch output, one result a line as each finishes; custom_ids "
                             "already in it are skipped (resume) and it is appended to")
    parser.add_argument("--max-concurrent-requests", type=int, default=256, metavar="N",
                        help="lines in flight at once (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                        help="HF directory or .gguf file (default: bundled "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) the bodies' `model` may use (default: MODEL)")
    add_engine_args(parser)
    lora = parser.add_argument_group("LoRA adapters")
    add_dataclass_flags(lora, EngineArgs, _some(LORA_ENGINE_FLAGS, "enable_lora"))
    add_dataclass_flags(lora, ServerConfig, _some(LORA_SERVER_FLAGS, "lora_modules"))
    add_dataclass_flags(lora, EngineArgs, _some(LORA_ENGINE_FLAGS, "max_loras",
                                                "max_lora_rank", "max_cpu_loras"))
    add_dataclass_flags(parser.add_argument_group("tool calling and chat"), ServerConfig,
                        _some(TOOL_FLAGS, "enable_auto_tool_choice", "tool_call_parser",
                              "reasoning_parser", "chat_template"))
    # What _check_lora_args and _check_tool_args read of serve's flags.
    parser.set_defaults(allow_runtime_lora_updating=False, max_stored_responses=0)


def check_run_batch_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check of parsed `run-batch` arguments."""
    if args.max_concurrent_requests < 1:
        parser.error("--max-concurrent-requests must be >= 1")
    if not os.path.isfile(args.input_file):
        parser.error(f"--input-file {args.input_file}: no such file")
    _check_lora_args(parser, args)
    _check_tool_args(parser, args)


def run_batch_server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig run-batch serves its lines with (LoRA modules, tools, template)."""
    values = {**flag_values(args, _some(LORA_SERVER_FLAGS, "lora_modules")),
              **flag_values(args, _some(TOOL_FLAGS, "enable_auto_tool_choice",
                                        "tool_call_parser", "reasoning_parser",
                                        "chat_template"))}
    values["lora_modules"] = tuple(values["lora_modules"] or ())
    return ServerConfig(**values)


def lora_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs keywords of the parsed LoRA flags."""
    return flag_values(args, LORA_ENGINE_FLAGS)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed `serve` arguments (a plain server or each Ray replica)."""
    values = {**flag_values(args, SERVER_FLAGS), **flag_values(args, LORA_SERVER_FLAGS),
              **flag_values(args, TOOL_FLAGS)}
    values["lora_modules"] = tuple(values["lora_modules"] or ())
    for name in ("allowed_hosts", "allowed_origins"):
        if values[name] is not None:
            values[name] = tuple(values[name])
    return ServerConfig(**values, limits=RequestLimits(**flag_values(args, LIMIT_FLAGS)))


def default_model_name(model: str | None) -> str:
    """The model as given (vLLM's rule); the bundled one by its file name's stem."""
    from aioengine.model.loader import resolve_model_path

    if model is not None:
        return model
    return os.path.basename(resolve_model_path(None)).split(".")[0]


def served_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The model names parsed `serve` arguments serve under (--served-model-name)."""
    return tuple(args.served_model_name or [default_model_name(serve_model(args))])


def serve_model(args: argparse.Namespace) -> str | None:
    """The model of parsed `serve` arguments: MODEL, else --model."""
    return args.model_positional or args.model


def _check_tool_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--enable-auto-tool-choice needs a parser; --chat-template is read now."""
    from aioengine.chat_prompt import load_chat_template

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_stored_responses < 0:
        parser.error("--max-stored-responses must be >= 0")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            parser.error(str(e))


def _check_server_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Limits that would leave the server unusable (a timeout of 0 closes every connection)."""
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        parser.error("--max-queued-requests must be >= 1")
    if args.max_connections < 0:
        parser.error("--max-connections must be >= 0")
    for name in ("keepalive_timeout", "body_read_timeout", "stream_write_timeout"):
        if not getattr(args, name) > 0:  # NaN too
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    for name in LIMIT_FLAGS:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def _check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flattens --lora-modules; LoRA flags without --enable-lora and adapter directories
    that do not exist stop the command before anything loads."""
    args.lora_modules = [m for group in args.lora_modules or () for m in group]
    given = [name for name, on in (("--lora-modules", args.lora_modules),
                                   ("--allow-runtime-lora-updating",
                                    args.allow_runtime_lora_updating)) if on]
    if given and not args.enable_lora:
        parser.error(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} "
                     f"--enable-lora")
    for m in args.lora_modules:
        if not os.path.isdir(m.path):
            parser.error(f"--lora-modules {m.name}={m.path}: no LoRA adapter directory at "
                         f"{m.path!r}")


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check of parsed `serve` arguments (parser.error on a bad one)."""
    _check_server_args(parser, args)
    _check_lora_args(parser, args)
    _check_tool_args(parser, args)
    if args.ray_replicas is not None and args.port == 0:
        parser.error("--ray-replicas needs a --port (Ray's proxy cannot pick one)")


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`aioengine serve ARGV` parsed and checked as the command line would be (Ray
    Serve's `build_app` builder takes its arguments this way)."""
    parser = argparse.ArgumentParser(prog="aioengine serve")
    add_serve_args(parser)
    parser.set_defaults(command="serve")
    args = parser.parse_args(argv)
    check_serve_args(parser, args)
    return args
