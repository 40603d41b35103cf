"""The pure parts of ``bench/rl.py`` (``rollbox bench rl``): argument parsing, the ``times``
wrapper of the workload's commands, the restart phase's output check, the JSON summary."""
from __future__ import annotations

import json
import subprocess

import pytest

from rollbox.benchkit import load_bench
from rollbox.edge.sessions import HEAD_LIMIT, StreamBuffer


@pytest.fixture(scope="module")
def rl():  # noqa: ANN201
    return load_bench("rl")


def test_parse_args(rl) -> None:  # noqa: ANN001
    o = rl.parse_args([])
    assert (o.quick, o.json_out, o.phases) == (False, False, rl.PHASES)
    o = rl.parse_args(["--json", "--quick", "--phases", "restart,grpo"])
    assert (o.quick, o.json_out, o.phases) == (True, True, ("grpo", "restart"))  # run order
    assert rl.parse_args(["--phases=many"]).phases == ("many",)
    for bad in (["--phases", "grpo,nope"], ["--phases", ""], ["--phases"], ["--fast"]):
        with pytest.raises(SystemExit):
            rl.parse_args(bad)


def test_timed_keeps_status_and_reports_cpu(rl) -> None:  # noqa: ANN001
    script = rl.timed("echo hello; python3 -c 'sum(range(3_000_000))'; exit 3")
    p = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False)
    assert p.returncode == 3
    out, cpu = rl.split_times(p.stdout)
    assert out == "hello"
    assert 0.01 <= cpu < 30  # the python child's CPU is counted


def test_split_times_formats(rl) -> None:  # noqa: ANN001
    dash = "a\nb\n0m0.010000s 0m0.020000s\n1m2.500000s 0m0.250000s\n"
    bash = "a\n0m0.001s 0m0.002s\n0m0.100s 0m0.200s\n"
    assert rl.split_times(dash) == ("a\nb", pytest.approx(62.78))
    assert rl.split_times(bash) == ("a", pytest.approx(0.303))


def buffered(data: str) -> tuple[str, int]:
    """What the edge reports for ``data`` on a stream (head, dropped marker, tail)."""
    b = StreamBuffer()
    raw = data.encode()
    for i in range(0, len(raw), 1 << 16):
        b.add(raw[i:i + (1 << 16)])
    return b.text(), b.total


def test_output_within_bound(rl) -> None:  # noqa: ANN001
    _cmd, small, _code = rl.ticker(3, 5)
    assert rl.output_within_bound(small, small, len(small))
    assert not rl.output_within_bound(small, small.replace("4", "5"), len(small))
    assert not rl.output_within_bound(small, small[:-8], len(small))  # short, not truncated
    _cmd, big, _code = rl.big_writer(0, 300_000)
    assert len(big) > HEAD_LIMIT
    text, total = buffered(big)
    assert rl.output_within_bound(big, text, total)  # head + marker + tail, as the edge keeps
    assert not rl.output_within_bound(big, text, total - 1)
    assert not rl.output_within_bound(big, text.replace("line 2999", "line 2998", 1), total)
    # rebuilt after a restart from the agent's last 1 MiB: a "lost" marker, then that MiB
    b = StreamBuffer()
    b.resume_at(len(big) - HEAD_LIMIT)
    b.add(big[-HEAD_LIMIT:].encode())
    assert rl.output_within_bound(big, b.text(), b.total)
    assert not rl.output_within_bound(big, b.text().replace("line 299999", "line 2", 1), b.total)
    assert not rl.output_within_bound(big, big[-HEAD_LIMIT:], len(big))  # not at offset 0
    assert not rl.output_within_bound(big, big[:100], len(big))  # too little kept


def test_pattern_checks_any_chunking(rl) -> None:  # noqa: ANN001
    import asyncio

    p = rl.Pattern((3 << 20) + 5)

    async def collect() -> bytes:
        return b"".join([c async for c in p.chunks()])

    data = asyncio.run(collect())
    assert len(data) == p.size
    for step in (4096, 700_001, 1 << 20):
        assert all(p.matches(off, data[off:off + step]) for off in range(0, len(data), step))
    assert not p.matches(5, data[6:100])


def test_restart_commands_print_what_is_expected(rl) -> None:  # noqa: ANN001
    for cmd, expected, code in (rl.ticker(7, 2), rl.big_writer(0, 2000)):
        p = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=False)
        assert (p.returncode, p.stdout) == (code, expected)


def test_summary_keys_shape(rl) -> None:  # noqa: ANN001
    keys = {"episodes_per_s", "errors", "ratio_vs_podman", "platform_cpu_s_per_episode",
            "podman_platform_cpu_s_per_episode", "sandboxes_1024_ok", "write_64x512_ok",
            "host_mem_available_min_mib", "server_rss_peak_mib", "restart_commands_recovered",
            "targets"}
    empty = rl.summary_keys({})
    assert keys <= set(empty) and all(v is None for v in empty["targets"].values())
    res = {"grpo": {"episodes_per_s": 3.0, "errors": 0, "platform_cpu_s_per_episode": 0.1},
           "grpo_podman": {"episodes_per_s": 1.0, "platform_cpu_s_per_episode": 0.6},
           "many": {"ok": 1}, "write": {"ok": 0, "mem_available_min_mib": 1500},
           "restart": {"recovered": 1.0}, "files": {"server_rss_peak_mib": 400.0}}
    s = rl.summary_keys(res)
    assert s["ratio_vs_podman"] == 3.0
    assert s["targets"] == {
        "errors==0": True, "ratio_vs_podman>=1.5": True, "platform_cpu<=podman/3": True,
        "sandboxes_1024_ok==1": True, "write_64x512_ok==1": False,
        "host_mem_available_min_mib>=2048": False, "restart_commands_recovered==1.0": True,
        "server_rss_peak_mib<=300": False}
    json.dumps(rl.rounded({**s, "x": (1.23456789, [2.5])}))
