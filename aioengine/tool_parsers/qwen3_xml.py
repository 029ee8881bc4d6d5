"""Qwen3-Coder's XML calls (`qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A call starts once `<tool_call>`, optional whitespace and `<function=NAME>` are read (else
`<tool_call>` is text). Its arguments are emitted as a JSON object one parameter at a time,
each when its value ends: at `</parameter>`, or at a `<parameter=` or `</function>` that
comes first (a model that left the tag open); one newline at each end of a value is
dropped. Values are typed by the offered function's JSON schema (`bind`): strings as
written; numbers, booleans, null, objects and arrays parsed; a parameter the schema does not
type is parsed as JSON if it is JSON, else kept as a string. Text between parameters is
dropped; `</function>` closes the object, and the `</tool_call>` after it is dropped. At the
end of an output an open value ends there and the object is closed.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, ClassVar

from aioengine.tool_call_stream import JSON_WS, ToolCallStream, partial_suffix
from aioengine.tool_parsers.base import PROMPT_EXAMPLE, ToolParser

_FUNCTION = re.compile(r"[ \t\n\r]*<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")
_OPEN_PARAM, _CLOSE_PARAM, _CLOSE_FUNCTION = "<parameter=", "</parameter>", "</function>"
_CLOSE_CALL = "</tool_call>"


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a property schema allows (empty: not typed)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} \
        if isinstance(t, list) else set()
    for value in schema.get("enum", []) + ([schema["const"]] if "const" in schema else []):
        types.add({str: "string", bool: "boolean", int: "integer", float: "number",
                   type(None): "null"}.get(type(value), "object"))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []) if isinstance(schema.get(key), list) else []:
            types |= _schema_types(sub)
    return types


def _strict_json(text: str) -> Any:
    """`text` as JSON (NaN and Infinity refused); ValueError if it is not."""
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)
    except RecursionError:
        raise ValueError(text) from None
    return value


def _json_or_literal(text: str) -> Any:
    """`text` as JSON, else as a Python literal that JSON can hold; ValueError if neither."""
    try:
        return _strict_json(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise ValueError(text) from None
    return list(value) if isinstance(value, tuple) else value


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema types it as (module docstring)."""
    types, text = _schema_types(schema), raw.strip()
    if "null" in types and text.lower() in ("null", "none"):
        return None
    if "string" in types:
        return raw
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if types & {"integer", "number"}:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return int(value) if "number" not in types and value == int(value) else value
    if types & {"object", "array"} or not types:
        try:
            return _json_or_literal(text) if types else _strict_json(text)
        except ValueError:
            pass
    return raw


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    trigger = "<tool_call>"
    separator: ClassVar[str] = "\n"
    _begin = "<tool_call>\n<function={}>\n"
    _end = "\n</function>\n</tool_call>"

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self._schemas = schemas or {}

    def bind(self, schemas: dict[str, dict[str, Any]]) -> ToolParser:
        return Qwen3CoderToolParser(schemas)

    def stream(self) -> ToolCallStream:
        return Qwen3XmlStream(self)

    def typed(self, function: str, key: str, raw: str) -> Any:
        properties = self._schemas.get(function, {}).get("properties")
        return typed_value(raw, properties.get(key) if isinstance(properties, dict) else None)

    def format_call(self, name: str, arguments: str) -> str:
        args = json.loads(arguments)
        params = "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n"
                         for k, v in args.items())
        return f"{self._begin.format(name)}{params}{self._end.lstrip()}"

    def prompt_instructions(self) -> str:
        example = self.format_call(*PROMPT_EXAMPLE)
        return ("To call a function, write a <tool_call> block: <function=NAME> with the "
                "function's name, then each argument as <parameter=KEY> followed by its value "
                "and </parameter>, each on their own lines, then </function> and "
                "</tool_call>. Write one block per call. For example:\n" + example)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": self._begin.format(name),
                "content": {"type": "json_schema", "json_schema": schema,
                            "style": "qwen_xml", "max_whitespace_cnt": 1},
                "end": self._end}

    def only_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return self._separated(tags, self.separator, single, at_least_one=True)

    def auto_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return self._triggered(tags, single)


class Qwen3XmlStream(ToolCallStream):
    """ToolCallStream's text and events, with Qwen3-Coder's call blocks (module docstring)."""

    _p: Qwen3CoderToolParser

    def __init__(self, parser: Qwen3CoderToolParser) -> None:
        super().__init__(parser)
        self._function = self._key = ""
        self._params = 0

    def _header(self, final: bool) -> bool:
        rest = self._buf[len(self._p.trigger):]
        m = _FUNCTION.match(rest)
        if m is None:
            head = rest.lstrip(JSON_WS)
            undecided = _OPEN_FUNCTION.startswith(head) or (
                head.startswith(_OPEN_FUNCTION) and not re.search(r"[>\n]", head))
            if undecided and not final:
                return False
            self._content(self._p.trigger)  # not a call: the tag is text
            self._buf, self._step = rest, self._text
            return True
        self._function, self._params = m.group(1).strip(), 0
        self._start(self._function)
        self._buf, self._step = rest[m.end():], self._body
        return True

    def _body(self, final: bool) -> bool:
        """Between parameters: the next `<parameter=KEY>` or `</function>`."""
        hits = [i for i in (self._buf.find(_OPEN_PARAM), self._buf.find(_CLOSE_FUNCTION))
                if i >= 0]
        if not hits:
            if final:
                self._close()
                self._buf = ""
                return False
            keep = max(partial_suffix(self._buf, _OPEN_PARAM),
                       partial_suffix(self._buf, _CLOSE_FUNCTION))
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        i = min(hits)
        if self._buf.startswith(_CLOSE_FUNCTION, i):
            self._close()
            self._buf, self._step = self._buf[i + len(_CLOSE_FUNCTION):], self._after_call
            return True
        m = _PARAM.match(self._buf, i)
        if m is None:
            if not final and not re.search(r"[>\n]", self._buf[i + len(_OPEN_PARAM):]):
                return False
            self._buf = self._buf[i + len(_OPEN_PARAM):]  # a broken tag: dropped
            return True
        self._key = m.group(1).strip()
        self._buf, self._step = self._buf[m.end():], self._value
        return True

    def _value(self, final: bool) -> bool:
        hits = [(i, tag) for tag in (_CLOSE_PARAM, _OPEN_PARAM, _CLOSE_FUNCTION)
                if (i := self._buf.find(tag)) >= 0]
        if hits:
            i, tag = min(hits)
            raw, used = self._buf[:i], i + (len(tag) if tag == _CLOSE_PARAM else 0)
        elif final:
            raw, used = self._buf, len(self._buf)
        else:
            return False
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = self._p.typed(self._function, self._key, raw)
        piece = f"{json.dumps(self._key, ensure_ascii=False)}: " \
                f"{json.dumps(value, ensure_ascii=False)}"
        self._args(("{" if self._params == 0 else ", ") + piece)
        self._params += 1
        self._buf, self._step = self._buf[used:], self._body
        return True

    def _close(self) -> None:
        self._args("}" if self._params else "{}")

    def _after_call(self, final: bool) -> bool:
        """Drops the `</tool_call>` after `</function>` (and the whitespace before it)."""
        head = self._buf.lstrip(JSON_WS)
        if head.startswith(_CLOSE_CALL):
            self._buf = head[len(_CLOSE_CALL):]
        elif _CLOSE_CALL.startswith(head) and not final:
            return False
        self._step = self._text
        return True


_OPEN_FUNCTION = "<function="
