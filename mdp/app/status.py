"""``mdp status``: a broker's services and workers as two tables, from its
``mmi.services`` and ``mmi.workers`` answers, once or every few seconds."""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

from twisted.internet import task

from mdp.app.tap import curve_client_of
from mdp.app.terminal import emit, error, table
from mdp.errors import BrokerUnreachable, MDPError, RequestTimeout

#: seconds ``mdp status`` waits at most for ``mmi.binarystar`` before asking
#: for the tables anyway (a broker that does not know the query may not answer)
BSTAR_PROBE = 1.0
#: characters of a reply an error message shows at most
EXCERPT = 200
#: what reading a reply of the wrong shape raises (RecursionError: JSON
#: nested too deep)
_MALFORMED = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)
#: clears the terminal before each refresh of ``--watch``
_CLEAR = "\x1b[H\x1b[2J"


class UndescribedReply(ValueError):
    """An ``mmi.services`` or ``mmi.workers`` reply that is not the JSON
    ``mdp status`` reads (another MDP broker answers 501, say); the message
    names the query and shows the start of the reply."""

    def __init__(self, query: str, reply: list[bytes]) -> None:
        self.query = query
        super().__init__(f"{query} answered {_excerpt(reply)}")


def _excerpt(frames: list[bytes]) -> str:
    """*frames* as a bytes literal, cut after :data:`EXCERPT` characters
    (saying how long they were): a reply may be megabytes of anything."""
    text = repr(frames)
    if len(text) <= EXCERPT:
        return text
    size = sum(len(frame) for frame in frames)
    return f"{text[:EXCERPT]}... ({size} bytes in {len(frames)} frame{'s' * (len(frames) != 1)})"


def _listing(reply: list[bytes], what: str) -> tuple[Any, str]:
    """The JSON of an ``mmi.services`` / ``mmi.workers`` reply, and a note
    when the broker cut the list short."""
    note = ""
    if len(reply) > 1:
        extra = json.loads(reply[1])
        if extra.get("truncated"):
            note = f"(the first {{shown}} of {extra['total']} {what})"
    return json.loads(reply[0]), note


def status_lines(services: list[bytes], workers: list[bytes]) -> list[str]:
    """The two tables of ``mdp status``, from the reply bodies of
    ``mmi.services`` and ``mmi.workers``.  Raises :class:`UndescribedReply`,
    naming the query, for a reply that is not what it reads."""
    try:
        lines = _services_lines(services)
    except _MALFORMED:
        raise UndescribedReply("mmi.services", services) from None
    try:
        return lines + [""] + _workers_lines(workers)
    except _MALFORMED:
        raise UndescribedReply("mmi.workers", workers) from None


def _services_lines(services: list[bytes]) -> list[str]:
    listed, note = _listing(services, "services")
    lines = ["no services"]
    if listed:
        rows = [(name, entry["workers"], entry["idle"], entry["workers"] - entry["idle"],
                 entry["queued"]) for name, entry in sorted(listed.items())]
        lines = table(["SERVICE", "WORKERS", "IDLE", "BUSY", "QUEUED"], rows, (1, 2, 3, 4))
    return lines + [note.format(shown=len(listed))] if note else lines


def _workers_lines(workers: list[bytes]) -> list[str]:
    listed, note = _listing(workers, "workers")
    lines = ["no workers"]
    if listed:
        # a broker with an access policy leaves the peer ids out
        rows = [(w.get("id", "-"), w["service"], "busy" if w["busy"] else "idle", w["dialect"],
                 f"{w['silence']:.1f}")
                for w in sorted(listed, key=lambda w: (w["service"], w.get("id", "")))]
        lines = table(["WORKER", "SERVICE", "STATE", "DIALECT", "SILENCE (s)"], rows, (4,))
    return lines + [note.format(shown=len(listed))] if note else lines


async def status(reactor: Any, options: Any) -> None:
    """Print the tables once, or every ``--watch`` seconds until Ctrl-C (a
    broker that does not answer is then said, and asked again)."""
    from mdp.majordomo.client import Client

    client = Client(options["brokers"], reactor, timeout=options["timeout"],
                    retries=options["retries"], **curve_client_of(options))
    watch = options["watch"]
    try:
        while True:
            lines = await _report(client, options)
            if lines is None and watch is None:
                raise SystemExit(1)
            if lines is not None and not emit(*_framed(lines, watch)):
                return
            if watch is None:
                return
            await task.deferLater(reactor, watch)
    finally:
        await client.close()


def _framed(lines: list[str], watch: Optional[float]) -> list[str]:
    """*lines* as one refresh shows them: on a terminal, on a cleared screen;
    piped, a blank line between refreshes."""
    if watch is None:
        return lines
    if sys.stdout.isatty():
        return [_CLEAR + lines[0], *lines[1:]]
    return [*lines, ""]


async def _report(client: Any, options: Any) -> Optional[list[str]]:
    """The lines of one report, or None once the line on stderr says why
    the broker did not answer; a reply it cannot read ends the command."""
    idle = await _not_serving(client, min(options["timeout"], BSTAR_PROBE))
    try:
        if idle is not None and len(options["brokers"]) == 1:
            raise _NotServing(idle)  # the tables would go unanswered
        services = await client.request("mmi.services")
        workers = await client.request("mmi.workers")
    except MDPError as e:
        error(f"mdp status: {_failure(e, idle, options['brokers'])}")
        return None
    try:
        tables = status_lines(services, workers)
    except UndescribedReply as e:
        error(f"mdp status: broker {client.endpoint} does not describe its services ({e})")
        raise SystemExit(1) from None
    return [f"broker {client.endpoint}", ""] + tables


def _failure(e: MDPError, idle: Optional[str], brokers: list[str]) -> str:
    """Why the tables did not come, naming the brokers asked."""
    if isinstance(e, _NotServing):
        return str(e)
    if isinstance(e, (RequestTimeout, BrokerUnreachable)):  # they name the brokers
        return f"{e}; {idle}" if idle is not None else str(e)
    return f"broker{'s' * (len(brokers) > 1)} {', '.join(brokers)}: {e}"


class _NotServing(MDPError):
    """The broker is one of a Binary Star pair that serves nothing now."""


async def _not_serving(client: Any, timeout: float) -> Optional[str]:
    """Why the broker *client* talks to serves nothing, if it is a broker of
    a Binary Star pair that does not serve (passive, or a backup that has not
    heard its primary), from its ``mmi.binarystar`` answer: that query is
    answered whatever the state and is no vote, where ``mmi.services`` to a
    passive broker goes unanswered (and is a vote); else None."""
    try:
        reply = await client.request("mmi.binarystar", timeout=timeout, retries=1)
        state = json.loads(reply[0])
        if not isinstance(state, dict) or state.get("serving") is not False:
            return None
    except (MDPError, *_MALFORMED):  # not in a pair (501), no answer, not JSON
        return None
    pair = f"broker {client.endpoint} is the {{}} of a Binary Star pair"
    if state.get("state") == "passive":
        return _passive(pair.format("passive broker") + ": it answers no requests", state)
    if state.get("state") == "backup":
        return (pair.format("backup") + " and has not heard its primary yet: it serves "
                "nothing until then; ask the primary (and check that this broker's "
                "--bstar-remote is the primary's --bstar-local)")
    return None


def _passive(passive: str, state: dict[str, Any]) -> str:
    """What a passive broker's *state* means for a client: its peer serves,
    or the next request here makes it take over."""
    peer, silence = state.get("peer"), state.get("peerSilence")
    failover = state.get("failoverTimeout")
    numbers = all(isinstance(n, (int, float)) for n in (silence, failover))
    if numbers and silence > failover:
        return (f"{passive}, and its peer has been silent for {silence:g} s: the next "
                "client request here makes it take over")
    if peer == "active":
        return f"{passive} while its peer (active) serves them; ask the other broker of the pair"
    return f"{passive} (its peer is {peer or 'not heard yet'}); ask the other broker of the pair"
