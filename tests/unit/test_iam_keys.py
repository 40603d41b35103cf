"""KeyStore: keys verify, revoke, and never sit in plaintext on disk."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollbox import errors
from rollbox.iam import KeyStore


def test_create_verify_revoke_and_hash_at_rest(tmp_path: Path) -> None:
    ks = KeyStore(tmp_path / "keys.db")
    try:
        key = ks.create("team-1")
        admin = ks.create("ops", admin=True)
        assert key.startswith("rbx_") and len(key) == 4 + 43
        p = ks.verify(key)
        assert (p.project, p.admin) == ("team-1", False)
        assert ks.verify(admin).admin
        for bad in (None, "", "rbx_" + "A" * 43, key[:-1], "x" + key, key + "x"):
            with pytest.raises(errors.Unauthorized):
                ks.verify(bad)
        infos = ks.list()
        assert {i.project for i in infos} == {"team-1", "ops"}
        assert all(key not in i.display and i.display.endswith("...") for i in infos)
        ks.revoke(p.key_id)
        with pytest.raises(errors.Unauthorized):
            ks.verify(key)
        with pytest.raises(errors.NotFound):
            ks.revoke(p.key_id)
        assert [i.revoked for i in ks.list("team-1")] == [True]
        with pytest.raises(errors.BadRequest):
            ks.create("bad name!")
    finally:
        ks.close()
    blob = b"".join(f.read_bytes() for f in tmp_path.iterdir() if f.is_file())
    secret = key[4 + 8:].encode()  # everything past the displayed prefix
    assert secret not in blob and admin[12:].encode() not in blob
    # Reopen: keys still verify (hash lookup), revocation persisted.
    ks = KeyStore(tmp_path / "keys.db")
    try:
        assert ks.verify(admin).project == "ops"
        with pytest.raises(errors.Unauthorized):
            ks.verify(key)
    finally:
        ks.close()


def test_revoke_by_another_process_is_seen_at_once(tmp_path: Path) -> None:
    """The server's verify cache must not outlive a revoke made through another connection
    to the file (another process), nor one made in the server's own process."""
    server = KeyStore(tmp_path / "keys.db")
    other = KeyStore(tmp_path / "keys.db")  # e.g. a CLI process
    try:
        key = server.create("team-1")
        key2 = server.create("team-1")
        key_id = server.verify(key).key_id
        server.verify(key)  # cached now
        other.revoke(key_id)
        with pytest.raises(errors.Unauthorized):
            server.verify(key)
        server.verify(key2)
        server.revoke(server.verify(key2).key_id)
        with pytest.raises(errors.Unauthorized):
            server.verify(key2)
    finally:
        server.close()
        other.close()


def test_list_shows_last_use_and_revocation_never_secrets(tmp_path: Path) -> None:
    ks = KeyStore(tmp_path / "keys.db")
    try:
        key = ks.create("team-1")
        unused = ks.create("team-1")
        assert all(i.last_used_at is None for i in ks.list())
        before = time.time()
        ks.verify(key)
        used = {i.key_id: i for i in ks.list("team-1")}
        kid = ks.verify(key).key_id
        assert used[kid].last_used_at is not None and used[kid].last_used_at >= before - 1
        ks.revoke(ks.verify(unused).key_id)
        infos = ks.list("team-1")
        assert [i.revoked for i in infos] == [False, True]
        assert infos[1].revoked_at is not None and infos[0].revoked_at is None
        for info in infos:
            assert key[12:] not in repr(info) and unused[12:] not in repr(info)
    finally:
        ks.close()


def test_an_old_database_gains_the_last_used_column(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "keys.db")
    db.executescript("""
        CREATE TABLE projects (name TEXT PRIMARY KEY, parent TEXT, max_sandboxes INTEGER,
            max_cpus REAL, max_memory_mib INTEGER, created_at REAL NOT NULL);
        CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, key_hash BLOB NOT NULL UNIQUE,
            display TEXT NOT NULL, project TEXT NOT NULL, admin INTEGER NOT NULL,
            created_at REAL NOT NULL, revoked_at REAL);
    """)
    db.close()
    ks = KeyStore(tmp_path / "keys.db")
    try:
        key = ks.create("p")
        assert ks.verify(key).project == "p"
        assert ks.list()[0].last_used_at is not None
    finally:
        ks.close()


async def test_a_stored_limit_out_of_the_models_bounds_still_reads(tmp_path: Path) -> None:
    """Limits stored before models.Quota was bounded (an inf cpus, a 2^60 sandboxes) read back
    as they are: validating them again failed every read and reserve of the project."""
    from rollbox.iam.keys import SQLiteIam, SQLiteLedger
    from rollbox.iam.model import Principal, Usage

    iam = SQLiteIam(tmp_path / "iam.db")
    ledger = SQLiteLedger(tmp_path / "iam.db")
    try:
        op = Principal(project="ops", admin=True, key_id="k", scope="")
        await iam.create_project(op, "old")
        with iam._lock:
            iam._db.execute("UPDATE projects SET max_sandboxes = ?, max_cpus = ? WHERE "
                            "name = ?", (1 << 60, float("inf"), "old"))
        q = await iam.get_quota(op, "old")
        assert q.sandboxes == 1 << 60 and q.cpus == float("inf")
        assert iam.get("old").sandboxes == 1 << 60
        res = await ledger.reserve("old", Usage(1, 1.0, 64))
        assert (await ledger.usage("old")).sandboxes == 1
        await ledger.cancel(res)
    finally:
        ledger.close()
        iam.close()
