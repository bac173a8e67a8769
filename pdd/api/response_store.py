"""Stored responses (`/v1/responses` with `store`), as vLLM keeps them: in memory, each
response's body for `GET /v1/responses/{id}`, and the conversation it ended (its input as
chat messages, then its output) for a later request's `previous_response_id`.

Bounded: at most `kept` responses, the oldest evicted first (a conversation that points at
an evicted response gets a 404 naming it, and can send its history in `input` instead).
Each API key's responses are its own: a key neither reads, continues nor deletes
another's (the namespace is the key's name; one namespace where the server has no keys).
The bound and what it holds are in `/pdd/stats` (`responses`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_KEPT = 1024  # responses a server keeps (each a body and its conversation: kilobytes)


@dataclass(frozen=True)
class Stored:
    body: dict[str, Any]  # the response object, as it was answered
    messages: list[dict[str, Any]]  # the conversation up to and with its output, as chat messages


class ResponseStore:
    """Responses by (namespace, id), in the order stored; the oldest go first past `kept`."""

    def __init__(self, kept: int = DEFAULT_KEPT) -> None:
        if kept < 0:
            raise ValueError("a response store keeps 0 or more responses")
        self.kept = kept
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self.evicted = 0

    def put(self, namespace: str, response_id: str, stored: Stored) -> None:
        if not self.kept:
            return
        self._items[(namespace, response_id)] = stored
        while len(self._items) > self.kept:
            self._items.popitem(last=False)
            self.evicted += 1

    def get(self, namespace: str, response_id: str) -> Stored | None:
        return self._items.get((namespace, response_id))

    def delete(self, namespace: str, response_id: str) -> bool:
        return self._items.pop((namespace, response_id), None) is not None

    def stats(self) -> dict[str, int]:
        return {"kept": self.kept, "stored": len(self._items), "evicted": self.evicted}
