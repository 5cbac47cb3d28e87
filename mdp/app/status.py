"""``mdp status``: a broker's services and workers as two tables, from MMI."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

from twisted.internet import task

from mdp.app.tap import curve_client_of
from mdp.app.terminal import emit, error, table
from mdp.errors import BrokerUnreachable, MDPError, RequestTimeout
from mdp.majordomo.client import Client

#: seconds to wait for ``mmi.binarystar``, which a broker may not answer
BSTAR_PROBE = 1.0
#: characters of a reply an error message shows at most
EXCERPT = 200
#: what reading a reply of the wrong shape raises (RecursionError: deep JSON)
_MALFORMED = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)
_CLEAR = "\x1b[H\x1b[2J"


def status_lines(services: list[bytes], workers: list[bytes]) -> list[str]:
    """The two tables of ``mdp status``; a ValueError if a reply is not the expected JSON."""
    return (_table(services, "mmi.services", ["SERVICE", "WORKERS", "IDLE", "BUSY", "QUEUED"],
                   (1, 2, 3, 4), _service_rows)
            + [""] + _table(workers, "mmi.workers", ["WORKER", "SERVICE", "STATE", "DIALECT", "SILENCE (s)"],
                            (4,), _worker_rows))


def _table(reply: list[bytes], query: str, headings: list[str], right: tuple[int, ...],
           rows: Callable[[Any], list[tuple[Any, ...]]]) -> list[str]:
    """The table of an MMI listing, with a note when the broker cut it short."""
    what = query.partition(".")[2]
    try:
        listed = json.loads(reply[0])
        lines = table(headings, rows(listed), right) if listed else [f"no {what}"]
        extra = json.loads(reply[1]) if len(reply) > 1 else {}
        if extra.get("truncated"):
            lines.append(f"(the first {len(listed)} of {extra['total']} {what})")
    except _MALFORMED:
        text, size = repr(reply), sum(len(frame) for frame in reply)
        if len(text) > EXCERPT:
            text = f"{text[:EXCERPT]}... ({size} bytes in {len(reply)} frame{'s' * (len(reply) != 1)})"
        raise ValueError(f"{query} answered {text}") from None
    return lines


def _service_rows(listed: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(name, entry["workers"], entry["idle"], entry["workers"] - entry["idle"],
             entry["queued"]) for name, entry in sorted(listed.items())]


def _worker_rows(listed: list[Any]) -> list[tuple[Any, ...]]:
    # a broker with an access policy leaves the peer ids out
    return [(w.get("id", "-"), w["service"], "busy" if w["busy"] else "idle", w["dialect"],
             f"{w['silence']:.1f}") for w in sorted(listed, key=lambda w: (w["service"], w.get("id", "")))]


async def status(reactor: Any, options: Any) -> None:
    """Print the tables once, or every ``--watch`` seconds until Ctrl-C."""
    client = Client(options["brokers"], reactor, timeout=options["timeout"],
                    retries=options["retries"], **curve_client_of(options))
    watch = options["watch"]
    try:
        while True:
            lines = await _report(client, options)
            if lines is None and watch is None:
                raise SystemExit(1)
            if lines is not None and watch is not None:  # on a cleared screen, or after a blank line
                lines = [_CLEAR + lines[0], *lines[1:]] if sys.stdout.isatty() else [*lines, ""]
            if lines is not None and not emit(*lines):
                return
            if watch is None:
                return
            await task.deferLater(reactor, watch)
    finally:
        await client.close()


async def _report(client: Any, options: Any) -> Optional[list[str]]:
    """The lines of one report, or None once stderr says why there are none."""
    idle = await _not_serving(client, min(options["timeout"], BSTAR_PROBE))
    if idle is not None and len(options["brokers"]) == 1:  # the tables would go unanswered
        error(f"mdp status: {idle}")
        return None
    try:
        services = await client.request("mmi.services")
        workers = await client.request("mmi.workers")
    except (RequestTimeout, BrokerUnreachable) as e:  # they name the brokers
        error(f"mdp status: {e}" + (f"; {idle}" if idle is not None else ""))
        return None
    except MDPError as e:
        brokers = options["brokers"]
        error(f"mdp status: broker{'s' * (len(brokers) > 1)} {', '.join(brokers)}: {e}")
        return None
    try:
        tables = status_lines(services, workers)
    except ValueError as e:
        error(f"mdp status: broker {client.endpoint} does not describe its services ({e})")
        raise SystemExit(1) from None
    return [f"broker {client.endpoint}", ""] + tables


async def _not_serving(client: Any, timeout: float) -> Optional[str]:
    """Why a Binary Star broker serves nothing (passive, or a backup yet to hear its primary), else
    None; ``mmi.binarystar``, unlike ``mmi.services``, is answered in any state and no failover vote."""
    try:
        reply = await client.request("mmi.binarystar", timeout=timeout, retries=1)
        state = json.loads(reply[0])
        if not isinstance(state, dict) or state.get("serving") is not False:
            return None
    except (MDPError, *_MALFORMED):  # not in a pair (501), no answer, not JSON
        return None
    pair = f"broker {client.endpoint} is the {{}} of a Binary Star pair"
    if state.get("state") == "backup":
        return (pair.format("backup") + " and has not heard its primary yet: it serves nothing until then; "
                "ask the primary (and check that this broker's --bstar-remote is the primary's "
                "--bstar-local)")
    if state.get("state") != "passive":
        return None
    passive = pair.format("passive broker") + ": it answers no requests"
    peer, silence, failover = state.get("peer"), state.get("peerSilence"), state.get("failoverTimeout")
    if all(isinstance(n, (int, float)) for n in (silence, failover)) and silence > failover:
        return (f"{passive}, and its peer has been silent for {silence:g} s: the next client request "
                "here makes it take over")
    if peer == "active":
        return f"{passive} while its peer (active) serves them; ask the other broker of the pair"
    return f"{passive} (its peer is {peer or 'not heard yet'}); ask the other broker of the pair"
