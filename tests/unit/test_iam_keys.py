"""KeyStore: keys verify, revoke, and never sit in plaintext on disk."""
from __future__ import annotations

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
