"""QEMU's stderr log is size-capped and keeps its tail: a process flooding its stderr (as a
guest can make QEMU print) never blocks on it, the file stays under the cap, and the last
message is what the error path quotes."""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from rollbox.backends.microvm import jail as jail_mod
from rollbox.backends.microvm.jail import Jail, QemuLog

# Writes 8 MiB to a non-blocking stderr as fast as it can (what does not fit is dropped, as
# QEMU's fprintf drops it), then 1 MiB it retries until the pipe takes it (what reaches the
# file is four times the cap), then one last line.
FLOOD = r"""
import os, time
line = b"qemu-system-x86_64: warning: guest-made noise " * 20 + b"\n"
tried = 0
while tried < 8 << 20:
    try:
        os.write(2, line)
    except BlockingIOError:
        pass
    tried += len(line)
sent = 0
while sent < 1 << 20:
    try:
        sent += os.write(2, line)
    except BlockingIOError:
        time.sleep(0.001)
while True:
    try:
        os.write(2, b"last: the reason QEMU stopped\n")
        break
    except BlockingIOError:
        time.sleep(0.01)
"""


async def test_a_flood_on_stderr_is_capped_and_the_tail_kept(tmp_path: Path) -> None:
    qlog = QemuLog(tmp_path / "qemu.log")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOOD, stderr=qlog.write_fd)
    qlog.start()
    # the writer never waits for the reader: it ends on its own, whatever we read
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    for _ in range(200):  # the reader catches up, then sees the end (the pipe closed)
        if qlog.read_fd < 0:
            break
        await asyncio.sleep(0.05)
    assert qlog.read_fd < 0
    data = (tmp_path / "qemu.log").read_bytes()
    assert len(data) <= jail_mod.LOG_MAX + 100
    assert data.endswith(b"last: the reason QEMU stopped\n")
    assert data.startswith(b"[rollbox: ") and b"earlier bytes of QEMU's log dropped" in data
    qlog.close()


async def test_log_tail_reads_what_is_still_in_the_pipe(tmp_path: Path) -> None:
    jail = Jail(tmp_path, "rollbox-unit", "vmlog")
    jail.dir.mkdir()
    jail.qemu_log = QemuLog(jail.log_file)
    os.write(jail.qemu_log.write_fd, b"rollbox-jailer: mount of /vm/layer0 failed\n")
    jail.qemu_log.start()  # nothing read yet: the tail drains the pipe first
    assert jail.log_tail() == "rollbox-jailer: mount of /vm/layer0 failed"
    jail.close_log()
    assert jail.qemu_log is None
