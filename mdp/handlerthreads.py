"""A blocking worker's handlers, run in threads: one per session, each reply
part handed back to the loop's thread (which alone touches the connections)
through a wake-up pipe."""

from __future__ import annotations

import os
import select
import threading
from collections import deque
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from twisted.logger import Logger

from mdp.handlers import reply_frames
from mdp.majordomo import codec
from mdp.majordomo.codec import WorkerFinal, WorkerPartial
from mdp.majordomo.worker import Final
from mdp.messages import text as label

log = Logger(namespace="mdp.blocking")

#: how often the loop looks whether a backlogged connection has drained (s)
PACED_POLL = 0.005
#: what a handler may return that is no generator, at a glance
_PLAIN_REPLIES = frozenset((bytes, list, tuple, str, type(None)))


class HandlerThreads:
    """The handlers of a worker with several sessions, run in as many threads;
    what they return reaches the loop's thread through a wake-up pipe."""

    def __init__(self, loop: Any, threads: int) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="mdp-handler")
        self.done: deque[tuple[Any, Any, type, list[bytes], Any, bool]] = deque()
        #: PARTIALs sent while their connection was backlogged: (session, job, ack)
        self.paced: list[tuple[Any, Any, Any]] = []
        self.loop = loop
        self.closed = False
        self.wakeFd, self.writeFd = os.pipe()
        os.set_blocking(self.wakeFd, False)
        os.set_blocking(self.writeFd, False)
        loop.pipes[self.wakeFd] = self
        loop.watch(self.wakeFd, select.POLLIN)

    def serve(self, session: Any, job: Any, body: list[bytes]) -> None:
        self.executor.submit(self._call, session, job, body)

    def _call(self, session: Any, job: Any, body: list[bytes]) -> None:
        """In a handler thread: run the handler, hand each reply part back."""
        served = True
        try:
            result = session.handler(body)
            if type(result) not in _PLAIN_REPLIES and isinstance(result, Generator):
                for item in result:
                    final = isinstance(item, Final)
                    frames = reply_frames(item.frames if final else item)
                    if final or not self._handBack(session, job, WorkerPartial, frames):
                        result.close()
                        if not final:
                            return
                        break
                else:
                    frames = [b""]
            else:
                frames = reply_frames(result)
        except Exception as e:
            log.failure("handler for {service} failed", service=label(session.machine.service))
            frames = codec.error_body(codec.STATUS_WORKER_ERROR, f"{type(e).__name__}: {e}")
            served = False
        self._handBack(session, job, WorkerFinal, frames, served)

    def _handBack(self, session: Any, job: Any, kind: type, frames: list[bytes],
                  served: bool = False) -> bool:
        """Give a reply part to the loop; a PARTIAL waits until it is on its
        way (paced by its connection): True if it went out."""
        ack = SimpleNamespace(event=threading.Event(), sent=False) if kind is WorkerPartial else None
        self.done.append((session, job, kind, frames, ack, served))
        try:
            os.write(self.writeFd, b"!")
        except OSError:  # full (the loop wakes anyway), or closed
            pass
        if ack is None:
            return True
        while not ack.event.wait(1.0):
            if self.closed:
                return False
        return ack.sent

    def ready(self, flags: int, now: float) -> None:
        """In the loop's thread: send what the handlers gave back."""
        try:
            while os.read(self.wakeFd, 4096):
                pass
        except BlockingIOError:
            pass
        while self.done:
            session, job, kind, frames, ack, served = self.done.popleft()
            sent = session._reply(job, kind, frames)
            if served and sent:
                session.requestsServed += 1
            if ack is not None:
                ack.sent = sent
                pipe = session._pipe
                if sent and pipe is not None and pipe.backlogged:
                    self.paced.append((session, job, ack))
                else:
                    ack.event.set()

    def release(self) -> None:
        """Let go the handlers whose connections have drained (or whose request went)."""
        waiting = []
        for session, job, ack in self.paced:
            pipe = session._pipe
            if pipe is not None and pipe.draining and session.machine.isCurrent(job):
                waiting.append((session, job, ack))
            else:
                ack.sent = session.machine.isCurrent(job)
                ack.event.set()
        self.paced = waiting

    def close(self) -> None:
        """Stop handing work out; a handler still running finds its request void."""
        if self.closed:
            return
        self.closed = True
        self.loop.forget(self.wakeFd)
        for item in self.done:
            if item[4] is not None:
                item[4].event.set()
        for _, _, ack in self.paced:
            ack.event.set()
        self.executor.shutdown(wait=False)
        os.close(self.wakeFd)
        os.close(self.writeFd)
