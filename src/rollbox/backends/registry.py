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
    from rollbox.images.store import ImageStore
    from rollbox.isolation.userns import UidSlots


def make_backends(settings: Settings, layer_mounts: LayerMounts, slots: UidSlots,
                  store: ImageStore) -> dict[str, Backend]:
    """The node's backends by kind; "container" is always there, "microvm" and "vm" too (offered
    where QEMU, the jailer and their guest kernel/initramfs are at hand; "vm" takes the
    microVM's accelerator choice). They share the node's uid
    slots and its disk pool (one owner of the pool's mount; writable layers of either kind are
    subvolumes named by sandbox id)."""
    from rollbox.backends.container.sandbox import ContainerBackend
    from rollbox.backends.microvm.backend import MicroVMBackend
    from rollbox.backends.vm.backend import VMBackend

    container = ContainerBackend(settings, layer_mounts, slots)
    microvm = MicroVMBackend(settings, slots, store, container.disk)
    vm = VMBackend(settings, slots, store, container.disk, accel_from=microvm)
    return {container.kind: container, microvm.kind: microvm,  # type: ignore[dict-item]
            vm.kind: vm}
