"""Settings: every ROLLBOX_* variable declared once (rollbox.config), read when a Settings is
made, shown with its source by ``rollbox config``, listed in docs/settings.md."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollbox import config_cli
from rollbox.config import GROUPS, REPO_ROOT, VARS, Settings, SettingError, describe

DOC = REPO_ROOT / "docs" / "settings.md"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ROLLBOX_* variable set: every setting at its default."""
    for name in list(os.environ):
        if name.startswith("ROLLBOX_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_the_settings_page_is_generated_from_the_declarations() -> None:
    assert DOC.read_text() == config_cli.markdown(), (
        "docs/settings.md is stale: rollbox config --markdown > docs/settings.md")


def test_every_field_is_a_setting_declared_group_by_group() -> None:
    assert list(VARS) == list(Settings.__dataclass_fields__)
    envs = [v.env for v in VARS.values()]
    assert len(set(envs)) == len(envs) and all(e.startswith("ROLLBOX_") for e in envs)
    order = [v.group for v in VARS.values()]
    runs = [g for i, g in enumerate(order) if i == 0 or order[i - 1] != g]
    assert runs == [g for g in GROUPS if g in order], "fields of one group are declared together"
    assert all(v.doc.strip() for v in VARS.values())


def test_unset_and_blank_leave_the_default(clean_env: pytest.MonkeyPatch) -> None:
    defaults = Settings()
    clean_env.setenv("ROLLBOX_UID_SLOTS", "  ")
    clean_env.setenv("ROLLBOX_IMAGES", "")
    clean_env.setenv("ROLLBOX_PYPI_FILE_UPSTREAMS", " ")
    s = Settings()
    assert (s.uid_slots, s.images_root) == (8192, None)
    assert s.pypi_mirror_file_upstreams == defaults.pypi_mirror_file_upstreams
    assert s.images_dir == Path("/var/lib/rollbox/images")


def test_values_are_parsed_by_type(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("ROLLBOX_VM_KSM", "yes")
    clean_env.setenv("ROLLBOX_RUN_TMPFS", "0")
    clean_env.setenv("ROLLBOX_VM_TEMPLATES", "off")
    clean_env.setenv("ROLLBOX_MEMORY_RESERVE_MIB", "4096")
    clean_env.setenv("ROLLBOX_VM_BOOT_TIMEOUT", "2.5")
    clean_env.setenv("ROLLBOX_DISK_DEVICE", "/dev/vdb1")
    clean_env.setenv("ROLLBOX_MIRRORS", "npm=http://10.9.0.1:4873/, bad ,go=http://10.9.0.1:3000")
    clean_env.setenv("ROLLBOX_PLATFORM_PORTS", "9000, x,9001")
    clean_env.setenv("ROLLBOX_NET_POOL", "10.99.0.0/20")
    clean_env.setenv("ROLLBOX_NET_FORWARD", "1")
    s = Settings()
    assert s.platform_ports == (9000, 9001) and s.net_forward
    assert s.net_pool == ipaddress.IPv4Network("10.99.0.0/20")
    assert (s.vm_ksm, s.run_tmpfs, s.vm_templates) == (True, False, False)
    assert (s.memory_reserve_mib, s.vm_boot_timeout_s) == (4096, 2.5)
    assert s.disk_pool_device == Path("/dev/vdb1")
    assert s.mirrors == {"npm": "http://10.9.0.1:4873/", "go": "http://10.9.0.1:3000"}


@pytest.mark.parametrize(("name", "value"), [("ROLLBOX_VM_KSM", "maybe"),
                                             ("ROLLBOX_UID_SLOTS", "many"),
                                             ("ROLLBOX_CPU_OVERCOMMIT", "1,5"),
                                             ("ROLLBOX_NET_POOL", "10.213.0.1/16")])
def test_a_value_that_does_not_parse_names_its_variable(clean_env: pytest.MonkeyPatch,
                                                        name: str, value: str) -> None:
    clean_env.setenv(name, value)
    with pytest.raises(SettingError, match=f"^{name}="):
        Settings()


def test_settings_are_read_when_made_not_when_imported(clean_env: pytest.MonkeyPatch) -> None:
    assert Settings().node_id == "n0"
    clean_env.setenv("ROLLBOX_NODE", "n5")
    assert Settings().node_id == "n5"


def test_describe_names_each_source(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("ROLLBOX_NODE", "n9")
    clean_env.setenv("ROLLBOX_RUNTIME", "native")  # set, equal to the default: still the variable
    s = Settings.scratch(tmp_path)
    src = {e.name: e.source for e in describe(s)}
    assert src["node_id"] == "ROLLBOX_NODE" and src["runtime"] == "ROLLBOX_RUNTIME"
    assert src["data_dir"] == "program" and src["run_tmpfs"] == "program"
    assert src["cgroup_parent"] == "program"  # a scratch node's own
    assert src["uid_slots"] == "default"
    assert [e.name for e in describe(s)] == [e.name for e in describe(Settings())]
    assert len(src) == len(VARS)


def test_environ_gives_a_child_the_same_node(clean_env: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    s = Settings.scratch(tmp_path)
    s.uid_base, s.vm_templates, s.node_id = 65536 * 7, False, "t1"
    s.node_share, s.node_cpus = 0.25, 1.5
    env = s.environ()
    for k, v in env.items():
        clean_env.setenv(k, v)
    child = Settings()
    for name in ("data_dir", "run_dir", "run_tmpfs", "images_root", "uid_base", "vm_templates",
                 "node_id", "cgroup_parent", "net_pool", "net_host_range", "host_auto",
                 "host_dir", "node_share", "node_cpus", "node_memory_mib", "chunk_store",
                 "vm_disks_root"):
        assert getattr(child, name) == getattr(s, name), name
    assert s.vm_disks_root is not None  # scratch: the node's VM disks (the desktop)
    assert {e.name: e.source for e in describe(child)}["node_id"] == "ROLLBOX_NODE"


def _rollbox_config(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")}
    return subprocess.run([sys.executable, "-m", "rollbox.cli", "config", *args],
                          env={**base, "COLUMNS": "250", **env}, capture_output=True,
                          text=True, timeout=60)


def test_rollbox_config_json_gives_values_and_sources() -> None:
    p = _rollbox_config("--json", ROLLBOX_NODE="n42", ROLLBOX_VM_TB_MIB="128",
                        ROLLBOX_VM_KSM="1", ROLLBOX_IMAGES="")
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert list(rows) == [e.name for e in describe(Settings())]
    assert rows["node_id"] == {"name": "node_id", "group": "node", "variable": "ROLLBOX_NODE",
                               "value": "n42", "source": "ROLLBOX_NODE"}
    assert (rows["vm_tb_size_mib"]["value"], rows["vm_tb_size_mib"]["source"]) == \
        (128, "ROLLBOX_VM_TB_MIB")
    assert rows["vm_ksm"]["value"] is True
    assert (rows["images_root"]["value"], rows["images_root"]["source"]) == (None, "default")
    assert rows["cgroup_parent"]["source"] == "default"
    assert rows["pypi_mirror_file_upstreams"]["value"] == ["https://files.pythonhosted.org"]


def test_rollbox_config_never_prints_a_secret() -> None:
    for args in (("--json",), ()):
        p = _rollbox_config(*args, ROLLBOX_E2B_SECRET="s3cr3t-k3y")
        assert p.returncode == 0, p.stderr
        assert "s3cr3t" not in p.stdout and "***" in p.stdout
    rows = {r["name"]: r for r in json.loads(_rollbox_config("--json").stdout)}
    assert rows["e2b_secret"]["value"] is None


def test_rollbox_config_table_shows_group_variable_value_source() -> None:
    p = _rollbox_config(ROLLBOX_NODE="n42")
    assert p.returncode == 0, p.stderr
    rows = {cells[1]: cells for line in p.stdout.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) == 5}
    assert rows["node_id"] == ["", "node_id", "ROLLBOX_NODE", "n42", "ROLLBOX_NODE"]
    assert rows["data_dir"] == ["node", "data_dir", "ROLLBOX_DATA", "/var/lib/rollbox",
                                "default"]
    assert rows["disk_pool_device"][3:] == ["(unset)", "default"]
    for group in GROUPS:
        if any(v.group == group for v in VARS.values()):
            assert f"│ {group} " in p.stdout


def test_rollbox_config_refuses_a_bad_value() -> None:
    p = _rollbox_config(ROLLBOX_UID_SLOTS="lots")
    assert p.returncode == 2
    assert "ROLLBOX_UID_SLOTS='lots'" in p.stderr


def test_rollbox_config_markdown_is_the_page() -> None:
    p = _rollbox_config("--markdown", ROLLBOX_NODE="n42")
    assert p.returncode == 0, p.stderr
    assert p.stdout == DOC.read_text()


async def test_the_sdk_takes_its_defaults_from_the_client_environment(
        clean_env: pytest.MonkeyPatch) -> None:
    from rollbox.sdk import DEFAULT_URL, AsyncClient

    async with AsyncClient() as client:
        assert client.base_url == DEFAULT_URL and client._t.headers == {}
    clean_env.setenv("ROLLBOX_URL", "http://10.1.2.3:7000")
    clean_env.setenv("ROLLBOX_API_KEY", "rbx_k")
    async with AsyncClient() as client:
        assert client.base_url == "http://10.1.2.3:7000" and client._t.headers == {"Authorization": "Bearer rbx_k"}
    async with AsyncClient("http://h:1", "other") as client:
        assert client.base_url == "http://h:1" and client._t.headers == {"Authorization": "Bearer other"}


def test_a_server_child_gets_the_settings_and_variables_it_is_given(
        clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rollbox.embedded import ServerProcess

    own = ServerProcess(env={"ROLLBOX_VM_TB_MIB": "512"})
    scratch = ServerProcess(Settings.scratch(tmp_path), env={"ROLLBOX_VM_TB_MIB": "256"})
    plain = ServerProcess()
    try:
        assert own.own_node and own.env is not None and own.env["ROLLBOX_VM_TB_MIB"] == "512"
        assert "ROLLBOX_DATA" not in own.env
        assert not scratch.own_node and scratch.env is not None
        assert scratch.env["ROLLBOX_DATA"] == str(tmp_path / "data")
        assert scratch.env["ROLLBOX_VM_TB_MIB"] == "256"
        assert plain.own_node and plain.env is None  # inherits this process's environment
    finally:
        for srv in (own, scratch, plain):
            srv.log.unlink(missing_ok=True)


# ROLLBOX_ names the docs may use that are no node setting: the SDK's client defaults, what a
# sandbox's own environment carries, and docs/mirrors.md's not-implemented allow list.
NOT_SETTINGS = {"ROLLBOX_URL", "ROLLBOX_API_KEY", "ROLLBOX_LANDLOCK_DENY", "ROLLBOX_DEBIAN_MIRROR",
                "ROLLBOX_PYPI_MIRROR_ALLOW"}


def test_the_docs_name_only_declared_variables() -> None:
    declared = {v.env for v in VARS.values()}
    named = {}
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]:
        for name in re.findall(r"ROLLBOX_[A-Z0-9_]*[A-Z0-9]", doc.read_text()):
            named.setdefault(name, doc.relative_to(REPO_ROOT).as_posix())
    unknown = {n: where for n, where in named.items() if n not in declared | NOT_SETTINGS}
    assert not unknown, f"no such setting (rollbox.config): {unknown}"
