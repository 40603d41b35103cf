"""``rollbox demo --task browser``: MiniWoB++ episodes in ``browser:1`` sandboxes, graded by
replay in a fresh sandbox.

One episode, all through the SDK:
1. the environment: a sandbox of ``browser:1`` (``backend`` container or microvm) runs
   ``driver.py start`` in the background: a local HTTP server inside the sandbox serves the
   MiniWoB++ task, chromedriver starts headless chromium, loads it, seeds it and presses START;
2. the scripted agent reads the page through DOM queries (``observe``: query text + element
   rects), picks the target and acts by INPUT ACTIONS ONLY (``click X Y``: a WebDriver pointer
   action that chromedriver turns into CDP ``Input.dispatchMouseEvent``); each action is logged
   to ``/work/episode/actions.jsonl``; it takes a screenshot, which the host downloads as a PNG
   through the files API;
3. the grader: ``sandbox.grade`` makes a FRESH sandbox of the pristine image layers, copies in
   only the action log, replays it as input events on a fresh chromium and the same seeded
   task, and reads the reward of the first episode end from its own page.

Why the reward can't be set by the agent: the agent's channel reaches only its own sandbox, and
there it can run any script: set MiniWoB++'s reward globals, rewrite the task page or the
driver. Nothing of that sandbox is read for the reward except the action log, and the grader
parses it as hostile (known input-action kinds, bounded counts, coordinates inside the viewport;
anything else refuses the whole log). The grader's sandbox, chromium, task page and driver
come from the image layers, which the agent never wrote; on a microVM its result is still
guest-reported, but by a guest that only ever saw the action list. The cheating agent here sets
its own page's score by script (``core.endEpisode(1)`` over WebDriver's execute) and forges a
script entry into its log: its page says 1.0, the grade says 0.
"""
from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import percentile
from rollbox.browser.image import BROWSER_IMAGE, DRIVER_PATH
from rollbox.errors import InfraError

DRIVER = f"python3 {DRIVER_PATH}"
ACTIONS = "/work/episode/actions.jsonl"
TASKS = ("click-button", "click-test")
# chromium + chromedriver + the task server; a microVM's guest memory is this too.
MEMORY_MIB = 2048
# vCPUs of a browser microVM (and its grader): QEMU's multi-threaded TCG runs each vCPU on
# its own host thread, so chromium's threads (main, IO, compositor, V8's) run in parallel.
# A container gets one CPU: there chromium is native and fast.
VM_CPUS = 2
# Under TCG a cold chromium takes minutes; generous, and the same for every step.
STEP_TIMEOUT_S = 1200
# How long the agent's browser may take to close its session once told to stop.
STOP_TIMEOUT_S = 120
# TCG translation cache for a microVM running chromium (see run_browser_demo).
BROWSER_TB_MIB = 512
# The grader's answer is one JSON line; anything longer is not a grader's answer.
MAX_GRADE_LINE = 4096

# The cheats (each defeats one thing the grader could have trusted):
# "script-score": script in its own page (chromedriver's execute endpoint, reachable from
# inside the sandbox like by any process there) declares the episode won: the page's reward
# globals say 1.0 (defeated by grading a replay on a fresh page, not reading this one).
SCRIPT_SCORE = """
import json, urllib.request
s = json.load(open('/work/episode/.driver-state.json'))
body = json.dumps({"script": "core.endEpisode(1.0, false, 'set by script')", "args": []})
req = urllib.request.Request(s["url"] + "/session/" + s["session"] + "/execute/sync",
                             data=body.encode(), headers={"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=60).read()
"""
# "forged-log": a script entry appended to the action log after the (correct) click, hoping
# the grader runs it (defeated by the grader refusing any log with a non-input action).
FORGED_LOG = ("printf '%s\\n' '{\"type\": \"script\", \"js\": \"core.endEpisode(1.0)\"}'"
              f" >> {ACTIONS}")
CHEATS = frozenset({"script-score", "forged-log"})


def choose_target(obs: dict[str, Any]) -> dict[str, Any]:
    """The scripted policy: the button the query names (click-button: 'Click on the "X"
    button.'), else the only button (click-test)."""
    buttons = [e for e in obs.get("elements", []) if e.get("tag") == "button"]
    m = re.search(r'"([^"]+)"', obs.get("query", ""))
    if m:
        named = [b for b in buttons if b.get("text") == m.group(1)]
        if named:
            return named[0]
    if len(buttons) == 1:
        return buttons[0]
    raise InfraError(f"the scripted agent found no target in {obs.get('query')!r}")


def parse_grade(stdout: str) -> dict[str, Any]:
    """The grader's last line: one JSON object with a numeric reward in [0, 1]."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if not lines or len(lines[-1]) > MAX_GRADE_LINE:
        raise InfraError("the grader printed no result line")
    try:
        out = json.loads(lines[-1])
    except ValueError:
        raise InfraError("the grader's result is not JSON") from None
    reward = out.get("reward") if isinstance(out, dict) else None
    if not isinstance(reward, int | float) or isinstance(reward, bool) or not 0 <= reward <= 1:
        raise InfraError("the grader's result has no reward in [0, 1]")
    return out


async def _run(sb: Any, cmd: str, what: str, *, timeout: float = STEP_TIMEOUT_S) -> str:
    r = await sb.exec(cmd, timeout=timeout)
    if r.exit_code != 0:
        raise InfraError(f"{what} failed ({r.exit_code}, timed out: {r.timed_out}): "
                         f"{(r.stderr or r.stdout)[-600:]}")
    return r.stdout


async def episode(client: Any, i: int, *, backend: str, task: str, seed: int,
                  out_dir: Path, timings: dict[str, list[float]],
                  cheats: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One episode; ``cheats``: tricks of CHEATS the agent plays (none: the honest agent)."""
    if not cheats <= CHEATS:
        raise ValueError(f"unknown cheats {sorted(cheats - CHEATS)}")
    t0 = time.monotonic()
    mine: dict[str, float] = {}

    def took(what: str, since: float) -> None:
        mine[what] = round(time.monotonic() - since, 3)
        timings[what].append(mine[what])

    cpus = VM_CPUS if backend == "microvm" else 1
    sb = await client.create(BROWSER_IMAGE, memory_mib=MEMORY_MIB, cpus=cpus, ttl_s=3600,
                             labels={"job": "demo-browser", "episode": str(i)},
                             backend=backend)
    took("create", t0)
    try:
        t = time.monotonic()
        env_proc = await sb.exec_background(
            f"{DRIVER} start --task {shlex.quote(task)} --seed {seed}")
        try:
            await _run(sb, f"{DRIVER} wait-ready --timeout {STEP_TIMEOUT_S - 30}",
                       "browser start", timeout=STEP_TIMEOUT_S)
        except InfraError as exc:
            log = await sb.exec("tail -c 1500 /work/episode/chromedriver.log", timeout=30)
            raise InfraError(f"{exc.message}\n{log.stdout}") from None
        took("browser_start", t)
        t = time.monotonic()
        obs = json.loads(await _run(sb, f"{DRIVER} observe", "observe"))
        await _run(sb, f"{DRIVER} screenshot /work/episode/observe.png", "screenshot")
        target = choose_target(obs)
        if "script-score" in cheats:
            await _run(sb, f"python3 -c {shlex.quote(SCRIPT_SCORE)}", "the script cheat")
        else:
            x, y = target["x"] + target["w"] / 2, target["y"] + target["h"] / 2
            await _run(sb, f"{DRIVER} click {x:.0f} {y:.0f}", "click")
        if "forged-log" in cheats:
            await _run(sb, FORGED_LOG, "the forged log")
        await _run(sb, f"{DRIVER} screenshot /work/episode/final.png", "screenshot")
        page = json.loads(await _run(sb, f"{DRIVER} page-reward", "page-reward"))
        took("act", t)
        out_dir.mkdir(parents=True, exist_ok=True)
        shots = []
        for name in ("observe", "final"):
            local = out_dir / f"browser-{i}-{name}.png"
            await sb.files.download_file(f"/work/episode/{name}.png", local)
            shots.append(str(local))
        # The episode is over: stop the agent's browser (SIGTERM: the driver closes its
        # session), so a microVM grader does not share the host's CPU with an idle chromium.
        await env_proc.kill(signal.SIGTERM)
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await env_proc.wait()
        except TimeoutError:
            await env_proc.kill(signal.SIGKILL)
        t = time.monotonic()
        g = await sb.grade(f"{DRIVER} grade --task {shlex.quote(task)} --seed {seed} "
                           f"--actions {ACTIONS}", files=[ACTIONS], timeout=STEP_TIMEOUT_S,
                           resources={"memory_mib": MEMORY_MIB, "cpus": cpus})
        took("grade", t)
        if g.result.exit_code != 0:
            raise InfraError(f"grader failed ({g.result.exit_code}): {g.result.stderr[-600:]}")
        graded = parse_grade(g.result.stdout)
    finally:
        await sb.delete()
    took("episode", t0)
    return {"episode": i, "backend": backend, "task": task, "seed": seed,
            "cheat": sorted(cheats),
            "query": obs.get("query"), "page_said_reward": page.get("raw_reward"),
            "reward": float(graded["reward"]), "grade": graded, "screenshots": shots,
            "timings_s": mine}


async def run_browser_episodes(n: int, url: str, api_key: str, *, backend: str = "container",
                               task: str = "click-button", out_dir: Path,
                               concurrency: int = 1) -> dict[str, Any]:
    """``n`` episodes (even: the honest agent, odd: the cheater playing every trick of
    CHEATS), ``concurrency`` at a time
    (chromium is heavy; under TCG one at a time is the sensible default)."""
    from rollbox.sdk import AsyncClient

    timings: dict[str, list[float]] = {k: [] for k in
                                       ("create", "browser_start", "act", "grade", "episode")}
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    gate = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    async with AsyncClient(base_url=url, api_key=api_key, timeout=STEP_TIMEOUT_S) as client:

        async def one(i: int) -> None:
            async with gate:
                try:
                    results.append(await episode(
                        client, i, backend=backend, task=task, seed=1000 + i,
                        out_dir=out_dir, timings=timings,
                        cheats=CHEATS if i % 2 else frozenset()))
                except Exception as exc:  # noqa: BLE001 - reported in the summary
                    errors.append(f"episode {i}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(i) for i in range(n)))
    honest = [r for r in results if not r["cheat"]]
    cheats = [r for r in results if r["cheat"]]
    summary: dict[str, Any] = {
        "task": task, "backend": backend, "episodes": n, "completed": len(results),
        "errors": errors, "wall_s": round(time.monotonic() - t0, 3),
        "reward_honest": sum(r["reward"] for r in honest) / max(1, len(honest)),
        "reward_cheating": sum(r["reward"] for r in cheats) / max(1, len(cheats)),
        "cheaters_page_said_won": sum(r["page_said_reward"] == 1 for r in cheats),
        "screenshots": [s for r in sorted(results, key=lambda r: r["episode"])
                        for s in r["screenshots"]],
        "results": sorted(results, key=lambda r: r["episode"]),
    }
    for k, xs in timings.items():
        summary[f"{k}_p50_s"] = round(percentile(xs, 50), 3)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"rollbox demo --task browser ({summary['backend']})")
    for col in ("episode", "agent", "query", "its page said", "graded reward", "grader's note"):
        table.add_column(col)
    for r in summary["results"]:
        g = r["grade"]
        table.add_row(str(r["episode"]), "cheater: " + "+".join(r["cheat"]) if r["cheat"]
                      else "honest", str(r["query"]), str(r["page_said_reward"]),
                      f"{r['reward']:.1f}", str(g.get("refused") or g.get("reason") or ""))
    console.print(table)
    for k, v in summary.items():
        if k not in ("results", "errors", "screenshots"):
            console.print(f"{k}: {v}")
    console.print("screenshots: " + " ".join(summary["screenshots"]))
    for e in summary["errors"][:10]:
        console.print(f"[red]{e}")


def run_browser_demo(n: int = 2, url: str | None = None, *, backend: str = "container",
                     task: str = "click-button", out_dir: Path | None = None) -> dict[str, Any]:
    """Build ``browser:1`` if needed, then ``n`` episodes against ``url`` or an embedded
    server; screenshots go to ``out_dir`` (default ./rollbox-demo-browser)."""
    from rollbox.browser.image import ensure_browser_image
    from rollbox.config import VARS, Settings, source
    from rollbox.embedded import server_process
    from rollbox.images.store import ImageStore

    settings = Settings()
    ensure_browser_image(ImageStore(settings.images_dir))
    out = out_dir or Path("rollbox-demo-browser")
    child_env = None
    if url is None and backend == "microvm" and source(settings, "vm_tb_size_mib") == "default":
        # The embedded node's TCG translation cache: chromium's code does not fit QEMU's
        # 64 MiB default (every flush retranslates all of it; its start-up ran into
        # chromedriver's 60 s wait). An explicit ROLLBOX_VM_TB_MIB wins.
        child_env = {VARS["vm_tb_size_mib"].env: str(BROWSER_TB_MIB)}
    with server_process(url, env=child_env) as (base_url, key):
        summary = asyncio.run(run_browser_episodes(n, base_url, key, backend=backend,
                                                   task=task, out_dir=out))
    print_summary(summary)
    return summary
