"""``mmi.services`` with more services than a listing holds: those with workers
come first, so requests for names nobody serves cannot push a served one out,
and Titanic still reads its listing."""

from __future__ import annotations

import json

import pytest_twisted

from mdp.majordomo import codec, mmi
from mdp.titanic.dispatcher import services_listed
from tests.conftest import LoopbackNet, RawPeer
from tests.test_mdp_behaviour import echo, make_client, start_broker, start_worker


@pytest_twisted.ensureDeferred
async def test_a_truncated_listing_names_every_service_with_workers(
        clocknet: LoopbackNet) -> None:
    broker, endpoint = await start_broker(clocknet)
    start_worker(clocknet, endpoint, "zz-served", echo)
    crowd = RawPeer(clocknet, endpoint)
    total = mmi.MAX_ENTRIES + 1
    for n in range(total):  # names nobody serves, sorting before the served one
        crowd.send(codec.CLIENT_HEADER, codec.C_REQUEST, b"a-%04d" % n, b"x")
    await clocknet.until(lambda: len(broker.services) == total + 1)
    reply = await clocknet.wait(make_client(clocknet, endpoint).request("mmi.services", b""))
    services = json.loads(reply[0])
    assert len(services) == mmi.MAX_ENTRIES and services["zz-served"]["workers"] == 1
    assert min(services) == "a-0000"  # then by name
    assert json.loads(reply[1]) == {"truncated": True, "total": total + 1}
    listing = services_listed(reply)
    assert listing is not None and listing[b"zz-served"] == 1
