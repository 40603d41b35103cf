"""Package mirrors run by the platform: the caching PyPI proxy (:mod:`.pypi`) and its
content-addressed, size-bounded blob store (:mod:`.store`). The public surface (settings, CLI,
in-process start, sandbox environment) is :mod:`rollbox.netpolicy.mirror`.

Owns only what is under ``Settings().mirror_dir``; must not touch the allow-lists, veths or DNS
gate of the rest of :mod:`rollbox.netpolicy`, and never fetches from hosts other than the
configured upstreams.
"""
