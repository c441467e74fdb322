"""Session ids a caller chooses, and the ids released before they existed.

The orchestrator names each session it creates (``PrefillRequest.session_id``,
``CreateDraftSessionRequest.session_id``) so that it can release it after a
create call that failed in any way: a cancelled or expired call may still
have created the session on the replica. That Release can reach the replica
before the create has finished, or before it began; the replica then keeps
the id as a *tombstone* for a while, and a create that ends with a
tombstoned id frees the session at once (docs/reliability.md, "Sessions lost
to a cancelled or expired call").

Plain Python, no locks of its own: each session table calls it under its
own lock.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from typing import Callable

from specdec.errors import InvalidArgument

MAX_SESSION_ID_LEN = 64
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,%d}" % MAX_SESSION_ID_LEN)


def new_session_id() -> str:
    """A fresh id, as both the orchestrator and the services pick them."""
    return uuid.uuid4().hex


def check_session_id(session_id: str) -> None:
    """INVALID_ARGUMENT unless ``session_id`` is 1-64 characters of [A-Za-z0-9_-]."""
    if not _SESSION_ID.fullmatch(session_id):
        shown = session_id if len(session_id) <= MAX_SESSION_ID_LEN else session_id[:MAX_SESSION_ID_LEN] + "..."
        raise InvalidArgument(
            f"session_id must be 1-{MAX_SESSION_ID_LEN} characters of [A-Za-z0-9_-], got {shown!r} "
            f"({len(session_id)} characters)"
        )


class Tombstones:
    """A bounded set of ids that expire ``ttl_s`` after they were added: the
    ids released before a session held them. At most ``max_ids`` are kept
    (the oldest go first): a flood of releases of unknown ids costs bounded
    memory, at worst forgetting a tombstone early, which leaves that one
    session to the idle TTL as before."""

    def __init__(self, ttl_s: float = 60.0, max_ids: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._clock = clock
        self._ids: OrderedDict[str, float] = OrderedDict()  # id -> expiry, oldest first

    def __len__(self) -> int:
        self._expire(self._clock())
        return len(self._ids)

    def __contains__(self, session_id: object) -> bool:
        self._expire(self._clock())
        return session_id in self._ids

    def add(self, session_id: str) -> None:
        """Remembers ``session_id``; an id no create could use (see
        :func:`check_session_id`) is not kept, so no Release stores more
        than 64 characters."""
        if not _SESSION_ID.fullmatch(session_id):
            return
        now = self._clock()
        self._expire(now)
        self._ids.pop(session_id, None)
        self._ids[session_id] = now + self.ttl_s
        while len(self._ids) > self.max_ids:
            self._ids.popitem(last=False)

    def _expire(self, now: float) -> None:
        while self._ids:
            sid, until = next(iter(self._ids.items()))
            if until > now:
                return
            del self._ids[sid]
