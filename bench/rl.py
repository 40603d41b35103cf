"""``rollbox bench rl [--quick] [--json] [--phases a,b]``: one node under an RL trainer's load.

Against ``rollbox serve`` in its own process (``embedded.ServerProcess``), on a scratch node of
its own (data dir, run dir, cgroup parent, node id, uid range; the node's images read-only)
with the built-in PyPI mirror enabled on a free port (``ROLLBOX_PYPI_MIRROR=1``); every phase
on ``IMAGE``. Phases, each checking free disk first (it names what it needs) and skipped with
the reason in the JSON when it can not run, each with a timeout:

1. ``grpo``: a GRPO burst, ``GROUPS`` groups x ``SAMPLES`` samples at default resources, every
   group one ``client.create_many``, all groups at once. Per sample the fixed workload
   ``WORKLOAD`` (a ``pip install`` of ``WHEEL`` from the mirror, 50 MB written into the
   writable layer, three small commands), then a grade in a fresh sandbox (``sb.grade``, the
   declared file ``ANSWER``), then the sandbox is deleted. The peer, in the same run: the same
   workload through podman (``run -d``, ``exec``, ``rm -f -t 0``; the same root filesystem
   imported as ``bench/container.py`` does; host network, pip pointed at the same mirror; the
   grade a fresh ``podman run --rm`` with the declared file copied out by ``podman cp`` and
   bind-mounted read-only). The mirror's cache is warmed before either timer.
2. ``many``: ``N_MANY`` sandboxes from one ``create_many``, each answering ``exec true``, then
   all deleted.
3. ``write``: ``N_WRITE`` sandboxes each writing 512 MiB into its writable layer (32 GiB, more
   than this host's RAM), in 32 MiB appends so that a memory-backed layer can be stopped
   before MemAvailable crosses the floor (``MEM_FLOOR_MIB`` plus what may still be in flight).
4. ``restart``: 16 sandboxes with commands mid-stream (one printing ~13 MB while the server is
   down), the server killed with SIGKILL and started again on the same port; half waited for
   by the ``sb.exec`` call started before the kill, half re-attached by exec id
   (``exec_background`` + ``process(id).wait()``). A command is recovered when its exit code
   is right and its output is, within the 1 MiB bound (every byte kept is the right byte at
   its place, the byte count is the command's).
5. ``files``: four concurrent single-file transfers of ``TRANSFER_BYTES`` each (writes, then
   reads) into four sandboxes; the server's peak RSS.

**CPU per episode** (``grpo``). The workload's own CPU is what each command's shell reports
with ``times`` (its own and its waited-for children's user + system time): the same commands,
counted the same way in both peers. ``platform_cpu_s_per_episode`` = (the server's CPU with its
reaped children's -- runc, the agents and what they reaped -- + the client's, i.e. this
process) minus the workload's own, per episode. For podman: the peer runs in a child process
that is a child subreaper, so every podman, conmon, runc and container process ends reaped
below it; its CPU with its reaped children's, plus the server's during that phase (the mirror
it serves), minus the workload's own. ``*_machine`` variants take the machine's busy CPU
(``/proc/stat``) instead of the process trees (they include whatever else runs on the host).

MemAvailable (``/proc/meminfo``) and the server's RSS are sampled every 50 ms from a thread
throughout. The last line of ``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.container import PODMAN_ULIMITS, podman_prepare  # noqa: E402
from rollbox.benchkit import (  # noqa: E402
    MiB, emit, machine_busy_s, mem_available, percentile, process_cpu_s, ratio, rounded, rss_bytes,
    say,
)
from rollbox.config import Settings  # noqa: E402
from rollbox.embedded import ServerProcess, _free_port  # noqa: E402

BASE_IMAGE = "python:3.11"
# python:3.11 + the bytecode of its standard library and packages (``compileall``; a no-op
# where the base already has it): an image built before the bytecode policy kept none, and
# then every fresh sandbox compiles pip (~0.9 s of CPU) -- work neither platform does for real
# images, which ship bytecode. Built once (before any timer); both peers run it.
IMAGE = "bench/rl-python:3.11"
COMPILE = ("python3 -m compileall -q -j 0 /usr/lib/python3.11 /usr/lib/python3/dist-packages "
           ">/dev/null; true")  # a few test files of the standard library do not compile
PHASES = ("grpo", "many", "write", "restart", "files")
GROUPS, SAMPLES = 32, 8
QUICK_GROUPS = 2
N_MANY, QUICK_N_MANY = 1024, 256
N_WRITE, QUICK_N_WRITE = 64, 16
WRITE_BYTES, WRITE_CHUNK = 512 << 20, 32 << 20
N_RESTART = 16
TRANSFER_BYTES, QUICK_TRANSFER_BYTES = 10**9, 256 << 20
PROBE_BYTES = 256 << 20  # the files phase measures here before it tries TRANSFER_BYTES
UID_SLOTS = 1040  # the node's sandboxes at most at once (1,024 in `many`), below uid 2^31
MEM_FLOOR_MIB = 2048  # the target: host MemAvailable never below 2 GiB
GRPO_FLOOR_MIB = MEM_FLOOR_MIB + 512  # a burst stopped (and reported) before the host is short
GIB = 1 << 30

# The fixed GRPO workload: (name, shell command, text its output must contain). Not in the
# image: six (a pure-Python wheel of 11 KB) -- so pip really downloads and installs it.
WHEEL = "six==1.16.0"
ANSWER = "/work/answer.py"
WORKLOAD: tuple[tuple[str, str, str], ...] = (
    ("pip", "python3 -m pip install -q --no-deps --no-cache-dir --disable-pip-version-check "
            f"--break-system-packages {WHEEL} && python3 -c 'import six; print(six.__version__)'",
     "1.16.0"),
    ("write_50mb", "head -c 50000000 /dev/zero > /root/blob && stat -c %s /root/blob",
     "50000000"),
    ("python", "python3 -c 'import json, sys; print(json.dumps({\"v\": sys.version_info[0]}))'",
     '{"v": 3}'),
    ("read", "grep -c . /etc/os-release && head -c 4096 /root/blob | wc -c", "4096"),
    ("test", f"mkdir -p /work && printf 'def double(x):\\n    return 2 * x\\n' > {ANSWER} && "
             "cd /work && python3 -c 'from answer import double; assert double(2) == 4; "
             "print(\"tests passed\")'", "tests passed"),
)
GRADE = ("cd /work && python3 -c 'from answer import double; assert double(21) == 42; "
         "print(\"reward 1\")'", "reward 1")
_TIMES = re.compile(r"(\d+)m([\d.]+)s")
_LOST = re.compile(r"\[\.\.\. (\d+) bytes lost to a server restart \.\.\.\]\n")
_DROPPED = re.compile(r"\n\[\.\.\. (\d+) bytes dropped \.\.\.\]\n")
_IDS = re.compile(r"\b(rl[0-9a-f]+-[0-9a-f]{12}|e\d+)\b")  # sandbox and exec ids


# ---- pure parts (tests/unit/test_bench_rl.py) -----------------------------------------------

@dataclass
class Options:
    quick: bool = False
    json_out: bool = False
    phases: tuple[str, ...] = PHASES


def parse_args(argv: list[str]) -> Options:
    """``[--quick] [--json] [--phases grpo,many,write,restart,files]``."""
    opts = Options()
    it = iter(argv)
    for a in it:
        if a == "--quick":
            opts.quick = True
        elif a == "--json":
            opts.json_out = True
        elif a == "--phases" or a.startswith("--phases="):
            value = a.partition("=")[2] if "=" in a else next(it, "")
            names = tuple(p.strip() for p in value.split(",") if p.strip())
            unknown = [p for p in names if p not in PHASES]
            if not names or unknown:
                raise SystemExit(f"--phases: pick from {','.join(PHASES)} (got {value!r})")
            opts.phases = tuple(p for p in PHASES if p in names)
        else:
            raise SystemExit(f"unknown argument {a!r}: [--quick] [--json] [--phases a,b]")
    return opts


def timed(cmd: str) -> str:
    """``cmd`` as a shell script that ends by printing ``times`` (the shell's and its waited-for
    children's CPU), keeping the command's exit status (``cmd`` in a subshell: an ``exit`` in it
    must not skip ``times``)."""
    return f"(\n{cmd}\n)\nrc=$?\ntimes\nexit $rc"


def split_times(stdout: str) -> tuple[str, float]:
    """(the command's own output, the CPU seconds ``times`` reported after it). dash and bash
    both print two lines, ``user system`` of the shell and of its children."""
    lines = stdout.rstrip("\n").split("\n")
    cpu = 0.0
    for line in lines[-2:]:
        for m, s in _TIMES.findall(line):
            cpu += int(m) * 60 + float(s)
    return "\n".join(lines[:-2]), cpu


def output_within_bound(expected: str, stdout: str, stdout_bytes: int) -> bool:
    """True when ``stdout`` holds only right bytes at their places and enough of them: the
    edge's result is ``[... N bytes lost to a server restart ...]`` (optional), a head from
    offset N, ``[... M bytes dropped ...]`` and a tail (optional); the head must be the
    command's bytes from N, the tail its last bytes, the byte count its own, and its last
    min(64 KiB, what follows the head) must be there."""
    if stdout_bytes != len(expected):
        return False
    start = 0
    if m := _LOST.match(stdout):
        start, stdout = int(m.group(1)), stdout[m.end():]
    m = _DROPPED.search(stdout)
    head, tail = (stdout[:m.start()], stdout[m.end():]) if m else (stdout, "")
    if not expected.startswith(head, start) or not expected.endswith(tail):
        return False
    rest = len(expected) - start - len(head)  # after the head
    return rest == 0 if not tail else len(tail) >= min(64 << 10, rest)


def ticker(i: int, ticks: int) -> tuple[str, str, int]:
    """A restart-phase command: (shell command, its whole stdout, its exit code)."""
    code = i % 5
    cmd = f"for i in $(seq 1 {ticks}); do echo tick {i} $i; sleep 0.25; done; exit {code}"
    return cmd, "".join(f"tick {i} {k}\n" for k in range(1, ticks + 1)), code


def big_writer(delay_s: float, lines: int) -> tuple[str, str, int]:
    """Prints ~10 MB (``lines`` numbered lines) after ``delay_s``: while the server is down."""
    cmd = f"sleep {delay_s}; seq -f 'line %.0f' 1 {lines}"
    return cmd, "".join(f"line {k}\n" for k in range(1, lines + 1)), 0


def summary_keys(res: dict[str, Any]) -> dict[str, Any]:
    """The headline figures (the issue's keys) and the targets, from the phase results."""
    g, p = res.get("grpo", {}), res.get("grpo_podman", {})
    out: dict[str, Any] = {
        "episodes_per_s": g.get("episodes_per_s"),
        "errors": g.get("errors"),
        "ratio_vs_podman": ratio(g.get("episodes_per_s") or None, p.get("episodes_per_s")),
        "platform_cpu_s_per_episode": g.get("platform_cpu_s_per_episode"),
        "podman_platform_cpu_s_per_episode": p.get("platform_cpu_s_per_episode"),
        "platform_cpu_s_per_episode_machine": g.get("platform_cpu_s_per_episode_machine"),
        "podman_platform_cpu_s_per_episode_machine": p.get("platform_cpu_s_per_episode_machine"),
        "podman_errors": p.get("errors"),
        "sandboxes_1024_ok": res.get("many", {}).get("ok"),
        "write_64x512_ok": res.get("write", {}).get("ok"),
        "host_mem_available_min_mib": res.get("write", {}).get("mem_available_min_mib"),
        "restart_commands_recovered": res.get("restart", {}).get("recovered"),
        "server_rss_peak_mib": res.get("files", {}).get("server_rss_peak_mib"),
    }
    cpu, pcpu = out["platform_cpu_s_per_episode"], out["podman_platform_cpu_s_per_episode"]
    vs_podman = out["ratio_vs_podman"]
    mem = out["host_mem_available_min_mib"]
    rss = out["server_rss_peak_mib"]
    out["targets"] = {
        "errors==0": out["errors"] == 0 if out["errors"] is not None else None,
        "ratio_vs_podman>=1.5": vs_podman >= 1.5 if vs_podman is not None else None,
        "platform_cpu<=podman/3": cpu <= pcpu / 3 if cpu is not None and pcpu else None,
        "sandboxes_1024_ok==1": out["sandboxes_1024_ok"] == 1
        if out["sandboxes_1024_ok"] is not None else None,
        "write_64x512_ok==1": out["write_64x512_ok"] == 1
        if out["write_64x512_ok"] is not None else None,
        "host_mem_available_min_mib>=2048": mem >= MEM_FLOOR_MIB if mem is not None else None,
        "restart_commands_recovered==1.0": out["restart_commands_recovered"] == 1.0
        if out["restart_commands_recovered"] is not None else None,
        "server_rss_peak_mib<=300": rss <= 300 if rss is not None else None,
    }
    return out


# ---- host sampling ----------------------------------------------------------------------------

def mem_available_mib() -> int:
    return mem_available() >> 20


def disk_short(path: Path, need: int, what: str) -> str | None:
    """None if the filesystem of ``path`` has ``need`` bytes free, else the reason."""
    free = shutil.disk_usage(path).free
    if free >= need:
        return None
    return (f"needs {need / GIB:.1f} GiB free on {path} for {what}; "
            f"{free / GIB:.1f} GiB free")


class HostWatch:
    """MemAvailable and the server's RSS every 50 ms, from a thread (the event loop may be
    busy exactly when it matters). ``window()`` resets the minimum and the peak for a phase;
    ``arm(floor)`` sets an asyncio event once MemAvailable drops below ``floor`` MiB."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.mem_min = self.mem_min_all = mem_available_mib()
        self.rss_peak = 0.0
        self._floor: int | None = None
        self._trip: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            m = mem_available_mib()
            self.mem_min, self.mem_min_all = min(self.mem_min, m), min(self.mem_min_all, m)
            if (proc := self.server.proc) is not None:  # the server of the moment (restarts)
                with contextlib.suppress(OSError):  # killed meanwhile
                    self.rss_peak = max(self.rss_peak, rss_bytes(proc.pid) / MiB)
            trip, floor = self._trip, self._floor
            if trip is not None and floor is not None and m < floor:
                loop, ev = trip
                loop.call_soon_threadsafe(ev.set)

    def window(self) -> None:
        self.mem_min = mem_available_mib()
        proc = self.server.proc
        self.rss_peak = 0.0
        with contextlib.suppress(OSError):
            self.rss_peak = rss_bytes(proc.pid) / MiB if proc is not None else 0.0

    @contextlib.contextmanager
    def arm(self, floor_mib: int) -> Iterator[asyncio.Event]:
        ev = asyncio.Event()
        self._trip, self._floor = (asyncio.get_running_loop(), ev), floor_mib
        try:
            yield ev
        finally:
            self._trip = self._floor = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


async def guarded(work: Awaitable[Any], tripped: asyncio.Event) -> tuple[bool, Any]:
    """(False, None) if ``tripped`` fires first (``work`` is cancelled), else (True, result)."""
    task = asyncio.ensure_future(work)
    trip = asyncio.ensure_future(tripped.wait())
    try:
        await asyncio.wait({task, trip}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        trip.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    return False, None


# ---- the server -------------------------------------------------------------------------------

def scratch_server_settings(root: Path, name: str, band: int, uid_slots: int) -> Settings:
    """Settings of a benchmark's scratch server node ``rollbox-bench-<name>-<tag>``: data dir
    below ``root``, a run tmpfs, its own cgroup parent and node id, and uid band ``band``
    above the test runs' bands (each benchmark its own), so it never meets the node's own or
    a test's sandboxes."""
    tag = secrets.token_hex(3)
    node = Settings()
    s = Settings.scratch(root)
    s.run_dir, s.run_tmpfs = Path(f"/run/rollbox-bench-{name}-{tag}"), True
    s.cgroup_parent, s.node_id = f"rollbox-bench-{name}-{tag}", f"{name}{tag}"
    s.uid_base = node.uid_base + (node.uid_slots + 64 + 8 * 1024 + band) * 65536
    s.uid_slots = uid_slots
    return s


class Server(ServerProcess):
    """``rollbox serve`` in its own process on a scratch node: its own data dir (below
    ``root``), run dir (a tmpfs the backend mounts), cgroup parent, node id and uid range
    (above the test runs' bands), so nothing here meets the node's own or a test's sandboxes;
    the node's images are read, never written. The PyPI mirror runs in the server on
    ``mirror_port``. ``kill`` + ``start`` is the restart scenario; ``cpu_s`` spans them."""

    def __init__(self, root: Path) -> None:
        super().__init__(scratch_server_settings(root, "rl", 16, UID_SLOTS))
        self.root = root
        self.mirror_port = _free_port()
        self.mirror_url = f"http://127.0.0.1:{self.mirror_port}/simple/"
        assert self.env is not None
        self.env.update(ROLLBOX_PYPI_MIRROR="1", ROLLBOX_PYPI_MIRROR_PORT=str(self.mirror_port))
        self.cpu_dead = 0.0  # CPU of the server processes this run killed

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_s(self) -> float:
        """The server's CPU with its reaped children's (runc, the agents), across restarts."""
        return self.cpu_dead + (process_cpu_s(self.pid, children=True) if self.proc else 0.0)

    def kill(self) -> None:
        if self.proc is not None:  # read before it goes: a zombie has no children's time
            self.cpu_dead += process_cpu_s(self.pid, children=True)
        super().kill()

    def stop(self) -> None:
        super().stop()
        with contextlib.suppress(OSError):
            self.settings.run_dir.rmdir()  # the backend took its tmpfs down when it stopped

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


# ---- phase 1: GRPO burst ----------------------------------------------------------------------

@dataclass
class Tally:
    episodes: int = 0
    errors: int = 0
    workload_cpu_s: float = 0.0
    first_errors: list[str] = field(default_factory=list)
    episode_s: list[float] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(what[:400])


def check_step(t: Tally, name: str, code: int | None, stdout: str, expect: str) -> bool:
    out, cpu = split_times(stdout)
    t.workload_cpu_s += cpu
    if code != 0 or expect not in out:
        t.fail(f"{name}: exit {code}, output {out[-200:]!r}")
        return False
    return True


async def grpo_rollbox(client: Any, groups: int, t: Tally) -> None:
    from rollbox import errors

    async def sample(sb: Any) -> None:
        t0 = time.monotonic()
        try:
            for name, cmd, expect in WORKLOAD:
                r = await sb.exec(timed(cmd), timeout=600)
                if not check_step(t, name, r.exit_code, r.stdout, expect):
                    return
            g = await sb.grade(timed(GRADE[0]), files=[ANSWER], timeout=600)
            if check_step(t, "grade", g.result.exit_code, g.result.stdout, GRADE[1]):
                t.episodes += 1
                t.episode_s.append(time.monotonic() - t0)
        except errors.RollboxError as exc:
            t.fail(f"{type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(errors.RollboxError):
                await sb.delete()

    async def group(g: int) -> None:
        try:
            boxes = await client.create_many(SAMPLES, IMAGE, network=["pypi"], ttl_s=3600,
                                             labels={"bench": "rl-grpo", "group": str(g)})
        except errors.RollboxError as exc:
            for _ in range(SAMPLES):
                t.fail(f"create_many: {type(exc).__name__}: {exc}")
            return
        await asyncio.gather(*(sample(sb) for sb in boxes))

    await asyncio.gather(*(group(g) for g in range(groups)))


async def warm_mirror(client: Any) -> str | None:
    """One pip install through the mirror before any timer: its cache then holds the wheel
    and the index page for both peers."""
    async with await client.create(IMAGE, network=["pypi"], ttl_s=600) as sb:
        r = await sb.exec(timed(WORKLOAD[0][1]), timeout=300)
        if r.exit_code != 0:
            return f"pip through the mirror failed: {r.stdout[-300:]} {r.stderr[-300:]}"
    return None


def episodes_figures(t: Tally, wall: float, platform_cpu: float, machine_cpu: float,
                     n: int) -> dict[str, Any]:
    return {"episodes": t.episodes, "errors": t.errors, "wall_s": wall,
            "episodes_per_s": t.episodes / wall if wall else 0.0,
            "episode_p50_s": percentile(t.episode_s, 50),
            "episode_p99_s": percentile(t.episode_s, 99),
            "workload_cpu_s_per_episode": t.workload_cpu_s / max(1, n),
            "platform_cpu_s_per_episode": (platform_cpu - t.workload_cpu_s) / max(1, n),
            "platform_cpu_s_per_episode_machine": (machine_cpu - t.workload_cpu_s) / max(1, n),
            "first_errors": t.first_errors}


async def phase_grpo(server: Server, groups: int, watch: HostWatch) -> dict[str, Any]:
    from rollbox.sdk import AsyncClient

    n = groups * SAMPLES
    async with AsyncClient(base_url=server.url, api_key=server.key, timeout=600) as client:
        if (why := await warm_mirror(client)) is not None:
            return {"skipped": why}
        t = Tally()
        with watch.arm(GRPO_FLOOR_MIB) as tripped:
            c0, s0, m0 = process_cpu_s(), server.cpu_s(), machine_busy_s()
            w0 = time.monotonic()
            done, _ = await guarded(grpo_rollbox(client, groups, t), tripped)
            wall = time.monotonic() - w0
            own = process_cpu_s() - c0 + server.cpu_s() - s0
            machine = machine_busy_s() - m0
        res = episodes_figures(t, wall, own, machine, n)
        if not done:
            res["aborted"] = f"MemAvailable fell below {GRPO_FLOOR_MIB} MiB"
            res["left_behind_deleted"] = await delete_all(client, {"bench": "rl-grpo"})
    res["n"] = n
    return res


# ---- phase 1, the podman peer (in a child subreaper process) -----------------------------------

PR_SET_CHILD_SUBREAPER = 36
PODMAN_LABEL = "rollbox-bench-rl"  # = the run's id, on every container of the peer
PODMAN_TAG = "localhost/rollbox-bench-" + IMAGE.replace(":", "-").replace("/", "-")  # its import


# podman commands in flight at most, as create_many's default concurrency (a podman exec stays
# in flight while its command runs, so this bounds the peer's commands too: 32 at once keep two
# cores busy; more would only queue on them, holding ~50 MB per podman process).
PODMAN_IN_FLIGHT = asyncio.Semaphore(32)


async def podman(*args: str, timeout: float = 600) -> tuple[int, str]:
    async with PODMAN_IN_FLIGHT:
        p = await asyncio.create_subprocess_exec(
            "podman", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(p.communicate(), timeout)
        except TimeoutError:
            p.kill()
            await p.wait()
            return -1, "timeout"
    return p.returncode or 0, (out.decode(errors="replace")
                               + (err.decode(errors="replace") if p.returncode else ""))


def podman_options(image: str) -> list[str]:
    """Default rollbox resources and the image's environment, as podman options (``podman
    import`` takes the root filesystem only)."""
    from rollbox.images.store import ImageStore
    from rollbox.models import Resources

    r = Resources()
    env = ImageStore(Settings().images_dir).resolve(image).config.get("env", {})
    return ["--cpus", str(r.cpus), "--memory", f"{r.memory_mib}m", "--pids-limit", str(r.pids),
            *PODMAN_ULIMITS, *(a for k, v in env.items() for a in ("-e", f"{k}={v}"))]


async def ensure_image() -> None:
    """``IMAGE`` over the current ``BASE_IMAGE``: built, or rebuilt when the base changed."""
    from rollbox.backends.container.build import build_layer_with_commands
    from rollbox.images.store import ImageStore

    store = ImageStore(Settings().images_dir)
    base = store.resolve(BASE_IMAGE).layers
    with contextlib.suppress(Exception):
        if list(store.resolve(IMAGE).layers[:-1]) == list(base):
            return
    say(f"building {IMAGE} ({BASE_IMAGE} + compileall) ...")
    await build_layer_with_commands(store, BASE_IMAGE, [COMPILE], IMAGE, network="none",
                                    log=lambda _msg: None)


async def grpo_podman(tag: str, mirror: str, groups: int, run: str, t: Tally,
                      tmp: Path) -> None:
    limits = [*podman_options(IMAGE), "--label", f"{PODMAN_LABEL}={run}"]

    async def sample(cid: str) -> None:
        t0 = time.monotonic()
        try:
            for name, cmd, expect in WORKLOAD:
                code, out = await podman("exec", cid, "sh", "-c", timed(cmd))
                if not check_step(t, name, code, out, expect):
                    return
            d = Path(tempfile.mkdtemp(dir=tmp))
            code, out = await podman("cp", f"{cid}:{ANSWER}", str(d / "answer.py"))
            if code != 0:
                t.fail(f"podman cp: {out[-300:]}")
                return
            code, out = await podman("run", "--rm", "--network", "none", *limits, "-v",
                                     f"{d / 'answer.py'}:{ANSWER}:ro", tag, "sh", "-c",
                                     timed(GRADE[0]))
            shutil.rmtree(d, ignore_errors=True)
            if check_step(t, "grade", code, out, GRADE[1]):
                t.episodes += 1
                t.episode_s.append(time.monotonic() - t0)
        finally:
            code, out = await podman("rm", "-f", "-t", "0", cid)
            if code != 0:
                t.fail(f"podman rm: {out[-300:]}")

    async def create() -> str | None:
        code, out = await podman("run", "-d", "--network", "host", *limits,
                                 "-e", f"PIP_INDEX_URL={mirror}", tag, "sleep", "infinity")
        if code != 0:
            t.fail(f"podman run -d: {out[-300:]}")
            return None
        return out.strip().splitlines()[-1]

    async def group() -> None:
        cids = await asyncio.gather(*(create() for _ in range(SAMPLES)))
        await asyncio.gather(*(sample(c) for c in cids if c))

    await asyncio.gather(*(group() for _ in range(groups)))


def podman_peer_main(arg: str) -> None:
    """``python bench/rl.py --podman-peer JSON``: the podman half of ``grpo``, as a child
    subreaper (conmon daemonizes; its processes end reaped here, so their CPU is counted)."""
    cfg = json.loads(arg)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    t = Tally()
    tmp = Path(tempfile.mkdtemp(prefix="rollbox-bench-rl-podman-"))
    w0 = time.monotonic()
    try:
        asyncio.run(grpo_podman(cfg["tag"], cfg["mirror"], cfg["groups"], cfg["run"], t, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - w0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # orphans (conmon) that are still on their way out
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
    emit({"episodes": t.episodes, "errors": t.errors, "wall_s": wall,
          "workload_cpu_s": t.workload_cpu_s, "cpu_s": process_cpu_s(children=True),
          "episode_s": t.episode_s, "first_errors": t.first_errors}, json_out=True, digits=None)


async def phase_grpo_podman(server: Server, groups: int, watch: HostWatch) -> dict[str, Any]:
    if not shutil.which("podman"):
        return {"skipped": "podman not installed"}
    await podman("rmi", "-f", PODMAN_TAG)  # this bench's own import of an earlier run
    tag = await asyncio.to_thread(podman_prepare, IMAGE)
    n = groups * SAMPLES
    run = secrets.token_hex(4)
    s0, m0 = server.cpu_s(), machine_busy_s()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--podman-peer",
        json.dumps({"tag": tag, "mirror": server.mirror_url, "groups": groups, "run": run}),
        stdout=asyncio.subprocess.PIPE)
    try:
        with watch.arm(GRPO_FLOOR_MIB) as tripped:
            done, got = await guarded(proc.communicate(), tripped)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        # whatever a killed or failed peer left (it removes its own containers)
        code, ids = await podman("ps", "-aq", "--filter", f"label={PODMAN_LABEL}={run}")
        left = ids.split() if code == 0 else []
        if left:
            await podman("rm", "-f", "-t", "0", *left)
    if not done:
        return {"aborted": f"MemAvailable fell below {GRPO_FLOOR_MIB} MiB", "left": len(left)}
    mirror_cpu, machine = server.cpu_s() - s0, machine_busy_s() - m0
    out = got[0]
    if proc.returncode != 0:
        return {"error": f"podman peer failed ({proc.returncode}): {out[-500:]!r}"}
    r = json.loads(out.decode().strip().splitlines()[-1])
    t = Tally(episodes=r["episodes"], errors=r["errors"], workload_cpu_s=r["workload_cpu_s"],
              first_errors=r["first_errors"], episode_s=r["episode_s"])
    res = episodes_figures(t, r["wall_s"], r["cpu_s"] + mirror_cpu, machine, n)
    res.update({"n": n, "image_tag": tag, "mirror_cpu_s": mirror_cpu, "left": len(left)})
    return res


# ---- phase 2: 1,024 at once -------------------------------------------------------------------

async def delete_all(client: Any, labels: dict[str, str]) -> int:
    """Delete every live sandbox with ``labels`` (also ones a cancelled call left behind)."""
    from rollbox import errors

    boxes = await client.list(labels=labels)
    sem = asyncio.Semaphore(32)

    async def rm(sb: Any) -> None:
        async with sem:
            with contextlib.suppress(errors.NotFound):
                await sb.delete()

    await asyncio.gather(*(rm(sb) for sb in boxes), return_exceptions=True)
    return len(boxes)


async def delete_left(server: Server) -> int:
    """Delete whatever sandbox a failed or timed-out phase left on the scratch node."""
    from rollbox.sdk import AsyncClient

    async with AsyncClient(base_url=server.url, api_key=server.key, timeout=120) as client:
        return await delete_all(client, {})


async def phase_many(server: Server, n: int) -> dict[str, Any]:
    from rollbox import errors
    from rollbox.sdk import AsyncClient

    labels = {"bench": "rl-many"}
    res: dict[str, Any] = {"n": n, "ok": 0}
    async with AsyncClient(base_url=server.url, api_key=server.key, timeout=600) as client:
        t0 = time.monotonic()
        try:
            boxes = await client.create_many(n, IMAGE, labels=labels, ttl_s=1800)
        except errors.RollboxError as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"[:500]
            res["create_s"] = time.monotonic() - t0
            res["left_behind_deleted"] = await delete_all(client, labels)
            return res
        res["create_s"] = time.monotonic() - t0
        sem = asyncio.Semaphore(64)

        async def true(sb: Any) -> bool:
            async with sem:
                try:
                    return (await sb.exec(["true"])).exit_code == 0
                except errors.RollboxError:
                    return False

        t1 = time.monotonic()
        answered = sum(await asyncio.gather(*(true(sb) for sb in boxes)))
        res["exec_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        await delete_all(client, labels)
        res["delete_s"] = time.monotonic() - t2
        res["left"] = len(await client.list(labels=labels))
    res.update(created=len(boxes), answered=answered,
               ok=int(len(boxes) == n and answered == n and res["left"] == 0))
    return res


# ---- phase 3: 64 x 512 MiB -------------------------------------------------------------------

async def phase_write(server: Server, n: int, watch: HostWatch) -> dict[str, Any]:
    from rollbox import errors
    from rollbox.sdk import AsyncClient

    labels = {"bench": "rl-write"}
    steps = WRITE_BYTES // WRITE_CHUNK
    # Stop issuing appends once MemAvailable is within what may still be in flight (one chunk
    # per sandbox) of the floor: with a memory-backed layer that is where it would go.
    stop_at = MEM_FLOOR_MIB + (n * WRITE_CHUNK >> 20) + 512
    res: dict[str, Any] = {"n": n, "bytes_each": WRITE_BYTES, "ok": 0, "guard_mib": stop_at}
    if (avail := mem_available_mib()) < stop_at:
        res["skipped"] = f"MemAvailable {avail} MiB is below the guard {stop_at} MiB at the start"
        return res
    written = 0
    failures: list[str] = []
    async with AsyncClient(base_url=server.url, api_key=server.key, timeout=600) as client:
        try:
            with watch.arm(stop_at) as tripped:
                t0 = time.monotonic()
                boxes = await client.create_many(n, IMAGE, labels=labels, ttl_s=1800)
                res["create_s"] = time.monotonic() - t0
                res["disk_tier"] = boxes[0].info.disk_tier

                async def writer(sb: Any) -> bool:
                    nonlocal written
                    for _ in range(steps):
                        if tripped.is_set():
                            return False
                        r = await sb.exec(f"head -c {WRITE_CHUNK} /dev/zero >> /root/big",
                                          timeout=600)
                        if r.exit_code != 0:
                            if len(failures) < 5:
                                failures.append(f"exit {r.exit_code}: {r.stderr[-200:]}")
                            return False
                        written += WRITE_CHUNK
                    r = await sb.exec("stat -c %s /root/big")
                    return r.exit_code == 0 and r.stdout.strip() == str(WRITE_BYTES)

                t1 = time.monotonic()
                done, results = await guarded(asyncio.gather(
                    *(writer(sb) for sb in boxes), return_exceptions=True), tripped)
                res["write_s"] = time.monotonic() - t1
                if not done:
                    res["aborted"] = (f"MemAvailable fell below {stop_at} MiB after "
                                      f"{written / GIB:.1f} GiB written: the writable layer is "
                                      "in memory")
                else:
                    okays = [r is True for r in results]
                    failures += [f"{type(r).__name__}: {r}"[:300] for r in results
                                 if isinstance(r, BaseException)][:5]
                    res["succeeded"] = sum(okays)
                    res["ok"] = int(all(okays) and len(okays) == n)
        except errors.RollboxError as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            res["written_gib"] = written / GIB
            res["failures"] = failures
            t2 = time.monotonic()
            await delete_all(client, labels)
            res["delete_s"] = time.monotonic() - t2
    return res


# ---- phase 4: restart with commands mid-stream ---------------------------------------------------

async def phase_restart(server: Server) -> dict[str, Any]:
    from rollbox import errors
    from rollbox.sdk import AsyncClient

    labels = {"bench": "rl-restart"}
    ticks = 40  # 10 s of output, across the kill and the restart
    cmds = [big_writer(1.5, 1_100_000) if i == 0 else ticker(i, ticks) for i in range(N_RESTART)]
    res: dict[str, Any] = {"n": N_RESTART, "recovered": 0.0, "big_output_bytes": len(cmds[0][1])}
    outcomes: list[str] = ["pending"] * N_RESTART
    client = AsyncClient(base_url=server.url, api_key=server.key, timeout=120)
    try:
        boxes = await client.create_many(N_RESTART, IMAGE, labels=labels, ttl_s=1800)
        foreground = range(0, N_RESTART, 2)  # sb.exec(...) started before the kill
        procs: dict[int, Any] = {}
        for i in range(1, N_RESTART, 2):  # exec_background; re-attached by id after
            procs[i] = await boxes[i].exec_background(cmds[i][0])

        async def fg(i: int) -> Any:
            return await boxes[i].exec(cmds[i][0])

        fg_tasks = {i: asyncio.create_task(fg(i)) for i in foreground}
        await asyncio.sleep(1.0)
        t_kill = time.monotonic()
        server.kill()
        await asyncio.sleep(3.0)  # the big writer prints its 10 MB now
        await asyncio.to_thread(server.start)
        res["down_s"] = time.monotonic() - t_kill
        res["readopted"] = len(await client.list(labels=labels))
        results: dict[int, Any] = {}
        for i, task in fg_tasks.items():
            try:
                results[i] = await task
            except errors.RollboxError as exc:
                outcomes[i] = f"exec: {type(exc).__name__}: {str(exc)[:200]}"
        for i, proc in procs.items():
            try:
                results[i] = await boxes[i].process(proc.exec_id).wait()
            except errors.RollboxError as exc:
                outcomes[i] = f"wait by id: {type(exc).__name__}: {str(exc)[:200]}"
        for i, r in results.items():
            _cmd, expected, code = cmds[i]
            if r.exit_code != code:
                outcomes[i] = f"exit {r.exit_code} (want {code})"
            elif not output_within_bound(expected, r.stdout, r.stdout_bytes):
                outcomes[i] = (f"output: {r.stdout_bytes} bytes, {len(r.stdout)} kept, "
                               f"{r.stdout_dropped} dropped (want {len(expected)})")
            else:
                outcomes[i] = "ok"
        res["recovered"] = outcomes.count("ok") / N_RESTART
        res["recovered_exec"] = sum(outcomes[i] == "ok" for i in foreground) / len(foreground)
        res["recovered_by_id"] = sum(outcomes[i] == "ok" for i in procs) / len(procs)
        res["big_writer"] = outcomes[0]
    except errors.RollboxError as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        kinds = [_IDS.sub("<id>", o) for o in outcomes]
        res["outcomes"] = dict(sorted({o: kinds.count(o) for o in kinds}.items(),
                                      key=lambda kv: -kv[1]))
        with contextlib.suppress(errors.RollboxError):
            await delete_all(client, labels)
        await client.close()
    return res


# ---- phase 5: single-file transfers --------------------------------------------------------------

class Pattern:
    """``size`` bytes: one random MiB over and over, streamed in 1 MiB chunks and checked at
    any chunking on the way back; neither side holds more than a chunk."""

    def __init__(self, size: int) -> None:
        self.size, self.block = size, os.urandom(1 << 20)

    async def chunks(self) -> Any:
        for off in range(0, self.size, len(self.block)):
            yield self.block[:self.size - off]

    def matches(self, off: int, data: bytes) -> bool:
        n = len(self.block)
        while data:
            i = off % n
            piece = data[:n - i]
            if piece != self.block[i:i + len(piece)]:
                return False
            off, data = off + len(piece), data[len(piece):]
        return True


async def transfers(server: Server, size: int, watch: HostWatch) -> dict[str, Any]:
    """Four sandboxes; four concurrent single-file writes of ``size`` bytes (streamed from an
    async iterator), then four concurrent streamed reads of them, checked; the server's peak
    RSS over both."""
    from rollbox import errors
    from rollbox.sdk import AsyncClient

    labels = {"bench": "rl-files"}
    mib = -(-size * 2 // (1 << 20))  # room for the file in the writable layer
    res: dict[str, Any] = {"bytes_each": size}
    pattern = Pattern(size)
    floor = MEM_FLOOR_MIB + 1024
    async with AsyncClient(base_url=server.url, api_key=server.key, timeout=600) as client:
        try:
            boxes = await client.create_many(4, IMAGE, labels=labels, ttl_s=1800,
                                             memory_mib=mib + 256, disk_mib=mib)
            res["disk_tier"] = boxes[0].info.disk_tier
            with watch.arm(floor) as tripped:
                watch.window()
                res["server_rss_before_mib"] = rss_bytes(server.pid) / MiB
                t0 = time.monotonic()
                done, _ = await guarded(asyncio.gather(
                    *(sb.files.write("/root/big.bin", pattern.chunks()) for sb in boxes)),
                    tripped)
                res["write_s"] = time.monotonic() - t0
                res["server_rss_peak_write_mib"] = watch.rss_peak
                if done:
                    async def same(sb: Any) -> bool:
                        off = 0
                        async for part in sb.files.read_stream("/root/big.bin"):
                            if not pattern.matches(off, part):
                                return False
                            off += len(part)
                        return off == size

                    t1 = time.monotonic()
                    done, back = await guarded(asyncio.gather(*(same(sb) for sb in boxes)),
                                               tripped)
                    res["read_s"] = time.monotonic() - t1
                    res["read_back_ok"] = int(done and all(back))
                res["server_rss_peak_mib"] = watch.rss_peak
                res["mem_available_min_mib"] = watch.mem_min
                if not done:
                    res["aborted"] = f"MemAvailable fell below {floor} MiB"
        except errors.RollboxError as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            await delete_all(client, labels)
    return res


async def phase_files(server: Server, size: int, watch: HostWatch) -> dict[str, Any]:
    """``transfers`` at ``PROBE_BYTES`` first; from the server's growth there, what ``size``
    would take: run it only if the host has that memory (a server that buffers whole bodies,
    plus a memory-backed writable layer), else report why not."""
    res: dict[str, Any] = {"n": 4, "bytes_each": size}
    probe = await transfers(server, min(size, PROBE_BYTES), watch)
    if size <= PROBE_BYTES or "server_rss_peak_mib" not in probe:
        return {**res, **probe}
    res["probe"] = probe
    growth = max(0.0, probe["server_rss_peak_mib"] - probe["server_rss_before_mib"])
    predicted = probe["server_rss_before_mib"] + growth * size / PROBE_BYTES
    in_memory = probe.get("disk_tier") == "memory"
    need = int(MEM_FLOOR_MIB + 1024 + predicted + (4 * size >> 20 if in_memory else 0))
    res["server_rss_peak_mib_predicted"] = predicted
    if (avail := mem_available_mib()) < need:
        res["skipped"] = (f"4 x {size >> 20} MiB would need MemAvailable >= {need} MiB (server "
                          f"~{predicted:.0f} MiB from the {PROBE_BYTES >> 20} MiB probe, "
                          f"{'the tmpfs layers, ' if in_memory else ''}the floor); {avail} MiB")
        return res
    return {**res, **await transfers(server, size, watch)}


# ---- the run ----------------------------------------------------------------------------------

async def run_phase(name: str, res: dict[str, Any], watch: HostWatch,
                    need: list[tuple[Path, int, str]], body: Callable[[], Awaitable[Any]],
                    timeout_s: float = 600) -> None:
    for path, nbytes, what in need:
        if (why := disk_short(path, nbytes, what)) is not None:
            res[name] = {"skipped": why}
            say(f"{name}: skipped: {why}")
            return
    watch.window()
    t0 = time.monotonic()
    say(f"{name} ...")
    try:
        r = await asyncio.wait_for(body(), timeout_s)
    except TimeoutError:  # a wedged phase is reported; what it left is deleted at the end
        r = {"error": f"timed out after {timeout_s:.0f} s"}
    except Exception as exc:  # noqa: BLE001 - one phase failing does not hide the others
        r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    r.setdefault("mem_available_min_mib", watch.mem_min)
    r["phase_s"] = time.monotonic() - t0
    r["load"] = os.getloadavg()[0]
    res[name] = r
    say(f"{name}: {json.dumps(rounded({k: v for k, v in r.items() if k != 'first_errors'}, 4))}")


async def run(opts: Options, server: Server, watch: HostWatch) -> dict[str, Any]:
    q = opts.quick
    groups = QUICK_GROUPS if q else GROUPS
    data = server.root
    await ensure_image()
    res: dict[str, Any] = {"quick": q, "image": IMAGE, "wheel": WHEEL, "groups": groups,
                           "samples": SAMPLES, "load_start": os.getloadavg()}
    n_eps = groups * SAMPLES
    podman_store = Path("/var/lib/containers/storage")
    podman_store = podman_store if podman_store.exists() else Path("/var/lib")
    if "grpo" in opts.phases:
        await run_phase("grpo", res, watch, [(data, n_eps * 60 * 10**6, f"{n_eps} x 50 MB")],
                        lambda: phase_grpo(server, groups, watch), 1200)
        await run_phase("grpo_podman", res, watch,
                        [(podman_store, n_eps * 60 * 10**6 + GIB, f"{n_eps} x 50 MB + image")],
                        lambda: phase_grpo_podman(server, groups, watch), 1500)
    if "many" in opts.phases:
        n = QUICK_N_MANY if q else N_MANY
        await run_phase("many", res, watch, [(data, n * (4 << 20), f"{n} sandboxes")],
                        lambda: phase_many(server, n))
    if "write" in opts.phases:
        n = QUICK_N_WRITE if q else N_WRITE
        await run_phase("write", res, watch,
                        [(data, n * WRITE_BYTES + 4 * GIB, f"{n} x 512 MiB + 4 GiB slack")],
                        lambda: phase_write(server, n, watch))
    if "restart" in opts.phases:
        await run_phase("restart", res, watch, [(data, GIB, "16 sandboxes + 10 MB output")],
                        lambda: phase_restart(server))
    if "files" in opts.phases:
        size = QUICK_TRANSFER_BYTES if q else TRANSFER_BYTES
        await run_phase("files", res, watch, [(data, 4 * size + GIB, f"4 x {size >> 20} MiB")],
                        lambda: phase_files(server, size, watch))
    res["load_end"] = os.getloadavg()
    res["left_at_end"] = await delete_left(server)
    res["host_mem_available_min_mib_run"] = watch.mem_min_all
    return res


def main(quick: bool = False, json_out: bool = False,
         phases: tuple[str, ...] = PHASES) -> dict[str, Any]:
    opts = Options(quick=quick, json_out=json_out, phases=phases)
    root = Path(tempfile.mkdtemp(prefix="rollbox-bench-rl-"))
    root.chmod(0o711)  # runc resolves paths below it as the sandbox's unprivileged host uid
    server = Server(root)
    watch = HostWatch(server)
    t0 = time.monotonic()
    try:
        server.start()
        res = asyncio.run(run(opts, server, watch))
    finally:
        watch.close()
        tail = server.log_tail()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    res["total_s"] = time.monotonic() - t0
    res = {**summary_keys(res), **res}
    if "Traceback" in tail:
        res["server_log_tail"] = tail
    say(json.dumps(res["targets"]))
    return emit(res, json_out, digits=4)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--podman-peer"]:
        podman_peer_main(sys.argv[2])
    else:
        o = parse_args(sys.argv[1:])
        main(quick=o.quick, json_out=o.json_out, phases=o.phases)
