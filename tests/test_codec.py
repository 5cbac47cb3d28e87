"""MDP/0.2 codec: every command round-trips; malformed input gets a precise error."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdp.errors import ProtocolError
from mdp.majordomo import codec

COMMANDS = [
    codec.ClientRequest(b"echo", [b"a", b"b"]),
    codec.ClientPartial(b"echo", [b"part"]),
    codec.ClientFinal(b"echo", [b""]),
    codec.Ready(b"svc.name-1"),
    codec.WorkerRequest(b"\x00\x01client", [b"body"]),
    codec.WorkerPartial(b"cid", [b"x", b"y"]),
    codec.WorkerFinal(b"cid", [b"z"]),
    codec.HEARTBEAT,
    codec.DISCONNECT,
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("dialect", codec.DIALECTS)
def test_round_trip(command: codec.Command, dialect: str) -> None:
    frames = codec.encode(command, dialect)
    assert (frames[0] == b"") is (dialect == codec.MAJORTOMO)
    used, rest = codec.split(frames)
    assert used == dialect
    decoded = codec.decode(rest, dialect)
    if dialect == codec.MAJORTOMO and isinstance(command, (codec.ClientPartial, codec.ClientFinal)):
        assert decoded == type(command)(b"", command.body)  # no service frame in this dialect
    else:
        assert decoded == command


def test_majortomo_dialect_uses_worker_codes_for_client_commands() -> None:
    assert codec.encode(codec.ClientRequest(b"s", [b"b"]), codec.MAJORTOMO) == [
        b"", b"MDPC02", b"\x02", b"s", b"b"]
    assert codec.encode(codec.ClientPartial(b"s", [b"b"]), codec.MAJORTOMO) == [
        b"", b"MDPC02", b"\x03", b"b"]
    assert codec.encode(codec.ClientFinal(b"s", [b"b"]), codec.MAJORTOMO) == [
        b"", b"MDPC02", b"\x04", b"b"]
    assert codec.encode(codec.Ready(b"s"), codec.MAJORTOMO) == [b"", b"MDPW02", b"\x01", b"s"]
    with pytest.raises(ProtocolError, match="majortomo dialect"):
        codec.decode([b"MDPC02", b"\x01", b"s", b"b"], codec.MAJORTOMO)


def test_wire_layout_matches_rfc() -> None:
    assert codec.encode(codec.ClientRequest(b"echo", [b"hi"])) == [b"MDPC02", b"\x01", b"echo", b"hi"]
    assert codec.encode(codec.ClientPartial(b"echo", [b"hi"])) == [b"MDPC02", b"\x02", b"echo", b"hi"]
    assert codec.encode(codec.ClientFinal(b"echo", [b"hi"])) == [b"MDPC02", b"\x03", b"echo", b"hi"]
    assert codec.encode(codec.Ready(b"echo")) == [b"MDPW02", b"\x01", b"echo"]
    assert codec.encode(codec.WorkerRequest(b"c", [b"hi"])) == [b"MDPW02", b"\x02", b"c", b"", b"hi"]
    assert codec.encode(codec.WorkerPartial(b"c", [b"hi"])) == [b"MDPW02", b"\x03", b"c", b"", b"hi"]
    assert codec.encode(codec.WorkerFinal(b"c", [b"hi"])) == [b"MDPW02", b"\x04", b"c", b"", b"hi"]
    assert codec.encode(codec.HEARTBEAT) == [b"MDPW02", b"\x05"]
    assert codec.encode(codec.DISCONNECT) == [b"MDPW02", b"\x06"]


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([], "empty message"),
        ([b"MDPX02", b"\x01"], "unknown protocol header"),
        ([b"MDPC01", b"\x01", b"s", b"b"], "unknown protocol header"),
        ([b"MDPC02"], "no command frame"),
        ([b"MDPC02", b"\x05", b"s", b"b"], "unknown MDP/Client command"),
        ([b"MDPC02", b"\x04", b"s", b"b"], "CANCEL takes 3 frames"),
        ([b"MDPC02", b"\x01"], "missing service name"),
        ([b"MDPC02", b"\x01", b"svc"], "missing body"),
        ([b"MDPC02", b"\x01", b"", b"b"], "empty service name"),
        ([b"MDPC02", b"\x01", b"s\x00", b"b"], "non-printable byte 0x00"),
        ([b"MDPC02", b"\x01", b"caf\xc3\xa9", b"b"], "non-printable byte 0xc3"),
        ([b"MDPC02", b"\x01", b"x" * 256, b"b"], "longer than 255"),
        ([b"MDPW02"], "no command frame"),
        ([b"MDPW02", b"\x08"], "unknown MDP/Worker command"),
        ([b"MDPW02", b"\x07"], "CANCEL takes 3 frames"),
        ([b"MDPW02", b"\x01", b"s", b"x", b"y"], "READY takes 3 frames"),
        ([b"MDPW02", b"\x01"], "READY takes 3 frames, got 2"),
        ([b"MDPW02", b"\x01", b"s", b"extra"], "READY takes 3 frames, got 4"),
        ([b"MDPW02", b"\x01", b""], "empty service name"),
        ([b"MDPW02", b"\x05", b"x"], "HEARTBEAT takes 2 frames, got 3"),
        ([b"MDPW02", b"\x06", b"x"], "DISCONNECT takes 2 frames, got 3"),
        ([b"MDPW02", b"\x04", b"c", b""], "FINAL needs at least 5 frames, got 4"),
        ([b"MDPW02", b"\x02", b"c", b"x", b"b"], "empty envelope delimiter"),
    ],
)
def test_malformed_input_is_rejected_precisely(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        codec.decode(frames)


def test_service_name_accepts_str_and_bytes() -> None:
    assert codec.api_service_name("echo") == b"echo"
    assert codec.api_service_name(b"echo") == b"echo"
    with pytest.raises(ValueError, match="not ASCII"):
        codec.api_service_name("écho")
    with pytest.raises(ValueError, match="empty"):
        codec.api_service_name("")


def test_error_body_round_trip() -> None:
    body = codec.error_body(codec.STATUS_UNAVAILABLE, "no worker")
    assert codec.parse_error_body(body) == (b"503", "no worker")
    assert codec.parse_error_body([b"ordinary", b"reply", b"frames"]) is None
    assert codec.parse_error_body([codec.ERROR_MARKER]) is None


def test_dialect_detection_leaves_rfc_frames_alone() -> None:
    assert codec.split([b"MDPC02", b"\x01"]) == (codec.RFC, [b"MDPC02", b"\x01"])
    assert codec.split([b""]) == (codec.RFC, [b""])
    assert codec.split([b"", b"MDPC02"]) == (codec.MAJORTOMO, [b"MDPC02"])


def test_expect_rejects_the_other_dialect() -> None:
    assert codec.expect([b"", b"MDPW02", b"\x05"], codec.MAJORTOMO) == [b"MDPW02", b"\x05"]
    with pytest.raises(ProtocolError, match="framed for the majortomo dialect, expected rfc"):
        codec.expect([b"", b"MDPW02", b"\x05"], codec.RFC)
    with pytest.raises(ProtocolError, match="framed for the rfc dialect, expected majortomo"):
        codec.expect([b"MDPW02", b"\x05"], codec.MAJORTOMO)


@given(st.lists(st.binary(max_size=12), max_size=8))
def test_decode_never_raises_anything_but_protocol_error(frames: list[bytes]) -> None:
    try:
        codec.decode(frames)
    except ProtocolError:
        pass


@given(
    st.sampled_from([b"MDPC02", b"MDPW02"]),
    st.binary(min_size=1, max_size=1),
    st.lists(st.binary(max_size=6), max_size=6),
)
def test_decode_of_headed_messages_is_total(header: bytes, command: bytes, rest: list[bytes]) -> None:
    frames = [header, command, *rest]
    try:
        decoded = codec.decode(frames)
    except ProtocolError:
        return
    # whatever decodes re-encodes to the same frames
    assert codec.encode(decoded) == frames


@given(
    client=st.binary(min_size=1, max_size=32),
    service=st.binary(min_size=1, max_size=20).map(lambda b: bytes(0x20 + x % 95 for x in b)),
    body=st.lists(st.binary(max_size=16), min_size=1, max_size=4),
    dialect=st.sampled_from(codec.DIALECTS),
)
def test_hot_path_encoders_match_encode(client: bytes, service: bytes, body: list[bytes],
                                        dialect: str) -> None:
    """The broker's object-free encoders give exactly the frames of encode()."""
    assert codec.encode_worker(codec.W_REQUEST, client, body, dialect) == codec.encode(
        codec.WorkerRequest(client, body), dialect)
    assert codec.encode_client_reply(service, body, True, dialect) == codec.encode(
        codec.ClientFinal(service, body), dialect)
    assert codec.encode_client_reply(service, body, False, dialect) == codec.encode(
        codec.ClientPartial(service, body), dialect)
