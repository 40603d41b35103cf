"""The client's defaults from its user's environment: ``ROLLBOX_URL`` (the server, or several
API URLs comma-separated: the client fails over between them, ``_failover``) and
``ROLLBOX_API_KEY`` (the key sent). The one reader of ``ROLLBOX_*`` variables outside
rollbox.config (tests/unit/test_settings_reads.py): these belong to the client, read where the
SDK runs (often a host with no node), while rollbox.config holds a node's settings, which a
client neither needs nor should import. A blank variable leaves the default, as there."""
from __future__ import annotations

import os

DEFAULT_URL = "http://127.0.0.1:7420"


def default_url() -> str:
    """``$ROLLBOX_URL`` (as given: one URL, or several comma-separated), else this host's
    ``rollbox serve``."""
    return os.environ.get("ROLLBOX_URL", "").strip() or DEFAULT_URL


def default_api_key() -> str | None:
    """``$ROLLBOX_API_KEY``, else None."""
    return os.environ.get("ROLLBOX_API_KEY", "").strip() or None
