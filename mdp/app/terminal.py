"""What the ``mdp`` command writes: reply frames and tables on standard
output, one-line errors on stderr, with peers' text escaped so it cannot
drive the terminal, and a reader of standard output that has gone (a broken
pipe) taken as an exit status rather than an error."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

#: the reader of standard output has gone (128 + SIGPIPE, as for a process the
#: signal killed): ``mdp call ... | head -1``
EXIT_BROKEN_PIPE = 141


def show(frame: bytes) -> str:
    """*frame* as text if it is printable UTF-8, else as a bytes literal."""
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        return repr(frame)
    return text if text.isprintable() else repr(frame)


def printable(text: str) -> str:
    """*text* with its unprintable characters (terminal escape codes among
    them) escaped, ``\\x1b`` for ESC: names and error texts from peers are
    printed through it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def error(line: str) -> None:
    """One line on stderr, its unprintable characters escaped."""
    print(printable(line), file=sys.stderr)
    sys.stderr.flush()


class Output:
    """Whether standard output's reader has gone (a broken pipe)."""

    gone = False


def divert_output() -> None:
    """Point standard output at /dev/null once its reader has gone, so that
    nothing written later (the interpreter's last flush among it) fails
    again; the exit status is then :data:`EXIT_BROKEN_PIPE`."""
    Output.gone = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def emit(*lines: str) -> bool:
    """Write *lines* to standard output and flush it; False (and nothing
    raised) when its reader has gone."""
    if Output.gone:
        return False
    try:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    except BrokenPipeError:
        divert_output()
        return False
    return True


def print_frames(frames: list[bytes]) -> bool:
    """The reply frames, one per line (:func:`show`); False when standard
    output's reader has gone."""
    return emit(*(show(frame) for frame in frames))


def table(headings: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int]) -> list[str]:
    """Lines of a plain text table; the columns numbered in *right* are
    aligned right (numbers)."""
    cells = [list(headings)] + [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(row[n]) for row in cells) for n in range(len(headings))]
    return ["  ".join(cell.rjust(widths[n]) if n in right else cell.ljust(widths[n])
                      for n, cell in enumerate(row)).rstrip() for row in cells]
