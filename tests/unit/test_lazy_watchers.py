"""Several edges of one process share a store's lazy loader (co-hosted edges on one image
store): the daemon's watch task runs until the last of them stops, not the first."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox.images.lazy.loader import LazyLoader
from rollbox.images.store import ImageStore


async def test_the_watch_outlives_one_of_two_edges(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    loader = LazyLoader(ImageStore(tmp_path / "images"))
    monkeypatch.setattr(loader, "ensure_daemon", lambda: {})  # no daemon: the watch is the unit
    monkeypatch.setattr(loader, "healthy", lambda state=None: True)
    await loader.start()  # edge A
    await loader.start()  # edge B
    watch = loader._watch
    assert watch is not None
    await loader.stop(daemon=False)  # A closes
    assert loader._watch is watch and not watch.done()
    await loader.stop(daemon=False)  # B closes
    assert loader._watch is None and watch.cancelled()
    await loader.start()
    await loader.stop()  # a full stop ends it whoever started it (daemon left alone here)
    assert loader._watch is None
