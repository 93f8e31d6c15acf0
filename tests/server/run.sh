#!/usr/bin/env bash
# Runs the official openai Python SDK (tests/server/test_openai_sdk.py)
# against a freshly started `mlxcel serve` with an API key. The venv lives in
# ${MLXCEL_CACHE_DIR:-~/.cache/mlxcel}/venvs/server. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."

bin="${MLXCEL_BIN:-target/release/mlxcel}"
[[ -x "$bin" ]] || { echo "error: $bin not found; build it first (cargo build --release -p mlxcel)" >&2; exit 1; }
venv="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/venvs/server"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -c 'import openai, pytest' 2>/dev/null || "$venv/bin/pip" install --quiet --disable-pip-version-check 'openai==2.*' 'pytest==9.2.0'

log=$(mktemp)
LLAMA_API_KEY=sk-test "$bin" serve --port 0 --host 127.0.0.1 -np 4 -c 8192 --alias smol --embedding-model all-MiniLM-L6-v2 --whisper-model whisper-tiny.en >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do
  url=$(grep -o 'http://127.0.0.1:[0-9]*' "$log" | head -1 || true)
  [[ -n $url ]] && curl -sf "$url/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.2
done
[[ -n ${url:-} ]] || { echo "error: the server did not come up" >&2; cat "$log" >&2; exit 1; }
MLXCEL_SERVER_URL=$url "$venv/bin/python" -m pytest -q tests/server/test_openai_sdk.py "$@" || { cat "$log" >&2; exit 1; }
