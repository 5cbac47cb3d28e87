"""Harmony (ZRE) nodes as real processes, beaconing over UDP, against
zeromq-pyre: discovery, WHISPER, SHOUT, JOIN and LEAVE both ways, EXIT on a
graceful stop and on SIGKILL, pyre's mangled non-ASCII strings, and a mesh of
twenty of our nodes.

Every node runs inside a network namespace the test creates, with only ``lo``
(up) and a multicast route on it: pyre and our ``udp:5670`` discovery find no
real interface there and fall back to multicast beacons to 225.25.25.25:5670
from 127.0.0.1, so nothing a test sends leaves this machine's loopback.  The
namespace is deleted afterwards, pass or fail.  Without ``ip`` or the right to
add a namespace (not root) the tests skip, unless ``CI=true``: then they fail.
The nodes are ``python -m tests.harmony_peers ours|pyre NAME [GROUP...]``,
driven by JSON lines on stdin, reporting ``READY``/``EVENT`` lines.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
from typing import Any, Iterator, Optional

import pytest
import pytest_twisted
from twisted.internet import defer, task

from tests.procs import ENV, Process, python, reactor, wait_until

pytestmark = pytest.mark.timeout(60)

#: evasive and expired (seconds) unless a test says otherwise
EVASIVE = 1
EXPIRED = 3
#: extra seconds allowed past an expiry for the tick, the reaper and a busy machine
MARGIN = 3.0

_namespaces = itertools.count()
_NAME = re.compile(r"^mdpt(\d+)x\d+$")
_EVENT = re.compile(rb"EVENT (\{.*\})$", re.M)


# --- the namespace ------------------------------------------------------------------


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true, so these tests must run, not skip")
    pytest.skip(reason)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip")
    assert ip is not None
    done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise AssertionError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done


def _sweep_stale() -> None:
    """Delete namespaces of ours left by test runs that were killed (their
    pytest process is gone), so a timeout does not leak them for ever."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        match = _NAME.match(name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _ip("netns", "del", name, check=False)
        except PermissionError:
            pass


@pytest.fixture
def namespace() -> Iterator[str]:
    """A fresh network namespace with only ``lo``, up, and multicast routed on
    it; deleted afterwards."""
    if shutil.which("ip") is None:
        _unavailable("no `ip` command (iproute2): cannot make a network namespace")
    _sweep_stale()
    name = f"mdpt{os.getpid()}x{next(_namespaces)}"
    added = _ip("netns", "add", name, check=False)
    if added.returncode:
        if os.geteuid() != 0 or "not permitted" in added.stderr.lower():
            _unavailable(f"cannot add a network namespace (`ip netns add`: "
                         f"{added.stderr.strip() or added.returncode}); run as root")
        raise AssertionError(f"ip netns add {name} failed: {added.stderr}")
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", name, "route", "add", "224.0.0.0/4", "dev", "lo", "src", "127.0.0.1")
        # the safety of these tests rests on this: no interface but loopback
        links = _ip("-n", name, "-o", "link", "show").stdout.strip().split("\n")
        assert [line.split(":")[1].strip() for line in links] == ["lo"], links
        yield name
    finally:
        _ip("netns", "del", name, check=False)


class Peer:
    """One node process (``ours`` or ``pyre``) inside the namespace, and the
    events it has printed."""

    def __init__(self, ns: str, kind: str, name: str, groups: tuple[str, ...],
                 env: dict[str, str]) -> None:
        ip = shutil.which("ip")
        assert ip is not None
        self.kind = kind
        self.name = name
        self.uuid = ""
        self.endpoint = ""
        self.proc = Process(reactor(), [ip, "netns", "exec", ns, *python(
            "-m", "tests.harmony_peers", kind, name, *groups)], env=env)
        self._parsed = 0
        self._events: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"<{self.kind} node {self.name!r} {self.uuid}>"

    async def ready(self, timeout: float = 60.0) -> None:
        match = await self.proc.waitFor(r"READY (\{.*\})", timeout)
        info = json.loads(match.group(1))
        self.uuid, self.endpoint = info["uuid"], info["endpoint"]

    def send(self, **command: Any) -> None:
        self.proc.transport.write(json.dumps(command).encode() + b"\n")

    def events(self, kind: Optional[str] = None, **match: Any) -> list[dict[str, Any]]:
        """The events so far (of *kind*, with these fields), in order."""
        output = self.proc.output
        end = output.rfind(b"\n") + 1
        if end > self._parsed:
            for found in _EVENT.finditer(output, self._parsed, end):
                self._events.append(json.loads(found.group(1)))
            self._parsed = end
        return [e for e in self._events if (kind is None or e["kind"] == kind)
                and all(e.get(k) == v for k, v in match.items())]

    async def expect(self, kind: str, count: int = 1, timeout: float = 15.0,
                     **match: Any) -> list[dict[str, Any]]:
        """Wait until *count* events of *kind* with these fields have come;
        return them."""
        try:
            await wait_until(lambda: len(self.events(kind, **match)) >= count, timeout)
        except AssertionError:
            raise AssertionError(
                f"{self} did not see {count} {kind} {match} within {timeout}s; its events:\n"
                + "\n".join(json.dumps(e) for e in self.events())
                + f"\nits output (tail):\n{self.proc.output[-6000:].decode(errors='replace')}"
            ) from None
        return self.events(kind, **match)

    async def expectKinds(self, kinds: list[str], timeout: float = 15.0,
                          **match: Any) -> None:
        """Wait until the events with these fields are *kinds*, in order."""
        try:
            await wait_until(lambda: len(self.events(**match)) >= len(kinds), timeout)
        except AssertionError:
            pass
        got = [e["kind"] for e in self.events(**match)]
        assert got == kinds, (
            f"{self} saw {got} for {match}, not {kinds}; its events:\n"
            + "\n".join(json.dumps(e) for e in self.events())
            + f"\nits output (tail):\n{self.proc.output[-6000:].decode(errors='replace')}")

    def kill(self) -> None:
        self.proc.signalProcess(signal.SIGKILL)


class Netns:
    """Spawns nodes in the namespace; :meth:`close` stops them all."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.peers: list[Peer] = []

    def spawn(self, kind: str, name: str, *groups: str, evasive: int = EVASIVE,
              expired: int = EXPIRED, **environ: str) -> Peer:
        env = {**ENV, "HARMONY_EVASIVE": str(evasive), "HARMONY_EXPIRED": str(expired),
               "PYTHONUTF8": "1", **environ}
        peer = Peer(self.name, kind, name, groups, env)
        self.peers.append(peer)
        return peer

    async def close(self) -> None:
        """Ask every node still running to stop, then SIGTERM, then SIGKILL
        what is left; every process is reaped."""
        async def stop(peer: Peer) -> None:
            if peer.proc.running:
                peer.send(op="stop")
                try:
                    await peer.proc.ended(10.0)
                except defer.TimeoutError:
                    pass
            await peer.proc.stop(5.0)

        await defer.DeferredList([defer.ensureDeferred(stop(p)) for p in self.peers],
                                 consumeErrors=True)
        for peer in self.peers:
            if peer.proc.running:  # cannot happen after SIGKILL, but never leave one behind
                peer.kill()
                await peer.proc.ended(10.0)


@pytest_twisted.async_yield_fixture
async def netns(namespace: str) -> Any:
    ns = Netns(namespace)
    try:
        yield ns
    finally:
        await ns.close()


async def pair(netns: Netns, ourGroups: tuple[str, ...] = (), pyreGroups: tuple[str, ...] = (),
               **timing: int) -> tuple[Peer, Peer]:
    """One of our nodes and one pyre node, each having seen the other ENTER."""
    pyre = netns.spawn("pyre", "pyre-node", *pyreGroups, **timing)
    ours = netns.spawn("ours", "our-node", *ourGroups, **timing)
    await pyre.ready()
    await ours.ready()
    assert pyre.uuid != ours.uuid
    await ours.expect("ENTER", peer=pyre.uuid, timeout=30)
    await pyre.expect("ENTER", peer=ours.uuid, timeout=30)
    return ours, pyre


def no_exits(*peers: Peer) -> None:
    for peer in peers:
        assert peer.events("EXIT") == [], f"{peer} saw a peer leave: {peer.events('EXIT')}"
        output = peer.proc.output.decode(errors="replace")
        assert peer.proc.running, f"{peer} exited:\n{output}"
        # a failed assert in pyre's node thread, an error in ours: a traceback
        assert "Traceback" not in output, f"{peer} printed a traceback:\n{output}"


# --- ours and pyre ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_ours_and_pyre_discover_each_other(netns: Netns) -> None:
    ours, pyre = await pair(netns)
    [entered] = ours.events("ENTER")
    assert entered["peer"] == pyre.uuid and entered["name"] == "pyre-node"
    [entered] = pyre.events("ENTER")
    assert entered["peer"] == ours.uuid and entered["name"] == "our-node"
    assert ours.endpoint.startswith("tcp://127.0.0.1:"), ours.endpoint
    assert pyre.endpoint.startswith("tcp://127.0.0.1:"), pyre.endpoint
    no_exits(ours, pyre)


@pytest.mark.parametrize("early", ["ours", "pyre"])
@pytest_twisted.ensureDeferred
async def test_whisper_shout_join_leave_with_pyre(netns: Netns, early: str) -> None:
    """*early* is in the group from the start (its HELLO says so), the other
    joins later; messages both ways, LEAVE, and our status counter, which
    pyre asserts goes up by exactly one on each JOIN and LEAVE."""
    group = "chat"
    ours, pyre = await pair(netns, ourGroups=(group,) if early == "ours" else (),
                            pyreGroups=(group,) if early == "pyre" else ())
    first, late = (ours, pyre) if early == "ours" else (pyre, ours)
    await late.expect("JOIN", peer=first.uuid, group=group)
    late.send(op="join", group=group)
    await first.expect("JOIN", peer=late.uuid, group=group)

    ours.send(op="whisper", peer=pyre.uuid, frames=["one", "two", "three"])
    [got] = await pyre.expect("WHISPER", peer=ours.uuid)
    assert got["frames"] == ["one", "two", "three"] and got["name"] == "our-node"
    pyre.send(op="whisper", peer=ours.uuid, frames=["from", "pyre"])
    [got] = await ours.expect("WHISPER", peer=pyre.uuid)
    assert got["frames"] == ["from", "pyre"] and got["name"] == "pyre-node"

    ours.send(op="shout", group=group, frames=["ours to all", "2nd"])
    [got] = await pyre.expect("SHOUT", peer=ours.uuid, group=group)
    assert got["frames"] == ["ours to all", "2nd"]
    pyre.send(op="shout", group=group, frames=["pyre to all"])
    [got] = await ours.expect("SHOUT", peer=pyre.uuid, group=group)
    assert got["frames"] == ["pyre to all"]

    late.send(op="leave", group=group)
    await first.expect("LEAVE", peer=late.uuid, group=group)

    # join, leave, join, ... : every JOIN and LEAVE carries the next status;
    # a wrong one kills pyre's node thread (an assert), and with it every
    # later delivery to pyre
    sequence = ["join", "leave", "join", "leave", "join"]
    for op in sequence:
        ours.send(op=op, group="again")
    await pyre.expectKinds([op.upper() for op in sequence], group="again", peer=ours.uuid)
    ours.send(op="whisper", peer=pyre.uuid, frames=["after", "the", "status", "changes"])
    await pyre.expect("WHISPER", peer=ours.uuid, frames=["after", "the", "status", "changes"])

    # and pyre's status, as we see it; then both are in "again"
    for op in sequence:
        pyre.send(op=op, group="again")
    await ours.expectKinds([op.upper() for op in sequence], group="again", peer=pyre.uuid)
    pyre.send(op="shout", group="again", frames=["pyre again"])
    await ours.expect("SHOUT", peer=pyre.uuid, group="again", frames=["pyre again"])
    ours.send(op="shout", group="again", frames=["ours again"])
    await pyre.expect("SHOUT", peer=ours.uuid, group="again", frames=["ours again"])

    first.send(op="leave", group=group)
    await late.expect("LEAVE", peer=first.uuid, group=group)
    no_exits(ours, pyre)


@pytest.mark.parametrize("leaver", ["ours", "pyre"])
@pytest_twisted.ensureDeferred
async def test_graceful_stop_is_seen_at_once(netns: Netns, leaver: str) -> None:
    """A node that stops says so (a beacon with port 0): the other sees EXIT
    long before the expiry (30 s here) would drop it."""
    expired = 30
    ours, pyre = await pair(netns, evasive=1, expired=expired)
    gone, stays = (ours, pyre) if leaver == "ours" else (pyre, ours)
    started = reactor().seconds()
    gone.send(op="stop")
    [left] = await stays.expect("EXIT", peer=gone.uuid, timeout=expired - 5)
    took = reactor().seconds() - started
    assert left["name"] == gone.name
    assert took < 5.0, f"EXIT after {took:.2f}s: the port-0 beacon was not acted on"
    await gone.proc.ended(15)
    assert gone.proc.exitCode == 0, gone.proc.output.decode(errors="replace")
    if gone.kind == "pyre":
        assert b"STOPPED {}" in gone.proc.output
    assert stays.proc.running and stays.events("EXIT") == [left]


@pytest.mark.parametrize("victim", ["ours", "pyre"])
@pytest_twisted.ensureDeferred
async def test_sigkill_is_seen_after_the_expiry(netns: Netns, victim: str) -> None:
    ours, pyre = await pair(netns, evasive=EVASIVE, expired=EXPIRED)
    gone, stays = (ours, pyre) if victim == "ours" else (pyre, ours)
    gone.kill()
    killed = reactor().seconds()
    await gone.proc.ended(10)
    [left] = await stays.expect("EXIT", peer=gone.uuid, timeout=EXPIRED + MARGIN + 5)
    took = reactor().seconds() - killed
    assert left["name"] == gone.name
    assert took <= EXPIRED + MARGIN, f"EXIT {took:.2f}s after SIGKILL (expiry {EXPIRED}s)"
    assert stays.proc.running


@pytest_twisted.ensureDeferred
async def test_pyre_non_ascii_strings_do_not_break_ours(netns: Netns) -> None:
    """pyre writes a string's length in characters and cuts its UTF-8 to
    that many bytes: "pyre-é" goes out as b"pyre-\\xc3", "group-é" as
    b"group-\\xc3" (both invalid UTF-8), "é-group" as "é-grou".  Ours reads
    them with U+FFFD for what is invalid, keeps the peer and goes on."""
    pyre = netns.spawn("pyre", "pyre-é")
    ours = netns.spawn("ours", "our-node", "é-group", "group-é")
    await pyre.ready()
    await ours.ready()
    [entered] = await ours.expect("ENTER", peer=pyre.uuid, timeout=30)
    assert entered["name"] == "pyre-\ufffd"
    await pyre.expect("ENTER", peer=ours.uuid, timeout=30)
    # pyre reads what we send correctly (we write bytes, and count them)
    await pyre.expect("JOIN", peer=ours.uuid, group="é-group")
    await pyre.expect("JOIN", peer=ours.uuid, group="group-é")

    for group in ("é-group", "group-é"):
        pyre.send(op="join", group=group)
    await ours.expect("JOIN", peer=pyre.uuid, group="é-grou")
    await ours.expect("JOIN", peer=pyre.uuid, group="group-\ufffd")
    # pyre sends these to us (it knows we are in both), with the cut names
    pyre.send(op="shout", group="é-group", frames=["ça va?"])
    pyre.send(op="shout", group="group-é", frames=["très bien"])
    await ours.expect("SHOUT", peer=pyre.uuid, group="é-grou", frames=["ça va?"])
    await ours.expect("SHOUT", peer=pyre.uuid, group="group-\ufffd", frames=["très bien"])
    pyre.send(op="leave", group="group-é")
    await ours.expect("LEAVE", peer=pyre.uuid, group="group-\ufffd")

    pyre.send(op="whisper", peer=ours.uuid, frames=["later", "ünïcode"])
    [got] = await ours.expect("WHISPER", peer=pyre.uuid)
    assert got["frames"] == ["later", "ünïcode"] and got["name"] == "pyre-\ufffd"
    ours.send(op="whisper", peer=pyre.uuid, frames=["ours", "still", "here"])
    await pyre.expect("WHISPER", peer=ours.uuid, frames=["ours", "still", "here"])
    # nobody dropped anybody, and nothing crashed
    no_exits(ours, pyre)


# --- a mesh of ours ---------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest_twisted.ensureDeferred
async def test_twenty_of_ours_form_a_full_mesh(netns: Netns) -> None:
    count, group = 20, "mesh"
    started = reactor().seconds()
    nodes = [netns.spawn("ours", f"node-{n:02d}", group) for n in range(count)]
    for node in nodes:
        await node.ready(timeout=60)
    uuids = {node.uuid for node in nodes}
    assert len(uuids) == count

    def entered(node: Peer) -> set[str]:
        return {e["peer"] for e in node.events("ENTER")}

    def missing() -> dict[str, int]:
        return {n.name: len(uuids - {n.uuid} - entered(n)) for n in nodes
                if entered(n) != uuids - {n.uuid}}

    try:
        await wait_until(lambda: not missing(), 60, step=0.1)
    except AssertionError:
        raise AssertionError(f"no full mesh within 60s; peers missing: {missing()}") from None
    formed = reactor().seconds() - started
    for node in nodes:
        names = {e["peer"]: e["name"] for e in node.events("ENTER")}
        assert names == {n.uuid: n.name for n in nodes if n is not node}
        await node.expect("JOIN", count=count - 1, group=group, timeout=15)

    shouter, victim = nodes[0], nodes[-1]
    shouter.send(op="shout", group=group, frames=["hello", "mesh"])
    for node in nodes[1:]:
        await node.expect("SHOUT", peer=shouter.uuid, group=group, frames=["hello", "mesh"])
    no_exits(*nodes)

    victim.kill()
    killed = reactor().seconds()
    await victim.proc.ended(10)
    survivors = nodes[:-1]
    seen: dict[str, float] = {}

    def allSeen() -> bool:
        for node in survivors:
            if node.name not in seen and node.events("EXIT", peer=victim.uuid):
                seen[node.name] = reactor().seconds() - killed
        return len(seen) == len(survivors)

    try:
        await wait_until(allSeen, EXPIRED + MARGIN + 10, step=0.05)
    except AssertionError:
        raise AssertionError(f"EXIT of the killed node seen by {sorted(seen)} only") from None
    slowest = max(seen.values())
    assert slowest <= EXPIRED + MARGIN, f"EXITs after {sorted(seen.values())}"
    for node in survivors:
        assert [e["peer"] for e in node.events("EXIT")] == [victim.uuid]
        assert node.proc.running
    print(f"\nmesh of {count}: formed {formed:.1f}s after the first spawn; SIGKILL seen by "
          f"all {len(survivors)} within {slowest:.2f}s (expiry {EXPIRED}s)")


@pytest_twisted.ensureDeferred
async def test_two_mdp_chats_find_each_other_by_beacons_and_a_pyre_node_hears_them(
        namespace: str) -> None:
    """``mdp chat`` with its default discovery (UDP beacons), as two people
    in two terminals would run it, plus a pyre node in the same group."""
    from tests.procs import script

    ip = shutil.which("ip")
    assert ip is not None
    env = {**ENV, "PYTHONUTF8": "1"}
    chats = [Process(reactor(), [ip, "netns", "exec", namespace, script("mdp"), "chat",
                                 "--name", name, "--group", "ROOM"], env=env)
             for name in ("alice", "bob")]
    ns = Netns(namespace)
    try:
        pyre = ns.spawn("pyre", "carol", "ROOM")
        await pyre.ready()
        alice, bob = chats
        await alice.waitFor(r"\* bob is here", 30)
        await bob.waitFor(r"\* alice is here", 30)
        await alice.waitFor(r"\* carol is here", 30)
        alice.transport.write("salut à tous\n".encode())
        await bob.waitFor("alice: salut à tous", 15)
        await pyre.expect("SHOUT", group="ROOM", frames=["salut à tous"])
        # pyre shouts to the peers it knows are in the group: bob's JOIN may come
        # after alice's shout did
        await pyre.expect("JOIN", name="bob", group="ROOM", timeout=30)
        pyre.send(op="shout", group="ROOM", frames=["hello from pyre"])
        await bob.waitFor("carol: hello from pyre", 15)
        alice.transport.closeStdin()  # Ctrl-D: a port-0 beacon, so the others see it at once
        await alice.ended(15)
        assert alice.exitCode == 0, alice.output
        await bob.waitFor(r"\* alice left", 10)
    finally:
        for chat in chats:
            await chat.stop()
        await ns.close()


# --- a flood of spoofed beacons ---------------------------------------------------------

#: Beacons from a new random UUID each, *RATE* a second until its stdin closes
#: (at most *SECONDS*), as ZRE nodes in the namespace hear them (multicast from
#: 127.0.0.1), each naming a port nobody listens on; prints FLOODING, then DONE.
SPOOFER = """
import os, select, socket, sys, time
rate, seconds = int(sys.argv[1]), float(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
print("FLOODING", flush=True)
start = time.monotonic()
sent = 0
while time.monotonic() - start < seconds and not select.select([sys.stdin], [], [], 0)[0]:
    while sent < rate * (time.monotonic() - start):
        s.sendto(b"ZRE\x01" + os.urandom(16) + (40000 + sent % 20000).to_bytes(2, "big"),
                 ("225.25.25.25", 5670))
        sent += 1
    time.sleep(0.005)
print("DONE", sent, flush=True)
"""


@pytest_twisted.ensureDeferred
async def test_a_real_peer_is_heard_during_and_after_a_flood_of_spoofed_beacons(
        netns: Netns) -> None:
    """A process sends 500 spoofed beacons a second (a new UUID each, never
    a HELLO); alice (peer table 100, strangers 16) meets bob, who starts
    during the flood, within 10 s and hears his WHISPER; once the flood has
    ended she meets carol within 2 s; she never keeps more than 16 strangers,
    nor a peer that has not said HELLO."""
    bounds = {"HARMONY_MAX_PEERS": "100", "HARMONY_MAX_STRANGERS": "16",
              "HARMONY_HELLO_WAIT": "2"}
    alice = netns.spawn("ours", "alice", **bounds)
    await alice.ready()
    ip = shutil.which("ip")
    assert ip is not None
    spoofer = Process(reactor(), [ip, "netns", "exec", netns.name,
                                  *python("-c", SPOOFER, "500", "60")], env=ENV)
    try:
        await spoofer.waitFor("FLOODING", 30)
        await stats_until(alice, lambda found: found["most"] >= 16, 5)  # her strangers are full
        bob = netns.spawn("ours", "bob", **bounds)
        await bob.ready()
        started = reactor().seconds()
        await alice.expect("ENTER", peer=bob.uuid, timeout=10)
        bob.send(op="whisper", peer=alice.uuid, frames=["through the flood"])
        await alice.expect("WHISPER", peer=bob.uuid, frames=["through the flood"], timeout=10)
        took = reactor().seconds() - started
        assert took < 10, f"alice heard bob {took:.1f}s after he started, during the flood"
        during = took
        spoofer.transport.closeStdin()
        await spoofer.waitFor(r"DONE \d+", 30)
        carol = netns.spawn("ours", "carol", **bounds)
        await carol.ready()
        started = reactor().seconds()
        await alice.expect("ENTER", peer=carol.uuid, timeout=10)
        took = reactor().seconds() - started
        assert took < 2, f"alice heard carol {took:.1f}s after she started, after the flood"
        print(f"\nflood of {spoofer.output.split()[-1].decode()} spoofed beacons: bob heard "
              f"{during:.2f}s after his start during it, carol {took:.2f}s after hers after it")
        found = await stats_until(alice, lambda found: found["strangers"] == 0, 5)
        assert found == {"peers": 2, "strangers": 0, "most": 16}
        assert {e["peer"] for e in alice.events("ENTER")} == {bob.uuid, carol.uuid}
        no_exits(alice, bob, carol)
    finally:
        await spoofer.stop()


_STATS = re.compile(rb"STATS (\{.*\})\n")


async def stats(peer: Peer) -> dict[str, int]:
    """What *peer* (ours) says of its tables when asked now."""
    count = len(_STATS.findall(peer.proc.output))
    peer.send(op="stats")
    await wait_until(lambda: len(_STATS.findall(peer.proc.output)) > count, 10)
    return json.loads(_STATS.findall(peer.proc.output)[-1])


async def stats_until(peer: Peer, predicate: Any, seconds: float) -> dict[str, int]:
    deadline = reactor().seconds() + seconds
    while not predicate(found := await stats(peer)):
        assert reactor().seconds() < deadline, f"{peer}: {found} after {seconds}s"
        await task.deferLater(reactor(), 0.1)
    return found
