"""Bad input through the real stack (SDK -> HTTP API -> edge -> runc): each gets its typed
error, nothing leaks and a neighbouring sandbox is unaffected."""
from __future__ import annotations

from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.iam import KeyStore
from tests.conftest import BOTH_TRANSPORTS, api_app

BB = "busybox:test"


@BOTH_TRANSPORTS
async def test_bad_input_gets_typed_errors(edge, api_edge, tmp_path: Path) -> None:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    key = keys.create("proj")
    app = api_app(api_edge, edge, keys)
    async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
        neighbour = await c.create(BB)
        await neighbour.files.write("/tmp/keep", "neighbour data")

        with pytest.raises(errors.NotFound):
            await c.create("no-such/image:1")
        with pytest.raises(errors.BadRequest):
            await c.create(BB, memory_mib=-5)
        with pytest.raises(errors.BadRequest):
            await c.create("Bad Image Name!")
        with pytest.raises(errors.BadRequest):
            await c.create(BB, disk_tier="ssd")
        # The platform's labels (graders, fncall workers: a restart re-admits those from the
        # reserved share, outside the project's quota) are not the caller's to set.
        for label in ({"rollbox.grader-of": neighbour.id}, {"rollbox.backend": "fncall"}):
            with pytest.raises(errors.BadRequest):
                await c.create(BB, labels=label)
        assert len(await c.list()) == 1  # nothing half-created
        mem = await c.create(BB, disk_tier="memory")  # the opt-in tier, through the API
        assert mem.info.disk_tier == "memory" and neighbour.info.disk_tier == "disk"
        await mem.delete()
        with pytest.raises(errors.NotFound):
            await c.get(f"{edge.node_id}-0123456789ab")

        sb = await c.create(BB)
        with pytest.raises(errors.BadRequest):
            await sb.exec("true", cwd="/no/such/dir")
        with pytest.raises(errors.BadRequest):
            await sb.exec("true", user="no-such-user")
        with pytest.raises(errors.BadRequest):
            await sb.exec("true", cwd="relative/path")
        with pytest.raises(errors.BadRequest):  # as sent by a client other than the SDK
            await c._t.request("POST", f"/v1/sandboxes/{sb.id}/exec",
                               json={"cmd": "true", "idempotency_key": "bad key!"})
        keyed = await sb.exec("true", idempotency_key="same")
        with pytest.raises(errors.IdempotencyConflict):  # a BadRequest: nothing runs
            await sb.exec("touch /tmp/ran", idempotency_key="same")
        assert (await sb.exec("ls /tmp")).stdout == ""
        with pytest.raises(errors.BadRequest):
            await c._t.request("GET", f"/v1/sandboxes/{sb.id}/exec/{keyed.exec_id}/stream",
                               params={"stdout_offset": -1})
        # Paths are resolved inside the sandbox root: this lands in the sandbox's /etc.
        await sb.files.write("/../../../etc/rollbox-escape-test", "x")
        assert not Path("/etc/rollbox-escape-test").exists()
        assert (await sb.exec("cat /etc/rollbox-escape-test")).stdout == "x"
        await sb.exec("mkfifo /tmp/fifo")
        with pytest.raises(errors.BadRequest):
            await sb.files.read("/tmp/fifo")  # not a regular file: refused, never blocks
        with pytest.raises(errors.NotFound):
            await sb.files.read("/no/such/file")
        # An upload above the sandbox's disk cap: the typed disk-full error, nothing stored.
        small = await c.create(BB, disk_mib=32)
        with pytest.raises(errors.BadRequest) as full:
            await small.files.write("/tmp/big", b"\0" * (48 << 20))
        assert full.value.details.get("reason") == "disk_full"
        with pytest.raises(errors.NotFound):
            await small.files.stat("/tmp/big")
        assert (await small.exec("ls -a /tmp")).stdout.split() == [".", ".."]
        await small.delete()
        edge.limits.max_sandboxes = len(edge.live)
        with pytest.raises(errors.CapacityExceeded) as full:
            await c.create(BB)
        assert full.value.retryable
        edge.limits.max_sandboxes = 2000

        await sb.delete()
        assert edge.leftovers(sb.id) == []
        with pytest.raises(errors.SandboxDead):
            await sb.exec("true")
        with pytest.raises(errors.SandboxDead):
            await sb.files.read("/etc/passwd")

        # The neighbour never noticed any of it.
        assert (await neighbour.exec("cat /tmp/keep")).stdout == "neighbour data"
        await neighbour.delete()
    keys.close()
