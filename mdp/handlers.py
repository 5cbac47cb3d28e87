"""Built-in worker handlers and loading a handler from ``module:callable``."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from mdp.errors import MDPError


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
