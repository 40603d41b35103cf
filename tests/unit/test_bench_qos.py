"""bench/qos.py's probe, run here as the sandbox runs it: a fixed unit repeated, one wall time
per unit, and the load command's shape (4 busy loops per core it is given)."""
from __future__ import annotations

import json
import subprocess
import sys

from rollbox.benchkit import load_bench


def test_probe_times_each_unit() -> None:
    mod = load_bench("qos")
    r = subprocess.run([sys.executable, "-c", mod.PROBE, "2000", "40", "0.0005"],
                       capture_output=True, text=True, timeout=60, check=True)
    units = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(units) == 40 and all(isinstance(x, int) and x > 0 for x in units)
    # twice the work takes longer: the unit is the loop, not the clock's overhead
    r2 = subprocess.run([sys.executable, "-c", mod.PROBE, "200000", "40", "0.0005"],
                        capture_output=True, text=True, timeout=60, check=True)
    big = json.loads(r2.stdout.strip().splitlines()[-1])
    assert sorted(big)[20] > 10 * sorted(units)[20]


def test_load_is_four_busy_loops_per_core() -> None:
    mod = load_bench("qos")
    assert mod.THREADS_PER_CORE >= 4
    assert mod.BUSY.count("while :; do :; done") == 1 and mod.BUSY.endswith("wait")
    assert f"for i in {' '.join(str(i) for i in range(mod.THREADS_PER_CORE))};" in mod.BUSY
