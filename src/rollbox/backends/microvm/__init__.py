"""MicroVM backend: QEMU ``microvm`` guests (TCG here, KVM where it boots a guest) on the same
EROFS layers and agent protocol as containers.

Owns QEMU's command line (``qemu.py``), the jail QEMU runs in (``jail.py``, with the static
``native/jailer``), the accelerator probe (``accel.py``), QMP (``qmp.py``), the VM's disks
(``disks.py``), the balloon (``balloon.py``) and the lifecycle (``backend.py``). Must not touch
the API, IAM, journal or placement (the edge owns those), must never mount a filesystem a guest
could write, and parses everything that comes out of a VM (agent bytes, QMP answers) as hostile.
"""
