"""The ``mdp`` console script's entry point: Ctrl-C is the script's own as
soon as its code runs (exit 130, quietly), and only then is the command line
(:mod:`mdp.app.cli`, which loads Twisted and ZeroMQ) imported.  Nothing
slower than :mod:`signal` is imported before that (not even :mod:`typing`)."""

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
    """Make *handler* SIGINT's, unless SIGINT is ignored, as a program
    started in the background (``nohup``, ``&`` in a script) inherits it:
    then it stays ignored."""
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
