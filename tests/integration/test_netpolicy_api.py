"""Network policy through the real stack (SDK -> HTTP API -> edge): create with a policy,
set_network live, typed errors for unknown permissions, malformed rules, dead sandboxes."""
from __future__ import annotations

from pathlib import Path

import pytest

import rollbox
from rollbox import errors
from rollbox.api import BackgroundServer
from rollbox.iam import KeyStore
from rollbox.netpolicy import link
from tests.conftest import BOTH_TRANSPORTS, api_app


@BOTH_TRANSPORTS
async def test_set_network_through_api(edge, api_edge, tmp_path: Path) -> None:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    key = keys.create("proj")
    app = api_app(api_edge, edge, keys)
    async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as c:
        plain = await c.create("debian:bookworm")
        assert plain.info.network is None and not link.exists(plain.id)

        sb = await c.create("debian:bookworm", network=["198.51.100.9:80"])
        assert sb.info.network is not None and link.exists(sb.id)
        info = await sb.set_network(["198.51.100.9:443", "example.org:443", "10.1.0.0/16:53/udp"])
        assert info.network is not None and "example.org:443" in info.network.allow
        # The gate answers the sandbox's DNS.
        assert "nameserver" in (await sb.files.read("/etc/resolv.conf")).decode()

        with pytest.raises(errors.BadRequest, match="unknown network permission"):
            await sb.set_network(["nosuchthing"])
        with pytest.raises(errors.BadRequest):
            await sb.set_network(["1.2.3.4:0"])
        with pytest.raises(errors.BadRequest):
            await sb.set_network(["exa mple.org:443"])
        with pytest.raises(errors.BadRequest):
            await c.create("debian:bookworm", network=["1.2.3.4/33:80"])
        # A refused change leaves the policy as it was.
        assert (await c.get(sb.id)).info.network.allow[0] == "198.51.100.9:443"  # type: ignore[union-attr]

        # Late network on a sandbox created without one.
        await plain.set_network([])
        assert link.exists(plain.id)

        await sb.delete()
        assert not link.exists(sb.id)
        with pytest.raises((errors.SandboxDead, errors.NotFound)):
            await sb.set_network([])
        await plain.delete()
        assert not link.exists(plain.id)
