"""Identity and quotas: API keys -> principals (project, the subtree they administer), stored
only as SHA-256 hashes; projects nested to any depth, each with limits carved out of its
parent's; the cluster-wide quota ledger every api replica reserves in before it creates.

The interface is ``iam.model`` (:class:`IamStore`, :class:`QuotaLedger`, :class:`LiveSandbox`);
two implementations with one logic (``iam.sql``): SQLite (``iam.keys``: embedded, the default)
and PostgreSQL (``iam.postgres``: cluster). Nothing here talks to edges: the api reserves and
commits, the watcher reconciles the ledger with the edges' live sets; the edge's own admission
reads a project's limits through ``IamStore.get`` (``iam.quotas`` keeps the flat per-node store
the edge tests use).
"""
from rollbox.iam.keys import KeyStore, SQLiteIam, SQLiteLedger
from rollbox.iam.model import (
    IamStore,
    KeyInfo,
    LiveSandbox,
    Principal,
    ProjectInfo,
    QuotaLedger,
    Reservation,
    Usage,
    live_sandboxes,
)
from rollbox.iam.quotas import QuotaStore, SQLiteQuotas
from rollbox.iam.sql import E2B_KEY_PREFIX, KEY_PREFIX

__all__ = ["E2B_KEY_PREFIX", "KEY_PREFIX", "IamStore", "KeyInfo", "KeyStore", "LiveSandbox",
           "Principal", "ProjectInfo", "QuotaLedger", "QuotaStore", "Reservation", "SQLiteIam",
           "SQLiteLedger", "SQLiteQuotas", "Usage", "live_sandboxes"]
