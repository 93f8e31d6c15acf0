#!/usr/bin/env bash
# Runs the headless-browser test of the bundled chat page (tests/ui/test_ui.py)
# against a freshly started `mlxcel serve`. Extra arguments go to `mlxcel serve`
# (e.g. -m <model>). Env: MLXCEL_BIN (default target/release/mlxcel),
# MLXCEL_CACHE_DIR (venv location), MLXCEL_UI_SCREENSHOT (default target/web-ui.png),
# MLXCEL_UI_READY_TIMEOUT (seconds to wait for the model, default 60).
set -euo pipefail
cd "$(dirname "$0")/../.."

if [[ ! -x /usr/bin/chromium ]]; then
  if [[ "${CI:-}" == "true" ]]; then
    echo "error: /usr/bin/chromium is required in CI (apt-get install chromium chromium-driver)" >&2
    exit 1
  fi
  echo "skipping the web UI test: /usr/bin/chromium is not installed (apt-get install chromium chromium-driver)"
  exit 0
fi
[[ -x /usr/bin/chromedriver ]] || { echo "error: /usr/bin/chromedriver is missing (apt-get install chromium-driver)" >&2; exit 1; }

bin="${MLXCEL_BIN:-target/release/mlxcel}"
[[ -x "$bin" ]] || { echo "error: $bin not found; build it first (cargo build --release -p mlxcel)" >&2; exit 1; }

venv="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/venvs/ui"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -c 'import selenium' 2>/dev/null || "$venv/bin/pip" install --quiet 'selenium==4.*'

log=$(mktemp)
server_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$server_pid" ]]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  if (( rc != 0 )); then
    echo "--- mlxcel serve log ---" >&2
    cat "$log" >&2
  fi
  rm -f "$log"
  exit "$rc"
}
trap cleanup EXIT

"$bin" serve --port 0 --host 127.0.0.1 -np 2 -c 4096 "$@" > "$log" 2>&1 &
server_pid=$!

port=""
for _ in $(seq 600); do
  port=$(sed -nE 's#.*listening on http://127\.0\.0\.1:([0-9]+).*#\1#p' "$log" | head -n 1)
  [[ -n "$port" ]] && break
  kill -0 "$server_pid" 2>/dev/null || { echo "error: mlxcel serve exited before listening" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$port" ]] || { echo "error: mlxcel serve did not report its port within 60 s" >&2; exit 1; }

MLXCEL_UI_URL="http://127.0.0.1:$port" \
MLXCEL_UI_SCREENSHOT="${MLXCEL_UI_SCREENSHOT:-target/web-ui.png}" \
  "$venv/bin/python" tests/ui/test_ui.py
