"""Stop-string matching in time linear in the new text, whatever the number of stop strings.

One Aho-Corasick automaton over characters holds all of a request's stop strings; it is
built once per stop list (O(total stop characters)) and shared by every sample with that
list (the n samples of a request). Each sample keeps a `StopStringCursor`: the automaton
state after the text so far, fed only the characters each step adds.

A state stands for a string: the longest suffix of the text fed so far that is a prefix of
some stop string (Aho-Corasick's invariant). From it, precomputed per state:
- `match`: the longest stop string that is a suffix of the state's string, so of the text.
  The first position with a match is where the earliest-ending stop string ends; the
  longest one ending there is the one that starts earliest (the tie-break).
- `hold`: the length of the longest suffix of the text that is a PROPER prefix of some stop
  string, the text that may still become (part of) a stop string. It is the state's depth
  when the state has a child (a longer stop string continues it), else that of its failure
  state: a leaf is a whole stop string and continues none.

Transitions live in one dict keyed `state << 21 | ord(char)` (code points are < 2**21):
about half the memory of a dict per state. Walking failure links makes one character cost
O(1) amortized over the text fed (each link followed shortens the state's depth, and each
character adds at most one to it).
"""
from __future__ import annotations

import weakref
from array import array
from collections.abc import Sequence

_CHAR_BITS = 21


class StopStringMatcher:
    """The automaton of one stop list (immutable once built; share it)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops: tuple[str, ...] = tuple(stops)
        self.edges: dict[int, int] = {}
        self.fail = array("i", [0])
        self.depth = array("i", [0])
        self.match = array("i", [-1])  # index into stops, -1: no stop string ends here
        self.hold = array("i", [0])
        self._build()

    @property
    def num_states(self) -> int:
        return len(self.depth)

    def _build(self) -> None:
        """Level by level (all stop strings' d-th characters, then their (d+1)-th, ...), so
        states are numbered in breadth-first order and every failure target (shallower)
        is complete when a state is created: one pass, O(total characters)."""
        edges, fail, depth, match = self.edges, self.fail, self.depth, self.match
        has_child = bytearray(1)
        node = [0] * len(self.stops)  # each stop string's state after its first d chars
        active = list(range(len(self.stops)))
        d = 0
        while active:
            still = []
            for i in active:
                s = self.stops[i]
                parent, c = node[i], ord(s[d])
                key = (parent << _CHAR_BITS) | c
                v = edges.get(key)
                if v is None:
                    v = len(depth)
                    # Failure target: the longest proper suffix of (parent's string + c)
                    # that is a prefix of some stop string (all shallower states exist).
                    f = fail[parent] if parent else -1
                    while f >= 0:
                        t = edges.get((f << _CHAR_BITS) | c)
                        if t is not None:
                            break
                        f = fail[f] if f else -1
                    fail.append(t if f >= 0 else 0)
                    edges[key] = v
                    depth.append(d + 1)
                    match.append(-1)
                    has_child.append(0)
                    has_child[parent] = 1
                node[i] = v
                if len(s) == d + 1:
                    if match[v] < 0:  # duplicates: the first one (the same string)
                        match[v] = i
                else:
                    still.append(i)
            active = still
            d += 1
        hold = self.hold
        for v in range(1, len(depth)):  # breadth-first: fail[v] < v is already final
            if match[v] < 0:
                match[v] = match[fail[v]]
            hold.append(depth[v] if has_child[v] else hold[fail[v]])


class StopStringCursor:
    """One sample's position in a StopStringMatcher: feed it the text as it grows."""

    __slots__ = ("matcher", "state")

    def __init__(self, matcher: StopStringMatcher) -> None:
        self.matcher = matcher
        self.state = 0

    def feed(self, text: str, start: int, search_from: int) -> tuple[str, int] | None:
        """Advances over text[start:] (the characters added since the last feed: every
        character is fed exactly once, in order). Returns the stop string that ends first
        after character `search_from` of `text` (on a tie, the longest) and its end; the
        cursor then stops there. None if none ends in the new characters."""
        m = self.matcher
        edges, fail, match = m.edges, m.fail, m.match
        s = self.state
        for i in range(start, len(text)):
            c = ord(text[i])
            while True:
                nxt = edges.get((s << _CHAR_BITS) | c)
                if nxt is not None:
                    s = nxt
                    break
                if s == 0:
                    break
                s = fail[s]
            if match[s] >= 0 and i >= search_from:  # ends at i + 1 > search_from
                self.state = s
                return m.stops[match[s]], i + 1
        self.state = s
        return None

    @property
    def partial_len(self) -> int:
        """Length of the longest suffix of the text fed that is a proper prefix of a stop
        string: the text to hold back."""
        return self.matcher.hold[self.state]


# Samples with the same stop list (the n samples of a request) share one automaton while
# any of them is alive; the key's hash is the strings' (cached by Python), so a lookup
# costs far less than a build.
_MATCHERS: weakref.WeakValueDictionary[tuple[str, ...], StopStringMatcher] = \
    weakref.WeakValueDictionary()


def stop_string_matcher(stops: Sequence[str]) -> StopStringMatcher:
    """The automaton for `stops`, built once while any sample holds it."""
    key = tuple(stops)
    matcher = _MATCHERS.get(key)
    if matcher is None:
        matcher = StopStringMatcher(key)
        _MATCHERS[key] = matcher
    return matcher
