"""Authenticated peers, encrypted links and the access policy, end to end:
``twist mdp-broker`` and ``twist mdp-worker`` processes over CURVE
(ZeroMQ) and mutual TLS (``ssl:``), clients in this process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.task import Clock
from twisted.logger import formatEvent

from mdp import Client, RequestTimeout, blocking
from mdp.errors import Forbidden, TransportError
from mdp.testing import CertificateAuthority as Authority
from mdp.transport import authenticated, beyond_loopback
from mdp.transport.curve import CurveServer, keygen
from tests.conftest import warnings_logged
from tests.curve_router import Recorder, claim, curve_router
from tests.procs import (
    BROKER_HB,
    ENV,
    WORKER_HB,
    Process,
    bound_endpoint,
    peer_closed,
    reactor,
    script,
    twist_broker,
    twist_worker,
    wait_until,
)
from tests.test_harmony_netns import namespace  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)

ANNOUNCED = "tests.handlers_for_tests:announced"


def public_key(path: str) -> str:
    """The Z85 public key of a ``.key`` certificate (what the broker knows a peer by)."""
    text = Path(path).read_text()
    match = re.search(r'public-key = "(.{40})"', text)
    assert match is not None
    return match.group(1)


def handled(workers: list[Process]) -> list[str]:
    return sorted(line.split()[-1] for w in workers
                  for line in w.output.decode(errors="replace").splitlines()
                  if "handling " in line and "mdp-worker" not in line)


async def refused(client: Client, service: str, body: bytes) -> BaseException:
    try:
        reply = await client.request(service, body)
    except Exception as e:
        return e
    raise AssertionError(f"{body!r} got through: {reply!r}")


class Running:
    """Processes and clients to stop at the end of a test."""

    def __init__(self) -> None:
        self.processes: list[Process] = []
        self.clients: list[Client] = []

    def client(self, endpoint: str, **options: Any) -> Client:
        client = Client(endpoint, reactor(), timeout=1.5, retries=1, **options)
        self.clients.append(client)
        return client

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        for process in reversed(self.processes):
            await process.stop()


@pytest_twisted.ensureDeferred
async def test_curve_lets_in_only_allowed_keys_and_the_policy_decides_what_they_do(
        tmp_path: Path) -> None:
    keys = {name: keygen(name, str(tmp_path))
            for name in ("broker", "alice", "worker", "rogue", "mallory")}
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("alice", "worker", "rogue"):
        (allowed / f"{name}.key").write_text(Path(keys[name][0]).read_text())
    policy = tmp_path / "access.toml"
    policy.write_text(f"""
[[peer]]
identity = {json.dumps(public_key(keys["alice"][0]))}
call = ["echo"]

[[peer]]
identity = {json.dumps(public_key(keys["worker"][0]))}
serve = ["echo", "secret"]
""")
    running = Running()
    try:
        broker, endpoint = await twist_broker(
            reactor(), "zmq:tcp://127.0.0.1:*", *BROKER_HB, "--curve-secret", keys["broker"][1],
            "--curve-allow", str(allowed), "--access", str(policy))
        running.processes.append(broker)
        assert b"without authentication" not in broker.output

        def worker(service: str, name: str) -> Process:
            process = twist_worker(reactor(), endpoint, service, ANNOUNCED, *WORKER_HB,
                                   "--curve-server-public", keys["broker"][0],
                                   "--curve-secret", keys[name][1])
            running.processes.append(process)
            return process

        workers = [worker("echo", "worker"), worker("secret", "worker")]
        for process in workers:
            await process.waitFor("sent READY", 60)
        await wait_until(lambda: broker.output.count(b"ready for ") >= 2, 30)
        # a key the broker lets in, but the policy does not let serve echo
        rogue = worker("echo", "rogue")
        await wait_until(lambda: b"may not serve it" in broker.output, 30)

        alice = running.client(endpoint, curveServerPublic=keys["broker"][0],
                               curveSecret=keys["alice"][1])
        assert await alice.request("echo", b"a1") == [b"a1"]

        # an unknown key, no key, the wrong server key: nothing gets through
        mallory = running.client(endpoint, curveServerPublic=keys["broker"][0],
                                 curveSecret=keys["mallory"][1])
        assert isinstance(await refused(mallory, "echo", b"m1"), RequestTimeout)
        plain = running.client(endpoint)
        assert isinstance(await refused(plain, "echo", b"n1"), RequestTimeout)
        impostor = running.client(endpoint, curveServerPublic=keys["mallory"][0],
                                  curveSecret=keys["alice"][1])
        assert isinstance(await refused(impostor, "echo", b"w1"), RequestTimeout)
        await wait_until(lambda: b"is not in the allow-list" in broker.output, 30)

        # the policy: alice may call echo only; MMI tells her of echo only
        error = await refused(alice, "secret", b"s1")
        assert isinstance(error, Forbidden) and error.code == b"403"
        (services,) = await alice.request("mmi.services")
        assert set(json.loads(services)) == {"echo"}
        assert await alice.request("mmi.service", b"secret") == [b"404"]

        # the broker serves on, and only alice's requests reached a worker
        assert await alice.request("echo", b"a2") == [b"a2"]
        # the blocking client takes the same keys (the broker is another process)
        with blocking.Client(endpoint, timeout=5, retries=1, curveServerPublic=keys["broker"][0],
                             curveSecret=keys["alice"][1]) as script:
            assert script.request("echo", b"b1") == [b"b1"]
        await wait_until(lambda: len(handled(workers)) == 3, 10)
        assert handled(workers + [rogue]) == ["a1", "a2", "b1"]
    finally:
        await running.stop()


@pytest_twisted.ensureDeferred
async def test_mutual_tls_refuses_peers_without_a_trusted_certificate(tmp_path: Path) -> None:
    authority = Authority(tmp_path)
    server = authority.issue("broker", "broker")
    worker_cert = authority.issue("worker", "worker-1", "Example")
    alice_cert = authority.issue("alice", "alice", "Example")
    stranger = Authority(tmp_path, "Other CA").issue("mallory", "alice", "Example")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "ca.pem").write_bytes(authority.pem.read_bytes())
    policy = tmp_path / "access.toml"
    policy.write_text("""
[[peer]]
identity = "CN=alice,O=Example"
call = ["echo"]

[[peer]]
identity = "CN=worker-1,O=Example"
serve = ["echo", "secret"]
""")
    running = Running()

    def peer(endpoint: str, cert: tuple[Path, Path]) -> str:
        return f"{endpoint}:caCertsDir={trusted}:certKey={cert[0]}:privateKey={cert[1]}"

    try:
        broker, endpoint = await twist_broker(
            reactor(), f"ssl:0:interface=127.0.0.1:privateKey={server[1]}:certKey={server[0]}"
            f":caCerts={authority.pem}", *BROKER_HB, "--access", str(policy))
        running.processes.append(broker)
        assert endpoint.startswith("ssl:host=127.0.0.1:port=")
        workers = [twist_worker(reactor(), peer(endpoint, worker_cert), service, ANNOUNCED,
                                *WORKER_HB) for service in ("echo", "secret")]
        running.processes.extend(workers)
        await wait_until(lambda: broker.output.count(b"ready for ") >= 2, 60)

        alice = running.client(peer(endpoint, alice_cert))
        assert await alice.request("echo", b"a1") == [b"a1"]
        # no client certificate, or one another authority signed: refused at the handshake
        anonymous = running.client(f"{endpoint}:caCertsDir={trusted}")
        assert isinstance(await refused(anonymous, "echo", b"n1"), RequestTimeout)
        impostor = running.client(peer(endpoint, stranger))
        assert isinstance(await refused(impostor, "echo", b"m1"), RequestTimeout)
        # the certificate's subject is the identity the policy names
        error = await refused(alice, "secret", b"s1")
        assert isinstance(error, Forbidden)
        assert await alice.request("echo", b"a2") == [b"a2"]
        # (the workers' output comes by its own pipe: it may follow the reply)
        await wait_until(lambda: len(handled(workers)) >= 2, 10)
        assert handled(workers) == ["a1", "a2"]
    finally:
        await running.stop()


def test_a_listener_beyond_loopback_without_authentication_is_named() -> None:
    assert beyond_loopback("zmq:tcp://*:5555") and beyond_loopback("tcp:5555")
    assert beyond_loopback("ssl:5555:interface=10.1.2.3:privateKey=k")
    assert not beyond_loopback("zmq:tcp://127.0.0.1:5555")
    assert not beyond_loopback("tcp:host=127.0.0.1:port=0") and not beyond_loopback("unix:path=/s")
    curve = CurveServer(b"p" * 40, b"s" * 40, frozenset())
    assert authenticated("zmq:tcp://*:1", curve)
    assert not authenticated("zmq:tcp://*:1", CurveServer(b"p" * 40, b"s" * 40, None))
    assert not authenticated("zmq:tcp://*:1") and not authenticated("tcp:5555")
    assert authenticated("ssl:5555:privateKey=k:caCerts=ca.pem")
    assert beyond_loopback("mtls:5555:privateKey=k:caCerts=ca.pem")
    assert not beyond_loopback("mtls:5555:interface=127.0.0.1:privateKey=k:caCerts=ca.pem")
    assert authenticated("mtls:5555:privateKey=k:caCerts=ca.pem")


@pytest_twisted.ensureDeferred
async def test_a_broker_open_to_other_machines_without_authentication_warns(
        namespace: str, tmp_path: Path) -> None:  # noqa: F811
    """Bound to every interface of a network namespace that has only
    loopback; with CURVE and an allow-list, the same broker says nothing."""
    ip = shutil.which("ip")
    assert ip is not None
    keygen("broker", str(tmp_path))
    (tmp_path / "allowed").mkdir()
    for options, warned in (((), True), (("--curve-secret", str(tmp_path / "broker.key_secret"),
                                          "--curve-allow", str(tmp_path / "allowed")), False)):
        broker = Process(reactor(), [ip, "netns", "exec", namespace, script("twist"),
                                     "--log-format", "text", "mdp-broker", "--endpoint",
                                     "zmq:tcp://*:5555", *options], ENV)
        try:
            await bound_endpoint(broker, "MDP broker")
            assert (b"reachable from other machines, without authentication"
                    in broker.output) is warned, broker.output
        finally:
            await broker.stop()


def test_curve_files_are_checked_at_once(tmp_path: Path) -> None:
    public, secret = keygen("node", str(tmp_path))
    with pytest.raises(TransportError, match="does not exist"):
        Client("zmq:tcp://127.0.0.1:5555", curveServerPublic=str(tmp_path / "none.key"))
    with pytest.raises(TransportError, match="holds no secret key"):
        Client("zmq:tcp://127.0.0.1:5555", curveServerPublic=public, curveSecret=public)
    with pytest.raises(ValueError, match="for zmq: endpoints"):
        Client("tcp:host=127.0.0.1:port=5555", curveServerPublic=public)
    with pytest.raises(ValueError, match="exists already"):
        keygen("node", str(tmp_path))
    assert oct(Path(secret).stat().st_mode & 0o777) == "0o600"


class ThreadedClock(Clock):
    """A Clock whose callFromThread runs the call at once (the ZAP thread's
    calls, made here from the test's)."""

    def callFromThread(self, f: Any, *args: Any, **kwargs: Any) -> None:
        f(*args, **kwargs)


def test_refused_curve_handshakes_log_at_most_a_line_a_second() -> None:
    """A flood of handshakes with keys not in the allow-list is counted one
    by one and logged once a second, the next line saying how many were held
    back."""
    import zmq

    from mdp.transport.curve import _gate

    friend, _ = zmq.curve_keypair()
    own, secret = zmq.curve_keypair()
    clock = ThreadedClock()
    counted: list[None] = []
    gate = _gate(CurveServer(own, secret, frozenset({friend})), "zmq:tcp://127.0.0.1:5555", clock,
                 refused=lambda: counted.append(None))
    with warnings_logged() as events:
        assert gate.callback("1", friend)
        for _ in range(300):
            assert not gate.callback("1", zmq.curve_keypair()[0])
        clock.advance(1.0)
        assert not gate.callback("1", zmq.curve_keypair()[0])
    lines = [formatEvent(event) for event in events]
    assert len(counted) == 301 and len(lines) == 2, lines
    assert all("is not in the allow-list" in line for line in lines)
    assert "(299 similar held back in the last 1s)" in lines[1]


def test_curve_keys_with_a_session_endpoint_in_a_list_are_refused_at_once(
        tmp_path: Path) -> None:
    """Not at the first failover to that endpoint (out of a timer)."""
    from mdp import Worker
    from mdp.freelance import freelance_client

    public, secret = keygen("node", str(tmp_path))
    endpoints = ["zmq:tcp://127.0.0.1:5555", "session+zmq:tcp://127.0.0.1:5556"]
    keys = {"curveServerPublic": public, "curveSecret": secret}
    for make in (lambda: Worker(endpoints, "svc", lambda f: f, reactor(), **keys),
                 lambda: Client(endpoints, reactor(), **keys),
                 lambda: freelance_client(endpoints, 1, reactor(), **keys),
                 lambda: freelance_client(endpoints, 2, reactor(), **keys)):
        with pytest.raises(TransportError, match="CURVE is not available on session"):
            make()


@pytest.mark.parametrize("model", [1, 2, 3])
@pytest_twisted.ensureDeferred
async def test_freelance_servers_take_curve_keys_too(tmp_path: Path, model: int) -> None:
    from mdp.freelance import FreelanceServer, freelance_client

    keys = {name: keygen(name, str(tmp_path)) for name in ("server", "alice", "mallory")}
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_text(Path(keys["alice"][0]).read_text())
    seen: list[bytes] = []

    def handler(frames: list[bytes]) -> list[bytes]:
        seen.extend(frames)
        return frames

    server = FreelanceServer(handler, reactor(), curveSecret=keys["server"][1],
                             curveAllow=str(allowed))
    bound = await server.listen("zmq:tcp://127.0.0.1:*")
    clients = []
    try:
        for name, body in (("alice", b"a1"), ("mallory", b"m1")):
            client = freelance_client([bound.endpoint], model, reactor(), timeout=1, deadline=1.5,
                                      curveServerPublic=keys["server"][0],
                                      curveSecret=keys[name][1])
            clients.append(client)
            if name == "alice":
                assert await client.request(body) == [body]
            else:
                assert isinstance(await refused_freelance(client, body), RequestTimeout)
        assert seen == [b"a1"]
        assert bound.handshakesRefused >= 1  # counted (and logged) by the server's transport
    finally:
        for client in clients:
            await client.close()
        await server.close()


async def refused_freelance(client: Any, body: bytes) -> BaseException:
    try:
        reply = await client.request(body)
    except Exception as e:
        return e
    raise AssertionError(f"{body!r} got through: {reply!r}")


@pytest_twisted.ensureDeferred
async def test_under_curve_a_peer_id_cannot_be_taken_over_by_another_key(tmp_path: Path) -> None:
    recorder = Recorder()
    async with curve_router(tmp_path, recorder, reactor()) as (router, dealer):
        alice = dealer("alice", b"worker-1")
        alice.send(b"from alice")
        await wait_until(lambda: len(recorder.events) == 1, 10)
        alice_id = recorder.events[0][3]
        assert recorder.events == [("message", b"worker-1", b"from alice", alice_id)]
        assert alice_id == public_key(str(tmp_path / "alice.key"))
        # while alice holds the id, mallory's connection with it is ignored
        mallory = dealer("mallory", b"worker-1")
        mallory.send(b"from mallory, early")
        router.sendMessage(b"worker-1", [b"for alice"])
        assert await task_poll(lambda: alice.poll(0)) and alice.recv() == b"for alice"
        # alice leaves; mallory claims the freed id anew: alice is reported gone first
        alice.close()
        await claim(dealer, b"worker-1", lambda sock: sock.send(b"from mallory"),
                    lambda: len(recorder.events) > 1)
        # only alice spoke as worker-1 until she was reported gone; mallory
        # after (her early message too, if libzmq kept it: but never as alice)
        mallory_id = public_key(str(tmp_path / "mallory.key"))
        gone = recorder.events.index(("gone", b"worker-1"))
        assert recorder.events[:gone] == [("message", b"worker-1", b"from alice", alice_id)]
        after = recorder.events[gone + 1:]
        assert after and all(e[0] == "message" and e[3] == mallory_id for e in after), after


async def task_poll(predicate: Any, seconds: float = 10) -> bool:
    await wait_until(predicate, seconds)
    return True


def test_curve_peers_pick_peer_ids_no_one_can_guess(tmp_path: Path) -> None:
    from mdp.transport.curve import curve_client
    from mdp.transport.zeromq import ZmqDealer

    keygen("server", str(tmp_path))
    curve = curve_client(str(tmp_path / "server.key"))

    class Nobody:
        def connectionMade(self) -> None: ...
        def messageReceived(self, frames: list[bytes]) -> None: ...
        def connectionLost(self, reason: object) -> None: ...

    dealers = [ZmqDealer("zmq:tcp://127.0.0.1:5555", Nobody(), reactor(), curve=curve)
               for _ in range(2)]
    try:
        ids = [d.identity for d in dealers]
        assert all(len(i) == 16 and i[0] != 0 for i in ids) and ids[0] != ids[1]
    finally:
        for d in dealers:
            d.close()


class Pipe:
    """A dealer receiver keeping what came."""

    def __init__(self) -> None:
        self.up = 0
        self.lost = 0
        self.messages: list[list[bytes]] = []

    def connectionMade(self) -> None:
        self.up += 1

    def messageReceived(self, frames: list[bytes]) -> None:
        self.messages.append(frames)

    def connectionLost(self, reason: object) -> None:
        self.lost += 1


async def mutual_tls_router(tmp_path: Path, *names: str,
                            kind: str = "ssl") -> tuple[Any, Recorder, dict[str, Any], Path]:
    """A listening ``ssl:`` (or *kind*) router requiring client certificates
    of a test authority; the recorder of what it hears, a certificate for
    each of *names*, and the directory trusting the authority (for the clients)."""
    from mdp import transport

    authority = Authority(tmp_path)
    server = authority.issue("broker", "broker")
    certs = {name: authority.issue(name, name, "Example") for name in names}
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "ca.pem").write_bytes(authority.pem.read_bytes())
    recorder = Recorder()
    router = await transport.listen(
        f"{kind}:0:interface=127.0.0.1:privateKey={server[1]}:certKey={server[0]}"
        f":caCerts={authority.pem}", recorder, reactor())
    recorder.transport = router
    return router, recorder, certs, trusted


@pytest_twisted.ensureDeferred
async def test_an_mtls_listener_says_the_ssl_endpoint_that_reaches_it(tmp_path: Path) -> None:
    """``mtls:`` (the dropin's endpoint parser) listens as ``ssl:`` with
    ``caCerts=`` does; its endpoint is the ``ssl:`` client one, to which a
    peer adds its certificate."""
    from mdp import transport

    router, recorder, certs, trusted = await mutual_tls_router(tmp_path, "alice", kind="mtls")
    cert, key = certs["alice"]
    pipe = Pipe()
    assert router.endpoint.startswith("ssl:host=127.0.0.1:port=")
    dealer = transport.connect(
        f"{router.endpoint}:caCertsDir={trusted}:certKey={cert}:privateKey={key}", pipe, reactor())
    try:
        await wait_until(lambda: pipe.up == 1, 10)
        dealer.sendMessage([b"hello"])
        await wait_until(lambda: len(recorder.events) == 1, 10)
        assert recorder.events[0][2:] == (b"hello", "CN=alice,O=Example")
    finally:
        await dealer.close()
        await router.close()


@pytest_twisted.ensureDeferred
async def test_under_mutual_tls_an_announced_identity_stays_with_its_certificate(
        tmp_path: Path) -> None:
    from mdp import transport

    router, recorder, certs, trusted = await mutual_tls_router(tmp_path, "alice", "bob")
    pipes = {name: Pipe() for name in certs}
    dealers = {}
    try:
        for name in ("alice", "bob"):
            cert, key = certs[name]
            dealers[name] = transport.connect(
                f"{router.endpoint}:caCertsDir={trusted}:certKey={cert}:privateKey={key}",
                pipes[name], reactor(), identity=b"same")
            await wait_until(lambda name=name: pipes[name].up == 1, 10)
            dealers[name].sendMessage([f"from {name}".encode()])
            if name == "alice":
                await wait_until(lambda: len(recorder.events) == 1, 10)
        # bob announced alice's identity with another certificate: dropped, unheard
        await wait_until(lambda: pipes["bob"].lost >= 1, 10)
        # (its own connection, under the id it had, is reported gone: not alice's)
        assert [e for e in recorder.events if e[0] == "message"] == [
            ("message", b"same", b"from alice", "CN=alice,O=Example")]
        assert ("gone", b"same") not in recorder.events
        router.sendMessage(b"same", [b"for alice"])
        await wait_until(lambda: pipes["alice"].messages == [[b"for alice"]], 10)
        assert pipes["bob"].messages == []
    finally:
        for dealer in dealers.values():
            await dealer.close()
        await router.close()


@pytest_twisted.ensureDeferred
async def test_a_tls_listener_closes_the_connections_it_refuses_at_its_cap(tmp_path: Path) -> None:
    """A TLS listener's factory is wrapped: a refused connection needs a
    protocol that closes it (the wrapper keeps a None protocol's socket open,
    with a traceback each).  Refused ones close; the count of open
    descriptors comes back to what is really open."""
    import socket

    from mdp import transport
    from mdp.transport.stream import StreamRouter

    router, recorder, certs, trusted = await mutual_tls_router(tmp_path, "alice")
    cert, key = certs["alice"]
    base = StreamRouter.accepted
    router.descriptorBudget = lambda: base + 1  # room for alice alone
    pipe = Pipe()
    dealer = transport.connect(f"{router.endpoint}:caCertsDir={trusted}:certKey={cert}:privateKey={key}",
                               pipe, reactor())
    raw: list[socket.socket] = []
    try:
        await wait_until(lambda: pipe.up == 1, 10)
        dealer.sendMessage([b"hello"])  # alice spoke: she keeps her slot
        await wait_until(lambda: len(recorder.events) == 1, 10)
        port = int(router.endpoint.rpartition("port=")[2])
        for _ in range(5):
            raw.append(socket.create_connection(("127.0.0.1", port), timeout=10))

        await wait_until(lambda: all(map(peer_closed, raw)), 10)
        assert router.refused == 5 and pipe.lost == 0
        await wait_until(lambda: StreamRouter.accepted == base + 1, 10)
    finally:
        for sock in raw:
            sock.close()
        await dealer.close()
        await router.close()


@pytest_twisted.ensureDeferred
async def test_a_node_with_curve_opens_no_unauthenticated_door_to_other_machines(
        tmp_path: Path) -> None:
    """CURVE keys and a plain tcp: (or ssl: without caCerts=) listener beyond
    loopback: refused at once, naming the endpoint (it listened in the clear,
    its warning telling to use the CURVE it had been given); loopback and
    unix: listeners may go beside it. A client with keys none of its
    servers would use is refused too (it talked in the clear)."""
    from mdp import Broker
    from mdp.freelance import FreelanceServer, freelance_client

    public, secret = keygen("node", str(tmp_path))
    (tmp_path / "allowed").mkdir()
    keys = {"curveSecret": secret, "curveAllow": str(tmp_path / "allowed")}
    broker = Broker(reactor(), **keys)
    server = FreelanceServer(lambda frames: frames, reactor(), **keys)
    for node in (broker, server):
        # (addresses this machine has not: were one let through, it could not bind)
        for endpoint in ("tcp:port=0:interface=192.0.2.1", "tcp6:port=0:interface=2001\\:db8\\:\\:1",
                         "ssl:0:interface=192.0.2.1:privateKey=k.pem"):
            with pytest.raises(TransportError, match="without authenticating them"):
                node.listen(endpoint)
    bound = await broker.listen("tcp:host=127.0.0.1:port=0")
    try:
        assert bound.endpoint.startswith("tcp:")
    finally:
        await broker.close()
    for model in (1, 2, 3):
        with pytest.raises(ValueError, match="for zmq: endpoints"):
            freelance_client(["tcp:host=127.0.0.1:port=5555"], model, reactor(),
                             curveServerPublic=public)
        mixed = freelance_client(["tcp:host=127.0.0.1:port=5555", "zmq:tcp://127.0.0.1:5556"],
                                 model, reactor(), curveServerPublic=public)  # one uses them
        assert mixed.added == ["tcp:host=127.0.0.1:port=5555", "zmq:tcp://127.0.0.1:5556"]
        await mixed.close()
        later = freelance_client([], model, reactor(), curveServerPublic=public)
        with pytest.raises(ValueError, match="for zmq: endpoints"):  # added one by one
            later.connect("tcp:host=127.0.0.1:port=5555")
        assert later.added == []
        await later.close()


def test_a_key_pair_that_cannot_be_written_is_a_value_error_leaving_nothing(
        tmp_path: Path, monkeypatch: Any) -> None:
    """The secret file fails (a full or read-only disk): one line saying why
    (``mdp keygen`` printed a traceback), and no half pair left behind."""
    import zmq.auth

    def half(directory: str, name: str) -> Any:
        (Path(directory) / f"{name}.key").write_text("public")
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(zmq.auth, "create_certificates", half)
    with pytest.raises(ValueError, match="cannot write the key pair k1 in .*Permission denied"):
        keygen("k1", str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_zap_handler_that_failed_to_start_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure to start a context's ZAP handler (e.g. out of descriptors) is
    raised; the next CURVE listener starts one of its own instead of registering
    its allow-list with one that is not running."""
    import zmq
    from twisted.internet import reactor
    from zmq.auth.thread import ThreadAuthenticator

    from mdp.transport import curve

    start = ThreadAuthenticator.start
    calls: list[int] = []

    def flaky(self: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise zmq.ZMQError(24)
        start(self)

    monkeypatch.setattr(ThreadAuthenticator, "start", flaky)
    context = zmq.Context()
    public, secret = zmq.curve_keypair()
    server = CurveServer(public, secret, frozenset())
    try:
        with pytest.raises(zmq.ZMQError):
            curve.zap_domain(context, server, "zmq:tcp://127.0.0.1:1", reactor)
        assert id(context) not in curve._zaps
        curve.zap_domain(context, server, "zmq:tcp://127.0.0.1:1", reactor)
        assert curve._zaps[id(context)].thread.is_alive()
    finally:
        zap = curve._zaps.pop(id(context), None)
        if zap is not None:
            zap.stop()
        context.term()


def test_a_mutual_tls_listener_is_checked_as_written(tmp_path: Path) -> None:
    """The errors of an ``ssl:`` listener with ``caCerts=`` quote the endpoint
    as the user wrote it (no option added on the way) and name a missing file."""
    from mdp import transport

    missing = tmp_path / "missing.pem"
    endpoint = f"ssl:5555:privateKey={tmp_path / 'k.pem'}:caCerts={missing}"
    with pytest.raises(TransportError, match=re.escape(f"bad endpoint {endpoint!r}: "
                                                       f"caCerts={missing}: no such file")):
        transport.check(endpoint, transport.LISTEN)
    bare = f"ssl:5555:caCerts={missing}"
    with pytest.raises(TransportError, match=re.escape(f"bad endpoint {bare!r}: ")):
        transport.check(bare, transport.LISTEN)
