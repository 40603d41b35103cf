"""A small HTTP + WebSocket service the port tests run inside a sandbox (python:3.11, stdlib
only): ``python3 port_service.py HOST PORT``. Its text is written into the sandbox; it is never
imported by the tests.

GET/POST any path: a JSON echo of method, path, headers and body. ``/cookies``: two
Set-Cookie headers (one host-only, one with a Domain). ``/redirect?to=URL``: a 302 there.
``/stream``: a chunked answer of 5 parts. ``/big?n=N``: N bytes. ``/ws``: a WebSocket echo
(text and binary; masks checked; a close is answered). ``/close``: an echo that closes its
connection (``Connection: close``). The echo names the connection it came on (``peer``: the
client's port) and the service (``who``: the text of /tmp/port_service.who, if any).
"""
import base64
import hashlib
import json
import struct
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
try:
    with open("/tmp/port_service.who") as _f:
        WHO = _f.read()
except OSError:
    WHO = ""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # noqa: ANN002, ANN201
        pass

    def _json(self, obj, status=200, extra=()):  # noqa: ANN001, ANN202
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _echo(self):  # noqa: ANN202
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            body = b"".join(parts)
        close = urlsplit(self.path).path == "/close"
        self._json({"method": self.command, "path": self.path,
                    "headers": {k.lower(): v for k, v in self.headers.items()},
                    "body": body.decode("latin-1"), "peer": self.client_address[1],
                    "who": WHO}, extra=[("Connection", "close")] if close else ())

    def do_POST(self):  # noqa: N802, ANN201
        self._echo()

    def do_PUT(self):  # noqa: N802, ANN201
        self._echo()

    def do_GET(self):  # noqa: N802, ANN201
        url = urlsplit(self.path)
        q = parse_qs(url.query)
        if url.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            return self._websocket()
        if url.path == "/cookies":
            return self._json({}, extra=[("Set-Cookie", "plain=1; Path=/"),
                                         ("Set-Cookie", "tossed=1; Domain=example.test")])
        if url.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", q["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if url.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                part = f"part{i};".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return None
        if url.path == "/big":
            n = int(q["n"][0])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            self.wfile.write(b"x" * n)
            return None
        return self._echo()

    def do_HEAD(self):  # noqa: N802, ANN201
        self.send_response(200)
        self.send_header("Content-Length", "1234")
        self.end_headers()

    def _websocket(self):  # noqa: ANN202
        key = self.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        proto = self.headers.get("Sec-WebSocket-Protocol")
        if proto:
            self.send_header("Sec-WebSocket-Protocol", proto.split(",")[0].strip())
        self.end_headers()
        self.wfile.flush()
        r, w = self.rfile, self.wfile
        while True:
            head = r.read(2)
            if len(head) < 2:
                return
            op, n = head[0] & 0x0F, head[1] & 0x7F
            if not head[1] & 0x80:
                return  # a client frame must be masked
            if n == 126:
                (n,) = struct.unpack(">H", r.read(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", r.read(8))
            mask = r.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(r.read(n)))
            if op == 8:
                w.write(b"\x88" + bytes([len(data)]) + data)
                w.flush()
                return
            if op in (1, 2):
                out = bytes([0x80 | op])
                if len(data) < 126:
                    out += bytes([len(data)])
                elif len(data) < 65536:
                    out += b"\x7e" + struct.pack(">H", len(data))
                else:
                    out += b"\x7f" + struct.pack(">Q", len(data))
                w.write(out + data)
                w.flush()


if __name__ == "__main__":
    srv = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler)
    print("ready", flush=True)
    srv.serve_forever()
