"""The edge of one Ray node as a long-lived Ray actor pinned to it, and the edge registry.

Owns the actor's life: it is detached (outlives the driver that made it), restarted by Ray
without limit when its process dies (``max_restarts=-1``), pinned to its Ray node
(``NodeAffinitySchedulingStrategy(soft=False)``) and takes no CPU slot (``num_cpus=0``). Its
constructor builds an :class:`~rollbox.edge.edge.Edge` from the node's settings (the
``ROLLBOX_*`` variables it is given) with the cluster's job leases
(:class:`~rollbox.jobs.postgres.PostgresLeaseStore` on the DSN file it is given: the edge's
reaper ends the sandboxes of its node whose job expired or ended; closed after the edge),
starts it (a restarted actor re-adopts the node's sandboxes from the edge's journal, commands
included), serves it over HTTP with the cluster token (``rollbox.edge.service.serve_edge``) on
its own event loop thread, and registers
``(node id, url)`` in the GCS key-value store, where api replicas find it. One edge per
rollbox node id: the actor's name is ``edge-<node id>`` in the ``rollbox`` namespace, a second
one is refused (:func:`create_edge` raises BadRequest). Sandboxes are never actors or tasks.
Does not place, route, or hold api state.

The cluster token never is an actor argument (Ray keeps those in its GCS, readable by anyone
who reaches the GCS port): the actor is given the path of a root-only file on its host that
``cluster up``/``join`` wrote (``cluster.local.node_token_path``), and reads it at each
construction (also when Ray restarts it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollbox import errors
from rollbox.terminal import escaped_logging

log = logging.getLogger(__name__)

KV_PREFIX = "edge:"
NAMESPACE = "rollbox"


def actor_name(node_id: str) -> str:
    return f"edge-{node_id}"


class LoopThread:
    """An event loop on a thread of its own running :meth:`_main` (a Ray actor's methods run on
    Ray's threads); ``_main`` sets ``_ready`` once it serves, and an error before that is
    raised by :meth:`_start_loop`."""

    loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    def _start_loop(self, name: str, timeout: float) -> None:
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.result(timeout)

    def _run(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            if not self._ready.done():
                self._ready.set_exception(exc)
            log.exception("%s loop ended", threading.current_thread().name)

    async def _main(self) -> None:
        raise NotImplementedError


class EdgeHost(LoopThread):
    """An edge and its HTTP server on a loop thread of their own (the Ray actor's methods run
    on Ray's threads and reach the edge through :meth:`call`)."""

    def __init__(self, env: Mapping[str, str], host: str, port: int, token: str,
                 dsn_file: str | None = None) -> None:
        self.env = dict(env)
        self.dsn_file = dsn_file  # the cluster's PostgreSQL (job leases); None: no jobs here
        self.host, self.port, self.token = host, port, token
        self.edge: Any = None
        self._stop: asyncio.Event | None = None
        self._stopping: bool | None = None  # shutdown's destroy

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 300) -> None:
        os.environ.update(self.env)  # this process is the node's edge and nothing else
        self._start_loop("rollbox-edge", timeout)

    async def _main(self) -> None:
        from rollbox.config import Settings
        from rollbox.edge.edge import Edge
        from rollbox.edge.service import serve_edge
        from rollbox.events.store import EventLog
        from rollbox.isolation import oom
        from rollbox.jobs.postgres import PostgresLeaseStore

        oom.protect()
        s = Settings()
        s.data_dir.mkdir(parents=True, exist_ok=True)
        leases = None
        if self.dsn_file is not None:
            dsn = Path(self.dsn_file).read_text().strip()
            leases = await PostgresLeaseStore.connect(dsn, max_size=2)
        events = EventLog(s.data_dir / "events.db")
        try:
            self.edge = Edge(s, events, leases=leases)
            self._stop = asyncio.Event()
            await self.edge.start()
            server = serve_edge(self.edge, self.host, self.port, self.token)
            try:
                await server.start()
                self._ready.set_result(None)
                await self._stop.wait()
            finally:
                await server.stop()
                if self._stopping is not None:  # shutdown(): else the edge dies with the process
                    await self.edge.close(destroy=self._stopping)
        finally:
            events.close()
            if leases is not None:
                await leases.close()

    def call(self, coro_fn: Any, timeout: float = 600) -> Any:
        """Run ``await coro_fn(edge)`` on the edge's loop from a Ray thread."""
        assert self.loop is not None

        async def run() -> Any:
            return await coro_fn(self.edge)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def shutdown(self, destroy: bool, timeout: float = 300) -> None:
        """Stop serving, then close the edge (destroying its sandboxes if ``destroy``)."""
        assert self.loop is not None and self._stop is not None
        self._stopping = destroy
        self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)


class EdgeActor:
    """The Ray actor (see the module docstring); made by :func:`create_edge`."""

    def __init__(self, node_id: str, env: Mapping[str, str], host: str, port: int,
                 token_file: str, dsn_file: str | None = None) -> None:
        import ray
        from ray.experimental import internal_kv

        from rollbox.config import Settings

        escaped_logging(logging.WARNING, json_lines=Settings().log_format == "json")
        self.node_id = node_id
        self.ray_node = ray.get_runtime_context().get_node_id()
        self.host = EdgeHost({**env, "ROLLBOX_NODE": node_id}, host, port,
                             read_token(token_file), dsn_file)
        self.host.start()
        internal_kv._internal_kv_put(
            KV_PREFIX + node_id, json.dumps({"node_id": node_id, "url": self.host.url,
                                            "ray_node": self.ray_node}),
            overwrite=True, namespace=NAMESPACE)

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "url": self.host.url, "ray_node": self.ray_node,
                "pid": os.getpid()}

    def capacity(self) -> dict[str, Any]:
        async def cap(edge: Any) -> dict[str, Any]:
            return dict(await edge.capacity())

        return self.host.call(cap)

    def create(self, spec: dict[str, Any], owner: str) -> dict[str, Any]:
        """A create through a Ray actor call (for the control-path measurement)."""
        from rollbox.models import SandboxSpec

        async def create(edge: Any) -> dict[str, Any]:
            info = await edge.create(SandboxSpec.model_validate(spec), owner)
            return info.model_dump(mode="json")

        return self.host.call(create)

    def delete(self, sandbox_id: str) -> None:
        async def delete(edge: Any) -> None:
            await edge.delete(sandbox_id)

        self.host.call(delete)

    def drain(self, on: bool = True) -> int:
        """Refuse new creates while ``on`` (``Edge.drain``: a burst node being released); the
        node's live sandboxes plus creates under way now."""

        async def drain(edge: Any) -> int:
            return int(edge.drain(on))

        return int(self.host.call(drain))

    def leftovers(self) -> dict[str, list[str]]:
        """What of this node's sandboxes is on its host (checked here, on the node): sandbox
        cgroups under the node's parent and the parent itself (removed here if empty), mounts
        below its data or run dir, network namespaces named for it. All empty after a
        shutdown that destroyed its sandboxes."""
        from rollbox.config import Settings
        from rollbox.isolation import cgroups, netns

        s = Settings()
        dirs = (str(s.data_dir) + "/", str(s.run_dir) + "/")
        with open("/proc/self/mountinfo") as f:
            mounts = [mp for line in f if (mp := line.split()[4] + "/").startswith(dirs)]
        cgroups.remove_parent_if_empty(s.cgroup_parent)  # the edge's close leaves none used
        return {"cgroups": [str(p) for p in cgroups.leftover(s.cgroup_parent)],
                "cgroup parents": [str(h / s.cgroup_parent) for h in cgroups.hierarchies()
                                   if (h / s.cgroup_parent).exists()],
                "mounts": mounts,
                "netns": [n for n in netns.list_rollbox()
                          if n.startswith(f"{netns.PREFIX}{self.node_id}-")]}

    def shutdown(self, destroy: bool = True) -> None:
        """Stop the edge (its sandboxes destroyed unless ``destroy`` is False: then the next
        edge of this node re-adopts them) and deregister it; the caller kills the actor."""
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(KV_PREFIX + self.node_id, namespace=NAMESPACE)
        self.host.shutdown(destroy)


def read_token(path: str) -> str:
    """The cluster token from the node's token file; InfraError if it is missing, empty, or
    readable by anyone but its owner (it must stay root's alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise errors.InfraError(f"cluster token file {path}: {exc.strerror}") from None
    with os.fdopen(fd) as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            raise errors.InfraError(f"cluster token file {path} is readable by others "
                                    "(must be 0600)")
        token = f.read().strip()
    if not token:
        raise errors.InfraError(f"cluster token file {path} is empty")
    return token


def ray_node_of(node_id: str) -> str:
    """The Ray node id of rollbox node ``node_id`` (the alive Ray node with its resource)."""
    import ray

    from rollbox.cluster.ray_nodes import NODE_RESOURCE

    for n in ray.nodes():
        if n.get("Alive") and NODE_RESOURCE + node_id in n.get("Resources", {}):
            return str(n["NodeID"])
    raise errors.NotFound(f"no alive Ray node for rollbox node {node_id!r}", node=node_id)


def create_edge(node_id: str, env: Mapping[str, str], host: str, port: int,
                token_file: str, timeout: float = 300, dsn_file: str | None = None,
                resources: Mapping[str, float] | None = None) -> Any:
    """Create node ``node_id``'s edge actor and wait until it serves; BadRequest if that node
    already has one alive (a duplicate node id). ``token_file``: the root-only file on the
    node's host the actor reads the cluster token from. ``dsn_file``: the cluster's
    PostgreSQL DSN (root-only, read by the actor, also when Ray restarts it), whose job
    leases the edge reaps; None: the edge takes no job's sandboxes. ``resources``: custom
    resources the actor holds while it runs (a burst node's edge holds its node's
    ``rollbox_burst`` unit, so Ray does not call the node idle). Needs ``ray.init`` in
    namespace rollbox."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        existing = ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:
        existing = None
    if existing is not None:
        if registered_node_alive(node_id):
            raise errors.BadRequest(f"node id {node_id!r} is already in the cluster",
                                    node=node_id)
        # The edge of a node that died (pinned there, Ray can not restart it elsewhere): the
        # node joins again, with a new Ray node.
        ray.kill(existing, no_restart=True)
        _wait_name_free(node_id)
    cls = ray.remote(EdgeActor)
    try:
        actor = cls.options(
            name=actor_name(node_id), namespace=NAMESPACE, lifetime="detached",
            max_restarts=-1, max_task_retries=0, num_cpus=0, max_concurrency=16,
            resources=dict(resources or {}),
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_of(node_id),
                                                               soft=False),
        ).remote(node_id, dict(env), host, port, token_file, dsn_file)
    except ValueError as exc:  # the name was taken meanwhile
        raise errors.BadRequest(f"node id {node_id!r} is already in the cluster",
                                node=node_id) from exc
    return started(actor, actor.info, timeout)


def started(actor: Any, probe: Any, timeout: float) -> Any:
    """``actor`` once its constructor ran (its first answer to method ``probe``); killed for
    good (no restart) and the error raised if it failed or did not answer in ``timeout``."""
    import ray

    try:
        ray.get(probe.remote(), timeout=timeout)
    except Exception:
        ray.kill(actor, no_restart=True)
        raise
    return actor


def registered_node_alive(node_id: str) -> bool:
    """Whether the Ray node that node ``node_id``'s edge registered from is alive."""
    import ray
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(KV_PREFIX + node_id, namespace=NAMESPACE)
    if not raw:
        return True  # an actor that has not registered yet: starting, not stale
    ray_node = json.loads(raw).get("ray_node")
    return any(n.get("Alive") and n["NodeID"] == ray_node for n in ray.nodes())


def _wait_name_free(node_id: str, timeout: float = 30) -> None:
    import time

    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    raise errors.InfraError(f"the dead edge actor of node {node_id!r} kept its name",
                            node=node_id)


def edge_actor(node_id: str) -> Any:
    import ray

    try:
        return ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:
        raise errors.NotFound(f"no edge actor for node {node_id!r}", node=node_id) from None


def stop_edge(node_id: str, destroy: bool = True, timeout: float = 120,
              verify: bool = False) -> None:
    """Shut node ``node_id``'s edge down (sandboxes destroyed unless not ``destroy``) and
    kill its actor for good (no restart). ``verify``: then ask the actor, on its node, for
    what of its sandboxes is left (:meth:`EdgeActor.leftovers`): InfraError naming it if
    anything is."""
    import ray

    actor = edge_actor(node_id)
    left: dict[str, list[str]] = {}
    try:
        ray.get(actor.shutdown.remote(destroy), timeout=timeout)
        if verify:
            left = {k: v for k, v in ray.get(actor.leftovers.remote(), timeout=60).items() if v}
    finally:
        ray.kill(actor, no_restart=True)
    if left:
        raise errors.InfraError(f"node {node_id}'s edge stopped and left {left}", node=node_id)


def gcs_client(gcs_address: str) -> Any:
    """A GCS client (no ray.init), for :func:`registered_edges`: made once and kept by a
    reader that asks again and again (an api replica, every second)."""
    from ray._raylet import GcsClient

    return GcsClient(address=gcs_address)


def registered_edges(gcs_address: str, client: Any | None = None) -> dict[str, str]:
    """node id -> edge url, as the edges registered themselves in the GCS (no ray.init: a
    GCS client only, what api replicas use; ``client``: one of :func:`gcs_client` to reuse,
    else one is made for this read). Two GCS calls: the keys, then their values at once."""
    client = client if client is not None else gcs_client(gcs_address)
    out: dict[str, str] = {}
    keys = client.internal_kv_keys(KV_PREFIX.encode(), NAMESPACE.encode(), timeout=5)
    if not keys:
        return out
    for raw in client.internal_kv_multi_get(keys, NAMESPACE.encode(), timeout=5).values():
        if raw:
            rec = json.loads(raw)
            out[rec["node_id"]] = rec["url"]
    return out
