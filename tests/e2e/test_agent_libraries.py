"""Real agent libraries, unchanged but for the base URL, against `aioengine serve` on the
bundled model: langchain-openai (forced tool calls, structured output, streaming),
instructor (TOOLS and JSON_SCHEMA modes) and the openai-agents SDK (a tool-calling run
through Chat Completions and through Responses). The model is tiny, so every call that
must produce a tool call forces it; forced calls are grammar-constrained and always parse."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import agents
import instructor
import langsmith
import openai
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool)
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from server_process import ServerProcess

pytestmark = pytest.mark.slow
agents.set_tracing_disabled(True)  # the Agents SDK would otherwise export traces to OpenAI

KEY = "x"  # a dummy: the server runs without an API key
ASK_WEATHER = "What is the weather in Paris?"


class GetWeather(BaseModel):
    """Get the current weather of a city."""
    city: str = Field(description="The name of the city")
    unit: str = Field(description="celsius or fahrenheit")


class Person(BaseModel):
    """A person mentioned in the text."""
    name: str
    age: int


ASK_PERSON = "Extract the person: Alice is 30 years old."


@pytest.fixture(autouse=True)
def no_langsmith() -> Iterator[None]:
    """No LangSmith tracing, whatever the environment says."""
    with langsmith.tracing_context(enabled=False):
        yield


@pytest.fixture(scope="module")
def model(tool_server: ServerProcess) -> str:
    return tool_server.model


@pytest.fixture(scope="module")
def chat(tool_server: ServerProcess, model: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=tool_server.base_url, api_key=KEY, model=model,
                      temperature=0, max_tokens=48, max_retries=0, timeout=120)


# --- langchain-openai --------------------------------------------------------------------

def check_weather_call(message: AIMessage) -> GetWeather:
    assert isinstance(message, AIMessage) and len(message.tool_calls) >= 1, message
    call = message.tool_calls[0]
    assert call["name"] == "GetWeather" and call["id"], call
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    return GetWeather(**call["args"])


def test_langchain_bind_tools_named(chat: ChatOpenAI) -> None:
    message = chat.bind_tools([GetWeather], tool_choice="GetWeather").invoke(ASK_WEATHER)
    weather = check_weather_call(message)
    assert isinstance(weather.city, str) and isinstance(weather.unit, str)
    assert message.response_metadata["finish_reason"] in ("tool_calls", "stop")


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(chat: ChatOpenAI, method: str) -> None:
    person = chat.with_structured_output(Person, method=method).invoke(ASK_PERSON)
    assert isinstance(person, Person), person
    assert isinstance(person.name, str) and isinstance(person.age, int)


def test_langchain_stream_equals_invoke(chat: ChatOpenAI) -> None:
    prompt = "Write one sentence about the sea."
    whole = chat.invoke(prompt)
    chunks = list(chat.stream(prompt))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert len([c for c in chunks if c.content]) > 1, chunks
    assert isinstance(whole.content, str) and whole.content
    assert "".join(str(c.content) for c in chunks) == whole.content


def test_langchain_stream_tool_call(chat: ChatOpenAI) -> None:
    bound = chat.bind_tools([GetWeather], tool_choice="GetWeather")
    whole = bound.invoke(ASK_WEATHER)
    chunks = list(bound.stream(ASK_WEATHER))
    assert len([c for c in chunks if c.tool_call_chunks]) > 2, chunks  # arguments streamed
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined = joined + chunk
    assert isinstance(joined, AIMessageChunk)
    streamed = check_weather_call(AIMessage(content=joined.content,
                                            tool_calls=joined.tool_calls))
    assert not joined.invalid_tool_calls, joined.invalid_tool_calls
    assert streamed == check_weather_call(whole)
    assert joined.tool_calls[0]["name"] == whole.tool_calls[0]["name"]


# --- instructor --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_instructor(tool_server: ServerProcess, model: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=tool_server.base_url, api_key=KEY, max_retries=0, timeout=120),
        mode=mode)
    person = client.chat.completions.create(
        model=model, response_model=Person, max_retries=0, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": ASK_PERSON}])
    assert isinstance(person, Person), person
    assert isinstance(person.name, str) and isinstance(person.age, int)


# --- openai-agents -----------------------------------------------------------------------

def weather_agent(model: agents.Model, called: list[str]) -> Agent:
    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        called.append(city)
        return f"It is sunny and 21 degrees in {city}."

    return Agent(name="weather", instructions="Answer questions about the weather.",
                 tools=[get_weather], model=model,
                 # One call: with parallel calls allowed the model starts a second one.
                 model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                              temperature=0, max_tokens=48))


@pytest.fixture
async def async_client(tool_server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=tool_server.base_url, api_key=KEY, max_retries=0,
                                  timeout=120) as client:
        yield client


async def run_weather(model: agents.Model,
                      stream: bool) -> tuple[list[str], agents.RunResultBase]:
    called: list[str] = []
    agent = weather_agent(model, called)
    if not stream:
        return called, await Runner.run(agent, ASK_WEATHER, max_turns=4)
    result = Runner.run_streamed(agent, ASK_WEATHER, max_turns=4)
    events = [e async for e in result.stream_events()]
    assert any(e.type == "raw_response_event" and e.data.type == "response.output_text.delta"
               for e in events)
    return called, result


def check_run(called: list[str], result: agents.RunResultBase) -> None:
    assert len(called) == 1 and isinstance(called[0], str), called
    outputs = [i for i in result.new_items if isinstance(i, agents.ToolCallOutputItem)]
    assert len(outputs) == 1 and called[0] in str(outputs[0].output), result.new_items
    assert len(result.raw_responses) == 2  # the forced call, then the answer to its result
    assert isinstance(result.final_output, str) and result.final_output.strip(), result


@pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])
async def test_agents_chat_completions(async_client: openai.AsyncOpenAI, model: str,
                                       stream: bool) -> None:
    check_run(*await run_weather(
        OpenAIChatCompletionsModel(model=model, openai_client=async_client), stream))


@pytest.mark.parametrize("stream", [False, True], ids=["run", "streamed"])
async def test_agents_responses(async_client: openai.AsyncOpenAI, model: str,
                                stream: bool) -> None:
    check_run(*await run_weather(
        OpenAIResponsesModel(model=model, openai_client=async_client), stream))
