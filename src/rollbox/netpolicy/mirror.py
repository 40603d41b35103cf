"""Package mirrors: where a sandbox with a named permission (``pypi``, ``npm``, ``debian``,
``go``) gets its packages. The permission opens the way to a mirror the platform runs or is
configured with, never to the open internet, so an allowed registry can not be used to fetch
arbitrary code from elsewhere. Ships a working caching PyPI proxy (:mod:`.mirrors.pypi`); the
other registries map to off-the-shelf caching proxies (docs/mirrors.md).

Settings (rollbox.config.Settings; env overrides in brackets):

- ``mirrors: dict[str, str]`` [``ROLLBOX_MIRRORS="pypi=http://10.0.0.1:3141/simple/,npm=..."``]:
  permission name -> mirror base URL as a sandbox sees it. ``Settings.mirror_url(name)`` reads
  it; for ``pypi`` it falls back on the built-in proxy's listen address when that is enabled.
  Netpolicy (permissions.py) opens that host:port instead of the registry's hosts, reaches a
  mirror on 127.0.0.1 at the sandbox's gate address (DNAT), and sets the tools' environment;
  :func:`debian_sources` gives apt's sources file for a Debian mirror.
- ``pypi_mirror_enabled: bool`` [``ROLLBOX_PYPI_MIRROR=1``]: the api process (embedded
  ``rollbox serve``) runs the PyPI proxy in-process, on its own address (never the api's).
- ``pypi_mirror_host: str = "127.0.0.1"`` [``ROLLBOX_PYPI_MIRROR_HOST``],
  ``pypi_mirror_port: int = 3141`` [``ROLLBOX_PYPI_MIRROR_PORT``]: where it listens.
- ``pypi_mirror_index_upstream = "https://pypi.org/simple/"`` [``ROLLBOX_PYPI_UPSTREAM``],
  ``pypi_mirror_file_upstreams = ("https://files.pythonhosted.org",)``
  [``ROLLBOX_PYPI_FILE_UPSTREAMS``, comma-separated]: the only origins it ever fetches from.
- ``pypi_mirror_max_bytes = 20 GiB`` [``ROLLBOX_PYPI_MIRROR_MAX_BYTES``]: file cache bound (LRU).
- ``pypi_mirror_index_ttl = 300.0`` s [``ROLLBOX_PYPI_MIRROR_INDEX_TTL``]: index page freshness.
- ``mirror_dir`` (property) = ``data_dir / "mirror"``; the PyPI cache is ``mirror_dir / "pypi"``.

Run it: ``rollbox mirror serve [--host H --port P]``, or in-process (``rollbox.api.mirror``: a
front door of the api app, and ``running_pypi_mirror`` for code and tests). Owns the mirrors only;
must not touch the allow-lists, veths or DNS gate of the rest of :mod:`rollbox.netpolicy`.
"""
from __future__ import annotations

from rollbox.config import Settings
from rollbox.errors import (  # the mirror's errors (re-exported here, where they are raised)
    HashMismatch,
    UpstreamBadResponse,
    UpstreamTooLarge,
    UpstreamUnavailable,
)
from rollbox.netpolicy.mirrors.pypi import PypiMirror

__all__ = [
    "HashMismatch",
    "PypiMirror",
    "UpstreamBadResponse",
    "UpstreamTooLarge",
    "UpstreamUnavailable",
    "debian_sources",
    "pypi_mirror",
]


def pypi_mirror(settings: Settings | None = None) -> PypiMirror:
    s = settings or Settings()
    return PypiMirror(s.mirror_dir / "pypi", index_upstream=s.pypi_mirror_index_upstream,
                      file_upstreams=s.pypi_mirror_file_upstreams,
                      max_bytes=s.pypi_mirror_max_bytes, index_ttl=s.pypi_mirror_index_ttl)


def debian_sources(url: str, suite: str = "bookworm") -> str:
    """A deb822 sources file for /etc/apt/sources.list.d/rollbox.sources through the mirror
    (apt-cacher-ng remap paths ``<url>/debian`` and ``<url>/debian-security``)."""
    base = url.rstrip("/")
    return (f"Types: deb\nURIs: {base}/debian\nSuites: {suite} {suite}-updates\n"
            f"Components: main\n\n"
            f"Types: deb\nURIs: {base}/debian-security\nSuites: {suite}-security\n"
            f"Components: main\n")
