"""Host-side isolation primitives: raw syscalls, uid-range user namespaces, cgroups, seccomp.

Owns how the kernel is asked to isolate a sandbox. Must not know about images, the API or
any particular backend's lifecycle.
"""
