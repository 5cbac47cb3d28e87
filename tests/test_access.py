"""Who may call and serve what: the access policy (its file format) and what
the broker does with it, as a state machine fed events (mdp.testing.Script)
with the identities the transports authenticated."""

from __future__ import annotations

import json
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdp import Broker, HeartbeatPolicy
from mdp.errors import Forbidden
from mdp.majordomo import codec
from mdp.messages import remote_error
from mdp.metrics import BrokerMetrics
from mdp.policy import AccessPolicy, AccessRule
from mdp.testing import Disconnect, Receive, Script, Send

W, C = codec.WORKER_HEADER, codec.CLIENT_HEADER
HB = HeartbeatPolicy(interval=1.0, liveness=3)
ALICE = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a CURVE public key, Z85
WORKER = "CN=worker-1,O=Example"  # a TLS subject

POLICY = """
[[peer]]
identity = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
call = ["echo", "billing.*"]

[[peer]]
identity = "CN=worker-1,O=Example"
serve = ["echo", "billing.*"]

[default]
call = ["public"]
"""


def envelope(client: bytes, assignment: int) -> bytes:
    return client + assignment.to_bytes(8, "big")


def broker_script(policy: AccessPolicy, **kwargs: object) -> tuple[Script, Broker]:
    script = Script()
    broker = Broker(reactor=script.clock, heartbeat=HB, access=policy, **kwargs)
    broker.listen(script.endpoint("broker"))
    script.identities.update({b"A": ALICE, b"W": WORKER, b"M": "someone-else"})
    return script, broker


def load(tmp_path: pathlib.Path, text: str) -> AccessPolicy:
    path = tmp_path / "access.toml"
    path.write_text(text)
    return AccessPolicy.load(str(path))


def request(service: bytes, *body: bytes) -> list[bytes]:
    return [C, codec.C_REQUEST, service, *body]


def error_code(send: Send) -> bytes:
    assert send.frames[:2] == (C, codec.C_FINAL)
    body = send.frames[3:]
    assert len(body) == 3 and body[0] == codec.ERROR_MARKER
    return body[1]


def test_the_policy_file_maps_identities_to_what_they_may_call_and_serve(
        tmp_path: pathlib.Path) -> None:
    policy = load(tmp_path, POLICY)
    assert policy.mayCall(ALICE, b"echo") and policy.mayCall(ALICE, b"billing.invoice")
    assert not policy.mayCall(ALICE, b"billing") and not policy.mayServe(ALICE, b"echo")
    assert policy.mayServe(WORKER, b"billing.x") and not policy.mayCall(WORKER, b"echo")
    # an authenticated peer not listed gets [default]; one of no identity, [anonymous] (nothing)
    assert policy.mayCall("unlisted", b"public") and not policy.mayCall("unlisted", b"echo")
    assert not policy.mayCall(None, b"public") and not policy.mayServe(None, b"echo")


@pytest.mark.parametrize("text, mistake", [
    ("[[peer]]\ncall = ['x']\n", "peer 1: no identity"),
    ("[[peer]]\nidentity = 'k'\nkall = ['x']\n", "unknown key(s) ['kall']"),
    ("[[peer]]\nidentity = 'k'\ncall = 'x'\n", "call is a list"),
    ("[[peer]]\nidentity = 'k'\n[[peer]]\nidentity = 'k'\n", "listed twice"),
    ("[defaults]\ncall = []\n", "unknown section(s) ['defaults']"),
    ("[[peer]\n", "not TOML"),
])
def test_a_mistake_in_the_policy_file_is_named_with_the_file(
        tmp_path: pathlib.Path, text: str, mistake: str) -> None:
    with pytest.raises(ValueError) as caught:
        load(tmp_path, text)
    assert mistake in str(caught.value) and "access.toml" in str(caught.value)


def test_a_forbidden_call_gets_403_and_reaches_no_worker() -> None:
    metrics = BrokerMetrics()
    script, broker = broker_script(AccessPolicy.fromDict({
        "peer": [{"identity": ALICE, "call": ["echo"]}, {"identity": WORKER, "serve": ["*"]}]}),
        metrics=metrics)
    script.feed(Receive(b"W", [W, codec.W_READY, b"echo"]))
    assert len(broker.workers) == 1
    (refused,) = script.feed(Receive(b"A", request(b"secret", b"x")))
    assert refused.to == b"A" and error_code(refused) == b"403"
    assert isinstance(remote_error(b"secret", refused.frames[3:]), Forbidden)
    assert "may not call 'secret'" in refused.frames[5].decode()
    # an unauthenticated peer is refused too; nothing was queued for anyone
    (anonymous,) = script.feed(Receive(b"X", request(b"echo", b"x")))
    assert error_code(anonymous) == b"403"
    assert broker.queued == 0
    assert metrics.denied.labels("secret", "call")._value.get() == 1
    # what is allowed goes through
    assert script.feed(Receive(b"A", request(b"echo", b"hi"))) == [
        Send(b"W", [W, codec.W_REQUEST, envelope(b"A", 1), b"", b"hi"])]


def test_a_worker_that_may_not_serve_a_service_gets_disconnect_on_ready() -> None:
    metrics = BrokerMetrics()
    script, broker = broker_script(AccessPolicy.fromDict({
        "peer": [{"identity": WORKER, "serve": ["echo"]}]}), metrics=metrics)
    for peer, service in ((b"W", b"billing"), (b"M", b"echo"), (b"X", b"echo")):
        assert script.feed(Receive(peer, [W, codec.W_READY, service])) == [
            Send(peer, [W, codec.W_DISCONNECT]), Disconnect(peer)]
    assert broker.workers == {} and broker.services == {}
    assert metrics.denied.labels("billing", "serve")._value.get() == 1
    assert script.feed(Receive(b"W", [W, codec.W_READY, b"echo"])) == []
    assert len(broker.workers) == 1


def test_mmi_answers_only_about_what_the_asker_may_call() -> None:
    script, broker = broker_script(AccessPolicy.fromDict({
        "peer": [{"identity": ALICE, "call": ["echo"]}, {"identity": WORKER, "serve": ["*"]}],
        "default": {"call": ["*"]}}))
    script.identities[b"W2"] = WORKER
    script.feed(Receive(b"W", [W, codec.W_READY, b"echo"]),
                Receive(b"W2", [W, codec.W_READY, b"secret"]))
    assert set(broker.services) == {b"echo", b"secret"}

    def ask(peer: bytes, service: bytes, *body: bytes) -> list[bytes]:
        (reply,) = script.feed(Receive(peer, request(service, *body)))
        return list(reply.frames[3:])

    assert ask(b"A", b"mmi.service", b"echo") == [b"200"]
    assert ask(b"A", b"mmi.service", b"secret") == [b"404"]  # as if it did not exist
    assert set(json.loads(ask(b"A", b"mmi.services", b"")[0])) == {"echo"}
    assert {w["service"] for w in json.loads(ask(b"A", b"mmi.workers", b"")[0])} == {"echo"}
    assert json.loads(ask(b"A", b"mmi.workers", b"secret")[0]) == []
    # a peer allowed everything sees everything
    assert ask(b"M", b"mmi.service", b"secret") == [b"200"]
    assert set(json.loads(ask(b"M", b"mmi.services", b"")[0])) == {"echo", "secret"}


def test_without_a_policy_anyone_calls_and_serves_anything() -> None:
    script = Script()
    broker = Broker(reactor=script.clock, heartbeat=HB)
    broker.listen(script.endpoint("broker"))
    assert script.feed(Receive(b"W", [W, codec.W_READY, b"echo"])) == []
    assert script.feed(Receive(b"X", request(b"echo", b"hi"))) == [
        Send(b"W", [W, codec.W_REQUEST, envelope(b"X", 1), b"", b"hi"])]


def test_an_access_rule_matches_whole_names() -> None:
    rule = AccessRule(call=("billing.*", "echo"))
    assert rule.mayCall("billing.x") and rule.mayCall("echo")
    assert not rule.mayCall("echo2") and not rule.mayCall("xbilling.y")


class Passive:
    """The admission of a passive Binary Star broker: serves nobody."""

    def admitClient(self, now: float) -> bool:
        return False

    def admitWorker(self, now: float) -> bool:
        return False

    def status(self, now: float) -> dict:
        return {"state": "passive"}


def test_a_passive_broker_under_a_policy_still_answers_nothing_but_binarystar() -> None:
    script, broker = broker_script(AccessPolicy.fromDict({
        "peer": [{"identity": ALICE, "call": ["echo"]}]}), admission=Passive())
    # silent, so the client tries the other broker of the pair
    assert script.feed(Receive(b"A", request(b"mmi.services", b""))) == []
    assert script.feed(Receive(b"A", request(b"echo", b"x"))) == []
    (state,) = script.feed(Receive(b"A", request(b"mmi.binarystar", b"")))
    assert json.loads(state.frames[3]) == {"state": "passive"}


def test_mmi_workers_leaves_out_peer_ids_under_a_policy() -> None:
    script, broker = broker_script(AccessPolicy.fromDict({
        "peer": [{"identity": ALICE, "call": ["echo"]}, {"identity": WORKER, "serve": ["*"]}]}))
    script.feed(Receive(b"W", [W, codec.W_READY, b"echo"]))
    (reply,) = script.feed(Receive(b"A", request(b"mmi.workers", b"")))
    (entry,) = json.loads(reply.frames[3])
    assert entry["service"] == "echo" and "id" not in entry


def test_mmi_services_under_a_policy_asks_once_per_service_and_sorts_only_what_is_shown(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing a peer may see is filtered first, then its first
    MAX_ENTRIES names picked: no sort of every service, no view built of
    services it will not see, one policy check per service."""
    from mdp.majordomo import broker_machine as brokerModule
    from mdp.majordomo import mmi

    script, broker = broker_script(AccessPolicy.fromDict({
        "peer": [{"identity": ALICE, "call": ["a-*"]}], "default": {"call": ["*"]}}))
    total = mmi.MAX_ENTRIES + 500
    for n in range(total):  # as many services alice may not see, queued by another peer
        script.feed(Receive(b"M", request(b"a-%05d" % n, b"x")),
                    Receive(b"M", request(b"b-%05d" % n, b"x")))
    assert len(broker.services) == 2 * total
    asked: list[bytes] = []
    mayCall = AccessPolicy.mayCall

    def counted(self: AccessPolicy, identity: object, service: bytes) -> bool:
        asked.append(service)
        return mayCall(self, identity, service)  # type: ignore[arg-type]

    monkeypatch.setattr(AccessPolicy, "mayCall", counted)
    built: list[bytes] = []
    view = brokerModule.ServiceSnapshot

    def counting(name: bytes, *rest: object) -> object:
        built.append(name)
        return view(name, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(brokerModule, "ServiceSnapshot", counting)
    (reply,) = script.feed(Receive(b"A", request(b"mmi.services", b"")))
    listing, more = reply.frames[3:]
    names = sorted(json.loads(listing))
    assert names == [f"a-{n:05d}" for n in range(mmi.MAX_ENTRIES)]
    assert json.loads(more) == {"truncated": True, "total": total}
    assert len(built) == mmi.MAX_ENTRIES
    assert sorted(asked) == sorted(broker.services)  # once each


@given(st.lists(st.text(alphabet="ab.*?[]!-", max_size=6), max_size=4),
       st.text(alphabet="ab.*?[]!-\n", max_size=8))
def test_an_access_rule_matches_as_fnmatchcase_does(patterns: list[str], name: str) -> None:
    import fnmatch

    rule = AccessRule(call=tuple(patterns), serve=tuple(patterns))
    expected = any(fnmatch.fnmatchcase(name, p) for p in patterns)
    assert rule.mayCall(name) is expected and rule.mayServe(name) is expected
