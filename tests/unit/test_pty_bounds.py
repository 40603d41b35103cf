"""PTY exec's bounds agree everywhere they are stated (models, the agent protocol, the agent's C
source) and bad sizes are refused before anything is sent."""
from __future__ import annotations

import re
from pathlib import Path

import pydantic
import pytest

from rollbox.agent import protocol as P
from rollbox.models import PTY_MAX_SIZE, ExecSpec, PtySize

AGENT_C = Path(__file__).resolve().parents[2] / "native" / "agent" / "agent.c"


def test_bounds_agree_with_the_agent() -> None:
    src = AGENT_C.read_text()
    assert P.PTY_MAX_SIZE == PTY_MAX_SIZE
    assert re.search(rf"#define PTY_MAX_SIZE {PTY_MAX_SIZE}\b", src)
    assert re.search(rf"#define EXEC_PTY {P.EXEC_PTY}u\b", src)
    assert re.search(rf"M_RESIZE = {P.RESIZE}\b", src)


@pytest.mark.parametrize("cols,rows", [(0, 24), (100_000, 24), (80, 0), (80, 100_000),
                                       (-1, 24), (PTY_MAX_SIZE + 1, 1)])
def test_bad_sizes_are_refused(cols: int, rows: int) -> None:
    with pytest.raises(ValueError):
        P.pty_size(cols, rows)
    with pytest.raises(pydantic.ValidationError):
        PtySize(cols=cols, rows=rows)
    with pytest.raises(pydantic.ValidationError):
        ExecSpec(cmd="true", pty={"cols": cols, "rows": rows})


def test_exec_request_carries_the_size_before_the_strings() -> None:
    req = P.ExecRequest(argv=["sh"], env=["A=b"], pty=(132, 43))
    _, _, _, payload = P.unpack(req.encode(7, with_cgroup=False))
    flags = P.EXEC_HEAD.unpack_from(payload)[3]
    assert flags & P.EXEC_PTY and not flags & P.EXEC_STDIN
    assert P.PTY_SIZE.unpack_from(payload, P.EXEC_HEAD.size) == (132, 43)
    assert payload[P.EXEC_HEAD.size + P.PTY_SIZE.size:] == b"/\0sh\0A=b\0"
    plain = P.ExecRequest(argv=["sh"], env=[])
    _, _, _, payload = P.unpack(plain.encode(7, with_cgroup=False))
    assert not P.EXEC_HEAD.unpack_from(payload)[3] & P.EXEC_PTY
    assert payload[P.EXEC_HEAD.size:] == b"/\0sh\0"
