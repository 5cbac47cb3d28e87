"""What every pure state machine of the library shares.

A machine knows no reactor, no transport and no Deferred.  Each of its
``handle*`` methods takes an event and the time it happens, sets :attr:`now`,
decides, and returns the actions it wants done, in order (small objects of
the machine's own module, collected in its outbox with :meth:`_emit`).  A
driver feeds it events from real transports and timers and performs the
actions; a test feeds it a list of events and reads the actions back.
"""

from __future__ import annotations

from typing import Any

import attrs

#: The decorator of action classes: plain slotted attrs classes (frozen ones
#: set every field through ``object.__setattr__``, slow on a request's path).
action_class = attrs.define(slots=True, weakref_slot=False)


class Machine:
    """The current event's time and the outbox of actions."""

    def __init__(self, now: float = 0.0) -> None:
        #: the time of the event being handled (the last one, between events)
        self.now = now
        self._outbox: list[Any] = []

    def seconds(self) -> float:
        """The machine's clock (what its log throttle reads): the current
        event's time."""
        return self.now

    def _emit(self, action: Any) -> None:
        self._outbox.append(action)

    def _drain(self) -> list[Any]:
        """The actions collected since the last call, in order."""
        actions, self._outbox = self._outbox, []
        return actions
