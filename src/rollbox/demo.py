"""``rollbox demo``: the main job. N concurrent SWE-style episodes against the embedded server.

Each episode: a sandbox from ``python:3.11`` plus a workspace layer (a small repo with a bug);
a scripted "agent" edits the code (even episodes fix it, odd ones write a wrong fix and try to
cheat by planting a ``conftest.py`` that passes every test); the reward comes from
``sandbox.grade``: a fresh sandbox made of the pristine layers plus a hidden-tests layer, into
which only the declared artifact (the package's source directory) is copied. So the cheat can't
change the reward.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from rollbox.benchkit import percentile
from rollbox.config import Settings
from rollbox.embedded import server_process

WORKSPACE_IMAGE = "demo/swe-workspace:1"
TESTS_IMAGE = "demo/swe-tests:1"
REPO = "/work/repo"
ARTIFACT_DIR = f"{REPO}/stats"

BUGGY = '''"""Small statistics helpers."""


def mean(xs):
    if not xs:
        raise ValueError("mean of empty data")
    return sum(xs) / (len(xs) - 1)


def median(xs):
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
'''
FIXED = BUGGY.replace("sum(xs) / (len(xs) - 1)", "sum(xs) / len(xs)")
WRONG = BUGGY.replace("sum(xs) / (len(xs) - 1)", "sum(xs) / (len(xs) + 1)")
CHEAT_CONFTEST = '''import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    rep.outcome = "passed"
'''
VISIBLE_TEST = '''from stats import median


def test_median():
    assert median([3, 1, 2]) == 2
'''
HIDDEN_TEST = '''from stats import mean, median


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_single():
    assert mean([7]) == 7


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5
'''


def ensure_demo_images(settings: Settings | None = None) -> None:
    """Build the workspace and hidden-tests layers (each its own versioned layer)."""
    from rollbox.images.sources import build_from_directory
    from rollbox.images.store import ImageStore

    store = ImageStore((settings or Settings()).images_dir)
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        (ws / "work/repo/stats").mkdir(parents=True)
        (ws / "work/repo/stats/__init__.py").write_text("from .core import mean, median\n")
        (ws / "work/repo/stats/core.py").write_text(BUGGY)
        (ws / "work/repo/tests").mkdir()
        (ws / "work/repo/tests/test_visible.py").write_text(VISIBLE_TEST)
        build_from_directory(store, ws, WORKSPACE_IMAGE)
        hidden = Path(tmp) / "hidden"
        (hidden / "work/repo/hidden_tests").mkdir(parents=True)
        (hidden / "work/repo/hidden_tests/test_hidden.py").write_text(HIDDEN_TEST)
        build_from_directory(store, hidden, TESTS_IMAGE)


async def episode(client: Any, i: int, timings: dict[str, list[float]]) -> dict[str, Any]:
    fix = i % 2 == 0
    t0 = time.monotonic()
    sb = await client.create("python:3.11", layers=[WORKSPACE_IMAGE],
                             labels={"job": "demo", "episode": str(i)}, ttl_s=600)
    timings["create"].append(time.monotonic() - t0)
    try:
        t = time.monotonic()
        r = await sb.exec("git init -q . && git add -A && python -m pytest -q tests 2>&1 | tail -1",
                          cwd=REPO, timeout=120)
        timings["exec"].append(time.monotonic() - t)
        src = (await sb.files.read(f"{ARTIFACT_DIR}/core.py")).decode()
        assert "len(xs) - 1" in src, "workspace layer not as built"
        await sb.files.write(f"{ARTIFACT_DIR}/core.py", FIXED if fix else WRONG)
        if not fix:  # the cheat: make every test pass inside the agent's own sandbox
            await sb.files.write(f"{REPO}/conftest.py", CHEAT_CONFTEST)
        r = await sb.exec("python -m pytest -q -p no:cacheprovider tests", cwd=REPO, timeout=120)
        agent_thinks_passed = r.exit_code == 0
        # Grading: pristine layers + hidden tests + only the declared artifact.
        t = time.monotonic()
        g = await sb.grade("python -m pytest -q -p no:cacheprovider hidden_tests",
                           files=[ARTIFACT_DIR], layers=[TESTS_IMAGE], cwd=REPO, timeout=120)
        reward = 1.0 if g.result.exit_code == 0 else 0.0
        timings["grade"].append(time.monotonic() - t)
    finally:
        await sb.delete()
    timings["episode"].append(time.monotonic() - t0)
    return {"episode": i, "fixed": fix, "agent_saw_pass": agent_thinks_passed, "reward": reward}


async def run_episodes(n: int, url: str, api_key: str) -> dict[str, Any]:
    from rich.progress import Progress

    from rollbox.sdk import AsyncClient

    timings: dict[str, list[float]] = {"create": [], "exec": [], "grade": [], "episode": []}
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    t0 = time.monotonic()
    async with AsyncClient(base_url=url, api_key=api_key) as client:
        with Progress(transient=False) as progress:
            task = progress.add_task(f"{n} episodes", total=n)

            async def one(i: int) -> None:
                try:
                    results.append(await episode(client, i, timings))
                except Exception as exc:  # noqa: BLE001 - reported in the summary
                    errors.append(f"episode {i}: {type(exc).__name__}: {exc}")
                progress.advance(task)

            await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t0
    fixed = [r for r in results if r["fixed"]]
    unfixed = [r for r in results if not r["fixed"]]
    summary = {
        "episodes": n,
        "completed": len(results),
        "errors": errors,
        "wall_s": round(wall, 3),
        "episodes_per_s": round(len(results) / wall, 3) if wall else 0,
        "mean_reward": round(sum(r["reward"] for r in results) / max(1, len(results)), 3),
        "reward_fixed": sum(r["reward"] for r in fixed) / max(1, len(fixed)),
        "reward_unfixed_cheating": sum(r["reward"] for r in unfixed) / max(1, len(unfixed)),
        "cheaters_fooled_own_tests": sum(r["agent_saw_pass"] for r in unfixed),
    }
    for k, xs in timings.items():
        summary[f"{k}_p50_s"] = round(percentile(xs, 50), 4)
        summary[f"{k}_p99_s"] = round(percentile(xs, 99), 4)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rollbox demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        if k != "errors":
            table.add_row(k, str(v))
    Console().print(table)
    for e in summary["errors"][:10]:
        Console().print(f"[red]{e}")


def run_demo(n: int = 32, url: str | None = None) -> dict[str, Any]:
    ensure_demo_images(Settings())
    with server_process(url) as (base_url, key):
        summary = asyncio.run(run_episodes(n, base_url, key))
    print_summary(summary)
    return summary
