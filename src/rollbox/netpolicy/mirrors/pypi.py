"""A caching PyPI proxy: PEP 503 HTML and PEP 691 JSON simple index, files served from a
content-addressed cache.

Routes (all GET): ``/simple/`` (empty: the cache's contents are other tenants' business), ``/simple/<project>/``,
``/files/<project>/<sha256>/<filename>`` (and ``<filename>.metadata``, PEP 658), ``/health``.
Nothing else: no path names a host, and a file is fetched only when it is listed, with a sha256,
in the upstream index of that project, from an origin in ``file_upstreams``. Upstream redirects
are followed only within the allowed origins. Files are verified against the index hash before
they are kept; index pages are kept ``index_ttl`` seconds, revalidated with ETags and served
stale while the upstream is down.
"""
from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import os
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from rollbox.errors import NotFound, RollboxError, UpstreamBadResponse, UpstreamUnavailable
from rollbox.netpolicy.mirrors.store import SHA256_RE, BlobStore, read_fd

log = logging.getLogger(__name__)

JSON_V1 = "application/vnd.pypi.simple.v1+json"
HTML_V1 = "application/vnd.pypi.simple.v1+html"
UPSTREAM_ACCEPT = f"{JSON_V1}, {HTML_V1};q=0.2, text/html;q=0.1"
MAX_INDEX_BYTES = 64 << 20  # the largest real project pages are a few MB
MAX_REDIRECTS = 3
MEMORY_INDEXES = 512
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_FILENAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+!-]{0,254}$")


def normalize(name: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def origin(url: str) -> str:
    u = urlsplit(url)
    port = u.port or {"http": 80, "https": 443}.get(u.scheme, 0)
    return f"{u.scheme}://{(u.hostname or '').lower()}:{port}"


def wants_json(accept: str) -> bool:
    """PEP 691 content negotiation: JSON only when the client ranks it above HTML."""
    best_json = best_html = -1.0
    for i, part in enumerate(accept.split(",")):
        kind, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for p in params:
            if p.startswith("q="):
                with contextlib.suppress(ValueError):
                    q = float(p[2:])
        q -= i * 1e-6  # earlier wins a tie
        if kind in (JSON_V1, "application/vnd.pypi.simple.latest+json"):
            best_json = max(best_json, q)
        elif kind in (HTML_V1, "application/vnd.pypi.simple.latest+html", "text/html", "*/*"):
            best_html = max(best_html, q)
    return best_json > best_html


@dataclass
class ProjectIndex:
    """One project's files as the upstream listed them (urls absolute, on allowed origins)."""

    name: str
    files: list[dict[str, Any]]
    fetched_at: float
    etag: str | None = None
    by_sha: dict[str, dict[str, Any]] = field(default_factory=dict)
    rendered: dict[str, bytes] = field(default_factory=dict)  # "json"/"html" -> page body

    def __post_init__(self) -> None:
        self.by_sha = {f["sha256"]: f for f in self.files}

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "files": self.files,
                           "fetched_at": self.fetched_at, "etag": self.etag})

    @classmethod
    def from_json(cls, text: str) -> ProjectIndex:
        d = json.loads(text)
        return cls(d["name"], d["files"], d["fetched_at"], d.get("etag"))


def _hash_of(value: Any) -> str | None:
    """sha256 from a PEP 691 hashes dict or a PEP 658 ``sha256=...`` attribute."""
    if isinstance(value, dict):
        h = value.get("sha256")
    elif isinstance(value, str) and value.startswith("sha256="):
        h = value[len("sha256="):]
    else:
        return None
    return h.lower() if isinstance(h, str) and SHA256_RE.match(h.lower()) else None


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links.append({k: v or "" for k, v in attrs})


def parse_upstream(body: bytes, content_type: str, page_url: str,
                   allowed: set[str]) -> list[dict[str, Any]]:
    """Files of a PEP 691 JSON or PEP 503 HTML page, keeping only those we can verify and may
    fetch: a sha256, a plain filename and a URL on an allowed origin."""
    raw: list[dict[str, Any]] = []
    if "json" in content_type:
        for f in json.loads(body).get("files", []):
            raw.append({
                "filename": f.get("filename"), "url": f.get("url"),
                "sha256": _hash_of(f.get("hashes")),
                "requires_python": f.get("requires-python"),
                "yanked": f.get("yanked", False),
                "metadata_sha256": _hash_of(f.get("core-metadata", f.get("dist-info-metadata"))),
                "size": f.get("size"), "upload_time": f.get("upload-time"),
            })
    else:
        parser = _Anchors()
        parser.feed(body.decode("utf-8", "replace"))
        for a in parser.links:
            href = a.get("href", "")
            url, _, frag = href.partition("#")
            name = urlsplit(url).path.rsplit("/", 1)[-1]
            yanked: bool | str = False
            if "data-yanked" in a:
                yanked = a["data-yanked"] or True
            raw.append({
                "filename": name, "url": url, "sha256": _hash_of(frag),
                "requires_python": a.get("data-requires-python") or None,
                "yanked": yanked,
                "metadata_sha256": _hash_of(a.get("data-core-metadata",
                                                  a.get("data-dist-info-metadata"))),
                "size": None, "upload_time": None,
            })
    files = []
    for f in raw:
        name, url, sha = f["filename"], f["url"], f["sha256"]
        if not (isinstance(name, str) and _FILENAME_RE.match(name) and sha
                and isinstance(url, str)):
            continue
        absolute = urljoin(page_url, url).partition("#")[0]
        if origin(absolute) not in allowed or urlsplit(absolute).scheme not in ("http", "https"):
            continue
        f["url"] = absolute
        files.append(f)
    return files


class PypiMirror:
    """The proxy's state (index cache, blob store, upstream client) and its ASGI ``app``."""

    def __init__(self, root: Path, *, index_upstream: str = "https://pypi.org/simple/",
                 file_upstreams: tuple[str, ...] = ("https://files.pythonhosted.org",),
                 max_bytes: int = 20 << 30, index_ttl: float = 300.0,
                 upstream_timeout: float = 30.0) -> None:
        self.index_upstream = index_upstream.rstrip("/") + "/"
        self.index_origin = origin(self.index_upstream)
        self.file_origins = {origin(u) for u in file_upstreams} | {self.index_origin}
        self.index_ttl = index_ttl
        self.store = BlobStore(root, max_bytes)
        self.index_dir = root / "index"
        self.index_dir.mkdir(parents=True, exist_ok=True)
        self._indexes: OrderedDict[str, ProjectIndex] = OrderedDict()
        self._index_fetches: dict[str, asyncio.Task[ProjectIndex]] = {}
        # trust_env=False: no HTTP(S)_PROXY from the environment, only the upstreams named here.
        # The system trust store (honours SSL_CERT_FILE/DIR), not certifi's: a site's own CA
        # for an internal upstream or a TLS-inspecting egress belongs there.
        self.client = httpx.AsyncClient(
            trust_env=False, follow_redirects=False, verify=ssl.create_default_context(),
            timeout=httpx.Timeout(upstream_timeout, connect=min(10.0, upstream_timeout)),
            headers={"User-Agent": "rollbox-mirror/0.1"})
        self.app = self._build_app()

    async def aclose(self) -> None:
        for t in self._index_fetches.values():
            t.cancel()
        await asyncio.gather(*self._index_fetches.values(), return_exceptions=True)
        await self.store.aclose()
        await self.client.aclose()

    # -- upstream -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _get(self, url: str, allowed: set[str],
                   headers: dict[str, str] | None = None) -> AsyncIterator[httpx.Response]:
        """GET ``url`` streaming, following redirects only within ``allowed`` origins."""
        for _ in range(MAX_REDIRECTS + 1):
            if origin(url) not in allowed:
                raise UpstreamBadResponse("upstream pointed outside the allowed hosts", url=url)
            try:
                async with self.client.stream("GET", url, headers=headers) as r:
                    if r.is_redirect and "location" in r.headers:
                        url = urljoin(url, r.headers["location"])
                        continue
                    yield r
                    return
            except httpx.TransportError as exc:
                raise UpstreamUnavailable(f"upstream unreachable: {exc!r}", url=url) from exc
        raise UpstreamBadResponse("too many upstream redirects", url=url)

    async def _fetch_index(self, project: str, cached: ProjectIndex | None) -> ProjectIndex:
        url = urljoin(self.index_upstream, f"{project}/")
        headers = {"Accept": UPSTREAM_ACCEPT}
        if cached is not None and cached.etag:
            headers["If-None-Match"] = cached.etag
        async with self._get(url, {self.index_origin}, headers) as r:
            if r.status_code == 304 and cached is not None:
                cached.fetched_at = time.time()
                self._save_index(cached)
                return cached
            if r.status_code == 404:
                raise NotFound(f"no project {project!r} upstream", project=project)
            if r.status_code >= 500 or r.status_code == 429:
                raise UpstreamUnavailable(f"upstream answered {r.status_code}", url=url)
            if r.status_code != 200:
                raise UpstreamBadResponse(f"upstream answered {r.status_code}", url=url)
            body = bytearray()
            try:
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_INDEX_BYTES:
                        raise UpstreamBadResponse("upstream index page too large", url=url)
            except httpx.TransportError as exc:
                raise UpstreamUnavailable(f"upstream cut the index: {exc!r}", url=url) from exc
            try:
                files = parse_upstream(bytes(body), r.headers.get("content-type", ""),
                                       str(r.url), self.file_origins)
            except (ValueError, AttributeError) as exc:
                raise UpstreamBadResponse(f"unparsable upstream index: {exc}", url=url) from exc
            idx = ProjectIndex(project, files, time.time(), r.headers.get("etag"))
        self._save_index(idx)
        return idx

    def _index_path(self, project: str) -> Path:
        return self.index_dir / f"{project}.json"

    def _save_index(self, idx: ProjectIndex) -> None:
        path = self._index_path(idx.name)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(idx.to_json())
        os.replace(tmp, path)
        self._remember(idx)

    def _remember(self, idx: ProjectIndex) -> None:
        self._indexes[idx.name] = idx
        self._indexes.move_to_end(idx.name)
        while len(self._indexes) > MEMORY_INDEXES:
            self._indexes.popitem(last=False)

    def _cached_index(self, project: str) -> ProjectIndex | None:
        idx = self._indexes.get(project)
        if idx is None:
            try:
                idx = ProjectIndex.from_json(self._index_path(project).read_text())
            except (FileNotFoundError, ValueError, KeyError):
                return None
            self._remember(idx)
        return idx

    async def index(self, project: str) -> ProjectIndex:
        """The project's index: cached while fresh, refetched after ``index_ttl``, the stale copy
        when the upstream is unreachable."""
        cached = self._cached_index(project)
        if cached is not None and time.time() - cached.fetched_at < self.index_ttl:
            return cached
        task = self._index_fetches.get(project)
        if task is None:  # one upstream request per project however many sandboxes ask
            task = asyncio.create_task(self._fetch_index(project, cached))
            self._index_fetches[project] = task
            task.add_done_callback(lambda _: self._index_fetches.pop(project, None))
        try:
            return await asyncio.shield(task)
        except (UpstreamUnavailable, UpstreamBadResponse) as exc:
            if cached is None:
                raise
            log.warning("serving stale index of %s: %s", project, exc.message)
            return cached

    def _producer(self, url: str) -> Callable[..., Awaitable[None]]:
        async def produce(sink: Callable[[bytes], Awaitable[None]],
                          expect_size: Callable[[int | None], None]) -> None:
            # identity: the hash is of the stored bytes, so no transfer compression to undo.
            async with self._get(url, self.file_origins, {"Accept-Encoding": "identity"}) as r:
                if r.status_code == 404:
                    raise NotFound("upstream has no such file", url=url)
                if r.status_code != 200:
                    cls = (UpstreamUnavailable if r.status_code >= 500 or r.status_code == 429
                           else UpstreamBadResponse)
                    raise cls(f"upstream answered {r.status_code}", url=url)
                length = r.headers.get("content-length")
                expect_size(int(length) if length and length.isdigit() else None)
                try:
                    async for chunk in r.aiter_bytes():
                        await sink(chunk)
                except httpx.TransportError as exc:
                    raise UpstreamUnavailable(f"upstream cut the file: {exc!r}", url=url) from exc
        return produce

    # -- http ---------------------------------------------------------------------------------

    def _build_app(self) -> Starlette:
        async def error(_: Request, exc: Exception) -> Response:
            assert isinstance(exc, RollboxError)
            return JSONResponse(exc.to_payload(), status_code=exc.status,
                                headers={"Retry-After": "5"} if exc.retryable else None)

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            try:
                yield
            finally:
                await self.aclose()

        return Starlette(
            routes=[
                Route("/health", self._health),
                Route("/simple/", self._root),
                Route("/simple/{project}/", self._project),
                Route("/files/{project}/{sha256}/{filename}", self._file),
            ],
            exception_handlers={RollboxError: error},
            lifespan=lifespan,
        )

    async def _health(self, _: Request) -> Response:
        return JSONResponse({"ok": True})

    async def _root(self, request: Request) -> Response:
        # Empty on purpose: what is cached is what other sandboxes installed (tenant
        # information), and installers only read project pages.
        if wants_json(request.headers.get("accept", "")):
            return JSONResponse({"meta": {"api-version": "1.1"}, "projects": []},
                                media_type=JSON_V1)
        return Response("<!DOCTYPE html><html><body></body></html>\n", media_type="text/html")

    async def _project(self, request: Request) -> Response:
        raw = request.path_params["project"]
        if not _NAME_RE.match(raw):
            raise NotFound("not a project name", project=raw)
        project = normalize(raw)
        if project != raw:
            return RedirectResponse(f"../{quote(project)}/", status_code=301)
        idx = await self.index(project)
        as_json = wants_json(request.headers.get("accept", ""))
        headers = {"Cache-Control": f"max-age={int(min(self.index_ttl, 600))}",
                   "Vary": "Accept"}
        # Rendered once per fetched index: big projects list thousands of files.
        key = "json" if as_json else "html"
        body = idx.rendered.get(key)
        if body is None:
            body = (json.dumps(self._json_page(idx.name, idx.files), separators=(",", ":"))
                    if as_json else self._html_page(idx.name, idx.files)).encode()
            idx.rendered[key] = body
        return Response(body, media_type=JSON_V1 if as_json else "text/html", headers=headers)

    @staticmethod
    def _link(project: str, f: dict[str, Any]) -> str:
        # Relative: correct whatever address the sandbox reached the mirror by.
        return f"../../files/{quote(project)}/{f['sha256']}/{quote(f['filename'])}"

    def _json_page(self, project: str, files: list[dict[str, Any]]) -> dict[str, Any]:
        out = []
        for f in files:
            entry: dict[str, Any] = {"filename": f["filename"], "url": self._link(project, f),
                                     "hashes": {"sha256": f["sha256"]}}
            if f.get("requires_python"):
                entry["requires-python"] = f["requires_python"]
            if f.get("yanked"):
                entry["yanked"] = f["yanked"]
            if f.get("metadata_sha256"):
                meta = {"sha256": f["metadata_sha256"]}
                entry["core-metadata"] = meta
                entry["dist-info-metadata"] = meta  # the name pip < 23.3 reads
            if f.get("size") is not None:
                entry["size"] = f["size"]
            if f.get("upload_time"):
                entry["upload-time"] = f["upload_time"]
            out.append(entry)
        return {"meta": {"api-version": "1.1"}, "name": project, "files": out,
                "versions": []}

    def _html_page(self, project: str, files: list[dict[str, Any]]) -> str:
        lines = ["<!DOCTYPE html>", "<html><head><meta name=\"pypi:repository-version\" "
                 "content=\"1.1\"><title>Links for " + html.escape(project) + "</title></head>",
                 "<body><h1>Links for " + html.escape(project) + "</h1>"]
        for f in files:
            attrs = [f'href="{html.escape(self._link(project, f))}#sha256={f["sha256"]}"']
            if f.get("requires_python"):
                attrs.append(f'data-requires-python="{html.escape(f["requires_python"])}"')
            if f.get("yanked"):
                reason = f["yanked"] if isinstance(f["yanked"], str) else ""
                attrs.append(f'data-yanked="{html.escape(reason)}"')
            if f.get("metadata_sha256"):
                m = f"sha256={f['metadata_sha256']}"
                attrs.append(f'data-core-metadata="{m}" data-dist-info-metadata="{m}"')
            lines.append(f"<a {' '.join(attrs)}>{html.escape(f['filename'])}</a><br/>")
        lines.append("</body></html>")
        return "\n".join(lines) + "\n"

    async def _file(self, request: Request) -> Response:
        project = request.path_params["project"]
        sha = request.path_params["sha256"].lower()
        filename = request.path_params["filename"]
        if not (_NAME_RE.match(project) and SHA256_RE.match(sha)):
            raise NotFound("no such file")
        metadata = filename.endswith(".metadata")
        if not metadata:
            fd = self.store.open(sha)  # verified bytes: served even if the index is gone
            if fd is not None:
                return self._stream(read_fd(fd), os.fstat(fd).st_size, filename)
        idx = await self.index(normalize(project))
        entry = idx.by_sha.get(sha)
        want = filename[: -len(".metadata")] if metadata else filename
        if entry is None or entry["filename"] != want:
            raise NotFound("file not listed in the project's index", project=project,
                           filename=filename)
        url, key = entry["url"], sha
        if metadata:
            if not entry.get("metadata_sha256"):
                raise NotFound("no metadata file for this distribution", filename=filename)
            url, key = url + ".metadata", entry["metadata_sha256"]
            fd = self.store.open(key)
            if fd is not None:
                return self._stream(read_fd(fd), os.fstat(fd).st_size, filename)
        fetch = self.store.fetch(key, self._producer(url))
        await fetch.wait_ready(min_bytes=1 << 20, timeout=2.0)
        size = fetch.size if fetch.size is not None else (fetch.written if fetch.done else None)
        return self._stream(self.store.follow(fetch), size, filename)

    @staticmethod
    def _stream(body: AsyncIterator[bytes], size: int | None, filename: str) -> Response:
        headers = {"Cache-Control": "public, max-age=31536000, immutable"}
        if size is not None:
            # A known length makes a cut (failed verification) visible to every client.
            headers["Content-Length"] = str(size)
        media = "text/plain" if filename.endswith(".metadata") else "application/octet-stream"
        return StreamingResponse(body, media_type=media, headers=headers)
