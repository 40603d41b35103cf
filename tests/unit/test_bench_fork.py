"""``bench/fork.py``'s own logic: its ``--only`` phases, and that a microVM fork round reads the
children's CPU while they still run (a delete reaps their QEMUs into this process's children's
CPU, which the round counts too: read after the deletes, every child was counted twice)."""
from __future__ import annotations

import types

import pytest

from rollbox.benchkit import load_bench


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_bench("fork")


def test_only_phases(bench) -> None:  # noqa: ANN001
    assert bench.parse_only("") == frozenset({"container", "microvm", "ports"})
    assert bench.parse_only(" microvm ,ports") == frozenset({"microvm", "ports"})
    with pytest.raises(ValueError, match="vm, x"):
        bench.parse_only("microvm,x,vm")


class FakeEdge:
    """fork/exec/delete of ``n`` children by id; records which are alive."""

    def __init__(self) -> None:
        self.alive: set[str] = set()

    async def fork(self, src: str, spec, owner: str):  # noqa: ANN001, ANN201
        ids = [f"c{i}" for i in range(spec.n)]
        self.alive |= set(ids)
        return types.SimpleNamespace(children=[types.SimpleNamespace(id=i) for i in ids],
                                     frozen_s=0.01)

    async def exec_start(self, sid: str, spec) -> str:  # noqa: ANN001
        assert sid in self.alive
        return "e1"

    async def exec_wait(self, sid: str, eid: str):  # noqa: ANN201
        return types.SimpleNamespace(exit_code=0)

    async def delete(self, sid: str) -> None:
        self.alive.discard(sid)


async def test_a_microvm_fork_round_counts_each_childs_cpu_once(bench, monkeypatch) -> None:  # noqa: ANN001
    """Each child's QEMU used 0.2 CPU-s, the source 0.05, the edge 0.1: the round's CPU is
    their sum, though the deletes reap the QEMUs into this process's children's CPU; a child
    restored into a spare QEMU counts from the fork's start (its 0.15 CPU-s as a spare left
    out)."""
    edge = FakeEdge()
    pids = {f"c{i}": 100 + i for i in range(3)}
    reaped = {"s": 0.0}

    async def delete(sid: str) -> None:
        edge.alive.discard(sid)
        reaped["s"] += 0.2  # the QEMU reaped by this process: its CPU now in RUSAGE_CHILDREN

    edge.delete = delete  # type: ignore[method-assign]
    started = {"edge": False}

    def process_cpu_s(pid=None, children: bool = False) -> float:  # noqa: ANN001
        if pid is None:
            return (0.1 if started["edge"] else 0.0) + reaped["s"]
        if pid == 1:  # the source
            return 1.0 + (0.05 if started["edge"] else 0.0)
        if pid == pids["c0"]:  # the spare: 0.15 before the fork
            return 0.15 + (0.2 if started["edge"] and "c0" in edge.alive else 0.0)
        return 0.2 if next(k for k, v in pids.items() if v == pid) in edge.alive else 0.0

    orig_fork = edge.fork

    async def fork(src: str, spec, owner: str):  # noqa: ANN001, ANN202
        started["edge"] = True
        return await orig_fork(src, spec, owner)

    edge.fork = fork  # type: ignore[method-assign]
    vms = {"src": types.SimpleNamespace(pid=1)}
    vms.update({k: types.SimpleNamespace(pid=v) for k, v in pids.items()})
    edge.backends = {"microvm": types.SimpleNamespace(
        _vms=vms, settings=types.SimpleNamespace(vm_fork_warm=False),
        spares=types.SimpleNamespace(spares=lambda: [types.SimpleNamespace(pid=pids["c0"])]))}
    monkeypatch.setattr(bench, "process_cpu_s", process_cpu_s)
    r = await bench.microvm_fork_round(edge, "src", 3, False)
    assert r["cpu"] == pytest.approx(3 * 0.2 + 0.05 + 0.1)
    assert r["child_cpu"] == pytest.approx(0.2)
    assert r["claimed"] == 1
    assert edge.alive == set()
