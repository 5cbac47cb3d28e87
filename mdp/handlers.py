"""Built-in worker handlers and loading a handler from ``module:callable``."""

from __future__ import annotations

import contextvars
import os
import pkgutil
import sys
from typing import Any, Callable, Optional

from twisted.internet import defer

from mdp.errors import MDPError
from mdp.messages import as_frame

#: the types of a plain reply, told from a generator without an isinstance check
PLAIN_REPLIES = frozenset((bytes, list, tuple, str, type(None)))


def reply_frames(value: Any) -> list[bytes]:
    """A handler's reply (``bytes``, ``str``, or a list or tuple of them) as a
    new, non-empty list of ``bytes``; ``None`` or ``[]`` is one empty frame.
    Anything else is a ``TypeError`` (the worker answers 500)."""
    if value is None:
        return [b""]
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return [as_frame(value, "a reply")]
    if not isinstance(value, (list, tuple)):
        # a dict, a set or a Future would iterate into a wrong reply
        raise TypeError(f"a reply is bytes, str, None or a list of them, not "
                        f"{type(value).__name__}")
    return [item if type(item) is bytes else as_frame(item, "a reply frame")
            for item in value] or [b""]


def call_handler(handler: Callable[[list[bytes]], Any], frames: list[bytes]) -> defer.Deferred:
    """Run a non-streaming handler (value, Deferred or coroutine); a Deferred of its frames."""
    return defer.maybeDeferred(handler, frames).addCallback(reply_frames)  # (a coroutine too)


def echo(request: list[bytes]) -> list[bytes]:
    """Reply with the request frames unchanged."""
    return request


BUILTIN: dict[str, Callable[[list[bytes]], Any]] = {"echo": echo}


def load_handler(spec: str) -> Callable[[list[bytes]], Any]:
    """Resolve ``echo`` or ``package.module:callable``, looking in the current directory first
    (as ``python -m`` does); any failure is an :class:`~mdp.errors.MDPError` with a one-line message."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise MDPError(
            f"handler {spec!r} is neither a built-in ({', '.join(BUILTIN)}) "
            "nor 'module:callable'"
        )
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        target = pkgutil.resolve_name(spec)
    except Exception as e:  # whatever the module's import raised, or no such attribute
        raise MDPError(f"cannot load handler {spec!r}: {_one_line(e)}") from e
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    if not callable(target):
        raise MDPError(f"handler {spec!r} is not callable (it is a {type(target).__name__})")
    return target


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, (ImportError, SyntaxError)):
        return text
    return f"{type(error).__name__}: {text}"


class _Serving:
    """The request a handler serves, as :func:`current_deadline` and :func:`cancelled` read it."""

    __slots__ = ("job", "clock")

    def __init__(self, job: Any, clock: Callable[[], float]) -> None:
        self.job = job  # (mdp.majordomo.worker._Job: its deadline, and why it was given up)
        self.clock = clock


_serving: contextvars.ContextVar[Optional[_Serving]] = contextvars.ContextVar("mdp_serving", default=None)


def serving(job: Any, clock: Callable[[], float]) -> contextvars.Token[Optional[_Serving]]:
    """The handler that runs from now (and what it schedules) serves *job*; undo with
    ``_serving.reset(token)``."""
    return _serving.set(_Serving(job, clock))


def current_deadline() -> Optional[float]:
    """Seconds left until the deadline of the request this handler serves (0 once it passed);
    None outside a handler, for a request without one, or once it is answered (for what the
    handler started that outlives it).  A request made from here waits no
    longer than that by default (docs/mdp.md, "Deadlines, cancellation and trace context")."""
    scope = _serving.get()
    if scope is None or scope.job.deadline is None or scope.job.answered:
        return None
    return max(0.0, scope.job.deadline - scope.clock())


def serving_trace() -> Optional[tuple[bytes, Optional[bytes]]]:
    """The W3C trace context (traceparent, tracestate) of the request this handler serves, if
    it came with one: what a request made from here carries on without OpenTelemetry."""
    scope = _serving.get()
    context = None if scope is None or scope.job.answered else scope.job.context
    if context is None or context.traceparent is None:
        return None
    return context.traceparent, context.tracestate


def cancelled() -> bool:
    """The request this handler serves was given up (its caller cancelled it) or its
    deadline passed: a handler that does long work polls this and stops."""
    scope = _serving.get()
    if scope is None:
        return False
    job = scope.job
    if job.givenUp is not None:  # (answered already: 499, or 504)
        return True
    return not job.answered and job.deadline is not None and scope.clock() >= job.deadline
