"""The E2B front door's state from the node's settings: the template map (base, then the
operator's) and the access-token key (the setting, else a root-only file in the data dir)."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox import errors
from rollbox.compat.e2b.state import E2BState
from rollbox.config import Settings
from rollbox.default_images import E2B_BASE_IMAGE


def test_templates_are_base_then_the_settings(tmp_path: Path) -> None:
    s = Settings.scratch(tmp_path)
    s.e2b_templates = {"py": "python:3.11"}
    st = E2BState(s)
    assert st.templates == {"base": E2B_BASE_IMAGE, "py": "python:3.11"}
    assert st.image_of("py") == "python:3.11" and st.image_of("other:1") == "other:1"
    s.e2b_templates = {"base": "debian:bookworm"}
    assert E2BState(s).image_of("base") == "debian:bookworm"


def test_the_token_key_is_the_setting_else_a_file_in_the_data_dir(tmp_path: Path) -> None:
    s = Settings.scratch(tmp_path)
    s.e2b_secret = "k1"
    a, b = E2BState(s), E2BState(s)
    assert a.sandbox_of(b.token("sb1", "key1"), "sb1") == ("sb1", "key1")
    assert not (s.data_dir / "e2b-token.key").exists()
    s.e2b_secret = None
    c, d = E2BState(s), E2BState(s)  # the first made the file, the second read it
    assert (s.data_dir / "e2b-token.key").stat().st_mode & 0o777 == 0o600
    assert d.sandbox_of(c.token("sb1", "key1"), None) == ("sb1", "key1")
    with pytest.raises(errors.Unauthorized):
        c.sandbox_of(a.token("sb1", "key1"), None)
