"""Ray's autoscaler for a cluster's burst nodes: the config the head starts with.

What ``rollbox cluster up --burst-nodes N`` gives ``ray start --head --autoscaling-config``:
one node type per burst slot (:func:`rollbox.cluster.burst.burst_node_types`, ``min_workers``
0: none runs until the scaler asks), and either

- this host's provider (:func:`local_config`:
  :class:`rollbox.cluster.burst_provider.LocalBurstProvider`, Ray's fake multi-node provider
  whose nodes are Ray nodes on this host, started as ``cluster.ray_nodes`` starts every node
  here), or
- an operator's own YAML for a real cloud (:func:`operator_config`: its provider, auth and
  commands kept; the burst node types made from its ``rollbox.burst`` node type and merged
  into its ``available_node_types``).

Owns the autoscaler's config. Does not start nodes (``cluster.burst_provider``), decide when
burst nodes are needed, start their edges (``cluster.burst``, ``cluster.burst_actor``) nor run
the head (``cluster.local``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rollbox import errors
from rollbox.cluster.burst import BURST_RESOURCE, burst_node_types
from rollbox.cluster.ray_nodes import NODE_RESOURCE, ClusterPorts

PROVIDER_MODULE = "rollbox.cluster.burst_provider.LocalBurstProvider"
HEAD_TYPE = "ray.head.default"
TEMPLATE_TYPE = "rollbox.burst"  # an operator's config: the burst VM's node type
# the head's environment with this host's provider: FakeMultiNodeProvider refuses to run
# without RAY_FAKE_CLUSTER (which also fixes the head's Ray node id), and the autoscaler
# updates every second (Ray's default is 5 s)
LOCAL_HEAD_ENV = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
_EMPTY_LISTS = ("cluster_synced_files", "rsync_exclude", "rsync_filter",
                "initialization_commands", "setup_commands", "head_setup_commands",
                "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")


def local_config(ports: ClusterPorts, prefix: str, slots: dict[str, int], *, address: str,
                 object_store_mib: int, idle_timeout_s: float = 6) -> dict[str, Any]:
    """The autoscaler config of burst nodes on this host: ``slots`` maps each burst node's
    rollbox node id to its node index on this host (its port block, uid band, subnet)."""
    return {
        "cluster_name": f"rollbox-{ports.base}", "max_workers": len(slots),
        "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60,
        "provider": {"type": "external", "module": PROVIDER_MODULE,
                     "gcs_address": f"{address}:{ports.gcs}", "port_base": ports.base,
                     "address": address, "object_store_mib": object_store_mib,
                     "nodes": dict(slots),
                     # no updater (nothing to ssh into: a node is up when its raylet is)
                     "disable_launch_config_check": True, "disable_node_updaters": True,
                     "use_node_id_as_ip": True},  # all nodes share 127.0.0.1
        "auth": {"ssh_user": "root"},
        "available_node_types": {
            HEAD_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0},
            **burst_node_types(prefix, len(slots), object_store_mib=object_store_mib)},
        "head_node_type": HEAD_TYPE,
        **{k: [] for k in _EMPTY_LISTS},
        "file_mounts": {}, "file_mounts_sync_continuously": False,
    }


def operator_config(path: Path, prefix: str, slots: int, *,
                    object_store_mib: int) -> dict[str, Any]:
    """An operator's autoscaler YAML (a real cloud) with ``slots`` burst node types merged in:
    each a copy of its ``rollbox.burst`` node type (the burst VM: ``node_config``, and its
    ``resources`` such as CPU) carrying ``rollbox_burst`` and the slot's ``rollbox_node:<id>``
    (Ray's autoscaler hands a node type's resources to the node's ``ray start``). BadRequest
    for a file that is no such config."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise errors.BadRequest(f"autoscaler config {path}: {exc.strerror}",
                                path=str(path)) from None
    except yaml.YAMLError as exc:
        raise errors.BadRequest(f"autoscaler config {path} is not YAML: {exc}",
                                path=str(path)) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("provider"), dict) or not \
            isinstance(raw.get("available_node_types"), dict):
        raise errors.BadRequest(f"autoscaler config {path}: a mapping with provider and "
                                "available_node_types", path=str(path))
    cfg = copy.deepcopy(raw)
    types: dict[str, Any] = cfg["available_node_types"]
    template = types.pop(TEMPLATE_TYPE, None)
    if not isinstance(template, dict) or not isinstance(template.get("node_config"), dict):
        raise errors.BadRequest(f"autoscaler config {path}: a node type {TEMPLATE_TYPE!r} "
                                "with the burst VM's node_config", path=str(path))
    extra = dict(template.get("resources") or {})
    if BURST_RESOURCE in extra or any(k.startswith(NODE_RESOURCE) for k in extra):
        raise errors.BadRequest(f"autoscaler config {path}: {TEMPLATE_TYPE!r} must not name "
                                f"{BURST_RESOURCE} or {NODE_RESOURCE}* (each slot gets its own)",
                                path=str(path))
    burst = burst_node_types(prefix, slots, cpus=float(extra.pop("CPU", 0)),
                             object_store_mib=object_store_mib)
    clash = sorted(set(burst) & set(types))
    if clash:
        raise errors.BadRequest(f"autoscaler config {path}: node types {clash} are rollbox's",
                                path=str(path))
    for t in burst.values():
        t["resources"].update(extra)
        t["node_config"] = copy.deepcopy(template["node_config"])
    types.update(burst)
    cfg["max_workers"] = max(int(cfg.get("max_workers") or 0),
                             slots + sum(int(t.get("max_workers") or 0)
                                         for n, t in types.items() if n not in burst))
    return cfg
