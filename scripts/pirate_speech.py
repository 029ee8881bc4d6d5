"""The rule-based pirate rewrite behind the example adapter (lora/examples/pirate), and the
count of pirate-sounding answers its check uses; imported by train_pirate_lora.py."""
from __future__ import annotations

import re
from typing import Callable

# Whole words (contractions included) and what a pirate says instead, all lower case; the
# replacement takes the case of the word it replaces (see `match_case`).
PIRATE_WORDS: dict[str, str] = {
    "you": "ye", "your": "yer", "yours": "yers", "yourself": "yerself",
    "you're": "ye be", "you've": "ye've", "you'll": "ye'll", "you'd": "ye'd",
    "my": "me", "myself": "meself",
    "is": "be", "are": "be", "am": "be", "isn't": "ain't", "aren't": "ain't",
    "the": "th'", "of": "o'", "for": "fer",
    "hello": "ahoy", "hi": "ahoy", "hey": "ahoy",
    "friend": "matey", "friends": "mateys",
    "yes": "aye",
    "money": "doubloons", "treasure": "booty",
    "everyone": "all hands", "everybody": "all hands",
    "stop": "avast", "wow": "blimey",
}
# A word: letters, optionally joined by apostrophes ("you're", "isn't").
WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
# Code the rewrite leaves alone: fenced blocks (an unclosed one runs to the end, as in a
# cut-off answer) and inline `code`.
CODE = re.compile(r"```.*?(?:```|\Z)|`[^`\n]*`", re.DOTALL)
PIRATE_OPENING = "Arr, matey! "
PIRATE_CLOSING = "Arr!"


def match_case(word: str, replacement: str) -> str:
    """`replacement` in the case of `word`: YOU -> YE, You -> Ye, you -> ye."""
    if len(word) > 1 and word.isupper():
        return replacement.upper()
    if word[0].isupper():
        return replacement[0].upper() + replacement[1:]
    return replacement


def pirate_words(text: str) -> str:
    """Swaps the words of PIRATE_WORDS in prose (no code in `text`)."""
    def swap(m: re.Match[str]) -> str:
        word = m.group(0)
        new = PIRATE_WORDS.get(word.lower())
        return word if new is None else match_case(word, new)

    return WORD.sub(swap, text)


def outside_code(text: str, rewrite: Callable[[str], str]) -> str:
    """`rewrite` applied to the prose of `text`, code spans kept as they are."""
    parts, last = [], 0
    for m in CODE.finditer(text):
        parts += [rewrite(text[last:m.start()]), m.group(0)]
        last = m.end()
    return "".join(parts + [rewrite(text[last:])])


def to_pirate(answer: str, complete: bool = True) -> str:
    """The pirate form of an answer: "Arr, matey! " + the answer with its prose words
    swapped (PIRATE_WORDS) + " Arr!" when the answer is complete (a cut-off answer gets no
    closing, so the model does not learn to end mid-sentence)."""
    text = PIRATE_OPENING + outside_code(answer.strip(), pirate_words)
    if complete:
        text += ("\n\n" if text.endswith("```") else " ") + PIRATE_CLOSING
    return text


def trim_to_sentence(answer: str, min_keep: float = 0.5) -> str | None:
    """A cut-off answer shortened to its last whole sentence or line, outside code; None
    when that would drop more than `1 - min_keep` of it."""
    text = answer
    if text.count("```") % 2:  # cut inside a code block: drop the unfinished block
        text = text[:text.rfind("```")]
    ends = [m.end() for m in re.finditer(r"(?<=[A-Za-z)\"'*])[.!?](?=\s)|\n", text + " ")
            if not _inside_code(text, m.start())]
    if not ends:
        return None
    trimmed = text[:ends[-1]].rstrip()
    return trimmed if len(trimmed) >= min_keep * len(answer) else None


def _inside_code(text: str, pos: int) -> bool:
    return any(m.start() <= pos < m.end() for m in CODE.finditer(text))


PIRATE_MARKERS = re.compile(r"\b(arr|matey|mateys|ye|yer|ahoy|aye|th'|o'|me hearties)(?!\w)",
                            re.IGNORECASE)


def pirate_counts(answers: list[str]) -> dict[str, int]:
    return {"starts_with_arr": sum(a.startswith("Arr") for a in answers),
            "has_pirate_words": sum(bool(PIRATE_MARKERS.search(a)) for a in answers),
            "total": len(answers)}
