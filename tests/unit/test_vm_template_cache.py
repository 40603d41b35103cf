"""The microVM template cache's policy (backends/microvm/template.py) with a stand-in builder:
keys, single-flight builds, LRU eviction by count and bytes, in-use templates kept, failed
builds not retried at once, bad templates dropped, unfinished builds cleaned on load. The save
and restore themselves run on real QEMU in tests/integration/test_microvm_template.py."""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from rollbox.backends.microvm import template as T


def key(n: int = 0, **kw: object) -> T.TemplateKey:
    base = T.TemplateKey(layers=("sha256:aa", "sha256:bb"), disk_mib=64, guest_digest="g1",
                         qemu_version="QEMU 7.2", argv=("qemu", "-m", "256", f"-x{n}"))
    return replace(base, **kw)  # type: ignore[arg-type]


class Disks:
    """The disk pool's template subvolumes, as a set."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def remove(self, disk_id: str) -> list[str]:
        self.ids.discard(disk_id)
        return []


class Builder:
    def __init__(self, disks: Disks, state_bytes: int = 1000, disk_bytes: int = 500,
                 delay: float = 0.0, fail: bool = False) -> None:
        self.disks, self.state_bytes, self.disk_bytes = disks, state_bytes, disk_bytes
        self.delay, self.fail = delay, fail
        self.calls: list[str] = []

    async def __call__(self, k: T.TemplateKey, staging: Path, disk_id: str) -> T.Built:
        self.calls.append(k.digest)
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("guest did not boot")
        (staging / T.STATE_NAME).write_bytes(b"s" * self.state_bytes)
        self.disks.ids.add(disk_id)
        return T.Built(disk_id=disk_id, disk_bytes=self.disk_bytes)


def cache(tmp_path: Path, disks: Disks, count: int = 4, nbytes: int = 1 << 30,
          retry_s: float = 60.0) -> T.TemplateCache:
    return T.TemplateCache(tmp_path / "tpl", count, nbytes, disks.remove, retry_s=retry_s)


def test_every_part_of_the_key_changes_the_digest() -> None:
    k = key()
    variants = [key(layers=("sha256:aa",)), key(layers=("sha256:bb", "sha256:aa")),
                key(disk_mib=65), key(guest_digest="g2"), key(qemu_version="QEMU 8.0"),
                key(argv=("qemu", "-m", "512", "-x0"))]
    digests = {v.digest for v in variants}
    assert k.digest not in digests and len(digests) == len(variants)
    assert key().digest == k.digest  # stable
    assert T.TemplateKey.from_json(json.loads(json.dumps(k.to_json()))) == k


def test_guest_digest_follows_file_contents(tmp_path: Path) -> None:
    kernel, initrd, manifest = tmp_path / "k", tmp_path / "i", tmp_path / "m.json"
    kernel.write_bytes(b"kernel")
    initrd.write_bytes(b"initrd")
    d0 = T.guest_digest(kernel, initrd, manifest)  # no manifest yet
    manifest.write_text("{}")
    d1 = T.guest_digest(kernel, initrd, manifest)
    initrd.write_bytes(b"initrd2")
    d2 = T.guest_digest(kernel, initrd, manifest)
    assert len({d0, d1, d2}) == 3


async def test_concurrent_acquires_of_one_key_build_once(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks)
    b = Builder(disks, delay=0.05)
    got = await asyncio.gather(*(c.acquire(key(), b) for _ in range(6)))
    assert len(b.calls) == 1
    assert all(t is got[0] and t is not None for t in got)
    assert got[0].users == 6
    for t in got:
        c.release(t)  # type: ignore[arg-type]
    # a later acquire reuses it, no second build; another key builds its own
    t = await c.acquire(key(), b)
    assert t is got[0] and len(b.calls) == 1
    await c.acquire(key(1), b)
    assert len(b.calls) == 2
    assert (tmp_path / "tpl" / key().digest / T.STATE_NAME).stat().st_size == 1000


async def test_lru_eviction_by_count_keeps_recently_used(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks, count=2)
    b = Builder(disks)
    for n in (0, 1):
        c.release(await c.acquire(key(n), b))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    c.release(await c.acquire(key(0), b))  # type: ignore[arg-type]  # 0 is now the newest
    c.release(await c.acquire(key(2), b))  # type: ignore[arg-type]  # evicts 1
    assert {t.key for t in c.templates()} == {key(0), key(2)}
    assert not (tmp_path / "tpl" / key(1).digest).exists()
    assert disks.ids == {c.disk_id_for(key(0)), c.disk_id_for(key(2))}
    assert len(b.calls) == 3


async def test_eviction_by_bytes_and_a_template_above_the_bound_is_not_kept(
        tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks, count=10, nbytes=3500)
    b = Builder(disks)  # 1500 bytes each
    for n in range(3):
        c.release(await c.acquire(key(n), b))  # type: ignore[arg-type]
    assert len(c.templates()) == 2 and c.total_bytes() <= 3500
    big = Builder(disks, state_bytes=4000)
    assert await c.acquire(key(9), big) is None  # built, too big alone: cold boot
    assert key(9).digest not in {t.digest for t in c.templates()}
    assert not (tmp_path / "tpl" / key(9).digest).exists()
    assert c.disk_id_for(key(9)) not in disks.ids


async def test_a_template_in_use_is_not_evicted_until_released(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks, count=1)
    b = Builder(disks)
    held = await c.acquire(key(0), b)
    assert held is not None
    t1 = await c.acquire(key(1), b)  # count bound 1, but 0 is in use
    assert t1 is not None and held.dir.exists()
    c.release(t1)
    c.release(held)
    c.release(await c.acquire(key(2), b))  # type: ignore[arg-type]
    assert [t.key for t in c.templates()] == [key(2)]


async def test_dropped_while_in_use_goes_after_the_last_release(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks)
    b = Builder(disks)
    a1 = await c.acquire(key(), b)
    a2 = await c.acquire(key(), b)
    assert a1 is a2 and a1 is not None
    c.drop(a1, "QEMU refused it")
    assert a1.dir.exists()  # the other restore still reads it
    c.release(a1)
    assert a1.dir.exists()
    c.release(a2)  # type: ignore[arg-type]
    assert not a1.dir.exists() and disks.ids == set()
    # the next acquire builds it again
    t = await c.acquire(key(), b)
    assert t is not None and t is not a1 and len(b.calls) == 2


async def test_a_failed_build_boots_cold_and_is_retried_only_later(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks, retry_s=0.2)
    bad = Builder(disks, fail=True, delay=0.02)
    got = await asyncio.gather(*(c.acquire(key(), bad) for _ in range(3)))
    assert got == [None, None, None] and len(bad.calls) == 1
    assert await c.acquire(key(), bad) is None and len(bad.calls) == 1  # not retried yet
    assert [p.name for p in (tmp_path / "tpl").iterdir()] == []  # staging removed
    assert disks.ids == set()
    await asyncio.sleep(0.25)
    good = Builder(disks)
    assert await c.acquire(key(), good) is not None and len(good.calls) == 1


async def test_a_cancelled_build_releases_its_waiters(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks)
    slow = Builder(disks, delay=5)
    first = asyncio.ensure_future(c.acquire(key(), slow))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(c.acquire(key(), slow))
    await asyncio.sleep(0.01)
    first.cancel()
    assert await asyncio.wait_for(second, 2) is None
    with pytest.raises(asyncio.CancelledError):
        await first
    assert [p.name for p in (tmp_path / "tpl").iterdir()] == []


async def test_load_keeps_good_templates_and_removes_the_rest(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks)
    b = Builder(disks)
    for n in range(3):
        c.release(await c.acquire(key(n), b))  # type: ignore[arg-type]
    root = tmp_path / "tpl"
    # a truncated state, an unfinished build, a meta naming another key, an orphan disk
    with open(root / key(0).digest / T.STATE_NAME, "r+b") as f:
        f.truncate(10)
    (root / ".build-x").mkdir()
    (root / ("0" * 64)).mkdir()
    meta = json.loads((root / key(1).digest / T.META_NAME).read_text())
    meta["key"]["disk_mib"] = 999
    (root / key(1).digest / T.META_NAME).write_text(json.dumps(meta))
    # a meta naming a disk that is not its own (e.g. a sandbox's): never deleted through it
    (root / key(3).digest).mkdir()
    (root / key(3).digest / T.STATE_NAME).write_bytes(b"s")
    (root / key(3).digest / T.META_NAME).write_text(json.dumps(
        {**json.loads((root / key(2).digest / T.META_NAME).read_text()),
         "key": key(3).to_json(), "state_bytes": 1, "disk_id": "n0-sandbox"}))
    disks.ids.add("tpl-orphan")
    disks.ids.add("n0-sandbox")  # a sandbox's subvolume: not the cache's business
    c2 = cache(tmp_path, disks)
    c2.load(set(disks.ids))
    assert [t.key for t in c2.templates()] == [key(2)]
    assert sorted(p.name for p in root.iterdir()) == [key(2).digest]
    assert disks.ids == {c2.disk_id_for(key(2)), "n0-sandbox"}
    # the reloaded template is used, not rebuilt
    t = await c2.acquire(key(2), b)
    assert t is not None and len(b.calls) == 3


async def test_lru_order_survives_a_reload(tmp_path: Path) -> None:
    disks = Disks()
    c = cache(tmp_path, disks, count=3)
    b = Builder(disks)
    for n in range(3):
        c.release(await c.acquire(key(n), b))  # type: ignore[arg-type]
    old = (tmp_path / "tpl" / key(0).digest / T.META_NAME)
    os.utime(old, (1, 1))  # 0 the least recently used
    c2 = cache(tmp_path, disks, count=2)
    c2.load()
    assert {t.key for t in c2.templates()} == {key(1), key(2)}


class Chan:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def reseed(self, entropy: bytes, timeout: float = 5.0) -> None:
        self.calls.append(("reseed", entropy))

    async def set_machine_id(self, machine_id: str, timeout: float = 5.0) -> None:
        self.calls.append(("machine_id", machine_id))

    async def set_hostname(self, hostname: str, timeout: float = 5.0) -> None:
        self.calls.append(("hostname", hostname))

    async def set_clock(self, unix_ns: int | None = None, timeout: float = 5.0) -> None:
        self.calls.append(("clock", unix_ns))


async def test_make_unique_sends_fresh_values_each_time() -> None:
    a, b = Chan(), Chan()
    ida = await T.make_unique(a, "n0-aaaa")
    idb = await T.make_unique(b, "n0-bbbb")
    da, db = dict(a.calls), dict(b.calls)
    assert da["reseed"] != db["reseed"] and len(da["reseed"]) == T.ENTROPY_BYTES  # type: ignore[arg-type]
    assert ida != idb and da["machine_id"] == ida and len(ida) == 32
    assert da["hostname"] == "n0-aaaa"
    assert abs(da["clock"] - __import__("time").time_ns()) < 5 * 10**9  # type: ignore[operator]
    assert [c[0] for c in a.calls][0] == "reseed"  # before anything else


class SharedRamBuilder(Builder):
    """A build that leaves a RAM file (a template with shared RAM), sealed as the real one."""

    async def __call__(self, k: T.TemplateKey, staging: Path, disk_id: str) -> T.Built:
        built = await super().__call__(k, staging, disk_id)
        ram = staging / T.RAM_NAME
        ram.write_bytes(b"r" * 4096)
        if os.geteuid() == 0:
            os.chown(ram, 0, 0)
        ram.chmod(0o444)
        return replace(built, ram_bytes=4096, shared_ram=True)


async def test_a_shared_ram_template_counts_its_ram_and_is_dropped_if_it_is_writable(
        tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a sealed RAM file is root's")
    disks = Disks()
    c = cache(tmp_path, disks)
    tpl = await c.acquire(key(0), SharedRamBuilder(disks))
    assert tpl is not None and tpl.shared_ram and tpl.ram_path.is_file()
    assert tpl.size == 1000 + 500 + 4096
    c.release(tpl)
    reloaded = cache(tmp_path, disks)
    reloaded.load(set(disks.ids))
    assert [(t.shared_ram, t.ram_bytes) for t in reloaded.templates()] == [(True, 4096)]
    # a RAM file anyone could write (or cut short) is never mapped into a VM again
    tpl.ram_path.chmod(0o644)
    c2 = cache(tmp_path, disks)
    c2.load(set(disks.ids))
    assert c2.templates() == []
    assert not (tmp_path / "tpl" / key(0).digest).exists()


async def test_every_dropped_template_is_told_once_evicted_bad_or_cleared(
        tmp_path: Path) -> None:
    disks = Disks()
    told: list[str] = []
    c = T.TemplateCache(tmp_path / "tpl", 1, 1 << 30, disks.remove,
                        on_drop=lambda t: told.append(t.digest))
    b = Builder(disks)
    t0 = await c.acquire(key(0), b)
    assert t0 is not None
    c.release(t0)
    c.release(await c.acquire(key(1), b))  # type: ignore[arg-type]  # evicts 0
    assert told == [key(0).digest]
    t1 = c.templates()[0]
    c.drop(t1, "QEMU refused it")
    c.drop(t1, "again")  # already dropped: not told twice
    assert told == [key(0).digest, key(1).digest]
    c.release(await c.acquire(key(2), b))  # type: ignore[arg-type]
    c.clear()
    assert told == [key(0).digest, key(1).digest, key(2).digest]
