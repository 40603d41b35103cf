"""SWE-ReX's request and response bodies (swe-rex 1.4 ``swerex.runtime.abstract``), mirrored.

Mirrored rather than imported so that the server does not need the ``swe-rex`` package (and
its pexpect/bashlex dependencies) installed; the integration tests check the shapes against
the real client. Unknown fields are ignored, as the SWE-ReX server does.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class IsAliveResponse(BaseModel):
    is_alive: bool
    message: str = ""


class CreateBashSessionRequest(BaseModel):
    startup_source: list[str] = []
    session: str = Field("default", min_length=1, max_length=256)
    session_type: Literal["bash"] = "bash"
    startup_timeout: float = 1.0


class CreateBashSessionResponse(BaseModel):
    output: str = ""
    session_type: Literal["bash"] = "bash"


class BashAction(BaseModel):
    command: str
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(BaseModel):
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


Action = Annotated[BashAction | BashInterruptAction, Field(discriminator="action_type")]


class BashObservation(BaseModel):
    output: str = ""
    exit_code: int | None = None
    failure_reason: str = ""
    expect_string: str = ""
    session_type: Literal["bash"] = "bash"


class CloseBashSessionRequest(BaseModel):
    session: str = "default"
    session_type: Literal["bash"] = "bash"


class CloseBashSessionResponse(BaseModel):
    session_type: Literal["bash"] = "bash"


class Command(BaseModel):
    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class CommandResponse(BaseModel):
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None


class ReadFileRequest(BaseModel):
    path: str
    encoding: str | None = None
    errors: str | None = None


class ReadFileResponse(BaseModel):
    content: str = ""


class WriteFileRequest(BaseModel):
    content: str
    path: str


class Empty(BaseModel):
    """WriteFileResponse, UploadResponse and CloseResponse: all empty objects."""


class ExceptionTransfer(BaseModel):
    """``_ExceptionTransfer``: the client re-raises ``class_path(message)`` on HTTP 511."""

    message: str = ""
    class_path: str = ""
    traceback: str = ""
    extra_info: dict[str, Any] = {}


# Exception classes the client re-raises (they live in swerex.exceptions or builtins).
SWEREX_EXC = "swerex.exceptions."
SwerexException = SWEREX_EXC + "SwerexException"
SessionExistsError = SWEREX_EXC + "SessionExistsError"
SessionDoesNotExistError = SWEREX_EXC + "SessionDoesNotExistError"
SessionNotInitializedError = SWEREX_EXC + "SessionNotInitializedError"
NonZeroExitCodeError = SWEREX_EXC + "NonZeroExitCodeError"
BashIncorrectSyntaxError = SWEREX_EXC + "BashIncorrectSyntaxError"
CommandTimeoutError = SWEREX_EXC + "CommandTimeoutError"
NoExitCodeError = SWEREX_EXC + "NoExitCodeError"


class RemoteError(Exception):
    """An error the SWE-ReX client re-raises as ``class_path`` (sent as HTTP 511)."""

    def __init__(self, class_path: str, message: str, **extra_info: Any) -> None:
        super().__init__(message)
        self.class_path = class_path
        self.message = message
        self.extra_info = extra_info

    def transfer(self) -> dict[str, Any]:
        return {"swerexception": ExceptionTransfer(
            message=self.message, class_path=self.class_path,
            extra_info=self.extra_info).model_dump()}
