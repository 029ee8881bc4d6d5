"""The stop-string automaton against the brute-force definition of what it computes.

The oracle below is the matching the detokenizer did before (every stop string searched in
the text every step): the earliest-ending stop string whose first occurrence ends after
`search_from` (a tie: the one starting earlier), and the longest suffix of the text that is
a proper prefix of a stop string.
"""
from __future__ import annotations

import random
import time

import pytest

from aioengine.stop_strings import StopStringCursor, StopStringMatcher, stop_string_matcher


def find_stop_string(text: str, stop: list[str], search_from: int) -> tuple[str, int] | None:
    """(stop string, end) of the stop string ending first after `search_from`; None if none."""
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        start = text.find(s, max(0, search_from - len(s) + 1))
        if start < 0:
            continue
        cand = (start + len(s), start, s)
        if best is None or cand[:2] < best[:2]:
            best = cand
    return None if best is None else (best[2], best[0])


def partial_stop_len(text: str, stop: list[str]) -> int:
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


def feed_in_chunks(stops: list[str], text: str, cuts: list[int], search_from: int
                   ) -> tuple[tuple[str, int] | None, list[tuple[int, int]]]:
    """Feeds text[:c] for each cut c in turn; returns the match (if any) and, for every
    prefix fed before it, (prefix length, partial_len)."""
    cursor = StopStringCursor(StopStringMatcher(stops))
    holds, fed = [], 0
    for c in [*cuts, len(text)]:
        if c <= fed:
            continue
        found = cursor.feed(text[:c], fed, search_from)
        if found is not None:
            return found, holds
        fed = c
        holds.append((c, cursor.partial_len))
    return None, holds


@pytest.mark.parametrize("alphabet", ["ab", "abc", "aé世😀"])
def test_matches_brute_force_on_random_texts(alphabet):
    """Random small alphabets make overlaps, shared prefixes, stop strings inside others
    and duplicates common; every prefix's hold-back and the match are compared."""
    rng = random.Random(1234)
    for _ in range(1500):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 8))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        search_from = rng.choice([0, 0, rng.randint(0, len(text))])
        found, holds = feed_in_chunks(stops, text, cuts, search_from)
        expected = find_stop_string(text, stops, search_from)
        assert found == expected, (stops, text, search_from)
        for end, hold in holds:
            assert hold == partial_stop_len(text[:end], stops), (stops, text[:end])


def test_brute_force_cases():
    """The cases the detokenizer's own tests pinned for the old functions."""
    def find(text, stops, search_from=0):
        return feed_in_chunks(stops, text, [], search_from)[0]

    assert find("abcabc", ["c"]) == ("c", 3)
    assert find("abcabc", ["c"], 3) == ("c", 6)  # must end after char 3
    assert find("abcabc", ["bca", "ca"]) == ("bca", 4)  # same end: the longer one
    assert find("abcabc", ["x"]) is None
    assert find("hello world", ["world", "lo w"]) == ("lo w", 7)  # earliest end wins

    def hold(text, stops):
        return feed_in_chunks(stops, text, [], len(text))[1][-1][1] if text else 0

    assert hold("the EN", ["END"]) == 2
    assert hold("the END", ["END"]) == 0  # a full match is not a proper prefix
    assert hold("xab", ["abc", "bx", "b"]) == 2
    assert hold("a", ["aaa"]) == 1
    assert hold("ab", ["ab", "b"]) == 0  # both leaves: nothing continues them
    assert hold("ab", ["ab", "b", "bc"]) == 1


def test_one_character_at_a_time_and_search_from_inside_a_stop():
    """A stop string that starts before search_from but ends after it counts (min_tokens:
    only the end must be outside the first tokens' text)."""
    cursor = StopStringCursor(StopStringMatcher(["abc"]))
    text = ""
    for ch, expected in zip("xab", [None, None, None]):
        text += ch
        assert cursor.feed(text, len(text) - 1, 3) is expected
    text += "c"
    assert cursor.feed(text, 3, 3) == ("abc", 4)


def test_rejects_empty_stop_string():
    with pytest.raises(ValueError):
        StopStringMatcher(["a", ""])


def test_samples_share_one_automaton():
    stops = [f"stop {i}" for i in range(100)]
    a = stop_string_matcher(stops)
    assert stop_string_matcher(list(stops)) is a
    assert stop_string_matcher(stops[:50]) is not a


def test_cost_does_not_grow_with_the_number_of_stop_strings():
    """Feeding text costs the same with 20,000 stop strings as with 20 (both never
    matching, sharing prefixes with the text), and building is linear in their size."""
    rng = random.Random(7)
    text = "".join(rng.choices("abcd", k=4000))

    def feed_time(stops: list[str]) -> float:
        cursor = StopStringCursor(StopStringMatcher(stops))
        start = time.perf_counter()
        for i in range(0, len(text), 4):
            cursor.feed(text[:i + 4], i, 0)
        return time.perf_counter() - start

    def stops_of(count: int) -> list[str]:
        return ["".join(rng.choices("abcd", k=rng.randint(5, 9))) + "x" for _ in range(count)]

    few, many = stops_of(20), stops_of(20_000)
    best_few = min(feed_time(few) for _ in range(3))
    best_many = min(feed_time(many) for _ in range(3))
    # The brute force would be ~1000x slower; allow for cache effects and a loaded machine.
    assert best_many < 4 * best_few, (best_few, best_many)


def test_quadratic_holdback_case_is_linear():
    """1,000 stop strings of up to 2,100 characters that share a prefix with the text: the
    brute-force hold-back compares each against every suffix length each step."""
    rng = random.Random(3)
    text = "".join(rng.choices("ab ", k=2000))
    # Ascending shared prefixes: the brute force meets the longest (the whole text) last.
    stops = [text[:2 * i + 2] + "".join(rng.choices("#~", k=100)) for i in range(1000)]
    start = time.perf_counter()
    matcher = StopStringMatcher(stops)
    build_s = time.perf_counter() - start
    cursor = StopStringCursor(matcher)
    start = time.perf_counter()
    for i in range(0, len(text), 5):
        assert cursor.feed(text[:i + 5], i, 0) is None
        assert cursor.partial_len == i + 5  # everything so far may still become a stop
    feed_s = time.perf_counter() - start
    assert matcher.num_states <= sum(map(len, stops)) + 1
    assert build_s < 5 and feed_s < 0.5, (build_s, feed_s)
