"""Built-in worker handlers and loading a handler from ``module:callable``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from twisted.internet import defer

from mdp.errors import MDPError


def reply_frames(value: Any) -> list[bytes]:
    """Normalise a handler's reply to a non-empty list of ``bytes`` frames:
    ``bytes``/``str`` (UTF-8) or a list of them; ``None`` or ``[]`` become one
    empty frame."""
    if value is None:
        return [b""]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [bytes(value)]
    if isinstance(value, str):
        return [value.encode("utf-8")]
    frames = []
    for item in value:
        if isinstance(item, str):
            frames.append(item.encode("utf-8"))
        elif isinstance(item, (bytes, bytearray, memoryview)):
            frames.append(bytes(item))
        else:
            raise TypeError(f"a reply frame must be bytes or str, not {type(item).__name__}")
    return frames or [b""]


def call_handler(handler: Callable[[list[bytes]], Any], frames: list[bytes]) -> defer.Deferred:
    """Run a non-streaming handler (plain value, Deferred or coroutine); the
    Deferred fires with its reply frames or fails with its exception."""

    def run() -> Any:
        result = handler(frames)
        return defer.ensureDeferred(result) if inspect.iscoroutine(result) else result

    return defer.maybeDeferred(run).addCallback(reply_frames)


def echo(request: list[bytes]) -> list[bytes]:
    """Reply with the request frames unchanged."""
    return request


BUILTIN: dict[str, Callable[[list[bytes]], Any]] = {"echo": echo}


def load_handler(spec: str) -> Callable[[list[bytes]], Any]:
    """Resolve ``echo`` (a built-in) or ``package.module:callable``."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise MDPError(
            f"handler {spec!r} is neither a built-in ({', '.join(BUILTIN)}) "
            "nor 'module:callable'"
        )
    try:
        target: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        raise MDPError(f"cannot load handler {spec!r}: {e}") from e
    if not callable(target):
        raise MDPError(f"handler {spec!r} is not callable")
    return target
