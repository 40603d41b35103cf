"""Identity: API keys -> principals (project, admin), stored only as SHA-256 hashes; per-project
quotas on one node (``iam.quotas``, its own SQLite file next to the keys).

Stores and validates; does not count usage (the edge's admission enforces quotas against its
live sandboxes) and nothing here talks to edges. Nested projects with delegated quotas come
later (see ``iam.keys.Project``).
"""
from rollbox.iam.keys import KEY_PREFIX, KeyInfo, KeyStore, Principal
from rollbox.iam.quotas import QuotaStore, SQLiteQuotas

__all__ = ["KEY_PREFIX", "KeyInfo", "KeyStore", "Principal", "QuotaStore", "SQLiteQuotas"]
