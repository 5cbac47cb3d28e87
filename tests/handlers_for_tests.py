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


_held = [0, 0]  # requests in hand now, most ever (of this process)


def held_tagged(frames: list[bytes]):
    """:func:`tagged` after 5 ms, noting the most requests this process held at once in
    ``$MDP_TEST_RUNS/most-<pid>``."""
    import os

    from twisted.internet import reactor, task

    _held[0] += 1
    if _held[0] > _held[1]:
        _held[1] = _held[0]
        with open(os.path.join(os.environ["MDP_TEST_RUNS"], f"most-{os.getpid()}"), "w") as most:
            most.write(str(_held[1]))

    def done() -> list[bytes]:
        _held[0] -= 1
        return [str(os.getpid()).encode(), *frames]

    return task.deferLater(reactor, 0.005, done)


def counted_tagged(frames: list[bytes]):
    """:func:`tagged` after 5 ms, counting the run: a line with the request in
    ``$MDP_TEST_RUNS/<pid>``."""
    import os

    from twisted.internet import reactor, task

    def done() -> list[bytes]:
        with open(os.path.join(os.environ["MDP_TEST_RUNS"], str(os.getpid())), "ab") as count:
            count.write(frames[0] + b"\n")
        return [str(os.getpid()).encode(), *frames]

    return task.deferLater(reactor, 0.005, done)


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


def counted_upper(frames: list[bytes]):
    """Upper-case the frames after 1 ms, then count the run: a line with the request in
    ``$MDP_TEST_RUNS/<pid>``.  The first request for ``$MDP_TEST_TRAP`` writes this pid to
    ``$MDP_TEST_RUNS/trapped`` and never returns (the test kills this worker)."""
    import os

    from twisted.internet import defer, reactor, task

    runs = os.environ["MDP_TEST_RUNS"]
    if frames[0] == os.environ.get("MDP_TEST_TRAP", "").encode():
        try:
            fd = os.open(os.path.join(runs, "trapped"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            pass
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            return defer.Deferred()

    def done() -> list[bytes]:
        with open(os.path.join(runs, str(os.getpid())), "ab") as count:
            count.write(frames[0] + b"\n")
        return [frame.upper() for frame in frames]

    return task.deferLater(reactor, 0.001, done)


async def until_cancelled(frames: list[bytes]):
    """Work for 30 s, unless given up first: then write the time it heard it (and the seconds
    it was left) to the file frames[0] (frames[0] + ".started" says it began); the request
    b"quick" is answered at once."""
    import time

    from twisted.internet import defer, reactor, task

    import mdp

    if frames == [b"quick"]:
        return [b"quick"]
    left = mdp.current_deadline()
    open(frames[0] + b".started", "w").close()
    try:
        return await task.deferLater(reactor, 30.0, lambda: [b"done"])
    except defer.CancelledError:
        with open(frames[0], "w") as f:
            f.write(f"{time.time()} {left}")
        raise


def twenty_ms_on_time(frames: list[bytes]):
    """20 ms of "work"; each request started is noted in the file frames[0] + ".started", one
    that starts past its deadline (or without one) in frames[0].  A start less than 10 ms
    past it is not noted: a loaded machine may preempt the worker between its last look at
    the deadline and the handler (current_deadline() stops at 0, so the exact one is read)."""
    from twisted.internet import reactor, task

    from mdp import handlers

    scope = handlers._serving.get()
    if frames[0] != b"warm":
        with open(frames[0] + b".started", "a") as f:
            f.write("started\n")
        late = None if scope is None or scope.job.deadline is None else \
            scope.clock() - scope.job.deadline
        if late is None or late >= 0.01:
            with open(frames[0], "a") as f:
                f.write(f"started {late} s past its deadline\n")
    return task.deferLater(reactor, 0.02, lambda: [b"ok"])
