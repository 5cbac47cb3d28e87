"""Built-in worker handlers and loading a handler from ``module:callable``."""

from __future__ import annotations

import os
import pkgutil
import sys
from typing import Any, Callable

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
