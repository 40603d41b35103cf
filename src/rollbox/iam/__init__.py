"""Identity: API keys -> principals (project, admin). Keys are stored only as SHA-256 hashes.

Owns its own SQLite file. Nested projects with quotas come later (see ``iam.keys.Project``);
enforcing quotas is not done here yet and nothing here talks to edges.
"""
from rollbox.iam.keys import KEY_PREFIX, KeyInfo, KeyStore, Principal

__all__ = ["KEY_PREFIX", "KeyInfo", "KeyStore", "Principal"]
