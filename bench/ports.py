"""``rollbox bench ports [--quick] [--json]``: the port proxy (rollbox.api.ports) against a
direct connection to the same service, in the same run.

``rollbox serve`` runs in its own process on a scratch node (its own data dir, cgroup parent,
node id and uid range; the node's images). One python:3.11 sandbox with no network runs a small
HTTP/1.1 service on its 127.0.0.1:8000 (stdlib ``http.server``, keep-alive, a 2 KiB answer).
The two paths:

- proxy: a lean HTTP/1.1 client (raw kept-alive sockets to the api, one per concurrent
  request, answers parsed by httptools: no HTTP library's own cost, as on the direct path) GETs
  ``sandbox.url(8000)`` with the API key: client -> api -> edge (in-process) -> a socket made
  in the sandbox's netns, kept alive by the proxy's pool and reused (``UpstreamPool``);
- direct: the benchmark's own socket made in the sandbox's netns (the peer a client inside
  the sandbox's network would be), a new connection per request (``Connection: close``).

Sequential requests (alternating blocks of both paths, so load drifts hit both alike) give each
path's p50 and the overhead p50 (proxy p50 - direct p50; target <= 2 ms), and the p50 of the
api's ``/v1/health`` on the same client (the hop any api request costs); requests at
concurrency 8 give each path's requests/s. The last line of ``--json`` is one JSON object:
``port_proxy_rps``, ``port_proxy_p50_ms``, ``port_proxy_overhead_p50_ms``, the direct peer's
``direct_rps``/``direct_p50_ms``, the rps ratio and the load average.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import emit, percentile, ratio, say
from rollbox.config import Settings
from rollbox.embedded import ServerProcess
from rollbox.isolation import netns

IMAGE = "python:3.11"
PORT = 8000
BODY = 2048
SERVICE = f"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps a connection alive unless the request closes it
    def do_GET(self):
        body = b"x" * {BODY}
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", {PORT}), H).serve_forever()
"""
REQUEST = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{PORT}\r\nConnection: close\r\n\r\n".encode()


async def direct_get(ns: str) -> int:
    """One request on a new connection made inside the sandbox's netns; the answer's size."""
    loop = asyncio.get_running_loop()
    sock = netns.socket_inside(ns)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", PORT))
        await loop.sock_sendall(sock, REQUEST)
        got = b""
        while data := await loop.sock_recv(sock, 65536):
            got += data
    finally:
        sock.close()
    if not got.startswith(b"HTTP/1.1 200") or not got.endswith(b"x" * BODY):
        raise RuntimeError(f"direct: unexpected answer {got[:80]!r}")
    return len(got)


class _Answer:
    """httptools callbacks of one answer."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.done = False

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


class RawClient:
    """A kept-alive HTTP/1.1 connection to the api, as lean as the direct path's sockets (no
    HTTP library's own cost in either path): one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        import httptools

        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(*self.addr)
        assert self.reader is not None
        head = f"GET {path} HTTP/1.1\r\nHost: {self.addr[0]}:{self.addr[1]}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.writer.write(head.encode())
        answer = _Answer()
        parser = httptools.HttpResponseParser(answer)
        while not answer.done:
            data = await self.reader.read(65536)
            if not data:
                raise RuntimeError("the api closed the connection")
            parser.feed_data(data)
        return parser.get_status_code(), bytes(answer.body)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run(url: str, key: str, n_seq: int, n_conc: int, conc: int) -> dict[str, Any]:
    import rollbox

    async with rollbox.AsyncClient(url, key) as c:
        sb = await c.create(IMAGE)
        try:
            await sb.files.write("/tmp/svc.py", SERVICE.encode())
            await sb.exec_background(["python3", "/tmp/svc.py"])
            ns = netns.PREFIX + sb.id
            target = sb.url(PORT)[len(url):]
            headers = {"Authorization": f"Bearer {key}"}
            host, port = url.removeprefix("http://").rsplit(":", 1)
            clients = [RawClient(host, int(port)) for _ in range(conc)]
            idle = list(clients)
            try:

                async def proxied() -> None:
                    c = idle.pop()
                    try:
                        status, body = await c.get(target, headers)
                    finally:
                        idle.append(c)
                    if status != 200 or len(body) != BODY:
                        raise RuntimeError(f"proxy: {status} {body[:200]!r}")

                deadline = time.monotonic() + 30
                while True:  # the service is up when both paths answer
                    try:
                        await direct_get(ns)
                        await proxied()
                        break
                    except (OSError, RuntimeError):
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
                for _ in range(30):  # warm both
                    await direct_get(ns)
                    await proxied()
                async def health() -> None:  # the api's own hop, for reference
                    c = idle.pop()
                    try:
                        status, _ = await c.get("/v1/health", {})
                    finally:
                        idle.append(c)
                    if status != 200:
                        raise RuntimeError(f"health: {status}")

                seq: dict[str, list[float]] = {"proxy": [], "direct": [], "health": []}
                ops = {"proxy": proxied, "direct": lambda: direct_get(ns), "health": health}
                block = 25
                for i in range(0, n_seq, block):
                    for name in (("proxy", "direct", "health") if (i // block) % 2 == 0
                                 else ("health", "direct", "proxy")):
                        for _ in range(min(block, n_seq - i)):
                            t = time.perf_counter()
                            await ops[name]()
                            seq[name].append(time.perf_counter() - t)

                async def rate(op: Any) -> float:
                    sem = asyncio.Semaphore(conc)

                    async def one() -> None:
                        async with sem:
                            await op()

                    t = time.perf_counter()
                    await asyncio.gather(*(one() for _ in range(n_conc)))
                    return n_conc / (time.perf_counter() - t)

                rps = {"proxy": [], "direct": []}  # type: dict[str, list[float]]
                for name in ("proxy", "direct", "direct", "proxy"):
                    rps[name].append(await rate(ops[name]))
            finally:
                for c in clients:
                    c.close()
        finally:
            await sb.delete()
    p50 = {k: percentile(v, 50) * 1000 for k, v in seq.items()}
    p99 = {k: percentile(v, 99) * 1000 for k, v in seq.items()}
    best = {k: max(v) for k, v in rps.items()}
    return {
        "port_proxy_rps": best["proxy"], "port_proxy_p50_ms": p50["proxy"],
        "port_proxy_p99_ms": p99["proxy"],
        "port_proxy_overhead_p50_ms": p50["proxy"] - p50["direct"],
        "direct_rps": best["direct"], "direct_p50_ms": p50["direct"],
        "direct_p99_ms": p99["direct"],
        # GET /v1/health on the same client: what any api request costs, proxy or not
        "api_health_p50_ms": p50["health"],
        "port_proxy_rps_ratio": ratio(best["proxy"], best["direct"]),
        "target_overhead_p50_ms": 2.0,
        "ok": p50["proxy"] - p50["direct"] <= 2.0,
        "sequential_requests": n_seq, "concurrent_requests": n_conc, "concurrency": conc,
        "answer_bytes": BODY, "loadavg_1m": os.getloadavg()[0],
    }


def main(quick: bool = False, json_out: bool = False) -> dict[str, Any]:
    n_seq, n_conc, conc = (100, 200, 8) if quick else (400, 1000, 8)
    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-ports-"))
    root.chmod(0o711)  # runc resolves the rootfs as the sandbox's unprivileged host uid
    # The node's images, used read-only; its own cgroup parent, and a free uid band and
    # subnet taken at start (Settings.scratch: host_auto), so a node's own server may run.
    node = Settings.scratch(root)
    node.node_id = f"bp{os.getpid()}"
    say(f"rollbox serve (scratch {root}); {IMAGE}, a {BODY}-byte answer on 127.0.0.1:{PORT}: "
        f"{n_seq} sequential requests per path, {n_conc} at c{conc}")
    srv = ServerProcess(node)
    try:
        srv.start()
        res = asyncio.run(run(srv.url, srv.key, n_seq, n_conc, conc))
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    say(f"proxy p50 {res['port_proxy_p50_ms']:.2f} ms vs direct {res['direct_p50_ms']:.2f} ms: "
        f"overhead {res['port_proxy_overhead_p50_ms']:.2f} ms (target <= 2); "
        f"{res['port_proxy_rps']:.0f} vs {res['direct_rps']:.0f} requests/s at c{conc}; "
        f"load {res['loadavg_1m']:.1f}")
    return emit(res, json_out)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
