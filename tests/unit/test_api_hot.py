"""api.hot: the lean path of create, exec and delete answers what FastAPI's own handler of the
same route answers (status, error code, message), for good and for malformed requests, and
keeps the caller's checks (a key, its project's sandboxes only)."""
from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute, request_response

from rollbox.api.routes import exec as exec_routes, sandboxes
from test_api_support import ApiStack

LEAN = {**sandboxes.LEAN, **exec_routes.LEAN}


def fastapi_served(stack: ApiStack) -> None:
    """The stack's hot routes served by FastAPI's handler again (the path before api.hot)."""
    routes = stack.app.router.routes
    for i, route in enumerate(routes):
        if isinstance(route, APIRoute) and route.endpoint in LEAN:
            routes[i] = plain = copy.copy(route)  # its own: the lean stack keeps its route
            plain.app = request_response(route.get_route_handler())


@pytest.fixture
async def stacks(tmp_path: Path) -> AsyncIterator[tuple[ApiStack, ApiStack]]:
    async with ApiStack(tmp_path / "lean") as lean, ApiStack(tmp_path / "fastapi") as plain:
        fastapi_served(plain)
        yield lean, plain


async def test_the_hot_routes_are_lean(tmp_path: Path) -> None:
    stack, plain = ApiStack(tmp_path / "lean", serve=False), ApiStack(tmp_path / "plain", serve=False)
    try:
        check_served(stack, plain)
    finally:
        await stack.close()
        await plain.close()


def check_served(stack: ApiStack, plain: ApiStack) -> None:
    hot_routes = [r for r in stack.app.routes if isinstance(r, APIRoute) and r.endpoint in LEAN]
    assert {(r.path, *r.methods) for r in hot_routes} == {
        ("/v1/sandboxes", "POST"), ("/v1/sandboxes/{sandbox_id}", "DELETE"),
        ("/v1/sandboxes/{sandbox_id}/exec", "POST")}
    # served by the lean handler (Starlette's request_response), not FastAPI's own
    assert {r.app.__module__ for r in hot_routes} == {"starlette.routing"}
    fastapi_served(plain)
    assert {r.app.__module__ for r in plain.app.routes
            if isinstance(r, APIRoute) and r.endpoint in LEAN} == {"fastapi.routing"}


async def answers(stack: ApiStack, key: str | None, other_key: str) -> list[tuple[object, ...]]:
    """Status and error (code, message without ids) of each request of a fixed list."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: list[tuple[object, ...]] = []
    async with httpx.AsyncClient(base_url=stack.url, headers=headers, timeout=30) as c, \
            httpx.AsyncClient(base_url=stack.url, timeout=30,
                              headers={"X-API-Key": other_key}) as other:

        def seen(r: httpx.Response) -> None:
            body = r.json() if r.content else None
            err = body.get("error") if isinstance(body, dict) else None
            if err is not None:
                assert err["request_id"] == r.headers["x-request-id"]
                out.append((r.status_code, err["code"], err["message"].replace(sid, "SID")))
            else:
                out.append((r.status_code, sorted(body) if isinstance(body, dict) else body))

        sid = "sb-none"
        r = await c.post("/v1/sandboxes", json={"image": "debian", "labels": {"a": "b"}})
        sid = r.json().get("id", sid)
        seen(r)
        bad_creates: list[dict[str, object]] = [
            {"json": {"image": "x", "resources": {"cpus": -1}}},
            {"json": {"image": "x", "bogus": 1}},
            {"json": [1, 2]},
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            {"content": b'{"image": "debian"}', "headers": {"content-type": "text/plain"}},
            {"content": b'{"image": "debian"}', "headers": {"content-type": ""}},
            {"content": b""},
            {"json": {"image": "debian"}, "headers": {"X-Rollbox-Attempt": "0"}},
            {"json": {"image": "debian"}, "headers": {"X-Rollbox-Attempt": "two"}},
        ]
        for kw in bad_creates:
            seen(await c.post("/v1/sandboxes", **kw))  # type: ignore[arg-type]
        seen(await c.post(f"/v1/sandboxes/{sid}/exec", params={"wait": 1},
                          json={"cmd": ["true"]}))
        seen(await c.post(f"/v1/sandboxes/{sid}/exec", params={"wait": "maybe"},
                          json={"cmd": ["true"]}))
        seen(await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls", "cwd": "relative"}))
        seen(await c.post(f"/v1/sandboxes/{sid}/exec", content=b"[",
                          headers={"content-type": "application/json"}))
        seen(await other.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": ["true"]}))
        seen(await other.post(f"/v1/sandboxes/{sid}/exec", json={"cwd": 5}))
        seen(await other.delete(f"/v1/sandboxes/{sid}"))
        seen(await c.post("/v1/sandboxes/sb-nope/exec", json={"cmd": ["true"]}))
        seen(await c.delete(f"/v1/sandboxes/{sid}"))
        seen(await c.delete(f"/v1/sandboxes/{sid}"))
    return out


async def test_lean_and_fastapi_answer_alike(stacks: tuple[ApiStack, ApiStack]) -> None:
    lean, plain = stacks
    got = await answers(lean, lean.key_a, lean.key_b)
    assert got == await answers(plain, plain.key_a, plain.key_b)
    statuses = [a[0] for a in got]
    assert statuses[0] == 201 and statuses[1:10] == [400] * 9
    assert statuses[10:] == [200, 400, 400, 400, 404, 404, 404, 404, 204, 404]
    assert got[10] == (200, sorted(got[10][1]))  # an ExecResult, not an error


@pytest.mark.parametrize("key", [None, "rbx_nope"])
async def test_lean_needs_a_valid_key(stacks: tuple[ApiStack, ApiStack], key: str | None) -> None:
    """The lean path checks the key before it reads the body: where FastAPI answers a
    malformed JSON body of an unknown caller 400 (it parses before it solves the caller), the
    lean path answers 401; every other answer is FastAPI's."""
    lean, plain = stacks
    got = await answers(lean, key, lean.key_b)
    before = await answers(plain, key, plain.key_b)
    malformed = [i for i, a in enumerate(before) if a[:2] == (400, "bad_request")]
    assert malformed == [4, 13]  # "{not json" and "[": FastAPI's JSON decode error
    assert [a for i, a in enumerate(got) if i not in malformed] == [
        a for i, a in enumerate(before) if i not in malformed]
    assert [got[i][:2] for i in malformed] == [(401, "unauthorized")] * 2
    assert all(a[:2] in ((401, "unauthorized"), (404, "not_found")) for a in got), got
    assert got[0][:2] == (401, "unauthorized")
