"""``client.create(image, backend="microvm")`` end to end through the api, the edge and a real
microVM (TCG): streamed output, stdin, a timeout enforced in the guest, a background command
re-attached by id, guest-reported results, a verified teardown. One VM."""
from __future__ import annotations

import pytest

import rollbox
from tests.helpers.vm_guest import real_guest_marks

BB = "busybox:test"
pytestmark = real_guest_marks(BB)


@pytest.fixture
def edge_settings() -> dict:
    return {"vm_accel": "tcg"}  # the KVM probe has its own (slow) test


async def test_sdk_create_exec_stdin_timeout_background_on_a_microvm(edge, api_server) -> None:  # noqa: ANN001
    url, keys = api_server
    cap = (await edge.capacity())["backends"]["microvm"]
    assert cap["offered"] and cap["facts"]["accel"] == "tcg"
    async with rollbox.AsyncClient(url, keys.create("proj")) as client:
        sb = await client.create(BB, backend="microvm", memory_mib=256, disk_mib=64)
        try:
            info = sb.info
            assert info.backend == "microvm" and info.guest_reported
            chunks: list[str] = []
            res = await sb.exec("for i in 1 2 3; do echo line$i; done; echo err >&2",
                                on_stdout=chunks.append)
            assert res.exit_code == 0 and res.guest_reported
            assert "".join(chunks) == "line1\nline2\nline3\n" and res.stderr == "err\n"
            res = await sb.exec(["cat"], stdin="from stdin\n")
            assert res.stdout == "from stdin\n"
            res = await sb.exec("sleep 30", timeout=1.5)
            assert res.timed_out
            proc = await sb.exec_background("sleep 1; echo done-bg")
            again = sb.process(proc.exec_id)  # re-attached by id
            out = [c.data async for c in again.attach()]
            assert b"".join(out) == b"done-bg\n"
            assert (await again.wait()).exit_code == 0
        finally:
            await sb.delete()
        assert edge.leftovers(sb.id) == []
