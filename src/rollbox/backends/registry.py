"""Which backends a node has: one per kind (``SandboxSpec.backend``), built for the edge.

The only place that names the backend packages. Owns the list and how each is built; must not
hold a backend's behaviour (that is the package's) nor the edge's (it gets the mapping). A
backend the node can not run still has an entry whose ``capacity()`` says why it is not
offered, so a spec naming it is refused with that reason.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rollbox.backends.base import Backend

if TYPE_CHECKING:
    from rollbox.config import Settings
    from rollbox.images.mounts import LayerMounts
    from rollbox.isolation.userns import UidSlots


def make_backends(settings: Settings, layer_mounts: LayerMounts,
                  slots: UidSlots) -> dict[str, Backend]:
    """The node's backends by kind; "container" is always there."""
    from rollbox.backends.container.sandbox import ContainerBackend

    container = ContainerBackend(settings, layer_mounts, slots)
    backends: dict[str, Backend] = {container.kind: container}  # type: ignore[dict-item]
    return backends
