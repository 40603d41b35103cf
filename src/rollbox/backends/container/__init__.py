"""Container backend: runc over overlayfs of idmapped EROFS layers, one agent per sandbox.

Owns a sandbox's rootfs composition, OCI bundle, runc lifecycle, agent channel and host-side
file access. Must not touch the API, IAM, journal or placement (the edge owns those), and must
never run a binary from a sandbox's writable tree for its own work.
"""
