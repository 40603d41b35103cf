"""An edge restart re-adopts a microVM with a network policy: the filter at its tap kept
enforcing while no edge ran (denied stayed denied, allowed stayed allowed), the new edge finds
the link and the table again, the gate answers again and set_network works. Real guest and
agent; one boot (``microvm_slow``)."""
from __future__ import annotations

import json

import pytest

from rollbox.models import NetworkPolicy, SandboxSpec
from rollbox.netpolicy import link
from tests.conftest import NodeRestarts, needs_python
from tests.integration.test_microvm_net_tap import PROBE
from tests.integration.test_netpolicy_targets import (  # noqa: F401 - fixtures
    DNS_CLIENT,
    FakeInternet,
    FakeUpstream,
    internet,
    upstream,
)
from tests.redteam.conftest import PY, Boxes

pytestmark = [needs_python, pytest.mark.microvm_slow]


async def probe(boxes: Boxes, sid: str, *specs: tuple[str, str, int]) -> list[str]:
    r = await boxes.run(sid, ["python3", "-c", PROBE, json.dumps(specs)], timeout_s=60)
    return json.loads(r.stdout.splitlines()[-1])


async def test_restart_keeps_the_tap_filter(restarts: NodeRestarts, internet: FakeInternet,  # noqa: F811
                                            upstream: FakeUpstream) -> None:  # noqa: F811
    named, allowed, denied = internet.ips[0], internet.ips[1], internet.ips[2]
    e1 = await restarts.start()
    if not (await e1.capacity())["backends"].get("microvm", {}).get("offered"):
        pytest.skip("this node offers no microVMs")
    rules = ["allowed.example:8080", f"{allowed}:8080"]
    sid = (await e1.create(SandboxSpec(image=PY, backend="microvm",
                                       network=NetworkPolicy(allow=rules)), "t")).id
    internet.route_from(sid)
    lnk = link.find(sid)
    assert lnk is not None
    dns = DNS_CLIENT.replace("open('/etc/resolv.conf').read().split()[1]", repr(lnk.gate_ip))
    b1 = Boxes(e1, None, "microvm")  # type: ignore[arg-type]
    got = json.loads((await b1.run(sid, ["python3", "-c", dns, json.dumps(
        [["allowed.example", 1, False]])], timeout_s=60)).stdout)
    assert list(got.values()) == ["rcode 0 answers 1"]
    assert await probe(b1, sid, ("tcp", named, 8080), ("tcp", denied, 8080)) == [
        "ok hi", "timeout"]
    await restarts.stop()
    e2 = await restarts.start()
    b2 = Boxes(e2, None, "microvm")  # type: ignore[arg-type]
    assert sid in e2.live, "the VM was not re-adopted"
    assert await probe(b2, sid, ("tcp", named, 8080), ("tcp", allowed, 8080),
                       ("tcp", denied, 8080)) == ["ok hi", "ok hi", "timeout"]
    got = json.loads((await b2.run(sid, ["python3", "-c", dns, json.dumps(
        [["exfil.example", 1, False]])], timeout_s=60)).stdout)
    assert list(got.values()) == ["rcode 5 answers 0"]  # the gate is back, still gating
    await e2.set_network(sid, NetworkPolicy(allow=[f"{denied}:8080"]))
    assert await probe(b2, sid, ("tcp", allowed, 8080), ("tcp", denied, 8080)) == [
        "timeout", "ok hi"]
