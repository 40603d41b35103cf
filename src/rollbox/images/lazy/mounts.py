"""The node's layer mounts: :class:`rollbox.images.mounts.LayerMounts` whose lazy layers are
served by this process's loader of the store (:class:`.loader.CurrentLoader`).

The wiring only: the mounts take lazy loading through their ``LazyLayers`` protocol and never
import the loader; this module, above both, binds the two for the edge, image builds, tools and
tests.
"""
from __future__ import annotations

from rollbox.config import Settings
from rollbox.images import mounts
from rollbox.images.lazy.loader import CurrentLoader
from rollbox.images.store import ImageStore


class LayerMounts(mounts.LayerMounts):
    """:class:`rollbox.images.mounts.LayerMounts` of ``store`` with its lazy layers served by
    this process's loader of it (made with ``settings`` if there is none yet)."""

    def __init__(self, store: ImageStore, settings: Settings | None = None) -> None:
        super().__init__(store, lazy=CurrentLoader(store, settings))
