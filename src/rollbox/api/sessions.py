"""Dashboard sessions: the signed cookie a sign-in (``api.dashboard``) exchanges an API key
for, and the principal of a request that carries one (``api.deps.principal``'s fallback for a
GET or HEAD without a key: a session can read, never change anything).

A token is ``b64(json{k, p, a, s, e}).b64(hmac-sha256)`` under a key derived from the api's
port-token secret (replicas that share that secret accept each other's sessions); it names the
key's principal and an expiry, never the key. At every use the key must still be active.

Owns the token format and its checks; must not touch routes.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import Request

from rollbox import errors
from rollbox.iam import Principal

COOKIE = "rollbox_dashboard"
SESSION_TTL_S = 8 * 3600


@dataclass(frozen=True)
class Session:
    principal: Principal
    expires_at: float


class Sessions:
    """Signed session tokens: ``b64(json{k, p, a, s, e}).b64(hmac)``."""

    def __init__(self, secret: bytes, ttl_s: float = SESSION_TTL_S) -> None:
        self._key = hmac.new(secret, b"rollbox-dashboard-session", hashlib.sha256).digest()
        self.ttl_s = ttl_s

    def issue(self, who: Principal, now: float | None = None) -> str:
        body = json.dumps({"k": who.key_id, "p": who.project, "a": who.admin, "s": who.scope,
                           "e": round((now or time.time()) + self.ttl_s)},
                          separators=(",", ":")).encode()
        mac = hmac.new(self._key, body, hashlib.sha256).digest()
        return f"{_b64(body)}.{_b64(mac)}"

    def open(self, token: str, now: float | None = None) -> Session:
        """The session of ``token``; Unauthorized if forged, malformed or expired."""
        body_b64, _, mac_b64 = token.partition(".")
        try:
            body, mac = _unb64(body_b64), _unb64(mac_b64)
        except ValueError:
            raise errors.Unauthorized("malformed dashboard session") from None
        want = hmac.new(self._key, body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            raise errors.Unauthorized("invalid dashboard session")
        d = json.loads(body)
        if d["e"] < (now or time.time()):
            raise errors.Unauthorized("the dashboard session expired: sign in again")
        return Session(Principal(project=d["p"], admin=bool(d["a"]), key_id=d["k"],
                                 scope=d["s"]), float(d["e"]))


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: str) -> bytes:
    if not s or len(s) > 4096:
        raise ValueError("empty or long")
    try:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc)) from None


async def cookie_principal(request: Request) -> Principal | None:
    """The principal of a GET/HEAD request's dashboard session (None: no cookie, or a method
    the cookie may not be used for); Unauthorized for a bad, expired or revoked session."""
    token = request.cookies.get(COOKIE)
    if token is None or request.method not in ("GET", "HEAD"):
        return None
    sessions: Sessions = request.app.state.dashboard_sessions
    session = sessions.open(token)
    await request.app.state.api.keys.key_active(session.principal.key_id)
    return session.principal
