"""The microVM guest: its kernel, its initramfs (the agent as ``/init``) and their manifest.

Owns building them (``build.py``, run by ``make guest``) and describing them to the backends
(``artifacts.py``: paths, digests, the kernel command line the agent understands). Must not
start VMs (``backends/microvm`` does) nor speak the agent protocol (``rollbox.agent``).
"""
