"""The suite-start sweep of dead test runs (tests/conftest.py) spares a run whose owner process
lives, however old the run is, and sweeps it once that process is gone: a long microVM run (a
browser episode in a script's test node) was killed at ~600 s by another run's sweep when age
was the only test for a run without a record."""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollbox.isolation import cgroups
from tests.conftest import RUNS_DIR, TEST_RUN, node_settings, run_owner_alive, sweep_dead_runs


def test_owner_record_names_a_live_process() -> None:
    assert run_owner_alive(str(os.getpid())) and run_owner_alive(f"{os.getpid()}\n")
    child = subprocess.Popen(["true"])
    child.wait()
    for dead in (str(child.pid), "", "x", "-1", "0", f"{os.getpid()} 5"):
        assert not run_owner_alive(dead), dead


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")
def test_a_script_making_a_test_node_owns_its_run(tmp_path) -> None:  # noqa: ANN001
    """node_settings outside pytest (a bench or demo script) records its process as owner."""
    code = ("import os, sys; sys.path.insert(0, os.getcwd()); from pathlib import Path; "
            "from tests.conftest import RUNS_DIR, TEST_RUN, node_settings; "
            f"node_settings(Path({str(tmp_path)!r})); "
            "print(TEST_RUN, (RUNS_DIR / TEST_RUN).read_text())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    proc_pid = out[1]
    assert out[0] != TEST_RUN and not run_owner_alive(proc_pid)  # it exited: its run is dead
    (RUNS_DIR / out[0]).unlink(missing_ok=True)
    node_settings(tmp_path)
    assert (RUNS_DIR / TEST_RUN).read_text() == str(os.getpid())


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups)")
def test_sweep_spares_a_live_owners_run_and_sweeps_it_after() -> None:
    run = secrets.token_hex(2)
    parent = cgroups.v2_root() / f"rollbox-test-{run}"
    box = parent / "box"
    box.mkdir(parents=True)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    sandbox = subprocess.Popen(["sleep", "120"])
    try:
        (box / "cgroup.procs").write_text(str(sandbox.pid))
        old = time.time() - 3600  # far older than the unowned-run age limit
        os.utime(parent, (old, old))
        RUNS_DIR.mkdir(exist_ok=True)
        (RUNS_DIR / run).write_text(str(owner.pid))
        assert run not in sweep_dead_runs()
        assert sandbox.poll() is None and box.is_dir()
        owner.kill()
        owner.wait()
        assert run in sweep_dead_runs()
        assert sandbox.wait(10) is not None and not parent.exists()
        assert not (RUNS_DIR / run).exists()
    finally:
        for p in (owner, sandbox):
            p.kill()
            p.wait()
        (RUNS_DIR / run).unlink(missing_ok=True)
        cgroups.kill(parent)
        cgroups.remove_tree(parent)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, loop devices)")
def test_runs_are_found_by_every_kind_of_resource(tmp_path) -> None:  # noqa: ANN001
    """A killed run may leave no cgroup parent: a test's own netns (rollbox-t<run>vn<hex>), a
    temp dir with a disk file, a loop device on it. Each makes the run a sweep candidate; a
    live owner's run is left alone, a dead owner's is swept."""
    import tempfile

    from rollbox.isolation import btrfs, netns
    from tests.conftest import run_resources

    runs = {kind: secrets.token_hex(2) for kind in ("netns", "tmp", "loop")}
    ns = f"rollbox-t{runs['netns']}vn{secrets.token_hex(4)}"
    tmps = {kind: Path(tempfile.mkdtemp(prefix=f"rollbox-test-{run}-"))
            for kind, run in runs.items() if kind != "netns"}
    disk = tmps["loop"] / "disk.img"
    disk.write_bytes(b"\0" * (1 << 20))
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    RUNS_DIR.mkdir(exist_ok=True)
    try:
        netns.create(ns)
        with btrfs.loop_attached(disk) as dev:
            found = run_resources()
            assert set(runs.values()) <= set(found)
            disk.unlink()  # the loop device alone names the run now
            tmps["loop"].rmdir()
            assert runs["loop"] in run_resources() and dev
        for run in runs.values():
            (RUNS_DIR / run).write_text(str(owner.pid))
        assert not set(runs.values()) & set(sweep_dead_runs())
        assert netns.netns_path(ns).exists() and tmps["tmp"].is_dir()
        owner.kill()
        owner.wait()
        swept = sweep_dead_runs()
        assert {runs["netns"], runs["tmp"]} <= set(swept)
        assert not netns.netns_path(ns).exists() and not tmps["tmp"].exists()
    finally:
        owner.kill()
        owner.wait()
        for run in runs.values():
            (RUNS_DIR / run).unlink(missing_ok=True)
        if netns.netns_path(ns).exists():
            netns.delete(ns)
        for d in tmps.values():
            shutil.rmtree(d, ignore_errors=True)
