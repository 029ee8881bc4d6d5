"""Python-style calls (`pythonic`, Llama 3.2 and Llama 4): a list of calls with keyword
arguments written as Python literals, `[get_weather(city="Paris", unit="celsius"), f(x=1)]`.

A block starts at a `[` followed (after optional whitespace) by a name and `(`; any other `[`
is text. It runs to its matching `]` (brackets inside Python strings do not count; at the
end of an output, to the end) and is read with `ast` (never evaluated): a non-empty list of
calls of plain names with keyword arguments only, each a literal (strings, numbers, True /
False / None and JSON's true / false / null, lists, tuples, dicts with string keys), is
those calls, their arguments as JSON; anything else is content, as written. Calls are sent
when the block ends. Llama 4's `<|python_start|>` at the start of an output and the
`<|python_end|>` after a block are dropped.

A forced call is constrained by an EBNF grammar built from the function's schema: its
declared parameters as keywords in declared order (the required ones present), each value a
literal of the parameter's type (string, integer, number, boolean, null, an enum's or
const's values); arrays, objects and untyped parameters take any literal.
"""
from __future__ import annotations

import ast
import io
import json
import keyword
import math
import re
import tokenize
import warnings
from typing import Any, ClassVar

from aioengine.tool_call_stream import ParsedToolCall, ToolCallStream
from aioengine.tool_parsers.base import PROMPT_EXAMPLE, ToolParser

_BLOCK_START = re.compile(r"\[[ \t\n\r]*[A-Za-z_]\w*[ \t\n\r]*\(")
_MAY_START = re.compile(r"\[[ \t\n\r]*(?:[A-Za-z_]\w*[ \t\n\r]*)?\Z")
_END_TAG = "<|python_end|>"
_NAMED_CONSTANTS = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A literal's value as JSON can hold it; ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bool, type(None))):
        return node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a finite number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("a dict key that is not a string")
            out[key] = _literal(v)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


def _escape_keywords(text: str) -> tuple[str, dict[str, str]] | None:
    """`text` with each Python keyword outside strings renamed, and the names back, so that
    a tool or parameter named `from`, `class` or `in` (valid JSON Schema names, and what a
    model writes) parses. True / False / None stay: they are literals. None if it does not
    tokenize."""
    starts = [0]  # each line's offset, lines as tokenize reads them (split at \n only)
    for line in io.StringIO(text).readlines():
        starts.append(starts[-1] + len(line))
    spans = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if (tok.type == tokenize.NAME and keyword.iskeyword(tok.string)
                    and tok.string not in ("True", "False", "None")):
                spans.append((starts[tok.start[0] - 1] + tok.start[1], tok.string))
    except (tokenize.TokenError, SyntaxError):
        return None
    back: dict[str, str] = {}
    for offset, word in reversed(spans):
        alias = f"{word}_kw_"
        while alias in text:  # never a name the text already uses
            alias += "_"
        back[alias] = word
        text = text[:offset] + alias + text[offset + len(word):]
    return text, back


def parse_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of a block, or None if it is not a list of calls (module docstring)."""
    escaped = _escape_keywords(text.strip())
    if escaped is None:
        return None
    source, back = escaped
    try:
        with warnings.catch_warnings():  # e.g. an invalid escape in a string: not ours to warn
            warnings.simplefilter("ignore")
            tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {back.get(kw.arg, kw.arg): _literal(kw.value)
                    for kw in node.keywords if kw.arg is not None}
        except (ValueError, RecursionError):
            return None
        if len(args) != len(node.keywords):  # a **mapping
            return None
        name = back.get(node.func.id, node.func.id)
        calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def python_literal(value: Any) -> str:
    """A JSON value written as a Python literal (JSON's string escapes are Python's)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(python_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {python_literal(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def _call_text(name: str, args: dict[str, Any]) -> str:
    return f"{name}(" + ", ".join(f"{k}={python_literal(v)}" for k, v in args.items()) + ")"


class PythonicToolParser(ToolParser):
    name = "pythonic"
    trigger = "["
    start_tag = "<|python_start|>"
    separator: ClassVar[str] = ", "

    def stream(self) -> ToolCallStream:
        return PythonicStream(self)

    def format_call(self, name: str, arguments: str) -> str:
        return f"[{_call_text(name, json.loads(arguments))}]"

    def prompt_instructions(self) -> str:
        return ("To call functions, reply with a Python list of the calls, each the "
                "function's name with its arguments as keyword arguments written as Python "
                "literals, calls separated by commas, and nothing else. For example:\n"
                + self.format_call(*PROMPT_EXAMPLE))

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{name}(",
                "content": {"type": "grammar", "grammar": keywords_grammar(schema)},
                "end": ")"}

    def only_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": "["},
            self._separated(tags, self.separator, single, True),
            {"type": "const_string", "value": "]"}]}

    def auto_calls(self, tags: list[dict[str, Any]], single: bool) -> dict[str, Any]:
        # One trigger per function, `[name(`, so a `[` in text is free; the list it opens
        # is that call, then (unless single) more calls, then `]`.
        more = self._separated(tags, self.separator, False, True)
        blocks = []
        for tag in tags:
            rest: list[dict[str, Any]] = [tag["content"], {"type": "const_string",
                                                           "value": ")"}]
            if not single:
                rest.append({"type": "optional", "content": {"type": "sequence", "elements": [
                    {"type": "const_string", "value": self.separator}, more]}})
            blocks.append({"type": "tag", "begin": "[" + tag["begin"],
                           "content": {"type": "sequence", "elements": rest}, "end": "]"})
        return {"type": "triggered_tags", "triggers": [b["begin"] for b in blocks],
                "tags": blocks, "at_least_one": False, "stop_after_first": single}


class PythonicStream(ToolCallStream):
    """ToolCallStream's text and events, with a block of Python calls at each `[` that
    opens one (module docstring)."""

    def __init__(self, parser: PythonicToolParser) -> None:
        super().__init__(parser)
        self._scan = _PyScan()  # type: ignore[assignment]

    def _header(self, final: bool) -> bool:
        if _BLOCK_START.match(self._buf) is None:
            if not final and _MAY_START.match(self._buf):
                return False
            self._content("[")  # not a block: the bracket is text
            self._buf, self._step = self._buf[1:], self._text
            return True
        self._scan, self._step = _PyScan(), self._block  # type: ignore[assignment]
        return True

    def _block(self, final: bool) -> bool:
        end = self._scan.advance(self._buf)  # type: ignore[attr-defined]
        if end < 0 and not final:
            return False
        n = len(self._buf) if end < 0 else end
        block, self._buf = self._buf[:n], self._buf[n:]
        calls = parse_calls(block)
        if calls is None:
            self._content(block)
        for call in calls or []:
            self._start(call.name)
            self._args(call.arguments)
        self._step = self._after_block
        return True

    def _after_block(self, final: bool) -> bool:
        if self._buf.startswith(_END_TAG):
            self._buf = self._buf[len(_END_TAG):]
        elif _END_TAG.startswith(self._buf) and not final:
            return False
        self._step = self._text
        return True


class _PyScan:
    """Bracket matching over Python source that may arrive in pieces: quotes (' and ")
    and backslash escapes inside them hide brackets. `pos`: how far it has read."""

    def __init__(self) -> None:
        self.depth, self.quote, self.esc, self.pos = 0, "", False, 0

    def advance(self, text: str) -> int:
        """Reads on from `pos`; the index just past the bracket that closes the first, or -1."""
        i = self.pos
        while i < len(text):
            c = text[i]
            i += 1
            if self.quote:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "\"'":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return -1


# The grammar of a call's keyword arguments (pythonic forced calls).
_GRAMMAR_BASE = r'''
py_string ::= "\"" py_char* "\""
py_char ::= [^"\\\n\r] | "\\" ["\\bfnrt] | "\\u" py_hex py_hex py_hex py_hex
py_hex ::= [0-9a-fA-F]
py_integer ::= "-"? ("0" | [1-9] [0-9]*)
py_number ::= py_integer ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
py_boolean ::= "True" | "False"
py_none ::= "None"
py_list ::= "[" (py_any (", " py_any)*)? "]"
py_dict ::= "{" (py_string ": " py_any (", " py_string ": " py_any)*)? "}"
py_any ::= py_string | py_number | py_boolean | py_none | py_list | py_dict
'''
_TYPE_RULES = {"string": "py_string", "integer": "py_integer", "number": "py_number",
               "boolean": "py_boolean", "null": "py_none"}


def _ebnf_string(text: str) -> str:
    return json.dumps(text)  # EBNF string literals take JSON's escapes


def _value_rule(schema: Any) -> str:
    """The EBNF expression of a value matching `schema` (module docstring)."""
    if not isinstance(schema, dict):
        return "py_any"
    if "const" in schema or isinstance(schema.get("enum"), list):
        values = [schema["const"]] if "const" in schema else schema["enum"]
        return "(" + " | ".join(_ebnf_string(python_literal(v)) for v in values) + ")"
    t = schema.get("type")
    types = [t] if isinstance(t, str) else t if isinstance(t, list) else []
    rules = [_TYPE_RULES.get(x, "py_any") for x in types if isinstance(x, str)]
    return "(" + " | ".join(rules) + ")" if rules else "py_any"


def keywords_grammar(schema: dict[str, Any]) -> str:
    """EBNF (start rule `root`) of the keyword arguments of a call whose parameters match
    `schema`: `first_i` / `more_i` are "at parameter i, with nothing / something before"."""
    properties = schema.get("properties")
    props = list(properties.items()) if isinstance(properties, dict) else []
    required = set(schema.get("required", []))
    lines = [_GRAMMAR_BASE, "root ::= first_0"]
    for i, (key, sub) in enumerate(props):
        kv = f"{_ebnf_string(key + '=')} {_value_rule(sub)}"
        first = [f"{kv} more_{i + 1}"] + ([] if key in required else [f"first_{i + 1}"])
        more = [f'", " {kv} more_{i + 1}'] + ([] if key in required else [f"more_{i + 1}"])
        lines += [f"first_{i} ::= " + " | ".join(first), f"more_{i} ::= " + " | ".join(more)]
    lines += [f'first_{len(props)} ::= ""', f'more_{len(props)} ::= ""']
    return "\n".join(lines)
