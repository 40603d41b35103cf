"""Round-trip cost of SWE-ReX calls through rollbox relative to the native SDK, same run:
``pytest -s -m slow tests/integration/test_compat_swerex_overhead.py`` prints the medians."""
from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

import pytest

pytest.importorskip("swerex.runtime.remote")

from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest  # noqa: E402

from tests.integration.test_compat_swerex import IMAGE, Env, env  # noqa: E402,F401

N = 200


async def _median_ms(fn: Callable[[], Awaitable[object]]) -> float:
    for _ in range(10):
        await fn()
    times = []
    for _ in range(N):
        t0 = time.perf_counter()
        await fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


@pytest.mark.slow
async def test_round_trip_overhead(env: Env) -> None:
    rt = env.runtime()
    await rt.create_session(CreateBashSessionRequest())
    sb = await env.client.get(env.sandbox_id)
    native = await _median_ms(lambda: sb.exec("true"))
    session = await _median_ms(lambda: rt.run_in_session(BashAction(command="true")))
    execute = await _median_ms(lambda: rt.execute(Command(command="true", shell=True)))
    print(f"\n{IMAGE}: median of {N}: sdk exec {native:.2f} ms, swe-rex run_in_session "
          f"{session:.2f} ms ({session / native:.2f}x), swe-rex execute {execute:.2f} ms "
          f"({execute / native:.2f}x)")
    # A session command skips the process start: it must not cost more than a few execs.
    assert session < 5 * native
