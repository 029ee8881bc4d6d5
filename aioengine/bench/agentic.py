"""Agent-shaped prompt sets for `aioengine bench spec --prompts ...`: the same request shape
over and over with small changes, as agents send them, where suffix decoding drafts from
earlier requests' outputs.

- `extraction`: a fixed-shape JSON extraction (the same keys every time, new values).
- `sql`: a SQL query over one schema with a changing condition.
- `code-edit`: rewrite a given function with a small change (the answer copies the code).
- `agent-replay`: a multi-turn tool-using conversation cut before an assistant turn (the
  next call, with an id a tool returned or the same shape with new arguments, or a JSON
  report restating the results), as the server renders it for a template without tools.

Each set is generated from a seed: `chat_set(name, n, seed)` (chat messages; the single-turn
sets also as strings: `prompt_set`). The bench warms up on one seed's prompts and times
another's; an odd and an even seed draw their people, cities, dates, ids and function names
from disjoint halves, so a timed prompt is never a warm-up one (the shapes and the rest of
the wording are shared, as in agent traffic).
"""
from __future__ import annotations

import json
import random

# Single user messages (prompt_set), and all sets (chat_set).
PROMPT_SETS = ("extraction", "sql", "code-edit")
AGENTIC_SETS = PROMPT_SETS + ("agent-replay",)
# The seeds of the warm-up and of the timed prompts.
WARMUP_SEED, TIMED_SEED = 1, 2

_FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan",
          "Julia", "Kenji", "Lena", "Marco", "Nora", "Omar", "Priya", "Quinn", "Rosa"]
_LAST = ["Smith", "Rossi", "Wang", "Okafor", "Kowalski", "Haddad", "Berg", "Tanaka",
         "Novak", "Silva", "Murphy", "Larsen", "Dubois", "Khan", "Meyer", "Costa"]
_COMPANIES = ["Acme Corp", "Globex", "Initech", "Umbrella Labs", "Stark Industries",
              "Wayne Enterprises", "Hooli", "Vandelay Imports", "Soylent", "Tyrell"]
_CITIES = ["Paris", "Berlin", "Lagos", "Tokyo", "Lima", "Oslo", "Toronto", "Madrid",
           "Nairobi", "Seoul", "Dublin", "Austin"]
_ROLES = ["sales manager", "data engineer", "head of marketing", "accountant",
          "product designer", "CTO", "support lead", "recruiter"]


def _half(values: list[str], part: int) -> list[str]:
    """The half of `values` a seed of parity `part` draws from."""
    return values[part::2]


def _extraction(rng: random.Random, part: int) -> str:
    first, last = rng.choice(_half(_FIRST, part)), rng.choice(_LAST)
    company, city, role = (rng.choice(_COMPANIES), rng.choice(_half(_CITIES, part)),
                           rng.choice(_ROLES))
    phone = f"+{rng.randint(1, 49)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    email = f"{first.lower()}.{last.lower()}@{company.split()[0].lower()}.com"
    text = rng.choice([
        f"Hi, I'm {first} {last}, {role} at {company} in {city}. Reach me at {email} or "
        f"{phone}.",
        f"{first} {last} ({role}, {company}) moved to {city} last year; phone {phone}, "
        f"mail {email}.",
        f"Contact: {email}. {first} {last} works as {role} for {company}, based in {city}. "
        f"Tel. {phone}",
    ])
    return ("Extract the contact from the text and answer with only a JSON object with the "
            "keys \"name\", \"email\", \"phone\", \"company\", \"role\" and \"city\".\n\n"
            f"Text: {text}")


_SQL_ASKS = [
    "the total amount per customer for orders with status '{s}' since {d}",
    "the 10 largest orders with status '{s}' created after {d}, newest first",
    "the number of orders per status for customers in {c}",
    "the average order amount per month for orders with status '{s}' in {c}",
    "all customers in {c} who have no order with status '{s}'",
]


def _sql(rng: random.Random, part: int) -> str:
    day = 2 * rng.randint(1, 14) - part  # odd or even days
    ask = rng.choice(_SQL_ASKS).format(
        s=rng.choice(["paid", "shipped", "refunded", "pending"]),
        d=f"2024-{rng.randint(1, 12):02d}-{day:02d}", c=rng.choice(_half(_CITIES, part)))
    return ("Tables: customers(id, name, city, created_at) and orders(id, customer_id, "
            "amount, status, created_at).\nWrite one PostgreSQL query that returns " + ask +
            ". Answer with the SQL only.")


_FUNCS = [
    ("def {f}(items, {a}):\n    total = 0\n    for item in items:\n        if item.{a} > 0:\n"
     "            total += item.price * item.{a}\n    return total\n"),
    ("def {f}(rows, {a}):\n    out = []\n    for row in rows:\n        key = row[\"{a}\"]\n"
     "        if key not in out:\n            out.append(key)\n    return sorted(out)\n"),
    ("def {f}(path, {a}):\n    with open(path) as fh:\n        lines = fh.readlines()\n"
     "    return [line.strip() for line in lines if {a} in line]\n"),
]
_CHANGES = ["logs how many items it skipped", "raises ValueError on an empty input",
            "takes a `limit` argument and stops after that many results",
            "has type hints and a docstring"]


_NAMES = ["summarize", "collect", "load_matches", "compute", "unique_keys", "total_of",
          "find_lines", "distinct", "aggregate", "scan", "tally", "gather"]


def _code_edit(rng: random.Random, part: int) -> str:
    code = rng.choice(_FUNCS).format(
        f=rng.choice(_half(_NAMES, part)),
        a=rng.choice(["quantity", "weight", "name", "needle", "tag"]))
    return (f"Rewrite this Python function so that it {rng.choice(_CHANGES)}. Answer with the "
            f"whole function only.\n\n```python\n{code}```")


# agent-replay: what an agent framework sends (OpenAI tools, assistant tool_calls, tool
# results), cut before an assistant turn that restates or reuses earlier turns.

def _fn(name: str, description: str, **params: str) -> dict:
    """An OpenAI function tool; `params`: name -> JSON type, all required."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(params),
                       "properties": {k: {"type": t} for k, t in params.items()}}}}


def _id(rng: random.Random, prefix: str, part: int) -> str:
    return f"{prefix}-{2 * rng.randrange(5000, 50000) + part}"  # last digit: the parity


def _amount(rng: random.Random, part: int) -> float:
    return rng.randint(12, 480) + (2 * rng.randint(0, 49) + part) / 100


def _date(rng: random.Random, part: int) -> str:
    return f"2024-{rng.randint(1, 12):02d}-{2 * rng.randint(1, 14) - part:02d}"


# (assistant text, tool, arguments, tool result) per round trip.
_Step = tuple[str, str, dict, dict]


def _replay(rng: random.Random, system: str, task: str, steps: list[_Step],
            report: str) -> list[dict]:
    """System prompt, task, then 3 to all of `steps` as round trips. After the last one the
    next turn is the next call (an id to copy, or the same call with new arguments); when
    all ran, or a third of the time, the user asks for a JSON report of the results."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    rounds = rng.randint(3, len(steps))
    for say, name, args, result in steps[:rounds]:
        call_id = f"call_{rng.getrandbits(40):010x}"
        messages.append({"role": "assistant", "content": say, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id,
                         "content": json.dumps(result)})
    if rounds == len(steps) or rng.random() < 1 / 3:
        messages.append({"role": "user", "content": "Summarize what the tools returned as a "
                         f"JSON report with the keys {report}. Answer with the JSON only."})
    return messages


_SUPPORT_TOOLS = [
    _fn("search_customers", "Find customers by name in a city.", query="string", city="string"),
    _fn("get_customer", "A customer's profile.", customer_id="string"),
    _fn("list_orders", "A customer's orders, newest first.", customer_id="string"),
    _fn("get_order", "One order with its items and payment charges.", order_id="string"),
    _fn("create_refund", "Refund one charge of an order.", order_id="string",
        charge_id="string", amount="number", reason="string"),
    _fn("send_email", "Email a customer.", to="string", subject="string", body="string"),
]
# The shop's catalogue, shared by all customers (like the statuses): not halved.
_ITEMS = ["desk lamp", "running shoes", "coffee grinder", "backpack", "USB-C hub",
          "yoga mat", "rain jacket", "water bottle", "headphones", "notebook set"]


def _support(rng: random.Random, part: int) -> tuple[list[dict], list[dict]]:
    first, last = rng.choice(_half(_FIRST, part)), rng.choice(_half(_LAST, part))
    name, city, customer = f"{first} {last}", rng.choice(_half(_CITIES, part)), _id(rng, "C", part)
    email = f"{first.lower()}.{last.lower()}@example.com"
    orders = [{"order_id": _id(rng, "O", part), "amount": _amount(rng, part),
               "status": rng.choice(["paid", "shipped", "delivered"]),
               "created_at": _date(rng, part)} for _ in range(rng.randint(2, 4))]
    order = rng.choice(orders)
    charges = [{"charge_id": _id(rng, "CH", part), "amount": order["amount"],
                "created_at": f"{order['created_at']}T10:{14 + i}:0{2 * i + part}Z"}
               for i in range(2)]
    items = [{"name": item, "quantity": rng.randint(1, 3)} for item in rng.sample(_ITEMS, 2)]
    refund = {"order_id": order["order_id"], "charge_id": charges[1]["charge_id"],
              "amount": order["amount"], "reason": "duplicate charge"}
    steps: list[_Step] = [
        ("I'll look the customer up first.", "search_customers", {"query": name, "city": city},
         {"results": [{"customer_id": customer, "name": name, "city": city, "email": email}]}),
        ("", "get_customer", {"customer_id": customer},
         {"customer_id": customer, "name": name, "email": email, "city": city,
          "tier": rng.choice(["basic", "plus", "gold"]), "since": _date(rng, part)}),
        ("Now their recent orders.", "list_orders", {"customer_id": customer},
         {"orders": orders}),
        (f"Order {order['order_id']} matches; let me check its charges.", "get_order",
         {"order_id": order["order_id"]}, {**order, "items": items, "charges": charges}),
        ("The second charge is the duplicate.", "create_refund", refund,
         {"refund_id": _id(rng, "R", part), "status": "pending", **refund}),
        ("", "send_email", {"to": email, "subject": f"Your refund for order {order['order_id']}",
                            "body": f"Hi {first}, we refunded the duplicate charge of "
                                    f"{order['amount']} on order {order['order_id']}."},
         {"status": "sent", "message_id": _id(rng, "M", part)}),
    ]
    task = (f"{name} from {city} wrote in: they were charged twice for a recent order. Find "
            "the order, refund the duplicate charge and let them know by email.")
    return _SUPPORT_TOOLS, _replay(
        rng, "You are the support agent of an online shop. Use the tools; never guess ids.",
        task, steps, '"customer_id", "order_id", "charge_id", "refund_id", "amount", "status"')


_TRIP_TOOLS = [
    _fn("get_weather", "The day's forecast for a city.", city="string", date="string"),
    _fn("search_hotels", "Hotels in a city with free rooms.", city="string",
        check_in="string", nights="integer"),
    _fn("convert_currency", "Convert an amount.", amount="number", source="string",
        target="string"),
]
_SKIES = ["sunny", "partly cloudy", "overcast", "light rain", "showers", "thunderstorms"]


def _trip(rng: random.Random, part: int) -> tuple[list[dict], list[dict]]:
    """The same call for city after city: the next turn repeats its shape."""
    cities, date = rng.sample(_half(_CITIES, part), rng.randint(4, 6)), _date(rng, part)
    steps: list[_Step] = []
    for i, city in enumerate(cities):
        high = rng.randint(4, 33)
        steps.append(("I'll start with the first city." if i == 0 else "", "get_weather",
                      {"city": city, "date": date},
                      {"city": city, "date": date, "forecast": rng.choice(_SKIES),
                       "high_c": high, "low_c": high - rng.randint(3, 11),
                       "precipitation_mm": rng.choice([0, 0, 0.4, 2.5, 7.1]),
                       "wind_kph": rng.randint(3, 41), "station": _id(rng, "WS", part)}))
    task = (f"I'm choosing where to spend {date}: {', '.join(cities)}. Check the weather in "
            "each of them for that day, one call per city, then tell me where it's best.")
    return _TRIP_TOOLS, _replay(
        rng, "You are a travel assistant. Call the tools for facts; do not invent forecasts.",
        task, steps, '"date", "cities" (each with "city", "forecast", "high_c", "low_c", '
        '"precipitation_mm"), "best_city"')


_CODE_TOOLS = [
    _fn("search_code", "Files and lines that match a pattern.", pattern="string"),
    _fn("read_file", "A file's contents.", path="string"),
    _fn("run_tests", "Run pytest on a path.", path="string"),
    _fn("edit_file", "Replace text in a file.", path="string", old="string", new="string"),
]


def _code_agent(rng: random.Random, part: int) -> tuple[list[dict], list[dict]]:
    func, attr = rng.choice(_half(_NAMES, part)), rng.choice(["quantity", "weight", "tag"])
    code = rng.choice(_FUNCS).format(f=func, a=attr)
    path, test = f"src/shop/{func}.py", f"tests/test_{func}.py"
    first_line, body = code.split("\n", 1)
    arg = first_line[first_line.index("(") + 1:first_line.index(",")]
    fixed = f"{first_line}\n    if not {arg}:\n        raise ValueError(\"empty input\")\n{body}"
    failing = (f"FAILED {test}::test_{func}_rejects_empty - Failed: DID NOT RAISE "
               "<class 'ValueError'>")
    steps: list[_Step] = [
        ("Let me find the function first.", "search_code", {"pattern": f"def {func}("},
         {"matches": [{"path": path, "line": 1, "text": first_line},
                      {"path": test, "line": rng.randint(3, 40), "text": f"from shop.{func} "
                       f"import {func}"}]}),
        ("", "read_file", {"path": path}, {"path": path, "content": code}),
        ("Now the failing test.", "run_tests", {"path": test},
         {"passed": rng.randint(2, 9), "failed": 1, "output": failing}),
        ("It should raise ValueError on an empty input.", "edit_file",
         {"path": path, "old": code, "new": fixed}, {"path": path, "ok": True}),
        ("", "run_tests", {"path": test}, {"passed": rng.randint(3, 10), "failed": 0,
                                           "output": f"{test} passed"}),
    ]
    task = (f"{test} fails since release {_id(rng, 'v', part)}. Find the cause, fix it and "
            "make sure the tests pass.")
    return _CODE_TOOLS, _replay(
        rng, "You are a coding agent working in a Python repository. Use the tools to "
        "read, change and test code.", task, steps,
        '"file", "function", "change", "tests_before", "tests_after"')


_CONVERSATIONS = [_support, _trip, _code_agent]


def tool_conversations(n: int, seed: int) -> list[tuple[list[dict], list[dict]]]:
    """`n` (tools, messages) of the agent-replay set, OpenAI-style as a client sends them
    (assistant `tool_calls`, `role: "tool"` results), deterministic in `seed`."""
    rng = random.Random(f"agent-replay-{seed}")
    return [_CONVERSATIONS[i % len(_CONVERSATIONS)](rng, seed % 2) for i in range(n)]


def as_sent(tools: list[dict], messages: list[dict]) -> list[dict]:
    """`messages` as the server renders them for a chat template that takes no tools (the
    bundled SmolLM2's; chat_prompt.render_chat_text): tools listed in the system prompt,
    past calls in the default (hermes) format, results as user `<tool_response>` turns.
    engine.generate renders messages with the bare template, so the bench sends these."""
    from aioengine.chat_prompt import default_tool_prompt
    from aioengine.tool_parsers import DEFAULT_TOOL_PARSER, get_tool_parser

    parser = get_tool_parser(DEFAULT_TOOL_PARSER)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [parser.format_call(c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            out.append({"role": "assistant",
                        "content": "\n".join(([m["content"]] if m["content"] else []) + calls)})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    block = default_tool_prompt(tools, parser)  # messages[0] is always the system prompt
    return [{"role": "system", "content": f"{out[0]['content']}\n\n{block}"}, *out[1:]]


_MAKERS = {"extraction": _extraction, "sql": _sql, "code-edit": _code_edit}


def prompt_set(name: str, n: int, seed: int) -> list[str]:
    """`n` prompts of the single-turn set `name` (PROMPT_SETS), deterministic in `seed`."""
    if name not in _MAKERS:
        raise ValueError(f"{name!r} is not a single-turn set ({', '.join(PROMPT_SETS)}); "
                         "chat_set gives every set as chat messages")
    rng = random.Random(f"{name}-{seed}")
    return [_MAKERS[name](rng, seed % 2) for _ in range(n)]


def chat_set(name: str, n: int, seed: int) -> list[list[dict]]:
    """`n` chats (message lists) of the set `name` (AGENTIC_SETS), deterministic in `seed`:
    a single-turn set's prompts as one user message each."""
    if name == "agent-replay":
        return [as_sent(tools, messages) for tools, messages in tool_conversations(n, seed)]
    return [[{"role": "user", "content": p}] for p in prompt_set(name, n, seed)]
