"""Helpers around the chunk store back-ends of ``rollbox.images.chunks``.

Owns ``loopback_s3`` (a moto S3 server on 127.0.0.1 for tests and ``rollbox bench images``).
Must not hold store logic itself: the back-ends live in ``rollbox.images.chunks``.
"""
