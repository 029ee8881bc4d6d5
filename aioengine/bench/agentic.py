"""Agent-shaped prompt sets for `aioengine bench spec --prompts ...`: the same request shape
over and over with small changes, as agents send them, where suffix decoding drafts from
earlier requests' outputs.

- `extraction`: a fixed-shape JSON extraction (the same keys every time, new values).
- `sql`: a SQL query over one schema with a changing condition.
- `code-edit`: rewrite a given function with a small change (the answer copies the code).

Each set is generated from a seed: `prompt_set(name, n, seed)`. The bench warms up on one
seed's prompts and times another's; an odd and an even seed draw their people, cities,
dates and function names from disjoint halves of the lists, so a timed prompt is never a
warm-up one (the shapes and the rest of the wording are shared, as in agent traffic).
"""
from __future__ import annotations

import random

AGENTIC_SETS = ("extraction", "sql", "code-edit")
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


_MAKERS = {"extraction": _extraction, "sql": _sql, "code-edit": _code_edit}


def prompt_set(name: str, n: int, seed: int) -> list[str]:
    """`n` prompts of the set `name` (AGENTIC_SETS), deterministic in `seed`."""
    rng = random.Random(f"{name}-{seed}")
    return [_MAKERS[name](rng, seed % 2) for _ in range(n)]
