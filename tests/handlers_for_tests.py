"""Handlers loaded by name (``module:callable``) in process tests."""


def upper(frames: list[bytes]) -> list[bytes]:
    return [frame.upper() for frame in frames]


def tagged(frames: list[bytes]):
    """Reply with this process's pid and the request, after 5 ms of "work"."""
    import os

    from twisted.internet import reactor, task

    return task.deferLater(reactor, 0.005, lambda: [str(os.getpid()).encode(), *frames])


def slow_tagged(frames: list[bytes]):
    """:func:`tagged` after 20 ms of "work" (so a run lasts long enough to kill
    processes in the middle of it)."""
    import os

    from twisted.internet import reactor, task

    return task.deferLater(reactor, 0.02, lambda: [str(os.getpid()).encode(), *frames])


def burst(frames: list[bytes]):
    """Stream int(frames[0]) PARTIALs in one burst, then a FINAL."""
    from mdp import Final

    for n in range(int(frames[0])):
        yield str(n)
    yield Final(b"end")


def slow_upper(frames: list[bytes]):
    """Upper-case the frames after 1 ms of "work" (so a job lasts long enough
    to lose a worker in the middle)."""
    from twisted.internet import reactor, task

    return task.deferLater(reactor, 0.001, lambda: [frame.upper() for frame in frames])


def big_stream(frames: list[bytes]):
    """Stream int(frames[0]) PARTIALs of 64 KiB each as fast as the broker
    takes them, then a FINAL ``end``."""
    from mdp import Final

    part = b"x" * (64 * 1024)
    for _ in range(int(frames[0])):
        yield part
    yield Final(b"end")


def sized(frames: list[bytes]) -> bytes:
    """Reply with int(frames[0]) bytes."""
    return b"x" * int(frames[0])


def blocking(frames: list[bytes]) -> list[bytes]:
    """Block the reactor for float(frames[0]) seconds (what a handler must not
    do), noting each run as a line in the file frames[1]."""
    import time

    with open(frames[1].decode(), "a") as runs:
        runs.write("run\n")
    time.sleep(float(frames[0]))
    return [b"done"]


def fails(frames: list[bytes]) -> list[bytes]:
    """Always raise: the worker answers with an error reply."""
    raise RuntimeError(f"refusing {frames!r}")


def announced(frames: list[bytes]) -> list[bytes]:
    """Echo, after printing ``handling <first frame>`` (a test reads the
    worker's output to see which requests reached it)."""
    print("handling", frames[0].decode(errors="replace"), flush=True)
    return frames
