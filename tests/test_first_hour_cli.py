"""What a user meets in the first hour with ``mdp`` and the ``twist`` plugins:
usage errors short and saying what is missing, endpoints given as bare
addresses or empty, a Titanic result that is pending or waited for, Freelance
servers that are all dead, ``mdp status`` against a passive Binary Star broker."""

from __future__ import annotations

import pytest

from mdp import transport
from mdp.errors import TransportError

pytestmark = pytest.mark.timeout(60)

REQUEST_ID = "0b9a3c4e-5d6f-4a1b-8c2d-3e4f5a6b7c8d"


# --- (c) bare addresses ----------------------------------------------------------------


@pytest.mark.parametrize("endpoint, role, meant", [
    ("localhost:5555", transport.CONNECT,
     "did you mean zmq:tcp://localhost:5555 (ZeroMQ) or tcp:host=localhost:port=5555"),
    ("127.0.0.1:5555", transport.CONNECT,
     "did you mean zmq:tcp://127.0.0.1:5555 (ZeroMQ) or tcp:host=127.0.0.1:port=5555"),
    ("127.0.0.1:5555", transport.LISTEN,
     "did you mean zmq:tcp://127.0.0.1:5555 (ZeroMQ) or tcp:5555:interface=127.0.0.1"),
    ("[::1]:5555", transport.CONNECT, "did you mean zmq:tcp://[::1]:5555 (ZeroMQ)"),
    ("*:5555", transport.LISTEN, "did you mean zmq:tcp://*:5555 (ZeroMQ) or tcp:5555 "),
])
def test_a_bare_address_gets_a_suggestion(endpoint: str, role: str, meant: str) -> None:
    with pytest.raises(TransportError) as raised:
        transport.check(endpoint, role)
    assert f"bad endpoint {endpoint!r}: an address with no scheme; {meant}" in str(raised.value)
    assert "unknown scheme" not in str(raised.value)


def test_an_unknown_scheme_still_lists_the_known_ones() -> None:
    with pytest.raises(TransportError, match=r"unknown scheme 'carrier-pigeon' \(known: "):
        transport.check("carrier-pigeon:coop")
