"""The trainer's prompts, written here (nothing is downloaded): the benchmark's 202 chat
prompts, templated tasks (explain, summarise, list, rewrite, compare, code, ...) over
topics, and requests the target model writes itself when asked for varied user requests.

`split_prompts` keeps a held-out set that training never sees: every 5th shipped prompt and
every templated prompt over the held-out topics (HELD_OUT_TOPICS)."""
from __future__ import annotations

import json
import random
from importlib import resources

TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "machine learning",
    "climate change", "the immune system", "volcanoes", "the stock market", "inflation",
    "the water cycle", "plate tectonics", "DNA", "the Roman Empire", "electric cars",
    "solar panels", "the internet", "blockchain", "vaccines", "sleep", "meditation",
    "the human brain", "gravity", "the Moon landing", "jazz music", "the Renaissance",
    "coffee", "honeybees", "rainforests", "the printing press", "quantum computing",
    "recycling", "the Olympic Games", "chess", "compound interest", "nutrition",
    "the Great Wall of China", "earthquakes", "antibiotics", "social media", "democracy",
    "the theory of evolution", "magnets", "the periodic table", "tea", "bicycles",
    "hurricanes", "the ocean tides", "the Industrial Revolution", "cloud computing",
    "3D printing", "the Egyptian pyramids", "ancient Greece", "origami", "gardening",
    "public speaking", "time management", "remote work", "electricity", "the Sun",
    "dinosaurs", "penguins", "glaciers", "nuclear energy", "wind turbines", "bread baking",
    "the Silk Road", "Shakespeare", "the metric system", "credit scores", "password security",
    "open source software", "video games", "the human heart", "friendship", "minimalism",
    "running", "yoga", "bird migration", "coral reefs", "deserts", "the Milky Way",
    "the Cold War", "paper money", "robots", "artificial intelligence", "language learning",
)
HELD_OUT_TOPICS = ("octopuses", "the Eiffel Tower", "lightning", "mushrooms", "submarines",
                   "libraries")
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "finds the largest element of a list", "merges two sorted lists",
    "computes the Fibonacci numbers up to n", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "checks whether a string is a palindrome",
    "sorts a list of dictionaries by a key", "reads a CSV file and prints each row",
    "computes the average of a list of numbers", "flattens a nested list",
    "counts the vowels in a string", "returns the factorial of n",
    "finds the second smallest number in a list", "validates an email address",
    "capitalizes every word in a sentence", "implements binary search",
    "computes the greatest common divisor of two numbers", "generates a random password",
    "transposes a matrix", "groups words by their first letter",
    "returns the n most common words in a text", "implements a stack class",
)
LANGUAGES = ("Python", "JavaScript", "Rust", "Go", "Java", "C")
SENTENCES = (
    "The meeting was moved to Thursday because the manager was sick.",
    "Our team finished the project two weeks early and under budget.",
    "The weather was so bad that all the flights were cancelled.",
    "I think we should try the new restaurant on Main Street tonight.",
    "The software update fixed the bug but made the app slower.",
    "She practiced the piano every day and finally won the competition.",
    "The city plans to build a new park next to the river.",
    "Please send me the report before the end of the day.",
    "Prices went up again, so many families are spending less.",
    "The library will be closed on Monday for repairs.",
    "He forgot his keys, so he had to wait outside for an hour.",
    "The new phone has a bigger screen and a better camera.",
)
ACTIVITIES = (
    "learning to cook", "saving money", "staying focused while studying", "writing a resume",
    "traveling on a budget", "starting a vegetable garden", "learning a new language",
    "getting better sleep", "running a first marathon", "keeping a houseplant alive",
    "preparing for a job interview", "organizing a small office", "taking better photos",
    "learning to program", "making new friends in a new city", "reducing screen time",
)
TEMPLATES = (
    "Explain {topic} in simple terms.",
    "Explain {topic} to a ten-year-old.",
    "Write a short summary of the most important facts about {topic}.",
    "List five interesting facts about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a short paragraph about the history of {topic}.",
    "Give me three questions and answers for a quiz about {topic}.",
    "Write a haiku about {topic}.",
    "What is a common misconception about {topic}?",
    "Describe {topic} in three sentences.",
    "Write a short blog post introduction about {topic}.",
    "Why is {topic} important?",
)
TASK_TEMPLATES = (
    ("Write a {lang} function that {task}.", "code"),
    ("Rewrite this sentence to sound more formal: {sentence}", "sentence"),
    ("Summarize this in a few words: {sentence}", "sentence"),
    ("Translate this sentence into French: {sentence}", "sentence"),
    ("Give me five tips for {activity}.", "activity"),
    ("Make a step-by-step plan for {activity}.", "activity"),
)
# What the target is asked, to write varied user requests of its own.
SELF_PROMPT = ("Write one question or request that a user might send to an AI assistant "
               "about {topic}. Reply with the request only.")


def shipped_prompts() -> list[str]:
    """The benchmark's chat prompts (aioengine/bench/data/prompts.jsonl)."""
    text = resources.files("aioengine.bench").joinpath("data/prompts.jsonl").read_text()
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def templated_prompts(topics: tuple[str, ...] = TOPICS) -> list[str]:
    out = [t.format(topic=topic) for topic in topics for t in TEMPLATES]
    for template, kind in TASK_TEMPLATES:
        if kind == "code":
            out += [template.format(lang=lang, task=task) for task in CODE_TASKS
                    for lang in LANGUAGES]
        elif kind == "sentence":
            out += [template.format(sentence=s) for s in SENTENCES]
        else:
            out += [template.format(activity=a) for a in ACTIVITIES]
    return out


def self_prompt_requests(topics: tuple[str, ...] = TOPICS) -> list[str]:
    """What the target is asked to produce its own user requests (one per topic)."""
    return [SELF_PROMPT.format(topic=t) for t in topics]


def clean_self_prompt(text: str) -> str | None:
    """A model-written request, trimmed; None when it is unusable (empty, too long)."""
    text = text.strip().strip('"').strip()
    if text.lower().startswith(("request:", "question:")):
        text = text.split(":", 1)[1].strip()
    return text if 10 <= len(text) <= 400 else None


def split_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts) before the model-written ones are added: every
    5th shipped prompt and the held-out topics' templated prompts are held out. Training
    prompts are shuffled with `seed`."""
    shipped = shipped_prompts()
    held_out = shipped[::5] + [t.format(topic=topic) for topic in HELD_OUT_TOPICS
                               for t in TEMPLATES[:4]]
    train = [p for i, p in enumerate(shipped) if i % 5] + templated_prompts()
    held = set(held_out)
    train = [p for p in dict.fromkeys(train) if p not in held]
    random.Random(seed).shuffle(train)
    return train, held_out
