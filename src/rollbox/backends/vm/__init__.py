"""Full-VM backend: QEMU ``q35`` guests booted through SeaBIOS with a display, a USB tablet and
a keyboard, for computer use (docs/backends/vm.md).

Owns the q35 command line (``machine.py``), the screen and input path (``display.py``: QMP
``screendump`` and ``input-send-event``, nothing else) and the lifecycle differences from
microVMs (``backend.py``). Everything else (jail, QMP client, disks, network, balloon, agent
channel, teardown) is the microVM backend's, imported, never copied. Must not touch the API,
IAM, journal or placement, never mounts a disk a guest could write, and parses everything out
of a VM (agent bytes, QMP answers, screenshot bytes) as hostile.
"""
