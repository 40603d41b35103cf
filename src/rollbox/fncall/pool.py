"""Warm pools of fncall workers, and the backend that routes a call to one.

A worker is a locked-down container sandbox made through the edge (no network, small
resources, the edge's admission/journal/TTL apply) running ``worker.py`` as one long-running
platform process (``EdgeAPI.platform_exec``) whose stdin/stdout carry framed requests and
results over the agent channel. The pools use only the EdgeAPI interface, so the edge may be
local or remote. A call never
creates a sandbox: it takes an idle worker of its pool (one pool per (language, image,
preloaded modules)), or waits for one while the pool grows under load up to a node-derived cap.
Workers that fail, time out or answer nonsense are destroyed and replaced.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import struct
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbox.agent.protocol import ExecRequest
from rollbox.edge.interface import EdgeAPI
from rollbox.errors import BadRequest, CapacityExceeded, InfraError, RollboxError
from rollbox.metrics import gauge, process_metrics
from rollbox.models import FnCallResult, FnCallSpec, FnCallStep, Resources, SandboxSpec

log = logging.getLogger(__name__)

WORKER_SOURCE = (Path(__file__).with_name("worker.py")).read_text()
FNCALL_IMAGE = "fncall:1"
FALLBACK_IMAGE = "python:3.11"  # python and bash only
# The optional image of the other languages (rollbox.default_images.POLYGLOT_IMAGE, built by
# `rollbox image ensure-polyglot`), and its languages.
POLYGLOT_IMAGE = "fncall-polyglot:1"
POLYGLOT_LANGUAGES = ("go", "java", "rust", "typescript")
# Languages with a build step (the host's backstop adds compile_timeout_s).
COMPILED_LANGUAGES = ("c", "cpp", "go", "java", "rust", "typescript")
# Owner of the worker sandboxes: not a valid project name (iam.keys.PROJECT_RE), so no
# project's key lists or reaches the workers that run every project's calls.
WORKER_OWNER = "@fncall"
CALL_UID = 1000  # unprivileged uid of every call inside a worker sandbox
LEN = struct.Struct(">I")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host-side backstop past a call's own deadlines: the worker enforces them itself.
HOST_GRACE_S = 5.0


@dataclass
class PoolConfig:
    max_workers: int = 0  # 0: derived from the edge's limits and the node's cores
    min_idle: int = 1  # per pool once used
    idle_ttl_s: float = 120.0  # idle workers above min_idle retire after this
    max_calls_per_worker: int = 5000  # recycle (fresh sandbox) now and then
    worker_cpus: float = 1.0
    worker_memory_mib: int = 1536
    worker_pids: int = 256
    worker_disk_mib: int = 512
    worker_ttl_s: float = 24 * 3600


async def default_cap(edge: EdgeAPI) -> int:
    """Workers on this node: bounded by the edge's sandbox limit and by cores (a worker mostly
    waits on its call; 8 per core keeps all cores busy without thrashing)."""
    cap = await edge.capacity()
    max_sb = cap.get("max_sandboxes") if isinstance(cap, Mapping) else None
    max_sb = max_sb if isinstance(max_sb, int) else 64
    return max(2, min(max_sb // 4, 8 * (os.cpu_count() or 1), 64))


class FnWorker:
    """One warm sandbox + its worker process; serves one call at a time."""

    def __init__(self, pool: Pool, sandbox_id: str) -> None:
        self.pool = pool
        self.sandbox_id = sandbox_id
        self.session: Any = None
        self.calls = 0
        self.last_used = time.monotonic()
        self.broken = False
        self._buf = bytearray()
        self._frames: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None
        self.info: dict[str, Any] = {}

    async def start(self, edge: EdgeAPI, preload: list[str], env: dict[str, str]) -> None:
        cfg = {"call_uid": CALL_UID, "preload": preload,
               "env": {"PATH": PATH, "LANG": "C.UTF-8", **env}}
        req = ExecRequest(
            argv=["/usr/bin/python3", "-I", "-c", WORKER_SOURCE, json.dumps(cfg)],
            env=[f"PATH={PATH}", "LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1"],
            cwd="/", stdin=True, stream_limit=1 << 62, tail_limit=0)
        self.session = await edge.platform_exec(self.sandbox_id, req)
        self._reader = asyncio.create_task(self._read())
        async with asyncio.timeout(60):
            ready = await self._frames.get()
        if not ready or not ready.get("ready"):
            raise InfraError(f"fncall worker in {self.sandbox_id} did not start: {ready}")
        self.info = ready

    async def _read(self) -> None:
        try:
            async for kind, payload in self.session.events():
                if kind == "stdout":
                    self._buf += payload
                    while len(self._buf) >= 4:
                        (n,) = LEN.unpack_from(self._buf)
                        if len(self._buf) < 4 + n:
                            break
                        frame = bytes(self._buf[4:4 + n])
                        del self._buf[:4 + n]
                        self._frames.put_nowait(json.loads(frame))
                elif kind == "stderr":
                    log.warning("fncall worker %s: %s", self.sandbox_id,
                                bytes(payload[:2000]).decode(errors="replace").rstrip())
                elif kind == "exited":
                    break
        except Exception as exc:  # noqa: BLE001 - any failure ends the worker
            log.warning("fncall worker %s channel failed: %s", self.sandbox_id, exc)
        self.broken = True
        self._frames.put_nowait(None)

    async def call(self, req: dict[str, Any], backstop_s: float) -> dict[str, Any]:
        data = json.dumps(req, separators=(",", ":")).encode()
        await self.session.write_stdin(LEN.pack(len(data)) + data)
        try:
            async with asyncio.timeout(backstop_s):
                res = await self._frames.get()
        except TimeoutError:
            self.broken = True
            raise InfraError(f"fncall worker {self.sandbox_id} did not answer in time") from None
        if res is None:
            self.broken = True
            raise InfraError(f"fncall worker {self.sandbox_id} died during the call")
        if res.get("id") != req["id"]:
            self.broken = True
            raise InfraError(f"fncall worker {self.sandbox_id} answered out of order")
        self.calls += 1
        self.last_used = time.monotonic()
        return res

    def stop(self) -> None:
        if self._reader:
            self._reader.cancel()


@dataclass
class Pool:
    key: tuple[str, str, tuple[str, ...]]  # (language, image, preload)
    idle: deque[FnWorker] = field(default_factory=deque)
    size: int = 0  # live + starting workers
    starting: int = 0
    waiters: deque[asyncio.Future[FnWorker]] = field(default_factory=deque)
    calls: int = 0


class FnCallBackend:
    """Runs :class:`FnCallSpec` calls on warm workers of one local edge."""

    def __init__(self, edge: EdgeAPI, config: PoolConfig | None = None) -> None:
        self.edge = edge
        self.config = config or PoolConfig()
        self.cap = self.config.max_workers  # 0: default_cap(edge), asked at start()
        self.pools: dict[tuple[str, str, tuple[str, ...]], Pool] = {}
        self._total = 0
        self._ids = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._closed = False
        self._images: dict[str, bool] = {}
        self._metrics_handle: int | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        if not self.cap:
            self.cap = await default_cap(self.edge)
        self._janitor = asyncio.create_task(self._janitor_loop())
        self._metrics_handle = process_metrics().add_collector(self._collect_metrics)

    def _collect_metrics(self) -> list[Any]:
        """Pool sizes by language (bounded: the languages fncall knows), at a scrape."""
        rows: dict[tuple[str, str], float] = {}
        for key, p in list(self.pools.items()):
            for what, n in (("workers", p.size), ("idle", len(p.idle)),
                            ("waiting", len(p.waiters))):
                rows[(key[0], what)] = rows.get((key[0], what), 0) + n
        return [gauge("rollbox_fncall_pool", "fncall workers by language (workers, idle, "
                      "calls waiting)", ["pool", "what"], ([list(k), v] for k, v in rows.items())),
                gauge("rollbox_fncall_workers_cap", "fncall: the node's worker cap", [],
                      [([], float(self.cap))])]

    async def close(self) -> None:
        self._closed = True
        if self._metrics_handle is not None:
            process_metrics().remove_collector(self._metrics_handle)
            self._metrics_handle = None
        if self._janitor:
            self._janitor.cancel()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        workers = [w for p in self.pools.values() for w in p.idle]
        for p in self.pools.values():
            p.idle.clear()
            for fut in p.waiters:
                if not fut.done():
                    fut.set_exception(InfraError("fncall backend closed"))
        await asyncio.gather(*(self._destroy(w) for w in workers), return_exceptions=True)

    async def __aenter__(self) -> FnCallBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stats(self) -> dict[str, Any]:
        return {"cap": self.cap, "workers": self._total, "pools": [
            {"language": k[0], "image": k[1], "preload": list(k[2]), "size": p.size,
             "idle": len(p.idle), "waiting": len(p.waiters), "calls": p.calls}
            for k, p in self.pools.items()]}

    # ---- routing ---------------------------------------------------------------------------
    async def _image_for(self, spec: FnCallSpec) -> str:
        if spec.image:
            return spec.image
        if spec.language in POLYGLOT_LANGUAGES:
            if await self._has_image(POLYGLOT_IMAGE):
                return POLYGLOT_IMAGE
            raise BadRequest(f"language {spec.language!r} runs on the optional image "
                             f"{POLYGLOT_IMAGE}, which this node has not built (`rollbox "
                             "image ensure-polyglot`)")
        if await self._has_image(FNCALL_IMAGE):
            return FNCALL_IMAGE
        if spec.language in ("python", "bash") and await self._has_image(FALLBACK_IMAGE):
            return FALLBACK_IMAGE
        raise InfraError(f"image {FNCALL_IMAGE} is not built (run `rollbox image "
                         "ensure-defaults`)")

    async def _has_image(self, name: str) -> bool:
        """Whether the node has image ``name`` (one of its own: no project's); a found one is
        remembered, a missing one looked up again (it may be built while the server runs)."""
        if name not in self._images:
            try:
                images = await self.edge.image_list(None)
            except RollboxError:
                return False
            if not any(i.name == name and i.owner is None for i in images):
                return False
            self._images[name] = True
        return True

    async def call(self, spec: FnCallSpec) -> FnCallResult:
        if self._closed:
            raise InfraError("fncall backend closed")
        key = (spec.language, await self._image_for(spec), tuple(spec.preload))
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = Pool(key)
        self._ids += 1
        req = {"id": self._ids, "language": spec.language, "code": spec.code,
               "files": spec.files, "stdin": base64.b64encode(spec.stdin.encode()).decode(),
               "args": spec.args, "env": spec.env, "timeout_s": spec.timeout_s,
               "compile_timeout_s": spec.compile_timeout_s, "memory_mib": spec.memory_mib,
               "max_output": spec.max_output_bytes, "fetch_files": spec.fetch_files}
        backstop = spec.timeout_s + (spec.compile_timeout_s if spec.language in COMPILED_LANGUAGES
                                     else 0) + HOST_GRACE_S
        for attempt in range(3):
            worker = await self._acquire(pool)
            try:
                res = await worker.call(req, backstop)
            except (InfraError, ConnectionError, OSError) as exc:
                worker.broken = True
                self._release(pool, worker)
                if attempt == 2:
                    raise InfraError(f"fncall failed on 3 workers: {exc}") from None
                continue
            except BaseException:
                worker.broken = True  # cancelled mid-call: its answer would be out of step
                self._release(pool, worker)
                raise
            if res.get("error") == "infrastructure":
                worker.broken = True  # e.g. a call's leftovers it could not remove: replace it
            self._release(pool, worker)
            pool.calls += 1
            await self._audit(worker, spec, res)
            return self._result(res, worker)
        raise InfraError("unreachable")

    async def _audit(self, worker: FnWorker, spec: FnCallSpec, res: dict[str, Any]) -> None:
        """One ``fncall.call`` event per call on the worker's sandbox: what ran and how it
        ended, never the code or its output (bounded: < 200 bytes, and a worker serves at most
        ``max_calls_per_worker`` calls)."""
        run = res.get("run") or res.get("compile") or {}
        data = json.dumps({"call": res.get("id"), "language": spec.language,
                           "status": str(res.get("status", res.get("error")))[:32],
                           "exit_code": run.get("exit_code"),
                           "wall_ms": round(float(run.get("wall_s") or 0) * 1000, 2),
                           "code_bytes": len(spec.code)}, separators=(",", ":"))
        try:
            await self.edge.record_event(worker.sandbox_id, "fncall.call", data)
        except Exception as exc:  # noqa: BLE001 - the audit trail never fails a call
            log.warning("fncall: audit event for %s: %s", worker.sandbox_id, exc)

    @staticmethod
    def _result(res: dict[str, Any], worker: FnWorker) -> FnCallResult:
        if "error" in res:
            if res["error"] == "bad_request":
                raise BadRequest(str(res.get("message")))
            raise InfraError(str(res.get("message")))

        def step(d: dict[str, Any] | None) -> FnCallStep | None:
            if d is None:
                return None
            d = dict(d)
            d["stdout"] = base64.b64decode(d["stdout"]).decode(errors="replace")
            d["stderr"] = base64.b64decode(d["stderr"]).decode(errors="replace")
            return FnCallStep(**d)

        run = step(res.get("run"))
        comp = step(res.get("compile"))
        main = run or comp
        assert main is not None
        return FnCallResult(
            status=res["status"], exit_code=main.exit_code, signal=main.signal,
            stdout=run.stdout if run else "", stderr=main.stderr,
            stdout_bytes=run.stdout_bytes if run else 0, stderr_bytes=main.stderr_bytes,
            truncated=bool(run and (len(run.stdout.encode()) < run.stdout_bytes
                                    or len(run.stderr.encode()) < run.stderr_bytes)),
            wall_s=run.wall_s if run else 0.0, cpu_s=run.cpu_s if run else 0.0,
            compile=comp, files=res.get("files") or {}, worker=worker.sandbox_id)

    async def batch(self, specs: list[FnCallSpec], concurrency: int = 32
                    ) -> list[FnCallResult | RollboxError]:
        """Run many calls with at most ``concurrency`` in flight; results in input order
        (a call that failed with a typed error gives that error in its place)."""
        sem = asyncio.Semaphore(max(1, concurrency))

        async def one(spec: FnCallSpec) -> FnCallResult | RollboxError:
            async with sem:
                try:
                    return await self.call(spec)
                except RollboxError as exc:
                    return exc

        return list(await asyncio.gather(*(one(s) for s in specs)))

    # ---- pool sizing -----------------------------------------------------------------------
    async def _acquire(self, pool: Pool) -> FnWorker:
        t0 = time.monotonic()
        try:
            return await self._take(pool)
        finally:
            process_metrics().fncall_wait_seconds.labels(pool.key[0]).observe(
                time.monotonic() - t0)

    async def _take(self, pool: Pool) -> FnWorker:
        while pool.idle:
            w = pool.idle.pop()  # most recently used: warmest caches
            if not w.broken:
                return w
            self._retire(pool, w)
        fut: asyncio.Future[FnWorker] = asyncio.get_running_loop().create_future()
        pool.waiters.append(fut)
        self._grow(pool)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(pool, fut.result())
            with contextlib.suppress(ValueError):
                pool.waiters.remove(fut)
            raise

    def _grow(self, pool: Pool) -> None:
        """Start workers for waiters not covered by workers already starting, within the cap;
        at the cap, retire an idle worker of another pool to make room."""
        want = len(pool.waiters) - pool.starting
        while want > 0:
            if self._total >= self.cap and not self._evict_other(pool):
                return
            self._total += 1
            pool.size += 1
            pool.starting += 1
            want -= 1
            self._spawn(self._start_worker(pool))

    def _evict_other(self, pool: Pool) -> bool:
        for other in self.pools.values():
            if other is not pool and other.idle:
                self._retire(other, other.idle.popleft())
                return True
        return False

    async def _start_worker(self, pool: Pool) -> None:
        language, image, preload = pool.key
        cfg = self.config
        spec = SandboxSpec(image=image, resources=Resources(
            cpus=cfg.worker_cpus, memory_mib=cfg.worker_memory_mib, pids=cfg.worker_pids,
            disk_mib=cfg.worker_disk_mib, inodes=100_000), ttl_s=cfg.worker_ttl_s,
            labels={"rollbox.backend": "fncall", "rollbox.fncall.language": language},
            qos="latency")
        worker: FnWorker | None = None
        try:
            # Reserved share: calls must not starve behind a node full of new sandboxes.
            info = await self.edge.create(spec, owner=WORKER_OWNER, share="reserved")
            worker = FnWorker(self, info.id)
            await worker.start(self.edge, list(preload), {})
        except asyncio.CancelledError:
            # A cancelled start (a prewarm given up on, close) is no worker: not counted, or
            # the pool stayed "full" of workers that never came and its waiters waited forever.
            pool.starting -= 1
            self._total -= 1
            pool.size -= 1
            if worker is not None:
                await self._destroy(worker)  # logs what it can not delete: stays cancelled
            if pool.waiters and not self._closed:
                self._grow(pool)  # the waiters this start was for
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the waiters
            log.warning("fncall: starting a %s worker failed: %s", language, exc)
            pool.starting -= 1
            if worker is not None:
                await self._destroy(worker)
            self._total -= 1
            pool.size -= 1
            err = exc if isinstance(exc, RollboxError) else InfraError(str(exc))
            if isinstance(exc, CapacityExceeded) or pool.size == 0:
                while pool.waiters:  # nobody else will serve them
                    fut = pool.waiters.popleft()
                    if not fut.done():
                        fut.set_exception(err)
            return
        pool.starting -= 1
        self._hand_over(pool, worker)

    def _hand_over(self, pool: Pool, worker: FnWorker) -> None:
        while pool.waiters:
            fut = pool.waiters.popleft()
            if not fut.done():
                fut.set_result(worker)
                return
        worker.last_used = time.monotonic()
        pool.idle.append(worker)

    def _release(self, pool: Pool, worker: FnWorker) -> None:
        if worker.broken or worker.calls >= self.config.max_calls_per_worker or self._closed:
            self._retire(pool, worker)
            if pool.waiters and not self._closed:
                self._grow(pool)
            return
        self._hand_over(pool, worker)

    def _retire(self, pool: Pool, worker: FnWorker) -> None:
        self._total -= 1
        pool.size -= 1
        self._spawn(self._destroy(worker))

    async def _destroy(self, worker: FnWorker) -> None:
        worker.stop()
        try:
            await self.edge.delete(worker.sandbox_id)
        except RollboxError as exc:
            log.warning("fncall: deleting worker %s: %s", worker.sandbox_id, exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def prewarm(self, language: str, n: int = 1, preload: list[str] | None = None,
                      image: str | None = None) -> None:
        """Bring a pool to at least ``n`` workers (before a burst, or for benchmarks)."""
        spec = FnCallSpec(language=language, code="", preload=preload or [],  # type: ignore[arg-type]
                          image=image)
        key = (spec.language, await self._image_for(spec), tuple(spec.preload))
        pool = self.pools.setdefault(key, Pool(key))
        need = min(n, self.cap) - pool.size
        starts = []
        for _ in range(max(0, need)):
            if self._total >= self.cap:
                break
            self._total += 1
            pool.size += 1
            pool.starting += 1
            starts.append(self._start_worker(pool))
        await asyncio.gather(*starts)

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(5)
            now = time.monotonic()
            for pool in self.pools.values():
                while (len(pool.idle) > self.config.min_idle
                       and now - pool.idle[0].last_used > self.config.idle_ttl_s):
                    self._retire(pool, pool.idle.popleft())
