"""Exposed ports on a microVM (``Backend.open_port``: a relay through the agent, the platform's
busybox nc to the guest's loopback, no guest network): an HTTP request and its answer both
ways, a port nothing listens on is PortNotListening at the first read. One VM restored from
the session's template (tests/conftest.py ``vm_template_node``)."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

from rollbox import errors
from rollbox.backends.platform_work import run_shell
from rollbox.config import Settings
from tests.helpers.vm_template import template_spec, vm_backend

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]


async def _request(b, vm, port: int, path: str) -> bytes:  # noqa: ANN001
    stream = await b.open_port(vm, port)
    try:
        await stream.write(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        out = b""
        while data := await stream.read():
            out += data
        return out
    finally:
        await stream.close()


async def test_a_microvm_port_through_the_agent(vm_template_node: Settings) -> None:
    settings = vm_template_node
    async with vm_backend(settings) as b:
        vm = await b.create(f"{settings.node_id}-port", template_spec(settings))
        try:
            assert vm.network is None  # no NIC: the relay needs none
            code, out = await run_shell(
                vm, "mkdir -p /srv && head -c 200000 /dev/zero | tr '\\0' y > /srv/big && "
                "cd /srv && (python3 -m http.server 8000 --bind 127.0.0.1 "
                ">/tmp/http.log 2>&1 &) ; sleep 0.1", vm.image_env, 60)
            assert code == 0, out
            deadline = time.monotonic() + 60
            while True:
                try:
                    got = await _request(b, vm, 8000, "/big")
                    break
                except errors.PortNotListening:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.5)
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 200") and body == b"y" * 200_000
            with pytest.raises(errors.PortNotListening):
                await _request(b, vm, 8001, "/")
        finally:
            await b.destroy(vm)
        assert b.leftovers(vm.id) == []
