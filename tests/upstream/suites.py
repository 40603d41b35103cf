"""Runs the upstream test suites of SWE-ReX and SandboxFusion, unmodified but for the rewrites
listed here, against a rollbox server (``rollbox serve``), and reports what passed.

Owns: fetching each suite at its pinned ref, the overlay that replaces the upstream fixtures
(``swerex_conftest.py``; ``sandboxfusion_shim/``), the list of rewrites and exclusions with their
reasons (docs/compat.md prints them), running pytest on the suite in a child process and reading
its JUnit XML. Must not touch rollbox itself: it talks to a server only over HTTP, through the
pinned clients. The marked tier ``-m upstream`` (tests/upstream/test_upstream.py) runs it on a
scratch ``rollbox serve``; by hand against any server::

    python -m tests.upstream.suites swerex --url http://127.0.0.1:7420 --key KEY [--src DIR]

``--src``: a git checkout or bare repository of the project (default: clone from GitHub).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    repo: str  # GitHub owner/name
    ref: str  # tag or commit the results were recorded at
    client: str  # the pinned client in requirements.lock
    files: tuple[str, ...]  # test files run against rollbox
    # Test files of the project not run, with why (none is about rollbox's front door).
    skipped_files: dict[str, str]
    # (file, old, new): mechanical rewrites of how a test reaches its server; each must apply.
    rewrites: tuple[tuple[str, str, str], ...]
    # Test ids (file::name) excluded from the pass count, with why.
    excluded: dict[str, str]
    # How many tests pass against rollbox (the tier checks it, so a test that stops being
    # collected is noticed).
    expected_passed: int
    pytest_args: tuple[str, ...] = ()  # options the suite needs (e.g. to drop its addopts)


SWEREX = Suite(
    name="swerex", repo="SWE-agent/SWE-ReX", ref="v1.4.0", client="swe-rex==1.4.0",
    files=("tests/test_execution.py", "tests/test_server.py", "tests/test_remote_deployment.py"),
    skipped_files={
        "tests/test_runtime.py": "unit tests of swerex.runtime.local's command splitter (no server)",
        "tests/test_local_runtime.py": "SWE-ReX's LocalRuntime on the test host (no server)",
        "tests/test_local_deployment.py": "SWE-ReX's LocalDeployment on the test host (no server)",
        "tests/test_dummy_deployment.py": "SWE-ReX's DummyDeployment (no server)",
        "tests/test_get_deployment.py": "constructs SWE-ReX's deployment classes (no server)",
        "tests/test_docker_deployment.py": "starts Docker containers (needs Docker and the "
                                           "internet for images)",
        "tests/test_modal_deployment.py": "needs Modal credentials and the internet",
        "tests/test_fargate_deployment.py": "needs AWS credentials and the internet",
    },
    rewrites=(
        # The upstream server listens at the root of its own port; rollbox serves one runtime
        # per sandbox under /swerex/{id} (the client joins endpoint names onto that host).
        ("tests/test_server.py", 'f"http://127.0.0.1:{remote_server.port}', 'f"{remote_server.url}'),
        ("tests/test_remote_deployment.py", "RemoteDeployment(port=port,",
         "RemoteDeployment(host=remote_server.url,"),
    ),
    excluded={},
    expected_passed=53,
)

SANDBOXFUSION = Suite(
    name="sandboxfusion", repo="bytedance/SandboxFusion",
    # No release tags: the commit the results were recorded at (main, 2026-07-14).
    ref="469de0845cb7d665bc68044d541aa3aa28c5b30a", client="sandbox-fusion==0.3.7",
    files=tuple(f"sandbox/tests/runners/test_{lang}.py"
                for lang in ("python", "cpp", "nodejs", "bash")),
    skipped_files={
        "sandbox/tests/runners/test_{go,java,rust,typescript}.py": "on the optional image: "
        "SANDBOXFUSION_POLYGLOT",
        "sandbox/tests/runners/test_<other language>.py": "languages rollbox's fncall pools "
        "do not run (csharp, cuda, d, julia, kotlin, lean, lua, perl, php, r, racket, ruby, "
        "scala, swift, verilog)",
        "sandbox/tests/runners/test_{pytest,jest,junit,go_test,jupyter,python_gpu}.py":
            "run modes and endpoints rollbox does not serve (test runners, /run_jupyter, GPUs)",
        "sandbox/tests/runners/test_isolation.py": "SandboxFusion's own network isolation "
        "(servers on ports inside one run); rollbox's isolation has its own tests",
        "sandbox/tests/datasets/": "SandboxFusion's dataset endpoints (/submit, "
        "/get_prompts), not served by rollbox",
    },
    rewrites=(),
    excluded={
        "sandbox/tests/runners/test_nodejs.py::test_nodejs_lodash_dep":
            "requires the npm package lodash, which SandboxFusion's image installs and "
            "rollbox's fncall:1 image does not (rollbox installs no npm packages)",
    },
    expected_passed=24,
    # Its addopts ask for pytest-cov, which measures SandboxFusion's server (not run here).
    pytest_args=("-o", "addopts="),
)

# The languages of the optional image fncall-polyglot:1 (`rollbox image ensure-polyglot`).
SANDBOXFUSION_POLYGLOT = dataclasses.replace(
    SANDBOXFUSION, name="sandboxfusion-polyglot",
    files=tuple(f"sandbox/tests/runners/test_{lang}.py"
                for lang in ("go", "java", "rust", "typescript")),
    skipped_files={},
    excluded={
        "sandbox/tests/runners/test_java.py::test_java_external_jar":
            "imports org.javatuples, a jar SandboxFusion ships in its runtime; Debian does "
            "not package it and rollbox installs no jars",
        "sandbox/tests/runners/test_go.py::test_golang_timeout":
            "a 1 s wall-clock compile budget (compile_timeout=1): `go build` of a hello world "
            "took 1.3-2.0 s on the 2-core test host at load 15-24, so the build times out "
            "before the run's timeout can be seen",
        "sandbox/tests/runners/test_rust.py::test_rust_timeout":
            "a 1 s wall-clock compile budget (compile_timeout=1): `rustc` of a hello world "
            "took 1.5-2.7 s on the 2-core test host at load 15-24 (as for Go)",
    },
    expected_passed=18,
)

SUITES = {s.name: s for s in (SWEREX, SANDBOXFUSION, SANDBOXFUSION_POLYGLOT)}
HOST_LESS = Path("/usr/bin/less")


@dataclasses.dataclass
class Outcome:
    suite: str
    ref: str
    passed: list[str]
    failed: dict[str, str]  # id -> first line of the failure
    skipped: dict[str, str]
    xfailed: list[str]
    excluded: dict[str, str]

    def summary(self) -> dict:
        return {"suite": self.suite, "ref": self.ref, "passed": len(self.passed),
                "failed": len(self.failed), "skipped": len(self.skipped),
                "xfailed": len(self.xfailed), "excluded": len(self.excluded),
                "failures": self.failed}


def fetch(suite: Suite, dest: Path, src: str | None = None) -> Path:
    """The suite's tree at ``suite.ref`` in ``dest``: from ``src`` (a git checkout or bare
    repository) or a shallow clone from GitHub."""
    dest.mkdir(parents=True, exist_ok=True)
    if src is None:  # a tag or a commit id: fetch just that
        for cmd in (["init", "-q"],
                    ["fetch", "-q", "--depth", "1", f"https://github.com/{suite.repo}", suite.ref],
                    ["checkout", "-q", "FETCH_HEAD"]):
            subprocess.run(["git", "-C", str(dest), *cmd], check=True)
        return dest
    archive = subprocess.run(["git", "-C", src, "archive", suite.ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def prepare(suite: Suite, tree: Path) -> None:
    """Install the overlay and apply the rewrites (each must match exactly once)."""
    if suite.name == "swerex":
        shutil.copy(HERE / "swerex_conftest.py", tree / "tests" / "conftest.py")
    if suite.name.startswith("sandboxfusion"):
        # Of the server package only its tests and its models (runners/types.py) stay; the
        # rest of the package is the shim.
        tests, types = tree / "sandbox" / "tests", tree / "sandbox" / "runners" / "types.py"
        keep = tree.parent / "sandbox-keep"
        keep.mkdir()
        tests.rename(keep / "tests")
        types.rename(keep / "types.py")
        shutil.rmtree(tree / "sandbox")
        shutil.copytree(HERE / "sandboxfusion_shim" / "sandbox", tree / "sandbox",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (keep / "tests").rename(tests)
        (keep / "types.py").rename(types)
        keep.rmdir()
        shutil.copy(HERE / "sandboxfusion_conftest.py", tests / "conftest.py")
    for rel, old, new in suite.rewrites:
        path = tree / rel
        text = path.read_text()
        if old not in text:
            raise RuntimeError(f"rewrite of {rel} no longer applies: {old!r}")
        path.write_text(text.replace(old, new))


def _case_id(case: ET.Element) -> str:
    cls = case.get("classname", "")
    file = cls.replace(".", "/") + ".py"
    return f"{file}::{case.get('name')}"


def parse(junit: Path, suite: Suite) -> Outcome:
    out = Outcome(suite.name, suite.ref, [], {}, {}, [], {})
    for case in ET.parse(junit).getroot().iter("testcase"):
        cid = _case_id(case)
        if cid in suite.excluded:
            out.excluded[cid] = suite.excluded[cid]
            continue
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out.failed[cid] = (bad.get("message") or "").splitlines()[0][:300] if bad.get(
                "message") else "failed"
        elif skip is not None:
            if skip.get("type") == "pytest.xfail":
                out.xfailed.append(cid)
            else:
                out.skipped[cid] = (skip.get("message") or "")[:300]
        else:
            out.passed.append(cid)
    return out


def run(suite: Suite, url: str, key: str, env: dict[str, str], src: str | None = None,
        workdir: Path | None = None, pytest_args: tuple[str, ...] = ()) -> Outcome:
    """Fetch, prepare and run ``suite`` against the server at ``url`` (``env``: what the
    overlay needs besides ROLLBOX_URL/ROLLBOX_API_KEY, e.g. UPSTREAM_SANDBOX)."""
    own = workdir is None
    work = workdir or Path(tempfile.mkdtemp(prefix=f"upstream-{suite.name}-"))
    try:
        tree = fetch(suite, work / "src", src)
        prepare(suite, tree)
        junit = work / "junit.xml"
        child_env = {**os.environ, "ROLLBOX_URL": url, "ROLLBOX_API_KEY": key, **env}
        child_env.pop("PYTEST_ADDOPTS", None)
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
             f"--junitxml={junit}", "-o", "junit_family=xunit1", "--timeout=120",
             *suite.pytest_args, *suite.files, *pytest_args],
            cwd=tree, env={**child_env, "PYTHONPATH": os.pathsep.join(
                [str(tree), child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)},
            check=False)
        return parse(junit, suite)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--url", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--src", help="git checkout or bare repository of the project")
    ap.add_argument("--sandbox", help="SWE-ReX: an existing sandbox (default: one is created)")
    ap.add_argument("--image", default="python:3.11")
    args = ap.parse_args(argv)
    suite = SUITES[args.suite]
    with suite_env(suite, args.url, args.key, args.image, args.sandbox) as env:
        outcome = run(suite, args.url, args.key, env, args.src)
    print(json.dumps(outcome.summary()))
    return 0 if not outcome.failed else 1


class suite_env:  # noqa: N801 - a context manager used like a function
    """What the suite's overlay needs: for SWE-ReX a sandbox (created here, deleted on exit
    unless given), set up like the upstream CI host (``python`` on PATH, ``less``)."""

    def __init__(self, suite: Suite, url: str, key: str, image: str = "python:3.11",
                 sandbox: str | None = None) -> None:
        self.suite, self.url, self.key, self.image, self.sandbox = suite, url, key, image, sandbox
        self._made = None

    def __enter__(self) -> dict[str, str]:
        if self.suite.name != "swerex":
            return {}
        import rollbox

        self._client = rollbox.Client(self.url, self.key)
        if self.sandbox is None:
            self._made = self._client.create(self.image, ttl_s=1800)
            self.sandbox = self._made.id
            # The upstream CI host (GitHub's ubuntu-latest) has `python` on PATH, and `less`
            # (test_interrupt_pager pages with it): rollbox's python:3.11 is Debian bookworm
            # without it, so the test host's own (Debian's, needing only libtinfo6 and libc,
            # which the image has) goes in.
            self._made.exec("command -v python || ln -s \"$(command -v python3)\" "
                            "/usr/local/bin/python", check=True)
            if self._made.exec("command -v less").exit_code != 0:
                self._made.files.write("/usr/local/bin/less", HOST_LESS.read_bytes(), 0o755)
                self._made.exec("less --version", check=True)
        return {"UPSTREAM_SANDBOX": self.sandbox}

    def __exit__(self, *exc: object) -> None:
        if self.suite.name != "swerex":
            return
        try:
            if self._made is not None:
                self._made.delete()
        finally:
            self._client.close()


if __name__ == "__main__":
    sys.exit(main())
