"""The Responses API's store of responses (serving_responses.py uses it).

Stored responses live in an in-memory store bounded in entries (--max-stored-responses) and
in bytes (--max-stored-response-bytes), each response counted as the size of its JSON. The
store's rules (`ResponsesStore`):

- Finished responses are dropped least recently stored first (a response is stored anew
  when it ends: its result is what a client comes back for).
- A background response is never dropped while it runs, as with OpenAI, whose store never
  drops one: its client can always fetch and cancel it. A new background response that does
  not fit beside the running ones is refused: 429 while they fill the store, 400 if it could
  never fit (a store of 0 entries, or its request alone over the byte budget).
- A foreground response that does not fit (the running background ones fill the store, or
  it alone is over the byte budget) is answered all the same, unstored: its `store` reads
  false. A response counts as its request while it runs and with its output once it ends;
  if it then no longer fits beside the running ones, it is dropped, and reads store: false
  (a background one too: only with a byte budget smaller than a few responses).

So the store holds at most --max-stored-response-bytes of JSON, plus the outputs of the
responses still running. A stored response keeps its echoed settings, conversation and output
as JSON bytes, a few objects whatever their size: the garbage collector never walks them.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from aioengine.server.protocol import ApiError
from aioengine.server.responses_items import ResponseState

# What a stored response costs besides its JSON (its id, state and their objects).
ENTRY_OVERHEAD_BYTES = 1024


@dataclass
class StoredResponse:
    state: ResponseState
    # The conversation without instructions: while the response runs, the previous
    # response's and the input as messages; once it has ended ([] here), with the output
    # too, as JSON in `messages_json`.
    messages: list[dict[str, Any]]
    background: bool = False
    request_bytes: int = 0  # the JSON of its echoed settings (`_echo`)
    task: asyncio.Task | None = None  # a background response while it runs
    messages_json: bytes | None = None
    ended: bool = False
    nbytes: int = 0  # as the store counts it

    @property
    def pinned(self) -> bool:
        """A background response that still runs: the store never drops it."""
        return self.background and not self.ended

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation, output included, of a response that has ended."""
        assert self.messages_json is not None
        return orjson.loads(self.messages_json)


class ResponsesStore:
    """Responses by id, at most `max_entries` of them and `max_bytes` in all (each counted
    as `StoredResponse.nbytes`). Finished responses are dropped least recently stored
    first; running background ones never (`pinned`). Invariant: after every `admit` and
    `update`, both bounds hold, each response counted as the store last saw it."""

    def __init__(self, max_entries: int, max_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, nbytes: int) -> bool:
        """Whether a response of `nbytes` fits an empty store."""
        return self.max_entries > 0 and nbytes <= self.max_bytes

    def admit(self, stored: StoredResponse, nbytes: int) -> bool:
        """Stores a new response counted as `nbytes`, dropping finished ones to make room;
        False, with nothing dropped, if the running background ones leave no room."""
        pinned = [s for s in self._entries.values() if s.pinned]
        if (len(pinned) >= self.max_entries
                or sum(s.nbytes for s in pinned) + nbytes > self.max_bytes):
            return False
        stored.nbytes = nbytes
        self._entries[stored.state.id] = stored
        self.nbytes += nbytes
        self._evict()
        return True

    def update(self, stored: StoredResponse, nbytes: int) -> bool:
        """A stored response has ended: it is counted as `nbytes` now and is the most
        recently stored; finished ones are dropped until the bounds hold, itself last.
        False if it is not (or no longer) stored."""
        if self._entries.get(stored.state.id) is not stored:
            return False
        self.nbytes += nbytes - stored.nbytes
        stored.nbytes = nbytes
        self._entries.move_to_end(stored.state.id)
        self._evict()
        return stored.state.id in self._entries

    def _within(self) -> bool:
        return len(self._entries) <= self.max_entries and self.nbytes <= self.max_bytes

    def _evict(self) -> None:
        if self._within():
            return
        for response_id, stored in list(self._entries.items()):  # least recently stored first
            if stored.pinned:
                continue
            del self._entries[response_id]
            self.nbytes -= stored.nbytes
            if self._within():
                return

    def get(self, response_id: str) -> StoredResponse:
        stored = self._entries.get(response_id)
        if stored is None:
            raise ApiError(404, f"Response with id {response_id!r:.80} not found.",
                           "response_id", type="not_found_error")
        return stored
