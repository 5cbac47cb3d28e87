"""The suite's NATS and RabbitMQ rows (benchmarks/peers.py): their ratios,
the line a run prints where they cannot run, and a server stopped with
nothing left behind.  Nothing here needs the servers or their clients: the
test of a started server runs only where nats-server is installed."""

from __future__ import annotations

import os

import pytest


def test_a_smoke_run_leaves_the_reference_stacks_out_and_says_so() -> None:
    from benchmarks.__main__ import PEER_STACKS, cases, reference_stacks

    run, notes = reference_stacks(True)
    assert run == ()
    assert set(notes) == set(PEER_STACKS)
    assert all("left out of a smoke run" in note for note in notes.values())
    names = {name for names, _, _ in cases(True) for name in names}
    assert not any(name.endswith(("/ nats", "/ rabbitmq")) for name in names)


def test_a_missing_server_or_library_is_a_line_saying_what_to_install(monkeypatch) -> None:
    from benchmarks import peers
    from benchmarks.__main__ import reference_stacks

    monkeypatch.setattr(peers, "_which", lambda name: None)
    monkeypatch.setattr(peers, "_module", lambda name: None)
    monkeypatch.setattr(peers, "RABBITMQ_SERVER", "/nonexistent/rabbitmq-server")
    run, notes = reference_stacks(False)
    assert run == ()
    assert "skipped" in notes["nats"] and "nats-server" in notes["nats"]
    assert "apt-get install nats-server" in notes["nats"] and ".[bench]" in notes["nats"]
    assert "apt-get install rabbitmq-server" in notes["rabbitmq"] and "pika" in notes["rabbitmq"]


def test_the_reference_cases_run_next_to_ours_with_the_same_shapes() -> None:
    from benchmarks.__main__ import PEER_SHAPES, cases

    entries = cases(False, references=("nats", "rabbitmq"))
    described = {name: d for _, ds, _ in entries for name, d in ds.items()}
    for shape in PEER_SHAPES:
        ours = described[f"{shape} / ours"]
        for peer in ("nats", "rabbitmq"):
            theirs = described[f"{shape} / {peer}"]
            for key in ("mode", "clients", "workers", "n", "window"):
                assert theirs.get(key) == ours.get(key), (shape, peer, key)
            assert theirs["server"]
    assert len(entries) == len(cases(False)) + 2 * len(PEER_SHAPES)


def test_the_report_gives_ours_over_each_reference_stack() -> None:
    from benchmarks.__main__ import PEER_SHAPES, aggregate, markdown, references

    def row(rate: float, cpu: float) -> dict:
        return aggregate([{"rate": rate, "p50_us": 1.0, "p99_us": 2.0, "cpu_s_per_1k": cpu,
                           "cpu_broker_s_per_1k": cpu / 2, "cpu_workers_s_per_1k": cpu / 4,
                           "cpu_clients_s_per_1k": cpu / 4}])

    table = {}
    for shape in PEER_SHAPES:
        table[f"{shape} / ours"] = row(1000.0, 0.2)
        table[f"{shape} / nats"] = row(2000.0, 0.1)
        table[f"{shape} / rabbitmq"] = row(500.0, 0.4)
    found = {r["reference"]: r["value"] for r in references(table)}
    for shape in PEER_SHAPES:
        assert found[f"{shape}: ours / nats"] == pytest.approx(0.5)
        assert found[f"{shape}: ours / rabbitmq"] == pytest.approx(2.0)
        assert found[f"{shape}: CPU per request, ours / nats"] == pytest.approx(2.0)
    text = markdown(table, {}, [], references(table))
    assert "| sync 1x1: ours / nats | 0.500 |" in text
    assert "the server's CPU" in text


@pytest.mark.skipif(not __import__("benchmarks.peers").peers._which("nats-server"),
                    reason="nats-server is not installed")
def test_a_server_is_stopped_and_its_directory_removed() -> None:
    from benchmarks import peers

    server = peers.Server("nats")
    try:
        assert server.endpoint.startswith("nats://127.0.0.1:")
        assert os.path.isdir(server.directory)
        assert peers._session(server.proc.pid) == [server.pid]
    finally:
        server.kill()
    assert peers._session(server.proc.pid) == []
    assert not os.path.exists(server.directory)
