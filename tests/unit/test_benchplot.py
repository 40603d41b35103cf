"""A benchmark run's record and plots: ``benchkit.BenchRun`` keeps what ``emit`` printed and
the raw samples the timing helpers took, saves them under a results directory, and
``benchplot`` draws them (and the older result-only files) as PNGs without rerunning anything;
the ``--plot``/``--save`` options every ``rollbox bench`` command has, and ``rollbox bench plot``."""
from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollbox import benchkit as bk
from rollbox import benchplot as bp


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def sample_run(tmp_path: Path) -> bk.BenchRun:
    async def cycle() -> bool:
        await asyncio.sleep(0.001)
        return True

    with bk.BenchRun("demo", argv=["rollbox", "bench", "demo"]) as run:
        res: dict[str, object] = {}
        for c in (1, 4):
            r = asyncio.run(bk.run_cycles(cycle, 8, c))
            res[f"cycles_per_s_c{c}"] = r["per_s"]
            res[f"cycle_p50_ms_c{c}"] = r["p50_ms"]
        res.update(bk.latency_ms([0.002, 0.003, 0.004], "exec_"))
        res["fork1_ready_p50_ms"], res["fork8_ready_p50_ms"] = 50.0, 240.0
        res["ratio_vs_peer_c4"] = 5.2
        res["nested"] = {"c2": {"per_s": 3.0}}
        bk.emit(res, json_out=False)
    assert bk._current_run.get() is None  # the record ends with the block
    return run


def test_the_run_keeps_the_result_and_every_series_of_samples(tmp_path: Path) -> None:
    run = sample_run(tmp_path)
    assert run.result is not None and run.result["fork8_ready_p50_ms"] == 240.0
    assert set(run.samples_ms) == {"cycle_c1", "cycle_c4", "exec"}
    assert len(run.samples_ms["cycle_c4"]) == 8
    assert run.samples_ms["exec"] == [2.0, 3.0, 4.0]  # milliseconds
    assert all(x >= 1.0 for x in run.samples_ms["cycle_c1"])  # each cycle slept 1 ms
    # a series taken twice keeps both
    with bk.BenchRun("again") as again:
        bk.record("x", [0.001])
        bk.record("x", [0.002])
    assert again.samples_ms == {"x": [1.0], "x#2": [2.0]}
    # outside a run, recording is a no-op, not an error
    bk.record("nowhere", [1.0])


def test_save_then_plot_from_the_file(tmp_path: Path) -> None:
    run = sample_run(tmp_path)
    saved = run.save(tmp_path / "results")
    assert saved.parent == tmp_path / "results" and saved.name.startswith("demo-")
    doc = json.loads(saved.read_text())
    assert doc["bench"] == "demo" and doc["result"] == run.result
    assert doc["samples_ms"]["exec"] == [2.0, 3.0, 4.0]
    assert doc["argv"] == ["rollbox", "bench", "demo"] and doc["started"] <= doc["finished"]
    assert run.save(tmp_path / "results") != saved  # a second save never overwrites
    loaded = bp.load(saved)
    flat = bp.flatten(loaded.result)
    assert flat["nested_c2_per_s"] == 3.0
    series = bp.scaling_series(flat)
    assert series["cycles_per_s (c=N)"].keys() == {1, 4}
    assert series["forkN_ready_p50_ms"] == {1: 50.0, 8: 240.0}
    assert not any("exec" in k for k in series)  # exec_p50_ms / exec_p99_ms are not a series
    assert bp.ratios(flat) == {"ratio_vs_peer_c4": 5.2}
    png = bp.plot(loaded, tmp_path / "out" / "demo.png")
    w, h = png_size(png)
    assert w > 400 and h > 3 * 300  # three panels (rates, times) + CDFs + ratios: four axes


def test_a_result_only_file_is_drawn_without_cdfs(tmp_path: Path) -> None:
    d = tmp_path / "results"
    d.mkdir()
    (d / "fork-2026-12-02T1418.json").write_text(json.dumps(
        {"fork1_ready_p50_ms": 55.9, "fork8_ready_p50_ms": 242.9, "fork32_ready_p50_ms": 912.5,
         "fork_vs_snapshot_create_ratio": 0.108}))
    (d / "fork-2026-12-02T1423.json").write_text(json.dumps(
        {"fork1_ready_p50_ms": 50.0, "fork8_ready_p50_ms": 241.0}))
    (d / "empty-2026-12-02T1000.json").write_text(json.dumps({"note": "nothing numeric"}))
    (d / "garbage-2026-12-02T1000.json").write_text("{not json")
    (d / "README.json").write_text("{}")  # not a result's name: ignored
    drawn = bp.redraw_all(d, tmp_path / "plots")
    assert set(drawn) == {"fork"}  # the newest fork; nothing to draw / unreadable: skipped
    assert bp.load(d / "fork-2026-12-02T1423.json").samples_ms == {}
    w, h = png_size(drawn["fork"])
    assert h < 2 * 3.6 * 90 + 10  # the newest run has one series and no ratio: one panel
    with pytest.raises(bp.ResultError, match="nothing numeric|no series"):
        bp.plot(bp.load(d / "empty-2026-12-02T1000.json"), tmp_path / "e.png")
    with pytest.raises(bp.ResultError, match="garbage"):
        bp.load(d / "garbage-2026-12-02T1000.json")
    with pytest.raises(bp.ResultError, match="not a saved result"):
        bp.load(d / "README.json")
    with pytest.raises(bp.ResultError, match="no such directory"):
        bp.redraw_all(tmp_path / "missing", tmp_path / "plots")


def test_every_bench_command_has_plot_and_save_and_bench_plot_redraws(tmp_path: Path) -> None:
    from rollbox.cli import app, bench_app

    runner = CliRunner()
    names = [c.name for c in bench_app.registered_commands if c.name != "plot"]
    assert "container" in names and "fork" in names
    for name in names:
        out = runner.invoke(app, ["bench", name, "--help"], terminal_width=200).output
        assert "--plot" in out and "--save" in out, name
    d = tmp_path / "r"
    d.mkdir()
    (d / "ports-2026-12-02T0756.json").write_text(json.dumps(
        {"direct_p50_ms": 1.0, "port_proxy_p50_ms": 1.5, "port_proxy_rps_ratio": 0.9}))
    r = runner.invoke(app, ["bench", "plot", "--results", str(d), "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    assert png_size(tmp_path / "p" / "ports.png")[0] > 400
    r = runner.invoke(app, ["bench", "plot", "--results", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such directory" in r.output


def test_bench_command_records_saves_and_plots_a_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    from rollbox import cli

    group = typer.Typer()

    @cli.bench_command("tiny", group)
    def tiny(json_out: bool = typer.Option(False, "--json")) -> None:
        bk.latency_ms([0.001, 0.002, 0.004], "op_")
        bk.emit({"op_per_s_c1": 10.0, "op_per_s_c8": 60.0, "ratio_vs_peer": 2.0}, json_out)

    @cli.bench_command("silent", group)
    def silent() -> None:
        pass

    monkeypatch.setattr(bk, "RESULTS_DIR", str(tmp_path.relative_to("/") / "res"))
    monkeypatch.setattr("rollbox.config.REPO_ROOT", Path("/"))
    runner = CliRunner()
    png = tmp_path / "tiny.png"
    r = runner.invoke(group, ["tiny", "--json", "--save", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["op_per_s_c8"] == 60.0
    (saved,) = (tmp_path / "res").glob("tiny-*.json")
    doc = json.loads(saved.read_text())
    assert doc["samples_ms"] == {"op": [1.0, 2.0, 4.0]} and doc["result"]["ratio_vs_peer"] == 2
    assert png_size(png)[0] > 400
    r = runner.invoke(group, ["silent", "--plot", str(tmp_path / "s.png")])
    assert r.exit_code == 1 and "emitted no result" in r.output
    assert not (tmp_path / "s.png").exists()


def test_a_lone_ratio_is_drawn_with_the_figures_it_comes_from(tmp_path: Path) -> None:
    """A result whose only peer figure is a ratio gets a panel of its figures by unit (those no
    other panel draws; a unit with one figure is a setting, not drawn)."""
    flat = bp.flatten({"lazy_s": 0.44, "local_s": 0.25, "ratio": 1.75, "latency_ms": 2.0,
                       "write_mib_s": 440.0, "read_mib_s": 1729.0, "speedup_4": 1.6,
                       "cycles_per_s_c1": 3.0, "cycles_per_s_c8": 9.0})
    assert bp.ratios(flat) == {"ratio": 1.75, "speedup_4": 1.6}
    figs = bp.figures(flat, [], ["per second"])
    assert figs == {"s": {"lazy_s": 0.44, "local_s": 0.25},
                    "MiB/s": {"read_mib_s": 1729.0, "write_mib_s": 440.0}}
    assert bp.figure_unit("full_pull_s_4") == "s" and bp.figure_unit("image") is None
    assert bp.flatten({"samples": [{"pss_mib": 81.2}, {"pss_mib": 80.0}], "xs": [1, 2]}) == {
        "samples_0_pss_mib": 81.2, "samples_1_pss_mib": 80.0}  # rows by index; numbers not
    assert bp.figure_unit("calls_per_own_cpu_s_c8") == "per second"
    assert bp.figure_unit("create_exec_destroy_per_s_c8") == "per second"
    assert bp.figure_unit("idle_create_per_s") == "per second"
    assert bp.figure_unit("idle_server_fds_per_sandbox") is None  # per sandbox, not per second
    assert bp.figure_unit("idle_delete_s") == "s"
    assert bp.figure_unit("platform_cpu_s_per_episode") == "s"
    d = tmp_path / "r"
    d.mkdir()
    (d / "lazy-20261203T0649.json").write_text(json.dumps(
        {"lazy_s": 0.44, "local_s": 0.25, "ratio": 1.75}))
    _, h = png_size(bp.redraw_all(d, tmp_path / "plots")["lazy"])
    assert h > 2 * 3.6 * 90 - 10  # the ratio and the figures: two panels
    # With raw samples the CDFs stand for the percentiles, not for other times (CPU per step).
    run = bp.from_document({"result": {"exec_p50_ms": 2.0, "exec_p99_ms": 4.0,
                                       "steps_create_server_ms": 7.0, "steps_exec_server_ms": 2.0},
                            "samples_ms": {"exec": [1.0, 2.0, 4.0]}}, d / "x.json", "cpu", "x")
    _, h = png_size(bp.plot(run, tmp_path / "cpu.png"))
    assert h > 2 * 3.6 * 90 - 10  # the CDF and the steps' figures
