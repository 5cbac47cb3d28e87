"""The ``mdp`` entry point: it takes Ctrl-C (exit 130) before importing the slow
:mod:`mdp.app.cli`, so it imports nothing but :mod:`signal` (not even typing)."""

from __future__ import annotations

import signal

TYPE_CHECKING = False  # (type checkers take any name TYPE_CHECKING as true)
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Sequence

#: Ctrl-C (128 + SIGINT), as shells report it
EXIT_INTERRUPTED = 130


def interrupted(number: int, frame: Any) -> None:
    """Ctrl-C before the command starts: exit at once, quietly."""
    raise SystemExit(EXIT_INTERRUPTED)


def catch_interrupt(handler: Callable[[int, Any], None]) -> None:
    """Make *handler* SIGINT's, unless SIGINT is ignored (started in the background)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, handler)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run the ``mdp`` command (see :func:`mdp.app.cli.main`)."""
    catch_interrupt(interrupted)
    try:
        from mdp.app import cli
    except KeyboardInterrupt:  # a handler of the embedding program's, say
        raise SystemExit(EXIT_INTERRUPTED) from None
    cli.main(argv)
