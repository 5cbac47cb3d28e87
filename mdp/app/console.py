"""The ``mdp`` console script's entry point: Ctrl-C is the script's own from
its first instant (exit 130, quietly), and only then is the command line
(:mod:`mdp.app.cli`, which loads Twisted and ZeroMQ) imported."""

from __future__ import annotations

import signal
from typing import Any, Optional, Sequence

#: Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


def interrupted(number: int, frame: Any) -> None:
    """Ctrl-C before the command starts: exit at once, quietly."""
    raise SystemExit(EXIT_INTERRUPTED)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the ``mdp`` command (see :func:`mdp.app.cli.main`)."""
    signal.signal(signal.SIGINT, interrupted)
    try:
        from mdp.app import cli
    except KeyboardInterrupt:  # a handler of the embedding program's, say
        raise SystemExit(EXIT_INTERRUPTED) from None
    cli.main(argv)
