"""Handlers loaded by name (``module:callable``) in process tests."""


def upper(frames: list[bytes]) -> list[bytes]:
    return [frame.upper() for frame in frames]


def tagged(frames: list[bytes]):
    """Reply with this process's pid and the request, after 5 ms of "work"."""
    import os

    from twisted.internet import reactor, task

    return task.deferLater(reactor, 0.005, lambda: [str(os.getpid()).encode(), *frames])
