"""What the ``mdp`` command writes: escaped frames and tables on stdout, one-line
errors on stderr; a broken pipe is an exit status, not an error."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

#: stdout's reader has gone (128 + SIGPIPE): ``mdp call ... | head -1``
EXIT_BROKEN_PIPE = 141


def show(frame: bytes) -> str:
    """*frame* as text if it is printable UTF-8, else as a bytes literal."""
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        return repr(frame)
    return text if text.isprintable() else repr(frame)


def printable(text: str) -> str:
    """*text* with unprintable characters (terminal escapes) escaped: for peers' text."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def error(line: str) -> None:
    """One line on stderr, its unprintable characters escaped."""
    print(printable(line), file=sys.stderr)
    sys.stderr.flush()


class Output:
    """Whether standard output's reader has gone (a broken pipe)."""

    gone = False


def divert_output() -> None:
    """Point stdout at /dev/null once its reader has gone, so later writes do not fail."""
    Output.gone = True
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def emit(*lines: str) -> bool:
    """Write *lines* to stdout and flush; False when its reader has gone."""
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
    """Print *frames*, one per line (:func:`show`); False when stdout's reader has gone."""
    return emit(*(show(frame) for frame in frames))


def table(headings: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int]) -> list[str]:
    """Lines of a plain text table; the columns numbered in *right* align right."""
    cells = [list(headings)] + [[printable(str(cell)) for cell in row] for row in rows]
    widths = [max(len(row[n]) for row in cells) for n in range(len(headings))]
    return ["  ".join(cell.rjust(widths[n]) if n in right else cell.ljust(widths[n])
                      for n, cell in enumerate(row)).rstrip() for row in cells]
