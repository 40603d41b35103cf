"""The port proxy's own logic without a sandbox (rollbox.api.ports): tokens bound to sandbox,
port and expiry and refused forged, expired or malformed; the port bounds; which requests are
proxied (both forms) and which pass to the api; the token key file made once, root-only."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from rollbox import errors
from rollbox.api.ports import PortConfig, PortProxy, PortTokens, check_port, token_secret

SID = "n0-0123456789ab"


def test_a_token_opens_its_sandbox_and_port_until_it_expires(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    tokens = PortTokens(PortConfig.ephemeral())
    token, exp = tokens.issue(SID, 8000, ttl_s=60)
    tokens.verify(token, SID, 8000)
    for sid, port in ((SID, 8001), ("n0-0123456789ac", 8000)):
        with pytest.raises(errors.PortTokenInvalid) as e:
            tokens.verify(token, sid, port)
        assert e.value.details["reason"] == "forged"
    # another api's key: forged
    with pytest.raises(errors.PortTokenInvalid):
        PortTokens(PortConfig.ephemeral()).verify(token, SID, 8000)
    # a later expiry with the old MAC: forged, not "expired" nor valid
    _, _, mac = token.split(".")
    with pytest.raises(errors.PortTokenInvalid) as e:
        tokens.verify(f"v1.{exp + 3600}.{mac}", SID, 8000)
    assert e.value.details["reason"] == "forged"
    monkeypatch.setattr("rollbox.api.ports.time.time", lambda: exp + 1.0)
    with pytest.raises(errors.PortTokenInvalid) as e:
        tokens.verify(token, SID, 8000)
    assert e.value.details["reason"] == "expired"
    for bad in ("", "v1", "v2.1.x", "v1.x.y", "v1.1.2.3", "v1." + "9" * 300 + ".x"):
        with pytest.raises(errors.PortTokenInvalid) as e:
            tokens.verify(bad, SID, 8000)
        assert e.value.details["reason"] == "malformed"


def test_bad_ports_and_ttls_are_bad_requests() -> None:
    tokens = PortTokens(PortConfig.ephemeral())
    for bad in (0, 65536, -1, True, 8000.0, "80a", "", "0080000"):
        with pytest.raises(errors.BadRequest):
            check_port(bad)
    assert check_port("8000") == 8000 and check_port(1) == 1 and check_port(65535) == 65535
    for ttl in (0, -1, 8 * 24 * 3600):
        with pytest.raises(errors.BadRequest):
            tokens.issue(SID, 8000, ttl_s=ttl)
    with pytest.raises(errors.BadRequest):
        tokens.issue(SID, 0)


def _scope(path: str, host: str = "api:7420", query: bytes = b"") -> dict[str, Any]:
    return {"type": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "headers": [(b"host", host.encode())]}


def test_which_requests_are_proxied() -> None:
    proxy = PortProxy(app=None, api=None, config=PortConfig.ephemeral("Ports.Test:7420"))  # type: ignore[arg-type]
    t = proxy.target(_scope(f"/v1/sandboxes/{SID}/ports/8000/a/b", query=b"x=1"))
    assert t is not None and (t.sandbox_id, t.port, t.form, t.path) == (SID, 8000, "path",
                                                                         b"/a/b?x=1")
    t = proxy.target(_scope(f"/v1/sandboxes/{SID}/ports/8000"))
    assert t is not None and t.path == b"/"
    t = proxy.target(_scope("/x", host=f"8000-{SID}.ports.test:7420"))
    assert t is not None and (t.sandbox_id, t.port, t.form, t.path) == (SID, 8000, "host", b"/x")
    t = proxy.target(_scope("/x", host=f"8000-{SID}.PORTS.test"))
    assert t is not None and t.form == "host"
    for path in ("/v1/sandboxes", f"/v1/sandboxes/{SID}", f"/v1/sandboxes/{SID}/port-tokens",
                 f"/v1/sandboxes/{SID}/exec", "/v1/health"):
        assert proxy.target(_scope(path)) is None, path
    assert proxy.target(_scope("/x", host="ports.test")) is None  # the domain itself: the api
    assert proxy.target(_scope("/x", host=f"8000-{SID}.ports.test.evil")) is None
    with pytest.raises(errors.BadRequest):
        proxy.target(_scope(f"/v1/sandboxes/{SID}/ports/99999/"))
    for host in (f"x-{SID}.ports.test", f"8000.{SID}.ports.test", f"80000-{SID}.ports.test"):
        with pytest.raises((errors.NotFound, errors.BadRequest)):
            proxy.target(_scope("/", host=host))
    no_domain = PortProxy(app=None, api=None, config=PortConfig.ephemeral())  # type: ignore[arg-type]
    assert no_domain.target(_scope("/x", host=f"8000-{SID}.ports.test")) is None


def test_the_token_key_file_is_made_once_and_root_only(tmp_path: Path) -> None:
    a = token_secret(None, tmp_path)
    assert len(a) == 32 and token_secret(None, tmp_path) == a
    mode = stat.S_IMODE(os.stat(tmp_path / "port-token.key").st_mode)
    assert mode == 0o600
    assert token_secret("configured", tmp_path) == b"configured"
    assert [p.name for p in tmp_path.iterdir()] == ["port-token.key"]
