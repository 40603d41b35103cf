"""An S3-compatible server on loopback (moto's server mode, in a subprocess) with one bucket.

For tests and benchmarks only: in-memory, no auth checks, bound to 127.0.0.1 on a free port.
A subprocess rather than moto's threaded server so the server's request handling does not
compete for the GIL with the client under measurement.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

# moto accepts any credentials; boto3 refuses to sign without some.
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "rollbox-loopback", "AWS_SECRET_ACCESS_KEY": "unused",
                    "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def loopback_s3(bucket: str = "rollbox-chunks", *, timeout_s: float = 30.0) -> Iterator[str]:
    """Yield the endpoint URL (``http://127.0.0.1:PORT``) of a fresh server with ``bucket``.

    Sets fake credentials in ``os.environ`` for the duration (only where none are set)."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    added = {k: v for k, v in FAKE_CREDENTIALS.items() if k not in os.environ}
    os.environ.update(added)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server on {endpoint} did not start "
                                       f"(exit {proc.poll()})") from None
                time.sleep(0.1)
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        client.close()
        yield endpoint
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for k in added:
            os.environ.pop(k, None)
