"""``rollbox bench vm [--quick] [--json]``: full-VM (``vm`` backend) sandboxes on this node, with
a plain QEMU boot of the same machine and a microVM create of the same image as the peers, in
one run.

Against ``rollbox serve`` in its own process on a scratch node (``bench/microvm.py``'s: its
own data dir, run dir, cgroup parent, node id, uid band; the node's images and guest artifacts
read-only), image
``IMAGE`` (the layered ``busybox:test`` guest: the default tier's), one vCPU, ``VM`` resources
for every VM of the run. Phases:

1. ``ready``: create -> the agent answers (the first ``exec(["true"])`` returns 0), p50/p99
   over ``n`` sequential creates of a ``vm`` sandbox (a cold q35 boot through SeaBIOS: the
   backend has no templates yet); then the same for ``microvm`` sandboxes of the same image on
   the same server (a template restore after one untimed warm-up create; the microVM
   backend's default).
2. ``exec``: ``exec(["true"])`` round trip through the SDK in one live VM, p50/p99.
3. ``screenshot``: ``sandbox.screenshot()`` p50/p99 and the PNG's bytes and size.
4. ``input``: the API round trip of one input action: ``mouse.click`` and ``keyboard.type`` of
   ``TYPE_CHARS`` characters (paced by the backend: a PS/2 queue), p50/p99 each.
5. ``input_to_screen``: the console's cursor blink turned off in the guest, the screen checked
   to be still (``STILL_SHOTS`` equal screenshots ``STILL_GAP_S`` apart: nothing else draws),
   then one key typed and screenshots taken until one differs from the still screen (the key
   echoed on the console, tty1): the time from sending the key to that screenshot, p50/p99.
   Each sample types a letter, and a backspace afterwards puts the line back.
6. ``pause``: ``pause()`` and ``resume()`` round trips, and a screenshot after each resume.
   ``pause_fs``: the filesystem-only pause, ``pause(keep_memory=False)`` (guest synced, QEMU
   stopped and killed) and ``resume()`` (a cold boot over the kept disk, to the agent
   answering) round trips, a file written before the first checked after each resume and a
   screenshot taken: ``pause_fs_p50_ms``, ``resume_fs_p50_s``; with ``ready`` in the run,
   ``ratio_resume_fs_vs_cold_ready`` = resume_fs p50 / a cold create's ready p50 (the peer).
7. ``idle``: host memory per idle VM: the drop of MemAvailable / N after ``IDLE_SETTLE_S`` of N
   idle ``vm`` sandboxes; held = each answers a screenshot and an exec within 5 s.
8. ``plain``: the peer: ``qemu-system-x86_64`` started by this file with the backend's own
   machine (``backends/vm/machine.py``'s argv for the same spec: q35, SeaBIOS, VGA, xhci
   tablet, balloon, virtio-serial, the same kernel, initramfs, image layers and a fresh ext4
   writable disk), the jail's paths and inherited descriptors replaced by plain files and unix
   sockets; no jail, no cgroups, no edge or API. Boot -> the agent runs ``true``, sequential.
   ``ratio_vs_plain_qemu_ready`` = rollbox ready p50 / plain p50.

9. ``restore``: one ``vm`` sandbox's machine snapshot (``sandbox.snapshot``: disk + memory;
   ``snapshot_s`` the call, ``snapshot_paused_s`` the source held still, the state's MiB),
   then ``n`` sequential creates of a ``vm`` sandbox from it, each timed like ``ready``
   (create -> the first ``exec(["true"])`` returns 0): ``restore_ready_p50_s``/``p99``;
   ``ratio_restore_vs_cold_ready`` = restore p50 / cold ``ready`` p50 of the same run.

10. ``desktop`` and ``plain_desktop`` (opt-in: ``--desktop``; minutes under TCG): sequential
   ``create("desktop:1", backend="vm")`` (2 vCPUs, 1 GiB: the desktop demo's VM) -> the agent
   answers and -> the desktop drawn (``rollbox.desktop``'s check of the decoded screenshot:
   1024x768, mostly the desktop's colour, the panel), the first create reported apart (where
   the backend builds a template of the key, that one builds it); screenshot round trips of
   the drawn desktop; and, interleaved with the creates after the first, the peer: a plain
   QEMU boot of the same machine (``plain_argv`` of the disk spec: the same kernel,
   initramfs and agent, the base read-only under a new empty qcow2 overlay made by qemu-img
   as the backend makes it), overlay -> the desktop drawn in QMP screendumps.
   ``ratio_vs_plain_qemu_desktop`` = rollbox's p50 / plain's (that server boots every create:
   ``ROLLBOX_VM_FULL_TEMPLATES=off``). ``desktop_restore`` (opt-in too): the same creates on
   a server with ``ROLLBOX_VM_FULL_TEMPLATES=disk`` (the node default: the first builds the
   desktop's machine template, the others restore it): ``desktop_restore_ready``,
   ``ratio_desktop_restore_vs_plain_qemu``; and on each restored desktop the demo's scripted
   agent clicks the Editor launcher, types a line and saves it: ``desktop_restore_input``
   (create -> the editor's window drawn: the click accepted; the saved note checked,
   ``desktop_restore_input_errors`` counts the creates where it was not the line).
11. ``desktop_idle`` (opt-in too): idle desktop VMs held at once (the issue's >= 20 on this
   host), on a server with machine templates (the first create builds the desktop's template,
   untimed and deleted before the baseline): ``DESKTOP_IDLE_N`` creates of the desktop demo's
   VM one after another, each drawn; after ``IDLE_SETTLE_S`` of idling, the MemAvailable drop
   / N (``desktop_idle_mib_per_vm``) and what the VMs' cgroups are charged
   (``desktop_idle_cgroup_mib_per_vm``: other work on the host does not move it); the VMs' own
   CPU (their cgroups) over ``DESKTOP_IDLE_CPU_S`` of idle (``desktop_idle_cpu_pct_per_vm``,
   percent of one core per VM; the host's busy cores beside it); held = each answers a
   screenshot that still shows the desktop and an exec within ``ANSWER_S``
   (``desktop_idle_held``). A create refused by the node ends the creates: N is what it took.

``--only a,b`` runs just those phases (``PHASES``). The last line of ``--json`` is one JSON
object.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.microvm import PlainQemu, image_layers, parse_only, server  # noqa: E402
from rollbox.backends.microvm import qemu  # noqa: E402
from rollbox.backends.vm import display, machine, rootdisk  # noqa: E402
from rollbox.benchkit import (  # noqa: E402
    CpuMeter, emit, machine_busy_s, mem_available, percentile, ratio, round_trips, say,
)
from rollbox.config import Settings  # noqa: E402
from rollbox.isolation import cgroups  # noqa: E402

IMAGE = "busybox:test"
VM_MEMORY_MIB = 256
VM_DISK_MIB = 256
VM = {"cpus": 1, "memory_mib": VM_MEMORY_MIB, "disk_mib": VM_DISK_MIB}
TYPE_CHARS = 32       # characters per keyboard.type sample
STILL_SHOTS = 3       # equal screenshots that make the screen "still"
STILL_GAP_S = 0.3     # between them
SCREEN_WAIT_S = 10.0  # a typed key not drawn within this is a failed sample
IDLE_SETTLE_S = 10.0  # idle time before MemAvailable is read (balloon, free-page reporting)
ANSWER_S = 5.0        # an idle VM is held if it answers a screenshot and an exec within this
# the guest console's cursor, blinking: off for the input-to-screen phase (the sandbox's own
# /sys; fbcon's knob, or the VT's escape for a text-mode console)
CURSOR_BLINK_OFF = ("for f in /sys/class/graphics/fbcon/cursor_blink; do "
                    "[ -w $f ] && echo 0 > $f; done; printf '\\033[?25l' > /dev/tty1 || true")
PHASES = frozenset({"ready", "exec", "screenshot", "input", "input_to_screen", "pause",
                    "pause_fs", "idle", "plain", "restore"})
SERVER_PHASES = PHASES - {"plain"}
# Opt-in (``--desktop``, or named in ``--only``): the desktop:1 disk's boots, ~1-2 min each
# under TCG. ``desktop``: rollbox creates -> the desktop drawn; ``plain_desktop``: the peer.
DESKTOP_PHASES = frozenset({"desktop", "plain_desktop", "desktop_restore", "desktop_idle"})
# desktop_restore's server: disk-image creates restore a machine template (backends/vm/
# templates.py; the node default); the other phases' server boots every create
DESKTOP_TEMPLATES = {"ROLLBOX_VM_FULL_TEMPLATES": "disk"}
COLD = {"ROLLBOX_VM_FULL_TEMPLATES": "off"}
DESKTOP_CREATES, DESKTOP_CREATES_QUICK = 3, 2
DESKTOP_WAIT_S = 900.0  # boot -> drawn, at most
DESKTOP_IDLE_N, DESKTOP_IDLE_N_QUICK = 20, 4  # idle desktops held at once (the issue: >= 20)
DESKTOP_IDLE_CPU_S = 20.0  # the idle desktops' CPU is read over this window


# ---- pure parts (unit-tested) ----------------------------------------------------------------

def summarize(samples_s: list[float], prefix: str, unit: str = "ms") -> dict[str, float]:
    """``{prefix}_p50_<unit>`` and ``{prefix}_p99_<unit>`` of samples in seconds."""
    scale = 1000.0 if unit == "ms" else 1.0
    return {f"{prefix}_p50_{unit}": percentile(samples_s, 50) * scale,
            f"{prefix}_p99_{unit}": percentile(samples_s, 99) * scale}


def plain_argv(spec: qemu.MachineSpec, *, binary: str, kernel: Path, initrd: Path,
               layers: list[Path], rw: Path | None, agent: Path, qmp_sock: Path,
               base: Path | None = None, overlay: Path | None = None) -> list[str]:
    """The backend's own argv for ``spec`` (``machine.argv``) with the jail's fixed paths
    replaced by ``kernel``/``initrd``/``layers``/``rw`` (a disk image guest: ``base`` and
    its ``overlay``) and its inherited descriptors by unix sockets (agent, QMP) and a null
    console: the same machine, run by hand. ValueError if a jail path or descriptor is left
    (the backend's argv grew something this does not map)."""
    if len(layers) != spec.layers:
        raise ValueError(f"{len(layers)} layer files for a spec of {spec.layers}")
    paths = {qemu.KERNEL: str(kernel), qemu.INITRD: str(initrd)}
    files = {f"file={qemu.layer_path(i)},": f"file={p}," for i, p in enumerate(layers)}
    if rw is not None:
        files[f"file={qemu.RW_DISK},"] = f"file={rw},"
    if base is not None and overlay is not None:
        files[f"filename={rootdisk.BASE_IMG},"] = f"filename={base},"
        files[f"filename={rootdisk.ROOT_QCOW2},"] = f"filename={overlay},"
    chardevs = {
        f"socket,id=console,fd={qemu.CONSOLE_FD},server=on,wait=off": "null,id=console",
        f"socket,id=qmp,fd={qemu.QMP_FD},server=on,wait=off":
            f"socket,id=qmp,path={qmp_sock},server=on,wait=off",
        f"socket,id=agent,fd={qemu.AGENT_FD},server=on,wait=off":
            f"socket,id=agent,path={agent},server=on,wait=off",
    }
    out = []
    for arg in machine.argv(spec, binary):
        arg = paths.get(arg, chardevs.get(arg, arg))
        for old, new in files.items():
            arg = arg.replace(old, new)
        out.append(arg)
    left = [a for a in out if "/vm/" in a or "fd=" in a]
    if left:
        raise ValueError(f"jail paths or descriptors left in the plain argv: {left}")
    return out


async def wait_for_change(shot: Callable[[], Awaitable[bytes]], before: bytes,
                          timeout: float, since: float | None = None,
                          clock: Callable[[], float] = time.monotonic) -> float | None:
    """Seconds from ``since`` (a ``clock()`` time; default: the call) until a screenshot
    differs from ``before`` (compared by sha256; QEMU's PNG of an unchanged screen is the same
    bytes); None when none did ``timeout`` seconds after the call."""
    old = hashlib.sha256(before).digest()
    start = clock()
    t0 = start if since is None else since
    while clock() - start < timeout:
        if hashlib.sha256(await shot()).digest() != old:
            return clock() - t0
    return None


async def still_screen(shot: Callable[[], Awaitable[bytes]], n: int = STILL_SHOTS,
                       gap_s: float = STILL_GAP_S, tries: int = 10) -> bytes | None:
    """A screenshot equal to the ``n - 1`` taken before it ``gap_s`` apart (nothing draws),
    trying ``tries`` times; None if the screen never held still."""
    for _ in range(tries):
        first = await shot()
        for _ in range(n - 1):
            await asyncio.sleep(gap_s)
            if await shot() != first:
                break
        else:
            return first
    return None


def png_size(data: bytes) -> tuple[int, int]:
    from rollbox.backends.vm.display import png_size as size

    return size(data)


# ---- rollbox phases --------------------------------------------------------------------------

async def ready_times(client: Any, backend: str, n: int, image: str = IMAGE) -> dict[str, Any]:
    """n sequential creates: create -> the first exec ``true`` returned 0 (seconds)."""
    lat: list[float] = []
    errors = 0
    for _ in range(n):
        t = time.monotonic()
        sb = await client.create(image, backend=backend, **VM, ttl_s=600)
        try:
            r = await sb.exec(["true"])
            if r.exit_code == 0:
                lat.append(time.monotonic() - t)
            else:
                errors += 1
        finally:
            await sb.delete()
    return {"samples": lat, "errors": errors}


async def one_vm_phases(client: Any, quick: bool, phases: frozenset[str],
                        res: dict[str, Any]) -> None:
    """exec, screenshot, input, input_to_screen and pause on one live vm sandbox."""
    sb = await client.create(IMAGE, backend="vm", **VM, ttl_s=1800)
    try:
        await sb.exec(["true"])
        if "exec" in phases:
            lat = await round_trips(lambda: sb.exec(["true"]), 30 if quick else 200)
            res.update(summarize(lat, "exec"))
            say(f"exec true p50 {res['exec_p50_ms']:.1f} ms p99 {res['exec_p99_ms']:.1f} ms")
        # the bochs DRM driver sets its mode during the boot: wait until the size is stable
        await still_screen(sb.screenshot)
        if "screenshot" in phases:
            lat = await round_trips(sb.screenshot, 20 if quick else 100, warmup=3)
            shot = await sb.screenshot()
            w, h = png_size(shot)
            res.update(summarize(lat, "screenshot"))
            res.update(screenshot_bytes=len(shot), screenshot_size=[w, h])
            say(f"screenshot p50 {res['screenshot_p50_ms']:.1f} ms p99 "
                f"{res['screenshot_p99_ms']:.1f} ms ({len(shot)} bytes, {w}x{h})")
        if "input" in phases:
            d = await sb.display()
            n = 10 if quick else 50
            lat = await round_trips(lambda: sb.mouse.click(d.width // 2, d.height // 2), n, 2)
            res.update(summarize(lat, "click"))
            text = "a" * TYPE_CHARS
            lat = await round_trips(lambda: sb.keyboard.type(text), n // 2, 1)
            await sb.keyboard.press("ctrl+u")
            res.update(summarize(lat, f"type{TYPE_CHARS}"))
            res["type_chars"] = TYPE_CHARS
            say(f"click p50 {res['click_p50_ms']:.1f} ms; type {TYPE_CHARS} chars p50 "
                f"{res[f'type{TYPE_CHARS}_p50_ms']:.1f} ms")
        if "input_to_screen" in phases:
            await input_to_screen(sb, 5 if quick else 20, res)
        if "pause" in phases:
            pauses, resumes, shots_ok = [], [], 0
            for _ in range(3 if quick else 10):
                t = time.monotonic()
                await sb.pause()
                pauses.append(time.monotonic() - t)
                t = time.monotonic()
                await sb.resume()
                resumes.append(time.monotonic() - t)
                shots_ok += (await sb.screenshot())[:4] == b"\x89PNG"
            res.update(summarize(pauses, "pause"))
            res.update(summarize(resumes, "resume"))
            res["screenshot_after_resume_ok"] = shots_ok == len(resumes)
            say(f"pause p50 {res['pause_p50_ms']:.0f} ms, resume p50 "
                f"{res['resume_p50_ms']:.0f} ms")
        if "pause_fs" in phases:
            await sb.exec("echo kept > /root/fs-pause-mark")
            stops, boots, kept = [], [], 0
            for _ in range(2 if quick else 5):
                t = time.monotonic()
                await sb.pause(keep_memory=False)
                stops.append(time.monotonic() - t)
                t = time.monotonic()
                await sb.resume()
                await sb.exec(["true"])
                boots.append(time.monotonic() - t)
                kept += (await sb.exec("cat /root/fs-pause-mark")).stdout == "kept\n" and (
                    await sb.screenshot())[:4] == b"\x89PNG"
            res.update(summarize(stops, "pause_fs"))
            res.update(summarize(boots, "resume_fs", "s"))
            res["resume_fs_kept_files_ok"] = kept == len(boots)
            if res.get("cold_ready_p50_s"):
                res["ratio_resume_fs_vs_cold_ready"] = (res["resume_fs_p50_s"]
                                                        / res["cold_ready_p50_s"])
            say(f"filesystem pause p50 {res['pause_fs_p50_ms']:.0f} ms, resume -> ready p50 "
                f"{res['resume_fs_p50_s']:.2f} s (files kept: {res['resume_fs_kept_files_ok']})")
    finally:
        await sb.delete()


async def input_to_screen(sb: Any, n: int, res: dict[str, Any]) -> None:
    r = await sb.exec(CURSOR_BLINK_OFF)
    res["cursor_blink_off"] = r.exit_code == 0
    lat: list[float] = []
    failed = 0
    for i in range(n):
        before = await still_screen(sb.screenshot)
        if before is None:
            failed += 1
            continue
        t0 = time.monotonic()
        await sb.keyboard.type("abcdefghijklmnopqrstuvwxyz"[i % 26])
        took = await wait_for_change(sb.screenshot, before, SCREEN_WAIT_S, since=t0)
        if took is None:
            failed += 1
        else:
            lat.append(took)
        await sb.keyboard.press("backspace")
    res.update(summarize(lat, "input_to_screen"))
    res["input_to_screen_failed"] = failed
    say(f"input to screen p50 {res['input_to_screen_p50_ms']:.0f} ms p99 "
        f"{res['input_to_screen_p99_ms']:.0f} ms ({failed} of {n} failed)")


async def held_count(boxes: list[Any], shows: Callable[[bytes], bool]) -> int:
    """How many of ``boxes`` are held: each answers, within ``ANSWER_S``, a screenshot that
    ``shows`` accepts and an ``exec(["true"])`` that returns 0."""
    held = 0
    for sb in boxes:
        try:
            async with asyncio.timeout(ANSWER_S):
                ok = shows(await sb.screenshot())
                ok = ok and (await sb.exec(["true"])).exit_code == 0
            held += ok
        except Exception:  # noqa: BLE001 - a VM that does not answer is not held
            pass
    return held


async def idle_phase(client: Any, n: int, res: dict[str, Any]) -> None:
    await asyncio.sleep(2)
    before = mem_available()
    boxes: list[Any] = []
    try:
        for _ in range(n):
            boxes.append(await client.create(IMAGE, backend="vm", **VM, ttl_s=900))
        await asyncio.sleep(IDLE_SETTLE_S)
        drop = before - mem_available()
        held = await held_count(boxes, lambda shot: shot[:4] == b"\x89PNG")
    finally:
        for sb in boxes:
            with contextlib.suppress(Exception):
                await sb.delete()
    res["idle_mib_per_vm"] = drop / n / (1 << 20)
    res["idle_n"], res["idle_held"] = n, held
    say(f"idle: {res['idle_mib_per_vm']:.0f} MiB per VM, {held} of {n} held")


async def restore_phase(client: Any, n: int, res: dict[str, Any]) -> None:
    """A machine snapshot of one live vm sandbox, then n sequential restores of it."""
    name = f"bench/vm-restore-{os.getpid()}:1"
    src = await client.create(IMAGE, backend="vm", **VM, ttl_s=900)
    try:
        await src.exec(["true"])
        t = time.monotonic()
        snap = await src.snapshot(name)
        res["snapshot_s"] = time.monotonic() - t
        res["snapshot_paused_s"] = snap.paused_s
        res["snapshot_state_mib"] = snap.memory_bytes / (1 << 20)
        say(f"vm snapshot {res['snapshot_s']:.2f} s (held still {snap.paused_s:.2f} s, "
            f"state {res['snapshot_state_mib']:.0f} MiB)")
        r = await ready_times(client, "vm", n, image=name)
        res.update(summarize(r["samples"], "restore_ready", "s"))
        res["restore_ready_errors"] = r["errors"]
        res.pop("restore_ready", None)
        say(f"vm restore -> ready p50 {res['restore_ready_p50_s']:.2f} s p99 "
            f"{res['restore_ready_p99_s']:.2f} s (errors {r['errors']})")
    finally:
        await src.delete()
        with contextlib.suppress(Exception):
            await client.images.delete(name)


async def server_phases(srv: Any, quick: bool, phases: frozenset[str],
                        res: dict[str, Any]) -> None:
    from rollbox.sdk import AsyncClient

    async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=600) as client:
        if "ready" in phases:
            n = 2 if quick else 5
            r = await ready_times(client, "vm", n)
            res.update(summarize(r["samples"], "cold_ready", "s"))
            res["cold_ready_errors"] = r["errors"]
            say(f"vm create -> ready p50 {res['cold_ready_p50_s']:.2f} s p99 "
                f"{res['cold_ready_p99_s']:.2f} s (errors {r['errors']})")
            await ready_times(client, "microvm", 1)  # the microVM template of the key
            r = await ready_times(client, "microvm", n)
            res.update(summarize(r["samples"], "microvm_ready", "s"))
            res["microvm_ready_errors"] = r["errors"]
            say(f"microvm create -> ready p50 {res['microvm_ready_p50_s']:.2f} s")
        if phases & {"exec", "screenshot", "input", "input_to_screen", "pause", "pause_fs"}:
            await one_vm_phases(client, quick, phases, res)
        if "idle" in phases:
            await idle_phase(client, 2 if quick else 4, res)
        if "restore" in phases:
            await restore_phase(client, 3 if quick else 10, res)
        if "desktop" in phases:
            await desktop_phase(client, quick, res, plain="plain_desktop" in phases)


async def desktop_drawn(shot: Callable[[], Awaitable[bytes]], t0: float,
                        timeout: float = DESKTOP_WAIT_S) -> float:
    """Seconds from ``t0`` until a screenshot shows the drawn desktop (``rollbox.desktop``'s
    check: its size, mostly its colour, the panel; decoded client-side); TimeoutError."""
    from rollbox.desktop.episode import Screen, decode_png

    while time.monotonic() - t0 < timeout:
        try:
            if Screen(decode_png(await shot()), 0.0).is_desktop():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - no screen yet (QMP not up, firmware): look again
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"no desktop drawn in {timeout:.0f} s")


async def desktop_phase(client: Any, quick: bool, res: dict[str, Any],
                        plain: bool, act: bool = False) -> None:
    """Sequential creates of the desktop: create -> the agent answers, create -> the desktop
    drawn; the first apart (it builds a template where the backend makes them); screenshot
    round trips of the drawn 1024x768 desktop. With ``plain``, a plain QEMU boot of the same
    machine after each create (interleaved: the host's load moves during a run). With
    ``act``, on every create after the first the demo's scripted agent (``rollbox.desktop``)
    then moves onto the Editor launcher, clicks it one look (``POLL_S``) later, and once the
    editor's window is drawn types a line and saves it: create -> the window drawn
    (``desktop_input``: the click accepted), the note read back must be the line."""
    from rollbox.desktop.episode import (
        CPUS, DESKTOP_IMAGE, MEMORY_MIB, TEXT, ScriptedAgent, read_note, run_agent,
    )

    agent, drawn, peer, accepted = [], [], [], []
    input_errors = 0
    for i in range(DESKTOP_CREATES_QUICK if quick else DESKTOP_CREATES):
        if plain and i:
            peer.append(await plain_desktop_boot())
        t0 = time.monotonic()
        sb = await client.create(DESKTOP_IMAGE, backend="vm", memory_mib=MEMORY_MIB, cpus=CPUS,
                                 ttl_s=1800)
        try:
            await sb.exec(["true"])
            agent.append(time.monotonic() - t0)
            drawn.append(await desktop_drawn(sb.screenshot, t0))
            say(f"desktop create {i}: agent {agent[-1]:.1f} s, drawn {drawn[-1]:.1f} s")
            if act and i:
                since = time.monotonic() - t0
                at = await run_agent(sb, ScriptedAgent(text=TEXT))
                if await read_note(sb) == TEXT and "editor" in at:
                    accepted.append(since + at["editor"])
                    say(f"desktop create {i}: the click's editor drawn {accepted[-1]:.1f} s "
                        f"after create ({at['editor'] - at['desktop']:.1f} s after the "
                        f"agent's first look), the typed line saved")
                else:
                    input_errors += 1
            if i == 0:
                lat = await round_trips(sb.screenshot, 10 if quick else 50, warmup=2)
                shot = await sb.screenshot()
                res.update(summarize(lat, "desktop_screenshot"))
                res["desktop_screenshot_bytes"] = len(shot)
        finally:
            await sb.delete()
    res["desktop_first_agent_s"], res["desktop_first_ready_s"] = agent[0], drawn[0]
    res.update(summarize(agent[1:], "desktop_agent", "s"))
    res.update(summarize(drawn[1:], "desktop_ready", "s"))
    res["desktop_ready"] = f"creates 2..{len(drawn)} (the first apart)"
    if act:
        res.update(summarize(accepted, "desktop_input", "s") if accepted else {})
        res["desktop_input_errors"] = input_errors
    if peer:
        res.update(summarize(peer, "plain_qemu_desktop_ready", "s"))


async def desktop_restore_phase(srv: Any, quick: bool, res: dict[str, Any]) -> None:
    """``desktop``'s creates on a server whose disk-image creates restore a machine template:
    the first builds it (boot, the screen settled, saved), the others restore it."""
    from rollbox.sdk import AsyncClient

    sub: dict[str, Any] = {}
    async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=1800) as client:
        await desktop_phase(client, quick, sub, plain=False, act=True)
    res["desktop_template_first_ready_s"] = sub["desktop_first_ready_s"]
    for k in ("p50", "p99"):
        res[f"desktop_restore_ready_{k}_s"] = sub[f"desktop_ready_{k}_s"]
        res[f"desktop_restore_agent_{k}_s"] = sub[f"desktop_agent_{k}_s"]
    res["desktop_restore_screenshot_p50_ms"] = sub["desktop_screenshot_p50_ms"]
    for k in ("p50", "p99"):
        res[f"desktop_restore_input_{k}_s"] = sub.get(f"desktop_input_{k}_s")
    res["desktop_restore_input_errors"] = sub["desktop_input_errors"]


async def desktop_idle_phase(srv: Any, quick: bool, res: dict[str, Any]) -> None:
    """Idle desktop VMs held at once on a server with machine templates (phase 11)."""
    from rollbox import errors
    from rollbox.desktop.episode import CPUS, DESKTOP_IMAGE, MEMORY_MIB, Screen, decode_png
    from rollbox.sdk import AsyncClient

    want = DESKTOP_IDLE_N_QUICK if quick else DESKTOP_IDLE_N
    spec = {"backend": "vm", "memory_mib": MEMORY_MIB, "cpus": CPUS, "ttl_s": 3600}
    async with AsyncClient(base_url=srv.url, api_key=srv.key, timeout=1800) as client:
        first = await client.create(DESKTOP_IMAGE, **spec)  # builds the template: untimed
        try:
            await desktop_drawn(first.screenshot, time.monotonic())
        finally:
            await first.delete()
        await asyncio.sleep(2)
        before = mem_available()
        boxes: list[Any] = []
        refused = None
        try:
            for _ in range(want):
                try:
                    sb = await client.create(DESKTOP_IMAGE, **spec)
                except errors.CapacityExceeded as exc:
                    refused = str(exc)
                    break
                boxes.append(sb)
                await desktop_drawn(sb.screenshot, time.monotonic())
            n = len(boxes)
            say(f"desktop idle: {n} desktops drawn; idling {IDLE_SETTLE_S:.0f} s")
            await asyncio.sleep(IDLE_SETTLE_S)
            drop = before - mem_available()
            parent = srv.settings.cgroup_parent
            # The VMs' own cgroups beside the drop: other work on the host moves MemAvailable.
            charged = sum((cgroups.memory_bytes(parent, sb.id) or 0) for sb in boxes)

            def vms_cpu_s() -> float:
                return sum((cgroups.cpu_usage_us(parent, sb.id) or 0) for sb in boxes) / 1e6

            with CpuMeter({"busy": machine_busy_s, "vms": vms_cpu_s}) as cpu:
                await asyncio.sleep(DESKTOP_IDLE_CPU_S)
            held = await held_count(
                boxes, lambda shot: Screen(decode_png(shot), 0.0).is_desktop())
        finally:
            for sb in boxes:
                with contextlib.suppress(Exception):
                    await sb.delete()
    res["desktop_idle_n"], res["desktop_idle_held"] = n, held
    res["desktop_idle_refused"] = refused
    res["desktop_idle_mib_per_vm"] = drop / n / (1 << 20) if n else None
    res["desktop_idle_cgroup_mib_per_vm"] = charged / n / (1 << 20) if n else None
    busy = cpu.spent["busy"] / cpu.spent["wall_s"]
    vms = cpu.spent["vms"] / cpu.spent["wall_s"]
    res["desktop_idle_cpu_pct_per_vm"] = 100.0 * vms / n if n else None
    res["desktop_idle_host_busy_cores"] = busy
    say(f"desktop idle: {held} of {n} held, {res['desktop_idle_mib_per_vm'] or 0:.0f} MiB "
        f"per VM ({res['desktop_idle_cgroup_mib_per_vm'] or 0:.0f} MiB charged), "
        f"{res['desktop_idle_cpu_pct_per_vm'] or 0:.1f}% of a core per VM (host busy "
        f"{busy:.2f} cores){'; refused: ' + refused if refused else ''}")


# ---- the peer: plain QEMU --------------------------------------------------------------------

class PlainVm(PlainQemu):
    """One boot of the backend's q35 machine by plain QEMU (``plain_argv``); the rest
    (writable disk + mkfs, the wait for the agent, ``true``) is the microVM peer's."""

    def __init__(self, workdir: Path, layers: list[Path]) -> None:
        super().__init__(workdir, layers, VM_MEMORY_MIB, VM_DISK_MIB)
        s = Settings()
        self.kernel, self.initrd = s.vm_full_kernel, s.vm_full_initrd
        self.binary = str(s.qemu_binary)

    def argv(self) -> list[str]:
        spec = qemu.MachineSpec(cpus=1, memory_mib=self.memory_mib, layers=len(self.layers),
                                tsc_khz=qemu.host_tsc_khz())
        return plain_argv(spec, binary=self.binary, kernel=self.kernel, initrd=self.initrd,
                          layers=self.layers, rw=self.rw, agent=self.sock,
                          qmp_sock=self.dir / "qmp.sock")


async def plain_phase(quick: bool, res: dict[str, Any]) -> None:
    layers = image_layers(IMAGE)
    lat: list[float] = []
    errors = 0
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-plainvm-") as d:
        for _ in range(2 if quick else 5):
            vm = PlainVm(Path(d), layers)
            try:
                lat.append(await vm.boot_and_exec())
            except Exception as exc:  # noqa: BLE001 - counted and said
                errors += 1
                say(f"  plain QEMU boot failed: {type(exc).__name__}: {exc}")
            finally:
                await vm.close()
    res.update(summarize(lat, "plain_qemu_ready", "s"))
    res["plain_qemu_errors"] = errors
    say(f"plain QEMU (same machine) boot -> ready p50 {res['plain_qemu_ready_p50_s']:.2f} s")


async def plain_desktop_boot() -> float:
    """The backend's desktop machine by plain QEMU (``plain_argv`` of the disk spec: the same
    kernel, initramfs and agent, the base read-only under a new empty qcow2 overlay made by
    qemu-img as the backend makes it): seconds from the overlay's creation to the drawn
    desktop (QMP screendumps)."""
    from rollbox.backends.microvm.qmp import QMP
    from rollbox.desktop.episode import CPUS, DESKTOP_IMAGE, MEMORY_MIB
    from rollbox.images.vmdisk import resolve_vm_disk, vm_disks_root

    s = Settings()
    disk = resolve_vm_disk(vm_disks_root(), DESKTOP_IMAGE)
    spec = qemu.MachineSpec(cpus=CPUS, memory_mib=MEMORY_MIB, layers=0, rw_disk=False,
                            tsc_khz=qemu.host_tsc_khz(), root_disk=disk.name,
                            init=disk.init)
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-plaindesk-") as d:
        work = Path(d)
        overlay, qs = work / "root.qcow2", work / "qmp.sock"
        argv = plain_argv(spec, binary=str(s.qemu_binary), kernel=s.vm_full_kernel,
                          initrd=s.vm_full_initrd, layers=[], rw=None,
                          agent=work / "agent.sock", qmp_sock=qs, base=disk.disk,
                          overlay=overlay)
        t0 = time.monotonic()
        mk = await asyncio.create_subprocess_exec(
            "qemu-img", "create", "-q", "-f", "qcow2", str(overlay), str(disk.bytes))
        if await mk.wait() != 0:
            raise RuntimeError("qemu-img create failed")
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            while not qs.exists():
                if proc.returncode is not None:
                    raise RuntimeError(f"qemu exited {proc.returncode}")
                await asyncio.sleep(0.05)
            q = await QMP.connect(qs)
            try:
                took = await desktop_drawn(
                    lambda: display.screendump(q, s.vm_screenshot_max_bytes), t0)
            finally:
                q.close()
            say(f"plain QEMU desktop: drawn {took:.1f} s")
            return took
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


# ---- the run ---------------------------------------------------------------------------------

def main(quick: bool = False, json_out: bool = False,
         only: frozenset[str] | None = None, desktop: bool = False) -> dict[str, Any]:
    phases = (PHASES | (DESKTOP_PHASES if desktop else frozenset())) if only is None else only
    if not phases or not phases <= PHASES | DESKTOP_PHASES:
        raise SystemExit(f"bench vm: phases are {', '.join(sorted(PHASES | DESKTOP_PHASES))}")
    node = Settings()
    if not node.vm_full_initrd.is_file():
        raise SystemExit(f"bench vm: no full-VM guest at {node.vm_full_initrd} (make vmguest)")
    res: dict[str, Any] = {"image": IMAGE, "quick": quick, "load_start": os.getloadavg()[0],
                           "cores": os.cpu_count(), "phases": sorted(phases),
                           "qemu": qemu.version(str(node.qemu_binary)), "vm": VM,
                           "restore_ready_p50_s": None,
                           "restore_ready": "not measured: phase restore not run",
                           "desktop_ready_p50_s": None,
                           "desktop_ready": "not measured: run with --desktop"}
    t0 = time.monotonic()
    if phases & (SERVER_PHASES | {"desktop"}):
        with server(COLD) as srv:
            asyncio.run(server_phases(srv, quick, phases, res))
    if "desktop_restore" in phases:
        with server(DESKTOP_TEMPLATES) as srv:
            asyncio.run(desktop_restore_phase(srv, quick, res))
    if "desktop_idle" in phases:
        with server(DESKTOP_TEMPLATES) as srv:
            asyncio.run(desktop_idle_phase(srv, quick, res))
    if "plain" in phases:
        asyncio.run(plain_phase(quick, res))
    if "plain_desktop" in phases and "desktop" not in phases:
        res.update(summarize([asyncio.run(plain_desktop_boot()) for _ in range(2)],
                             "plain_qemu_desktop_ready", "s"))
    res["ratio_vs_plain_qemu_desktop"] = ratio(res.get("desktop_ready_p50_s"),
                                               res.get("plain_qemu_desktop_ready_p50_s"))
    res["ratio_desktop_restore_vs_plain_qemu"] = ratio(
        res.get("desktop_restore_ready_p50_s"), res.get("plain_qemu_desktop_ready_p50_s"))
    res["ratio_vs_plain_qemu_ready"] = ratio(res.get("cold_ready_p50_s"),
                                             res.get("plain_qemu_ready_p50_s"))
    res["ratio_vs_microvm_ready"] = ratio(res.get("cold_ready_p50_s"),
                                          res.get("microvm_ready_p50_s"))
    res["ratio_restore_vs_cold_ready"] = ratio(res.get("restore_ready_p50_s"),
                                               res.get("cold_ready_p50_s"))
    res["wall_s"] = time.monotonic() - t0
    res["load_end"] = os.getloadavg()[0]
    return emit(res, json_out)


if __name__ == "__main__":
    only = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--only"), "")
    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv, only=parse_only(only),
         desktop="--desktop" in sys.argv)
