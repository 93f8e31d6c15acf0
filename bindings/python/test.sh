#!/usr/bin/env bash
# Builds the mlxcel wheel, installs it into bindings/python/.venv together
# with its pinned MLX wheel (mlx-cpu from PyPI), and runs the pytest suite.
# Idempotent: re-runs reuse the venv and cargo's artifacts
# (target/blas-bundled, see .cargo/config.toml). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"

python=${PYTHON:-python3}
venv=.venv
if ! "$venv/bin/python" -c 'import sys; assert sys.version_info >= (3, 10)' 2>/dev/null; then
  rm -rf "$venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install "maturin==1.16.0" "pytest==9.2.0" "numpy==2.4.6"

# Release build without a link to Debian's OpenBLAS (MLXCEL_BLAS=bundled via
# .cargo/config.toml, since cargo runs from this folder); __init__.py
# preloads OpenBLAS at import when the system has it.
rm -rf dist
"$venv/bin/maturin" build --release --quiet -o dist --interpreter "$venv/bin/python"
wheel=$(ls dist/mlxcel-*.whl)
# Same version on every build: uninstall first so the new wheel goes in;
# installing resolves mlx-cpu==0.32.4 (from PyPI the first time).
"${pip[@]}" uninstall -y mlxcel >/dev/null 2>&1 || true
"${pip[@]}" install "$wheel"

# From tests/, so `import mlxcel` finds the installed package, not a source tree.
cd tests
exec "../$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
