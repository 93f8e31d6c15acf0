#!/usr/bin/env bash
# Create (idempotently) the reference virtualenv at tests/reference/.venv with
# the pinned mlx / mlx-lm versions from requirements.txt, then the packages of
# requirements-nodeps.txt with --no-deps (mlx-whisper, whose metadata asks for
# torch that it does not need at run time).
#
#   bash tests/reference/setup_venv.sh          # create or update
#   FORCE=1 bash tests/reference/setup_venv.sh  # rebuild from scratch
#
# pip's cache lives under ${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/pip so that
# CI re-runs don't re-download the wheels.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
REQ="$HERE/requirements.txt"
REQ_NODEPS="$HERE/requirements-nodeps.txt"
CACHE="${MLXCEL_CACHE_DIR:-$HOME/.cache/mlxcel}/pip"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.requirements.sha256"

mkdir -p "$CACHE"
if [[ "${FORCE:-0}" == "1" ]]; then rm -rf "$VENV"; fi

want="$(cat "$REQ" "$REQ_NODEPS" | sha256sum | cut -d' ' -f1)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_venv: $VENV is up to date"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
export PIP_CACHE_DIR="$CACHE"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -r "$REQ"
"$VENV/bin/python" -m pip install --quiet --no-deps -r "$REQ_NODEPS"
"$VENV/bin/python" - <<'PY'
import mlx.core as mx, mlx_lm, importlib.metadata as md
import faster_whisper, mlx_whisper
print("setup_venv: mlx", mx.__version__, "| mlx-lm", md.version("mlx-lm"),
      "| transformers", md.version("transformers"), "| numpy", md.version("numpy"),
      "| faster-whisper", md.version("faster-whisper"), "| ctranslate2", md.version("ctranslate2"),
      "| mlx-whisper", md.version("mlx-whisper"))
PY
echo "$want" > "$STAMP"
