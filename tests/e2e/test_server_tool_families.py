"""Forced tool calls in every other family's format, through the real server and the real
`openai` client on the bundled model: one server per `--tool-call-parser` (mistral chosen by
`auto` from a chat template that renders the tools itself; granite, phi4_mini_json,
qwen3_coder and pythonic offered through the default tool prompt). The grammar makes the
model write the family's syntax; the calls must come back parsed, naming the right
function, with arguments that validate against its schema, streamed as non-streamed."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from server_process import ServerProcess, openai_client, serving, start_server
from test_server_tools import ASK, NAMED, SCHEMAS, TIME, TOOLS, WEATHER, check_calls, joined_stream

pytestmark = pytest.mark.slow

# A ChatML template (the bundled model's turns) that takes tools and writes Mistral's
# markers: the tools reach the prompt through the template, and `auto` reads its format.
MISTRAL_LIKE_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Available functions: [AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]
To call functions write [TOOL_CALLS] then a JSON array of {"name": ..., "arguments": ...}.\
<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}\
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

FAMILIES = ["mistral", "granite", "phi4_mini_json", "qwen3_coder", "pythonic"]
MARKERS = {"mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>", "phi4_mini_json": "functools",
           "qwen3_coder": "<function=", "pythonic": "lookup_word(word="}


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, tmp_path_factory) -> Iterator[tuple[str, ServerProcess]]:
    family = request.param
    if family == "mistral":
        template = tmp_path_factory.mktemp("template") / "mistral_like.jinja"
        template.write_text(MISTRAL_LIKE_TEMPLATE)
        args = ["--tool-call-parser", "auto", "--chat-template", str(template)]
    else:
        args = ["--tool-call-parser", family]
    for server in serving(*args):
        yield family, server


@pytest.fixture(scope="module")
def client(family_server) -> openai.OpenAI:
    return openai_client(family_server[1])


def prompt_text(server: ServerProcess, body: dict) -> str:
    status, raw = server.request("POST", "/tokenize", {"model": server.model, **body})
    assert status == 200, raw
    status, raw = server.request("POST", "/detokenize", {"model": server.model,
                                                         "tokens": json.loads(raw)["tokens"]})
    assert status == 200, raw
    return json.loads(raw)["prompt"]


def test_the_tools_are_in_the_prompt(family_server) -> None:
    family, server = family_server
    text = prompt_text(server, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    assert "get_weather" in text and "get_time" in text and MARKERS[family] in text
    if family == "mistral":  # rendered by the template, not the default tool prompt
        assert "[AVAILABLE_TOOLS]" in text and "You are a function calling" not in text
        assert "--tool-call-parser auto: the chat template writes mistral tool calls" \
            in "".join(server.log)
    else:
        assert "You are a function calling" in text


# get_weather with a city of at most 24 characters: at temperature 1.0 an unbounded string
# may run past max_tokens, and where it does depends on the CPU's kernels (on an AMD EPYC
# qwen3_coder's seed-1 call wrote a sentence as the city and ended with "length").
_PARAMS = WEATHER["function"]["parameters"]
BOUNDED = [{**WEATHER, "function": {**WEATHER["function"], "parameters": {
    **_PARAMS, "properties": {**_PARAMS["properties"],
                              "city": {"type": "string", "maxLength": 24}}}}}, TIME]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_call_is_that_function_with_valid_arguments(client, family_server,
                                                          temperature: float) -> None:
    model = family_server[1].model
    for seed in range(2):
        r = client.chat.completions.create(
            model=model, messages=ASK, tools=BOUNDED, tool_choice=NAMED, max_tokens=80,
            temperature=temperature, seed=seed)
        calls = check_calls(r.choices[0].message, r.choices[0].finish_reason)
        assert [c.function.name for c in calls] == ["get_weather"]
        assert r.choices[0].message.content is None


def test_required_streamed_joins_to_the_non_streamed(client, family_server) -> None:
    kwargs = dict(model=family_server[1].model, messages=ASK, tools=TOOLS,
                  tool_choice="required", max_tokens=120, temperature=0)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.message.content is None and choice.message.tool_calls
    assert choice.finish_reason in ("tool_calls", "length")
    whole = choice.message.tool_calls
    if choice.finish_reason == "length":  # the tiny model may repeat calls: the last is cut
        whole = whole[:-1]
    for call in whole:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, finish = joined_stream(client.chat.completions.create(**kwargs, stream=True))
    assert finish == choice.finish_reason
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_parallel_tool_calls_false_gives_one_call(client, family_server) -> None:
    r = client.chat.completions.create(
        model=family_server[1].model, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=3, n=2)
    for choice in r.choices:
        assert len(check_calls(choice.message, choice.finish_reason)) == 1


def test_second_turn_writes_the_past_call_in_the_format(client, family_server) -> None:
    family, server = family_server
    r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS,
                                       tool_choice=NAMED, max_tokens=80, temperature=0)
    call = check_calls(r.choices[0].message, r.choices[0].finish_reason)[0]
    messages = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    text = prompt_text(server, {"messages": messages, "tools": TOOLS, "tool_choice": "required"})
    assert "sunny, 21 C" in text
    assert text.count(MARKERS[family]) >= 2 if family == "mistral" else \
        server_parser_writes(family, call.function.name, call.function.arguments) in text
    answer = client.chat.completions.create(model=server.model, messages=messages,
                                            tools=TOOLS, tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None


def server_parser_writes(family: str, name: str, arguments: str) -> str:
    from aioengine.tool_parsers import get_tool_parser

    return get_tool_parser(family).format_call(name, arguments)


def test_auto_without_a_known_format_fails_start_up() -> None:
    """The bundled model's template writes no tool-call format: `auto` cannot choose."""
    with pytest.raises(RuntimeError) as e:
        start_server("--enable-auto-tool-choice", "--tool-call-parser", "auto")
    assert "--tool-call-parser auto cannot tell" in str(e.value)
    assert "hermes" in str(e.value) and "pythonic" in str(e.value)
