"""More, and more varied, training prompts from text that installed packages ship (nothing
is downloaded): passages of Python's own documentation (the standard library's
`pydoc_data`) and its functions' docstrings, the countries, languages, currencies and
regions of `pycountry`, the job titles, colours and slogans of `faker`, and the jokes of
`pyjokes` (the last three are the `train` extra). Many prompts quote a passage, so their
answers copy from the input, as chat, summarising and code-explaining requests do.

`corpus_prompts` returns them deduplicated, shuffled by a seed, without any prompt that
mentions a held-out topic or is one of the benchmark's prompts.
"""
from __future__ import annotations

import importlib
import inspect
import random
import warnings
from collections.abc import Callable, Iterable

PASSAGE_TEMPLATES = (
    "Explain this passage from the Python documentation in simple terms:\n\n{text}",
    "Summarize the following text in two or three sentences:\n\n{text}",
    "Write a short Python example that illustrates this:\n\n{text}",
    "Write three quiz questions, with answers, about this text:\n\n{text}",
)
DOCSTRING_TEMPLATES = (
    "What does the Python function `{name}` do? Its documentation says:\n\n{text}",
    "Show how to use `{name}` in a small program. Its documentation:\n\n{text}",
)
COUNTRY_TEMPLATES = (
    "What is the capital of {name}, and what is it known for?",
    "Tell me about the culture and traditions of {name}.",
    "Plan a one-week trip to {name}.",
    "Write a short poem about {name}.",
    "What are three traditional dishes from {name}?",
)
LANGUAGE_TEMPLATES = (
    "Where is {name} spoken, and by how many people?",
    "How do you say 'hello' and 'thank you' in {name}?",
)
JOB_TEMPLATES = (
    "What does a {name} do on a typical day?",
    "Write a short cover letter for a {name} position.",
    "What skills and education does a {name} need?",
)
STDLIB_MODULES = (
    "builtins", "os", "os.path", "math", "itertools", "functools", "collections", "string",
    "re", "json", "random", "statistics", "datetime", "pathlib", "shutil", "textwrap",
    "heapq", "bisect", "operator", "time", "calendar", "csv", "urllib.parse", "hashlib",
    "base64", "fractions", "decimal", "difflib", "fnmatch", "glob", "secrets", "uuid",
    "zlib", "gzip", "tempfile", "typing", "dataclasses", "enum", "copy", "pprint",
)


def python_doc_passages(min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Prose paragraphs of the Python documentation's topics (pydoc_data, stdlib)."""
    from pydoc_data.topics import topics

    out = []
    for text in topics.values():
        for para in text.split("\n\n"):
            para = para.strip()
            if min_chars <= len(para) <= max_chars and not para.startswith(">>>"):
                out.append(para)
    return out


def stdlib_docstrings(min_chars: int = 80, max_chars: int = 1200) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the public functions and classes of STDLIB_MODULES."""
    out = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj):
                continue
            with warnings.catch_warnings():  # typing's deprecated aliases warn when read
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj) or ""
            if min_chars <= len(doc) <= max_chars:
                out.append((f"{module_name}.{name}", doc))
    return list(dict(out).items())


def _fill(templates: Iterable[str], names: Iterable[str]) -> list[str]:
    return [t.format(name=n) for n in names for t in templates]


def country_prompts() -> list[str]:
    import pycountry

    countries = sorted(c.name for c in pycountry.countries)
    languages = sorted(lang.name for lang in pycountry.languages
                       if hasattr(lang, "alpha_2") and lang.type == "L")
    currencies = sorted(c.name for c in pycountry.currencies)
    out = _fill(COUNTRY_TEMPLATES, countries) + _fill(LANGUAGE_TEMPLATES, languages)
    out += [f"What is the history of the {c}, and where is it used?" for c in currencies]
    by_code = {c.alpha_2: c.name for c in pycountry.countries}
    regions = sorted((s.name, s.type.lower(), by_code.get(s.country_code, ""))
                     for s in pycountry.subdivisions)
    rng = random.Random(0)
    for name, kind, country in rng.sample(regions, min(1000, len(regions))):
        out.append(f"Tell me about {name}, a {kind} of {country}.")
    return out


def faker_prompts(num_slogans: int = 500) -> list[str]:
    from faker import Faker
    from faker.providers.color.en_US import Provider as Colors
    from faker.providers.job.en_US import Provider as Jobs

    out = _fill(JOB_TEMPLATES, sorted(set(Jobs.jobs)))
    out += [f"Describe the colour {c} and suggest where to use it in a room."
            for c in sorted(Colors.all_colors)]
    fake = Faker("en_US")
    fake.seed_instance(0)
    for _ in range(num_slogans):
        out.append(f"Write a short product pitch for a company whose slogan is "
                   f"\"{fake.catch_phrase()}\".")
    return out


def joke_prompts() -> list[str]:
    import pyjokes

    return [f"Explain why this joke is funny: {j}" for j in pyjokes.get_jokes(category="all")]


def documentation_prompts() -> list[str]:
    out = [t.format(text=p) for p in python_doc_passages() for t in PASSAGE_TEMPLATES]
    out += [t.format(name=n, text=d) for n, d in stdlib_docstrings()
            for t in DOCSTRING_TEMPLATES]
    return out


SOURCES: dict[str, Callable[[], list[str]]] = {
    "python_docs": documentation_prompts, "countries": country_prompts,
    "faker": faker_prompts, "jokes": joke_prompts,
}


def corpus_prompts(excluded_topics: Iterable[str], excluded: Iterable[str],
                   seed: int = 0) -> dict[str, list[str]]:
    """Each source's prompts, deduplicated across sources and shuffled by `seed`, without
    those that mention an excluded topic (case-insensitive) or are in `excluded`."""
    topics = [t.lower() for t in excluded_topics]
    seen = set(excluded)
    out = {}
    for name, source in SOURCES.items():
        kept = []
        for prompt in source():
            if prompt in seen or any(t in prompt.lower() for t in topics):
                continue
            seen.add(prompt)
            kept.append(prompt)
        random.Random(f"{seed}:{name}").shuffle(kept)
        out[name] = kept
    return out
