"""Cloud bursting's policy (DSec §3.4): which sandbox may go to a burst node, and when.

A sandbox may go to a burst node only when all of these hold:

- its qos is ``batch`` (best-effort; ``latency`` never bursts);
- its backend is ``container`` (microVMs and the others stay on the cluster's own nodes);
- every layer of its image (and of its extra layers) is in the shared chunk store
  (``chunk_store``, a ``posix://`` or ``s3://`` URL: a ``dir://`` store is one node's own), so
  a fresh burst node can load it lazily: the store's ref of the image name and each layer's
  manifest (written last by a push, so a manifest means the whole layer is there);
- the cluster's use is at or above ``burst_threshold`` (default 0.80): the tightest budget
  (sandboxes, CPUs, memory) used over the alive non-burst nodes of the watcher's view.

Placement asks :meth:`BurstPolicy.allows` in its filter (a burst node is a candidate only when
it answers True); :meth:`BurstPolicy.prepare` (async, cached per image for
``burst_layers_ttl_s``) must have looked the spec's layers up first, else the answer is "not
shared". ``rollbox.cluster.burst`` reads :func:`cluster_use` to ask Ray's autoscaler for burst
nodes and give idle ones back.

Owns the eligibility rules and the cache of the shared store's answers. Does not start or stop
nodes (``rollbox.cluster.burst``), choose among nodes (``rollbox.placement.choice``) nor probe
edges (the watcher).
"""
from __future__ import annotations

import logging
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollbox import errors
from rollbox.config import Settings
from rollbox.images.stores import open_store
from rollbox.images.stores.base import ChunkStore
from rollbox.models import SandboxSpec
from rollbox.placement.view import NodeView

log = logging.getLogger(__name__)

BUDGETS = ("sandboxes", "cpus", "memory_mib")
SHARED_SCHEMES = ("posix", "s3")  # a dir:// store is one node's own


@dataclass(frozen=True)
class BurstConfig:
    """The bursting settings (``Settings.burst_*``, docs/settings.md)."""

    threshold: float = 0.80
    idle_s: float = 120.0
    max_nodes: int = 8
    layers_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if not (0 < self.threshold <= 1 and self.idle_s >= 0 and self.max_nodes >= 0
                and self.layers_ttl_s >= 0):
            raise errors.BadRequest("burst settings out of range: 0 < threshold <= 1, "
                                    "idle_s >= 0, max_nodes >= 0, layers_ttl_s >= 0",
                                    threshold=self.threshold, idle_s=self.idle_s,
                                    max_nodes=self.max_nodes)

    @classmethod
    def from_settings(cls, s: Settings) -> BurstConfig:
        return cls(threshold=s.burst_threshold, idle_s=s.burst_idle_s,
                   max_nodes=s.burst_nodes, layers_ttl_s=s.burst_layers_ttl_s)


def is_shared_store(url: str | None) -> bool:
    """Whether chunk store ``url`` is reachable from every node (posix://, s3://)."""
    return bool(url) and urllib.parse.urlsplit(url or "").scheme in SHARED_SCHEMES


def cluster_use(nodes: Sequence[NodeView]) -> float:
    """Use of the cluster's own (non-burst) alive nodes: the tightest budget's used share,
    ``1 - sum(free) / sum(limits)`` over the nodes reporting that budget's size. 0.0 when no
    such node reports a size (nothing to be full); 1.0 when there is no alive own node."""
    own = [n for n in nodes if n.health == "alive" and not n.burst]
    if not own:
        return 1.0
    use = 0.0
    for b in BUDGETS:
        size = free = 0.0
        for n in own:
            limit = n.limits.get(b)
            if limit and b in n.free:
                size += float(limit)
                free += max(0.0, min(float(n.free[b]), float(limit)))
        if size > 0:
            use = max(use, 1.0 - free / size)
    return use


def live_sandboxes(nv: NodeView) -> int:
    """Sandboxes on a node per its view (live at the probe plus creates in progress)."""
    return nv.sandboxes + nv.starting


def image_layers_key(spec: SandboxSpec) -> tuple[str, ...]:
    return (spec.image, *spec.layers)


class BurstPolicy:
    """The rules of the module docstring over one shared chunk store.

    ``store``: the shared chunk store (None: no shared store, nothing bursts; a store that is
    not shared by its URL is refused); ``resolve``: optional, an image name -> its layer
    digests as the api knows them (e.g. the api host's ImageStore): when given, the shared
    store's ref must name the same layers (a stale push is not the image the caller means)."""

    def __init__(self, config: BurstConfig, store: ChunkStore | None, *,
                 resolve: Callable[[str], Sequence[str] | None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if store is not None and not is_shared_store(store.url):
            raise errors.BadRequest(f"chunk store {store.url!r} is not shared (posix:// or "
                                    "s3://): burst nodes could not load its layers",
                                    store=store.url)
        self.config = config
        self.store = store
        self.resolve = resolve
        self.clock = clock
        self._shared: dict[tuple[str, ...], tuple[float, bool]] = {}
        self._use_of: tuple[Sequence[NodeView] | None, float] = (None, 0.0)

    @classmethod
    def from_settings(cls, s: Settings, **kw: object) -> BurstPolicy:
        url = s.chunk_store
        store = open_store(url) if is_shared_store(url) else None
        return cls(BurstConfig.from_settings(s), store, **kw)  # type: ignore[arg-type]

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()

    # ---- the rules ------------------------------------------------------------------------
    @staticmethod
    def kind_ok(spec: SandboxSpec) -> bool:
        """The spec's own rules: qos batch and the container backend."""
        return spec.qos == "batch" and spec.backend == "container"

    def use(self, nodes: Sequence[NodeView]) -> float:
        """:func:`cluster_use` of ``nodes``, computed once per view snapshot (the watcher
        hands out the same sequence until the view changes)."""
        seen, use = self._use_of
        if seen is not nodes:
            use = cluster_use(nodes)
            self._use_of = (nodes, use)
        return use

    def over(self, nodes: Sequence[NodeView]) -> bool:
        return self.use(nodes) >= self.config.threshold

    def layers_shared(self, spec: SandboxSpec) -> bool:
        """The cached answer of :meth:`prepare` for the spec's image and layers (False when
        not looked up, or older than ``layers_ttl_s``)."""
        hit = self._shared.get(image_layers_key(spec))
        return hit is not None and self.clock() - hit[0] <= self.config.layers_ttl_s and hit[1]

    def why_not(self, spec: SandboxSpec, nodes: Sequence[NodeView]) -> str | None:
        """None if ``spec`` may go to a burst node now, else the first rule it fails."""
        if spec.qos != "batch":
            return f"qos {spec.qos} never bursts"
        if spec.backend != "container":
            return f"backend {spec.backend} never bursts"
        if self.store is None:
            return "no shared chunk store"
        if not self.layers_shared(spec):
            return "a layer of the image is not in the shared chunk store"
        if not self.over(nodes):
            return (f"cluster use {self.use(nodes):.2f} is below the burst threshold "
                    f"{self.config.threshold:.2f}")
        return None

    def allows(self, spec: SandboxSpec, nodes: Sequence[NodeView]) -> bool:
        """Placement's hook: may ``spec`` go to a burst node of ``nodes`` now."""
        return (self.kind_ok(spec) and self.store is not None and self.layers_shared(spec)
                and self.over(nodes))

    # ---- the shared store -----------------------------------------------------------------
    async def prepare(self, spec: SandboxSpec) -> bool:
        """Look the spec's layers up in the shared store (cached for ``layers_ttl_s``);
        whether all are there. Only for specs that pass :meth:`kind_ok` (no store call for
        the others). A store that fails counts as "not shared" (logged), never as an error
        of the create."""
        if not self.kind_ok(spec) or self.store is None:
            return False
        key = image_layers_key(spec)
        hit = self._shared.get(key)
        now = self.clock()
        if hit is not None and now - hit[0] <= self.config.layers_ttl_s:
            return hit[1]
        try:
            ok = await self._all_shared(spec)
        except errors.RollboxError as exc:
            log.warning("shared chunk store lookup of %s failed: %s", spec.image[:80], exc)
            ok = False
        self._shared[key] = (now, ok)
        if len(self._shared) > 4096:  # bounded: drop the oldest answers
            for k in sorted(self._shared, key=lambda k: self._shared[k][0])[:1024]:
                del self._shared[k]
        return ok

    async def _digests(self, name: str) -> list[str] | None:
        """The layer digests of image or layer ``name`` per the shared store (None: absent,
        or not the layers the api resolves the name to)."""
        assert self.store is not None
        if name.startswith("sha256-"):
            return [name]
        try:
            ref = await self.store.get_ref(name)
        except errors.NotFound:
            return None
        layers = list(ref.layers)
        if self.resolve is not None:
            local = self.resolve(name)
            if local is not None and list(local) != layers:
                log.info("image %s: the shared store's ref is not the api's", name[:80])
                return None
        return layers

    async def _all_shared(self, spec: SandboxSpec) -> bool:
        assert self.store is not None
        digests: list[str] = []
        for name in image_layers_key(spec):
            got = await self._digests(name)
            if not got:
                return False
            digests += got
        for d in dict.fromkeys(digests):
            if not await self.store.has_manifest(d):
                return False
        return True
