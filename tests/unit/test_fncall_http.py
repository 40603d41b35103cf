"""fncall's HTTP doors at the unit tier: ``POST /v1/fncall`` (the hand-rolled hot path: auth,
validation errors, result shape, OpenAPI) and SandboxFusion's ``/run_code`` request/response
mapping, over a real uvicorn with a recording stand-in for the pools on ``app.state.fncall``."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from test_api_support import ApiStack

from rollbox import errors
from rollbox.compat.sandboxfusion import RunCodeRequest, to_response, to_spec
from rollbox.models import FnCallResult, FnCallSpec, FnCallStep


class RecordingBackend:
    """Answers each call with the next canned result (or raises it), keeps the specs."""

    def __init__(self) -> None:
        self.specs: list[FnCallSpec] = []
        self.next: FnCallResult | errors.RollboxError = FnCallResult(
            status="ok", exit_code=0, stdout="1\n", wall_s=0.002, cpu_s=0.001, worker="w1")

    async def call(self, spec: FnCallSpec) -> FnCallResult:
        self.specs.append(spec)
        if isinstance(self.next, errors.RollboxError):
            raise self.next
        return self.next


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[tuple[ApiStack, RecordingBackend]]:
    async with ApiStack(tmp_path) as s:
        backend = RecordingBackend()
        s.app.state.fncall = backend
        yield s, backend


async def test_fncall_route_auth_validation_and_result(stack) -> None:
    s, backend = stack
    async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
        body = {"language": "python", "code": "print(1)", "stdin": "x", "timeout_s": 2}
        r = await c.post("/v1/fncall", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        r = await c.post("/v1/fncall", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert backend.specs == []
        for headers in ({"Authorization": f"Bearer {s.key_a}"}, {"X-API-Key": s.key_b}):
            r = await c.post("/v1/fncall", json=body, headers=headers)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/json"
            out = FnCallResult.model_validate(r.json())
            assert (out.status, out.stdout, out.worker) == ("ok", "1\n", "w1")
        assert backend.specs[-1] == FnCallSpec(language="python", code="print(1)", stdin="x",
                                               timeout_s=2)
        ok = {"X-API-Key": s.key_a}
        for bad, needle in (({"language": "cobol", "code": "x"}, "language"),
                            ({"language": "python", "code": "x", "timeout_s": 0}, "timeout_s"),
                            ({"language": "python", "code": "x", "bogus": 1}, "bogus"),
                            ({"language": "python", "code": "x",
                              "files": {"../etc/passwd": ""}}, "files")):
            r = await c.post("/v1/fncall", json=bad, headers=ok)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["code"] == "bad_request" and needle in r.text, r.text
        r = await c.post("/v1/fncall", content=b"{not json", headers=ok)
        assert r.status_code == 400
        backend.next = errors.InfraError("pool on fire")
        r = await c.post("/v1/fncall", json=body, headers=ok)
        assert r.status_code == 503 and r.json()["error"]["retryable"] is True
        spec = (await c.get("/openapi.json")).json()
        post = spec["paths"]["/v1/fncall"]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/FnCallSpec")
        assert "FnCallSpec" in spec["components"]["schemas"]


def test_sandboxfusion_request_mapping() -> None:
    spec = to_spec(RunCodeRequest(
        code="print(1)", language="python3", stdin=None, run_timeout=3, compile_timeout=7,
        memory_limit_MB=256, files={"/abs/in.txt": "aGk=", "rel.txt": "eA==", "gone": None},
        fetch_files=["out.txt"]))
    assert spec.language == "python" and spec.stdin == "" and spec.timeout_s == 3
    assert spec.compile_timeout_s == 7 and spec.memory_mib == 256
    assert spec.files == {"abs/in.txt": "aGk=", "rel.txt": "eA=="}
    assert spec.fetch_files == ["out.txt"]
    assert to_spec(RunCodeRequest(code="x", language="javascript")).language == "nodejs"
    # -1 (SandboxFusion's "no limit") keeps fncall's default
    assert to_spec(RunCodeRequest(code="x", language="cpp")).memory_mib == \
        FnCallSpec(language="cpp", code="x").memory_mib
    with pytest.raises(errors.BadRequest, match="not served"):
        to_spec(RunCodeRequest(code="x", language="lua"))
    with pytest.raises(errors.BadRequest):
        to_spec(RunCodeRequest(code="x", language="python", files={"a/../../b": "eA=="}))


def test_sandboxfusion_response_mapping() -> None:
    ok = to_response(FnCallResult(status="ok", exit_code=0, stdout="42", wall_s=0.5,
                                  worker="sb1", files={"out.txt": "eA=="}))
    assert (ok.status, ok.message, ok.executor_pod_name) == ("Success", "", "sb1")
    assert ok.compile_result is None and ok.files == {"out.txt": "eA=="}
    assert ok.run_result is not None
    assert (ok.run_result.status, ok.run_result.return_code, ok.run_result.stdout,
            ok.run_result.execution_time) == ("Finished", 0, "42", 0.5)
    comp = FnCallStep(exit_code=0, stderr="warn")
    failed = to_response(FnCallResult(status="runtime_error", exit_code=4, stdout="hi\n",
                                      compile=comp))
    assert (failed.status, failed.message) == ("Failed", "runtime_error")
    assert failed.compile_result is not None and failed.compile_result.return_code == 0
    assert failed.run_result is not None and failed.run_result.return_code == 4
    ce = to_response(FnCallResult(status="compile_error", exit_code=1, stderr="error: x",
                                  compile=FnCallStep(exit_code=1, stderr="error: x")))
    assert ce.status == "Failed" and ce.run_result is None
    assert ce.compile_result is not None and ce.compile_result.stderr == "error: x"
    tle = to_response(FnCallResult(status="timeout", exit_code=None, signal=9))
    assert tle.status == "Failed" and tle.run_result is not None
    assert (tle.run_result.status, tle.run_result.return_code) == ("TimeLimitExceeded", -9)
    ctle = to_response(FnCallResult(status="timeout", compile=FnCallStep(
        exit_code=None, signal=9, timed_out=True)))
    assert ctle.compile_result is not None and ctle.compile_result.status == "TimeLimitExceeded"
    assert ctle.run_result is None


async def test_sandboxfusion_route_keyed_and_headers(stack) -> None:
    s, backend = stack
    async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
        body = {"code": "print(1)", "language": "python", "run_timeout": 2}
        r = await c.post(f"/sandboxfusion/{s.key_a}/run_code", json=body)
        assert r.status_code == 200 and r.json()["status"] == "Success", r.text
        assert r.json()["run_result"]["stdout"] == "1\n"
        assert backend.specs[-1].timeout_s == 2
        r = await c.post("/run_code", json=body, headers={"Authorization": f"Bearer {s.key_b}"})
        assert r.status_code == 200
        r = await c.post("/run_code", json=body)
        assert r.status_code == 401
        r = await c.post("/run_code", json={**body, "language": "lua"},
                         headers={"X-API-Key": s.key_a})
        assert r.status_code == 400 and "not served" in r.text
