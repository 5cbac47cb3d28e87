"""What every pure state machine of the library shares.  A machine knows no reactor,
transport or Deferred: each ``handle*`` method takes an event and its time and returns
the actions to do, in order, for a driver to perform (or a test to read back)."""

from __future__ import annotations

from typing import Any

import attrs


def action_type(module: str, name: str, *fields: str, frozen: bool = False, **defaults: Any) -> Any:
    """An action (or, *frozen*, a hashable message) class of *module* with *fields*, then
    those with *defaults*: slotted, not frozen by default (that is slow on a request's path)."""
    made = {**{field: attrs.field() for field in fields},
            **{field: attrs.field(default=value) for field, value in defaults.items()}}
    kind = attrs.make_class(name, made, slots=True, weakref_slot=False, frozen=frozen)
    kind.__module__ = module
    return kind


def machine_view(name: str, doc: str) -> Any:
    """A driver's read-only property: its ``machine``'s attribute *name*."""
    return property(lambda self: getattr(self.machine, name), doc=doc)


class Machine:
    """The current event's time and the outbox of actions."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now  # the time of the event being handled (or the last one)
        self._outbox: list[Any] = []

    def _emit(self, action: Any) -> None:
        self._outbox.append(action)

    def actionsSoFar(self) -> list[Any]:
        """After a handler raised: the actions it decided before, which its driver still performs."""
        return self._drain()

    def _drain(self) -> list[Any]:
        """The actions collected since the last call, in order."""
        actions, self._outbox = self._outbox, []
        return actions
