"""``rollbox bench compat [--quick] [--json] [--url URL]``.

Peer-protocol overhead, one server (``rollbox serve`` in its own process, as deployed): N
concurrent create -> run ``echo ok`` -> kill cycles through the unmodified ``e2b`` SDK
(``AsyncSandbox`` against ``/e2b``) and the same cycles through rollbox's own ``AsyncClient``,
same image (E2B ``base`` = ``debian:bookworm``), rounds interleaved so drift hits both.
``e2b_vs_native_ratio`` = median E2B wall time / median native wall time (target < 2).
The last line of ``--json`` is one JSON object.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

from rollbox.benchkit import emit, percentile, ratio, rounded, run_cycles, say
from rollbox.embedded import server_process
from rollbox.default_images import BASE_IMAGE


async def _timed(n: int, cycle: Any) -> tuple[float, int]:
    """(wall seconds, errors) of ``n`` cycles all at once."""
    r = await run_cycles(cycle, n, n)
    return r["wall_s"], r["errors"]


async def run(url: str, key: str, n: int, rounds: int) -> dict[str, Any]:
    import rollbox

    os.environ["E2B_API_URL"] = f"{url}/e2b"
    os.environ["E2B_SANDBOX_URL"] = f"{url}/e2b/envd"
    os.environ["E2B_API_KEY"] = key
    from e2b import AsyncSandbox

    async with rollbox.AsyncClient(url, key) as client:
        async def native() -> bool:
            sb = await client.create(BASE_IMAGE, ttl_s=300)
            try:
                return (await sb.exec("echo ok")).stdout == "ok\n"
            finally:
                await sb.delete()

        async def e2b() -> bool:
            sbx = await AsyncSandbox.create("base", timeout=300)
            try:
                return (await sbx.commands.run("echo ok")).stdout == "ok\n"
            finally:
                await sbx.kill()

        await _timed(4, native)  # warm both paths (image cache, connection pools)
        await _timed(4, e2b)
        walls: dict[str, list[float]] = {"native": [], "e2b": []}
        errs = 0
        for r in range(rounds):
            for name, fn in (("native", native), ("e2b", e2b)) if r % 2 == 0 else (
                    ("e2b", e2b), ("native", native)):
                wall, e = await _timed(n, fn)
                errs += e
                walls[name].append(wall)
                say(f"  round {r + 1}/{rounds} {name}: {n} cycles in {wall:.2f}s ({e} errors)")
    native_s = percentile(walls["native"], 50)
    e2b_s = percentile(walls["e2b"], 50)
    return {
        "concurrency": n, "rounds": rounds, "image": BASE_IMAGE,
        "native_wall_s": native_s, "e2b_wall_s": e2b_s,
        "native_cycles_per_s": n / native_s, "e2b_cycles_per_s": n / e2b_s,
        "e2b_vs_native_ratio": ratio(e2b_s, native_s),
        "native_walls_s": walls["native"], "e2b_walls_s": walls["e2b"], "errors": errs,
    }


def main(quick: bool = False, json_out: bool = False, url: str | None = None,
         n: int = 64) -> dict[str, Any]:
    rounds = 1 if quick else 3
    with server_process(url) as (u, key):
        res = rounded(asyncio.run(run(u, key, n, rounds)))
    say(f"e2b_vs_native_ratio {res['e2b_vs_native_ratio']} "
        f"(e2b {res['e2b_wall_s']}s vs native {res['native_wall_s']}s for {n} cycles)")
    return emit(res, json_out)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv, json_out="--json" in sys.argv)
