"""LayerStorage's promises: uploads under way count against the project's limit and the store's
free space until they are committed, so concurrent ones can not together stage more than
either allows; a refusal because of them is retryable."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox import errors
from rollbox.config import Settings
from rollbox.edge.storage import LayerStorage
from rollbox.images.store import ImageStore

MIB = 1 << 20


def storage(tmp_path: Path, **settings: object) -> LayerStorage:
    s = Settings()
    for k, v in settings.items():
        setattr(s, k, v)
    return LayerStorage(ImageStore(tmp_path / "images"), s)


def test_promises_count_against_the_project_limit(tmp_path: Path) -> None:
    st = storage(tmp_path, project_layer_mib=10, image_store_reserve_bytes=0)
    a = st.promise("team", 8 * MIB)
    assert a.bytes == 8 * MIB
    b = st.promise("team", 8 * MIB)
    assert b.bytes == 2 * MIB and isinstance(b.error, errors.CapacityExceeded)
    with pytest.raises(errors.CapacityExceeded) as busy:  # held by uploads: retryable
        st.promise("team", 8 * MIB)
    assert busy.value.retryable and busy.value.details["held_bytes"] == 10 * MIB
    assert st.promise("other", 8 * MIB).bytes == 8 * MIB  # per project
    st.release(a)
    assert st.promise("team", 8 * MIB).bytes == 8 * MIB


def test_promises_count_against_the_store_reserve(tmp_path: Path) -> None:
    st = storage(tmp_path, project_layer_mib=1 << 30, image_store_reserve_bytes=90 * MIB)
    st.free_bytes = lambda: 100 * MIB  # type: ignore[method-assign]  # (a shared disk moves)
    a = st.promise("a", 8 * MIB)
    b = st.promise("b", 8 * MIB)  # another project: the store's space is shared
    assert (a.bytes, b.bytes) == (8 * MIB, 2 * MIB)
    assert isinstance(b.error, errors.CapacityExceeded)
    with pytest.raises(errors.CapacityExceeded):
        st.promise("c", 1)
    st.release(b)
    assert st.promise("c", 8 * MIB).bytes == 2 * MIB
