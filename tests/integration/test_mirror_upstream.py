"""The PyPI mirror against a small local upstream we control: it fetches only what the index
lists from the allowed origins, rejects bytes that do not match the index hash (and keeps none),
serves stale index pages when the upstream fails, shares one download among concurrent clients,
and evicts least-recently-used files past its byte bound."""
from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from rollbox.api.server import BackgroundServer
from rollbox.netpolicy.mirror import PypiMirror
from rollbox.netpolicy.mirrors import store

JSON_V1 = "application/vnd.pypi.simple.v1+json"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FakeUpstream:
    """A PEP 691 index: ``files[name] = (bytes served, sha256 announced)``."""

    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    extra_entries: list[dict[str, object]] = field(default_factory=list)
    redirects: dict[str, str] = field(default_factory=dict)  # filename -> Location
    hits: Counter[str] = field(default_factory=Counter)
    meta: dict[str, bytes] = field(default_factory=dict)  # PEP 658: dist name -> METADATA
    html: bool = False  # serve a PEP 503 HTML page instead of PEP 691 JSON
    index_status: int = 200
    slow: float = 0.0
    url: str = ""

    def app(self) -> Starlette:
        async def index(request: Request) -> Response:
            self.hits[request.url.path] += 1
            if self.index_status != 200:
                return Response("no", status_code=self.index_status)
            if request.path_params["project"] != "demo":
                return Response("not found", status_code=404)
            entries: list[dict[str, object]] = [
                {"filename": n, "url": f"{self.url}/packages/{n}", "hashes": {"sha256": h}}
                for n, (_, h) in self.files.items()]
            for e in entries:
                if e["filename"] in self.meta:
                    e["core-metadata"] = {"sha256": sha(self.meta[str(e["filename"])])}
            if self.html:
                links = "".join(
                    f'<a href="/packages/{e["filename"]}#sha256={e["hashes"]["sha256"]}" '  # type: ignore[index]
                    f'data-requires-python="&gt;=3.8">{e["filename"]}</a>' for e in entries)
                return Response(f"<html><body>{links}</body></html>", media_type="text/html")
            return JSONResponse({"meta": {"api-version": "1.0"}, "name": "demo",
                                 "files": entries + self.extra_entries}, media_type=JSON_V1)

        async def package(request: Request) -> Response:
            name = request.path_params["name"]
            self.hits[request.url.path] += 1
            if name in self.redirects:
                return RedirectResponse(self.redirects[name], status_code=302)
            if name.endswith(".metadata"):
                return Response(self.meta[name.removesuffix(".metadata")])
            body = self.files[name][0]

            async def chunks() -> AsyncIterator[bytes]:
                for i in range(0, len(body), 64 * 1024):
                    if self.slow:
                        await asyncio.sleep(self.slow)
                    yield body[i:i + 64 * 1024]
            return StreamingResponse(chunks(), headers={"Content-Length": str(len(body))})

        async def anything(request: Request) -> Response:
            self.hits[request.url.path] += 1
            return Response("evil payload")

        return Starlette(routes=[Route("/simple/{project}/", index),
                                 Route("/packages/{name}", package),
                                 Route("/{path:path}", anything)])


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream()
    async with BackgroundServer(fake.app()) as srv:  # type: ignore[arg-type]
        fake.url = srv.url
        yield fake


@pytest.fixture
async def other_host() -> AsyncIterator[FakeUpstream]:
    """A server on another origin that the mirror must never contact."""
    fake = FakeUpstream()
    async with BackgroundServer(fake.app()) as srv:  # type: ignore[arg-type]
        fake.url = srv.url
        yield fake


class Running:
    def __init__(self, mirror: PypiMirror, url: str, client: httpx.AsyncClient) -> None:
        self.mirror, self.url, self.client = mirror, url, client

    async def get(self, path: str, **kw: object) -> httpx.Response:
        return await self.client.get(self.url + path, **kw)  # type: ignore[arg-type]

    async def file_url(self, name: str) -> str:
        page = (await self.get("/simple/demo/", headers={"Accept": JSON_V1})).json()
        (entry,) = [f for f in page["files"] if f["filename"] == name]
        return entry["url"].replace("../..", "")


async def start(root: Path, upstream: FakeUpstream, **kw: object) -> tuple[Running,
                                                                           BackgroundServer]:
    mirror = PypiMirror(root, index_upstream=f"{upstream.url}/simple/",
                        file_upstreams=(upstream.url,), **kw)  # type: ignore[arg-type]
    srv = BackgroundServer(mirror.app)  # type: ignore[arg-type]
    await srv.start()
    return Running(mirror, srv.url, httpx.AsyncClient(timeout=30)), srv


@pytest.fixture
async def running(tmp_path: Path, upstream: FakeUpstream) -> AsyncIterator[Running]:
    r, srv = await start(tmp_path / "cache", upstream)
    try:
        yield r
    finally:
        await r.client.aclose()
        await srv.stop()


def blobs(root: Path) -> set[str]:
    return {p.name for p in (root / "blobs").glob("*/*")}


async def test_only_listed_files_from_allowed_origins(running: Running, upstream: FakeUpstream,
                                                      other_host: FakeUpstream) -> None:
    good = b"good wheel bytes"
    upstream.files["demo-1.0-py3-none-any.whl"] = (good, sha(good))
    upstream.files["demo-1.1-py3-none-any.whl"] = (b"x", sha(b"x"))
    upstream.redirects["demo-1.1-py3-none-any.whl"] = f"{other_host.url}/packages/steal"
    upstream.extra_entries = [
        {"filename": "evil-1.0.whl", "url": f"{other_host.url}/evil-1.0.whl",
         "hashes": {"sha256": sha(b"evil payload")}},  # off the allowed origins: dropped
        {"filename": "nohash-1.0.whl", "url": f"{upstream.url}/packages/nohash-1.0.whl",
         "hashes": {}},  # can not be verified: dropped
        {"filename": "../../etc/passwd", "url": f"{upstream.url}/x",
         "hashes": {"sha256": "0" * 64}},
    ]
    page = (await running.get("/simple/demo/", headers={"Accept": JSON_V1})).json()
    assert sorted(f["filename"] for f in page["files"]) == sorted(upstream.files)
    html = (await running.get("/simple/demo/")).text
    assert "evil" not in html and "nohash" not in html and other_host.url not in html
    root = (await running.get("/simple/", headers={"Accept": JSON_V1})).json()
    assert root["projects"] == []  # the cache's contents are not listed to tenants

    r = await running.get(await running.file_url("demo-1.0-py3-none-any.whl"))
    assert r.status_code == 200 and r.content == good

    refused = [
        f"/{other_host.url}/evil-1.0.whl",
        "/https://evil.example/x",
        f"/files/demo/{sha(b'evil payload')}/evil-1.0.whl",  # a hash not in the index
        f"/files/demo/{'1' * 64}/demo-1.0-py3-none-any.whl",
        f"/files/demo/{sha(good)}/../../../etc/passwd",
        f"/files/nosuchproject/{'2' * 64}/x.whl",
        "/packages/demo-1.0-py3-none-any.whl",  # upstream paths are not proxied
    ]
    for path in refused:
        r = await running.get(path)
        assert r.status_code == 404, (path, r.status_code, r.text)
    # A listed file whose upstream redirects off the allowed origins: refused, not followed.
    r = await running.get(await running.file_url("demo-1.1-py3-none-any.whl"))
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_bad_response"
    assert sum(other_host.hits.values()) == 0
    assert set(upstream.hits) <= {"/simple/demo/", "/simple/nosuchproject/",
                                  "/packages/demo-1.0-py3-none-any.whl",
                                  "/packages/demo-1.1-py3-none-any.whl"}


async def test_hash_mismatch_is_rejected_and_not_cached(running: Running,
                                                        upstream: FakeUpstream) -> None:
    root = running.mirror.store.root
    upstream.files["demo-1.0.tar.gz"] = (b"tampered", sha(b"what the index says"))
    big = bytes(range(256)) * (12 * 1024)  # 3 MiB: streams before verification ends
    upstream.files["demo-2.0.tar.gz"] = (big, sha(big[:-1] + b"X"))
    upstream.slow = 0.01
    small_url = await running.file_url("demo-1.0.tar.gz")
    for attempt in (1, 2):
        r = await running.get(small_url)
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "hash_mismatch"
        assert upstream.hits["/packages/demo-1.0.tar.gz"] == attempt  # nothing was kept
    # Large file: headers went out before the end, so the body is cut short of its length;
    # no client ever holds the complete wrong file.
    big_url = await running.file_url("demo-2.0.tar.gz")
    received = bytearray()
    with pytest.raises(httpx.RemoteProtocolError):
        async with running.client.stream("GET", running.url + big_url) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_raw():
                received += chunk
    assert len(received) < len(big)
    assert blobs(root) == set()
    assert list((root / "tmp").iterdir()) == []


async def test_stale_index_when_upstream_fails(tmp_path: Path, upstream: FakeUpstream) -> None:
    data = b"v1"
    upstream.files["demo-1.0.tar.gz"] = (data, sha(data))
    r, srv = await start(tmp_path / "cache", upstream, index_ttl=0)
    try:
        assert (await r.get("/simple/demo/")).status_code == 200
        upstream.index_status = 500
        stale = await r.get("/simple/demo/")
        assert stale.status_code == 200 and "demo-1.0.tar.gz" in stale.text
        assert upstream.hits["/simple/demo/"] == 2  # it did try the upstream again
        # Never cached: the upstream's failure is passed on as retryable.
        other = await r.get("/simple/other/")
        assert other.status_code == 503 and other.json()["error"]["retryable"] is True
        assert other.headers["retry-after"]
        upstream.index_status = 200
        missing = await r.get("/simple/other/")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        # Names are normalized (PEP 503) by redirect.
        redirect = await r.get("/simple/De_Mo/")
        assert redirect.status_code == 301 and redirect.headers["location"] == "../de-mo/"
    finally:
        await r.client.aclose()
        await srv.stop()


async def test_concurrent_clients_share_one_download(running: Running,
                                                     upstream: FakeUpstream) -> None:
    body = bytes(range(256)) * (8 * 1024)  # 2 MiB, sent slowly
    upstream.files["demo-3.0.tar.gz"] = (body, sha(body))
    upstream.slow = 0.02
    url = await running.file_url("demo-3.0.tar.gz")
    got = await asyncio.gather(*(running.get(url) for _ in range(6)))
    assert all(g.status_code == 200 and g.content == body for g in got)
    assert upstream.hits["/packages/demo-3.0.tar.gz"] == 1
    assert blobs(running.mirror.store.root) == {sha(body)}


@pytest.mark.parametrize("clock", ["real", "stuck"])
async def test_lru_eviction_past_the_bound(tmp_path: Path, upstream: FakeUpstream, clock: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if clock == "stuck":  # every use within one tick of the file clock: the order must hold
        monkeypatch.setattr(store, "time", SimpleNamespace(time_ns=lambda: 1_700_000_000 * 10**9))
    parts = {n: bytes([i]) * 1000 for i, n in enumerate(("a-1.whl", "b-1.whl", "c-1.whl"))}
    for n, b in parts.items():
        upstream.files[n] = (b, sha(b))
    root = tmp_path / "cache"
    r, srv = await start(root, upstream, max_bytes=2500)
    try:
        urls = {n: await r.file_url(n) for n in parts}
        for n in ("a-1.whl", "b-1.whl", "a-1.whl", "c-1.whl"):  # a used again: b is oldest
            assert (await r.get(urls[n])).content == parts[n]
        assert blobs(root) == {sha(parts["a-1.whl"]), sha(parts["c-1.whl"])}
        assert r.mirror.store.total == 2000
        assert (await r.get(urls["b-1.whl"])).content == parts["b-1.whl"]  # refetched
        assert upstream.hits["/packages/b-1.whl"] == 2
        assert upstream.hits["/packages/a-1.whl"] == 1
    finally:
        await r.client.aclose()
        await srv.stop()
    # A restart keeps the cache and its use order.
    again = PypiMirror(root, index_upstream=f"{upstream.url}/simple/", max_bytes=2500)
    assert list(again.store._lru) == [sha(parts["c-1.whl"]), sha(parts["b-1.whl"])]
    await again.aclose()


async def test_metadata_files_and_html_upstream(running: Running,
                                                upstream: FakeUpstream) -> None:
    wheel, meta = b"wheel", b"Metadata-Version: 2.1\nName: demo\nVersion: 5.0\n"
    upstream.files["demo-5.0-py3-none-any.whl"] = (wheel, sha(wheel))
    upstream.meta["demo-5.0-py3-none-any.whl"] = meta
    page = (await running.get("/simple/demo/", headers={"Accept": JSON_V1})).json()
    (entry,) = page["files"]
    assert entry["core-metadata"] == {"sha256": sha(meta)}
    r = await running.get(entry["url"].replace("../..", "") + ".metadata")
    assert r.status_code == 200 and r.content == meta
    assert sha(meta) in blobs(running.mirror.store.root)
    html = (await running.get("/simple/demo/")).text
    assert f'data-core-metadata="sha256={sha(meta)}"' in html

    # An HTML-only upstream (relative links on its own origin) parses the same way.
    upstream.html = True
    running.mirror.index_ttl = 0
    page = (await running.get("/simple/demo/", headers={"Accept": JSON_V1})).json()
    (entry,) = page["files"]
    assert entry["filename"] == "demo-5.0-py3-none-any.whl"
    assert entry["requires-python"] == ">=3.8"
    assert (await running.get(entry["url"].replace("../..", ""))).content == wheel
