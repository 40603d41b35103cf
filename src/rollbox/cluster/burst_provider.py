"""This host's node provider for Ray's autoscaler: burst nodes as Ray nodes here.

:class:`LocalBurstProvider` is Ray's fake multi-node provider (``FakeMultiNodeProvider``: its
bookkeeping of launched nodes, node ids standing for ips, ``RAY_FAKE_CLUSTER``) whose nodes
start the way every rollbox node on this host starts (:func:`rollbox.cluster.ray_nodes.start_node`):
``ray start`` in a v2 cgroup of the node's own (``rollbox-ray-<port base>/<node id>``), on the
node's fixed ports of the cluster's range (sandboxes reach none of them: platform ports); an
attempt that misses Ray's fixed 30 s registration is killed whole (its cgroup) before the next
one, which takes a fresh Ray node id; terminating a node is ``cgroup.kill`` of that cgroup.

Why not Ray's own fake provider: it starts a node with ``ray._private.node.Node`` inside the
autoscaler's process, holding the provider's lock all along; on a loaded host the raylet misses
the 30 s registration, ``Node()`` raises *after* it started the raylet, and the provider never
records the node: that raylet registers late, holding the burst slot's ``rollbox_node:<id>``,
nothing ever ends it, and the autoscaler launches the slot again (two Ray nodes of one rollbox
node: the burst drill's 1-in-3 failure under load, docs/cluster.md).

Owns the burst nodes' Ray processes on this host. Runs in the autoscaler's process on the head
(Ray imports it by the config's ``provider.module``: ``cluster.autoscaler.local_config``). Does
not start edges nor decide when nodes are needed (``cluster.burst``).
"""
from __future__ import annotations

import logging
from typing import Any

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

from rollbox import errors
from rollbox.cluster import ray_nodes
from rollbox.cluster.ray_nodes import NODE_RESOURCE, ClusterPorts

log = logging.getLogger(__name__)


class LocalBurstProvider(FakeMultiNodeProvider):  # type: ignore[misc]
    """See the module docstring. Runs in the autoscaler's process on the head (Ray imports it
    by ``provider.module``); its config: ``port_base``, ``address``, ``object_store_mib``,
    ``nodes`` (rollbox node id -> node index)."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str) -> None:
        super().__init__(provider_config, cluster_name)
        self.ports = ClusterPorts(int(provider_config["port_base"]))
        self.address = str(provider_config.get("address", "127.0.0.1"))
        self.object_store_mib = int(provider_config.get("object_store_mib", 256))
        self.indexes = {str(k): int(v) for k, v in provider_config["nodes"].items()}

    def _create_node_with_resources_and_labels(self, node_config: dict[str, Any],
                                               tags: dict[str, str], count: int,
                                               resources: dict[str, Any],
                                               labels: dict[str, str]) -> None:
        from ray.autoscaler.tags import (
            NODE_KIND_WORKER,
            STATUS_UP_TO_DATE,
            TAG_RAY_NODE_KIND,
            TAG_RAY_NODE_NAME,
            TAG_RAY_NODE_STATUS,
            TAG_RAY_USER_NODE_TYPE,
        )

        node_type = tags[TAG_RAY_USER_NODE_TYPE]
        ids = [k[len(NODE_RESOURCE):] for k in resources if k.startswith(NODE_RESOURCE)]
        if len(ids) != 1 or ids[0] not in self.indexes:
            raise errors.InfraError(f"node type {node_type}: no burst slot of this cluster",
                                    node_type=node_type)
        node_id = ids[0]
        extra = {k: float(v) for k, v in resources.items()
                 if k not in ("CPU", "GPU", "memory", "object_store_memory")
                 and not k.startswith(NODE_RESOURCE)}
        last: Exception | None = None
        for _ in range(ray_nodes.START_ATTEMPTS):
            with self.lock:  # held only to take an id: a start takes seconds
                ray_id = self._next_hex_node_id()
            env = {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": ray_id, "RAY_CLOUD_INSTANCE_ID": ray_id,
                   "RAY_NODE_TYPE_NAME": node_type}
            try:
                # one attempt per Ray node id: a killed attempt's id is dead in the GCS
                ray_nodes.start_node(self.ports, node_id, self.indexes[node_id], head=False,
                                     address=self.address,
                                     object_store_mib=self.object_store_mib, env=env,
                                     resources=extra, attempts=1)
            except errors.InfraError as exc:  # start_node killed what it had started
                last = exc
                if "timed out during startup" not in str(exc):
                    raise
                log.warning("burst node %s missed Ray's registration; started again", node_id)
                continue
            with self.lock:
                self._nodes[ray_id] = {"tags": {
                    TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_USER_NODE_TYPE: node_type,
                    TAG_RAY_NODE_NAME: ray_id, TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE, **tags},
                    "node": node_id}
            log.info("burst node %s up (Ray node %s)", node_id, ray_id)
            return
        assert last is not None
        raise last

    def _terminate_node(self, node: dict[str, Any]) -> None:
        node_id = node["node"]
        ray_nodes.kill_node(self.ports, node_id)
        log.info("burst node %s ended", node_id)
