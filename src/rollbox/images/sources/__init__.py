"""Image sources, in one place: each makes layers of the store from something else and tags
an image.

- :mod:`.directory`: a directory tree, as is (``rollbox image build --from-dir``);
- :mod:`.oci`: a ``docker save`` tarball or an OCI image-layout archive (``rollbox image
  import``);
- :mod:`.debootstrap`: a minbase Debian suite (``rollbox image build --debootstrap``);
- :mod:`.desktop`: the ``vm`` backend's ``desktop:1`` disk (debootstrap + apt in a chroot, one
  raw ext4 disk, not layers: ``rollbox image ensure-desktop``; imported by its callers only);
- :mod:`.busybox`: ``busybox:test``, a tiny static image for fast tests;
- :mod:`.commands`: commands run in a sandbox over a base image, its writable layer taken
  through the snapshots' path (``rollbox image build --base --run``; the sandbox is the
  caller's, through a protocol).

Every tree is staged under ``store.tmp_dir`` (same filesystem as the layers) in the overlayfs
format (:mod:`rollbox.images.overlay`) and packed by :meth:`ImageStore.add_layer_from_dir`;
git repositories keep only what HEAD reaches unless asked (:mod:`rollbox.images.git`). Must not
make sandboxes (the caller's :class:`.commands.BuildSandboxes` does) nor know a backend.
"""
from rollbox.images.sources.busybox import build_busybox_image, busybox_image_current
from rollbox.images.sources.commands import (
    BuildSandbox,
    BuildSandboxes,
    build_layer_with_commands,
)
from rollbox.images.sources.debootstrap import DEBIAN_CONFIG, build_debian_base, default_mirror
from rollbox.images.sources.directory import build_from_directory
from rollbox.images.sources.oci import extract_layer_tar, import_oci_archive

__all__ = ["DEBIAN_CONFIG", "BuildSandbox", "BuildSandboxes", "build_busybox_image",
           "build_debian_base", "build_from_directory", "build_layer_with_commands",
           "busybox_image_current", "default_mirror", "extract_layer_tar", "import_oci_archive"]
