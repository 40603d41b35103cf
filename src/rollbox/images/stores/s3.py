"""``s3://bucket/prefix?endpoint=...``: a chunk store in an S3-compatible bucket.

Every object is PUT whole, so readers never see a partial one; objects are immutable and
content-addressed (refs: last writer wins). boto3's blocking calls run in a private thread pool.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from rollbox.errors import StoreUnreachable
from rollbox.images.stores.base import ObjectStore


class S3ChunkStore(ObjectStore):
    """An S3-compatible bucket (boto3, blocking calls in a private thread pool)."""

    def __init__(self, url: str, bucket: str, prefix: str, *, endpoint: str | None,
                 region: str | None, compression: str = "none", latency_ms: float = 0.0,
                 threads: int = 32, connect_timeout: float = 3.0,
                 read_timeout: float = 30.0, attempts: int = 3) -> None:
        super().__init__(url, compression, latency_ms)
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="s3chunk")
        # boto3 clients are thread-safe; one per store with a connection per worker thread.
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region or "us-east-1",
            config=Config(max_pool_connections=threads, connect_timeout=connect_timeout,
                          read_timeout=read_timeout,
                          retries={"max_attempts": attempts, "mode": "standard"},
                          # Every chunk is SHA-256-verified against its manifest: botocore's
                          # own CRC32 over each 1 MiB body (default since 1.36) only costs CPU.
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _translate(self, exc: Exception, key: str) -> Exception:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                if code == "NoSuchBucket":
                    return StoreUnreachable(f"chunk store {self.url}: no bucket {self.bucket}",
                                            store=self.url)
                return KeyError(key)
            return StoreUnreachable(f"chunk store {self.url}: {code or status}: {exc}",
                                    store=self.url)
        if isinstance(exc, BotoCoreError | OSError):
            return StoreUnreachable(f"chunk store {self.url} unreachable: {exc}", store=self.url)
        return exc

    def _get(self, key: str) -> bytes:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            return bytes(resp["Body"].read())
        except Exception as exc:
            raise self._translate(exc, key) from exc

    def _has(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as exc:
            err = self._translate(exc, key)
            if isinstance(err, KeyError):
                return False
            raise err from exc

    def _put(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as exc:
            err = self._translate(exc, key)
            if isinstance(err, KeyError):  # NoSuchBucket reported as 404 by some servers
                err = StoreUnreachable(f"chunk store {self.url}: cannot write {key}",
                                       store=self.url)
            raise err from exc

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

