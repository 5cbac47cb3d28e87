"""A blocking worker's handlers, run in threads: one per session, each reply part handed back to
the loop's thread (which alone touches the connections) through a wake-up pipe."""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections import deque
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from time import monotonic
from typing import Any, Callable, Optional

from twisted.logger import Logger

from mdp import handlers, tracing
from mdp.handlers import PLAIN_REPLIES, reply_frames
from mdp.majordomo import codec
from mdp.majordomo.codec import WorkerFinal, WorkerPartial
from mdp.majordomo.worker import Final, given_up_body, lapsed
from mdp.messages import text as label

log = Logger(namespace="mdp.blocking")

#: how often the loop looks whether a backlogged connection has drained (s)
PACED_POLL = 0.005

Answer = tuple[list[bytes], bool, Optional[BaseException]]


def run_handler(session: Any, job: Any, body: list[bytes],
                part: Callable[[list[bytes]], bool]) -> Optional[Answer]:
    """Run *session*'s handler on *body*, each PARTIAL through *part* (False: the stream stops, and None is
    returned); else the FINAL's frames, whether the handler served it, and what to raise once it is answered
    (an exception not an ``Exception``).  A handler's exception is logged and answered with a 500.  A *job*
    with a context runs with it in reach (``mdp.current_deadline()``, ``mdp.cancelled()``)."""
    if job.context is None:
        return _run(session, body, part)
    token = handlers.serving(job, monotonic)
    span, spanToken = tracing.start_handler_span(session.machine.service, handlers.serving_trace())
    try:
        return _run(session, body, part)
    finally:
        if span is not None:
            tracing.detach(spanToken)
            tracing.end_span(span)
        handlers._serving.reset(token)


def _run(session: Any, body: list[bytes], part: Callable[[list[bytes]], bool]) -> Optional[Answer]:
    try:
        result = session.handler(body)
        if type(result) in PLAIN_REPLIES or not isinstance(result, Generator):
            return reply_frames(result), True, None
        for item in result:
            final = isinstance(item, Final)
            frames = reply_frames(item.frames if final else item)
            if final or not part(frames):
                result.close()
                return (frames, True, None) if final else None
        return [b""], True, None
    except BaseException as e:
        log.failure("handler for {service} failed", service=label(session.machine.service))
        frames = codec.error_body(codec.STATUS_WORKER_ERROR, f"{type(e).__name__}: {e}")
        return frames, False, None if isinstance(e, Exception) else e


class HandlerThreads:
    """The handlers of a worker with several sessions, run in as many threads; what they return reaches the
    loop's thread through a wake-up pipe.  A handler that raises ``SystemExit`` or ``KeyboardInterrupt`` is
    answered with a 500, and the exception is raised again in the loop's thread."""

    #: (for the loop's one-socket wait: nothing of it waits to be sent)
    backlog = ()

    def __init__(self, loop: Any, threads: int) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="mdp-handler")
        #: reply parts handed back: (session, job, kind, frames, ack, served, raised)
        self.done: deque[tuple[Any, Any, type, list[bytes], Any, bool, Any]] = deque()
        #: PARTIALs sent, their handlers waiting for the connection: (session, job, ack)
        self.paced: list[tuple[Any, Any, Any]] = []
        self.loop = loop
        self.closed = False
        #: guards ``done``, ``closed`` and the pipe against ``close()``
        self.lock = threading.Lock()
        self.wakeFd, self.writeFd = os.pipe()
        os.set_blocking(self.wakeFd, False)
        os.set_blocking(self.writeFd, False)
        loop.pipes[self.wakeFd] = self
        loop.watch(self.wakeFd, select.POLLIN)

    def serve(self, session: Any, job: Any, body: list[bytes]) -> None:
        self.executor.submit(self._call, session, job, body)

    def _call(self, session: Any, job: Any, body: list[bytes]) -> None:
        """In a handler thread: run the handler, hand each reply part back (none for a request
        given up before it started: answered already, or 504 past its deadline)."""
        if job.givenUp is not None:
            return
        if lapsed(job, monotonic()):
            self._handBack(session, job, WorkerFinal, given_up_body(job))
            return
        answer = run_handler(session, job, body,
                             lambda frames: self._handBack(session, job, WorkerPartial, frames))
        if answer is not None:
            self._handBack(session, job, WorkerFinal, *answer)

    def _handBack(self, session: Any, job: Any, kind: type, frames: list[bytes],
                  served: bool = False, raised: Optional[BaseException] = None) -> bool:
        """Give a reply part to the loop; a PARTIAL waits until it is on its
        way (paced by its connection): True if it went out."""
        ack: Optional[Future[bool]] = Future() if kind is WorkerPartial else None
        with self.lock:
            if self.closed:
                return False
            wake = not self.done  # (once woken, the loop takes every part there is)
            self.done.append((session, job, kind, frames, ack, served, raised))
            if wake:
                self._wake()
        while ack is not None and not ack.done() and not self.closed:
            with contextlib.suppress(FutureTimeout):  # (close() settles every ack)
                ack.result(timeout=1.0)
        return ack is None or (ack.done() and ack.result())

    def wait(self, timeout: int) -> None:
        """The loop's only descriptor (every session between connections):
        wait for a handler at most *timeout* ms (-1: no limit)."""
        if select.select([self.wakeFd], [], [], None if timeout < 0 else timeout / 1000)[0]:
            self.ready(select.POLLIN, 0.0)

    def ready(self, flags: int, now: float) -> None:
        """In the loop's thread: send what the handlers gave back."""
        try:
            while os.read(self.wakeFd, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            with self.lock:
                if not self.done:
                    break
                session, job, kind, frames, ack, served, raised = self.done.popleft()
            sent = False
            try:
                sent = session._reply(job, kind, frames)
                if served and sent:
                    session.requestsServed += 1
                if raised is not None:  # (as with one session: out of run())
                    raise raised
            except BaseException:
                with self.lock:
                    if self.done:  # the rest, for the loop's next turn or run() called again
                        self._wake()
                raise
            finally:
                if ack is not None and sent:  # its handler waits until its connection has taken it
                    self.paced.append((session, job, ack))
                elif ack is not None:
                    _settle(ack, False)

    def _wake(self) -> None:
        """Wake the loop (with the lock held)."""
        try:
            os.write(self.writeFd, b"!")
        except BlockingIOError:  # full: the loop wakes anyway
            pass

    def release(self) -> None:
        """After a turn of the loop: let go the handlers whose connections
        have drained (or whose requests went)."""
        waiting = []
        for session, job, ack in self.paced:
            pipe = session.transport
            current = session.machine.isCurrent(job)
            if current and pipe is not None and pipe.draining:
                waiting.append((session, job, ack))
            else:
                _settle(ack, current)
        self.paced = waiting

    def close(self) -> None:
        """Stop handing work out; a handler still running finds its request void."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.loop.forget(self.wakeFd)
            waiting = [item[4] for item in self.done if item[4] is not None]
            self.done.clear()
            os.close(self.wakeFd)
            os.close(self.writeFd)
        for ack in waiting + [ack for _, _, ack in self.paced]:
            _settle(ack, False)
        self.paced = []
        self.executor.shutdown(wait=False)


def _settle(ack: Future[bool], sent: bool) -> None:
    """Tell a handler waiting on *ack* whether its PARTIAL went, once (a release may be interrupted)."""
    if not ack.done():
        ack.set_result(sent)
