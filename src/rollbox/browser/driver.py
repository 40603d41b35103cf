#!/usr/bin/env python3
"""In-sandbox browser driver for MiniWoB++ tasks (runs INSIDE a ``browser:1`` sandbox).

Shipped in the image's tools layer at /opt/rollbox-browser/driver.py; Python 3.11 standard
library only (no selenium: chromedriver speaks W3C WebDriver over plain HTTP). It owns the
browser side of an episode and nothing on the host.

Subcommands
  start --task T --seed S     the environment (platform code, before the agent acts): serve the
                              MiniWoB++ HTML on 127.0.0.1, start chromedriver + headless
                              chromium, load the task, seed it, press START; then hold them
                              until killed. Run it in the background; ``wait-ready`` waits.
  observe                     the agent's view: query text + visible elements (tag, text, rect)
                              read through WebDriver element queries (DOM reads only).
  click X Y | type TEXT | key NAME
                              INPUT ACTIONS ONLY (WebDriver actions: chromedriver dispatches
                              them as trusted CDP Input events); each is appended to the action
                              log, the episode's only graded artifact.
  screenshot PATH             a PNG of the viewport.
  page-reward                 what the agent's OWN page claims (WOB_* globals): untrusted, the
                              agent could have set them by script; for display only.
  grade --task T --seed S --actions PATH
                              the grader, in a FRESH sandbox: the same set-up, then the action
                              log replayed as input events (parsed as hostile: known action
                              kinds only, bounded), the reward of the FIRST episode end read
                              from the grader's own page. Prints one JSON line.

Why replay: the agent's sandbox runs whatever the agent wants, so anything its page says (the
reward globals, the DOM, this very file) may have been set by script. The grader's chromium, page
and driver come from the pristine image layers of a sandbox the agent never reached; the only
thing carried over is the list of input actions, which can do no more than a user's mouse and
keyboard could.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import http.server
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MINIWOB_HTML = "/usr/local/lib/python3.11/dist-packages/miniwob/html"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/lib/chromium/chromium"
TASK_PORT = 8000
DRIVER_PORT = 9515
EPISODE_DIR = Path("/work/episode")
STATE = EPISODE_DIR / ".driver-state.json"
ACTIONS = EPISODE_DIR / "actions.jsonl"
# The window; headless chromium's viewport (what a screenshot shows) is a little smaller. A
# logged click must fall inside the window; one outside the viewport stops the replay.
VIEWPORT = (500, 400)
# The task's own time limit (MiniWoB++'s default is 10 s); chromium under TCG needs longer
# for the agent's observe round trips (a microVM agent's click came 56 s after START at host
# load ~17, half of the former 120 s). Set identically by ``start`` and ``grade``; the raw
# reward the grader reads does not decay with time.
EPISODE_MAX_MS = 600_000
# One WebDriver call: a cold chromium's first page load on a one-vCPU TCG guest of a busy
# host took over 2 minutes.
CALL_TIMEOUT_S = 900
SESSION_ATTEMPTS = 3
# Waits poll this often: on a one-vCPU microVM under TCG a tight poll takes the CPU that
# chromium needs.
POLL_S = 0.5
# Chromium's command line, the same for the agent's browser and the grader's. Under TCG
# (microVMs here) every process chromium starts costs seconds to tens of seconds (a fresh
# exec of a ~250 MiB binary: its relocations, ICU and V8 snapshot, all emulated; measured:
# each renderer ~20 s, three per page with site isolation), so: one process (browser,
# renderer, GPU, network and storage services in one: --single-process, no zygote), no site
# isolation or spare renderer, none of the background services that start their own
# (on-device model, optimization guide, translate, media router, component updates), and V8
# without JIT (freshly JIT-compiled code is new translation work under TCG). The sandbox
# is the isolation, not chromium's own (root in a VM or a user namespace: --no-sandbox).
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--single-process", "--no-zygote",
    "--js-flags=--jitless", "--disable-gpu", "--disable-software-rasterizer",
    "--disable-dev-shm-usage", "--disable-site-isolation-trials",
    "--disable-features=site-per-process,IsolateOrigins,SpareRendererForSitePerProcess,"
    "OptimizationGuideModelDownloading,OptimizationHintsFetching,"
    "OptimizationGuideOnDeviceModel,OnDeviceModelService,Translate,MediaRouter,"
    "AutofillServerCommunication,CertificateTransparencyComponentUpdater,BackForwardCache",
    "--renderer-process-limit=1",
    f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}", "--force-device-scale-factor=1",
    "--no-first-run", "--no-default-browser-check", "--disable-extensions",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--user-data-dir=/tmp/rollbox-browser-profile",
    # CDP over a pipe, not a TCP port: nothing to resolve (sandboxes have no /etc/hosts) and
    # nothing another process could connect to.
    "--remote-debugging-pipe"]
ELEMENT_KEY = "element-6066-11e4-a52e-4f735466cecf"  # W3C WebDriver's element reference key

# Bounds of a replayed action log: it comes from the agent's sandbox.
MAX_LOG_BYTES = 64 * 1024
MAX_ACTIONS = 100
MAX_TEXT = 256
# Named keys (WebDriver's code points); any other key is refused.
KEYS = {"Enter": "\ue007", "Tab": "\ue004", "Backspace": "\ue003", "Escape": "\ue00c",
        "Space": " ", "ArrowLeft": "\ue012", "ArrowUp": "\ue013", "ArrowRight": "\ue014",
        "ArrowDown": "\ue015", "Delete": "\ue017"}


class DriverError(Exception):
    pass


# ---- WebDriver over HTTP ---------------------------------------------------------------------

class WebDriver:
    def __init__(self, url: str, session: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.session = session

    def call(self, method: str, path: str, body: Any = None,
             timeout: float = CALL_TIMEOUT_S) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                payload = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            payload = json.loads(exc.read() or b"{}")
            err = payload.get("value", {})
            raise DriverError(f"{method} {path}: {err.get('error')}: "
                              f"{str(err.get('message', ''))[:300]}") from None
        return payload.get("value")

    def s(self, method: str, path: str, body: Any = None) -> Any:
        return self.call(method, f"/session/{self.session}{path}", body)

    def new_session(self) -> None:
        caps = {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "pageLoadStrategy": "normal",
            # chromedriver's own waits on the renderer (session start, page loads): its 60 s
            # start-up wait ran out on a TCG guest.
            "timeouts": {"pageLoad": CALL_TIMEOUT_S * 1000, "script": CALL_TIMEOUT_S * 1000,
                         "implicit": 0},
            "goog:chromeOptions": {"binary": CHROMIUM, "args": CHROMIUM_ARGS}}}}
        self.session = self.call("POST", "/session", caps)["sessionId"]

    # element reads (DOM only: what a screen reader would see)
    def find_all(self, css: str) -> list[str]:
        return [e[ELEMENT_KEY] for e in self.s("POST", "/elements",
                                                {"using": "css selector", "value": css})]

    def rect(self, el: str) -> dict[str, float]:
        return self.s("GET", f"/element/{el}/rect")

    # input actions
    def click(self, x: float, y: float) -> None:
        self.s("POST", "/actions", {"actions": [{
            "type": "pointer", "id": "mouse", "parameters": {"pointerType": "mouse"},
            "actions": [{"type": "pointerMove", "duration": 0, "origin": "viewport",
                         "x": int(x), "y": int(y)},
                        {"type": "pointerDown", "button": 0},
                        {"type": "pointerUp", "button": 0}]}]})

    def keys(self, chars: str) -> None:
        steps: list[dict[str, str]] = []
        for ch in chars:
            steps += [{"type": "keyDown", "value": ch}, {"type": "keyUp", "value": ch}]
        self.s("POST", "/actions", {"actions": [{"type": "key", "id": "keyboard",
                                                 "actions": steps}]})

    def script(self, js: str) -> Any:
        """Platform use only: the environment's set-up and the grader's own reads."""
        return self.s("POST", "/execute/sync", {"script": js, "args": []})


# ---- the environment: task server, chromedriver, set-up ---------------------------------------

def loopback_up() -> None:
    """Bring ``lo`` up if it is down (a microVM guest starts with it down; the task server and
    chromedriver listen on 127.0.0.1). SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass


def serve_tasks() -> http.server.ThreadingHTTPServer:
    handler = functools.partial(_QuietHandler, directory=MINIWOB_HTML)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", TASK_PORT), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start_chromedriver(log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")  # noqa: SIM115 - held by the child for its life
    proc = subprocess.Popen([CHROMEDRIVER, f"--port={DRIVER_PORT}"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    wd = WebDriver(f"http://127.0.0.1:{DRIVER_PORT}")
    deadline = time.monotonic() + 120
    while True:
        try:
            if wd.call("GET", "/status", timeout=5).get("ready"):
                return proc
        except (OSError, DriverError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise DriverError(f"chromedriver did not start (exit {proc.poll()})")
        time.sleep(POLL_S)


def validate_task(task: str, html_root: str = MINIWOB_HTML) -> str:
    """``task`` if it names a MiniWoB++ task page (a plain name: no path, no suffix)."""
    if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", task) or not (
            Path(html_root) / "miniwob" / f"{task}.html").is_file():
        raise DriverError(f"unknown MiniWoB++ task {task[:80]!r}")
    return task


def set_up_episode(wd: WebDriver, task: str, seed: int) -> None:
    """Load the task, seed its generator, press START (the cover MiniWoB++ shows before each
    episode) with a real click: the same in the agent's sandbox and in the grader's."""
    wd.s("POST", "/url", {"url": f"http://127.0.0.1:{TASK_PORT}/miniwob/{task}.html"})
    wd.script(f"Math.seedrandom({json.dumps(str(seed))}); "
              f"core.EPISODE_MAX_TIME = {EPISODE_MAX_MS};")
    cover = wd.find_all("#sync-task-cover")
    if not cover:
        raise DriverError("task page has no START cover")
    r = wd.rect(cover[0])
    wd.click(r["x"] + r["width"] / 2, r["y"] + r["height"] / 2)
    if wd.script("return WOB_EPISODE_ID === 0 && core.EP_TIMER !== null") is not True:
        raise DriverError("episode did not start")


@contextlib.contextmanager
def browser(log_path: Path):  # noqa: ANN201
    loopback_up()
    server = serve_tasks()
    proc = start_chromedriver(log_path)
    wd = WebDriver(f"http://127.0.0.1:{DRIVER_PORT}")
    try:
        for attempt in range(SESSION_ATTEMPTS):
            try:
                wd.new_session()
                break
            except DriverError as exc:
                # chromedriver gives a starting chromium a fixed 60 s, which a cold start on
                # a TCG guest can exceed; the next try finds the binary's pages cached.
                if "session not created" not in str(exc) or attempt == SESSION_ATTEMPTS - 1:
                    raise
        yield wd
    finally:
        if wd.session:
            with contextlib.suppress(OSError, DriverError):
                wd.call("DELETE", f"/session/{wd.session}", timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        server.shutdown()


def cmd_start(args: argparse.Namespace) -> int:
    task = validate_task(args.task)
    EPISODE_DIR.mkdir(parents=True, exist_ok=True)
    ACTIONS.write_text("")
    STATE.unlink(missing_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with browser(EPISODE_DIR / "chromedriver.log") as wd:
            set_up_episode(wd, task, args.seed)
            tmp = STATE.with_suffix(".tmp")
            tmp.write_text(json.dumps({"url": wd.url, "session": wd.session, "task": task,
                                       "seed": args.seed}))
            tmp.rename(STATE)
            print("ready", flush=True)
            stop.wait(args.hold_s)
    except Exception as exc:  # noqa: BLE001 - reported to wait-ready
        STATE.with_suffix(".error").write_text(f"{type(exc).__name__}: {exc}")
        raise
    return 0


def cmd_wait_ready(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if STATE.exists():
            return 0
        err = STATE.with_suffix(".error")
        if err.exists():
            print(err.read_text(), file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    print("browser not ready in time", file=sys.stderr)
    return 1


def attached() -> WebDriver:
    state = json.loads(STATE.read_text())
    return WebDriver(state["url"], state["session"])


# ---- the agent's side ----------------------------------------------------------------------

def cmd_observe(_args: argparse.Namespace) -> int:
    wd = attached()
    query = wd.find_all("#query")
    out: dict[str, Any] = {
        "query": wd.s("GET", f"/element/{query[0]}/text") if query else "", "elements": []}
    for el in wd.find_all("#area *"):
        if not wd.s("GET", f"/element/{el}/displayed"):
            continue
        r = wd.rect(el)
        out["elements"].append({"tag": wd.s("GET", f"/element/{el}/name"),
                                "text": wd.s("GET", f"/element/{el}/text"),
                                "x": r["x"], "y": r["y"], "w": r["width"], "h": r["height"]})
    print(json.dumps(out))
    return 0


def log_action(action: dict[str, Any]) -> None:
    with open(ACTIONS, "a") as f:
        f.write(json.dumps(action) + "\n")


def cmd_click(args: argparse.Namespace) -> int:
    action = {"type": "click", "x": args.x, "y": args.y}
    perform(attached(), check_action(action))
    log_action(action)
    return 0


def cmd_type(args: argparse.Namespace) -> int:
    action = {"type": "type", "text": args.text}
    perform(attached(), check_action(action))
    log_action(action)
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    action = {"type": "key", "key": args.name}
    perform(attached(), check_action(action))
    log_action(action)
    return 0


def cmd_screenshot(args: argparse.Namespace) -> int:
    png = base64.b64decode(attached().s("GET", "/screenshot"))
    Path(args.path).write_bytes(png)
    print(len(png))
    return 0


def page_state(wd: WebDriver) -> dict[str, Any]:
    return wd.script('return {"done": WOB_DONE_GLOBAL, "raw_reward": WOB_RAW_REWARD_GLOBAL, '
                     '"reward": WOB_REWARD_GLOBAL, "reason": WOB_REWARD_REASON, '
                     '"episodes_ended": WOB_EPISODE_ID};')


def cmd_page_reward(_args: argparse.Namespace) -> int:
    print(json.dumps(page_state(attached())))
    return 0


# ---- actions: validation (hostile log) and dispatch ---------------------------------------------

def check_action(a: Any) -> dict[str, Any]:
    """The action as replayed, or DriverError: only clicks inside the viewport, printable text
    of bounded length and named keys; nothing else (no script, no navigation)."""
    if not isinstance(a, dict) or not isinstance(a.get("type"), str):
        raise DriverError("action is not an object with a type")
    kind = a["type"]
    if kind == "click":
        x, y = a.get("x"), a.get("y")
        if set(a) != {"type", "x", "y"} or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in (x, y)):
            raise DriverError("click needs numeric x and y only")
        if not (0 <= x < VIEWPORT[0] and 0 <= y < VIEWPORT[1]):
            raise DriverError("click outside the viewport")
        return {"type": "click", "x": int(x), "y": int(y)}
    if kind == "type":
        text = a.get("text")
        if set(a) != {"type", "text"} or not isinstance(text, str) or len(text) > MAX_TEXT \
                or not text.isprintable():
            raise DriverError("type needs printable text of at most 256 characters")
        return {"type": "type", "text": text}
    if kind == "key":
        if set(a) != {"type", "key"} or a.get("key") not in KEYS:
            raise DriverError(f"key must be one of {sorted(KEYS)}")
        return {"type": "key", "key": a["key"]}
    raise DriverError(f"action type {kind[:40]!r} is not an input action")


def perform(wd: WebDriver, a: dict[str, Any]) -> None:
    if a["type"] == "click":
        wd.click(a["x"], a["y"])
    elif a["type"] == "type":
        wd.keys(a["text"])
    else:
        wd.keys(KEYS[a["key"]])


def parse_log(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        data = f.read(MAX_LOG_BYTES + 1)
    if len(data) > MAX_LOG_BYTES:
        raise DriverError(f"action log over {MAX_LOG_BYTES} bytes")
    try:
        lines = [ln for ln in data.decode("utf-8").splitlines() if ln.strip()]
        if len(lines) > MAX_ACTIONS:
            raise DriverError(f"action log over {MAX_ACTIONS} actions")
        return [check_action(json.loads(ln)) for ln in lines]
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, nesting too deep
        raise DriverError(f"action log is not JSON lines: {type(exc).__name__}") from None


def cmd_grade(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    result: dict[str, Any] = {"reward": 0.0, "task": args.task, "seed": args.seed}
    try:
        actions = parse_log(Path(args.actions))
    except (OSError, DriverError) as exc:
        result["refused"] = f"action log refused: {exc}"[:300]
        print(json.dumps(result))
        return 0
    task = validate_task(args.task)
    with browser(Path("/tmp/grader-chromedriver.log")) as wd:
        set_up_episode(wd, task, args.seed)
        replayed = 0
        state = page_state(wd)
        for action in actions:
            try:
                perform(wd, action)
            except DriverError as exc:  # e.g. a click outside the page: the log's fault
                result["stopped"] = f"replay stopped at action {replayed}: {exc}"[:300]
                break
            replayed += 1
            state = page_state(wd)
            if state["episodes_ended"]:
                break  # the first episode's end is the outcome; later ones are retries
        deadline = time.monotonic() + 3
        while not state["episodes_ended"] and time.monotonic() < deadline:
            time.sleep(POLL_S)
            state = page_state(wd)
    ended = bool(state["episodes_ended"])
    raw = state["raw_reward"] if ended else 0
    result.update({"reward": 1.0 if ended and isinstance(raw, int | float) and raw > 0 else 0.0,
                   "raw_reward": raw, "ended": ended, "reason": state["reason"] if ended else
                   "episode did not end", "actions_replayed": replayed,
                   "actions": len(actions), "grade_s": round(time.monotonic() - t0, 3)})
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="driver.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--task", default="click-button")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--hold-s", type=float, default=3600)
    s.set_defaults(fn=cmd_start)
    s = sub.add_parser("wait-ready")
    s.add_argument("--timeout", type=float, default=300)
    s.set_defaults(fn=cmd_wait_ready)
    sub.add_parser("observe").set_defaults(fn=cmd_observe)
    s = sub.add_parser("click")
    s.add_argument("x", type=float)
    s.add_argument("y", type=float)
    s.set_defaults(fn=cmd_click)
    s = sub.add_parser("type")
    s.add_argument("text")
    s.set_defaults(fn=cmd_type)
    s = sub.add_parser("key")
    s.add_argument("name")
    s.set_defaults(fn=cmd_key)
    s = sub.add_parser("screenshot")
    s.add_argument("path")
    s.set_defaults(fn=cmd_screenshot)
    sub.add_parser("page-reward").set_defaults(fn=cmd_page_reward)
    s = sub.add_parser("grade")
    s.add_argument("--task", default="click-button")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--actions", default=str(ACTIONS))
    s.set_defaults(fn=cmd_grade)
    args = p.parse_args(argv)
    try:
        return int(args.fn(args))
    except DriverError as exc:
        print(f"driver: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
