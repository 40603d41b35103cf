"""Project quotas at rest: set/replace/get, validation, and a restart keeps them."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollbox import errors
from rollbox.iam.quotas import SQLiteQuotas, check_quota
from rollbox.models import Quota


def test_set_get_replace_and_survive_reopen(tmp_path: Path) -> None:
    q = SQLiteQuotas(tmp_path / "quotas.db")
    try:
        assert q.get("team") == Quota()  # unlimited until set
        q.set("team", Quota(sandboxes=3, cpus=2.5, memory_mib=4096, layer_mib=100))
        assert q.get("team") == Quota(sandboxes=3, cpus=2.5, memory_mib=4096, layer_mib=100)
        q.set("team", Quota(sandboxes=1))  # a replace: the rest becomes unlimited
        assert q.get("team") == Quota(sandboxes=1)
        q.set("org/sub", Quota(layer_mib=0))
    finally:
        q.close()
    q = SQLiteQuotas(tmp_path / "quotas.db")
    try:
        assert q.get("team") == Quota(sandboxes=1)
        assert q.get("org/sub").layer_mib == 0
    finally:
        q.close()


def test_bad_quotas_are_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    q = SQLiteQuotas(tmp_path / "quotas.db")
    try:
        q.set("team", Quota(sandboxes=2))
        with pytest.raises(errors.BadRequest):
            q.set("team", Quota.model_construct(sandboxes=-1, cpus=None, memory_mib=None,
                                                layer_mib=None))
        with pytest.raises(errors.BadRequest):
            q.set("bad name!", Quota())
        assert q.get("team") == Quota(sandboxes=2)
    finally:
        q.close()
    with pytest.raises(Exception):  # the wire model refuses a negative limit itself
        Quota(cpus=-0.5)
    limits = {"sandboxes": 100, "cpus": 8.0, "memory_mib": 1024, "layer_mib": 10}
    check_quota(Quota(sandboxes=100, cpus=8, memory_mib=1024, layer_mib=10), limits)
    for bad in (Quota(sandboxes=101), Quota(cpus=8.5), Quota(memory_mib=1025),
                Quota(layer_mib=11)):
        with pytest.raises(errors.BadRequest) as exc:
            check_quota(bad, limits)
        assert "capacity" in exc.value.details
