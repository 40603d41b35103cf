"""The table of named permissions: what ``pypi``, ``npm``, ``debian`` and ``go`` open.

A named permission never opens a public registry: it opens the platform's mirror for it (URL
from ``Settings.mirror_url(name)``, i.e. ``ROLLBOX_MIRRORS`` or the built-in PyPI proxy) and
sets the environment a package tool needs to use it. A mirror on this host (wildcard or
loopback address in its URL) is reached by the sandbox at its gate address, forwarded to the
mirror's port and nothing else.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit


@dataclass(frozen=True)
class Permission:
    name: str
    mirror: str  # key of Settings.mirror_url
    env: Callable[[str, str], dict[str, str]]  # (url as the sandbox sees it, host) -> env
    doc: str


def _pip(url: str, host: str) -> dict[str, str]:
    return {"PIP_INDEX_URL": url, "PIP_TRUSTED_HOST": host, "UV_INDEX_URL": url,
            "UV_DEFAULT_INDEX": url}


def _npm(url: str, host: str) -> dict[str, str]:
    return {"NPM_CONFIG_REGISTRY": url, "YARN_REGISTRY": url}


def _debian(url: str, host: str) -> dict[str, str]:
    return {"ROLLBOX_DEBIAN_MIRROR": url}


def _go(url: str, host: str) -> dict[str, str]:
    return {"GOPROXY": url, "GOSUMDB": "off", "GONOSUMCHECK": "1"}


PERMISSIONS: dict[str, Permission] = {
    p.name: p for p in (
        Permission("pypi", "pypi", _pip, "the platform's PyPI mirror (pip, uv)"),
        Permission("npm", "npm", _npm, "the platform's npm registry mirror"),
        Permission("debian", "debian", _debian, "the platform's Debian package mirror"),
        Permission("go", "go", _go, "the platform's Go module proxy"),
    )
}

LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::", "[::]", "::1", "[::1]", ""}


def split_url(url: str) -> tuple[str, int]:
    """(host, port) of a mirror URL; the scheme's default port when none is given."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname is None:
        raise ValueError(f"mirror URL must be http(s)://host[:port]/...: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port


def sandbox_url(url: str, gate_ip: str) -> str:
    """The mirror URL as the sandbox must use it: a mirror on this host is at the gate."""
    parts = urlsplit(url)
    host, port = split_url(url)
    if host not in LOCAL_HOSTS:
        return url
    return urlunsplit((parts.scheme, f"{gate_ip}:{port}", parts.path, parts.query,
                       parts.fragment))
