#!/usr/bin/env bash
# E2B's own python-sdk tests (unmodified) against `rollbox serve`.
#
#   tools/e2b_upstream.sh [--all] [PYTEST ARGS...]
#
# What it does: checks out packages/python-sdk/tests of E2B's repository at E2B_REF into a
# scratch dir, starts `python -m rollbox.cli serve` on a free port as a throw-away node (its
# own data, run dir, cgroup parent, uid band and subnet; the host's built images, read-only),
# makes an E2B-form key of project `e2b-upstream` (`rollbox key create --local --format e2b`),
# points E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY at it and runs pytest on the core tests
# (lifecycle, list, connect, timeout, commands, files, watch, pty; --all: every test dir),
# deselecting the tests listed in tools/e2b_upstream_excluded.txt (docs/compat.md says why).
# The server and scratch dir are removed on exit, also on failure or ^C.
#
# Variables: E2B_REPO  a git dir or URL of e2b-dev/E2B (default: the mirror under /work/.mirror
#                      if present, else https://github.com/e2b-dev/E2B)
#            E2B_REF   commit or tag whose tests to run (default: the one docs/compat.md records)
#            PYTHON    interpreter with rollbox's deps and the pinned e2b (default: the venv's)
#            E2B_NO_EXCLUDE=1  run the excluded tests too (to see what they do today)
#            E2B_NEWER=1  also the newer test files of tools/e2b_upstream_newer.txt (path commit)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-/work/main/.venv/bin/python}
E2B_REF=${E2B_REF:-b8029973a}
if [[ -z "${E2B_REPO:-}" ]]; then
  if [[ -d /work/.mirror/e2b-dev+E2B/repo ]]; then E2B_REPO=/work/.mirror/e2b-dev+E2B/repo
  else E2B_REPO=https://github.com/e2b-dev/E2B; fi
fi
ALL=0
if [[ "${1:-}" == "--all" ]]; then ALL=1; shift; fi

WORK=$(mktemp -d /tmp/rollbox-e2bup-XXXXXX)
chmod 711 "$WORK"
SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    if [[ -n "${KEY:-}" ]]; then  # what a killed or failed test left: deleted, then the server
      PYTHONPATH="$ROOT/src" "$PYTHON" -c 'import sys, rollbox
c = rollbox.Client(sys.argv[1], api_key=sys.argv[2])
for sb in c.list():
    sb.delete()
c.close()' "$URL" "$KEY" || true
    fi
    kill -INT "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

# -- the tests, unmodified --
if [[ -d "$E2B_REPO/objects" || -d "$E2B_REPO/.git" ]]; then
  git -C "$E2B_REPO" archive "$E2B_REF" packages/python-sdk/tests packages/python-sdk/pytest.ini \
    | tar -x -C "$WORK"
else
  git clone -q --filter=blob:none --no-checkout "$E2B_REPO" "$WORK/src"
  git -C "$WORK/src" archive "$E2B_REF" packages/python-sdk/tests packages/python-sdk/pytest.ini \
    | tar -x -C "$WORK"
fi
SDK="$WORK/packages/python-sdk"
# E2B_NEWER=1: add the newer test files tools/e2b_upstream_newer.txt names (path commit), each
# as that commit has it, from the same repository; they run with the core set.
NEWER=()
if [[ "${E2B_NEWER:-0}" == 1 ]]; then
  GITDIR="$E2B_REPO"; [[ -d "$E2B_REPO/objects" || -d "$E2B_REPO/.git" ]] || GITDIR="$WORK/src"
  while read -r path commit; do
    [[ -z "$path" || "$path" == \#* ]] && continue
    if [[ ! -d "$GITDIR/objects" ]]; then GIT=(git -C "$GITDIR"); else GIT=(git --git-dir="$GITDIR"); fi
    "${GIT[@]}" cat-file -e "$commit^{commit}" 2>/dev/null || "${GIT[@]}" fetch -q origin "$commit"
    mkdir -p "$SDK/$(dirname "$path")"
    "${GIT[@]}" show "$commit:packages/python-sdk/$path" >"$SDK/$path"
    [[ "$path" == */test_*.py ]] && NEWER+=("$path")
  done <"$ROOT/tools/e2b_upstream_newer.txt"
fi

# -- a throw-away node served by `rollbox serve` --
eval "$(PYTHONPATH="$ROOT/src" "$PYTHON" - "$WORK/node" <<'EOF'
import shlex, socket, sys
from pathlib import Path
from rollbox.config import Settings
s = Settings.scratch(Path(sys.argv[1]))
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
env = {"ROLLBOX_DATA": s.data_dir, "ROLLBOX_RUN": s.run_dir, "ROLLBOX_RUN_TMPFS": "0",
       "ROLLBOX_IMAGES": s.images_root, "ROLLBOX_CGROUP": s.cgroup_parent,
       "ROLLBOX_UID_BASE": s.uid_base, "ROLLBOX_NET_POOL": s.net_pool,
       "ROLLBOX_HOST_AUTO": "1", "ROLLBOX_NODE": f"e2bup{port}", "PORT": port}
for k, v in env.items():
    print(f"export {k}={shlex.quote(str(v))}")
EOF
)"
export ROLLBOX_AGENT=${ROLLBOX_AGENT:-$ROOT/build/rollbox-agent}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -m rollbox.cli serve --port "$PORT" >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
URL="http://127.0.0.1:$PORT"
for _ in $(seq 300); do
  curl -fsS "$URL/v1/health" >/dev/null 2>&1 && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.log"; exit 1; }
  sleep 0.2
done
curl -fsS "$URL/v1/health" >/dev/null || { echo "server did not come up"; cat "$WORK/serve.log"; exit 1; }
KEY=$("$PYTHON" -m rollbox.cli key create --local --project e2b-upstream --format e2b)

export E2B_API_URL="$URL/e2b" E2B_SANDBOX_URL="$URL/e2b/envd" E2B_API_KEY="$KEY"
export E2B_DOMAIN=127.0.0.1 E2B_ACCESS_TOKEN=unused
unset ROLLBOX_DATA ROLLBOX_RUN ROLLBOX_CGROUP ROLLBOX_UID_BASE ROLLBOX_NET_POOL ROLLBOX_HOST_AUTO

CORE=(tests/sync/sandbox_sync/test_create.py tests/async/sandbox_async/test_create.py
      tests/sync/sandbox_sync/test_kill.py tests/async/sandbox_async/test_kill.py
      tests/sync/api_sync/test_sbx_info.py tests/async/api_async/test_sbx_info.py
      tests/sync/api_sync/test_sbx_kill.py tests/async/api_async/test_sbx_kill.py
      tests/sync/api_sync/test_sbx_list.py tests/async/api_async/test_sbx_list.py
      tests/sync/sandbox_sync/test_connect.py tests/async/sandbox_async/test_connect.py
      tests/sync/sandbox_sync/test_timeout.py tests/async/sandbox_async/test_timeout.py
      tests/sync/sandbox_sync/commands tests/async/sandbox_async/commands
      tests/sync/sandbox_sync/files tests/async/sandbox_async/files
      tests/sync/sandbox_sync/pty tests/async/sandbox_async/pty)
CORE+=("${NEWER[@]}")
if [[ $ALL == 1 ]]; then CORE=(tests); fi
DESELECT=()
if [[ "${E2B_NO_EXCLUDE:-0}" != 1 ]]; then
  while IFS= read -r line; do
    line=${line%%#*}; line=$(echo "$line" | xargs)
    [[ -n "$line" ]] && DESELECT+=(--deselect "$line")
  done <"$ROOT/tools/e2b_upstream_excluded.txt"
fi
cd "$SDK"
set +e
# -p no:cacheprovider: nothing written into the checkout; -o: the SDK's own pytest.ini.
"$PYTHON" -m pytest -p no:cacheprovider -q -rfE --timeout 120 "${DESELECT[@]}" "${CORE[@]}" "$@"
rc=$?
set -e
if [[ $rc != 0 && -n "${E2B_UPSTREAM_LOG:-}" ]]; then cp "$WORK/serve.log" "$E2B_UPSTREAM_LOG"; fi
exit $rc
