"""`rollbox image ...`: build, import, list, remove, inspect images; ensure the defaults.

Mounted by the main CLI; also runnable as ``python -m rollbox.image_cli``. Thin: the work is
the image store's, its sources' (``rollbox.images.sources``), the chunk stores' and the default
images' (``rollbox.default_images``); builds by running commands use a container build sandbox
(``rollbox.backends.container.build``).
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollbox.errors import RollboxError
from rollbox.images import sources as builders
from rollbox.images.store import ImageStore
from rollbox.terminal import escape_control

app = typer.Typer(help="Manage rollbox images (EROFS layers + named refs).", no_args_is_help=True)
console = Console(stderr=True)
out = Console()
T = TypeVar("T")

_state: dict[str, Any] = {"root": None}


@app.callback()
def _main(root: Optional[Path] = typer.Option(  # noqa: UP007 (typer needs Optional)
        None, "--root", help="Image store root "
        "(default: $ROLLBOX_IMAGES, else $ROLLBOX_DATA/images)")) -> None:
    _state["root"] = root


def _store() -> ImageStore:
    return ImageStore(_state["root"])


@contextmanager
def _progress(title: str) -> Iterator[Callable[[str], None]]:
    with Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        task = bar.add_task(title, total=None)

        def say(msg: str) -> None:
            bar.update(task, description=f"{title}: {escape(escape_control(msg))}")

        yield say
        bar.update(task, description=f"{title}: done")


def _run(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except RollboxError as exc:
        # a build step's error carries its output: the sandbox's bytes, shown escaped
        console.print(f"[red]error[/red] ({exc.code}): {escape(escape_control(exc.message))}",
                      soft_wrap=True)
        raise typer.Exit(code=2 if exc.status < 500 else 1) from None
    except OSError as exc:
        console.print(f"[red]error[/red]: {escape(escape_control(str(exc)))}", soft_wrap=True)
        raise typer.Exit(code=1) from None


@app.command("build")
def build_cmd(
    name: str = typer.Argument(..., help="Image name, e.g. myimg:1"),
    from_dir: Optional[Path] = typer.Option(None, "--from-dir", help="Directory to pack"),  # noqa: UP007
    debootstrap: Optional[str] = typer.Option(None, "--debootstrap", metavar="SUITE",  # noqa: UP007
                                              help="Debian suite to debootstrap"),
    mirror: Optional[str] = typer.Option(None, "--mirror", help="Debian mirror URI"),  # noqa: UP007
    base: Optional[str] = typer.Option(None, "--base", help="Run --run commands over this image"),  # noqa: UP007
    run: list[str] = typer.Option([], "--run", help="Command for the new layer (repeatable)"),
    network: bool = typer.Option(True, help="Give the build sandbox the host network"),
    keep_git_history: bool = typer.Option(
        False, "--keep-git-history", help="keep every object of the layer's git repositories "
        "(default: only what HEAD reaches; red-team E36)"),
) -> None:
    """Build an image from a directory, by debootstrapping a Debian suite, or as a new layer
    made by running commands in a sandbox over --base (its writable layer, scrubbed)."""
    if sum(x is not None for x in (from_dir, debootstrap, base)) != 1 or bool(run) != bool(base):
        console.print("[red]error[/red]: give exactly one of --from-dir, --debootstrap or "
                      "--base with one or more --run")
        raise typer.Exit(code=2)
    store = _store()
    with _progress(f"build {name}") as say:
        if base is not None:
            import asyncio

            from rollbox.backends.container.build import build_layer_with_commands

            _run(lambda: asyncio.run(build_layer_with_commands(
                store, base, run, name, network="host" if network else "none", log=say,
                log_file=store.root / "logs" / "build-commands.log",
                keep_git_history=keep_git_history)))
            image = store.resolve(name)
        elif from_dir is not None:
            image = _run(lambda: builders.build_from_directory(
                store, from_dir, name, progress=say, keep_git_history=keep_git_history))
        else:
            assert debootstrap is not None
            image = _run(lambda: builders.build_debian_base(store, name, debootstrap, mirror,
                                                            progress=say))
    out.print(f"{image.name} {' '.join(image.layers)}")


@app.command("import")
def import_cmd(tarball: Path = typer.Argument(..., help="docker save or OCI archive"),
               name: str = typer.Argument(...),
               keep_git_history: bool = typer.Option(
                   False, "--keep-git-history", help="keep every object of the image's git "
                   "repositories (default: only what HEAD reaches)")) -> None:
    """Import a `docker save` tarball or an OCI archive."""
    store = _store()
    with _progress(f"import {name}") as say:
        image = _run(lambda: builders.import_oci_archive(store, tarball, name, progress=say,
                                                         keep_git_history=keep_git_history))
    out.print(f"{image.name} {' '.join(image.layers)}")


@app.command("upload")
def upload_cmd(
    name: str = typer.Argument(..., help="Image name with a path, e.g. myproject/task:1"),
    path: Path = typer.Argument(..., help="Directory (its contents) or tar file (gz/bz2/xz)"),
    base: Optional[str] = typer.Option(None, "--base", help="Stack the layer on this image"),  # noqa: UP007
    url: Optional[str] = typer.Option(  # noqa: UP007
        None, "--url", help="API (default: $ROLLBOX_URL, else this node's rollbox serve)"),
    api_key: Optional[str] = typer.Option(  # noqa: UP007
        None, "--api-key", help="API key (default: $ROLLBOX_API_KEY, else this node's admin key)"),
) -> None:
    """Upload a task image into your project through the API: the server builds the layer
    from the streamed tree (a filesystem image made by the client is never mounted)."""
    from rich.progress import BarColumn, DownloadColumn, TransferSpeedColumn

    import rollbox
    from rollbox.config import Settings
    from rollbox.sdk import default_api_key

    key = api_key or default_api_key()
    if key is None:
        try:
            key = Settings().admin_key_path.read_text().strip()
        except OSError:
            console.print("[red]error[/red]: no --api-key, no ROLLBOX_API_KEY and no admin "
                          "key on this node")
            raise typer.Exit(code=2) from None
    with Progress(TextColumn("[bold]upload"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("upload", total=None)

        def progress(sent: int, total: int | None) -> None:
            bar.update(task, completed=sent, total=max(total or 0, sent) or None)

        with rollbox.Client(url, key) as client:
            info = _run(lambda: client.images.upload(name, path, base=base, progress=progress))
    out.print(f"{info.name} {' '.join(info.layers)} ({info.size / 2**20:.1f} MiB)")


@app.command("ls")
def ls_cmd() -> None:
    """List named images."""
    store = _store()
    table = Table("NAME", "LAYERS", "SIZE", "CREATED")
    for image in _run(store.list):
        size = sum(int(store.layer_meta(d).get("size", 0)) for d in image.layers
                   if store.has_layer(d))
        table.add_row(image.name, str(len(image.layers)), f"{size / 2**20:.1f} MiB",
                      datetime.fromtimestamp(image.created).strftime("%Y-%m-%d %H:%M"))
    out.print(table)


@app.command("rm")
def rm_cmd(name: str, gc: bool = typer.Option(False, "--gc", help="Also gc unused layers")) -> None:
    """Remove an image ref (layers go with `gc`)."""
    store = _store()
    _run(lambda: store.remove(name))
    out.print(f"removed {name}")
    if gc:
        removed = _run(store.gc)
        out.print(f"gc removed {len(removed)} layer(s)")


@app.command("gc")
def gc_cmd(grace: float = typer.Option(600.0, help="Keep unreferenced layers younger than "
                                                   "this many seconds")) -> None:
    """Delete layers that no image uses (and unmount them)."""
    removed = _run(lambda: _store().gc(grace_seconds=grace))
    for digest in removed:
        out.print(digest)


@app.command("inspect")
def inspect_cmd(name: str) -> None:
    """Print an image's ref and layer metadata as JSON."""
    data = _run(lambda: _store().inspect(name))
    print(json.dumps(data, indent=2))


@app.command("ensure-defaults")
def ensure_defaults_cmd(
    mirror: Optional[str] = typer.Option(None, "--mirror", help="Debian mirror URI"),  # noqa: UP007
) -> None:
    """Build debian:bookworm and busybox:test if missing, then the python image if known."""
    store = _store()
    if not builders.busybox_image_current(store):
        with _progress("build busybox:test"):
            _run(lambda: builders.build_busybox_image(store))
    else:
        console.print("busybox:test present")
    if not store.exists("debian:bookworm"):
        with _progress("build debian:bookworm") as say:
            _run(lambda: builders.build_debian_base(store, mirror=mirror, progress=say))
    else:
        console.print("debian:bookworm present")
    try:
        defaults = importlib.import_module("rollbox.default_images")
    except ModuleNotFoundError as exc:
        if exc.name != "rollbox.default_images":
            raise
        console.print("rollbox.default_images not available yet: skipping the python image")
        return
    ensure_python = getattr(defaults, "ensure_python_image", None)
    if ensure_python is None:
        console.print("rollbox.default_images has no ensure_python_image: skipping")
        return
    _run(lambda: ensure_python(store))


@app.command("ensure-polyglot")
def ensure_polyglot_cmd() -> None:
    """Build fncall-polyglot:1 (fncall:1 + Go, Java, Rust, TypeScript, lodash, less) if missing:
    fncall's go/java/rust/typescript calls run on it; never built by ensure-defaults
    (minutes, ~1 GiB)."""
    from rollbox.default_images import ensure_polyglot_image

    store = _store()
    with _progress("ensure fncall-polyglot:1") as say:
        name = _run(lambda: ensure_polyglot_image(store, log=say))
    out.print(name)


@app.command("ensure-desktop")
def ensure_desktop_cmd(force: bool = typer.Option(
        False, "--force", help="build again even if it is there")) -> None:
    """Build the `vm` backend's desktop:1 disk (Debian, Xorg, JWM, xterm, mousepad, gnumeric;
    raw ext4 <= 1.5 GiB in <data_dir>/vm-disks) if missing; never by ensure-defaults
    (minutes; root)."""
    from rollbox.default_images import ensure_desktop_image
    from rollbox.images.vmdisk import resolve_vm_disk, vm_disks_root

    with _progress("ensure desktop:1") as say:
        name = _run(lambda: ensure_desktop_image(log=say, force=force))
    disk = _run(lambda: resolve_vm_disk(vm_disks_root(), name))
    out.print(f"{name} {disk.disk} ({disk.bytes / 2**20:.0f} MiB disk, "
              f"{disk.manifest['allocated_bytes'] / 2**20:.0f} MiB allocated, "
              f"sha256 {disk.manifest['sha256'][:16]})")


@app.command("ensure-browser")
def ensure_browser_cmd() -> None:
    """Build browser:1 (chromium + chromium-driver + MiniWoB++ tasks) if missing; never built
    by ensure-defaults (minutes, ~1 GiB)."""
    from rollbox.browser.image import ensure_browser_image

    store = _store()
    with _progress("ensure browser:1") as say:
        name = _run(lambda: ensure_browser_image(store, log=say))
    out.print(name)


# ---- chunk store: push / pull / squash (rollbox.images.chunks, rollbox.images.squash) ------

def _chunk_store_url(url: Optional[str]) -> str:  # noqa: UP007
    from rollbox.images.chunks import default_store_url

    return url or default_store_url()


@app.command("push")
def push_cmd(
    name: str = typer.Argument(..., help="Image to push"),
    store_url: Optional[str] = typer.Argument(  # noqa: UP007
        None, help="dir:///path, posix:///path or s3://bucket/prefix?endpoint=... "
        "(default: $ROLLBOX_CHUNK_STORE or dir://$ROLLBOX_DATA/chunks)"),
    chunk_size: int = typer.Option(0, "--chunk-size", help="Bytes per chunk (0: default)"),
    compression: Optional[str] = typer.Option(  # noqa: UP007
        None, "--compression", help="none|zstd (default: the store URL's compression=)"),
) -> None:
    """Push an image's layers (chunked, deduplicated) and its ref to a chunk store."""
    import asyncio

    from rollbox.images import chunks

    store = _store()

    async def go(say: Callable[[str], None]) -> list[chunks.TransferStats]:
        dst = chunks.open_store(_chunk_store_url(store_url))
        first = len(chunks.TRANSFERS)
        try:
            await chunks.push_image(store, name, dst,
                                    chunk_size=chunk_size or chunks.DEFAULT_CHUNK_SIZE,
                                    compression=compression, progress=say)
        finally:
            await dst.close()
        return chunks.TRANSFERS[first:]

    with _progress(f"push {name}") as say:
        stats = _run(lambda: asyncio.run(go(say)))
    for st in stats:
        out.print(f"{st.layer} {st.chunks_transferred}/{st.chunks} chunks "
                  f"{st.bytes_transferred} bytes pushed ({st.bytes_logical} bytes layer)")


@app.command("pull")
def pull_cmd(
    name: str = typer.Argument(..., help="Image to pull"),
    store_url: Optional[str] = typer.Argument(None, help="Chunk store URL (see push)"),  # noqa: UP007
    lazy: bool = typer.Option(False, "--lazy", help="Only the ref and layer manifests; layer "
                              "bytes are fetched on first read by the lazy loader"),
) -> None:
    """Pull an image's ref and layers from a chunk store into the local image store."""
    import asyncio

    from rollbox.images import chunks

    store = _store()

    async def go(say: Callable[[str], None]) -> tuple[Any, list[chunks.TransferStats]]:
        src = chunks.open_store(_chunk_store_url(store_url))
        try:
            image, stats = await chunks.pull_image(src, name, store, lazy=lazy, progress=say)
            if lazy:
                from rollbox.images.lazy.loader import register_lazy_image

                # The lazy loader tags the image over its cache.
                register_lazy_image(store, image, src.url)
            return image, stats
        finally:
            await src.close()

    with _progress(f"pull {name}") as say:
        image, stats = _run(lambda: asyncio.run(go(say)))
    for st in stats:
        out.print(f"{st.layer} {st.chunks_transferred}/{st.chunks} chunks "
                  f"{st.bytes_transferred} bytes pulled ({st.bytes_logical} bytes layer)")
    out.print(f"{image.name} {' '.join(image.layers)}" + (" (lazy)" if lazy else ""))


@app.command("squash")
def squash_cmd(
    name: str = typer.Argument(..., help="Image whose layers to squash"),
    start: Optional[int] = typer.Option(  # noqa: UP007
        None, "--from", help="Squash layers N..top into one (default: the trailing run of "
        "small layers)"),
    tag: Optional[str] = typer.Option(None, "--tag", help="Tag the result as this name "  # noqa: UP007
                                      "(default: replace NAME)"),
) -> None:
    """Collapse consecutive layers into one EROFS layer (overlay whiteouts preserved)."""
    from rollbox.images.squash import squash_image

    store = _store()
    with _progress(f"squash {name}") as say:
        image = _run(lambda: squash_image(store, name, start=start, tag=tag, progress=say))
    out.print(f"{image.name} {' '.join(image.layers)}")


@app.command("ensure-bench-images")
def ensure_bench_images_cmd() -> None:
    """Build the >= 1 GB python-big:3.11 image for `rollbox bench images` (slow; needs PyPI)."""
    from rollbox.default_images import ensure_bench_image

    store = _store()
    _run(lambda: ensure_bench_image(store, log=console.print))


@app.command("stats")
def stats_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON"),
    cgroup_parent: Optional[str] = typer.Option(  # noqa: UP007
        None, "--cgroup-parent", help="Sandbox cgroup parent, to name sandboxes exactly "
        "(default: $ROLLBOX_CGROUP or rollbox)"),
) -> None:
    """Lazy-loading counters of this node: per layer (bytes requested, fetched, written, cache
    hits) and per sandbox (by the reader's cgroup); plus recent full pulls."""
    from rollbox.config import Settings
    from rollbox.images.lazy.loader import loader_for

    store = _store()
    st = _run(lambda: loader_for(store).stats(
        cgroup_parent=cgroup_parent or Settings().cgroup_parent))
    pulls = []
    try:
        with open(store.logs_dir / "transfers.jsonl") as f:
            pulls = [json.loads(line) for line in f if '"pull"' in line][-20:]
    except (OSError, ValueError):
        pass
    if as_json:
        print(json.dumps({**st, "pulls": pulls}, indent=2))
        return
    d = st["daemon"]
    out.print(f"daemon: {'up' if d.get('alive') else 'down'} generation {d.get('generation', '-')}"
              f" pid {d.get('pid', '-')}; cache {st['cache']['used'] / 2**20:.1f} MiB of "
              f"{st['cache']['limit'] / 2**20:.0f} MiB")
    mib = 2**20
    table = Table("LAYER", "SIZE MiB", "REQUESTED MiB", "FETCHED MiB", "WRITTEN MiB", "FETCHED %",
                  "HITS", "MISSES", "LAST ERROR")
    for digest, ls in st["layers"].items():
        size = max(1, int(ls.get("size", 0)))
        err = (ls.get("last_error") or {}).get("code", "")
        table.add_row(digest[:19], f"{size / mib:.1f}", f"{ls['bytes_requested'] / mib:.1f}",
                      f"{ls['bytes_fetched'] / mib:.1f}", f"{ls['bytes_written'] / mib:.1f}",
                      f"{100 * ls['bytes_fetched'] / size:.1f}", str(ls["cache_hits"]),
                      str(ls["cache_misses"]), err)
    out.print(table)
    if st["sandboxes"]:
        sb = Table("SANDBOX", "LAYERS", "REQUESTED MiB", "FETCHED MiB", "HITS", "MISSES")
        for sid, c in st["sandboxes"].items():
            sb.add_row(sid, str(c["layers"]), f"{c['bytes_requested'] / mib:.1f}",
                       f"{c['bytes_fetched'] / mib:.1f}", str(c["cache_hits"]),
                       str(c["cache_misses"]))
        out.print(sb)
    for p in pulls:
        out.print(f"full pull {p['layer'][:19]}: {p['bytes_transferred'] / mib:.1f} MiB in "
                  f"{p['seconds']:.2f} s")


if __name__ == "__main__":
    app()
