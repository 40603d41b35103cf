"""SandboxFusion front door: ``POST /run_code`` as the ``sandbox-fusion`` client speaks it,
served by the fncall service's warm pools (``app.state.fncall``).

Auth: an API key in ``Authorization: Bearer`` / ``X-API-Key``, or — for the unmodified client,
which sends no headers — in the path: ``SANDBOX_FUSION_ENDPOINT=http://HOST:PORT/sandboxfusion/
<api key>`` makes it post to ``/sandboxfusion/<key>/run_code``. Owns only these routes and the
mapping between the two wire formats.
"""

from typing import Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from rollbox import errors
from rollbox.api.context import ApiContext
from rollbox.api.deps import request_key
from rollbox.api.routes.fncall import backend_of
from rollbox.models import FnCallResult, FnCallSpec, FnCallStep

# SandboxFusion language names -> fncall languages.
LANGUAGES: dict[str, str] = {"python": "python", "python3": "python", "bash": "bash",
                             "cpp": "cpp", "c": "c", "nodejs": "nodejs", "javascript": "nodejs",
                             # on the optional image fncall-polyglot:1 (rollbox.fncall.pool)
                             "go": "go", "java": "java", "rust": "rust",
                             "typescript": "typescript"}


class RunCodeRequest(BaseModel):
    """The fields the ``sandbox-fusion`` client sends (``sandbox_fusion.models``)."""
    model_config = ConfigDict(extra="ignore")
    compile_timeout: float = Field(10, gt=0, le=600)
    run_timeout: float = Field(10, gt=0, le=600)
    memory_limit_MB: int = Field(-1)
    code: str = Field(..., max_length=1 << 20)
    stdin: str | None = None
    language: str
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def to_spec(req: RunCodeRequest) -> FnCallSpec:
    lang = LANGUAGES.get(req.language)
    if lang is None:
        raise errors.BadRequest(f"language {req.language!r} is not served by rollbox "
                                f"(supported: {', '.join(sorted(LANGUAGES))})")
    # Absolute paths land inside the call's own directory (it is the only writable place).
    files = {k.lstrip("/"): v for k, v in req.files.items() if v is not None}
    try:
        return FnCallSpec(
            language=lang,  # type: ignore[arg-type]
            code=req.code, stdin=req.stdin or "", files=files, timeout_s=req.run_timeout,
            compile_timeout_s=req.compile_timeout, fetch_files=req.fetch_files,
            **({"memory_mib": req.memory_limit_MB} if req.memory_limit_MB > 0 else {}))
    except ValueError as exc:
        raise errors.BadRequest(str(exc)) from None


def _step(step: FnCallStep, *, timed_out: bool) -> CommandRunResult:
    return CommandRunResult(
        status="TimeLimitExceeded" if timed_out else "Finished", execution_time=step.wall_s,
        return_code=step.exit_code if step.exit_code is not None else
        (-step.signal if step.signal else None),
        stdout=step.stdout, stderr=step.stderr)


def to_response(res: FnCallResult) -> RunCodeResponse:
    compile_result = None
    if res.compile is not None:
        compile_result = _step(res.compile, timed_out=res.compile.timed_out)
        if res.status in ("compile_error", "timeout") and res.compile.exit_code != 0:
            return RunCodeResponse(status="Failed", message="compilation failed",
                                   compile_result=compile_result, executor_pod_name=res.worker)
    run = FnCallStep(exit_code=res.exit_code, signal=res.signal,
                     timed_out=res.status == "timeout", stdout=res.stdout, stderr=res.stderr,
                     wall_s=res.wall_s, cpu_s=res.cpu_s)
    ok = res.status == "ok"
    return RunCodeResponse(
        status="Success" if ok else "Failed", message="" if ok else res.status,
        compile_result=compile_result, run_result=_step(run, timed_out=res.status == "timeout"),
        executor_pod_name=res.worker, files=res.files)


def mount(app: FastAPI, api: ApiContext) -> None:
    async def run(body: RunCodeRequest, request: Request, key: str | None) -> RunCodeResponse:
        await api.principal(request_key(request) if key is None else key)
        return to_response(await backend_of(request).call(to_spec(body)))

    @app.post("/run_code", response_model=RunCodeResponse, tags=["sandboxfusion"])
    async def run_code(body: RunCodeRequest, request: Request) -> RunCodeResponse:
        return await run(body, request, None)

    @app.post("/sandboxfusion/{api_key}/run_code", response_model=RunCodeResponse,
              tags=["sandboxfusion"])
    async def run_code_keyed(api_key: str, body: RunCodeRequest, request: Request
                             ) -> RunCodeResponse:
        return await run(body, request, api_key)



